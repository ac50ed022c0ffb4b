"""IMAP benchmark: sessions/s, FETCH throughput and SELECT time on one `cassmail serve` node.

Not a test. It measures what the IMAP issue asks for:

    make cassandra && .venv/bin/python loadtest/bench_imap.py
    .venv/bin/python loadtest/bench_imap.py --set store.cassandra.port=29042 --mailboxes 10,10000,100000
    .venv/bin/python loadtest/bench_imap.py --set store.backend=mbox --set store.mbox.path=/tmp/bench-mbox

What it does:

1. On Cassandra a fresh `bench_imap_<random>` keyspace (SimpleStrategy RF=1, consistency ONE;
   dropped at the end); on the mbox store the configured directory (a temporary one unless
   `store.mbox.path` is set). A fresh domain; one user
   per --mailboxes size whose INBOX gets that many small messages (1-3 KB) through the Store
   API; one user whose INBOX gets --fetch-messages messages of --fetch-sizes.
2. One node (`cassmail serve`, IMAP only, --workers workers, log level WARNING).
3. SELECT: per mailbox size, the first SELECT (it gives UIDs to the messages that have none: on
   Cassandra one conditional batch per 1,024; the filling process numbers its mail ahead per
   `store.cassandra.number_ahead`, so `--set store.cassandra.number_ahead=0` leaves it all to the
   first SELECT) and then --selects more, one at a time, timed from the command to its tagged OK;
   then --selects more, each in a new session (on whichever worker takes it).
   Then SELECT after 10 flag changes by another session, plain and with QRESYNC, once the fill
   is older than the store's arrival window (`arrival_window`).
4. Header listing: per mailbox size, in a new session, `FETCH 1:* (UID FLAGS RFC822.SIZE
   BODY.PEEK[HEADER.FIELDS (FROM TO SUBJECT DATE)])` (a client's first sync) twice: the first
   reads every header from the store, the second finds them in the worker's header cache.
5. Sessions/s: --clients concurrent loops of connect, LOGIN, SELECT INBOX of the 10-message
   user, FETCH 1:* (FLAGS UID), LOGOUT for --seconds.
6. FETCH: --clients concurrent sessions on the FETCH user, each `UID FETCH n BODY.PEEK[]` for
   random messages for --seconds; every body is checked against its size. MB/s = 10^6 bytes/s.
7. CPU seconds of cassmail (serve and workers) and of the CassandraDaemon for phases 4 to 6.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    HOST,
    PASSWORD,
    CassandraCpu,
    CassmailNode,
    bench_settings,
    delta,
    fmt,
    make_users,
    markdown,
    parse_range,
    pct,
    positive,
)

from cassmail import config  # noqa: E402
from cassmail.config import ConfigError, Settings  # noqa: E402
from cassmail.store import make_store  # noqa: E402
from cassmail.store.base import Store, Target  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="IMAP benchmark: sessions/s, FETCH MB/s and SELECT time on one node.")
    p.add_argument("--config", metavar="FILE", help="cassmail TOML settings: which store (default: built-ins)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set store.cassandra.port=29042 (repeatable)")
    p.add_argument("--mailboxes", default="10,10000,100000",
                   help="mailbox sizes whose SELECT is timed (default 10,10000,100000)")
    p.add_argument("--selects", type=positive(int), default=5, help="SELECTs timed after the first (default 5)")
    p.add_argument("--fetch-messages", type=positive(int), default=200, help="messages of the FETCH user (default 200)")
    p.add_argument("--fetch-sizes", type=parse_range, default=parse_range("50K-500K"),
                   help="their sizes, uniform (default 50K-500K)")
    p.add_argument("--clients", type=positive(int), default=16, help="concurrent sessions (default 16)")
    p.add_argument("--seconds", type=positive(float), default=20.0, help="length of each load phase (default 20)")
    p.add_argument("--workers", type=int, default=0, help="cassmail worker processes (default 0 = one per core)")
    p.add_argument("--fill-concurrency", type=positive(int), default=64, help="deliveries in flight while filling")
    p.add_argument("--keep", action="store_true", help="keep the keyspace / directory and the work directory")
    args = p.parse_args(argv)
    try:
        args.mailbox_sizes = sorted({int(x) for x in args.mailboxes.split(",") if x.strip()})
    except ValueError:
        p.error("--mailboxes is a comma-separated list of numbers")
    if not args.mailbox_sizes or min(args.mailbox_sizes) < 1:
        p.error("--mailboxes needs sizes >= 1")
    return args


def load_settings(args: argparse.Namespace) -> Settings:
    backend = config.load(args.config, overrides=list(args.overrides)).store.backend
    return bench_settings(args.config, args.overrides, backend, "bench_imap")


# --------------------------------------------------------------------------- a small IMAP client


class Imap:
    """Just enough IMAP for the benchmarks: tagged commands, literals read exactly, APPEND with a
    synchronizing literal and IDLE ended by DONE, one command at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.n = reader, writer, 0

    @classmethod
    async def connect(cls, port: int) -> Imap:
        reader, writer = await asyncio.open_connection(HOST, port, limit=1 << 20)
        client = cls(reader, writer)
        greeting = await reader.readline()
        if not greeting.startswith(b"* OK"):
            raise RuntimeError(f"bad greeting {greeting!r}")
        return client

    def _send(self, text: str | bytes) -> bytes:
        self.n += 1
        tag = b"b%d" % self.n
        self.writer.write(tag + b" " + (text if isinstance(text, bytes) else text.encode()) + b"\r\n")
        return tag

    async def _reply(self, tag: bytes, continuation: bytes | None = None) -> Reply:
        """Lines up to the tagged one; on the server's first continuation request ("+ ...")
        `continuation` is sent (a literal, or DONE for IDLE)."""
        lines, literals = [], []
        while True:
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("connection closed")
            if line.startswith(b"+") and continuation is not None:
                self.writer.write(continuation)
                continuation = None
                continue
            lines.append(line)
            m = re.search(rb"\{(\d+)\}\r\n\Z", line)
            if m:
                literals.append(await self.reader.readexactly(int(m.group(1))))
            if line.startswith(tag + b" "):
                return Reply(line[len(tag) + 1:].split(b" ", 1)[0].upper().decode("ascii", "replace"), lines, literals)

    async def command(self, text: str) -> Reply:
        """One command and its reply, whatever its status."""
        return await self._reply(self._send(text))

    async def cmd(self, text: str) -> tuple[list[bytes], list[bytes]]:
        """(response lines, literals) of one command; raises unless it ends in OK."""
        reply = await self.command(text)
        if reply.status != "OK":
            raise RuntimeError(f"{text[:40]}: {reply.lines[-1]!r}")
        return reply.lines, reply.literals

    async def append(self, mailbox: str, message: bytes, flags: str = "") -> Reply:
        head = f"APPEND {mailbox} " + (f"({flags}) " if flags else "") + "{%d}" % len(message)
        return await self._reply(self._send(head), message + b"\r\n")

    async def idle(self) -> Reply:
        """IDLE, and DONE as soon as the server says it is idling."""
        return await self._reply(self._send("IDLE"), b"DONE\r\n")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.cmd("LOGOUT")
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


@dataclasses.dataclass
class Reply:
    status: str  # OK, NO or BAD
    lines: list[bytes]
    literals: list[bytes]


async def login(port: int, user: str) -> Imap:
    client = await Imap.connect(port)
    await client.cmd(f'LOGIN "{user}" "{PASSWORD}"')
    return client


# --------------------------------------------------------------------------- filling the store


def small_message(i: int) -> bytes:
    filler = b"x" * (1000 + (i * 37) % 2000)
    return b"From: s%d@remote.test\r\nSubject: small %d\r\n\r\n%s\r\n" % (i, i, filler)


def big_message(i: int, size: int) -> bytes:
    head = b"From: f%d@remote.test\r\nSubject: fetch %d\r\n\r\n" % (i, i)
    line = b"A" * 76 + b"\r\n"
    return head + line * max(0, (size - len(head)) // len(line))


async def fill(store: Store, user: str, bodies: list[bytes], concurrency: int) -> float:
    limit = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def one(body: bytes) -> None:
        async with limit:
            await store.deliver(body, [Target(user)])

    await asyncio.gather(*(one(b) for b in bodies))
    return time.perf_counter() - started


# --------------------------------------------------------------------------- phases


async def time_selects(port: int, user: str, expect: int, n: int) -> tuple[float, list[float], list[float]]:
    """The first SELECT and `n` more in its session (on its worker), then one in each of `n` new
    sessions a second apart, on whichever worker takes the connection: (first, again, new)."""
    client = await login(port, user)
    times = []
    try:
        for _ in range(n + 1):
            times.append(await time_select(client, user, expect))
    finally:
        await client.close()
    fresh = []
    for _ in range(n):
        await asyncio.sleep(1)  # (a client that comes back, not one racing the last one's LOGOUT)
        client = await login(port, user)
        try:
            fresh.append(await time_select(client, user, expect))
        finally:
            await client.close()
    return times[0], times[1:], fresh


async def time_select(client: Imap, user: str, expect: int) -> float:
    started = time.perf_counter()
    lines, _ = await client.cmd("SELECT INBOX")
    took = time.perf_counter() - started
    if b"* %d EXISTS\r\n" % expect not in lines:
        raise RuntimeError(f"SELECT of {user} did not show {expect} messages")
    return took


def arrival_window(settings: Settings) -> float:
    """Seconds of mail a refresh reads again at every look (Store.arrivals: on Cassandra the
    rows stamped that long before its last look, in case one landed late). Right after a fill
    at 1,000 messages/s that is 15,000 rows; the resyncs measure a client coming back to a
    mailbox whose mail is older than that."""
    if settings.store.backend != "cassandra":
        return 0.0
    from cassmail.store.cassandra import ARRIVAL_SKEW
    from cassmail.store.cassandra_counts import CHANGES_SETTLE

    return settings.store.cassandra.request_timeout + CHANGES_SETTLE + ARRIVAL_SKEW


async def time_resyncs(port: int, user: str, expect: int, n: int, changes: int = 10) -> tuple[list[float], list[float]]:
    """SELECT after `changes` flag changes made by another session, `n` times: a plain SELECT,
    then a QRESYNC one (RFC 7162) from the HIGHESTMODSEQ of the SELECT before, which must
    report exactly those messages. Both in one session, so on one worker (see MailboxView.load)."""
    client, changer = await login(port, user), await login(port, user)
    rng, keyword = random.Random(7), f"$b{secrets.token_hex(3)}_"
    plain, qresync = [], []
    try:
        await client.cmd("ENABLE QRESYNC")
        await changer.cmd("SELECT INBOX")
        lines, _ = await client.cmd("SELECT INBOX")
        for i in range(2 * n):
            uidvalidity = int(re.search(rb"UIDVALIDITY (\d+)", b"".join(lines)).group(1))
            highest = int(re.search(rb"HIGHESTMODSEQ (\d+)", b"".join(lines)).group(1))
            seqs = rng.sample(range(1, expect + 1), changes)
            for seq in seqs:
                await changer.cmd(f"STORE {seq} FLAGS.SILENT ({keyword}{i})")  # a change, whatever it had
            await client.cmd("UNSELECT")
            with_qresync = i % 2 == 1
            text = f"SELECT INBOX (QRESYNC ({uidvalidity} {highest}))" if with_qresync else "SELECT INBOX"
            started = time.perf_counter()
            lines, _ = await client.cmd(text)
            (qresync if with_qresync else plain).append(time.perf_counter() - started)
            if b"* %d EXISTS\r\n" % expect not in lines:
                raise RuntimeError(f"SELECT of {user} did not show {expect} messages")
            told = sum(1 for line in lines if b" FETCH (" in line)
            if with_qresync and told != changes:
                raise RuntimeError(f"QRESYNC told {told} changed messages, not {changes}")
    finally:
        await client.close()
        await changer.close()
    return plain, qresync


async def time_statuses(port: int, store: Store, user: str, expect: int, n: int) -> tuple[float, list[float]]:
    """STATUS of the mailbox from another session: the first, then `n` each after a new delivery
    (so that no worker can answer from what it counted before)."""
    client = await login(port, user)
    times = []
    try:
        for i in range(n + 1):
            if i:
                await store.deliver(small_message(10_000_000 + i), [Target(user)])
            started = time.perf_counter()
            lines, _ = await client.cmd("STATUS INBOX (MESSAGES UNSEEN UIDNEXT)")
            times.append(time.perf_counter() - started)
            if not any(b"MESSAGES %d " % (expect + i) in line for line in lines):
                raise RuntimeError(f"STATUS of {user} did not count {expect + i} messages: {lines}")
    finally:
        await client.close()
    return times[0], times[1:]


HEADER_LISTING = "FETCH 1:* (UID FLAGS RFC822.SIZE BODY.PEEK[HEADER.FIELDS (FROM TO SUBJECT DATE)])"


async def time_header_listing(port: int, user: str) -> tuple[int, float, float]:
    """What a mail client's first sync of a mailbox asks for (HEADER_LISTING) in a new session,
    twice: (messages, seconds of the first, seconds of the second). The first finds no header
    in the worker's cache; the second, in the same session and worker, finds them all."""
    client = await login(port, user)
    try:
        lines, _ = await client.cmd("SELECT INBOX")
        exists = next(int(line.split()[1]) for line in lines if line.endswith(b" EXISTS\r\n"))
        times = []
        for _ in range(2):
            started = time.perf_counter()
            lines, literals = await client.cmd(HEADER_LISTING)
            times.append(time.perf_counter() - started)
            fetched = sum(1 for line in lines if line.startswith(b"* ") and b" FETCH (" in line)
            if fetched != exists or sum(1 for literal in literals if b"Subject: " in literal) != exists:
                raise RuntimeError(f"{HEADER_LISTING} of {user} answered {fetched} messages of {exists}")
    finally:
        await client.close()
    return exists, times[0], times[1]


async def sessions_phase(port: int, user: str, clients: int, seconds: float) -> tuple[int, int, list[float]]:
    deadline = time.monotonic() + seconds
    done, errors, latencies = 0, 0, []

    async def loop() -> None:
        nonlocal done, errors
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                client = await login(port, user)
                await client.cmd("SELECT INBOX")
                await client.cmd("FETCH 1:* (FLAGS UID)")
                await client.close()
            except (OSError, RuntimeError, ConnectionError, asyncio.IncompleteReadError):
                errors += 1
                continue
            done += 1
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(loop() for _ in range(clients)))
    return done, errors, latencies


async def fetch_phase(port: int, user: str, sizes: dict[int, int], clients: int, seconds: float) -> tuple[int, int, int]:
    deadline = time.monotonic() + seconds
    fetched, nbytes, errors = 0, 0, 0
    uids = sorted(sizes)

    async def loop(seed: int) -> None:
        nonlocal fetched, nbytes, errors
        rng = random.Random(seed)
        client = await login(port, user)
        await client.cmd("EXAMINE INBOX")
        try:
            while time.monotonic() < deadline:
                uid = rng.choice(uids)
                _, literals = await client.cmd(f"UID FETCH {uid} BODY.PEEK[]")
                if len(literals) != 1 or len(literals[0]) != sizes[uid]:
                    errors += 1
                    continue
                fetched += 1
                nbytes += len(literals[0])
        finally:
            await client.close()

    await asyncio.gather(*(loop(i) for i in range(clients)))
    return fetched, nbytes, errors


async def uid_sizes(port: int, user: str) -> dict[int, int]:
    client = await login(port, user)
    try:
        await client.cmd("EXAMINE INBOX")
        lines, _ = await client.cmd("FETCH 1:* (UID RFC822.SIZE)")
    finally:
        await client.close()
    out = {}
    for line in lines:
        m = re.search(rb"UID (\d+) RFC822.SIZE (\d+)|RFC822.SIZE (\d+) UID (\d+)", line)
        if m:
            uid, size = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            out[int(uid)] = int(size)
    return out


# --------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, settings: Settings, store: Store, workdir: Path) -> list[str]:
    domain = f"bench-{secrets.token_hex(4)}.example"
    await store.add_domain(domain)
    users = await make_users(store, domain, len(args.mailbox_sizes) + 1)
    fetch_user, box_users = users[0], dict(zip(args.mailbox_sizes, users[1:]))
    rng = random.Random(1)
    out = [f"## IMAP benchmark, backend {settings.store.backend}, {os.cpu_count()} cores", ""]
    for size, user in box_users.items():
        seconds = await fill(store, user, [small_message(i) for i in range(size)], args.fill_concurrency)
        filled_at = time.monotonic()
        print(f"filled {user}: {size} messages in {seconds:.1f} s", flush=True)
    lo, hi = args.fetch_sizes
    fetch_bodies = [big_message(i, rng.randint(lo, hi)) for i in range(args.fetch_messages)]
    await fill(store, fetch_user, fetch_bodies, min(args.fill_concurrency, 16))
    node = CassmailNode(settings, workdir, ["imap"], workers=args.workers,
                        imap={"idle_poll": settings.imap.idle_poll}).start()
    port = node.ports["imap"]
    c = settings.store.cassandra
    cass = CassandraCpu(c.contact_points if settings.store.backend == "cassandra" else None, c.port)
    try:
        rows = []
        for size, user in box_users.items():
            first, rest, fresh = await time_selects(port, user, size, args.selects)
            rows.append([f"{size:,}", f"{first:.3f}", fmt(statistics.median(rest), ".3f"), fmt(max(rest), ".3f"),
                         fmt(statistics.median(fresh), ".3f"), fmt(max(fresh), ".3f")])
            print(f"SELECT {size}: first {first:.3f} s, then median {statistics.median(rest):.3f} s; "
                  f"new sessions {' '.join(f'{t:.3f}' for t in fresh)} s", flush=True)
        ahead = (f"; store.cassandra.number_ahead = {settings.store.cassandra.number_ahead}"
                 if settings.store.backend == "cassandra" else "")
        out += ["SELECT INBOX, seconds from command to tagged OK (the first one gives UIDs to the messages that have "
                f"none{ahead}):", ""]
        out += markdown(["messages", "first SELECT", "SELECT (median)", "SELECT (max)", "new session SELECT (median)",
                         "new session SELECT (max)"], rows, set())
        out.append("")
        rows = []
        wait = arrival_window(settings) - (time.monotonic() - filled_at)
        if wait > 0:  # (the mailboxes filled before the last one are older still)
            print(f"waiting {wait:.0f} s for the fill to leave the arrival window", flush=True)
            await asyncio.sleep(wait)
        for size, user in box_users.items():
            if size < 10:
                continue
            plain, qresync = await time_resyncs(port, user, size, args.selects)
            rows.append([f"{size:,}", *(fmt(f(t) * 1000, ".1f")
                                        for t in (plain, qresync) for f in (statistics.median, max))])
            print(f"after 10 changes {size}: SELECT median {statistics.median(plain) * 1000:.1f} ms, "
                  f"QRESYNC median {statistics.median(qresync) * 1000:.1f} ms", flush=True)
        out += ["SELECT INBOX again after 10 flag changes by another session, milliseconds: plain, and with QRESYNC "
                "(which reports the 10):", ""]
        out += markdown(["messages", "SELECT (median)", "SELECT (max)", "QRESYNC (median)", "QRESYNC (max)"],
                        rows, set())
        out.append("")
        rows = []
        for size, user in box_users.items():
            first, rest = await time_statuses(port, store, user, size, args.selects)
            rows.append([f"{size:,}", f"{first * 1000:.1f}", fmt(statistics.median(rest) * 1000, ".1f"),
                         fmt(max(rest) * 1000, ".1f")])
            print(f"STATUS {size}: first {first * 1000:.1f} ms, then median {statistics.median(rest) * 1000:.1f} ms",
                  flush=True)
        out += ["STATUS INBOX (MESSAGES UNSEEN UIDNEXT) from another session, milliseconds: the first, then each "
                "after one more delivery:", ""]
        out += markdown(["messages", "first STATUS", "STATUS (median)", "STATUS (max)"], rows, set())
        out.append("")

        rows = []
        for size, user in box_users.items():
            cpu0, cass0 = node.cpu(), cass.seconds()
            exists, first, again = await time_header_listing(port, user)
            cpu1, cass1 = node.cpu(), cass.seconds()
            rows.append([f"{exists:,}", f"{first:.3f}", f"{exists / first:,.0f}", fmt(delta(cpu0, cpu1)),
                         fmt(delta(cass0, cass1)), f"{again:.3f}"])
            print(f"header listing {exists}: first {first:.3f} s, again {again:.3f} s", flush=True)
        out += [f"`{HEADER_LISTING}` in a new session (a client's first sync), seconds from command to tagged OK: "
                "the first (the worker keeps no header of the mailbox yet), its CPU seconds, and a second in the "
                "same session:", ""]
        out += markdown(["messages", "first listing s", "messages/s", "cassmail CPU", "Cassandra CPU", "again s"],
                        rows, set())
        out.append("")

        cpu0, cass0, t0 = node.cpu(), cass.seconds(), time.perf_counter()
        done, errors, lat = await sessions_phase(port, box_users[min(box_users)], args.clients, args.seconds)
        elapsed = time.perf_counter() - t0
        cpu1, cass1 = node.cpu(), cass.seconds()
        sess_row = [f"sessions ({args.clients} clients)", f"{done / elapsed:.1f} sessions/s", "-",
                    fmt(pct(lat, 50), ".3f"), fmt(pct(lat, 99), ".3f"), str(errors),
                    fmt(delta(cpu0, cpu1)), fmt(delta(cass0, cass1))]
        print(f"sessions: {done / elapsed:.1f}/s", flush=True)

        sizes = await uid_sizes(port, fetch_user)
        cpu0, cass0, t0 = node.cpu(), cass.seconds(), time.perf_counter()
        fetched, nbytes, ferrors = await fetch_phase(port, fetch_user, sizes, args.clients, args.seconds)
        elapsed = time.perf_counter() - t0
        cpu1, cass1 = node.cpu(), cass.seconds()
        fetch_row = [f"UID FETCH BODY.PEEK[] ({args.clients} clients, {lo // 1000}K-{hi // 1000}K)",
                     f"{fetched / elapsed:.1f} msgs/s", f"{nbytes / elapsed / 1e6:.1f}", "-", "-", str(ferrors),
                     fmt(delta(cpu0, cpu1)), fmt(delta(cass0, cass1))]
        print(f"fetch: {nbytes / elapsed / 1e6:.1f} MB/s", flush=True)
        out += [f"Load phases, {args.seconds:g} s each ({node.workers} worker(s)); CPU in seconds over the phase:", ""]
        out += markdown(["phase", "rate", "MB/s", "p50 s", "p99 s", "errors", "cassmail CPU", "Cassandra CPU"],
                        [sess_row, fetch_row], {0})
        out += ["", f"Cassandra CPU: {cass.label}"]
    finally:
        print(node.stop(), flush=True)
    return out


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(args)
    except ConfigError as exc:
        print(f"bench_imap: {exc}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="bench_imap_"))
    made_keyspace = False
    if settings.store.backend == "cassandra":
        from cassmail.store import cassandra_schema

        await asyncio.to_thread(cassandra_schema.apply, settings.store.cassandra)
        made_keyspace = True
    elif settings.store.backend == "mbox" and settings.store.mbox.path == config.MboxSettings().path:
        settings.store.mbox = dataclasses.replace(settings.store.mbox, path=str(workdir / "mail"))
    store = make_store(settings)
    await store.open()
    try:
        lines = await run(args, settings, store, workdir)
    finally:
        await store.close()
        if made_keyspace and not args.keep:
            from cassmail.store import cassandra_schema

            await asyncio.to_thread(cassandra_schema.drop, settings.store.cassandra)
    print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
