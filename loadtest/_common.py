"""What every load test and benchmark in loadtest/ shares, kept in one place so that all of them
read sizes, write node settings, start a node and count CPU the same way.

- sizes: decimal units (K = 10^3, M = 10^6), so message sizes and MB/s use the same megabyte;
- settings: a `Settings` object written back as the TOML file `cassmail --config` reads;
- processes: CPU seconds of process trees from /proc (children that already exited included),
  the whole machine's busy time, the CassandraDaemon serving a port;
- `CassmailNode`: one `cassmail serve` process on free loopback ports, stopped with everything
  it forked;
- Markdown tables and percentiles for the printed results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from cassmail import config
from cassmail.auth import HashParams, hash_password, verify_password
from cassmail.config import Settings, to_toml
from cassmail.store.base import NoSuchDomain, Store

HOST = "127.0.0.1"
#: The load-test users' password, hashed cheaply: logging in is not what is measured.
PASSWORD = "pw"
BENCH_HASH = HashParams(log2_n=10)
#: The store the CassMail paper's single-node runs measure: RF=1 and consistency ONE. Benchmarks
#: put these after --config and --set, so they always win.
RF1_CL_ONE = {
    "store.backend": "cassandra",
    "store.cassandra.replication_strategy": "SimpleStrategy",
    "store.cassandra.replication_factor": "1",
    "store.cassandra.read_consistency": "ONE",
    "store.cassandra.write_consistency": "ONE",
}
CASSMAIL = Path(sys.executable).parent / "cassmail"
CLK_TCK = os.sysconf("SC_CLK_TCK")
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


# --------------------------------------------------------------------------- sizes and numbers


def parse_size(text: str) -> int:
    """"50K" -> 50000: decimal units, so sizes and MB/s use the same megabyte."""
    t = text.strip().upper()
    digits = t.rstrip("BKMG")
    unit = t[len(digits) :]
    if not digits or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 500, 50K, 2M)")
    try:
        value = float(digits) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def parse_range(text: str) -> tuple[int, int]:
    """"50K-500K" -> (50000, 500000); "100K" alone is a fixed size."""
    lo_text, sep, hi_text = text.strip().partition("-")
    lo = parse_size(lo_text)
    hi = parse_size(hi_text) if sep else lo
    if hi < lo:
        raise argparse.ArgumentTypeError(f"range {text.strip()!r} ends below its start")
    return lo, hi


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """"50K-500K,200K-2M" -> [(50000, 500000), (200000, 2000000)]."""
    ranges = [parse_range(part) for part in text.split(",") if part.strip()]
    if not ranges:
        raise argparse.ArgumentTypeError("--sizes needs at least one range")
    return ranges


def human(n: int) -> str:
    """50000 -> "50K": the inverse of parse_size for round numbers."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale and n % (scale // 1000 or 1) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def range_label(lo: int, hi: int) -> str:
    return f"{human(lo)}-{human(hi)}"


def number(kind: type, minimum: float = 1) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` that is at least `minimum`."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value

    return convert


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above zero."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return convert


# --------------------------------------------------------------------------- settings files


def free_port(host: str = HOST) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_us(cmd: list[str]) -> list[str]:
    """`cmd` run through util-linux setpriv so that it gets SIGTERM if this process dies
    (PR_SET_PDEATHSIG survives the exec), where setpriv exists: a load generator never outlives
    its run. Start such children from the main thread: the signal follows the forking thread."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


def run_cmd(cmd: list[str], timeout: float = 120, check: bool = True, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


# --------------------------------------------------------------------------- CPU accounting


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from field 3 (state) on; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields:
                kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def descendants(root: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    kids = children_map() if kids is None else kids
    out, todo = [], list(kids.get(root, ()))
    while todo and len(out) < 100_000:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def pid_cpu(pid: int, reaped_children: bool = False) -> float | None:
    """utime+stime of a process (every thread), plus its reaped children's if asked."""
    f = proc_stat(pid)
    if f is None:
        return None
    ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if reaped_children else 0)
    return ticks / CLK_TCK


def pid_age(pid: int) -> float | None:
    """Seconds since the process started; None when it is gone."""
    f = proc_stat(pid)
    if f is None:
        return None
    with open("/proc/uptime") as fh:
        return float(fh.read().split()[0]) - int(f[19]) / CLK_TCK


def tree_cpu(root: int | None, kids: dict[int, list[int]] | None = None) -> float | None:
    """CPU seconds of a process and all its descendants: for every live one utime+stime, plus
    cutime+cstime (its children that already exited and were reaped: Postfix's and Dovecot's
    short-lived processes end up in their master's). None if the root is gone."""
    if root is None or proc_stat(root) is None:
        return None
    kids = children_map() if kids is None else kids
    return sum(pid_cpu(p, reaped_children=True) or 0.0 for p in [root, *descendants(root, kids)])


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as fh:
        parts = [int(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


def own_cpu() -> float:
    """CPU seconds (user+system) of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def listening_inodes(port: int) -> set[str]:
    """Socket inodes in LISTEN state on a TCP port (one per SO_REUSEPORT listener)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except OSError:
            continue
    return inodes


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets `pid` holds open (none once it is gone)."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    out.add(link[8:-1])
    return out


def owns_socket(pid: int, inodes: set[str]) -> bool:
    wanted = {f"socket:[{i}]" for i in inodes}
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
    except OSError:
        pass
    return False


def is_local_address(host: str) -> bool:
    """True when host names this machine: it is loopback, or we can bind to it."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def cassandra_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as fh:
                if b"CassandraDaemon" in fh.read():
                    pids.append(int(entry))
    return sorted(pids)


#: A node started less than this long ago is still compiling its hot code: in the IMAP mix its
#: compiler took 14 CPU s of the first run's 25 s and 3 of the second's (loadtest/RESULTS.md).
YOUNG_NODE = 300.0


class CassandraCpu:
    """CPU seconds of the local CassandraDaemon JVM(s) serving the benchmarked port.

    Other nodes on this host are left out when the one listening on our port can be
    told apart; otherwise every CassandraDaemon is counted and the label says so. The
    label also says when a node started less than YOUNG_NODE seconds ago.
    """

    def __init__(self, contact_points: Sequence[str] | None, port: int = 0) -> None:
        self.pids: list[int] = []
        if contact_points is None:
            self.label = "backend is not cassandra"
            return
        self.label = "Cassandra not on this host: its CPU not measured"
        if not any(is_local_address(h) for h in contact_points):
            return
        every = cassandra_pids()
        if not every:
            self.label = "local, but no CassandraDaemon process visible (container?): not measured"
            return
        inodes = listening_inodes(port)
        ours = [pid for pid in every if inodes and owns_socket(pid, inodes)]
        if ours:
            self.pids = ours
            others = len(every) - len(ours)
            self.label = f"CassandraDaemon pid {','.join(map(str, ours))} (listening on :{port})" + (
                f"; {others} other CassandraDaemon on this host not counted" if others else ""
            )
        else:
            self.pids = every
            self.label = f"all CassandraDaemon pids {','.join(map(str, every))} (owner of :{port} not identified)"
        ages = [age for pid in self.pids if (age := pid_age(pid)) is not None]
        if ages and min(ages) < YOUNG_NODE:
            self.label += (f"; started {min(ages):.0f} s ago, its compiler still at work: the first runs after a "
                           "start run slow")

    @property
    def enabled(self) -> bool:
        return bool(self.pids)

    def _per_pid(self, read: Callable[[int], Any]) -> dict[int, Any]:
        return {pid: value for pid in self.pids if (value := read(pid)) is not None}

    def sample(self) -> dict[int, float]:
        """utime+stime per JVM pid now."""
        return self._per_pid(pid_cpu)

    def seconds(self) -> float | None:
        """utime+stime of all counted JVMs now, None when none is counted."""
        return sum(self.sample().values()) if self.pids else None

    @staticmethod
    def delta(before: dict[int, float], after: dict[int, float]) -> float | None:
        common = before.keys() & after.keys()
        return sum(after[p] - before[p] for p in common) if common else None

    def wait_quiet(self, limit: float = 60.0, cores: float = 0.3, step: float = 5.0) -> float:
        """Block until the JVMs use less than `cores` (the previous run's flushes and compactions
        are done), at most `limit` seconds; the seconds waited."""
        t0 = time.monotonic()
        if not self.enabled:
            return 0.0
        while time.monotonic() - t0 < limit:
            before = self.sample()
            time.sleep(step)
            used = self.delta(before, self.sample())
            if used is None or used / step < cores:
                break
        return time.monotonic() - t0

    def parts(self) -> dict[int, JvmParts]:
        """Per counted JVM, CPU seconds and bytes written by part of the node, now."""
        return self._per_pid(jvm_parts)


#: The parts of a Cassandra node, by the names its threads carry (the kernel keeps 15 characters).
#: Shared-pool workers take the name of the stage they serve at the moment: all are requests.
JVM_PARTS = (
    ("requests", ("Native-Transpor", "epollEventLoop", "ReadStage", "MutationStage", "CounterMutation",
                  "RequestResponse", "Paxos", "SharedPool")),
    ("commit log", ("COMMIT-LOG", "PERIODIC-COMMIT", "GROUP-COMMIT", "BATCH-COMMIT")),
    ("memtable flush", ("MemtableFlush", "PerDiskMemtable", "MemtablePostFlu", "MemtableReclaim",
                        "SlabPoolCleaner", "LocalPool")),
    ("compaction", ("CompactionExecu", "ValidationExec")),
    ("GC", ("GC Thread", "G1 ", "VM Thread")),
    ("JIT", ("C1 Compiler", "C2 Compiler")),
)
JVM_PART_NAMES = (*(name for name, _ in JVM_PARTS), "other")


def jvm_part(thread_name: str) -> str:
    for name, prefixes in JVM_PARTS:
        if thread_name.startswith(prefixes):
            return name
    return "other"


@dataclasses.dataclass
class JvmParts:
    """One JVM at one moment: per thread (tid) its part, CPU seconds and bytes written to storage
    (`write_bytes` of /proc/PID/task/TID/io: page-cache pages it dirtied), and the process's totals,
    which also hold the threads that have exited."""

    threads: dict[int, tuple[str, float, int]]
    cpu: float
    written: int


def _io_written(path: str) -> int | None:
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def jvm_parts(pid: int) -> JvmParts | None:
    total, written = pid_cpu(pid), _io_written(f"/proc/{pid}/io")
    if total is None or written is None:
        return None
    threads = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            base = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{base}/comm") as fh:
                    name = fh.read().strip()
                with open(f"{base}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            threads[int(tid)] = (jvm_part(name), (int(f[11]) + int(f[12])) / CLK_TCK, _io_written(f"{base}/io") or 0)
    return JvmParts(threads, total, written)


def jvm_parts_delta(before: dict[int, JvmParts], after: dict[int, JvmParts]) -> dict[str, tuple[float, int]]:
    """CPU seconds and bytes written per part between two samples of the same JVMs. A thread that
    started between them counts whole; what threads that ended between them used is in "other"
    (the process's totals less the threads seen)."""
    out = {name: [0.0, 0] for name in JVM_PART_NAMES}
    for pid in before.keys() & after.keys():
        a, b = before[pid], after[pid]
        seen_cpu, seen_written = 0.0, 0
        for tid, (part, cpu, written) in b.threads.items():
            _, cpu0, written0 = a.threads.get(tid, (part, 0.0, 0))
            d_cpu, d_written = max(0.0, cpu - cpu0), max(0, written - written0)
            out[part][0] += d_cpu
            out[part][1] += d_written
            seen_cpu += d_cpu
            seen_written += d_written
        out["other"][0] += max(0.0, (b.cpu - a.cpu) - seen_cpu)
        out["other"][1] += max(0, (b.written - a.written) - seen_written)
    return {name: (cpu, written) for name, (cpu, written) in out.items()}


def delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


# --------------------------------------------------------------------------- the store: settings, users and counts


def bench_settings(config_file: str | None, overrides: Sequence[str], backend: str, keyspace_prefix: str = "bench",
                   mbox_path: Path | None = None) -> Settings:
    """Settings for one benchmarked store: on Cassandra a fresh `<prefix>_<random>` keyspace at
    RF1_CL_ONE (after --config and --set, so they always win); on mbox the given directory."""
    if backend == "cassandra":
        fixed = [f"{k}={v}" for k, v in RF1_CL_ONE.items()]
        fixed.append(f"store.cassandra.keyspace={keyspace_prefix}_{secrets.token_hex(5)}")
        return config.load(config_file, overrides=[*overrides, *fixed])
    settings = config.load(config_file, overrides=[*overrides, f"store.backend={backend}"])
    if backend == "mbox" and mbox_path is not None:
        settings.store = dataclasses.replace(settings.store,
                                             mbox=dataclasses.replace(settings.store.mbox, path=str(mbox_path)))
    return settings


def scrypt_verify_ms(params: HashParams, repeat: int = 5) -> float:
    """Fastest of `repeat` checks of a right password: what one cassmail login spends hashing."""
    stored = hash_password(PASSWORD, params)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        verify_password(PASSWORD, stored)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


async def make_users(store: Store, domain: str, n: int, concurrency: int = 32, password: str = PASSWORD,
                     params: HashParams = BENCH_HASH, prefix: str = "u") -> list[str]:
    """Create u0000@domain.. (the domain must exist), `concurrency` at a time (each creation is a
    lightweight transaction in Cassandra), all with one hash: cheap unless a benchmark measures
    logins at a given cost, since user creation is set-up."""
    hashed = hash_password(password, params)
    limit = asyncio.Semaphore(concurrency)
    users = [f"{prefix}{i:04d}@{domain}" for i in range(n)]

    async def one(user: str) -> None:
        async with limit:
            # The domain was added a moment ago: at a weak read level (RF=2, ONE) the replica that
            # answers may not have it yet. Set-up waits for it (10 s at most).
            for _ in range(100):
                try:
                    await store.create_user(user, hashed)
                    return
                except NoSuchDomain:
                    await asyncio.sleep(0.1)
            await store.create_user(user, hashed)

    await asyncio.gather(*(one(u) for u in users))
    return users


async def count_inboxes(store: Store, users: Sequence[str], concurrency: int = 32) -> tuple[int, int]:
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


# --------------------------------------------------------------------------- a cassmail node


LISTENERS = ("smtp", "submission", "lmtp", "pop3", "imap")


class CassmailNode:
    """One `cassmail --config FILE serve` with the named listeners on free 127.0.0.1 ports.

    Logins in clear text are allowed and failed logins are not slowed down: a load generator
    logs in over loopback many times a second, and neither TLS nor the throttle is measured.
    """

    def __init__(self, settings: Settings, directory: Path, listeners: Sequence[str], workers: int = 0,
                 log_level: str = "WARNING", name: str = "cassmail", **overrides: dict[str, Any]) -> None:
        s = dataclasses.replace(settings)
        s.node = dataclasses.replace(settings.node, name="bench-cassmail.localhost", workers=workers,
                                     log_level=log_level)
        self.ports: dict[str, int] = {}
        for listener_name in LISTENERS:
            if not hasattr(settings, listener_name):
                continue
            listener = dataclasses.replace(getattr(settings, listener_name))
            listener.enabled = listener_name in listeners
            if listener.enabled:
                self.ports[listener_name] = free_port()
                listener.listen = f"{HOST}:{self.ports[listener_name]}"
                for key, value in (("allow_plaintext_auth", True), ("auth_failure_delay", 0.0)):
                    if hasattr(listener, key):
                        setattr(listener, key, value)
                for key, value in overrides.get(listener_name, {}).items():
                    setattr(listener, key, value)
            setattr(s, listener_name, listener)
        missing = set(listeners) - set(self.ports)
        if missing:
            raise ValueError(f"this cassmail has no {', '.join(sorted(missing))} listener")
        self.settings = s
        self.workers = workers or os.cpu_count() or 1
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / f"{name}.toml"
        self.config.write_text(to_toml(s))
        self.log_path = directory / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.children: set[int] = set()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, timeout: float = 90) -> CassmailNode:
        cmd = [str(CASSMAIL), "--config", str(self.config), "serve"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(die_with_us(cmd), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"cassmail serve exited with {self.process.returncode}:\n{self.log_text()}")
            # Every worker binds its own listening socket (SO_REUSEPORT): ready when all of them do.
            if all(len(listening_inodes(p)) >= self.workers and greets(p) for p in self.ports.values()):
                self.children = set(descendants(self.process.pid))
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"cassmail serve did not come up in {timeout:g} s:\n{self.log_text()}")

    def cpu(self) -> float | None:
        return tree_cpu(self.pid)

    def stop(self, timeout: float = 30) -> str:
        p = self.process
        if p is None or p.poll() is not None:
            return "not running"
        self.children |= set(descendants(p.pid))
        p.send_signal(signal.SIGTERM)
        try:
            return f"stopped (exit {p.wait(timeout)})"
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            for pid in self.children:  # workers of a supervisor that had to be killed
                with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if str(self.config).encode() in fh.read():
                        os.kill(pid, signal.SIGKILL)
            return f"killed after {timeout:g} s"

    def log_text(self, last: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-last:]
        except OSError:
            return ""


async def drop_keyspace(cassandra: config.CassandraSettings) -> str:
    """Drop a keyspace a benchmark made; the line that says so, or why it could not (cleanup
    reports, never hides the results)."""
    from cassmail.store import cassandra_schema

    try:
        await asyncio.to_thread(cassandra_schema.drop, cassandra)
        return f"dropped keyspace {cassandra.keyspace}"
    except Exception as exc:  # noqa: BLE001 - cleanup reports, never hides the results
        return f"could not drop keyspace {cassandra.keyspace}: {exc}"


async def guarded_target(
    label: str, measure: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[list[str]]],
    workdir: Path, subdirs: Sequence[str], keep: bool, say: Callable[[str], None],
) -> int:
    """Measure one target of a benchmark run: 0, or 130 when interrupted, or 1 when it failed
    (reported, with its traceback). Whatever happened, what it started is stopped (`stop`
    gives the lines to report) and, unless `keep`, its directories under `workdir` removed, so
    that what was measured is still reported and the next target starts clean."""
    status = 0
    try:
        await measure()
    except (KeyboardInterrupt, asyncio.CancelledError):
        say("\ninterrupted")
        status = 130
    except Exception as exc:  # noqa: BLE001 - report what was measured, stop what was started
        say(f"\n{label} stopped by {type(exc).__name__}: {exc}")
        traceback.print_exc()
        status = 1
    finally:
        for line in await stop():
            say("  " + line)
        if not keep:
            for sub in subdirs:
                shutil.rmtree(workdir / sub, ignore_errors=True)
    return status


def greets(port: int, timeout: float = 2.0) -> bool:
    """True when a server on 127.0.0.1:port sends a positive greeting (SMTP 220, POP3 +OK, IMAP * OK)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.settimeout(5)
            data = sock.recv(512)
    except OSError:
        return False
    return data.startswith((b"220", b"+OK", b"* OK"))


# --------------------------------------------------------------------------- tables


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the values, None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def markdown(head: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    """A Markdown table padded to line up in a terminal; columns not in `left` align right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return [line(head), sep, *(line(r) for r in rows)]
