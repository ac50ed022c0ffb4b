"""IMAP IDLE at scale: what idle sessions cost a node, and how fast a change made on another node
reaches them.

Not a test:

    make cassandra && .venv/bin/python loadtest/bench_idle.py --set store.cassandra.port=9042
    .venv/bin/python loadtest/bench_idle.py --targets mbox --sessions 1000,10000 --users 1000

The goal it measures (the push-IDLE issue): a change made on any node reaches every idle session
on every node within 1 s; 10,000 idle IMAP sessions on one node under 1 GiB RSS of its processes
and under 5% of a core while nothing changes; what 1,000 idle sessions cost (CPU, Cassandra
reads/s).

Per target (mbox, cassandra), in a temporary directory:

1. The store: on Cassandra a fresh `bench_idle_<random>` keyspace (SimpleStrategy RF=1, consistency
   ONE; dropped at the end) of the Cassandra named by --config/--set; on mbox a fresh directory
   that both nodes share (two processes on one mbox root is how the mbox store runs
   multi-process). A fresh domain, --users users with the cheapest password hash (scrypt N=2^10:
   logins are not what is measured), each INBOX filled with --messages small messages through
   the Store API.
2. Two `cassmail serve` nodes on that store: node A (IMAP only, --workers workers, the metrics
   endpoint on) holds the idle sessions; node B (SMTP and IMAP) receives the changes. Queue
   workers are off on both (delivery.enabled = false): no mail leaves, and their once-a-second
   look at the queue is not IDLE's cost. imap.max_connections of node A is the largest session
   count (a worker may get more than its share of the connections: SO_REUSEPORT hashes them).
   This process raises its open-files limit to the hard limit; the nodes inherit it.
3. Node A at rest (no session) for --base-seconds.
4. For each count in --sessions (ascending): sessions are opened up to it, --open-concurrency at a
   time, over raw sockets (LOGIN, SELECT INBOX, IDLE); session i belongs to user i mod --users,
   so every user has count / users sessions. Then, after --settle seconds:
   a. idle: --idle-seconds with nothing changing (default 60: the IDLE watchers list every
      watched mailbox every imap.idle_refresh = 60 s and re-resolve its id as often, so a
      shorter window would miss or over-weigh those rounds): CPU seconds per second of node A's
      processes (the serve process, its workers and the metrics exporter, from /proc/PID/stat),
      the peak over 1 s, their RSS (sum of VmRSS: shared pages counted once per process) and PSS
      (shared pages split) at the end, node A's store calls per second by operation (its metrics
      endpoint, cassmail_store_seconds_count), and on Cassandra the CQL requests node A's
      connections made (system_views.clients request_count, its connections found from the
      sockets of its processes) and the reads per table of the keyspace
      (system_views.coordinator_read_latency and coordinator_scan_latency, both nodes: node B
      has no session and does nothing meanwhile), and the CassandraDaemon's CPU;
   b. push latency: --changes changes made on node B one at a time, alternately a delivery
      (SMTP) and a flag change (IMAP UID STORE +FLAGS/-FLAGS \\Flagged of the user's first
      message), each to the next user, after a random pause of 0..idle_poll s: the time from
      the change's last command sent (the end of DATA, the STORE) to each of that user's idle
      sessions on node A reading its untagged EXISTS or FETCH; the change's own reply time apart;
   c. changes flowing: --rate deliveries per second over SMTP to node B for --flow-seconds,
      spread over the users in turn, with node A's costs as in (a) and the latency of every
      idle session of each delivery's user.
   A session not told of a change 10 s after it (in c: nor 10 s after the phase's end) counts as
   not informed, apart from the latencies.
5. Markdown tables; --json writes the same figures.

Everything started is stopped at the end, the keyspace dropped and the directory removed
(--keep keeps them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    HOST,
    PASSWORD,
    CassandraCpu,
    CassmailNode,
    bench_settings,
    children_map,
    descendants,
    drop_keyspace,
    fmt,
    guarded_target,
    free_port,
    listening_inodes,
    machine_cpu,
    make_users,
    markdown,
    own_cpu,
    pct,
    positive,
    socket_inodes,
    tree_cpu,
)
from bench_imap import Imap, small_message  # noqa: E402

from cassmail.config import ConfigError, Settings  # noqa: E402
from cassmail.store import make_store  # noqa: E402
from cassmail.store.base import Target as Delivery  # noqa: E402

TARGETS = ("mbox", "cassandra")
#: Seconds a session is waited for after a change (while changes flow: also after the phase's end)
#: before it counts as not informed.
MISS_AFTER = 10.0
#: Seconds an idle session may take to open (LOGIN, SELECT, IDLE) before it counts as failed.
OPEN_TIMEOUT = 120.0


def say(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="IMAP IDLE at scale: idle sessions' cost on a node, push latency "
                                            "of changes made on another node.")
    p.add_argument("--config", metavar="FILE", help="cassmail TOML settings: the Cassandra to use (default: built-ins)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set store.cassandra.port=9042 (repeatable)")
    p.add_argument("--targets", default="mbox,cassandra", help="stores, in order (default mbox,cassandra)")
    p.add_argument("--sessions", default="1000,10000",
                   help="idle session counts measured in turn, ascending (default 1000,10000)")
    p.add_argument("--users", type=positive(int), default=1000, help="users; session i is user i mod users (1000)")
    p.add_argument("--messages", type=int, default=5, help="messages in every INBOX before the run (default 5)")
    p.add_argument("--workers", type=int, default=0, help="worker processes of each node (default 0 = one per core)")
    p.add_argument("--open-concurrency", type=positive(int), default=64,
                   help="sessions being opened at once (default 64)")
    p.add_argument("--base-seconds", type=float, default=10.0, help="node A at rest, no session (default 10)")
    p.add_argument("--open-limit", type=positive(float), default=240.0,
                   help="seconds to open each count's sessions; past it the count reached is measured (default 240)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds after the sessions are open (default 5)")
    p.add_argument("--idle-seconds", type=positive(float), default=60.0,
                   help="measured with nothing changing (default 60)")
    p.add_argument("--changes", type=int, default=50, help="changes timed one at a time (default 50)")
    p.add_argument("--rate", type=float, default=20.0, help="deliveries per second while changes flow (default 20)")
    p.add_argument("--flow-seconds", type=float, default=30.0, help="length of that phase (default 30; 0 skips it)")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    p.add_argument("--keep", action="store_true", help="keep the keyspace / directory")
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not args.targets or set(args.targets) - set(TARGETS):
        p.error(f"--targets: a list of {', '.join(TARGETS)}")
    try:
        args.levels = [int(x.replace("_", "")) for x in args.sessions.split(",") if x.strip()]
    except ValueError:
        p.error("--sessions is a comma-separated list of numbers")
    if not args.levels or min(args.levels) < 1 or args.levels != sorted(set(args.levels)):
        p.error("--sessions: counts >= 1, ascending")
    if args.messages < 1:
        p.error("--messages must be >= 1 (a flag change needs a message)")
    return args


# --------------------------------------------------------------------------- node A's processes


def node_pids(root: int | None) -> list[int]:
    if root is None:
        return []
    return [root, *descendants(root, children_map())]


def _status_kib(pid: int, key: str, path: str = "status") -> int:
    try:
        with open(f"/proc/{pid}/{path}") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory(pids: Sequence[int], metrics_port: int = 0, workers: int = 2) -> dict[str, Any]:
    """RSS and PSS in MiB, in all and per process: the serve process (with one worker it is the
    worker), the exporter (the child that holds the metrics endpoint) and the workers."""
    exporter = listening_inodes(metrics_port) if metrics_port else set()
    per = []
    for i, pid in enumerate(pids):
        if i == 0:
            role = "serve+worker" if workers == 1 else "supervisor"
        else:
            role = "exporter" if exporter & socket_inodes(pid) else "worker"
        per.append({"pid": pid, "what": role, "rss": _status_kib(pid, "VmRSS:") / 1024,
                    "pss": _status_kib(pid, "Pss:", "smaps_rollup") / 1024})
    return {"rss": sum(p["rss"] for p in per), "pss": sum(p["pss"] for p in per), "processes": per}


def tcp_table() -> list[tuple[int, int, str, str]]:
    """(local port, remote port, state, inode) of every TCP socket."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            next(fh, None)
            for line in fh:
                cols = line.split()
                if len(cols) > 9:
                    rows.append((int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16), cols[3], cols[9]))
    return rows


def cql_ports(pids: Sequence[int], cql_port: int) -> set[int]:
    """Local ports of the connections these processes hold to the CQL port."""
    inodes = set().union(*(socket_inodes(p) for p in pids)) if pids else set()
    return {local for local, remote, state, inode in tcp_table() if remote == cql_port and inode in inodes}


def sessions_per_process(pids: Sequence[int], imap_port: int) -> list[int]:
    """Established connections on the IMAP port held by each of the processes."""
    established = {inode for local, _, state, inode in tcp_table() if local == imap_port and state == "01"}
    counts = [len(socket_inodes(p) & established) for p in pids]
    return [n for n in counts if n]


def store_calls(metrics_port: int) -> dict[str, float]:
    """cassmail_store_seconds_count by op, from node A's metrics endpoint."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for m in re.finditer(r'^cassmail_store_seconds_count\{op="([^"]+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


class CassandraCounters:
    """Requests per client connection and reads per table of one keyspace, from Cassandra's
    virtual tables (system_views), through a driver session of this process."""

    def __init__(self, settings: Settings) -> None:
        from cassandra.cluster import Cluster

        c = settings.store.cassandra
        self.keyspace, self.port = c.keyspace, c.port
        self.cluster = Cluster(list(c.contact_points), port=c.port)
        self.session = self.cluster.connect()

    def requests(self) -> dict[int, int]:
        """request_count by client port (connections from 127.0.0.1 only: the nodes are local)."""
        return {r.port: r.request_count for r in self.session.execute(
            "SELECT address, port, request_count FROM system_views.clients")}

    def reads(self) -> dict[str, int]:
        """Single-partition reads and scans coordinated, per table of the keyspace."""
        out: dict[str, int] = {}
        for table, kind in (("coordinator_read_latency", "read"), ("coordinator_scan_latency", "scan")):
            for r in self.session.execute(f"SELECT table_name, count FROM system_views.{table} WHERE keyspace_name = %s",
                                          (self.keyspace,)):
                if r.count:
                    out[f"{r.table_name} ({kind})" if kind == "scan" else r.table_name] = r.count
        return out

    def close(self) -> None:
        self.cluster.shutdown()


# --------------------------------------------------------------------------- the clients


class IdleSession:
    """One session on node A: LOGIN, SELECT INBOX, IDLE; then every line the server sends is
    timed (EXISTS and FETCH are what a change brings)."""

    def __init__(self, index: int, user: str) -> None:
        self.index, self.user = index, user
        self.heard: list[tuple[float, str]] = []  # (perf_counter, "EXISTS" | "FETCH")
        self.other: list[bytes] = []
        self.news = asyncio.Event()
        self.closed = False
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self, port: int) -> None:
        client = await Imap.connect(port)
        self.writer = client.writer
        await client.cmd(f'LOGIN "{self.user}" "{PASSWORD}"')
        await client.cmd("SELECT INBOX")
        client.writer.write(b"i IDLE\r\n")
        line = await client.reader.readline()
        if not line.startswith(b"+"):
            raise RuntimeError(f"IDLE: {line!r}")
        self.task = asyncio.ensure_future(self._listen(client.reader))

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                now = time.perf_counter()
                if line.startswith(b"* ") and line.rstrip().endswith(b" EXISTS"):
                    self.heard.append((now, "EXISTS"))
                elif line.startswith(b"* ") and b" FETCH " in line:
                    self.heard.append((now, "FETCH"))
                elif not re.match(rb"\* \d+ RECENT\r\n", line):
                    self.other.append(line)
                self.news.set()
        except (OSError, asyncio.IncompleteReadError, ValueError):
            pass
        self.closed = True
        self.news.set()

    async def heard_after(self, start: int, kind: str, deadline: float) -> float | None:
        """perf_counter of the first `kind` line at or after heard[start], None by the deadline."""
        while True:
            self.news.clear()
            for at, k in self.heard[start:]:
                if k == kind:
                    return at
            if self.closed:
                return None
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.news.wait(), left)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.writer is not None:
            self.writer.close()


class Smtp:
    """One SMTP connection to node B, any number of transactions."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> Smtp:
        reader, writer = await asyncio.open_connection(HOST, port)
        client = cls(reader, writer)
        await client._reply(220)
        writer.write(b"EHLO bench-idle.localhost\r\n")
        await client._reply(250)
        return client

    async def _reply(self, code: int) -> bytes:
        while True:
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("SMTP connection closed")
            if line[3:4] != b"-":
                if not line.startswith(b"%d" % code):
                    raise RuntimeError(f"SMTP: expected {code}, got {line!r}")
                return line

    async def send(self, rcpt: str, body: bytes) -> tuple[float, float]:
        """(perf_counter when the end of DATA was sent, when its 250 came)."""
        self.writer.write(b"MAIL FROM:<idle-bench@remote.test>\r\n")
        await self._reply(250)
        self.writer.write(b"RCPT TO:<%s>\r\n" % rcpt.encode())
        await self._reply(250)
        self.writer.write(b"DATA\r\n")
        await self._reply(354)
        self.writer.write(body.replace(b"\r\n.", b"\r\n..") + b"\r\n.\r\n")
        sent = time.perf_counter()
        await self._reply(250)
        return sent, time.perf_counter()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.write(b"QUIT\r\n")
            await self.writer.drain()
        self.writer.close()


def push_message(n: int, rcpt: str) -> bytes:
    return (b"From: pusher@remote.test\r\nTo: %s\r\nSubject: push %d\r\n\r\n" % (rcpt.encode(), n)
            + b"x" * 1500 + b"\r\n")


# --------------------------------------------------------------------------- measurement


@dataclasses.dataclass
class Costs:
    """Node A over one phase."""

    seconds: float
    cores: float | None  # CPU seconds per second of node A's processes
    peak_cores: float | None  # the largest over one sample interval
    rss: float  # MiB at the end
    pss: float
    processes: list[dict[str, Any]]
    cql_requests: float | None  # per second, node A's connections
    peak_cql: float | None
    other_cql: float | None  # per second, node B's connections
    reads: dict[str, float]  # per second per table, the keyspace
    calls: dict[str, float]  # node A's store calls per second by op
    cassandra_cores: float | None
    client_cores: float
    machine_busy: float  # cores of the whole machine busy

    def row(self, label: str, sessions: int) -> list[str]:
        return [label, f"{sessions:,}", fmt(self.cores, ".3f"), fmt(None if self.cores is None else self.cores * 100, ".1f"),
                fmt(self.peak_cores, ".2f"), f"{self.rss:.0f}", f"{self.pss:.0f}", fmt(self.cql_requests, ".1f"),
                fmt(self.peak_cql, ".0f"), fmt(sum(self.reads.values()) if self.reads else None, ".1f"),
                fmt(self.cassandra_cores, ".3f"), f"{self.machine_busy:.2f}"]


COST_HEAD = ["phase", "sessions", "node A cores", "% of a core", "peak (1 s)", "RSS MiB", "PSS MiB",
             "node A CQL req/s", "peak (1 s)", "keyspace reads/s", "Cassandra cores", "machine busy cores"]


class Meter:
    """Samples node A every second during a phase (see the module's docstring, 4a)."""

    def __init__(self, target: StoreRun, interval: float = 1.0) -> None:
        self.t, self.interval = target, interval

    async def measure(self, seconds: float, work: Any = None) -> tuple[Costs, Any]:
        """Samples for `seconds` (while `work`, a coroutine, runs, if given: then until it ends)."""
        t = self.t
        cpu0, cass0, own0, mach0 = tree_cpu(t.node_a.pid), t.cass_cpu.seconds(), own_cpu(), machine_cpu()
        calls0 = store_calls(t.metrics_port)
        req0 = await asyncio.to_thread(t.counters.requests) if t.counters else {}
        reads0 = await asyncio.to_thread(t.counters.reads) if t.counters else {}
        started = time.perf_counter()
        samples: list[tuple[float, float | None, dict[int, int]]] = [(started, cpu0, req0)]
        task = asyncio.ensure_future(work) if work is not None else None
        try:
            while True:
                if task is None:
                    await asyncio.sleep(min(self.interval, max(0.0, started + seconds - time.perf_counter())))
                else:
                    await asyncio.wait({task}, timeout=self.interval)
                now = time.perf_counter()
                req = await asyncio.to_thread(t.counters.requests) if t.counters else {}
                samples.append((now, tree_cpu(t.node_a.pid), req))
                if task.done() if task is not None else now - started >= seconds - 1e-3:
                    break
        finally:
            if task is not None and not task.done():
                task.cancel()
        result = task.result() if task is not None else None
        elapsed = time.perf_counter() - started
        cpu1, cass1, own1, mach1 = tree_cpu(t.node_a.pid), t.cass_cpu.seconds(), own_cpu(), machine_cpu()
        calls1 = store_calls(t.metrics_port)
        reads1 = await asyncio.to_thread(t.counters.reads) if t.counters else {}
        mem = memory(node_pids(t.node_a.pid), t.metrics_port, t.node_a.workers)
        peak = None
        for (ta, ca, _), (tb, cb, _) in zip(samples, samples[1:]):
            if ca is not None and cb is not None and tb > ta:
                peak = max(peak or 0.0, (cb - ca) / (tb - ta))
        cql = peak_cql = other = None
        if t.counters:
            ports_a = cql_ports(node_pids(t.node_a.pid), t.counters.port) | t.ports_a
            t.ports_a = ports_a
            ports_b = cql_ports(node_pids(t.node_b.pid), t.counters.port) | t.ports_b
            t.ports_b = ports_b
            req1 = samples[-1][2]

            def grown(before: dict[int, int], after: dict[int, int], ports: set[int]) -> int:
                return sum(after[p] - before.get(p, 0) for p in ports if p in after)

            cql = grown(req0, req1, ports_a) / elapsed
            other = grown(req0, req1, ports_b) / elapsed
            for (ta, _, ra), (tb, _, rb) in zip(samples, samples[1:]):
                if tb > ta:
                    peak_cql = max(peak_cql or 0.0, grown(ra, rb, ports_a) / (tb - ta))
        busy = (mach1[0] - mach0[0]) / elapsed
        costs = Costs(
            seconds=elapsed,
            cores=None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / elapsed,
            peak_cores=peak, rss=mem["rss"], pss=mem["pss"], processes=mem["processes"],
            cql_requests=cql, peak_cql=peak_cql, other_cql=other,
            reads={k: (v - reads0.get(k, 0)) / elapsed for k, v in reads1.items() if v - reads0.get(k, 0) > 0},
            calls={k: (v - calls0.get(k, 0)) / elapsed for k, v in calls1.items() if v - calls0.get(k, 0) > 0},
            cassandra_cores=None if cass0 is None or cass1 is None else (cass1 - cass0) / elapsed,
            client_cores=(own1 - own0) / elapsed, machine_busy=busy)
        return costs, result


@dataclasses.dataclass
class Latencies:
    kind: str
    changes: int = 0
    informed: list[float] = dataclasses.field(default_factory=list)  # seconds, one per session and change
    missed: int = 0
    acks: list[float] = dataclasses.field(default_factory=list)  # seconds of the change's own reply
    failed: int = 0  # changes node B did not make

    def row(self, label: str, sessions: int) -> list[str]:
        lat = self.informed
        return [label, f"{sessions:,}", self.kind, str(self.changes), f"{len(lat):,}", str(self.missed),
                fmt(statistics.median(lat) if lat else None, ".3f"), fmt(pct(lat, 90), ".3f"),
                fmt(pct(lat, 99), ".3f"), fmt(max(lat) if lat else None, ".3f"),
                fmt(statistics.median(self.acks) if self.acks else None, ".3f")]


LAT_HEAD = ["phase", "sessions", "change", "changes", "sessions informed", "not informed", "median s", "p90 s", "p99 s",
            "max s", "change's reply s (median)"]


# --------------------------------------------------------------------------- one target


@dataclasses.dataclass
class Level:
    sessions: int
    opened: int
    open_seconds: float
    open_errors: dict[str, int]
    per_worker: list[int]
    idle: Costs | None = None
    idle_noise: int = 0  # untagged lines idle sessions got while nothing changed
    latency: dict[str, Latencies] = dataclasses.field(default_factory=dict)
    flow: Costs | None = None
    flow_latency: Latencies | None = None
    dropped: int = 0


class StoreRun:
    def __init__(self, name: str, settings: Settings, workdir: Path, args: argparse.Namespace) -> None:
        self.name, self.settings, self.workdir, self.args = name, settings, workdir, args
        self.node_a: CassmailNode
        self.node_b: CassmailNode
        self.metrics_port = 0
        self.counters: CassandraCounters | None = None
        c = settings.store.cassandra
        self.cass_cpu = CassandraCpu(c.contact_points if name == "cassandra" else None, c.port)
        self.ports_a: set[int] = set()
        self.ports_b: set[int] = set()
        self.made_keyspace = False
        self.users: list[str] = []
        self.sessions: list[IdleSession] = []
        self.by_user: dict[str, list[IdleSession]] = {}
        self.base: Costs | None = None
        self.levels: list[Level] = []
        self.notes: list[str] = []
        self.next_user = 0

    # ----------------------------------------------------------------- set-up

    async def prepare(self) -> None:
        args = self.args
        if self.name == "cassandra":
            from cassmail.store import cassandra_schema

            self.made_keyspace = True
            await asyncio.to_thread(cassandra_schema.apply, self.settings.store.cassandra)
        store = make_store(self.settings)
        await store.open()
        t0 = time.perf_counter()
        try:
            domain = f"idle-{secrets.token_hex(4)}.example"
            await store.add_domain(domain)
            self.users = await make_users(store, domain, args.users)
            say(f"  {len(self.users)} users in {time.perf_counter() - t0:.1f} s")
            t1 = time.perf_counter()
            todo = iter([(u, i) for i in range(args.messages) for u in self.users])

            async def deliverer() -> None:
                for user, i in todo:
                    await store.deliver(small_message(i), [Delivery(user)])

            await asyncio.gather(*(deliverer() for _ in range(32)))
            say(f"  {len(self.users) * args.messages} messages delivered through the Store API in "
                f"{time.perf_counter() - t1:.1f} s")
        finally:
            await store.close()

    def start(self) -> None:
        args, s = self.args, self.settings
        s = dataclasses.replace(s)
        s.delivery = dataclasses.replace(s.delivery, enabled=False)
        top = max(args.levels)
        self.metrics_port = free_port()
        a = dataclasses.replace(s)
        a.metrics = dataclasses.replace(s.metrics, enabled=True, listen=f"{HOST}:{self.metrics_port}")
        b = dataclasses.replace(s)
        b.metrics = dataclasses.replace(s.metrics, enabled=False)
        self.node_a = CassmailNode(a, self.workdir / "node-a", ["imap"], workers=args.workers, name="node-a",
                                   imap={"max_connections": top + 100}).start()
        self.node_b = CassmailNode(b, self.workdir / "node-b", ["smtp", "imap"], workers=args.workers,
                                   name="node-b").start()
        if self.name == "cassandra":
            self.counters = CassandraCounters(s)
        store = s.store
        where = (f"keyspace {store.cassandra.keyspace} on {','.join(store.cassandra.contact_points)}:{store.cassandra.port}"
                 f" (RF=1, CL ONE); {self.cass_cpu.label}" if self.name == "cassandra"
                 else f"mbox store in {store.mbox.path} (fsync {'on' if store.mbox.fsync else 'off'}), both nodes")
        self.notes.append(f"node A: pid {self.node_a.pid}, {self.node_a.workers} worker(s), IMAP :{self.node_a.ports['imap']}, "
                          f"imap.max_connections = {top + 100} per worker, idle_poll {s.imap.idle_poll:g} s, "
                          f"idle_refresh {s.imap.idle_refresh:g} s; node B: pid {self.node_b.pid}, "
                          f"{self.node_b.workers} worker(s); {where}")
        say("  " + self.notes[-1])

    # ----------------------------------------------------------------- phases

    async def open_sessions(self, count: int) -> Level:
        args, port = self.args, self.node_a.ports["imap"]
        errors: dict[str, int] = {}
        start = len(self.sessions)
        todo = iter(range(start, count))
        t0 = time.perf_counter()
        stop = False
        last_say = t0

        async def opener() -> None:
            nonlocal stop, last_say
            for i in todo:
                if stop or time.perf_counter() - t0 > args.open_limit:
                    stop = True
                    return
                s = IdleSession(i, self.users[i % len(self.users)])
                try:
                    await asyncio.wait_for(s.open(port), OPEN_TIMEOUT)
                except (OSError, RuntimeError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                    s.close()
                    key = f"{type(exc).__name__}: {str(exc)[:120]}"
                    errors[key] = errors.get(key, 0) + 1
                    if sum(errors.values()) > max(20, count // 100):
                        stop = True
                    continue
                self.sessions.append(s)
                self.by_user.setdefault(s.user, []).append(s)
                if time.perf_counter() - last_say > 15:
                    last_say = time.perf_counter()
                    say(f"    {len(self.sessions):,} sessions open ({(len(self.sessions) - start) / (last_say - t0):.0f}/s)")

        await asyncio.gather(*(opener() for _ in range(args.open_concurrency)))
        seconds = time.perf_counter() - t0
        pids = node_pids(self.node_a.pid)
        per_worker = await asyncio.to_thread(sessions_per_process, pids, port)
        level = Level(count, len(self.sessions), seconds, errors, per_worker)
        say(f"  {len(self.sessions):,} idle sessions open ({len(self.sessions) - start:,} new in {seconds:.1f} s, "
            f"{(len(self.sessions) - start) / seconds:.0f}/s); per worker {per_worker}"
            + (f"; errors {errors}" if errors else ""))
        return level

    async def idle_phase(self, level: Level) -> None:
        noise0 = sum(len(s.other) + len(s.heard) for s in self.sessions)
        level.idle, _ = await Meter(self).measure(self.args.idle_seconds)
        level.idle_noise = sum(len(s.other) + len(s.heard) for s in self.sessions) - noise0
        c = level.idle
        say(f"  idle {c.seconds:.0f} s: node A {fmt(c.cores, '.3f')} cores (peak {fmt(c.peak_cores, '.2f')}), "
            f"RSS {c.rss:.0f} MiB, PSS {c.pss:.0f} MiB, CQL {fmt(c.cql_requests, '.1f')} req/s; "
            f"store calls/s {_short(c.calls)}")

    def _user(self) -> str:
        """The next user that has an idle session, in turn."""
        users = [u for u in self.users if self.by_user.get(u)]
        user = users[self.next_user % len(users)]
        self.next_user += 1
        return user

    async def latency_phase(self, level: Level) -> None:
        args = self.args
        smtp = await Smtp.connect(self.node_b.ports["smtp"])
        stores: dict[str, Imap] = {}
        level.latency = {"delivery": Latencies("delivery"), "flags": Latencies("flags")}
        flagged: dict[str, bool] = {}
        rng = random.Random(7)
        try:
            for n in range(args.changes):
                await asyncio.sleep(rng.uniform(0, self.settings.imap.idle_poll))
                user = self._user()
                watchers = [s for s in self.by_user[user] if not s.closed]
                marks = [len(s.heard) for s in watchers]
                kind = "delivery" if n % 2 == 0 else "flags"
                lat = level.latency[kind]
                try:
                    if kind == "delivery":
                        sent, acked = await smtp.send(user, push_message(n, user))
                        want = "EXISTS"
                    else:
                        client = stores.get(user)
                        if client is None:
                            client = await Imap.connect(self.node_b.ports["imap"])
                            await client.cmd(f'LOGIN "{user}" "{PASSWORD}"')
                            await client.cmd("SELECT INBOX")
                            stores[user] = client
                        flagged[user] = not flagged.get(user, False)
                        tag = client._send(f"STORE 1 {'+' if flagged[user] else '-'}FLAGS.SILENT (\\Flagged)")
                        sent = time.perf_counter()
                        reply = await client._reply(tag)
                        acked = time.perf_counter()
                        if reply.status != "OK":
                            raise RuntimeError(f"STORE: {reply.lines[-1]!r}")
                        want = "FETCH"
                except (OSError, RuntimeError, ConnectionError, asyncio.IncompleteReadError) as exc:
                    lat.failed += 1
                    say(f"    change {n} ({kind}) failed: {exc}")
                    continue
                lat.changes += 1
                lat.acks.append(acked - sent)
                deadline = sent + MISS_AFTER
                heard = await asyncio.gather(*(s.heard_after(m, want, deadline) for s, m in zip(watchers, marks)))
                for at in heard:
                    if at is None:
                        lat.missed += 1
                    else:
                        lat.informed.append(at - sent)
        finally:
            await smtp.close()
            for client in stores.values():
                await client.close()
        for lat in level.latency.values():
            say(f"  push latency, {lat.kind}: {lat.changes} changes, {len(lat.informed)} sessions informed, median "
                f"{fmt(statistics.median(lat.informed) if lat.informed else None, '.3f')} s, max "
                f"{fmt(max(lat.informed) if lat.informed else None, '.3f')} s, {lat.missed} not informed")

    async def flow_phase(self, level: Level) -> None:
        args = self.args
        if args.flow_seconds <= 0 or args.rate <= 0:
            return
        connections = max(1, min(8, int(args.rate // 5) or 1))
        smtps = [await Smtp.connect(self.node_b.ports["smtp"]) for _ in range(connections)]
        lat = Latencies("delivery")
        sent_to: list[tuple[str, float, list[tuple[IdleSession, int]]]] = []
        total = int(args.rate * args.flow_seconds)

        async def sender(k: int, smtp: Smtp) -> None:
            t0 = time.perf_counter()
            for n in range(k, total, connections):
                due = t0 + n / args.rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                user = self._user()
                marks = [(s, len(s.heard)) for s in self.by_user[user] if not s.closed]
                try:
                    sent, acked = await smtp.send(user, push_message(n, user))
                except (OSError, RuntimeError, ConnectionError, asyncio.IncompleteReadError) as exc:
                    lat.failed += 1
                    say(f"    delivery failed: {exc}")
                    continue
                lat.changes += 1
                lat.acks.append(acked - sent)
                sent_to.append((user, sent, marks))

        async def work() -> None:
            await asyncio.gather(*(sender(k, s) for k, s in enumerate(smtps)))

        level.flow, _ = await Meter(self).measure(args.flow_seconds, work())
        for smtp in smtps:
            await smtp.close()
        deadline = time.perf_counter() + MISS_AFTER
        for _, sent, marks in sent_to:
            heard = await asyncio.gather(*(s.heard_after(m, "EXISTS", max(deadline, sent + MISS_AFTER)) for s, m in marks))
            for at in heard:
                if at is None:
                    lat.missed += 1
                else:
                    lat.informed.append(at - sent)
        level.flow_latency = lat
        c = level.flow
        say(f"  flow {lat.changes} deliveries in {c.seconds:.0f} s ({lat.changes / c.seconds:.1f}/s): node A "
            f"{fmt(c.cores, '.3f')} cores, CQL {fmt(c.cql_requests, '.1f')} req/s; latency median "
            f"{fmt(statistics.median(lat.informed) if lat.informed else None, '.3f')} s, max "
            f"{fmt(max(lat.informed) if lat.informed else None, '.3f')} s, {lat.missed} not informed")

    async def run(self) -> None:
        args = self.args
        waited = await asyncio.to_thread(self.cass_cpu.wait_quiet, 90.0, 0.3)
        if waited > 6:
            say(f"  waited {waited:.0f} s for Cassandra to finish flushing and compacting the fill")
        if args.base_seconds > 0:
            self.base, _ = await Meter(self).measure(args.base_seconds)
            say(f"  at rest: node A {fmt(self.base.cores, '.3f')} cores, RSS {self.base.rss:.0f} MiB, "
                f"CQL {fmt(self.base.cql_requests, '.1f')} req/s")
        for count in args.levels:
            level = await self.open_sessions(count)
            self.levels.append(level)
            if level.opened < count:
                why = (f"errors {level.open_errors}" if sum(level.open_errors.values()) > max(20, count // 100)
                       else f"--open-limit ({args.open_limit:g} s) ran out" + (f"; errors {level.open_errors}"
                                                                                 if level.open_errors else ""))
                self.notes.append(f"{count:,} sessions asked, {level.opened:,} opened in {level.open_seconds:.0f} s: {why}")
                say("  " + self.notes[-1])
            await asyncio.sleep(args.settle)
            await self.idle_phase(level)
            if args.changes > 0:
                await self.latency_phase(level)
            await self.flow_phase(level)
            level.dropped = sum(1 for s in self.sessions if s.closed)
            if level.dropped:
                say(f"  {level.dropped} idle sessions were closed by the server")
            if level.opened < count:
                break

    async def stop(self) -> list[str]:
        for s in self.sessions:
            s.close()
        await asyncio.sleep(0.5)
        out = []
        for node in (getattr(self, "node_a", None), getattr(self, "node_b", None)):
            if node is None:
                continue
            status = node.stop()
            out.append(f"{node.config.stem}: {status}")
            lines = node.log_text(20_000_000).splitlines()
            problems = [i for i, ln in enumerate(lines) if "level=error" in ln or "Traceback" in ln]
            if problems:
                out.append(f"  its log had {len(problems)} error line(s), the first:")
                out += ["    " + ln[:300] for ln in lines[problems[0]:problems[0] + 25]]
            if problems or not status.startswith("stopped"):
                kept = Path(tempfile.gettempdir()) / f"bench_idle-{self.name}-{node.config.stem}-{node.pid}.log"
                with contextlib.suppress(OSError):
                    shutil.copyfile(node.log_path, kept)
                    out.append(f"  its log is kept in {kept}")
        if self.counters is not None:
            await asyncio.to_thread(self.counters.close)
        if self.made_keyspace and not self.args.keep:
            out.append(await drop_keyspace(self.settings.store.cassandra))
        return out


def _short(calls: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])) or "none"


# --------------------------------------------------------------------------- output


def tables(targets: list[StoreRun]) -> list[str]:
    out = ["Node A's costs (CPU seconds per second of its processes; memory at the end of the phase; "
           "CQL requests of its own connections):", ""]
    rows = []
    for t in targets:
        if t.base is not None:
            rows.append(t.base.row(f"{t.name}: at rest", 0))
        for lv in t.levels:
            if lv.idle is not None:
                rows.append(lv.idle.row(f"{t.name}: idle", lv.opened))
            if lv.flow is not None and lv.flow_latency is not None:
                rows.append(lv.flow.row(f"{t.name}: {lv.flow_latency.changes / lv.flow.seconds:.1f} deliveries/s", lv.opened))
    out += markdown(COST_HEAD, rows, {0})
    out += ["", "Push latency: from the change's last command sent on node B to each idle session of its user on "
            "node A reading its EXISTS (delivery) or FETCH (flag change):", ""]
    rows = []
    for t in targets:
        for lv in t.levels:
            for lat in lv.latency.values():
                rows.append(lat.row(f"{t.name}: one at a time", lv.opened))
            if lv.flow_latency is not None:
                rows.append(lv.flow_latency.row(f"{t.name}: while flowing", lv.opened))
    out += markdown(LAT_HEAD, rows, {0, 2})
    out += ["", "Opening the sessions (LOGIN, SELECT INBOX, IDLE) and where they went:", ""]
    rows = []
    for t in targets:
        for lv in t.levels:
            rows.append([t.name, f"{lv.sessions:,}", f"{lv.opened:,}", f"{lv.open_seconds:.1f}",
                         " / ".join(f"{n:,}" for n in lv.per_worker), str(sum(lv.open_errors.values())),
                         str(lv.idle_noise), str(lv.dropped)])
    out += markdown(["store", "sessions asked", "open", "seconds to open", "per worker", "open errors",
                     "lines while idle", "dropped"], rows, {0})
    out += ["", "Node A's store calls per second while idle, by operation (its metrics endpoint):", ""]
    for t in targets:
        for lv in t.levels:
            if lv.idle is not None:
                out.append(f"- {t.name}, {lv.opened:,} sessions: {_short(lv.idle.calls)}")
                if lv.idle.reads:
                    out.append(f"  - reads/s per table of the keyspace (both nodes): {_short(lv.idle.reads)}")
                mem = ", ".join(f"{p['what']} {p['rss']:.0f}/{p['pss']:.0f}" for p in lv.idle.processes)
                out.append(f"  - RSS/PSS MiB per process: {mem}")
    return out


def to_json(targets: list[StoreRun], preface: list[str]) -> dict[str, Any]:
    def costs(c: Costs | None) -> dict[str, Any] | None:
        return dataclasses.asdict(c) if c is not None else None

    def lat(x: Latencies) -> dict[str, Any]:
        v = x.informed
        return {"kind": x.kind, "changes": x.changes, "informed": len(v), "missed": x.missed, "failed": x.failed,
                "median": statistics.median(v) if v else None, "p90": pct(v, 90), "p99": pct(v, 99),
                "max": max(v) if v else None, "ack_median": statistics.median(x.acks) if x.acks else None}

    return {"preface": preface, "targets": {t.name: {
        "notes": t.notes, "base": costs(t.base),
        "levels": [{"sessions": lv.sessions, "opened": lv.opened, "open_seconds": lv.open_seconds,
                    "open_errors": lv.open_errors, "per_worker": lv.per_worker, "idle": costs(lv.idle),
                    "idle_noise": lv.idle_noise, "dropped": lv.dropped,
                    "latency": {k: lat(v) for k, v in lv.latency.items()}, "flow": costs(lv.flow),
                    "flow_latency": lat(lv.flow_latency) if lv.flow_latency else None}
                   for lv in t.levels]} for t in targets}}


# --------------------------------------------------------------------------- main


def code_state() -> str:
    """The commit measured, and the files changed since it (others may be working in the tree)."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h %cd", "--date=format:%Y-%m-%d %H:%M"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no", "--", "cassmail"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"commit {head}" + (f", with uncommitted changes to {', '.join(changed)}" if changed else "")


def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench_idle_"))
    try:
        settings = {t: bench_settings(args.config, args.overrides, t, "bench_idle", mbox_path=workdir / "mbox-store")
                    for t in args.targets}
    except ConfigError as exc:
        print(f"bench_idle: {exc}", file=sys.stderr)
        return 2
    nofile = raise_nofile()
    need = max(args.levels) + 200
    preface = [
        f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.uname().nodename}: {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- command: `{' '.join(['.venv/bin/python', 'loadtest/bench_idle.py', *(sys.argv[1:] if argv is None else argv)])}`",
        f"- code: {code_state()}",
        f"- {args.users:,} users, {args.messages} messages per INBOX; sessions {', '.join(f'{n:,}' for n in args.levels)}; "
        f"idle {args.idle_seconds:g} s; {args.changes} changes one at a time; {args.rate:g} deliveries/s for "
        f"{args.flow_seconds:g} s; open files limit {nofile[0]} (this process and the nodes)",
    ]
    if nofile[0] < need:
        preface.append(f"- warning: the open files limit ({nofile[0]}) is below the sessions asked ({need}): "
                       "expect the largest count to fail")
    say("# IMAP IDLE: idle sessions' cost and push latency")
    for line in preface:
        say(line)
    done: list[StoreRun] = []
    status = 0
    for name in args.targets:
        say(f"\n## {name}")
        target = StoreRun(name, settings[name], workdir / f"{name}-nodes", args)

        async def measure(target: StoreRun = target) -> None:
            await target.prepare()
            target.start()
            await target.run()

        status = await guarded_target(name, measure, target.stop, workdir, ("mbox-store", f"{name}-nodes"),
                                      args.keep, say) or status
        done.append(target)
        if status == 130:
            break
    if args.keep:
        say(f"--keep: left {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    say("\n## results\n")
    for t in done:
        for note in t.notes:
            say(f"- {t.name}: {note}")
    say("")
    for line in tables(done):
        say(line)
    if args.json:
        args.json.write_text(json.dumps(to_json(done, preface), indent=1))
    return status or (0 if any(t.levels for t in done) else 1)


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
