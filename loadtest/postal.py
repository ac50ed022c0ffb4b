"""postal (SMTP) and rabid (POP3/IMAP), Debian's mail load generators, against one node, bounded in time.

    .venv/bin/python loadtest/postal.py --config node.toml --smtp 127.0.0.1:2525 --pop3 127.0.0.1:1110 \\
        --users 100 --sizes 50K-500K --seconds 120 --out results/

With --config (the node's settings, or $CASSMAIL_CONFIG) a fresh domain and --users users
(password "pw") are created in the node's store and removed at the end; with --users-file the
users already exist ("address password" per line). Per size range: postal sends for --seconds,
then rabid retrieves and deletes for --seconds (when --pop3 is given). Every run writes one JSON
file into --out that loadtest/report.py turns into tables and plots.

How the numbers are taken:
- postal writes one line per message sent to postal.log and rabid one line per message
  retrieved to rabid.log in their working directory; these files are read every --interval
  seconds, so the series has our own clock and short runs count too. postal's own per-minute
  lines (time, messages, data(K), errors, connections; its stdout is line-buffered through
  stdbuf) are kept beside them. rabid 0.76 prints no statistics line of its own.
- The mean of a run is the CassMail paper's: per-interval throughput, the first interval
  dropped as warm-up, the last --average-last intervals averaged, with their sample standard
  deviation.
- The caller may pass CPU probes (name -> seconds used so far); they are sampled with the
  series, so the report can plot who spent the CPU per interval.
- postal stops sending on SIGINT; it then gets up to 5 s to finish the messages in flight (until
  it holds no connection) and SIGTERM. rabid gets SIGTERM: sessions cut there delete nothing
  (POP3 deletes at QUIT).

Sizes are decimal (K = 10^3, M = 10^6) and passed to postal in KiB (-M/-m); MB/s means 10^6
bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cassmail import config
from cassmail.store import make_store

from _common import (HOST, PASSWORD, count_inboxes, die_with_us, machine_cpu, make_users, number, own_cpu,
                     parse_range, parse_ranges, range_label, socket_inodes, tree_cpu)

#: postal's -r and rabid's -r: per minute over all threads. The defaults (24,000/min) could cap a
#: fast server at small sizes: lifted.
UNLIMITED_RATE = 1_000_000
#: Bytes postal adds to each message body (its headers), measured with a counting SMTP sink.
POSTAL_HEADERS = 450
#: postal counts a minute's bytes in a 32-bit counter: past 4 GiB a minute (71.6 MB/s) its data(K)
#: column starts again from 0. Seen here: Postfix at 200K-2M, 5,219 messages of ~1.1 MB (5.8 GB) in a
#: minute printed as 1.48 GB.
WRAP = 1 << 32


# --------------------------------------------------------------------------- postal's per-minute lines


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


def error_messages(stderr: str) -> list[str]:
    """postal's or rabid's error messages, one per error. Both print a server's refusal as
    "Server error:%s." with the reply's own CRLF inside, so the closing period stands on a line of
    its own: it belongs to the message before it and is not an error of its own."""
    messages: list[str] = []
    for line in stderr.splitlines():
        line = line.strip()
        if line == "." and messages:
            messages[-1] += "."
        elif line:
            messages.append(line)
    return messages


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


def postal_kib(lo: int, hi: int) -> tuple[int, int]:
    """A decimal byte range as postal's -M/-m (KiB, at least 1 for the maximum)."""
    return max(0, round(lo / 1024)), max(1, round(hi / 1024))


def postal_mean_size(lo: int, hi: int) -> float:
    lo_k, hi_k = postal_kib(lo, hi)
    return (lo_k + hi_k) / 2 * 1024 + POSTAL_HEADERS


# --------------------------------------------------------------------------- one bounded run


@dataclass
class Tick:
    """One sample of a run: seconds since start, messages so far (the tool's log), CPU so far."""

    t: float
    messages: int
    cpu: dict[str, float | None]
    machine_busy: float


@dataclass
class LoadRun:
    """One postal or rabid run against one server, as report.py reads it back (JSON)."""

    tool: str
    server: str
    sizes: str
    interval: float
    average_last: int
    command: list[str] = field(default_factory=list)
    started: float = 0.0  # epoch seconds
    ticks: list[Tick] = field(default_factory=list)
    minutes: list[Minute] = field(default_factory=list)
    errors: int = 0
    error_lines: list[str] = field(default_factory=list)
    #: Messages and bytes the server held before and after the run (its own count), when known.
    server_before: tuple[int, int] | None = None
    server_after: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    settings: dict[str, str] = field(default_factory=dict)
    #: Actions made during the run (`run_tool`'s `actions`): seconds since start when each began and
    #: ended, and what it returned.
    events: list[tuple[float, float, str]] = field(default_factory=list)

    # ----- derived figures

    def spans(self) -> list[tuple[float, float, float]]:
        """(start, end, messages per minute) of each interval of non-zero length."""
        return [(a.t, b.t, (b.messages - a.messages) * 60 / (b.t - a.t))
                for a, b in zip(self.ticks, self.ticks[1:]) if b.t > a.t]

    def rates(self) -> list[float]:
        """Messages per minute in each interval."""
        return [rate for _, _, rate in self.spans()]

    def window(self) -> tuple[int, int]:
        """(first, last+1) interval indexes averaged: the first is warm-up, then at most average_last."""
        n = len(self.ticks) - 1
        if n <= 0:
            return 0, 0
        start = 1 if n > 1 else 0
        return max(start, n - self.average_last), n

    def stat(self) -> tuple[float, float | None]:
        """Mean msgs/min over the averaged intervals and its sample standard deviation."""
        lo, hi = self.window()
        values = self.rates()[lo:hi]
        if not values:
            return 0.0, None
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)

    def cores(self, name: str) -> float | None:
        """Cores `name` used on average over the averaged intervals."""
        lo, hi = self.window()
        if hi <= lo:
            return None
        a, b = self.ticks[lo], self.ticks[hi]
        x, y = a.cpu.get(name), b.cpu.get(name)
        if x is None or y is None or b.t <= a.t:
            return None
        return max(0.0, y - x) / (b.t - a.t)

    def machine_cores(self) -> float | None:
        lo, hi = self.window()
        if hi <= lo:
            return None
        a, b = self.ticks[lo], self.ticks[hi]
        return (b.machine_busy - a.machine_busy) / (b.t - a.t) if b.t > a.t else None

    @property
    def total(self) -> int:
        return self.ticks[-1].messages if self.ticks else 0

    def mean_size(self) -> float | None:
        """Mean message size the server stored (its count), else what postal sends on average."""
        if self.server_before and self.server_after:
            n = abs(self.server_after[0] - self.server_before[0])
            if n:
                return abs(self.server_after[1] - self.server_before[1]) / n
        return None

    def mb_per_s(self) -> float | None:
        size = self.mean_size()
        return None if size is None else self.stat()[0] * size / 60e6

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LoadRun:
        data = dict(data)
        data["ticks"] = [Tick(**t) for t in data.get("ticks", [])]
        data["minutes"] = [Minute(**m) for m in data.get("minutes", [])]
        for key in ("server_before", "server_after"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        data["events"] = [tuple(e) for e in data.get("events", [])]
        return cls(**data)

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in f"{self.server}-{self.tool}-{self.sizes}").strip("-")

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"run-{self.slug}.json"
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path


class LineCounter:
    """Counts the lines of a file another process appends to, reading only what is new."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return self.lines
        self.offset += len(data)
        self.lines += data.count(b"\n")
        return self.lines


Probes = dict[str, Callable[[], float | None]]


def _wait_connections_closed(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until `proc` exits or holds no socket, at most `timeout` seconds. (postal, interrupted,
    finishes its messages in flight and closes its connections, but does not exit.)"""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and socket_inodes(proc.pid):
        time.sleep(0.05)


def run_tool(run: LoadRun, cmd: list[str], log_name: str, workdir: Path, seconds: float,
             probes: Probes | None = None, interrupt_first: bool = False, stop_when_drained: bool = False,
             actions: dict[float, Callable[[], str]] | None = None, say: Callable[[str], None] = print,
             messages: int | None = None) -> LoadRun:
    """Run `cmd` for `seconds` in its own directory, sampling its log and the probes every interval.
    With `stop_when_drained`, a retrieval stops once the mailboxes are empty (`messages`: what
    they held at the start, when known; see drop_drained_tail).

    `actions` maps seconds into the run to a call made then (a fault injected, say); what the call
    returns is noted in the run with its time.

    The tool is stopped at the deadline whatever happens (SIGINT first if asked, then SIGTERM,
    then SIGKILL) and its stdout/stderr are kept in the directory."""
    rundir = workdir / run.slug
    rundir.mkdir(parents=True, exist_ok=True)
    (rundir / log_name).unlink(missing_ok=True)  # a reused --out: the tool appends to its log
    probes = dict(probes or {})
    counter = LineCounter(rundir / log_name)
    stdbuf = shutil.which("stdbuf")
    full = ([stdbuf, "-oL"] if stdbuf else []) + cmd
    run.command = cmd
    out_path, err_path = rundir / "stdout.txt", rundir / "stderr.txt"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(die_with_us(full), cwd=rundir, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    # The load generator itself and its children (rabid forks one process per client).
    probes.setdefault(run.tool, lambda: tree_cpu(proc.pid))

    def tick(t0: float) -> None:
        cpu = {name: probe() for name, probe in probes.items()}
        run.ticks.append(Tick(time.monotonic() - t0, counter.count(), cpu, machine_cpu()[0]))

    run.started = time.time()
    t0 = time.monotonic()
    tick(t0)
    deadline = t0 + seconds
    pending = sorted((actions or {}).items())
    try:
        next_tick = t0 + run.interval
        while proc.poll() is None:
            now = time.monotonic()
            while pending and now - t0 >= pending[0][0]:
                at, action = pending.pop(0)
                what = action()
                run.events.append((now - t0, time.monotonic() - t0, what))
                run.notes.append(f"at {now - t0:.0f} s: {what}")
                say(f"    {now - t0:6.0f} s: {what}")
            if now >= min(next_tick, deadline) - 1e-3:
                tick(t0)
                last = run.ticks[-1]
                if len(run.ticks) > 1:
                    prev = run.ticks[-2]
                    rate = (last.messages - prev.messages) * 60 / max(last.t - prev.t, 1e-9)
                    say(f"    {run.tool} {last.t:6.0f} s {last.messages:7d} msgs  {rate:8.0f} msgs/min")
                if stop_when_drained and _drained(run.ticks, messages):
                    break  # every mailbox is empty: see drop_drained_tail
                if now >= deadline - 1e-3:
                    break
                next_tick += run.interval
            wake = min(next_tick, deadline, t0 + pending[0][0] if pending else deadline)
            time.sleep(max(0.0, wake - time.monotonic()))
        else:
            run.notes.append(f"{run.tool} exited by itself with {proc.returncode} after "
                             f"{time.monotonic() - t0:.0f} s")
            tick(t0)
    finally:
        if interrupt_first and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            _wait_connections_closed(proc, 5.0)
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                break
            proc.send_signal(sig)
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
    if stop_when_drained:
        drop_drained_tail(run, messages)
    after = counter.count()
    if after > run.total:
        run.notes.append(f"{after - run.total} more messages finished after the deadline (not in the series)")
    errors = error_messages(err_path.read_text(errors="replace"))
    run.error_lines = errors[:20]
    run.errors = len(errors)
    if run.tool == "postal":
        mean = postal_mean_size(*parse_range(run.sizes))
        run.minutes = [m for ln in out_path.read_text(errors="replace").splitlines()
                       if (m := parse_minute(ln, mean)) is not None]
        run.errors = max(run.errors, sum(m.errors for m in run.minutes))
    run.save(workdir / "json")
    return run


def _drained(ticks: list[Tick], messages: int | None = None) -> bool:
    """Every mailbox is empty: the tool took the `messages` that were there (when known), or two
    intervals went by without a message after some came."""
    if _took_all(ticks, messages):
        return True
    return len(ticks) >= 4 and ticks[-1].messages == ticks[-2].messages == ticks[-3].messages > 0


def _took_all(ticks: list[Tick], messages: int | None) -> bool:
    """Whether the last sample counts every one of the `messages` the mailboxes held (when known)."""
    return messages is not None and len(ticks) > 1 and ticks[-1].messages >= messages > 0


def drop_drained_tail(run: LoadRun, messages: int | None = None) -> None:
    """A retrieval that emptied the mailboxes is measured while mail was there: the intervals at
    its end without a message are dropped, whether the tool was stopped for them or by the
    deadline, and so is the interval in which it took the last messages (idle for part of it,
    with fewer and fewer sessions finding mail). `messages`: what the mailboxes held at the start,
    when known, so that a run that took the last of them in its last interval is seen to have
    emptied them. A run still busy at its deadline keeps them all."""
    ticks = run.ticks
    idle = 0
    while len(ticks) >= 2 and ticks[-1].messages == ticks[-2].messages > 0:
        ticks.pop()
        idle += 1
    emptied = idle > 0 or _took_all(ticks, messages)
    if emptied and len(ticks) >= 3:
        ticks.pop()
        run.notes.append(f"the mailboxes were empty after {ticks[-1].t:.0f} s or less: the {idle} idle intervals "
                         f"at the end and the one that emptied them were dropped")


def run_postal(server: str, port: int | Sequence[tuple[str, int]], sizes: tuple[int, int], users_file: Path,
               workdir: Path, seconds: float, threads: int = 32, per_connection: int = 10, interval: float = 60.0,
               average_last: int = 5, probes: Probes | None = None,
               actions: dict[float, Callable[[], str]] | None = None, say: Callable[[str], None] = print,
               rate: int = UNLIMITED_RATE) -> LoadRun:
    """postal -t THREADS against 127.0.0.1:port (or round-robin over several (host, port), THREADS
    each) for `seconds`, at most `rate` messages a minute; one recipient per message from users_file."""
    servers = [(HOST, port)] if isinstance(port, int) else list(port)
    lo_k, hi_k = postal_kib(*sizes)
    run = LoadRun("postal", server, range_label(*sizes), interval, average_last)
    run.settings = {"threads": str(threads), "messages per connection": f"1..{per_connection}"}
    cmd = ["postal", "-t", str(threads), "-c", str(per_connection), "-M", str(lo_k), "-m", str(hi_k),
           "-r", str(rate), ",".join(f"[{h}]{p}" for h, p in servers), str(users_file)]
    say(f"  {server}: {' '.join(cmd)}  ({seconds:g} s)")
    return run_tool(run, cmd, "postal.log", workdir, seconds, probes, interrupt_first=True, actions=actions, say=say)


def run_rabid(server: str, port: int, sizes: str, users_file: Path, workdir: Path, seconds: float,
              processes: int = 8, interval: float = 60.0, average_last: int = 5, probes: Probes | None = None,
              say: Callable[[str], None] = print, messages: int | None = None) -> LoadRun:
    """rabid -p PROCESSES against the POP3 server on 127.0.0.1:port for `seconds`: every session logs
    in, lists, retrieves and deletes every message (rabid's default -d 100:100) and quits.
    (rabid 0.76's IMAP mode, -i, cannot connect at all, here to Dovecot as to cassmail: IMAP load
    comes from the locustfile.)"""
    run = LoadRun("rabid", server, sizes, interval, average_last)
    run.settings = {"processes": str(processes)}
    cmd = ["rabid", "-p", str(processes), "-r", str(UNLIMITED_RATE), f"[{HOST}]{port}", str(users_file)]
    say(f"  {server}: {' '.join(cmd)}  ({seconds:g} s)")
    return run_tool(run, cmd, "rabid.log", workdir, seconds, probes, stop_when_drained=True, say=say,
                    messages=messages)


def write_users(users: Sequence[str], directory: Path, password: str = PASSWORD) -> tuple[Path, Path]:
    """(postal's recipients file, rabid's "address password" file)."""
    directory.mkdir(parents=True, exist_ok=True)
    postal_file, rabid_file = directory / "postal-users.txt", directory / "rabid-users.txt"
    postal_file.write_text("".join(u + "\n" for u in users))
    rabid_file.write_text("".join(f"{u} {password}\n" for u in users))
    return postal_file, rabid_file


# --------------------------------------------------------------------------- the store: users and counts


async def remove_users(store, domain: str, users: Sequence[str], concurrency: int = 16) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(user: str) -> None:
        async with limit:
            await store.delete_user(user)

    await asyncio.gather(*(one(u) for u in users))
    await store.remove_domain(domain)


class StoreSide:
    """The node's store opened in this process on a loop of its own, for set-up and counting
    between runs (the runs themselves are synchronous)."""

    def __init__(self, settings) -> None:
        self.loop = asyncio.new_event_loop()
        self.store = make_store(settings)
        self.loop.run_until_complete(self.store.open())

    def call(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.store.close())
        finally:
            self.loop.close()


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="postal and rabid against one cassmail node (or any SMTP/POP3 server).")
    p.add_argument("--smtp", metavar="HOST:PORT", help="where postal sends (127.0.0.0/8 only)")
    p.add_argument("--pop3", metavar="HOST:PORT", help="where rabid reads and deletes (127.0.0.0/8 only)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--config", metavar="FILE", default=os.environ.get("CASSMAIL_CONFIG"),
                     help="the node's settings: users are created in its store (default $CASSMAIL_CONFIG)")
    who.add_argument("--users-file", metavar="FILE", type=Path,
                     help="existing users, one 'address password' per line")
    p.add_argument("--users", type=number(int), default=100, help="users to create with --config (default 100)")
    p.add_argument("--sizes", type=parse_ranges, default=parse_ranges("200K-2M,50K-500K"),
                   help="message size ranges, uniform within each (default 200K-2M,50K-500K)")
    p.add_argument("--seconds", type=number(float), default=600.0,
                   help="length of each postal and each rabid run (default 600: the paper's 10 minutes)")
    p.add_argument("--interval", type=number(float, 0.5), default=60.0,
                   help="seconds per throughput sample (default 60)")
    p.add_argument("--average-last", type=number(int), default=5,
                   help="intervals averaged at the end of a run (default 5; the first is always warm-up)")
    p.add_argument("--threads", type=number(int), default=32, help="postal threads (default 32)")
    p.add_argument("--per-connection", type=int, default=10, help="postal -c (default 10)")
    p.add_argument("--processes", type=number(int), default=8, help="rabid processes (default 8)")
    p.add_argument("--server", default="cassmail", help="name of the server in the results (default cassmail)")
    p.add_argument("--out", type=Path, default=Path("loadtest-results"), help="directory for the JSON runs")
    p.add_argument("--keep", action="store_true", help="keep the users created with --config")
    admin = p.add_mutually_exclusive_group()
    admin.add_argument("--create-users", metavar="DOMAIN",
                       help="only create DOMAIN and --users users in it (password pw), print them and exit")
    admin.add_argument("--list-users", metavar="DOMAIN", help="only print the users of DOMAIN and exit")
    admin.add_argument("--remove-users", metavar="DOMAIN", help="only delete DOMAIN and all its users and exit")
    args = p.parse_args(argv)
    args.out = args.out.resolve()  # the tools run in directories of their own and read the users file from there
    if args.create_users or args.list_users or args.remove_users:
        if not args.config:
            p.error("the user commands need --config (the node's settings)")
        return args
    if not args.smtp and not args.pop3:
        p.error("nothing to do: give --smtp and/or --pop3")
    if not args.config and not args.users_file:
        p.error("give --config (the node's settings) or --users-file")
    for name in ("smtp", "pop3"):
        value = getattr(args, name)
        if value:
            host, _, port = value.rpartition(":")
            if not host.startswith("127.") and host != "localhost" or not port.isdigit():
                p.error(f"--{name} must be 127.x.x.x:PORT (load only ever goes to this machine's loopback)")
            setattr(args, name, (host, int(port)))
    return args


def manage_users(args: argparse.Namespace) -> int:
    """The user commands: set-up for other load generators (the locustfile uses them)."""
    side = StoreSide(config.load(args.config))
    try:
        if args.create_users:
            side.call(side.store.add_domain(args.create_users))
            users = side.call(make_users(side.store, args.create_users, args.users))
        elif args.list_users:
            users = side.call(side.store.list_users(args.list_users))
        else:
            side.call(remove_users(side.store, args.remove_users, side.call(side.store.list_users(args.remove_users))))
            users = []
    finally:
        side.close()
    print("".join(u + "\n" for u in users), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.create_users or args.list_users or args.remove_users:
        return manage_users(args)
    from baseline import ensure_packages

    ensure_packages(postal=True)
    workdir = args.out
    workdir.mkdir(parents=True, exist_ok=True)
    side: StoreSide | None = None
    domain = f"loadtest-{secrets.token_hex(4)}.example"
    users: list[str] = []
    runs: list[LoadRun] = []
    status = 0
    try:
        if args.users_file:
            pairs = [ln.split() for ln in args.users_file.read_text().splitlines() if ln.strip()]
            users = [p[0] for p in pairs]
            postal_file, rabid_file = write_users(users, workdir, pairs[0][1] if len(pairs[0]) > 1 else PASSWORD)
        else:
            side = StoreSide(config.load(args.config))
            side.call(side.store.add_domain(domain))
            users = side.call(make_users(side.store, domain, args.users))
            postal_file, rabid_file = write_users(users, workdir)
            print(f"created {len(users)} users in {domain}")
        cpu0 = own_cpu()
        for lo, hi in args.sizes:
            before = side.call(count_inboxes(side.store, users)) if side else None
            if args.smtp:
                run = run_postal(args.server, args.smtp[1], (lo, hi), postal_file, workdir, args.seconds,
                                 args.threads, args.per_connection, args.interval, args.average_last)
                if side:
                    run.server_before, run.server_after = before, side.call(count_inboxes(side.store, users))
                    before = run.server_after
                run.save(workdir / "json")
                runs.append(run)
            if args.pop3:
                run = run_rabid(args.server, args.pop3[1], range_label(lo, hi), rabid_file, workdir, args.seconds,
                                args.processes, args.interval, args.average_last,
                                messages=before[0] if before else None)
                if side:
                    run.server_before, run.server_after = before, side.call(count_inboxes(side.store, users))
                run.save(workdir / "json")
                runs.append(run)
        print(f"\nthis process used {own_cpu() - cpu0:.1f} CPU s")
    except KeyboardInterrupt:
        status = 130
    finally:
        if side is not None:
            if not args.keep and users:
                side.call(remove_users(side.store, domain, users))
            side.close()
    print()
    print("| tool | server | sizes | msgs/min (mean ± sd) | MB/s | messages | errors |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in runs:
        mean, sd = r.stat()
        mbs = r.mb_per_s()
        print(f"| {r.tool} | {r.server} | {r.sizes} | {mean:.0f}" + (f" ± {sd:.0f}" if sd is not None else "")
              + f" | {'-' if mbs is None else f'{mbs:.1f}'} | {r.total} | {r.errors} |")
    print(f"\nJSON runs in {workdir / 'json'}; report: .venv/bin/python loadtest/report.py {workdir}")
    return status or (1 if any(r.total == 0 for r in runs) else 0)


if __name__ == "__main__":
    sys.exit(main())
