"""POP3 benchmark: one `cassmail serve` node per page size, driven by rabid or a Python client.

Not a test. Issue 4: "Debian's rabid (postal's POP3 load generator) or an equivalent
driver against one node: messages/min and MB/s retrieved and deleted", and the
effect of the batch size in which a login reads the mailbox listing
(`pop3.page_size`, CassMail's "batch size"):

    make cassandra && .venv/bin/python loadtest/bench_pop3.py --seconds 60
    .venv/bin/python loadtest/bench_pop3.py --set store.cassandra.port=29042 \\
        --users 20 --messages-per-user 20 --page-sizes 10,500 --seconds 30

What it does:

1. A fresh `bench_pop3_<random>` keyspace (schema applied, SimpleStrategy RF=1, read and
   write consistency ONE), a fresh domain, --users users (password "pw", cheap hash) whose
   INBOXes get --messages-per-user messages each through the Store API (sizes uniform in
   --sizes; a few header lines, then base64 text cut from one random pool: 76-character
   lines like an attachment, so every client can read it), and one extra user with
   --big-mailbox small messages, never retrieved, to time the login of a large mailbox.
2. Per page size: a TOML config (POP3 only on a free 127.0.0.1 port, plaintext USER/PASS
   allowed, no login slow-down; log level WARNING, or INFO with rabid, see below),
   `cassmail --config FILE serve`, then:
   - the large-mailbox login, --big-logins times with no other load: connect .. "+OK" of
     PASS (the whole listing is read at PASS, `page_size` summaries per store request), STAT;
   - the driver for --seconds/--minutes with --clients concurrent sessions. Every session:
     connect, USER/PASS, LIST, RETR and DELE every message, QUIT (the deletions happen at QUIT).
     * rabid (`apt-get install postal`): `rabid -p CLIENTS [127.0.0.1]PORT USERFILE` (it sends
       CAPA, USER/PASS, LIST, then RETR and DELE per message, QUIT; no STAT/UIDL; -d 100:100,
       delete everything retrieved, is its default). It never stops on its own, so it is
       killed at the deadline: sessions in progress end without QUIT and delete nothing.
       rabid 0.76 prints its CSV header but no statistics line while it runs, so cassmail
       runs at log level INFO for it and its sessions and RETRs are counted from cassmail's
       session lines (two lines per session); deletions are counted through the store.
       Login times come from a probe in this process (one login at a time, USER/PASS/QUIT,
       deleting nothing) running beside rabid; the notes add the server-side PASS time of
       every rabid login from the same log.
     * python: asyncio sessions in this process that also send STAT and UIDL, check every
       RETR byte for byte against what was delivered, stop starting new RETRs at the
       deadline and QUIT, so every session ends cleanly. Login times are those of the
       sessions themselves.
   Mailboxes are topped up to --messages-per-user between runs, so every run starts with
   the same counts. Deleted rows stay tombstones in the mailbox partition (for
   `store.cassandra.tombstone_grace`, default 3 h), so later runs list past the earlier
   runs' tombstones; the per-run header says how many. `--set store.cassandra.tombstone_grace=0`
   lets the low-water mark skip them.
3. One table row per page size. CPU seconds during the driver phase: cassmail (the serve
   process and its workers, /proc), Cassandra (the CassandraDaemon listening on the
   configured port, /proc) and the driver (rabid's process plus this process, which runs
   the probe; or this process for the python driver).
4. Through the store, after each run: python driver - every mailbox holds exactly what it
   held before minus the messages whose QUIT was answered +OK; rabid - every mailbox holds
   a suffix of its messages in arrival order (rabid deletes from message 1 up and only a
   QUIT commits), and the large mailbox is untouched.

The keyspace is dropped at the end (--keep leaves it and the work directory with the
configs and logs). Sizes are decimal (K = 10^3) and MB/s means 10^6 bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import email.utils
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from cassmail import config
from cassmail.auth import hash_password
from cassmail.config import ConfigError, Settings
from cassmail.model import MessageSummary, uidl
from cassmail.store import make_store
from cassmail.store.base import Store, StoreError, Target

import _common
from _common import BENCH_HASH, HOST, PASSWORD, CassandraCpu, CassmailNode, delta, number, own_cpu, pid_cpu
from _common import fmt as _fmt
from _common import markdown

#: Bytes per base64 line of the body pool (76 characters and CRLF).
LINE = 78


# --------------------------------------------------------------------------- arguments


def parse_range(text: str) -> tuple[int, int]:
    """"50K-500K" -> (50000, 500000); "100K" alone is a fixed size; at least 1K (room for the headers)."""
    lo, hi = _common.parse_range(text)
    if lo < 1000:
        raise argparse.ArgumentTypeError(f"messages need at least 1K (room for the headers), got {text!r}")
    return lo, hi


def parse_page_sizes(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or any(not 1 <= v <= 10_000 for v in values):
        raise argparse.ArgumentTypeError(f"page sizes must be 1..10000 (pop3.page_size), got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark cassmail's POP3 front end (retrieve and delete) per pop3.page_size.",
    )
    p.add_argument("--config", metavar="FILE",
                   help="cassmail TOML settings: which Cassandra (default: $CASSMAIL_CONFIG or built-ins)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a setting, e.g. --set store.cassandra.port=29042 (repeatable)",
    )
    p.add_argument("--users", type=number(int), default=200, help="users with a full INBOX (default 200)")
    p.add_argument("--messages-per-user", type=number(int), default=50, metavar="M", help="messages per INBOX (default 50)")
    p.add_argument("--sizes", type=parse_range, default=parse_range("50K-500K"),
                   help="message size range, uniform (default 50K-500K)")
    p.add_argument("--page-sizes", type=parse_page_sizes, default=parse_page_sizes("10,100,500,2000"),
                   help="pop3.page_size values, one serve run each (default 10,100,500,2000)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--seconds", type=number(float), help="driver time per run (default 60)")
    when.add_argument("--minutes", type=number(float, 0.05), help="driver time per run, in minutes")
    p.add_argument("--workers", type=number(int, 0), default=0, help="cassmail worker processes (default 0 = one per core)")
    p.add_argument("--driver", choices=("rabid", "python"), default="rabid" if shutil.which("rabid") else "python",
                   help="load generator (default rabid when installed, else python)")
    p.add_argument("--clients", type=number(int), default=8, help="concurrent POP3 sessions (rabid -p; default 8)")
    p.add_argument("--big-mailbox", type=number(int, 0), default=20_000, metavar="N",
                   help="messages of the large-mailbox user whose login is timed (default 20000; 0 = none)")
    p.add_argument("--big-size", type=parse_range, default=parse_range("1K-3K"),
                   help="message size range of the large mailbox (default 1K-3K)")
    p.add_argument("--big-logins", type=number(int), default=3, help="timed logins of the large mailbox per run (default 3)")
    p.add_argument("--fill-concurrency", type=number(int), default=32, help="deliveries in flight while filling (default 32)")
    p.add_argument("--io-timeout", type=number(float), default=60.0, help="seconds a client waits for one answer (default 60)")
    p.add_argument("--server-log-level", choices=("auto", "INFO", "WARNING"), default="auto",
                   help="log level of cassmail serve (default auto: INFO with rabid, whose sessions and RETRs are "
                        "counted from the session lines, WARNING with the python driver)")
    p.add_argument("--keep", action="store_true", help="keep the keyspace and the work directory (configs, logs)")
    args = p.parse_args(argv)
    args.run_seconds = args.minutes * 60 if args.minutes else (args.seconds or 60.0)
    if args.server_log_level == "auto":
        args.server_log_level = "INFO" if args.driver == "rabid" else "WARNING"
    return args


def load_settings(args: argparse.Namespace) -> Settings:
    """The user's settings (which Cassandra) with a fresh keyspace, RF=1 and consistency ONE."""
    overrides = list(args.overrides) + [
        f"store.cassandra.keyspace=bench_pop3_{secrets.token_hex(5)}",
        "store.cassandra.replication_strategy=SimpleStrategy",
        "store.cassandra.replication_factor=1",
        "store.cassandra.read_consistency=ONE",
        "store.cassandra.write_consistency=ONE",
    ]
    settings = config.load(args.config, overrides=overrides)
    if settings.store.backend != "cassandra":
        raise ConfigError(f"store.backend: this benchmark needs cassandra, got {settings.store.backend!r}")
    return settings


# --------------------------------------------------------------------------- CPU accounting


# --------------------------------------------------------------------------- mail


@dataclass(frozen=True, slots=True)
class Made:
    """How a message's bytes were made (enough to make them again for checking)."""

    user: str
    seq: int
    size: int
    offset: int


class Bodies:
    """Message bytes: a few header lines, then base64 text cut from one random pool."""

    def __init__(self, largest: int, rng: random.Random) -> None:
        raw = os.urandom((largest + 256 * 1024) * 3 // 4 + 1024)
        self.pool = base64.encodebytes(raw).replace(b"\n", b"\r\n")  # 76 characters + CRLF per line
        self.lines = len(self.pool) // LINE
        self.rng = rng
        self.date = email.utils.format_datetime(email.utils.localtime()).encode()
        self.seq = 0

    def header(self, user: str, seq: int) -> bytes:
        return (
            b"From: Bench Sender <sender@bench-pop3.example>\r\n"
            b"To: " + user.encode() + b"\r\n"
            b"Subject: POP3 bench message " + str(seq).encode() + b"\r\n"
            b"Date: " + self.date + b"\r\n"
            b"Message-ID: <" + str(seq).encode() + b".bench-pop3@bench-pop3.example>\r\n"
            b"MIME-Version: 1.0\r\n"
            b"Content-Type: application/octet-stream\r\n"
            b"Content-Transfer-Encoding: base64\r\n\r\n"
        )

    def new(self, user: str, lo: int, hi: int) -> Made:
        self.seq += 1
        size = self.rng.randint(lo, hi)
        body = size - len(self.header(user, self.seq)) - 2
        offset = self.rng.randrange(0, self.lines - (body // LINE + 2)) * LINE
        return Made(user, self.seq, size, offset)

    def make(self, m: Made) -> bytes:
        head = self.header(m.user, m.seq)
        text = self.pool[m.offset : m.offset + m.size - len(head) - 2]
        if text.endswith(b"\r"):
            text = text[:-1] + b"A"
        return head + text + b"\r\n"


async def bounded(jobs: Sequence[Any], work: Callable[[Any], Any], concurrency: int) -> None:
    """Run work(job) for every job, `concurrency` at a time."""
    it = iter(jobs)

    async def worker() -> None:
        for job in it:
            await work(job)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)) or 1)))


async def fill(store: Store, bodies: Bodies, wanted: dict[str, int], sizes: tuple[int, int], concurrency: int,
               made: dict[uuid.UUID, Made], label: str) -> tuple[int, int, float]:
    """Deliver wanted[user] messages to each INBOX; (messages, bytes, seconds)."""
    jobs = [u for u, n in wanted.items() for _ in range(max(n, 0))]
    random.shuffle(jobs)
    done = [0, 0]
    t0 = last = time.perf_counter()

    async def one(user: str) -> None:
        nonlocal last
        m = bodies.new(user, *sizes)
        data = bodies.make(m)
        for attempt in range(3):
            try:
                [mid] = await store.deliver(data, [Target(user)])
                break
            except StoreError:
                if attempt == 2:
                    raise
                await asyncio.sleep(1)
        made[mid] = m
        done[0] += 1
        done[1] += len(data)
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            print(f"    {label}: {done[0]}/{len(jobs)} messages, {done[1] / 1e6:.0f} MB", flush=True)

    await bounded(jobs, one, concurrency)
    return done[0], done[1], time.perf_counter() - t0


async def snapshot(store: Store, users: Sequence[str]) -> dict[str, list[MessageSummary]]:
    """Every INBOX summary of every user, in arrival order."""
    out: dict[str, list[MessageSummary]] = {}

    async def one(user: str) -> None:
        out[user] = [s async for s in store.list_messages(user, "INBOX", 1000)]

    await bounded(list(users), one, 16)
    return out


# --------------------------------------------------------------------------- the node


# --------------------------------------------------------------------------- a POP3 client


class PopError(Exception):
    """A -ERR answer or a protocol deviation; the text says which."""


class Pop3:
    """A minimal asyncio POP3 client that frames answers with bytes searches (fast for big RETRs)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
        self.reader, self.writer, self.timeout = reader, writer, timeout
        self.buf = bytearray()

    @classmethod
    async def connect(cls, port: int, timeout: float) -> Pop3:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
        client = cls(reader, writer, timeout)
        first, _ = await client._answer(False)
        if not first.startswith(b"+OK"):
            client.close()
            raise PopError(f"greeting: {first[:120]!r}")
        return client

    async def _more(self) -> None:
        data = await asyncio.wait_for(self.reader.read(1 << 18), self.timeout)
        if not data:
            raise ConnectionError("connection closed by the server")
        self.buf += data

    async def _answer(self, multi: bool) -> tuple[bytes, bytes | None]:
        scan = 0
        while (eol := self.buf.find(b"\r\n", scan)) < 0:
            scan = max(0, len(self.buf) - 1)
            await self._more()
        first = bytes(self.buf[:eol])
        if not multi or not first.startswith(b"+OK"):
            del self.buf[: eol + 2]
            return first, None
        scan = eol  # the status line's CRLF starts the terminator of an empty answer
        while (end := self.buf.find(b"\r\n.\r\n", scan)) < 0:
            scan = max(eol, len(self.buf) - 4)
            await self._more()
        body = bytes(self.buf[eol + 2 : end + 2])
        del self.buf[: end + 5]
        return first, body

    async def command(self, line: str, multi: bool = False) -> tuple[bytes, bytes | None]:
        self.writer.write(line.encode() + b"\r\n")
        await asyncio.wait_for(self.writer.drain(), self.timeout)
        first, body = await self._answer(multi)
        if not first.startswith(b"+OK"):
            verb = line.split()[0]
            raise PopError(f"{verb}: {first[:120].decode('latin-1')}")
        return first, body

    async def login(self, user: str, password: str) -> bytes:
        await self.command(f"USER {user}")
        first, _ = await self.command(f"PASS {password}")
        return first

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


def unstuff(body: bytes) -> bytes:
    if body.startswith(b".."):
        body = body[1:]
    return body.replace(b"\n..", b"\n.")


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (of seconds) in ms."""
    value = _common.pct(values, q)
    return None if value is None else value * 1000


# --------------------------------------------------------------------------- drivers


@dataclass
class RunResult:
    page_size: int
    driver: str
    seconds: float = 0.0
    sessions: int | None = 0
    retrieved: int | None = 0
    retrieved_bytes: int | None = 0
    retrieved_seconds: float = 0.0  # the window the retrieved counts cover
    deleted: int = 0
    deleted_bytes: int = 0
    logins: list[float] = field(default_factory=list)
    login_source: str = ""
    retr: list[float] = field(default_factory=list)
    session_times: list[float] = field(default_factory=list)
    big: list[float] = field(default_factory=list)
    big_stat: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    after_run: Counter[str] = field(default_factory=Counter)  # server log lines once the driver had stopped
    first_error: dict[str, str] = field(default_factory=dict)
    cassmail_cpu: float | None = None
    cassandra_cpu: float | None = None
    driver_cpu: float | None = None
    driver_cpu_note: str = ""
    check: str = ""
    check_ok: bool = True
    notes: list[str] = field(default_factory=list)
    # python driver: uidls whose deletion a QUIT confirmed, per user
    confirmed: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    rabid_csv: list[str] = field(default_factory=list)
    driver_start: float = 0.0  # epoch seconds
    probe_sessions: int = 0
    at_start: int = 0  # messages in the INBOXes when the run started
    left: int = 0  # and when it ended
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def error(self, kind: str, text: str) -> None:
        self.errors[kind] += 1
        self.first_error.setdefault(kind, text)


async def timed_login(port: int, user: str, timeout: float) -> tuple[float, Pop3, bytes]:
    t0 = time.perf_counter()
    client = await Pop3.connect(port, timeout)
    try:
        answer = await client.login(user, PASSWORD)
    except BaseException:
        client.close()
        raise
    return time.perf_counter() - t0, client, answer


async def big_logins(port: int, user: str, expect: int, n: int, timeout: float, result: RunResult) -> None:
    """Log in to the large mailbox n times, one at a time: PASS (the listing) and STAT, then QUIT."""
    for _ in range(n):
        try:
            seconds, client, answer = await timed_login(port, user, max(timeout, 300))
            try:
                t = time.perf_counter()
                first, _ = await client.command("STAT")
                result.big_stat.append(time.perf_counter() - t)
                count = int(first.split()[1])
                if count != expect:
                    result.error("big mailbox count", f"STAT says {count} messages, {expect} delivered ({answer!r})")
                await client.command("QUIT")
            finally:
                client.close()
            result.big.append(seconds)
        except (OSError, asyncio.TimeoutError, PopError, ValueError, IndexError) as exc:
            result.error(f"big login {type(exc).__name__}", str(exc) or type(exc).__name__)


async def warm_up(port: int, users: Sequence[str], n: int, timeout: float, result: RunResult) -> None:
    """Untimed logins first: a fresh worker's first login costs ~50 ms more (connections, prepared
    statements), and the kernel picks the worker of each connection (SO_REUSEPORT)."""
    for user in random.Random().choices(list(users), k=n):
        try:
            _, client, _ = await timed_login(port, user, timeout)
            try:
                await client.command("QUIT")
            finally:
                client.close()
        except (OSError, asyncio.TimeoutError, PopError) as exc:
            result.error(f"warm-up {type(exc).__name__}", f"{user}: {exc}")


class UserPool:
    """Random users, never one that another client is using (like rabid)."""

    def __init__(self, users: Sequence[str], rng: random.Random) -> None:
        self.free, self.rng = list(users), rng

    def take(self) -> str | None:
        if not self.free:
            return None
        i = self.rng.randrange(len(self.free))
        self.free[i], self.free[-1] = self.free[-1], self.free[i]
        return self.free.pop()

    def give(self, user: str) -> None:
        self.free.append(user)


async def python_driver(port: int, users: Sequence[str], expected: Callable[[str], bytes | None],
                        args: argparse.Namespace, result: RunResult) -> None:
    """--clients sessions in a loop: USER/PASS, STAT, LIST, UIDL, RETR+DELE each, QUIT."""
    pool = UserPool(users, random.Random())
    start = time.perf_counter()
    deadline = start + args.run_seconds
    result.retrieved = result.retrieved_bytes = result.sessions = 0
    result.login_source = "sessions"
    last_delete = [0.0]

    async def session(user: str) -> None:
        t0 = time.perf_counter()
        client: Pop3 | None = None
        try:
            seconds, client, _ = await timed_login(port, user, args.io_timeout)
            result.logins.append(seconds)
            stat, _ = await client.command("STAT")
            _, listing = await client.command("LIST", multi=True)
            _, uidls = await client.command("UIDL", multi=True)
            sizes = [(int(n), int(s)) for n, s in (line.split() for line in (listing or b"").splitlines())]
            ids = dict((int(n), u.decode()) for n, u in (line.split() for line in (uidls or b"").splitlines()))
            if int(stat.split()[1]) != len(sizes) or len(ids) != len(sizes):
                raise PopError(f"STAT {stat!r} vs {len(sizes)} LIST lines vs {len(ids)} UIDL lines")
            dele: list[tuple[str, int]] = []
            for n, size in sizes:
                if time.perf_counter() >= deadline:
                    break
                t = time.perf_counter()
                first, body = await client.command(f"RETR {n}", multi=True)
                result.retr.append(time.perf_counter() - t)
                data = unstuff(body or b"")
                want = expected(ids[n])
                if len(data) != size:
                    result.error("RETR size", f"{user} #{n}: LIST says {size}, RETR gave {len(data)} bytes ({first!r})")
                elif want is not None and data != want:
                    result.error("RETR content", f"{user} #{n} ({ids[n]}): bytes differ from those delivered")
                result.retrieved += 1
                result.retrieved_bytes += len(data)
                await client.command(f"DELE {n}")
                dele.append((ids[n], size))
            bye, _ = await client.command("QUIT")
            m = re.search(rb"(\d+) message", bye)
            if m is None or int(m.group(1)) != len(dele):
                result.error("QUIT count", f"{user}: {len(dele)} DELE, QUIT answered {bye!r}")
            if dele:
                last_delete[0] = time.perf_counter() - start
            result.confirmed[user].update(u for u, _ in dele)
            result.deleted += len(dele)
            result.deleted_bytes += sum(s for _, s in dele)
            result.sessions += 1
            result.session_times.append(time.perf_counter() - t0)
        except (OSError, asyncio.TimeoutError, PopError, ValueError, IndexError, KeyError) as exc:
            # The session ends without QUIT: the server deletes nothing of it.
            result.error(type(exc).__name__, f"{user}: {exc}" if str(exc) else user)
        finally:
            if client is not None:
                client.close()

    async def worker() -> None:
        while time.perf_counter() < deadline:
            user = pool.take()
            if user is None:
                await asyncio.sleep(0.05)
                continue
            try:
                await session(user)
            finally:
                pool.give(user)

    tasks = [asyncio.ensure_future(worker()) for _ in range(args.clients)]
    try:
        # Sessions stop starting RETRs at the deadline; the rest is one QUIT each.
        await asyncio.wait_for(asyncio.gather(*tasks), args.run_seconds + args.io_timeout * 3 + 30)
    except asyncio.TimeoutError:
        result.error("driver hard stop", "sessions still running long after the deadline were cancelled")
    result.seconds = time.perf_counter() - start
    result.retrieved_seconds = result.seconds
    result.notes.append(f"python driver: the last QUIT that removed messages came {last_delete[0]:.1f} s into the run")


_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def read_log(path: Path) -> list[dict[str, Any]]:
    """cassmail's log lines as dicts (logfmt; "ts" as epoch seconds); other lines as {"raw": line}."""
    records: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return records
    for line in text.splitlines():
        if not line.strip() or line.startswith("cassmail: serving"):
            continue
        if not line.startswith("ts="):
            records.append({"raw": line, "ts": None, "level": "raw"})
            continue
        rec: dict[str, Any] = {k: v[1:-1] if v.startswith('"') else v for k, v in _KV.findall(line)}
        rec["raw"] = line
        try:
            rec["ts"] = datetime.fromisoformat(rec["ts"].replace("Z", "+00:00")).timestamp()
        except (KeyError, ValueError):
            rec["ts"] = None
        records.append(rec)
    return records


async def rabid_driver(port: int, users: Sequence[str], args: argparse.Namespace, workdir: Path,
                       result: RunResult, cpu_before: Callable[[], None]) -> None:
    """rabid -p CLIENTS for the run time (killed then), and a login probe beside it.

    rabid 0.76 (Debian's postal package) prints its CSV header and never a statistics
    line while it runs (its periodic print is not reached; it never exits on its own),
    so sessions and RETRs are counted afterwards from cassmail's session log lines.
    """
    userfile = workdir / "rabid-users.txt"
    userfile.write_text("".join(f"{u} {PASSWORD}\n" for u in users))
    rundir = workdir / f"rabid-page{result.page_size}"
    rundir.mkdir(exist_ok=True)  # rabid writes rabid.log into its working directory
    out, err = rundir / "stdout.csv", rundir / "stderr.txt"
    result.login_source = "probe"
    cmd = ["rabid", "-p", str(args.clients), f"[{HOST}]{port}", str(userfile)]
    result.notes.append("rabid: " + " ".join(cmd[:-1]) + " USERFILE")
    own0 = own_cpu()
    cpu_before()
    result.driver_start = time.time()
    start = time.perf_counter()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(cmd, cwd=rundir, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    rabid_cpu: float | None = None
    try:
        deadline = start + args.run_seconds
        rng = random.Random()
        while time.perf_counter() < deadline and proc.poll() is None:
            user = rng.choice(list(users))
            try:
                t0 = time.perf_counter()
                client = await Pop3.connect(port, args.io_timeout)
                result.probe_sessions += 1
                try:
                    await client.login(user, PASSWORD)
                    result.logins.append(time.perf_counter() - t0)
                    await client.command("QUIT")
                finally:
                    client.close()
            except (OSError, asyncio.TimeoutError, PopError) as exc:
                result.error(f"probe {type(exc).__name__}", f"{user}: {exc}")
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.perf_counter())))
        rabid_cpu = pid_cpu(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    result.seconds = result.retrieved_seconds = time.perf_counter() - start
    if proc.returncode not in (-signal.SIGTERM, None):
        result.error("rabid exit", f"rabid exited with {proc.returncode} before the deadline: {err.read_text()[-300:]}")
    result.rabid_csv = [ln for ln in out.read_text(errors="replace").splitlines() if re.match(r"\d+:\d+,", ln)]
    for line in err.read_text(errors="replace").splitlines():
        if line.strip():
            kind = "rabid: " + re.sub(r"\d+", "N", line.strip())[:60]
            result.error(kind, line.strip()[:200])
    own = own_cpu() - own0
    result.driver_cpu = (rabid_cpu or 0.0) + own
    result.driver_cpu_note = f"rabid {_fmt(rabid_cpu)} s + probe {own:.1f} s (this process)"


def count_rabid(records: list[dict[str, Any]], before: dict[str, list[MessageSummary]],
                after: dict[str, list[MessageSummary]], result: RunResult) -> None:
    """Sessions and RETRs of rabid from cassmail's session lines (ts >= driver start, probe taken out).

    rabid deletes every message it retrieves, so per user the RETRs beyond the messages that
    went are those of the session cut at the deadline: the first ones still in the mailbox.
    """
    sessions, per_user, auth_ms = 0, Counter(), []
    for rec in records:
        # A session cut while its login was still running is logged without a user.
        if rec.get("ts") is None or rec["ts"] < result.driver_start or rec.get("user", "") not in before.keys() | {""}:
            continue
        if rec.get("event") == "session" and rec.get("listener") == "pop3":
            sessions += 1
            if rec.get("user"):
                with contextlib.suppress(ValueError):
                    per_user[rec["user"]] += int(rec.get("retrieved") or 0)
        elif rec.get("event") == "auth" and rec.get("result") == "ok":
            with contextlib.suppress(ValueError):
                auth_ms.append(int(rec.get("ms", "")) / 1000)
    result.sessions = max(0, sessions - result.probe_sessions)
    result.retrieved = sum(per_user.values())
    cut_bytes, odd = 0, 0
    for user, k in per_user.items():
        cut = k - (len(before[user]) - len(after.get(user, [])))
        if cut < 0:
            odd += 1
            continue
        cut_bytes += sum(s.size for s in after[user][:cut])
    result.retrieved_bytes = result.deleted_bytes + cut_bytes
    if odd:
        result.error("log vs store", f"{odd} mailbox(es) lost more messages than their sessions retrieved")
    result.notes.append(
        f"from cassmail's log: {sessions} POP3 sessions ({result.probe_sessions} of them the probe's), "
        f"{result.retrieved} RETRs, {result.retrieved - result.deleted} of them in sessions cut at the deadline; "
        f"server-side PASS..+OK p50/p95 {_fmt(pct(auth_ms, 50))}/{_fmt(pct(auth_ms, 95))} ms over {len(auth_ms)} logins"
    )


# --------------------------------------------------------------------------- checks


def check_python(before: dict[str, list[MessageSummary]], after: dict[str, list[MessageSummary]],
                 result: RunResult) -> None:
    """Each mailbox = before minus what the QUITs confirmed, id for id."""
    bad, unexpected_gone, still_there = 0, 0, 0
    for user, was in before.items():
        gone = result.confirmed.get(user, set())
        want = [s.id for s in was if uidl(s.id) not in gone]
        have = [s.id for s in after.get(user, [])]
        if want != have:
            bad += 1
            unexpected_gone += len(set(want) - set(have))
            still_there += len(gone & {uidl(i) for i in have})
    deleted = sum(len(v) - len(after.get(u, [])) for u, v in before.items())
    if bad:
        result.check_ok = False
        result.check = (f"MISMATCH in {bad} mailbox(es): {unexpected_gone} message(s) gone that no QUIT removed, "
                        f"{still_there} confirmed deletion(s) still present")
    else:
        result.check = (f"ok: {deleted} gone = {result.deleted} confirmed by QUIT, every other message present "
                        f"({len(before)} mailboxes)")


def check_rabid(before: dict[str, list[MessageSummary]], after: dict[str, list[MessageSummary]],
                result: RunResult) -> None:
    """Each mailbox keeps a suffix (arrival order) of what it had; count what went."""
    bad = 0
    for user, was in before.items():
        have = [s.id for s in after.get(user, [])]
        k = len(was) - len(have)
        if k < 0 or [s.id for s in was[k:]] != have:
            bad += 1
            continue
        result.deleted += k
        result.deleted_bytes += sum(s.size for s in was[:k])
    if bad:
        result.check_ok = False
        result.check = f"MISMATCH in {bad} mailbox(es): not what remains after deleting from message 1 up"
    else:
        result.check = (f"ok: {result.deleted} gone, each mailbox kept its newest messages in order "
                        f"({len(before)} mailboxes)")


# --------------------------------------------------------------------------- report


def per_min(n: int | None, seconds: float) -> str:
    return "-" if n is None or seconds <= 0 else f"{n * 60 / seconds:.0f}"


def mb_s(n: int | None, seconds: float) -> str:
    return "-" if n is None or seconds <= 0 else f"{n / seconds / 1e6:.1f}"


def drained(r: RunResult, text: str) -> str:
    """Rates of a run that emptied every mailbox are lower bounds: '>=' says so."""
    return f">={text}" if r.left == 0 and text != "-" else text


def table(results: list[RunResult], big_n: int) -> list[str]:
    head = ["page size", "driver", "s", "sessions/min", "msgs/min retr", "msgs/min del", "MB/s retr", "MB/s del",
            "left", "login p50 ms", "login p95 ms", f"login {big_n} msgs ms" if big_n else "login large ms", "errors",
            "cassmail CPU s", "Cassandra CPU s", "driver CPU s"]
    rows = []
    for r in results:
        big = statistics.median(r.big) * 1000 if r.big else None
        rows.append([
            str(r.page_size), r.driver, f"{r.seconds:.0f}", per_min(r.sessions, r.retrieved_seconds),
            drained(r, per_min(r.retrieved, r.retrieved_seconds)), drained(r, per_min(r.deleted, r.seconds)),
            drained(r, mb_s(r.retrieved_bytes, r.retrieved_seconds)), drained(r, mb_s(r.deleted_bytes, r.seconds)),
            f"{r.left}/{r.at_start}",
            _fmt(pct(r.logins, 50), ".0f"), _fmt(pct(r.logins, 95), ".0f"),
            _fmt(big, ".0f") if big_n else "-", str(sum(r.errors.values())),
            _fmt(r.cassmail_cpu), _fmt(r.cassandra_cpu), _fmt(r.driver_cpu),
        ])
    return markdown(head, rows, {1})


def verdict(results: list[RunResult], args: argparse.Namespace) -> str:
    """One or two sentences on what the page size did (from the numbers, not assumed)."""
    if len(results) < 2:
        return "Only one page size was run: nothing to compare."
    parts = []
    big = [(r.page_size, statistics.median(r.big)) for r in results if r.big]
    if len(big) >= 2:
        slow, fast = max(big, key=lambda x: x[1]), min(big, key=lambda x: x[1])
        reqs = {p: -(-args.big_mailbox // p) for p, _ in big}
        parts.append(
            f"Logging in to the {args.big_mailbox}-message mailbox took "
            + ", ".join(f"{s * 1000:.0f} ms at page size {p} ({reqs[p]} requests)" for p, s in big)
            + f": {slow[1] / fast[1]:.1f}x between the slowest (page size {slow[0]}) and the fastest (page size {fast[0]})."
        )
    logins = [(r.page_size, pct(r.logins, 50)) for r in results if r.logins]
    del_rates = [(r.page_size, r.deleted * 60 / r.seconds) for r in results if r.seconds > 0]
    if logins and del_rates:
        lo, hi = min(v for _, v in del_rates), max(v for _, v in del_rates)
        mean = statistics.mean(v for _, v in del_rates) or 1
        parts.append(
            f"For the {args.messages_per_user}-message mailboxes the login p50 was "
            + ", ".join(f"{v:.0f} ms" for _, v in logins) + " and messages deleted per minute "
            + ", ".join(f"{v:.0f}" for _, v in del_rates)
            + f" (page sizes {', '.join(str(p) for p, _ in del_rates)}; spread {100 * (hi - lo) / mean:.0f}% of the mean;"
            + " listing requests per login " + ", ".join(str(-(-args.messages_per_user // p)) for p, _ in del_rates) + ")"
            + ("; some runs emptied every mailbox, so their rates are lower bounds." if any(r.left == 0 for r in results)
               else ".")
        )
    return " ".join(parts)


def describe(settings: Settings, args: argparse.Namespace, cass: CassandraCpu) -> list[str]:
    c = settings.store.cassandra
    lo, hi = args.sizes
    blo, bhi = args.big_size
    return [
        f"Cassandra          {', '.join(c.contact_points)} port {c.port}, keyspace {c.keyspace} (created for this run), "
        f"SimpleStrategy RF=1, read/write consistency ONE, tombstone_grace {c.tombstone_grace:g} s",
        f"cassmail           {args.workers or os.cpu_count()} worker(s) (--workers {args.workers}), POP3 only, "
        f"log level {args.server_log_level}",
        f"driver             {args.driver}, {args.clients} concurrent sessions, {args.run_seconds:g} s per run",
        f"mailboxes          {args.users} users x {args.messages_per_user} messages of {lo / 1e3:g}K-{hi / 1e3:g}K "
        f"(uniform, ~{args.users * args.messages_per_user * (lo + hi) / 2 / 1e6:.0f} MB)"
        + (f"; 1 user x {args.big_mailbox} messages of {blo / 1e3:g}K-{bhi / 1e3:g}K" if args.big_mailbox else ""),
        f"page sizes         {', '.join(map(str, args.page_sizes))}",
        f"host               {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start",
        f"CPU accounting     cassmail: serve + workers (/proc); Cassandra: {cass.label}; driver: see below",
    ]


# --------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, settings: Settings, store: Store, workdir: Path,
              cass: CassandraCpu, results: list[RunResult]) -> int:
    status = 0
    domain = f"bench-pop3-{secrets.token_hex(4)}.example"
    await store.add_domain(domain)
    hashed = hash_password(PASSWORD, BENCH_HASH)
    users = [f"u{i:04d}@{domain}" for i in range(args.users)]
    big_user = f"big@{domain}" if args.big_mailbox else None
    t = time.perf_counter()

    async def create(user: str) -> None:
        await store.create_user(user, hashed)

    await bounded(users + ([big_user] if big_user else []), create, 32)
    print(f"created {len(users) + bool(big_user)} users in {domain} in {time.perf_counter() - t:.1f} s", flush=True)

    bodies = Bodies(max(args.sizes[1], args.big_size[1]), random.Random())
    made: dict[uuid.UUID, Made] = {}
    n, size, secs = await fill(store, bodies, {u: args.messages_per_user for u in users}, args.sizes,
                               args.fill_concurrency, made, "fill")
    print(f"filled {len(users)} INBOXes: {n} messages, {size / 1e6:.0f} MB in {secs:.1f} s "
          f"({size / 1e6 / secs if secs else 0:.1f} MB/s)", flush=True)
    if big_user:
        big_made: dict[uuid.UUID, Made] = {}
        n, size, secs = await fill(store, bodies, {big_user: args.big_mailbox}, args.big_size,
                                   max(args.fill_concurrency, 64), big_made, "large mailbox")
        print(f"filled the large mailbox {big_user}: {n} messages, {size / 1e6:.0f} MB in {secs:.1f} s", flush=True)

    by_uidl = {uidl(mid): m for mid, m in made.items()}

    def expected(u: str) -> bytes | None:
        m = by_uidl.get(u)
        return bodies.make(m) if m is not None else None

    before = await snapshot(store, users)
    tombstones = 0
    for index, page_size in enumerate(args.page_sizes):
        result = RunResult(page_size, args.driver, loadavg=os.getloadavg())
        results.append(result)
        print(f"\n## page_size {page_size}: load average {' '.join(f'{x:.2f}' for x in result.loadavg)}; "
              f"{sum(len(v) for v in before.values())} messages in {len(before)} INBOXes; "
              f"~{tombstones // max(len(users), 1)} deleted rows per INBOX partition from earlier runs", flush=True)
        node = CassmailNode(settings, workdir, ["pop3"], args.workers, args.server_log_level,
                            name=f"pop3-page{page_size}",
                            pop3={"page_size": page_size, "tls_cert": "", "tls_key": "", "implicit_tls": False})
        node.start(60)
        port = node.ports["pop3"]
        try:
            await warm_up(port, users, 4 * node.workers, args.io_timeout, result)
            if big_user:
                await big_logins(port, big_user, args.big_mailbox, args.big_logins, args.io_timeout, result)
                print(f"  large mailbox login: {', '.join(f'{s * 1000:.0f}' for s in result.big)} ms "
                      f"(STAT after it {', '.join(f'{s * 1000:.1f}' for s in result.big_stat)} ms)", flush=True)
            marks: dict[str, float | None] = {}

            def mark_before() -> None:
                marks.update(node=node.cpu(), cass=cass.seconds(), own=own_cpu())

            if args.driver == "python":
                mark_before()
                await python_driver(port, users, expected, args, result)
                result.driver_cpu = own_cpu() - (marks["own"] or 0.0)
                result.driver_cpu_note = "this process (asyncio sessions)"
            else:
                await rabid_driver(port, users, args, workdir, result, mark_before)
            result.cassmail_cpu = delta(marks.get("node"), node.cpu())
            result.cassandra_cpu = delta(marks.get("cass"), cass.seconds())
            driver_end = time.time()
            await asyncio.sleep(2)  # let work of connections the driver dropped finish before SIGTERM
        finally:
            node.stop()
            code = node.process.returncode if node.process else None
        if code not in (0, None):
            result.error("serve exit", f"cassmail serve exited with {code}")
        records = read_log(node.log_path)
        for rec in records:
            if rec.get("level") not in ("warning", "error", "critical", "raw"):
                continue
            kind = f"cassmail log {rec.get('level')} {rec.get('event', '')}".rstrip()
            if rec.get("ts") is not None and rec["ts"] > driver_end:
                result.after_run[kind] += 1
                result.first_error.setdefault("after " + kind, rec["raw"][:300])
            else:
                result.error(kind, rec["raw"][:300])

        after = await snapshot(store, users)
        if args.driver == "python":
            check_python(before, after, result)
        else:
            check_rabid(before, after, result)
            count_rabid(records, before, after, result)
        if big_user:
            left = sum(1 for _ in [s async for s in store.list_messages(big_user, "INBOX", 1000)])
            if left != args.big_mailbox:
                result.check_ok = False
                result.check += f"; LARGE MAILBOX now holds {left}, not {args.big_mailbox}"
        if not result.check_ok:
            status = 1
        remaining = sum(len(v) for v in after.values())
        result.at_start, result.left = sum(len(v) for v in before.values()), remaining
        print(f"  {result.sessions if result.sessions is not None else '?'} sessions, "
              f"{result.deleted} messages deleted ({result.deleted_bytes / 1e6:.0f} MB) in {result.seconds:.0f} s, "
              f"{sum(result.errors.values())} errors; {remaining} messages left", flush=True)
        print(f"  check: {result.check}", flush=True)
        tombstones += result.deleted
        if index + 1 < len(args.page_sizes):
            wanted = {u: args.messages_per_user - len(after[u]) for u in users}
            n, size, secs = await fill(store, bodies, wanted, args.sizes, args.fill_concurrency, made, "refill")
            by_uidl.update({uidl(mid): m for mid, m in made.items() if uidl(mid) not in by_uidl})
            print(f"  refilled {n} messages ({size / 1e6:.0f} MB) in {secs:.1f} s", flush=True)
            before = await snapshot(store, users)
    return status


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.driver == "rabid" and not shutil.which("rabid"):
        print("bench_pop3: rabid is not installed (apt-get install -y postal), or use --driver python", file=sys.stderr)
        return 2
    try:
        settings = load_settings(args)
        store = make_store(settings)
    except ConfigError as exc:
        print(f"bench_pop3: {exc}", file=sys.stderr)
        return 2
    if args.sizes[1] > settings.store.max_message_size:
        print(f"bench_pop3: --sizes up to {args.sizes[1]} exceed store.max_message_size", file=sys.stderr)
        return 2
    c = settings.store.cassandra
    cass = CassandraCpu(c.contact_points, c.port)
    workdir = Path(tempfile.mkdtemp(prefix="bench_pop3-"))
    results: list[RunResult] = []
    status = 0
    made_keyspace = False
    opened = False
    t0 = time.perf_counter()
    print("# cassmail POP3 benchmark")
    for line in describe(settings, args, cass):
        print("  " + line)
    print(flush=True)
    from cassmail.store import cassandra_schema

    # SIGINT/SIGTERM cancel the run: the finally blocks stop rabid and cassmail and drop the keyspace.
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, task.cancel)
    try:
        t = time.perf_counter()
        made_keyspace = True
        await asyncio.to_thread(cassandra_schema.apply, c)
        print(f"created keyspace {c.keyspace} in {time.perf_counter() - t:.1f} s", flush=True)
        await store.open()
        opened = True
        status = await run(args, settings, store, workdir, cass, results)
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - still report and clean up
        if isinstance(exc, asyncio.CancelledError):
            task.uncancel()  # let the cleanup below await
        print(f"\nbench_pop3: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
        if not isinstance(exc, (StoreError, asyncio.CancelledError)):
            traceback.print_exc()
        status = 1
    finally:
        if opened:
            await store.close()
        if made_keyspace and args.keep:
            print(f"\n--keep: left keyspace {c.keyspace} and {workdir}")
        elif made_keyspace:
            try:
                await asyncio.to_thread(cassandra_schema.drop, c)
                print(f"\ndropped keyspace {c.keyspace}")
            except Exception as exc:  # noqa: BLE001
                print(f"could not drop keyspace {c.keyspace}: {exc}", file=sys.stderr)
                status = status or 1
        if not args.keep and status == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not args.keep:
            print(f"configs and logs left in {workdir}")

    results = [r for r in results if r.seconds > 0]  # a run cut before its driver finished says nothing
    if not results:
        return status or 1
    print()
    print(f"## Results ({args.driver}, {args.clients} sessions, {args.run_seconds:g} s per page size; "
          f"{time.perf_counter() - t0:.0f} s in all)")
    print()
    for line in table(results, args.big_mailbox):
        print(line)
    print()
    print(verdict(results, args))
    print()
    for r in results:
        la = " ".join(f"{x:.2f}" for x in r.loadavg)
        retr = f"; RETR p50/p95 {_fmt(pct(r.retr, 50))}/{_fmt(pct(r.retr, 95))} ms" if r.retr else ""
        sess = f"; session p50/p95 {_fmt(pct(r.session_times, 50), '.0f')}/{_fmt(pct(r.session_times, 95), '.0f')} ms" \
            if r.session_times else ""
        print(f"- page size {r.page_size}: load average at start {la}; logins timed {len(r.logins)} ({r.login_source}); "
              f"large-mailbox logins {', '.join(f'{s * 1000:.0f}' for s in r.big) or '-'} ms{retr}{sess}; "
              f"driver CPU = {r.driver_cpu_note}")
        print(f"  check: {r.check}")
        for row in r.rabid_csv:
            print(f"  rabid printed (time,messages,data(K),errors,connections,...): {row}")
        for note in r.notes:
            print(f"  {note}")
        for kind, n in r.errors.most_common():
            print(f"  errors: {n} x {kind}; first: {r.first_error[kind]}")
        for kind, n in r.after_run.most_common():
            print(f"  after the driver stopped (not in the errors column): {n} x {kind}; first: {r.first_error['after ' + kind]}")
    print()
    print("Columns: 'del' is counted through the store (messages gone per mailbox) over the whole run; for rabid, "
          "sessions and 'retr' come from cassmail's session log lines (the probe's sessions taken out). 'left' = "
          "messages in the INBOXes at the end / at the start; '>=' marks rates of runs that emptied every mailbox. "
          "login = connect to the +OK of PASS. CPU seconds cover the driver phase only.")
    return status


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
