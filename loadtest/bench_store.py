"""Store benchmark: drive a mail store directly through the Store contract and print a table.

Not a test. It measures what the protocol front ends would get from the store
alone (no SMTP/IMAP parsing), so a slow number here is the store's or the
database's, not a protocol's:

    make cassandra && .venv/bin/python loadtest/bench_store.py --seconds 20

It measures the Cassandra store unless the settings name another backend
(`--set store.backend=mbox`, CASSMAIL_STORE_BACKEND, or `backend` under
[store] in the --config / $CASSMAIL_CONFIG file): cassmail's own default
backend is mbox, which is what `serve` wants out of the box but not what this
benchmark is for. The backend measured is printed above the settings and
above the table.

Per size range it runs four phases, each bounded by --seconds and by
--max-messages: deliver (one recipient), list (INBOX pages of up to 500),
read (whole bodies, checked byte for byte) and copy (IMAP COPY of a delivered
message to Archive); plus one "deliver x3" phase (one call, three mailboxes)
at the first range. Sizes are decimal (K = 10^3,
M = 10^6) and MB/s means 10^6 bytes per second. Failed calls are counted
(errors column) and count towards --max-messages, but not towards ops/s, MB/s
or the latencies.

By default everything happens in a fresh `bench_<random>` keyspace, created
with the schema and dropped at the end, and a fresh `bench-<random>.example`
domain whose users are deleted at the end (--keep leaves both). With
--keyspace (or `--set store.cassandra.keyspace=...`) an existing keyspace is
used as it is: no schema change, never dropped.

The store is opened as a worker opens it (`serving=True`): on Cassandra the
benchmark's event loop reads and writes the driver's connections.

CPU: the benchmark's own process (getrusage, includes the driver's threads)
and, when Cassandra is on this host, the CassandraDaemon JVM (utime+stime
from /proc), per phase and for the run, so one can see who spent the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import sys
import time
import tomllib
import traceback
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cassmail import config
from cassmail.config import ConfigError, Settings
from cassmail.store import make_store
from cassmail.store.base import Store, StoreError, Target

from _common import CassandraCpu, human, make_users, own_cpu, parse_ranges, positive
from _common import fmt as _fmt

LIST_LIMIT = 500


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark a cassmail store through the Store contract (deliver, list, read).",
    )
    p.add_argument("--config", metavar="FILE", help="cassmail TOML settings (default: $CASSMAIL_CONFIG or built-ins)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a setting, e.g. --set store.cassandra.port=29042 or --set store.backend=mbox "
        "(repeatable; the backend is cassandra unless named here, in the environment or in the file)",
    )
    p.add_argument(
        "--keyspace", metavar="NAME",
        help="use this existing keyspace as is (default: create a fresh bench_<random> one and drop it after)",
    )
    p.add_argument("--keep", action="store_true", help="keep the users, domain and created keyspace")
    p.add_argument("--users", type=positive(int), default=50, help="users in the bench domain (default 50)")
    p.add_argument("--concurrency", type=positive(int), default=32, help="operations in flight (default 32)")
    p.add_argument("--seconds", type=positive(float), default=20.0, help="time limit per phase (default 20)")
    p.add_argument("--max-messages", type=positive(int), default=5000, help="operation limit per phase (default 5000)")
    p.add_argument(
        "--sizes", type=parse_ranges, default=parse_ranges("50K-500K,200K-2M"),
        help="comma-separated size ranges, uniform within each (default 50K-500K,200K-2M)",
    )
    return p.parse_args(argv)


def backend_named(args: argparse.Namespace, env: Mapping[str, str]) -> bool:
    """Whether the operator chose a backend: a flag, the environment or the settings file."""
    if any(o.split("=", 1)[0].strip() == "store.backend" for o in args.overrides):
        return True
    if env.get("CASSMAIL_STORE_BACKEND"):
        return True
    path = args.config or env.get("CASSMAIL_CONFIG")
    if not path:
        return False
    try:
        with open(path, "rb") as fh:
            store = tomllib.load(fh).get("store", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False  # config.load reports it with its own message
    return isinstance(store, dict) and "backend" in store


def load_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> tuple[Settings, bool]:
    """Settings to bench, and whether the keyspace is ours (fresh: create, then drop). The
    backend is Cassandra unless the operator named one (see the module docstring)."""
    env = os.environ if env is None else env
    overrides = list(args.overrides)
    if not backend_named(args, env):
        overrides.insert(0, "store.backend=cassandra")
    named = args.keyspace is not None or any(o.split("=", 1)[0].strip() == "store.cassandra.keyspace" for o in overrides)
    if args.keyspace is not None:
        overrides.append(f"store.cassandra.keyspace={args.keyspace}")
    elif not named:
        overrides.append(f"store.cassandra.keyspace=bench_{secrets.token_hex(5)}")
    settings = config.load(args.config, env=env, overrides=overrides)
    return settings, settings.store.backend == "cassandra" and not named


# --------------------------------------------------------------------------- CPU accounting


# --------------------------------------------------------------------------- phases


@dataclass
class PhaseResult:
    name: str
    sizes: str
    ops: int = 0
    seconds: float = 0.0
    bytes: int = 0
    items: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    first_error: dict[str, str] = field(default_factory=dict)
    bench_cpu: float = 0.0
    cass_cpu: float | None = None
    note: str = ""

    def rate(self, n: float) -> float:
        return n / self.seconds if self.seconds > 0 else 0.0

    def pct(self, q: float) -> float | None:
        """Nearest-rank percentile in ms."""
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        rank = max(1, -(-len(ordered) * q // 100))
        return ordered[int(rank) - 1] * 1000


#: An operation: given its sequence number, do one store call; return (bytes moved, items).
Op = Callable[[int], Awaitable[tuple[int, int]]]


async def run_phase(
    name: str, sizes: str, op: Op, concurrency: int, seconds: float, max_ops: int, cass: CassandraCpu
) -> PhaseResult:
    """Run `op` from `concurrency` workers until max_ops have started or time is up."""
    result = PhaseResult(name, sizes)
    issued = 0
    cpu0, cass0 = own_cpu(), cass.sample()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        nonlocal issued
        while issued < max_ops and time.perf_counter() < deadline:
            seq = issued
            issued += 1
            t0 = time.perf_counter()
            try:
                moved, items = await op(seq)
            except Exception as exc:  # noqa: BLE001 - a benchmark counts failures instead of stopping
                kind = type(exc).__name__
                result.errors[kind] += 1
                result.first_error.setdefault(kind, str(exc) or kind)
                continue
            result.latencies.append(time.perf_counter() - t0)
            result.bytes += moved
            result.items += items

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - start
    result.ops = len(result.latencies)
    result.bench_cpu = own_cpu() - cpu0
    result.cass_cpu = CassandraCpu.delta(cass0, cass.sample()) if cass.enabled else None
    print(f"  {name:<10} {sizes:<10} {result.ops:>6} ok {sum(result.errors.values()):>4} err "
          f"{result.seconds:6.1f} s {result.rate(result.ops):8.1f} ops/s {result.rate(result.bytes) / 1e6:8.1f} MB/s",
          flush=True)
    return result


@dataclass
class Delivered:
    user: str
    id: uuid.UUID
    offset: int
    size: int


class Bench:
    """The benchmark state: one open store, its users, and the random body pool."""

    def __init__(self, store: Store, users: list[str], args: argparse.Namespace, cass: CassandraCpu) -> None:
        self.store, self.users, self.args, self.cass = store, users, args, cass
        self.rng = random.Random()
        top = max(hi for _, hi in args.sizes)
        # One pool of random bytes, sliced per message: generating bodies costs nothing in the loop.
        self.pool = os.urandom(top + 1024 * 1024)
        self.view = memoryview(self.pool)

    def _body(self, lo: int, hi: int) -> tuple[int, int]:
        size = self.rng.randint(lo, hi)
        return self.rng.randint(0, len(self.pool) - size), size

    def phase(self, name: str, sizes: str, op: Op) -> Awaitable[PhaseResult]:
        a = self.args
        return run_phase(name, sizes, op, a.concurrency, a.seconds, a.max_messages, self.cass)

    async def deliver(self, lo: int, hi: int, label: str, recipients: int, keep: list[Delivered] | None) -> PhaseResult:
        async def op(_: int) -> tuple[int, int]:
            offset, size = self._body(lo, hi)
            users = self.rng.sample(self.users, recipients)
            ids = await self.store.deliver(self.view[offset : offset + size], [Target(u) for u in users])
            if keep is not None:
                keep.append(Delivered(users[0], ids[0], offset, size))
            return size, len(ids)

        name = "deliver" if recipients == 1 else f"deliver x{recipients}"
        result = await self.phase(name, label, op)
        if recipients > 1:
            result.note = f"{result.rate(result.items):.0f} copies/s; MB/s counts each body once"
        return result

    async def list(self, label: str) -> PhaseResult:
        async def op(seq: int) -> tuple[int, int]:
            page = await self.store.list_page(self.users[seq % len(self.users)], "INBOX", limit=LIST_LIMIT)
            return 0, len(page.items)

        result = await self.phase("list", label, op)
        per = result.items / result.ops if result.ops else 0
        result.note = f"{result.rate(result.items):.0f} summaries/s ({per:.0f} per listing)"
        return result

    async def read(self, label: str, delivered: list[Delivered]) -> PhaseResult:
        async def op(_: int) -> tuple[int, int]:
            m = self.rng.choice(delivered)
            pos = 0
            async for chunk in self.store.read_chunks(m.user, "INBOX", m.id):
                start = m.offset + pos
                if chunk != self.pool[start : start + len(chunk)]:
                    raise ValueError(f"body of {m.id} differs from what was delivered at byte {pos}")
                pos += len(chunk)
            if pos != m.size:
                raise ValueError(f"body of {m.id} is {pos} bytes, delivered {m.size}")
            return pos, 1

        result = await self.phase("read", label, op)
        result.note = f"bodies checked byte for byte; from {len(delivered)} delivered"
        return result

    async def copy(self, label: str, delivered: list[Delivered]) -> PhaseResult:
        """IMAP COPY (and MOVE's first half): a delivered message copied to Archive; the first
        copy is read back and checked byte for byte. The messages are given UIDs first, outside
        the phase, as an IMAP session's listing would have."""
        checked: list[bool] = []
        by_user: dict[str, list[uuid.UUID]] = {}
        for m in delivered:
            by_user.setdefault(m.user, []).append(m.id)
        for user, ids in by_user.items():
            await self.store.assign_uids(user, "INBOX", ids)

        async def op(_: int) -> tuple[int, int]:
            m = self.rng.choice(delivered)
            [copy] = await self.store.copy_messages(m.user, "INBOX", [m.id], "Archive")
            if not checked:
                checked.append(True)
                got = await self.store.read_message(m.user, "Archive", copy)
                if got != self.pool[m.offset : m.offset + m.size]:
                    raise ValueError(f"copy of {m.id} differs from what was delivered")
            return m.size, 1

        result = await self.phase("copy", label, op)
        result.note = "COPY INBOX -> Archive; MB/s counts the bytes copied"
        return result


# --------------------------------------------------------------------------- setup and report


def describe(settings: Settings, args: argparse.Namespace, created: bool, store: Store | None = None) -> list[str]:
    """The settings that decide the numbers, one per line."""
    s = settings.store
    lines = [f"backend            {s.backend}"]
    if s.backend == "cassandra":
        c = s.cassandra
        if c.replication_strategy == "NetworkTopologyStrategy":
            rf = "NetworkTopologyStrategy " + ", ".join(f"{dc}={n}" for dc, n in c.datacenters.items())
        else:
            rf = f"SimpleStrategy, replication_factor={c.replication_factor}"
        lines += [
            f"contact points     {', '.join(c.contact_points)} port {c.port}",
            f"keyspace           {c.keyspace} ({'created for this run' if created else 'existing, used as is'})",
            f"replication        {rf}  (from settings{'' if created else '; the keyspace may differ'})",
            f"consistency        read {c.read_consistency.upper()}, write {c.write_consistency.upper()}, "
            f"serial {c.serial_consistency.upper()}",
            f"chunk size         {c.chunk_size} bytes, {c.chunk_concurrency} chunk requests in flight per message",
            f"request timeout    {c.request_timeout:g} s",
        ]
        cluster = getattr(store, "_cluster", None)
        if cluster is not None:
            import cassandra

            lines.append(f"driver             cassandra-driver {cassandra.__version__}, {cluster.connection_class.__name__}")
    lines += [
        f"concurrency        {args.concurrency} operations in flight",
        f"users              {args.users}",
        f"per phase          at most {args.seconds:g} s and {args.max_messages} operations",
        f"sizes              {', '.join(f'{human(lo)}-{human(hi)}' for lo, hi in args.sizes)} (uniform; K=10^3, M=10^6)",
        f"host               {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start",
    ]
    return lines


def where(settings: Settings) -> str:
    """The store measured, in one phrase: the backend and where its data lives."""
    s = settings.store
    if s.backend == "cassandra":
        c = s.cassandra
        return f"{s.backend} store at {','.join(c.contact_points)}:{c.port}, keyspace {c.keyspace}"
    if s.backend == "mbox":
        return f"{s.backend} store in {s.mbox.path}"
    return f"{s.backend} store in {s.wheelfs.root}"


def table(results: list[PhaseResult], cass_on: bool) -> list[str]:
    head = ["phase", "sizes", "ops", "errors", "s", "ops/s", "MB/s", "p50 ms", "p95 ms", "p99 ms", "bench CPU s"]
    if cass_on:
        head.append("Cassandra CPU s")
    head.append("notes")
    rows = []
    for r in results:
        row = [
            r.name, r.sizes, str(r.ops), str(sum(r.errors.values())), f"{r.seconds:.1f}", f"{r.rate(r.ops):.1f}",
            "-" if r.name == "list" else f"{r.rate(r.bytes) / 1e6:.1f}",
            _fmt(r.pct(50)), _fmt(r.pct(95)), _fmt(r.pct(99)), f"{r.bench_cpu:.1f}",
        ]
        if cass_on:
            row.append(_fmt(r.cass_cpu))
        row.append(r.note)
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    right = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11} - ({11} if not cass_on else set())

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return [line(head), sep, *(line(r) for r in rows)]


async def delete_users(store: Store, users: list[str], concurrency: int) -> list[str]:
    """Delete the bench users; returns the failures (cleanup never hides the results)."""
    limit = asyncio.Semaphore(concurrency)
    failures: list[str] = []

    async def one(user: str) -> None:
        async with limit:
            try:
                await store.delete_user(user)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{user}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(u) for u in users))
    return failures


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings, created = load_settings(args)
    except ConfigError as exc:
        print(f"bench_store: {exc}", file=sys.stderr)
        return 2
    too_big = [hi for _, hi in args.sizes if settings.store.max_message_size and hi > settings.store.max_message_size]
    if too_big:
        print(f"bench_store: sizes up to {max(too_big)} exceed store.max_message_size "
              f"({settings.store.max_message_size})", file=sys.stderr)
        return 2
    try:
        store = make_store(settings, serving=True)  # (as a worker opens it: this loop does its I/O)
    except ConfigError as exc:
        print(f"bench_store: {exc}", file=sys.stderr)
        return 2

    c = settings.store.cassandra
    cass = CassandraCpu(c.contact_points, c.port) if settings.store.backend == "cassandra" else CassandraCpu(None)
    run_cpu0, run_cass0, run_t0 = own_cpu(), cass.sample(), time.perf_counter()
    results: list[PhaseResult] = []
    users: list[str] = []
    domain = f"bench-{secrets.token_hex(4)}.example"
    opened = False
    made = None  # None: no keyspace made; False: apply failed part way; True: made
    status = 0
    try:
        if created:
            from cassmail.store import cassandra_schema

            t = time.perf_counter()
            made = False
            await asyncio.to_thread(cassandra_schema.apply, c)
            made = True
            print(f"created keyspace {c.keyspace} in {time.perf_counter() - t:.1f} s", flush=True)
        await store.open()
        opened = True
        print(f"# cassmail store benchmark: {where(settings)}")
        for line in describe(settings, args, created, store):
            print("  " + line)
        print(f"  CPU accounting     bench process (getrusage); {cass.label}")
        print(flush=True)

        await store.add_domain(domain)
        t = time.perf_counter()
        users = await make_users(store, domain, args.users, args.concurrency)
        print(f"created {len(users)} users in {domain} in {time.perf_counter() - t:.1f} s", flush=True)

        bench = Bench(store, users, args, cass)
        for index, (lo, hi) in enumerate(args.sizes):
            label = f"{human(lo)}-{human(hi)}"
            delivered: list[Delivered] = []
            results.append(await bench.deliver(lo, hi, label, 1, delivered))
            results.append(await bench.list(label))
            if delivered:
                results.append(await bench.read(label, delivered))
                results.append(await bench.copy(label, delivered))
            else:
                print(f"  read, copy {label:<10} skipped: nothing was delivered", flush=True)
            if index == 0:
                if len(users) >= 3:
                    results.append(await bench.deliver(lo, hi, label, 3, None))
                else:
                    print("  deliver x3 skipped: needs --users >= 3", flush=True)
    except Exception as exc:  # noqa: BLE001 - still print what was measured and clean up
        print(f"\nbench_store: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
        if not isinstance(exc, StoreError):
            traceback.print_exc()
        status = 1
    finally:
        if opened and not args.keep:
            t = time.perf_counter()
            failures = await delete_users(store, users, args.concurrency)
            try:
                await store.remove_domain(domain)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"domain {domain}: {type(exc).__name__}: {exc}")
            print(f"\ncleanup: deleted {len(users) - len(failures)} users and the domain in "
                  f"{time.perf_counter() - t:.1f} s" + (f"; {len(failures)} failures" if failures else ""))
            for failure in failures[:5]:
                print(f"  {failure}")
        elif opened:
            print(f"\n--keep: left {len(users)} users in {domain}")
        if opened:
            await store.close()
        if made is not None and args.keep:
            print(f"--keep: left keyspace {c.keyspace}")
        elif made is not None:
            try:
                await asyncio.to_thread(cassandra_schema.drop, c)
                print(f"dropped keyspace {c.keyspace}")
            except Exception as exc:  # noqa: BLE001
                if made:  # after a failed apply the node is usually unreachable and there is nothing to drop
                    print(f"could not drop keyspace {c.keyspace}: {exc}", file=sys.stderr)
                    status = status or 1

    if not results:
        return status or 1

    run_cpu = own_cpu() - run_cpu0
    run_cass = CassandraCpu.delta(run_cass0, cass.sample()) if cass.enabled else None
    wall = time.perf_counter() - run_t0
    print()
    print(f"## results: {where(settings)}")
    for line in table(results, cass.enabled):
        print(line)
    for r in results:
        for kind, n in r.errors.items():
            print(f"errors in {r.name} {r.sizes}: {n} x {kind}, first: {r.first_error[kind]}")
    phase_cpu = sum(r.bench_cpu for r in results)
    phase_wall = sum(r.seconds for r in results)
    print()
    print(f"bench process CPU: {run_cpu:.1f} s over the whole run ({wall:.1f} s wall, setup and cleanup included); "
          f"{phase_cpu:.1f} s in the phases ({phase_wall:.1f} s wall, {phase_cpu / phase_wall if phase_wall else 0:.2f} cores)")
    if cass.enabled:
        phase_cass = sum(r.cass_cpu or 0.0 for r in results)
        print(f"Cassandra CPU:     {_fmt(run_cass)} s over the whole run; {phase_cass:.1f} s in the phases "
              f"({phase_cass / phase_wall if phase_wall else 0:.2f} cores) [{cass.label}]")
    else:
        print(f"Cassandra CPU:     {cass.label}")
    return status


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
