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
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cassmail import config
from cassmail.config import ConfigError, Settings
from cassmail.store import make_store
from cassmail.store.base import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (JVM_PART_NAMES, RF1_CL_ONE, CassandraCpu, CassmailNode, children_map,  # noqa: E402
                     count_inboxes, die_with_us, human, jvm_parts_delta, machine_cpu, make_users, markdown,
                     parse_ranges, positive, run_cmd, tree_cpu)
from baseline import Postfix, ensure_packages  # noqa: E402
from postal import POSTAL_HEADERS, UNLIMITED_RATE, Minute, parse_minute  # noqa: E402

#: A run waits at most this long for Cassandra to calm down (flushes, compaction) first.
QUIET_MAX = 60.0
#: ... and calls it calm below this many cores.
QUIET_CORES = 0.25


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




def load_settings(args: argparse.Namespace) -> tuple[Settings, list[str]]:
    notes = []
    for item in args.overrides:
        key = item.split("=", 1)[0].strip()
        if key in RF1_CL_ONE or key == "store.cassandra.keyspace":
            notes.append(f"--set {key} ignored: this benchmark always uses a fresh keyspace, RF=1 and CL=ONE")
    fixed = [f"{k}={v}" for k, v in RF1_CL_ONE.items()]
    fixed.append(f"store.cassandra.keyspace=bench_smtp_{secrets.token_hex(5)}")
    return config.load(args.config, overrides=[*args.overrides, *fixed]), notes


# --------------------------------------------------------------------------- small helpers


def log(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- packages


# --------------------------------------------------------------------------- CPU accounting


GROUPS = ("cassmail", "Cassandra", "postal", "Postfix")


@dataclass
class Sample:
    at: float
    cpu: dict[str, float | None]
    machine_busy: float
    cassandra_parts: dict = field(default_factory=dict)


class CpuMeter:
    """Samples the CPU of the processes that take part in a run."""

    def __init__(self, cass: CassandraCpu) -> None:
        self.cass = cass
        self.cassmail_pid: int | None = None
        self.postfix_pid: int | None = None
        self.postal_pid: int | None = None

    def sample(self) -> Sample:
        kids = children_map()
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
            self.cass.parts() if self.cass.enabled else {},
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


# --------------------------------------------------------------------------- Postfix


# --------------------------------------------------------------------------- postal


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
    cassandra_parts: dict[str, tuple[float, int]] = field(default_factory=dict)
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
    await asyncio.to_thread(meter.cass.wait_quiet, QUIET_MAX, QUIET_CORES)
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
           "-r", str(UNLIMITED_RATE), f"[127.0.0.1]{port}", str(users_file)]
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
                    run.cassandra_parts = jvm_parts_delta(first.cassandra_parts, last.cassandra_parts)
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


def breakdown(runs: list[Run]) -> list[str]:
    """Per MB ingested in the measured minutes: CPU ms of cassmail, of each part of the Cassandra
    node and of Postfix in the same size range, and MB the Cassandra node wrote to storage."""
    head = ["server", "sizes", "MB ingested", "cassmail", "Cassandra",
            *(f"Cassandra: {p}" for p in JVM_PART_NAMES), "Postfix",
            "MB written / MB ingested", *(f"written: {p}" for p in JVM_PART_NAMES if p not in ("GC", "JIT"))]
    rows = []
    for r in runs:
        mb = sum(m.mb_per_s * 60 for m in r.minutes)
        if not mb or not r.cpu:
            continue
        parts = r.cassandra_parts

        def ms(seconds: float | None) -> str:
            return _fmt(None if seconds is None else seconds * 1000 / mb, ".2f")

        def ratio(written: int | None) -> str:
            return _fmt(None if written is None or not parts else written / 1e6 / mb, ".2f")

        total_written = sum(w for _, w in parts.values()) if parts else None
        rows.append([r.server, r.sizes, f"{mb:.0f}", ms(r.cpu.get("cassmail")), ms(r.cpu.get("Cassandra")),
                     *(ms(parts[p][0] if parts else None) for p in JVM_PART_NAMES), ms(r.cpu.get("Postfix")),
                     ratio(total_written),
                     *(ratio(parts[p][1] if parts else None) for p in JVM_PART_NAMES if p not in ("GC", "JIT"))])
    if not rows:
        return []
    return ["CPU ms per MB ingested, and bytes the Cassandra node wrote to storage per byte ingested "
            "(page-cache pages dirtied, by the thread that dirtied them; \"other\" holds threads that ended):",
            "", *markdown(head, rows, {0, 1})]


def describe(settings: Settings, args: argparse.Namespace, cass: CassandraCpu) -> list[str]:
    c = settings.store.cassandra
    workers = args.workers or os.cpu_count() or 1
    return [
        f"Cassandra          {', '.join(c.contact_points)} port {c.port}, keyspace {c.keyspace} (fresh), "
        f"SimpleStrategy RF=1, read ONE, write ONE",
        f"cassmail           {workers} worker(s), log level WARNING, MX listener only",
        f"postal             {args.threads} threads, 1..{args.per_connection} messages per connection, "
        f"one recipient per message out of {args.users} users, -r {UNLIMITED_RATE}",
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
        await asyncio.to_thread(ensure_packages, True, args.postfix, False, log)
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
    cassmail: CassmailNode | None = None
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
            cassmail = CassmailNode(settings, workdir, ["smtp"], args.workers)
            t = time.perf_counter()
            await asyncio.to_thread(cassmail.start)
            meter.cassmail_pid = cassmail.pid
            log(f"cassmail serve pid {meter.cassmail_pid} on 127.0.0.1:{cassmail.ports['smtp']} with {cassmail.workers} "
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
                run = await run_postal("cassmail", cassmail.ports["smtp"], label, lo, hi, args, users_file, meter, workdir)
                runs.append(run)
                if cassmail.process is not None and cassmail.process.poll() is not None:
                    run.notes.append(f"cassmail serve exited with {cassmail.process.returncode}")
                now = await count_inboxes(store, users)
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
    if any(r.cassandra_parts for r in runs):
        log("")
        for line in breakdown(runs):
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
