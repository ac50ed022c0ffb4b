"""IMAP side by side: the same mixed multi-client load on a private Dovecot and on cassmail (mbox
and Cassandra), taking turns in one run; and, apart, what a login costs each of them.

Not a test:

    .venv/bin/python loadtest/bench_imap_mix.py --set store.cassandra.port=19042
    .venv/bin/python loadtest/bench_imap_mix.py --targets dovecot,mbox --clients 16 --seconds 30
    .venv/bin/python loadtest/bench_imap_mix.py --targets dovecot,cassandra --rounds 6 --seconds 15

Per target (default dovecot, mbox, cassandra), in a temporary directory, with the same users and
the same bytes:

1. Mailboxes: one user per client whose INBOX holds --messages messages (sizes uniform in
   --sizes; From, To, Subject, Date, Message-ID; CRLF lines; the same bytes on every target) and
   an empty Archive. Dovecot (baseline.py's private instance, Debian packages installed when
   missing): Maildir files written into new/. cassmail: the Store API, on the mbox store or on a
   fresh keyspace (SimpleStrategy RF=1, consistency ONE; dropped at the end) of the Cassandra
   named by --config/--set; `cassmail serve` with the IMAP listener only, --workers workers.
   What the fill wrote is synced to disk before the server starts.
2. The mix: every client logs in once, SELECTs its INBOX and reads every UID and RFC822.SIZE
   (not measured: Dovecot indexes its Maildir here, cassmail gives out UIDs). Every target is
   filled, started and listed before the first is measured. Then, in --rounds rounds, each
   target in turn (the order reversed every other round: A B, B A, A B, ...) sends, one
   command at a time and without pause, what a mail client sends, drawn from a shuffled deck in
   the proportions of MIX (or --weights): FETCH of a window of sequence numbers (UID FLAGS),
   UID FETCH of the header fields From To Subject Date, UID FETCH BODY.PEEK[] (its size checked),
   UID STORE +FLAGS/-FLAGS, SEARCH UNSEEN, SEARCH SUBJECT, NOOP, APPEND (synchronizing literal),
   UID COPY to Archive, UID EXPUNGE of what the client appended (after UID STORE +FLAGS.SILENT
   (\\Deleted), counted as a STORE), STATUS of Archive, and IDLE ended by DONE at the server's
   continuation. In each round, after --warmup seconds (not counted) --seconds are measured;
   the rounds of a target are added up: per command type cmds/s, p50, p99 and errors (a NO/BAD,
   a wrong answer, a timeout); CPU seconds of the server's processes (Dovecot's master and all
   it forked; cassmail serve and its workers), of the CassandraDaemon, of this load generator
   and of the whole machine.
3. Logins, apart: --login-seconds of connect + LOGIN + LOGOUT by --clients loops, per password
   scheme: Dovecot's {PLAIN} (its default) and a slow hash (--dovecot-hash; default the
   BLF-CRYPT cost whose verification time is nearest cassmail's scrypt, or ARGON2ID: this
   Dovecot has no scrypt), cassmail's scrypt at its floor (N=2^10) and at auth.scrypt_n.
4. Markdown tables: cmds/s per type on each target and the ratios cassmail / Dovecot, latency,
   CPU, each round's cmds/s and ratios (with more than one), logins; --json writes the same
   figures.

Everything started is stopped at the end (also on Ctrl-C), the keyspace dropped and the
temporary directory removed (--keep keeps them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PASSWORD,
    CassandraCpu,
    CassmailNode,
    bench_settings,
    drop_keyspace,
    fmt,
    guarded_target,
    machine_cpu,
    make_users,
    markdown,
    own_cpu,
    parse_range,
    pct,
    positive,
    range_label,
    scrypt_verify_ms,
)
from baseline import Dovecot, choose_dovecot_hash, dovecot_verify_ms, ensure_packages  # noqa: E402
from bench_imap import Imap, Reply  # noqa: E402

from cassmail.auth import HashParams  # noqa: E402
from cassmail.config import ConfigError, Settings  # noqa: E402
from cassmail.store import make_store  # noqa: E402
from cassmail.store.base import Target as Delivery  # noqa: E402

TARGETS = ("dovecot", "mbox", "cassandra")
TITLES = {"dovecot": "Dovecot", "mbox": "cassmail mbox", "cassandra": "cassmail Cassandra"}
#: Command type -> (its weight in the deck, what is sent). The weights follow what a mail client
#: does while a user reads mail: mostly header and body fetches, flag changes and NOOP polls.
MIX: dict[str, tuple[int, str]] = {
    "fetch-flags": (10, "FETCH a:b (UID FLAGS)"),
    "fetch-headers": (20, "UID FETCH n (BODY.PEEK[HEADER.FIELDS (From To Subject Date)])"),
    "fetch-body": (15, "UID FETCH n BODY.PEEK[]"),
    "store": (10, "UID STORE n +FLAGS/-FLAGS"),
    "search-unseen": (4, "SEARCH UNSEEN"),
    "search-subject": (3, "SEARCH SUBJECT word"),
    "noop": (10, "NOOP"),
    "append": (5, "APPEND INBOX {n}"),
    "copy": (3, "UID COPY n Archive"),
    "expunge": (5, "UID EXPUNGE (what it appended)"),
    "status": (5, "STATUS Archive (MESSAGES UNSEEN UIDNEXT)"),
    "idle": (3, "IDLE + DONE"),
}
WORDS = ("invoice", "meeting", "report", "holiday", "budget", "release", "review", "travel",
         "payroll", "offsite", "backup", "contract", "security", "roadmap", "hiring", "launch")
#: Seconds a client may take to log in, SELECT and list its mailbox before the mix starts.
OPEN_TIMEOUT = 600.0
QUIET_MAX = 60.0
QUIET_CORES = 0.3
SCRYPT_FLOOR = HashParams(log2_n=10)


def say(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------- arguments


def parse_weights(text: str) -> dict[str, int]:
    """"fetch-body=30,idle=0": weights that replace MIX's for the named types."""
    out = {k: w for k, (w, _) in MIX.items()}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in MIX or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--weights: NAME=N with NAME one of {', '.join(MIX)}; got {part!r}")
        out[name.strip()] = int(value)
    if not any(out.values()):
        raise argparse.ArgumentTypeError("--weights: every weight is 0")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The same mixed IMAP load on Dovecot and on cassmail (mbox, Cassandra).")
    p.add_argument("--config", metavar="FILE", help="cassmail TOML settings: which Cassandra (default: built-ins)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set store.cassandra.port=19042 (repeatable)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"in order (default {','.join(TARGETS)})")
    p.add_argument("--clients", type=positive(int), default=16, help="concurrent sessions, one user each (default 16)")
    p.add_argument("--seconds", type=positive(float), default=30.0, help="measured seconds of the mix (default 30)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of mix before the measured ones (default 5)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="measured rounds per target, the targets taking turns, in reverse order every other round "
                        "(A B, B A, ...): the machine's speed drifting over the run then weighs on every target "
                        "alike (default 1)")
    p.add_argument("--login-seconds", type=float, default=10.0,
                   help="seconds of connect+LOGIN+LOGOUT per password scheme; 0 skips logins (default 10)")
    p.add_argument("--messages", type=positive(int), default=500, help="messages per INBOX (default 500)")
    p.add_argument("--sizes", type=parse_range, default=parse_range("2K-50K"),
                   help="their sizes, uniform (default 2K-50K)")
    p.add_argument("--window", type=positive(int), default=50, help="messages per FETCH (UID FLAGS) (default 50)")
    p.add_argument("--weights", type=parse_weights, default=parse_weights(""),
                   help="NAME=N,... replacing the default weights of: " + ", ".join(f"{k}={w}" for k, (w, _) in MIX.items()))
    p.add_argument("--dovecot-hash", default="auto", metavar="SCHEME[:COST]",
                   help="Dovecot's slow hash for the login table: auto (BLF-CRYPT at the cost nearest cassmail's "
                        "scrypt), or e.g. BLF-CRYPT:10, ARGON2ID, SHA512-CRYPT:5000 (doveadm pw -s SCHEME -r COST)")
    p.add_argument("--quiet-max", type=float, default=QUIET_MAX,
                   help=f"seconds to wait at most for Cassandra to settle after the fill (default {QUIET_MAX:g})")
    p.add_argument("--timeout", type=positive(float), default=30.0, help="seconds per command before it counts as an error")
    p.add_argument("--workers", type=int, default=0, help="cassmail worker processes (default 0 = one per core)")
    p.add_argument("--fill-concurrency", type=positive(int), default=32, help="deliveries in flight while filling")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--keep", action="store_true", help="keep the keyspace and the temporary directory")
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not args.targets or any(t not in TARGETS for t in args.targets):
        p.error(f"--targets: choose from {', '.join(TARGETS)}")
    if args.warmup < 0 or args.login_seconds < 0:
        p.error("--warmup and --login-seconds must be >= 0")
    return args


# --------------------------------------------------------------------------- the mail


def message(user: str, n: int, size: int) -> bytes:
    """Message n of a user, exactly `size` bytes (at least its header), the same on every target."""
    rng = random.Random(f"{user}/{n}")
    w1, w2 = rng.choice(WORDS), rng.choice(WORDS)
    head = (f"From: Sender {n % 97} <sender{n % 97}@remote.test>\r\nTo: <{user}>\r\n"
            f"Subject: {w1} {w2} update {n}\r\nDate: Mon, 02 Mar 2026 {n // 3600 % 24:02d}:{n // 60 % 60:02d}:"
            f"{n % 60:02d} +0000\r\nMessage-ID: <{n}.{user.replace('@', '.')}@bench.test>\r\nMIME-Version: 1.0\r\n"
            f"Content-Type: text/plain; charset=us-ascii\r\n\r\n").encode()
    room = max(2, size - len(head))
    line = " ".join(rng.choice(WORDS) for _ in range(12)).ljust(78, ".")[:78].encode() + b"\r\n"
    full, rest = divmod(room - 2, len(line))
    return head + line * full + line[:rest] + b"\r\n"


def sizes_of(user: str, count: int, sizes: tuple[int, int]) -> list[int]:
    """The same sizes in every run: drawn from the user's name without its (fresh) domain."""
    rng = random.Random(f"sizes/{user.split('@', 1)[0]}")
    return [rng.randint(*sizes) for _ in range(count)]


def plan(users: list[str], count: int, sizes: tuple[int, int]) -> Iterator[tuple[str, int, bytes]]:
    """(user, n, message) for every INBOX, message n of every user before message n+1 of any."""
    table = {u: sizes_of(u, count, sizes) for u in users}
    for n in range(count):
        for user in users:
            yield user, n, message(user, n, table[user][n])


# --------------------------------------------------------------------------- servers


@dataclasses.dataclass
class Scheme:
    """One password scheme of the login table: its users and what one verification costs."""

    label: str
    users: list[str]
    verify_ms: float | None


class Server:
    """One target: mailboxes filled before it starts, its CPU, a clean stop."""

    name = ""
    port = 0
    cass: CassandraCpu | None = None
    schemes: list[Scheme]

    async def prepare(self, users: list[str], login_users: list[str], args: argparse.Namespace) -> None:
        raise NotImplementedError

    def start(self) -> str:
        raise NotImplementedError

    def cpu(self) -> float | None:
        raise NotImplementedError

    def describe(self) -> str:
        return ""

    async def stop(self) -> list[str]:
        raise NotImplementedError


class DovecotServer(Server):
    name = "dovecot"

    def __init__(self, workdir: Path, slow_hash: str, slow_label: str, slow_ms: float | None) -> None:
        self.workdir = workdir
        self.slow_hash, self.slow_label, self.slow_ms = slow_hash, slow_label, slow_ms
        self.dovecot: Dovecot | None = None
        self.schemes = []

    async def prepare(self, users: list[str], login_users: list[str], args: argparse.Namespace) -> None:
        mail = self.workdir / "maildirs"
        self.dovecot = Dovecot(self.workdir, mail, users + login_users, PASSWORD,
                               hashes={u: self.slow_hash for u in login_users})
        t0 = time.perf_counter()
        stamp = int(time.time()) - 86400
        for user in users + login_users:
            local, domain = user.split("@", 1)
            for sub in ("cur", "new", "tmp", ".Archive/cur", ".Archive/new", ".Archive/tmp"):
                (mail / domain / local / sub).mkdir(parents=True, exist_ok=True)
        for user, n, body in plan(users, args.messages, args.sizes):
            local, domain = user.split("@", 1)
            path = mail / domain / local / "new" / f"{stamp + n}.M{n}P{os.getpid()}.bench,S={len(body)}"
            path.write_bytes(body)
            os.utime(path, (stamp + n, stamp + n))
        for root, dirs, files in os.walk(mail):
            for name in [*dirs, *files]:
                os.chown(os.path.join(root, name), self.dovecot.uid, self.dovecot.uid)
        self.dovecot.configure()
        self.schemes = [Scheme("{PLAIN} (Dovecot's default)", users, dovecot_verify_ms("{PLAIN}" + PASSWORD)),
                        Scheme(self.slow_label, login_users, self.slow_ms)]
        say(f"  Maildirs written in {time.perf_counter() - t0:.1f} s")

    def start(self) -> str:
        assert self.dovecot is not None
        self.dovecot.start()
        self.port = self.dovecot.imap_port
        return (f"Dovecot {self.dovecot.version()} master pid {self.dovecot.master_pid()} IMAP :{self.port} "
                f"(a process per session, login processes in high-security mode: Dovecot's defaults)")

    def cpu(self) -> float | None:
        return self.dovecot.cpu() if self.dovecot is not None else None

    async def stop(self) -> list[str]:
        if self.dovecot is None:
            return []
        out = [f"Dovecot: {self.dovecot.stop()}"]
        problems = [ln for ln in self.dovecot.log_text().splitlines() if "Error:" in ln or "Panic:" in ln]
        if problems:
            out.append(f"  its log had {len(problems)} error line(s), first: {problems[0][:300]}")
        return out


class CassmailServer(Server):
    def __init__(self, name: str, settings: Settings, workdir: Path, workers: int, quiet_max: float) -> None:
        self.name = name
        self.quiet_max = quiet_max
        self.settings = settings
        self.workdir = workdir
        self.workers = workers
        self.node: CassmailNode | None = None
        self.made_keyspace = False
        c = settings.store.cassandra
        self.cass = CassandraCpu(c.contact_points, c.port) if settings.store.backend == "cassandra" else None
        self.schemes = []

    async def prepare(self, users: list[str], login_users: list[str], args: argparse.Namespace) -> None:
        if self.settings.store.backend == "cassandra":
            from cassmail.store import cassandra_schema

            self.made_keyspace = True
            await asyncio.to_thread(cassandra_schema.apply, self.settings.store.cassandra)
        configured = HashParams.from_settings(self.settings.auth)
        store = make_store(self.settings)
        await store.open()
        t0 = time.perf_counter()
        try:
            domain = users[0].split("@", 1)[1]
            await store.add_domain(domain)
            await make_users(store, domain, len(users), params=SCRYPT_FLOOR)
            await make_users(store, domain, len(login_users), params=configured, prefix="s")
            todo = plan(users, args.messages, args.sizes)

            async def deliverer() -> None:
                for user, _, body in todo:  # one iterator shared by every deliverer
                    await store.deliver(body, [Delivery(user)])

            await asyncio.gather(*(deliverer() for _ in range(args.fill_concurrency)))
        finally:
            await store.close()
        say(f"  {len(users) * args.messages} messages delivered through the Store API in {time.perf_counter() - t0:.1f} s")
        self.schemes = [
            Scheme(f"scrypt N=2^{SCRYPT_FLOOR.log2_n} r={SCRYPT_FLOOR.r} (cassmail's floor)", users,
                   scrypt_verify_ms(SCRYPT_FLOOR)),
            Scheme(f"scrypt N=2^{configured.log2_n} r={configured.r} p={configured.p} (auth.scrypt_n)", login_users,
                   scrypt_verify_ms(configured)),
        ]

    def start(self) -> str:
        if self.cass is not None:
            waited = self.cass.wait_quiet(self.quiet_max, QUIET_CORES)
            if waited > 6:
                say(f"  waited {waited:.0f} s for Cassandra to finish flushing and compacting the fill")
        self.node = CassmailNode(self.settings, self.workdir, ["imap"], workers=self.workers,
                                 name=self.name).start()
        self.port = self.node.ports["imap"]
        store = self.settings.store
        where = (f"keyspace {store.cassandra.keyspace} on {','.join(store.cassandra.contact_points)}:{store.cassandra.port}"
                 f" (RF=1, CL ONE); {self.cass.label if self.cass else ''}" if store.backend == "cassandra"
                 else f"mbox store in {store.mbox.path} (fsync {'on' if store.mbox.fsync else 'off'})")
        return f"cassmail serve pid {self.node.pid}, {self.node.workers} worker(s), IMAP :{self.port}, {where}"

    def cpu(self) -> float | None:
        return self.node.cpu() if self.node is not None else None

    async def stop(self) -> list[str]:
        out = []
        if self.node is not None:
            out.append(f"{self.name}: {self.node.stop()}")
            problems = [ln for ln in self.node.log_text(500_000).splitlines() if "level=error" in ln or "Traceback" in ln]
            if problems:
                out.append(f"  its log had {len(problems)} error line(s), first: {problems[0][:300]}")
        if self.made_keyspace:
            out.append("  " + await drop_keyspace(self.settings.store.cassandra))
        return out


# --------------------------------------------------------------------------- the mix


@dataclasses.dataclass
class Tally:
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: int = 0
    first_error: str = ""

    def error(self, text: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or text[:200]


@dataclasses.dataclass
class Clock:
    start: float = math.inf
    end: float = math.inf


@dataclasses.dataclass
class MixRun:
    target: str
    wall: float = 0.0
    tallies: dict[str, Tally] = dataclasses.field(default_factory=lambda: {k: Tally() for k in MIX})
    cpu: dict[str, float | None] = dataclasses.field(default_factory=dict)
    messages: int = 0
    bytes: int = 0
    reconnects: int = 0
    load: float = 0.0  # the machine's load average as the measured seconds began

    def rate(self, kind: str | None = None) -> float:
        n = sum(len(t.latencies) for k, t in self.tallies.items() if kind in (None, k))
        return n / self.wall if self.wall else 0.0

    def mean(self, kind: str) -> float | None:
        t = self.tallies[kind].latencies
        return sum(t) / len(t) if t else None

    @property
    def commands(self) -> int:
        return sum(len(t.latencies) for t in self.tallies.values())

    @property
    def errors(self) -> int:
        return sum(t.errors for t in self.tallies.values())


class Session:
    """One client of the mix: its connection, its messages (UID -> size) and what it appended."""

    def __init__(self, index: int, port: int, user: str, args: argparse.Namespace, run: MixRun, clock: Clock) -> None:
        self.index, self.port, self.user, self.args, self.run, self.clock = index, port, user, args, run, clock
        self.rng = random.Random(f"mix/{index}")  # the same draws on every target
        self.client: Imap | None = None
        self.sizes: dict[int, int] = {}
        self.uids: list[int] = []
        self.pending: list[int] = []
        self.appended = 0

    async def open(self) -> None:
        client = await Imap.connect(self.port)
        try:
            await client.cmd(f'LOGIN "{self.user}" "{PASSWORD}"')
            await client.cmd("SELECT INBOX")
            if not self.sizes:
                lines, _ = await client.cmd("UID FETCH 1:* (RFC822.SIZE)")
                for line in lines:
                    m = re.search(rb"UID (\d+) RFC822.SIZE (\d+)|RFC822.SIZE (\d+) UID (\d+)", line)
                    if m:
                        uid, size = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
                        self.sizes[int(uid)] = int(size)
                if len(self.sizes) != self.args.messages:
                    raise RuntimeError(f"{self.user}: INBOX lists {len(self.sizes)} messages, "
                                       f"{self.args.messages} were stored")
                self.uids = sorted(self.sizes)
        except BaseException:
            await client.close()
            raise
        self.client = client

    async def timed(self, kind: str, call: Awaitable[Reply], check: Callable[[Reply], str | None] | None = None) -> Reply:
        """Run one command; count it (latency or error) when it ran inside the measured window."""
        t0 = time.monotonic()
        reply = await call
        t1 = time.monotonic()
        if t0 >= self.clock.start and t1 <= self.clock.end:
            tally = self.run.tallies[kind]
            problem = (f"{reply.status}: {reply.lines[-1][:150]!r}" if reply.status != "OK"
                       else (check(reply) if check is not None else None))
            if problem:
                tally.error(problem)
            else:
                tally.latencies.append(t1 - t0)
        return reply

    async def one(self, kind: str) -> None:
        c, rng, uid = self.client, self.rng, self.rng.choice(self.uids)
        assert c is not None
        if kind == "fetch-flags":
            w = min(self.args.window, len(self.uids))
            first = rng.randint(1, len(self.uids) - w + 1)
            await self.timed(kind, c.command(f"FETCH {first}:{first + w - 1} (UID FLAGS)"),
                             lambda r: None if sum(b" FETCH (" in ln for ln in r.lines) >= w else "too few FETCH lines")
        elif kind == "fetch-headers":
            await self.timed(kind, c.command(f"UID FETCH {uid} (BODY.PEEK[HEADER.FIELDS (From To Subject Date)])"),
                             lambda r: None if any(b"Subject:" in x for x in r.literals) else "no Subject: returned")
        elif kind == "fetch-body":
            size = self.sizes[uid]
            await self.timed(kind, c.command(f"UID FETCH {uid} BODY.PEEK[]"),
                             lambda r: None if any(len(x) == size for x in r.literals) else f"no body of {size} bytes")
        elif kind == "store":
            sign, flag = rng.choice("+-"), rng.choice(("\\Seen", "\\Flagged"))
            await self.timed(kind, c.command(f"UID STORE {uid} {sign}FLAGS ({flag})"))
        elif kind == "search-unseen":
            await self.timed(kind, c.command("SEARCH UNSEEN"), _has_search)
        elif kind == "search-subject":
            await self.timed(kind, c.command(f'SEARCH SUBJECT "{rng.choice(WORDS)}"'), _has_search)
        elif kind == "noop":
            await self.timed(kind, c.command("NOOP"))
        elif kind == "append":
            self.appended += 1
            body = message(self.user, 1_000_000 + self.appended, rng.randint(1000, 4000))
            reply = await self.timed(kind, c.append("INBOX", body),
                                     lambda r: None if re.search(rb"APPENDUID \d+ \d+", r.lines[-1]) else "no APPENDUID")
            m = re.search(rb"APPENDUID \d+ (\d+)", reply.lines[-1])
            if m:
                self.pending.append(int(m.group(1)))
        elif kind == "copy":
            await self.timed(kind, c.command(f"UID COPY {uid} Archive"))
        elif kind == "expunge":
            uids = ",".join(map(str, self.pending))
            await self.timed("store", c.command(f"UID STORE {uids} +FLAGS.SILENT (\\Deleted)"))
            await self.timed(kind, c.command(f"UID EXPUNGE {uids}"))
            self.pending.clear()
        elif kind == "status":
            await self.timed(kind, c.command("STATUS Archive (MESSAGES UNSEEN UIDNEXT)"),
                             lambda r: None if any(ln.startswith(b"* STATUS") for ln in r.lines) else "no STATUS")
        elif kind == "idle":
            await self.timed(kind, c.idle())

    async def loop(self, weights: dict[str, int]) -> None:
        deck: list[str] = []
        while time.monotonic() < self.clock.end:
            if not deck:
                deck = [k for k, w in weights.items() for _ in range(w)]
                self.rng.shuffle(deck)
            kind = deck.pop()
            if kind == "expunge" and not self.pending:
                continue
            try:
                if self.client is None:
                    self.run.reconnects += 1
                    await asyncio.wait_for(self.open(), self.args.timeout)
                await asyncio.wait_for(self.one(kind), self.args.timeout)
            except (OSError, ConnectionError, RuntimeError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                if time.monotonic() >= self.clock.start:
                    self.run.tallies[kind].error(f"{type(exc).__name__}: {exc}")
                if self.client is not None:
                    self.client.writer.close()
                    self.client = None
                    self.pending.clear()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _has_search(reply: Reply) -> str | None:
    return None if any(ln.startswith(b"* SEARCH") for ln in reply.lines) else "no * SEARCH"


async def open_sessions(server: Server, users: list[str], args: argparse.Namespace) -> list[Session]:
    """Every client logged in, its INBOX selected and listed (not measured)."""
    sessions = [Session(i, server.port, u, args, MixRun(server.name), Clock()) for i, u in enumerate(users)]
    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(s.open() for s in sessions)), OPEN_TIMEOUT)
    messages = sum(len(s.sizes) for s in sessions)
    say(f"  {TITLES[server.name]}: {len(sessions)} sessions logged in and listed {messages} messages "
        f"({sum(sum(s.sizes.values()) for s in sessions) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return sessions


async def mix_phase(server: Server, sessions: list[Session], args: argparse.Namespace) -> MixRun:
    """One measured round of the mix on open sessions: --warmup seconds, then --seconds counted."""
    run, clock = MixRun(server.name), Clock()
    run.messages = sum(len(s.sizes) for s in sessions)
    run.bytes = sum(sum(s.sizes.values()) for s in sessions)
    for s in sessions:
        s.run, s.clock = run, clock
    now = time.monotonic()
    clock.start, clock.end = now + args.warmup, now + args.warmup + args.seconds
    loops = asyncio.gather(*(s.loop(args.weights) for s in sessions))
    await asyncio.sleep(max(0.0, clock.start - time.monotonic()))
    before, run.load = _sample(server), os.getloadavg()[0]
    await asyncio.sleep(max(0.0, clock.end - time.monotonic()))
    after = _sample(server)
    run.wall = clock.end - clock.start
    run.cpu = {k: (None if before[k] is None or after[k] is None else after[k] - before[k]) for k in before}
    await loops
    return run


def merged(rounds: list[MixRun]) -> MixRun:
    """One target's rounds as one run: their commands, errors, seconds and CPU added up."""
    out = MixRun(rounds[0].target, messages=rounds[0].messages, bytes=rounds[0].bytes)
    for r in rounds:
        out.wall += r.wall
        out.reconnects += r.reconnects
        for kind, t in r.tallies.items():
            total = out.tallies[kind]
            total.latencies += t.latencies
            total.errors += t.errors
            total.first_error = total.first_error or t.first_error
        for key, value in r.cpu.items():
            before = out.cpu.get(key, 0.0)
            out.cpu[key] = None if value is None or before is None else before + value
    out.load = sum(r.load for r in rounds) / len(rounds)
    return out


def _sample(server: Server) -> dict[str, float | None]:
    return {"server": server.cpu(), "Cassandra": server.cass.seconds() if server.cass and server.cass.enabled else None,
            "load generator": own_cpu(), "machine": machine_cpu()[0]}


# --------------------------------------------------------------------------- logins


@dataclasses.dataclass
class LoginRun:
    target: str
    scheme: str
    verify_ms: float | None
    wall: float = 0.0
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    cpu: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0


async def login_phase(server: Server, scheme: Scheme, args: argparse.Namespace) -> LoginRun:
    run = LoginRun(server.name, scheme.label, scheme.verify_ms)
    end = time.monotonic() + args.login_seconds

    async def loop(user: str) -> None:
        while time.monotonic() < end:
            t0 = time.monotonic()
            client = None
            try:
                client = await asyncio.wait_for(Imap.connect(server.port), args.timeout)
                reply = await asyncio.wait_for(client.command(f'LOGIN "{user}" "{PASSWORD}"'), args.timeout)
                if reply.status != "OK":
                    raise RuntimeError(f"LOGIN: {reply.lines[-1][:150]!r}")
                await asyncio.wait_for(client.cmd("LOGOUT"), args.timeout)
            except (OSError, ConnectionError, RuntimeError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                run.errors += 1
                run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"[:200]
                continue
            finally:
                if client is not None:
                    client.writer.close()
            if time.monotonic() <= end:
                run.latencies.append(time.monotonic() - t0)

    before, t0 = _sample(server), time.monotonic()
    await asyncio.gather(*(loop(scheme.users[i % len(scheme.users)]) for i in range(args.clients)))
    after = _sample(server)
    run.wall = min(time.monotonic(), end) - t0
    run.cpu = {k: (None if before[k] is None or after[k] is None else after[k] - before[k]) for k in before}
    return run


# --------------------------------------------------------------------------- tables


def ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.3f}x"


def mix_tables(runs: list[MixRun], args: argparse.Namespace) -> list[str]:
    base = next((r for r in runs if r.target == "dovecot"), None)
    others = [r for r in runs if r is not base]
    head = ["command", "weight", *(f"{TITLES[r.target]} cmds/s" for r in runs),
            *(f"{TITLES[r.target]} / Dovecot" for r in others if base)]
    rows = []
    for kind, (_, sent) in MIX.items():
        if not args.weights[kind] and not any(r.tallies[kind].latencies for r in runs):
            continue
        rows.append([sent, str(args.weights[kind]), *(f"{r.rate(kind):.1f}" for r in runs),
                     *(ratio(base.mean(kind), r.mean(kind)) for r in others if base)])
    rows.append(["**all commands**", str(sum(args.weights.values())), *(f"**{r.rate():.1f}**" for r in runs),
                 *(f"**{ratio(r.rate(), base.rate())}**" for r in others if base)])
    rounds = f"{args.rounds} rounds of " if args.rounds > 1 else ""
    out = [f"Commands/s, {args.clients} clients, {rounds}{args.seconds:g} s measured after {args.warmup:g} s of warm-up; "
           "one command at a time per client, drawn from a shuffled deck of the weights, so every target runs "
           "the same proportions. Ratio per command: Dovecot's mean latency / cassmail's (how many of that "
           "command cassmail answers in the time Dovecot answers one); all commands: the ratio of cmds/s. "
           "UID STORE also counts the +FLAGS.SILENT (\\Deleted) before each UID EXPUNGE.", ""]
    out += markdown(head, rows, {0})
    head = ["command", *(f"{TITLES[r.target]} mean / p50 / p99 ms" for r in runs)]
    rows = []
    for kind, (_, sent) in MIX.items():
        if any(r.tallies[kind].latencies for r in runs):
            rows.append([sent, *(" / ".join(fmt(_ms(v), ".2f") for v in (r.mean(kind), pct(r.tallies[kind].latencies, 50),
                                                                          pct(r.tallies[kind].latencies, 99)))
                                 for r in runs)])
    out += ["", "Latency, from the command sent to its tagged reply:", ""] + markdown(head, rows, {0})
    head = ["target", "commands", "errors", "server CPU s", "Cassandra CPU s", "server+Cassandra CPU ms/command",
            "load generator CPU s", "everything else CPU s", "machine busy cores", "load average", "mailboxes (messages, MB)"]
    rows = []
    for r in runs:
        used = (r.cpu.get("server") or 0.0) + (r.cpu.get("Cassandra") or 0.0)
        machine = r.cpu.get("machine")
        # /proc/stat and the processes are read a moment apart: a slightly negative rest is 0.
        rest = None if machine is None else max(0.0, machine - used - (r.cpu.get("load generator") or 0.0))
        rows.append([TITLES[r.target], str(r.commands), str(r.errors), fmt(r.cpu.get("server")),
                     fmt(r.cpu.get("Cassandra")), fmt(used * 1000 / r.commands if r.commands else None, ".2f"),
                     fmt(r.cpu.get("load generator")), fmt(rest),
                     fmt(machine / r.wall if r.wall and machine is not None else None, ".2f"), f"{r.load:.2f}",
                     f"{r.messages}, {r.bytes / 1e6:.1f}"])
    out += ["", "CPU seconds over the measured seconds (server: Dovecot's master and every process it forked, or "
            "cassmail serve and its workers; everything else: the rest of the machine, other work on it "
            "included):", ""] + markdown(head, rows, {0})
    for r in runs:
        for kind, t in r.tallies.items():
            if t.errors:
                out.append(f"- {TITLES[r.target]} {kind}: {t.errors} error(s), first: {t.first_error}")
        if r.reconnects:
            out.append(f"- {TITLES[r.target]}: {r.reconnects} session(s) logged in again after an error")
    return out


def login_table(runs: list[LoginRun], args: argparse.Namespace) -> list[str]:
    head = ["target", "password scheme", "one check ms", "sessions/s", "p50 ms", "p99 ms", "errors",
            "server CPU ms/session", "Cassandra CPU ms/session"]
    rows = []
    for r in runs:
        n = len(r.latencies)
        per = (lambda v: fmt(v * 1000 / n if v is not None and n else None, ".1f"))
        rows.append([TITLES[r.target], r.scheme, fmt(r.verify_ms, ".1f"), f"{r.rate:.1f}",
                     fmt(_ms(pct(r.latencies, 50)), ".1f"), fmt(_ms(pct(r.latencies, 99)), ".1f"), str(r.errors),
                     per(r.cpu.get("server")), per(r.cpu.get("Cassandra"))])
    out = [f"Logins, apart from the mix: {args.clients} loops of connect + LOGIN + LOGOUT for {args.login_seconds:g} s "
           "per scheme (one check ms: one verification of the right password, measured outside the server):", ""]
    out += markdown(head, rows, {0, 1})
    base = [r for r in runs if r.target == "dovecot"]
    if len(base) == 2:
        for r in runs:
            if r.target != "dovecot":
                b = base[0] if "floor" in r.scheme else base[1]
                out.append(f"- {TITLES[r.target]} {r.scheme} / Dovecot {b.scheme}: {ratio(r.rate, b.rate)} sessions/s")
    for r in runs:
        if r.errors:
            out.append(f"- {TITLES[r.target]} {r.scheme}: {r.errors} error(s), first: {r.first_error}")
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def to_json(mix: list[MixRun], logins: list[LoginRun], preface: list[str],
            rounds: list[list[MixRun]]) -> dict[str, object]:
    return {
        "preface": preface,
        "mix": {r.target: {"seconds": r.wall, "cpu": r.cpu, "messages": r.messages, "bytes": r.bytes,
                           "commands_per_s": r.rate(), "reconnects": r.reconnects, "load": r.load,
                           "types": {k: {"count": len(t.latencies), "per_s": r.rate(k), "errors": t.errors,
                                         "first_error": t.first_error, "p50": pct(t.latencies, 50),
                                         "p99": pct(t.latencies, 99)} for k, t in r.tallies.items()}}
                for r in mix},
        "logins": [{"target": r.target, "scheme": r.scheme, "verify_ms": r.verify_ms, "per_s": r.rate,
                    "sessions": len(r.latencies), "errors": r.errors, "first_error": r.first_error, "cpu": r.cpu}
                   for r in logins],
        "rounds": [[{"target": r.target, "seconds": r.wall, "commands": r.commands, "commands_per_s": r.rate(),
                     "errors": r.errors, "cpu": r.cpu} for r in done] for done in rounds],
    }


# --------------------------------------------------------------------------- main


async def start_target(server: Server, users: list[str], login_users: list[str], args: argparse.Namespace) -> None:
    """Fill a target's mailboxes, put them on disk and start its server."""
    say(f"\n## {TITLES[server.name]} (load average {os.getloadavg()[0]:.2f})")
    await server.prepare(users, login_users, args)
    # The fill's 200 MB reach the disk now, not under the mix: an fsync there would wait for
    # them (ext4 commits a journal for all dirty data), charging one target's fill to the next.
    t0 = time.perf_counter()
    await asyncio.to_thread(os.sync)
    say(f"  what the fill wrote synced to disk in {time.perf_counter() - t0:.1f} s")
    say("  " + server.start())


async def run_targets(servers: list[Server], users: list[str], login_users: list[str], args: argparse.Namespace,
                      rounds: list[list[MixRun]], logins: list[LoginRun]) -> None:
    """Every target filled and started, its sessions opened; then the measured rounds, the
    targets taking turns (reversed every other round); then the logins of each."""
    for server in servers:
        await start_target(server, users, login_users, args)
    say("")
    sessions = {server.name: await open_sessions(server, users, args) for server in servers}
    try:
        for n in range(args.rounds):
            done: list[MixRun] = []
            rounds.append(done)
            for server in servers if n % 2 == 0 else servers[::-1]:
                run = await mix_phase(server, sessions[server.name], args)
                done.append(run)
                say(f"  round {n + 1}, {TITLES[server.name]}: {run.rate():.1f} commands/s, {run.errors} errors, "
                    f"server CPU {fmt(run.cpu.get('server'))} s")
    finally:
        for group in sessions.values():
            await asyncio.gather(*(s.close() for s in group), return_exceptions=True)
    if args.login_seconds > 0:
        for server in servers:
            for scheme in server.schemes:
                lr = await login_phase(server, scheme, args)
                logins.append(lr)
                say(f"  {TITLES[server.name]} logins, {scheme.label}: {lr.rate:.1f} sessions/s, {lr.errors} errors")


def rounds_table(rounds: list[list[MixRun]]) -> list[str]:
    """Commands/s of each target in each round, in the order they ran, and the ratios."""
    names = [r.target for r in rounds[0]]
    base = "dovecot" if "dovecot" in names else None
    others = [t for t in names if t != base]
    head = ["round", "order", *(f"{TITLES[t]} cmds/s" for t in names), *(f"{TITLES[t]} / Dovecot" for t in others if base)]
    rows = []
    for n, done in enumerate(rounds, 1):
        by = {r.target: r for r in done}
        rows.append([str(n), ", ".join(TITLES[r.target] for r in done),
                     *(f"{by[t].rate():.1f}" if t in by else "-" for t in names),
                     *(ratio(by[t].rate(), by[base].rate()) if t in by and base in by else "-" for t in others if base)])
    return ["Each round on its own (a round: --warmup seconds, then --seconds measured, per target):", ""] + \
        markdown(head, rows, {1})


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench_imap_mix_"))
    os.chmod(workdir, 0o755)  # Dovecot's users (dovenull, nobody) go through it
    try:
        settings = {t: bench_settings(args.config, args.overrides, t, "bench_imap_mix", mbox_path=workdir / "mbox-store")
                    for t in args.targets if t != "dovecot"}
    except ConfigError as exc:
        print(f"bench_imap_mix: {exc}", file=sys.stderr)
        return 2
    if "dovecot" in args.targets:
        try:
            await asyncio.to_thread(ensure_packages, False, False, True, say)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"bench_imap_mix: {exc}", file=sys.stderr)
            return 2
    domain = f"imapmix-{secrets.token_hex(4)}.example"
    users = [f"u{i:04d}@{domain}" for i in range(args.clients)]
    login_users = [f"s{i:04d}@{domain}" for i in range(args.clients)]
    auth = next(iter(settings.values())).auth if settings else bench_settings(args.config, args.overrides, "mbox").auth
    scrypt_ms = scrypt_verify_ms(HashParams.from_settings(auth))
    preface = [
        f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.uname().nodename}: {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- command: `{' '.join(['.venv/bin/python', 'loadtest/bench_imap_mix.py', *(sys.argv[1:] if argv is None else argv)])}`",
        f"- {args.clients} users, one session each; {args.messages} messages per INBOX, sizes {range_label(*args.sizes)} "
        f"(uniform); the same bytes on every target",
        f"- mix weights: {', '.join(f'{k}={w}' for k, w in args.weights.items())}",
    ]
    say("# IMAP: the same mixed load on Dovecot and cassmail")
    for line in preface:
        say(line)
    rounds: list[list[MixRun]] = []
    logins: list[LoginRun] = []
    servers: list[Server] = []
    for name in args.targets:
        if name == "dovecot":
            stored, label, ms = await asyncio.to_thread(choose_dovecot_hash, args.dovecot_hash, scrypt_ms)
            say(f"\nDovecot's slow scheme for the login table: {label}, one check {ms:.1f} ms "
                f"(cassmail's scrypt at auth.scrypt_n: {scrypt_ms:.1f} ms)")
            servers.append(DovecotServer(workdir / "dovecot-target", stored, label, ms))
            (workdir / "dovecot-target").mkdir(mode=0o755)
        else:
            servers.append(CassmailServer(name, settings[name], workdir / f"{name}-node", args.workers, args.quiet_max))

    async def measure() -> None:
        await run_targets(servers, users, login_users, args, rounds, logins)

    async def stop() -> list[str]:
        return [line for server in reversed(servers) for line in await server.stop()]

    subdirs = ["dovecot-target", *(f"{s.name}-node" for s in servers if s.name != "dovecot"), "mbox-store"]
    title = ", ".join(TITLES[s.name] for s in servers)
    status = await guarded_target(title, measure, stop, workdir, subdirs, args.keep, say)
    measured = {s.name: [r for done in rounds for r in done if r.target == s.name] for s in servers}
    mixes = [merged(runs) for runs in measured.values() if runs]
    if args.keep:
        say(f"--keep: left {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if mixes:
        say("\n## results\n")
        for line in mix_tables(mixes, args):
            say(line)
        if len(rounds) > 1:
            say("")
            for line in rounds_table(rounds):
                say(line)
    if logins:
        say("")
        for line in login_table(logins, args):
            say(line)
    if args.json:
        args.json.write_text(json.dumps(to_json(mixes, logins, preface, rounds), indent=1))
    if len({(r.messages, r.bytes) for r in mixes}) > 1:
        say(f"\nwarning: the targets listed different mailboxes: {[(r.target, r.messages, r.bytes) for r in mixes]}")
    return status or (0 if mixes else 1)


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
