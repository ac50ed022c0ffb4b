"""SMTP benchmark: one `cassmail serve` node on Cassandra against Postfix, both driven by postal.

Not a test. It measures the whole receive path (SMTP parsing, RCPT checks, the
store, Cassandra) the way the CassMail paper did, with Debian's `postal`, and
compares it with Postfix on the same machine in the same run:

    .venv/bin/python loadtest/bench_smtp.py --set store.cassandra.port=29042

What it does:

1. Installs the Debian packages `postal` and (with --postfix) `postfix` if they
   are missing. Postfix is installed with debconf's "No configuration", so the
   package sets up no system instance and starts nothing.
2. cassmail: a fresh `bench_smtp_<random>` keyspace (SimpleStrategy, RF=1),
   read and write consistency ONE, a fresh `bench-<random>.example` domain
   with --users users (created through the Store API, concurrently, with one
   cheap scrypt hash), a TOML config with only the MX listener (smtp) on a free
   127.0.0.1 port, `node.workers` from --workers and log level WARNING
   (INFO writes one line per delivery, and the benchmark would then measure
   logging as well), then `cassmail --config FILE serve`.
3. Postfix: a separate instance in a temporary directory (`postfix -c DIR`;
   /etc/postfix is never touched), listening on a free 127.0.0.1 port, with
   the same users as a virtual mailbox domain delivered to Maildirs under the
   same temporary directory, and DNS lookups, header/body checks and client
   restrictions off. The `postconf` commands it runs are printed.
4. For each size range: postal against cassmail, then against Postfix. postal
   prints one line per clock minute; the first (partial) minute is warm-up,
   the next --minutes lines are measured, then postal gets SIGINT (it stops
   sending but keeps running), the line of the following minute is read (it
   holds the messages that were still in flight) and postal gets SIGTERM.
   Every run has a hard deadline. CPU (utime+stime, and cutime+cstime of
   children already reaped, from /proc) is sampled at the start and end of the
   measured minutes for: the cassmail supervisor and its workers, the
   CassandraDaemon JVM listening on the configured port, postal, and the
   Postfix master and everything it forked; plus the whole machine from
   /proc/stat, so load from others shows up as "other".
5. After each run the delivered mail is counted: cassmail by listing INBOX of
   every user through the Store API, Postfix by counting Maildir files once its
   queue is empty; each count is compared with the messages postal reported.
6. A Markdown table, and per size range the ratio cassmail/Postfix of MB/s.
   Cleanup: cassmail and Postfix stopped, the keyspace dropped and the
   temporary directory removed (--keep keeps both).

Sizes are decimal (K = 10^3, M = 10^6) and converted to postal's KiB (-M/-m);
MB/s means 10^6 bytes per second, from postal's data(K) column (KiB).
Every process this starts is stopped at the end, also on SIGINT/SIGTERM; postal
and cassmail also get SIGTERM if this script dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cassmail import config
from cassmail.config import ConfigError, Settings
from cassmail.server import make_store
from cassmail.store.base import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import CassandraCpu, _listening_inodes, human, make_users, parse_ranges, positive  # noqa: E402

CASSMAIL = Path(sys.executable).parent / "cassmail"
POSTFIX_LIB = "/usr/lib/postfix/"
#: Postal's -r: messages per minute over all threads. Its default (24,000/min) is below what a
#: fast server takes at 50 KB-500 KB, so the cap is lifted.
POSTAL_RATE = 1_000_000
#: A run waits at most this long for Cassandra to calm down (flushes, compaction) first.
QUIET_MAX = 60.0
#: ... and calls it calm below this many cores.
QUIET_CORES = 0.25
#: Seconds the Postfix queue may take to empty after a run before its count is taken anyway.
QUEUE_DRAIN_MAX = 300.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="SMTP benchmark: cassmail (Cassandra, RF=1, CL=ONE) vs Postfix, driven by postal.",
    )
    p.add_argument("--config", metavar="FILE", help="cassmail TOML settings: which Cassandra (default: built-ins)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a setting, e.g. --set store.cassandra.port=29042 (repeatable)",
    )
    p.add_argument("--minutes", type=positive(int), default=3,
                   help="measured minutes per run, after postal's first (partial, warm-up) minute (default 3)")
    p.add_argument("--users", type=positive(int), default=700, help="recipients (default 700)")
    p.add_argument(
        "--sizes", type=parse_ranges, default=parse_ranges("200K-2M,50K-500K"),
        help="comma-separated message size ranges, uniform within each (default 200K-2M,50K-500K)",
    )
    # 32: on this 2-core machine postal -t 4 left both servers idle part of the time (cassmail 18.5 MB/s,
    # Postfix 29 MB/s at 50K-500K), -t 16 still held Postfix back (44 MB/s) and -t 32 saturated both
    # (cassmail 42 MB/s, Postfix 65 MB/s, the CPUs busy); -t 64 gained nothing more. Postfix needs
    # the most: its smtpd/cleanup/virtual processes wait on fsync.
    p.add_argument("--threads", type=positive(int), default=32,
                   help="postal threads, each one SMTP connection at a time (default 32: enough to keep "
                        "both servers busy on 2 cores)")
    p.add_argument("--connections", "--messages-per-connection", dest="per_connection", type=int, default=10,
                   metavar="N", help="postal -c: messages per connection, random 1..N (default 10; -1 = unlimited)")
    p.add_argument("--workers", type=int, default=0, help="cassmail worker processes (default 0 = one per core)")
    p.add_argument("--postfix", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the Postfix baseline (default on)")
    p.add_argument("--cassmail", action=argparse.BooleanOptionalAction, default=True,
                   help="run cassmail (default on; --no-cassmail runs only the Postfix baseline)")
    p.add_argument("--keep", action="store_true", help="keep the keyspace and the temporary directory")
    args = p.parse_args(argv)
    if args.per_connection == 0 or args.per_connection < -1:
        p.error("--connections must be >= 1 or -1")
    if args.workers < 0:
        p.error("--workers must be >= 0")
    if not args.cassmail and not args.postfix:
        p.error("nothing to run: both --no-cassmail and --no-postfix")
    return args


#: Settings the issue fixes for this benchmark; they win over --config and --set.
FIXED = {
    "store.backend": "cassandra",
    "store.cassandra.replication_strategy": "SimpleStrategy",
    "store.cassandra.replication_factor": "1",
    "store.cassandra.read_consistency": "ONE",
    "store.cassandra.write_consistency": "ONE",
}


def load_settings(args: argparse.Namespace) -> tuple[Settings, list[str]]:
    notes = []
    for item in args.overrides:
        key = item.split("=", 1)[0].strip()
        if key in FIXED or key == "store.cassandra.keyspace":
            notes.append(f"--set {key} ignored: this benchmark always uses a fresh keyspace, RF=1 and CL=ONE")
    fixed = [f"{k}={v}" for k, v in FIXED.items()]
    fixed.append(f"store.cassandra.keyspace=bench_smtp_{secrets.token_hex(5)}")
    return config.load(args.config, overrides=[*args.overrides, *fixed]), notes


# --------------------------------------------------------------------------- small helpers


def log(text: str = "") -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smtp_banner(port: int, timeout: float = 2.0) -> str | None:
    """The 220 greeting of a server on 127.0.0.1:port, or None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            data = sock.recv(512).decode("ascii", "replace")
            try:
                sock.sendall(b"QUIT\r\n")
                sock.recv(512)
            except OSError:
                pass
            return data.strip() if data.startswith("220") else None
    except OSError:
        return None


def die_with_us(cmd: list[str]) -> list[str]:
    """`cmd` run through util-linux setpriv so that it gets SIGTERM if this process dies
    (PR_SET_PDEATHSIG, which survives the exec), where setpriv exists. Start such children from the
    main thread: the signal follows the thread that forked them."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def to_toml(obj: Any, prefix: str = "") -> str:
    """Settings written back as a TOML file (as tests/nodes.py does)."""
    scalars, tables = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            tables.append(to_toml(value, f"{prefix}{f.name}."))
        else:
            scalars.append(f"{f.name} = {_toml(value)}")
    head = f"[{prefix[:-1]}]\n" if prefix else ""
    return head + "\n".join(scalars) + "\n\n" + "".join(tables)


def run_cmd(cmd: list[str], timeout: float = 120, check: bool = True, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


# --------------------------------------------------------------------------- packages


def ensure_packages(want_postfix: bool) -> None:
    """Install postal (and postfix) from Debian when missing; Postfix without a system instance."""
    missing = []
    if shutil.which("postal") is None and not Path("/usr/sbin/postal").exists():
        missing.append("postal")
    if want_postfix and not (Path("/usr/sbin/postfix").exists() and Path("/usr/sbin/postconf").exists()):
        missing.append("postfix")
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"missing Debian packages {' '.join(missing)}: install them (needs root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if "postfix" in missing:
        # "No configuration": the package writes no main.cf and starts no instance on port 25.
        subprocess.run(["debconf-set-selections"], input="postfix postfix/main_mailer_type select No configuration\n",
                       text=True, check=False, timeout=60)
    log(f"installing {' '.join(missing)} (apt-get install -y)")
    cmd = ["apt-get", "install", "-y", "-q", *missing]
    if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
        run_cmd(["apt-get", "update", "-q"], timeout=600, env=env)
        run_cmd(cmd, timeout=600, env=env)


# --------------------------------------------------------------------------- CPU accounting


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields:
                kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def tree_cpu(root: int | None, kids: dict[int, list[int]]) -> float | None:
    """CPU seconds of a process and all its descendants: for every live one utime+stime, plus
    cutime+cstime (its children that already exited and were reaped: Postfix's short-lived
    smtpd/cleanup/virtual processes end up in the master's). None if the root is gone."""
    if root is None or _stat(root) is None:
        return None
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        fields = _stat(pid)
        if fields is None:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14))
        todo.extend(kids.get(pid, ()))
    return total / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as fh:
        parts = [int(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


GROUPS = ("cassmail", "Cassandra", "postal", "Postfix")


@dataclass
class Sample:
    at: float
    cpu: dict[str, float | None]
    machine_busy: float


class CpuMeter:
    """Samples the CPU of the processes that take part in a run."""

    def __init__(self, cass: CassandraCpu) -> None:
        self.cass = cass
        self.cassmail_pid: int | None = None
        self.postfix_pid: int | None = None
        self.postal_pid: int | None = None

    def sample(self) -> Sample:
        kids = _children_map()
        cass = self.cass.sample() if self.cass.enabled else {}
        return Sample(
            time.monotonic(),
            {
                "cassmail": tree_cpu(self.cassmail_pid, kids),
                "Cassandra": sum(cass.values()) if cass else None,
                "postal": tree_cpu(self.postal_pid, kids),
                "Postfix": tree_cpu(self.postfix_pid, kids),
            },
            machine_cpu()[0],
        )

    @staticmethod
    def delta(a: Sample, b: Sample) -> tuple[dict[str, float | None], float, float]:
        """Per group CPU seconds between two samples, the wall seconds, and the machine's busy seconds."""
        out: dict[str, float | None] = {}
        for g in GROUPS:
            x, y = a.cpu.get(g), b.cpu.get(g)
            out[g] = None if x is None or y is None else max(0.0, y - x)
        return out, b.at - a.at, b.machine_busy - a.machine_busy


# --------------------------------------------------------------------------- cassmail


class Cassmail:
    """One `cassmail serve` process with only the MX listener."""

    def __init__(self, settings: Settings, workdir: Path, workers: int) -> None:
        s = dataclasses.replace(settings)
        s.node = dataclasses.replace(settings.node, name="bench-cassmail.localhost", workers=workers,
                                     log_level="WARNING")
        self.port = free_port()
        for name in ("smtp", "submission", "lmtp", "pop3", "imap"):
            listener = dataclasses.replace(getattr(settings, name))
            listener.enabled = name == "smtp"
            listener.listen = f"127.0.0.1:{self.port}" if name == "smtp" else "127.0.0.1:0"
            setattr(s, name, listener)
        self.settings = s
        self.workers = workers or os.cpu_count() or 1
        self.config = workdir / "cassmail.toml"
        self.config.write_text(to_toml(s))
        self.log_path = workdir / "cassmail.log"
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        cmd = [str(CASSMAIL), "--config", str(self.config), "serve"] if CASSMAIL.exists() else \
              [sys.executable, "-c", "import sys; from cassmail.cli import main; sys.exit(main())",
               "--config", str(self.config), "serve"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(die_with_us(cmd), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env)

    def wait_ready(self, timeout: float = 90) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"cassmail serve exited with {self.process.returncode}:\n{self.log_text()}")
            # Every worker binds its own listening socket (SO_REUSEPORT): wait for all of them.
            if len(_listening_inodes(self.port)) >= self.workers and smtp_banner(self.port):
                return
            time.sleep(0.2)
        raise RuntimeError(f"cassmail serve did not listen with {self.workers} workers in {timeout:g} s:\n"
                           f"{self.log_text()}")

    def stop(self, timeout: float = 30) -> str:
        p = self.process
        if p is None or p.poll() is not None:
            return "not running"
        p.send_signal(signal.SIGTERM)
        try:
            code = p.wait(timeout)
            return f"stopped (exit {code})"
        except subprocess.TimeoutExpired:
            for pid in _descendants(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
            p.wait(10)
            return f"killed after {timeout:g} s"

    def log_text(self, last: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-last:]
        except OSError:
            return ""


def _descendants(root: int) -> list[int]:
    kids = _children_map()
    out, todo = [], list(kids.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


async def count_cassmail(store: Store, users: list[str], concurrency: int = 32) -> tuple[int, int]:
    """(messages, bytes) in the INBOX of every user, listed through the Store API."""
    limit = asyncio.Semaphore(concurrency)
    totals = [0, 0]

    async def one(user: str) -> None:
        async with limit:
            async for summary in store.list_messages(user, "INBOX"):
                totals[0] += 1
                totals[1] += summary.size

    await asyncio.gather(*(one(u) for u in users))
    return totals[0], totals[1]


# --------------------------------------------------------------------------- Postfix


class Postfix:
    """A Postfix instance of its own (`postfix -c DIR`): /etc/postfix is never read or written."""

    def __init__(self, workdir: Path, domain: str, users: list[str]) -> None:
        self.dir = workdir / "postfix"
        self.queue = self.dir / "queue"
        self.mail = self.dir / "mail"
        self.port = free_port()
        self.domain = domain
        self.users = users
        self.changes: list[str] = []
        self.started = False

    def postconf(self, *args: str) -> None:
        cmd = ["postconf", "-c", str(self.dir), *args]
        run_cmd(cmd)
        head = [a for a in cmd if a.startswith("-") or a in ("postconf", str(self.dir))]
        self.changes.append(" ".join(head))
        self.changes += [f"    {a!r}" for a in cmd[len(head):]]

    def configure(self) -> None:
        for d in (self.dir, self.queue, self.dir / "data", self.mail):
            d.mkdir(parents=True, exist_ok=True)
        # virtual(8) delivers as nobody (a static uid), Postfix runs as the postfix user: both need
        # to get through the temporary directory.
        os.chmod(self.dir.parent, 0o755)
        os.chmod(self.dir, 0o755)
        os.chown(self.mail, 65534, 65534)
        pw = pwd.getpwnam("postfix")
        os.chown(self.dir / "data", pw.pw_uid, pw.pw_gid)  # master refuses to start otherwise
        shutil.copy("/etc/postfix/master.cf", self.dir / "master.cf")
        (self.dir / "main.cf").write_text("")
        (self.dir / "vmailbox").write_text(
            "".join(f"{u} {self.domain}/{u.split('@', 1)[0]}/\n" for u in self.users)  # trailing / = Maildir
        )
        self.postconf(
            "-e",
            "compatibility_level = 3.6",
            f"queue_directory = {self.queue}",
            f"data_directory = {self.dir / 'data'}",
            "myhostname = bench-postfix.localhost",
            "inet_interfaces = loopback-only",
            "inet_protocols = ipv4",
            "mynetworks = 127.0.0.0/8",
            "mydestination =",
            "relay_domains =",
            "relayhost =",
            "local_recipient_maps =",
            "alias_maps =",
            "alias_database =",
            f"virtual_mailbox_domains = {self.domain}",
            f"virtual_mailbox_maps = texthash:{self.dir / 'vmailbox'}",
            f"virtual_mailbox_base = {self.mail}",
            "virtual_uid_maps = static:65534",
            "virtual_gid_maps = static:65534",
            "virtual_mailbox_limit = 0",
            "message_size_limit = 67108864",
            "smtp_host_lookup = native",
            "disable_dns_lookups = yes",
            "smtpd_peername_lookup = no",
            "header_checks =",
            "body_checks =",
            "mime_header_checks =",
            "nested_header_checks =",
            "smtpd_client_restrictions =",
            "smtpd_helo_restrictions =",
            "smtpd_sender_restrictions =",
            "smtpd_relay_restrictions = permit_mynetworks, reject_unauth_destination",
            "smtpd_recipient_restrictions =",
            "smtpd_tls_security_level = none",
            "smtp_tls_security_level = none",
            "biff = no",
        )
        # master.cf: no smtpd on port 25, one on our port, no chroot (the queue is in a temp dir).
        self.postconf("-MX", "smtp/inet")
        self.postconf("-M", f"127.0.0.1:{self.port}/inet = 127.0.0.1:{self.port} inet n - n - - smtpd")
        self.postconf("-F", "*/*/chroot = n")
        run_cmd(["postfix", "-c", str(self.dir), "check"])

    def start(self, timeout: float = 60) -> None:
        try:
            run_cmd(["postfix", "-c", str(self.dir), "start"])
        except RuntimeError:
            # Postfix logs to syslog, which may not exist here: once more with a log file, to say why.
            run_cmd(["postconf", "-c", str(self.dir), "-e", f"maillog_file = {self.dir / 'maillog'}"])
            out = subprocess.run(["postfix", "-c", str(self.dir), "start"], capture_output=True, text=True,
                                 timeout=120)
            if out.returncode == 0:
                subprocess.run(["postfix", "-c", str(self.dir), "stop"], capture_output=True, timeout=60)
            raise RuntimeError(f"postfix -c {self.dir} start failed:\n{out.stdout}{out.stderr}") from None
        self.started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.master_pid() and smtp_banner(self.port):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Postfix did not answer on 127.0.0.1:{self.port} in {timeout:g} s")

    def master_pid(self) -> int | None:
        try:
            pid = int((self.queue / "pid" / "master.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _stat(pid) is not None else None

    def stop(self, timeout: float = 30) -> str:
        if not self.started:
            return "not started"
        master = self.master_pid()
        if master is None:
            return "not running"
        procs = [master, *_descendants(master)]
        subprocess.run(["postfix", "-c", str(self.dir), "stop"], capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(p) for p in procs):
            time.sleep(0.2)
        left = [p for p in procs if _alive(p)]
        if not left:
            self.started = False
            return "stopped"
        subprocess.run(["postfix", "-c", str(self.dir), "abort"], capture_output=True, timeout=60)
        time.sleep(1)
        for pid in left:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.started = False
        return f"aborted ({len(left)} processes did not stop in {timeout:g} s)"

    def queued(self) -> int:
        n = 0
        for sub in ("maildrop", "incoming", "active", "deferred", "hold"):
            for _, _, files in os.walk(self.queue / sub):
                n += len(files)
        return n

    def delivered(self) -> tuple[int, int]:
        """(messages, bytes) in the Maildirs (new/ and cur/)."""
        n = size = 0
        base = self.mail / self.domain
        if not base.is_dir():
            return 0, 0
        for user in os.scandir(base):
            for sub in ("new", "cur"):
                try:
                    for entry in os.scandir(os.path.join(user.path, sub)):
                        n += 1
                        size += entry.stat().st_size
                except FileNotFoundError:
                    continue
        return n, size

    def wait_queue_empty(self, limit: float = QUEUE_DRAIN_MAX) -> tuple[float, int]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            if self.queued() == 0:
                break
            time.sleep(0.5)
        return time.monotonic() - t0, self.queued()


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


# --------------------------------------------------------------------------- postal


@dataclass
class Minute:
    clock: str
    messages: int
    kib: int
    errors: int
    connections: int
    #: Times 4 GiB was added back to postal's data column (see parse_minute).
    wraps: int = 0

    @property
    def bytes(self) -> int:
        return self.kib * 1024 + self.wraps * WRAP

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / 60


#: postal counts a minute's bytes in a 32-bit counter: past 4 GiB a minute (71.6 MB/s) its data(K)
#: column starts again from 0. Seen here: Postfix at 200K-2M, 5,219 messages of ~1.1 MB (5.8 GB) in a
#: minute printed as 1.48 GB.
WRAP = 1 << 32
#: Bytes postal adds to each message body (its headers), measured with a counting SMTP sink.
POSTAL_HEADERS = 450


def parse_minute(line: str, mean_size: float = 0.0) -> Minute | None:
    """One of postal's per-minute lines: `HH:MM,messages,data(K),errors,connections,SSL connections`.

    With `mean_size` (the mean message size postal sends, in bytes) a data column that wrapped
    around at 4 GiB is corrected: the number of wraps is the one that brings the bytes closest to
    messages x mean_size (unambiguous while that estimate is off by less than 2 GiB)."""
    parts = line.strip().split(",")
    if len(parts) < 5 or ":" not in parts[0]:
        return None
    try:
        minute = Minute(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]))
    except ValueError:
        return None
    if mean_size > 0:
        minute.wraps = max(0, round((minute.messages * mean_size - minute.kib * 1024) / WRAP))
    return minute


@dataclass
class Run:
    server: str
    sizes: str
    load: float
    command: list[str] = field(default_factory=list)
    warmup: Minute | None = None
    minutes: list[Minute] = field(default_factory=list)
    tail: list[Minute] = field(default_factory=list)
    cpu: dict[str, float | None] = field(default_factory=dict)
    wall: float = 0.0
    machine: float = 0.0
    waited: float = 0.0
    delivered: int | None = None
    delivered_bytes: int | None = None
    in_window: int | None = None  # Postfix: Maildir deliveries during the measured minutes
    notes: list[str] = field(default_factory=list)
    stderr: str = ""

    @property
    def reported(self) -> int:
        return sum(m.messages for m in ([self.warmup] if self.warmup else []) + self.minutes + self.tail)

    @property
    def errors(self) -> int:
        return sum(m.errors for m in self.minutes)

    @property
    def all_errors(self) -> int:
        return sum(m.errors for m in ([self.warmup] if self.warmup else []) + self.minutes + self.tail)

    def stat(self, what: str) -> tuple[float, float | None]:
        values = [m.messages if what == "msgs" else m.mb_per_s for m in self.minutes]
        if not values:
            return 0.0, None
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


async def _readline(stream: asyncio.StreamReader, deadline: float) -> str | None:
    """The next line before the deadline (monotonic), or None at the deadline or EOF."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    try:
        raw = await asyncio.wait_for(stream.readline(), remaining)
    except asyncio.TimeoutError:
        return None
    return raw.decode("ascii", "replace") if raw else None


async def wait_quiet(meter: CpuMeter) -> float:
    """Let Cassandra finish flushing/compacting the previous run (bounded), and start postal early in
    a clock minute so its first, discarded minute is a real warm-up."""
    t0 = time.monotonic()
    if meter.cass.enabled:
        while time.monotonic() - t0 < QUIET_MAX:
            a = meter.cass.sample()
            await asyncio.sleep(5)
            used = CassandraCpu.delta(a, meter.cass.sample())
            if used is None or used / 5 < QUIET_CORES:
                break
    second = time.time() % 60
    if second > 45:
        await asyncio.sleep(61 - second)
    return time.monotonic() - t0


async def run_postal(
    server: str, port: int, label: str, lo: int, hi: int, args: argparse.Namespace, users_file: Path,
    meter: CpuMeter, workdir: Path, postfix: Postfix | None = None,
) -> Run:
    """One postal run; `postfix` is given when the server is that Postfix (its Maildirs are counted)."""
    run = Run(server, label, os.getloadavg()[0])
    run.waited = await wait_quiet(meter)
    run.load = os.getloadavg()[0]
    lo_k, hi_k = max(0, round(lo / 1024)), max(1, round(hi / 1024))
    cmd = ["postal", "-t", str(args.threads), "-c", str(args.per_connection), "-M", str(lo_k), "-m", str(hi_k),
           "-r", str(POSTAL_RATE), f"[127.0.0.1]{port}", str(users_file)]
    run.command = cmd
    mean_size = (lo_k + hi_k) / 2 * 1024 + POSTAL_HEADERS
    log(f"\n## {server}, {label}: load average {run.load:.2f} at start (waited {run.waited:.0f} s for a quiet "
        f"Cassandra and the minute)\n  {' '.join(cmd)}")
    err_path = workdir / f"postal-{server}-{label}.err"
    start = time.monotonic()
    # Warm-up (<= 60 s to the first clock minute), the measured minutes, the tail minute, slack.
    hard = start + 60 * (args.minutes + 2) + 45
    with open(err_path, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *die_with_us(cmd), stdout=asyncio.subprocess.PIPE, stderr=err, stdin=asyncio.subprocess.DEVNULL,
            cwd=workdir,  # postal writes postal.log into its working directory
        )
    meter.postal_pid = proc.pid
    assert proc.stdout is not None
    first: Sample | None = None
    interrupted = False
    try:
        while True:
            line = await _readline(proc.stdout, hard)
            if line is None:
                run.notes.append("postal stopped printing before the end" if time.monotonic() < hard
                                 else "hard time limit reached")
                break
            minute = parse_minute(line, mean_size)
            if minute is None:
                continue
            if run.warmup is None:
                run.warmup, first = minute, meter.sample()
                if postfix is not None:
                    run.in_window = -postfix.delivered()[0]
                log(f"  {minute.clock} warm-up  {minute.messages:6d} msgs {minute.mb_per_s:7.1f} MB/s "
                    f"{minute.errors} errors (partial minute, not counted)")
            elif not interrupted:
                run.minutes.append(minute)
                log(f"  {minute.clock} minute {len(run.minutes)} {minute.messages:6d} msgs "
                    f"{minute.mb_per_s:7.1f} MB/s {minute.errors} errors"
                    + (f" (postal's data column wrapped: +{minute.wraps} x 4 GiB)" if minute.wraps else ""))
                if len(run.minutes) >= args.minutes:
                    last = meter.sample()
                    assert first is not None
                    run.cpu, run.wall, run.machine = CpuMeter.delta(first, last)
                    if postfix is not None and run.in_window is not None:
                        run.in_window += postfix.delivered()[0]
                    # postal stops sending on SIGINT and keeps printing; the next minute's line holds
                    # the messages that were in flight.
                    proc.send_signal(signal.SIGINT)
                    interrupted = True
                    hard = min(hard, time.monotonic() + 75)
            else:
                run.tail.append(minute)
                log(f"  {minute.clock} tail     {minute.messages:6d} msgs (finished after SIGINT)")
                break
    finally:
        # postal only stops sending on SIGINT; SIGTERM ends it. Without the tail line yet (an error,
        # the deadline), SIGINT first lets messages in flight finish.
        steps = [(signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)]
        if not interrupted:
            steps.insert(0, (signal.SIGINT, 5.0))
        for sig, wait in steps:
            if proc.returncode is not None:
                break
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                await asyncio.wait_for(proc.wait(), wait)
            except asyncio.TimeoutError:
                continue
        meter.postal_pid = None
    try:
        run.stderr = err_path.read_text(errors="replace")
    except OSError:
        pass
    if not run.cpu:
        run.notes.append(f"only {len(run.minutes)} of {args.minutes} minutes measured")
    return run


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _pm(mean: float, sd: float | None, spec: str) -> str:
    return format(mean, spec) + (f" ± {format(sd, spec)}" if sd is not None else "")


def table(runs: list[Run]) -> list[str]:
    head = ["server", "sizes", "min", "msgs/min", "MB/s", "errors", "delivered / sent",
            "CPU s cassmail", "Cassandra", "postal", "Postfix", "cores used", "machine busy", "load avg"]
    rows = []
    for r in runs:
        msgs, msgs_sd = r.stat("msgs")
        mbs, mbs_sd = r.stat("mbs")
        used = sum(v for v in r.cpu.values() if v is not None)
        check = "-" if r.delivered is None else f"{r.delivered} / {r.reported}"
        rows.append([
            r.server, r.sizes, str(len(r.minutes)), _pm(msgs, msgs_sd, ".0f"), _pm(mbs, mbs_sd, ".1f"),
            str(r.errors), check,
            *(_fmt(r.cpu.get(g)) for g in GROUPS),
            _fmt(used / r.wall if r.wall else None, ".2f"),
            _fmt(r.machine / r.wall if r.wall else None, ".2f"),
            f"{r.load:.2f}",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    left = {0, 1}

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return [line(head), sep, *(line(r) for r in rows)]


def ratios(runs: list[Run], labels: list[str]) -> list[str]:
    out = []
    for label in labels:
        c = next((r for r in runs if r.server == "cassmail" and r.sizes == label and r.minutes), None)
        p = next((r for r in runs if r.server == "Postfix" and r.sizes == label and r.minutes), None)
        if c and p and p.stat("mbs")[0] > 0:
            ratio = c.stat("mbs")[0] / p.stat("mbs")[0]
            verdict = "meets" if ratio >= 0.5 else "misses"
            out.append(f"{label}: cassmail/Postfix MB/s = {c.stat('mbs')[0]:.1f} / {p.stat('mbs')[0]:.1f} = "
                       f"{ratio:.2f}x ({verdict} the target of 0.5x; the CassMail paper: 0.38x)")
    return out


def describe(settings: Settings, args: argparse.Namespace, cass: CassandraCpu) -> list[str]:
    c = settings.store.cassandra
    workers = args.workers or os.cpu_count() or 1
    return [
        f"Cassandra          {', '.join(c.contact_points)} port {c.port}, keyspace {c.keyspace} (fresh), "
        f"SimpleStrategy RF=1, read ONE, write ONE",
        f"cassmail           {workers} worker(s), log level WARNING, MX listener only",
        f"postal             {args.threads} threads, 1..{args.per_connection} messages per connection, "
        f"one recipient per message out of {args.users} users, -r {POSTAL_RATE}",
        f"sizes              {', '.join(f'{human(lo)}-{human(hi)}' for lo, hi in args.sizes)} "
        f"(uniform; decimal, passed to postal in KiB)",
        f"per run            {args.minutes} measured minute(s) after postal's first, partial minute",
        f"host               {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"CPU accounting     /proc utime+stime (+ reaped children) of cassmail's tree, postal, Postfix's master "
        f"tree; {cass.label}; a shared node counts every client's load",
    ]


# --------------------------------------------------------------------------- main


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings, notes = load_settings(args)
    except ConfigError as exc:
        print(f"bench_smtp: {exc}", file=sys.stderr)
        return 2
    too_big = [hi for _, hi in args.sizes if hi > settings.store.max_message_size]
    if too_big:
        print(f"bench_smtp: sizes up to {max(too_big)} exceed store.max_message_size", file=sys.stderr)
        return 2
    try:
        await asyncio.to_thread(ensure_packages, args.postfix)
    except Exception as exc:  # noqa: BLE001
        print(f"bench_smtp: {exc}", file=sys.stderr)
        return 2

    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)

    c = settings.store.cassandra
    cass = CassandraCpu(c.contact_points, c.port)
    meter = CpuMeter(cass)
    workdir = Path(tempfile.mkdtemp(prefix="bench_smtp_"))
    domain = f"bench-{secrets.token_hex(4)}.example"
    labels = [f"{human(lo)}-{human(hi)}" for lo, hi in args.sizes]
    runs: list[Run] = []
    store: Store | None = None
    cassmail: Cassmail | None = None
    postfix: Postfix | None = None
    made = False
    status = 0
    from cassmail.store import cassandra_schema

    log("# cassmail SMTP benchmark (postal)")
    for line in describe(settings, args, cass):
        log("  " + line)
    for note in notes:
        log("  note: " + note)
    log(f"  work directory     {workdir}")
    try:
        t = time.perf_counter()
        made = True  # from here on the keyspace may exist: drop it (IF EXISTS) at the end
        await asyncio.to_thread(cassandra_schema.apply, c)
        store = make_store(settings)
        await store.open()
        await store.add_domain(domain)
        users = await make_users(store, domain, args.users, 64)
        users_file = workdir / "users.txt"
        users_file.write_text("".join(u + "\n" for u in users))
        log(f"\ncreated keyspace {c.keyspace}, domain {domain} and {len(users)} users in "
            f"{time.perf_counter() - t:.1f} s")

        if args.cassmail:
            cassmail = Cassmail(settings, workdir, args.workers)
            t = time.perf_counter()
            cassmail.spawn()
            await asyncio.to_thread(cassmail.wait_ready)
            meter.cassmail_pid = cassmail.process.pid if cassmail.process else None
            log(f"cassmail serve pid {meter.cassmail_pid} on 127.0.0.1:{cassmail.port} with {cassmail.workers} "
                f"worker(s), up in {time.perf_counter() - t:.1f} s (config {cassmail.config})")
        if args.postfix:
            postfix = Postfix(workdir, domain, users)
            await asyncio.to_thread(postfix.configure)
            await asyncio.to_thread(postfix.start)
            meter.postfix_pid = postfix.master_pid()
            version = run_cmd(["postconf", "-c", str(postfix.dir), "-h", "mail_version"], check=False).strip()
            log(f"Postfix {version} master pid {meter.postfix_pid} on 127.0.0.1:{postfix.port}; a separate "
                f"instance in {postfix.dir} (/etc/postfix untouched), configured with:")
            for change in postfix.changes:
                log("  " + change)

        counted = (0, 0)
        pf_counted = (0, 0)
        for (lo, hi), label in zip(args.sizes, labels):
            if cassmail is not None:
                run = await run_postal("cassmail", cassmail.port, label, lo, hi, args, users_file, meter, workdir)
                runs.append(run)
                if cassmail.process is not None and cassmail.process.poll() is not None:
                    run.notes.append(f"cassmail serve exited with {cassmail.process.returncode}")
                now = await count_cassmail(store, users)
                run.delivered, run.delivered_bytes = now[0] - counted[0], now[1] - counted[1]
                counted = now
            if postfix is not None:
                run = await run_postal("Postfix", postfix.port, label, lo, hi, args, users_file, meter, workdir,
                                       postfix)
                runs.append(run)
                waited, left = await asyncio.to_thread(postfix.wait_queue_empty)
                if left:
                    run.notes.append(f"{left} messages still queued after {waited:.0f} s")
                elif waited > 2:
                    run.notes.append(f"the queue took {waited:.0f} s to empty after postal stopped")
                now = await asyncio.to_thread(postfix.delivered)
                run.delivered, run.delivered_bytes = now[0] - pf_counted[0], now[1] - pf_counted[1]
                pf_counted = now
            for r in runs[-2:]:
                if r.sizes == label and r.delivered is not None:
                    log(f"  check {r.server} {label}: postal reported {r.reported} messages sent "
                        f"({r.all_errors} errors), the server holds {r.delivered} new ones "
                        f"({r.delivered_bytes / 1e6 if r.delivered_bytes else 0:.0f} MB)")
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - print what was measured, clean up
        print(f"\nbench_smtp: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
        if not isinstance(exc, asyncio.CancelledError):
            traceback.print_exc()
        status = 1
    finally:
        log("\n## cleanup")
        if cassmail is not None:
            state = await asyncio.to_thread(cassmail.stop)
            log(f"  cassmail serve: {state}")
            problems = [ln for ln in cassmail.log_text(20000).splitlines() if "level=error" in ln or "Traceback" in ln]
            if problems:
                log(f"  cassmail log had {len(problems)} error line(s), first: {problems[0][:300]}")
        if postfix is not None:
            log(f"  Postfix: {await asyncio.to_thread(postfix.stop)}")
        if store is not None:
            await store.close()
        if made and args.keep:
            log(f"  --keep: left keyspace {c.keyspace} and {workdir}")
        elif made:
            try:
                t = time.perf_counter()
                await asyncio.to_thread(cassandra_schema.drop, c)
                log(f"  dropped keyspace {c.keyspace} in {time.perf_counter() - t:.1f} s")
            except Exception as exc:  # noqa: BLE001
                log(f"  could not drop keyspace {c.keyspace}: {exc}")
                status = status or 1
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
            log(f"  removed {workdir}")

    if not runs:
        return status or 1
    log("\n## results\n")
    for line in table(runs):
        log(line)
    log("")
    for line in ratios(runs, labels):
        log(line)
    log("\nmsgs/min and MB/s: mean ± sample standard deviation over the measured minutes; errors: postal's, in "
        "those minutes; delivered / sent: messages the server holds after the run / messages postal reported "
        "for the whole run (warm-up and tail minutes included); CPU s: during the measured minutes; cores used: "
        "the four columns / wall time; machine busy: all CPU use on the host (others' included).")
    for r in runs:
        extra = list(r.notes)
        if r.delivered is not None and r.delivered != r.reported:
            extra.append(f"delivered {r.delivered} but postal reported {r.reported} sent "
                         f"(difference {r.delivered - r.reported:+d})")
        if r.server == "Postfix" and r.in_window is not None and r.wall:
            extra.append(f"Maildir deliveries during the measured minutes: {r.in_window / (r.wall / 60):.0f}/min")
        wrapped = [m for m in r.minutes if m.wraps]
        if wrapped:
            extra.append(f"postal's data(K) column wrapped at 4 GiB in {len(wrapped)} of the measured minutes "
                         f"(a 32-bit counter): corrected from the message count, e.g. {wrapped[0].clock} "
                         f"{wrapped[0].kib * 1024 / 60e6:.1f} -> {wrapped[0].mb_per_s:.1f} MB/s")
        if r.delivered and r.delivered_bytes and r.minutes:
            mean = r.delivered_bytes / r.delivered
            msgs = r.stat("msgs")[0]
            extra.append(f"cross-check: the server's mean stored message is {mean / 1e3:.0f} KB, so "
                         f"{msgs:.0f} msgs/min is {msgs * mean / 60e6:.1f} MB/s stored (with the headers it adds)")
        if r.all_errors or not r.minutes:
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            extra.append(f"{r.all_errors} postal errors; postal's stderr: {' | '.join(lines[:3])[:400] or '(empty)'}")
        if r.machine and r.wall:
            ours = sum(v for v in r.cpu.values() if v is not None)
            extra.append(f"CPU used by everything else on the host (others' work, kernel threads such as disk "
                         f"writeback): {(r.machine - ours) / r.wall:.2f} cores")
        for e in extra:
            log(f"- {r.server} {r.sizes}: {e}")
    return status


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
