"""WheelFS store benchmark: deliveries/s and listing time on a local directory, against the mbox
and Cassandra stores, through the Store contract, in one bounded run. Not a test.

    .venv/bin/python loadtest/bench_wheelfs.py --cassandra 127.0.0.1:29042

For each store in turn (wheelfs with cues, wheelfs without, mbox, cassandra) it runs
bench_store.py's phases with its message sizes (deliver, one recipient, then list INBOX
pages of up to 500, per size range), then fills one mailbox with --mailbox-size small
messages and times a complete listing of it (the median of --listings runs, every summary,
no body read) and one "IMAP check" (mailbox info, listing, UIDs, UIDNEXT). For the WheelFS
store it also prints file-system operations per delivery and per check, the paper's measure.

The file stores work in a fresh directory under --dir (removed at the end), with fsync on as
in production; the Cassandra store in a fresh keyspace (dropped at the end). Each phase is
bounded by --seconds and --max-messages, so the whole run takes about two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_store import (  # noqa: E402
    Bench,
    CassandraCpu,
    PhaseResult,
    delete_users,
    human,
    make_users,
    parse_ranges,
    positive,
    table,
)

from cassmail.config import CassandraSettings, MboxSettings, Settings, WheelFSSettings, host_port  # noqa: E402
from cassmail.model import INBOX  # noqa: E402
from cassmail.store import make_store  # noqa: E402
from cassmail.store.base import Store, Target  # noqa: E402

STORES = ("wheelfs", "wheelfs-nocues", "mbox", "cassandra")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="WheelFS store vs mbox and Cassandra: deliveries/s and listing time.")
    p.add_argument("--cassandra", default="127.0.0.1:9042", metavar="HOST:PORT", help="Cassandra to compare with")
    p.add_argument("--stores", default=",".join(STORES), help=f"comma-separated, of {', '.join(STORES)}")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the file stores are made (default: temp dir)")
    p.add_argument("--users", type=positive(int), default=20, help="users per store (default 20)")
    p.add_argument("--concurrency", type=positive(int), default=16, help="operations in flight (default 16)")
    p.add_argument("--seconds", type=positive(float), default=6.0, help="time limit per phase (default 6)")
    p.add_argument("--max-messages", type=positive(int), default=1000, help="operation limit per phase (default 1000)")
    p.add_argument("--sizes", type=parse_ranges, default=parse_ranges("50K-500K,200K-2M"),
                   help="size ranges, as bench_store.py (default 50K-500K,200K-2M)")
    p.add_argument("--mailbox-size", type=positive(int), default=2000, help="messages in the listed mailbox (default 2000)")
    p.add_argument("--listings", type=positive(int), default=5, help="timed complete listings (default 5)")
    return p.parse_args(argv)


def settings_for(name: str, work: Path, args: argparse.Namespace) -> Settings:
    settings = Settings()
    settings.store.max_message_size = 64 * 1024 * 1024
    if name.startswith("wheelfs"):
        settings.store.backend = "wheelfs"
        settings.store.wheelfs = WheelFSSettings(root=str(work / name), cues=name == "wheelfs")
    elif name == "mbox":
        settings.store.backend = "mbox"
        settings.store.mbox = MboxSettings(path=str(work / name))
    else:
        host, port = host_port(args.cassandra, "--cassandra")
        settings.store.backend = "cassandra"
        settings.store.cassandra = CassandraSettings(
            contact_points=[host], port=port, keyspace=f"benchwfs_{int(time.time())}",
            read_consistency="ONE", write_consistency="ONE", serial_consistency="SERIAL",
        )
    return settings


async def timed_listing(store: Store, user: str, listings: int) -> tuple[float, int]:
    """Median seconds of a complete listing of the user's INBOX, and how many summaries it had."""
    times, count = [], 0
    for _ in range(listings):
        t0 = time.perf_counter()
        count = len([s async for s in store.list_messages(user, INBOX)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times), count


async def imap_check(store: Store, user: str) -> float:
    """What an IMAP SELECT or NOOP asks of the store when no mail is new."""
    t0 = time.perf_counter()
    await store.mailbox_info(user, INBOX)
    summaries = [s async for s in store.list_messages(user, INBOX)]
    await store.assign_uids(user, INBOX, [s.id for s in summaries if s.uid is None])
    await store.uid_next(user, INBOX)
    return time.perf_counter() - t0


async def fill(store: Store, user: str, n: int, concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limit:
            await store.deliver(b"Subject: listing %d\r\n\r\n" % i + b"x" * 2000, [Target(user)])

    await asyncio.gather(*(one(i) for i in range(n)))


async def bench_one(name: str, work: Path, args: argparse.Namespace) -> tuple[list[PhaseResult], dict[str, Any]]:
    settings = settings_for(name, work, args)
    made = False
    if name == "cassandra":
        from cassmail.store import cassandra_schema

        await asyncio.to_thread(cassandra_schema.apply, settings.store.cassandra)
        made = True
    store = make_store(settings)
    await store.open()
    results: list[PhaseResult] = []
    extra: dict[str, Any] = {}
    users: list[str] = []
    domain = f"bench-{name}.example"
    try:
        await store.add_domain(domain)
        users = await make_users(store, domain, args.users, args.concurrency)
        c = settings.store.cassandra
        cass = CassandraCpu(c.contact_points, c.port) if name == "cassandra" else CassandraCpu(None)
        bench = Bench(store, users, args, cass)
        fs = getattr(store, "fs", None)
        for lo, hi in args.sizes:
            label = f"{human(lo)}-{human(hi)}"
            before = fs.total if fs else 0
            result = await bench.deliver(lo, hi, label, 1, None)
            if fs and result.ops:
                result.note = f"{(fs.total - before) / (result.ops + sum(result.errors.values())):.0f} fs ops/delivery"
            results.append(result)
            results.append(await bench.list(label))
        for result in results:
            result.name = f"{name} {result.name}"
        listed = f"listed@{domain}"
        await store.create_user(listed, await store.get_password_hash(users[0]))
        users.append(listed)
        await fill(store, listed, args.mailbox_size, args.concurrency)
        extra["listing_s"], extra["listed"] = await timed_listing(store, listed, args.listings)
        await imap_check(store, listed)  # the first one assigns the UIDs
        if fs:
            with fs.counting() as ops:
                extra["check_s"] = await imap_check(store, listed)
            extra["check_ops"] = sum(ops.values())
        else:
            extra["check_s"] = await imap_check(store, listed)
    finally:
        failures = await delete_users(store, users, args.concurrency)
        if failures:
            print(f"  cleanup: {len(failures)} users not deleted, first: {failures[0]}")
        await store.close()
        if made:
            from cassmail.store import cassandra_schema

            await asyncio.to_thread(cassandra_schema.drop, settings.store.cassandra)
    return results, extra


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.stores.split(",") if n.strip()]
    unknown = [n for n in names if n not in STORES]
    if unknown:
        print(f"bench_wheelfs: unknown store(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-wheelfs-", dir=args.dir))
    print("# WheelFS store vs mbox and Cassandra (through the Store contract)")
    print(f"  file stores in {work} (fsync on); Cassandra {args.cassandra} (RF=1, CL=ONE)")
    print(f"  {args.users} users, {args.concurrency} in flight, at most {args.seconds:g} s and {args.max_messages} "
          f"operations per phase; listing: one mailbox of {args.mailbox_size} messages of 2 KB\n", flush=True)
    results: list[PhaseResult] = []
    listings: list[tuple[str, dict[str, Any]]] = []
    try:
        for name in names:
            print(f"{name}:", flush=True)
            try:
                phases, extra = await bench_one(name, work, args)
            except Exception as exc:  # noqa: BLE001 - one store failing still prints the others
                print(f"  {name} stopped by {type(exc).__name__}: {exc}", flush=True)
                continue
            results += phases
            listings.append((name, extra))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    for line in table(results, False):
        print(line)
    print()
    print("| store | messages listed | complete listing, median ms | IMAP check, ms | fs ops per IMAP check |")
    print("|---|---:|---:|---:|---:|")
    for name, extra in listings:
        ops = extra.get("check_ops")
        print(f"| {name} | {extra['listed']} | {extra['listing_s'] * 1000:.1f} | {extra['check_s'] * 1000:.1f} | "
              f"{'-' if ops is None else ops} |")
    return 0 if results else 1


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
