"""The Cassandra backend of the Store contract.

Data model (schema/001_initial.cql): a user is a partition listing its
mailboxes; a mailbox is a partition of small message rows clustered by
timeuuid; bodies are cut into chunks, each chunk its own partition. Aliases
(schema/003_aliases.cql) are a partition per domain, a row per alias, with
an index of the aliases that list each user.

The outbound queue and DKIM keys (schema/006_outbound.cql) are in
cassandra_queue.py; Sieve scripts (schema/007_sieve.cql) in cassandra_sieve.py.

Delivery is plain idempotent writes at the write consistency level, in an
order that never shows a half-written message: chunks first, then (for a
body shared by several copies) its reference row, then the message rows in
one logged batch. Only UID allocation, IMAP \\Recent claims, mailbox creation
and user creation use lightweight transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from cassandra import ConsistencyLevel, DriverException
from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, NoHostAvailable, ResponseFuture, Session
from cassandra.connection import ConnectionBusy, ConnectionException
from cassandra.pool import NoConnectionsAvailable
from cassandra.policies import DCAwareRoundRobinPolicy, TokenAwarePolicy
from cassandra.query import BatchStatement, BatchType, PreparedStatement, Statement

from cassmail.config import CassandraSettings
from cassmail.model import (
    DEFAULT_MAILBOXES,
    HIERARCHY_DELIMITER,
    INBOX,
    InvalidInput,
    MailboxInfo,
    MessageSummary,
    Page,
    address_key,
    flag_set,
    mailbox_name,
    new_message_id,
    normalize_domain,
    timeuuid_seconds,
)
from cassmail.store.base import (
    Alias,
    AliasExists,
    Body,
    DomainInUse,
    FlagMode,
    MailboxExists,
    MailboxNotAllowed,
    NoSuchAlias,
    NoSuchDomain,
    NoSuchMailbox,
    NoSuchMessage,
    NoSuchUser,
    StoreUnavailable,
    Target,
    UserExists,
    check_alias,
    check_flag_mode,
    check_recent_below,
    check_rename,
    checked_password_hash,
    internal_date as internal_date_utc,
    needs_uid,
    prepare_delivery,
    uid_work,
)

from cassmail.store.cassandra_queue import QUEUE_STATEMENTS, CassandraQueue
from cassmail.store.cassandra_sieve import SIEVE_STATEMENTS, CassandraSieve

log = logging.getLogger(__name__)

#: Seconds beyond the request timeout a write may take to land (see changes_token).
CHANGES_SETTLE = 2.0
#: Rows per conditional batch when assigning UIDs (keeps batches far below batch_size_fail_threshold).
UID_BATCH = 256
#: Ids per `IN (...)` read or delete.
IN_BATCH = 100
#: Smallest partial move of a low-water mark by a listing (100 ns units: one minute), so that
#: listings of a mailbox with recent deletions write at most about once a minute.
CATCH_UP_STEP_100NS = 60 * 10_000_000
#: Attempts at one conditional write before giving up with StoreUnavailable.
LWT_ATTEMPTS = 32
_EPOCH_OFFSET_100NS = 0x01B21DD213814000
#: What the driver raises when Cassandra fails: not all of it derives from DriverException
#: (NoHostAvailable, the connection errors and the pool's are plain Exceptions), so code that
#: turns driver failures into StoreUnavailable catches this whole tuple.
DRIVER_FAILURES: tuple[type[Exception], ...] = (
    DriverException,
    NoHostAvailable,
    ConnectionException,
    ConnectionBusy,
    NoConnectionsAvailable,
)
_READ_EVENT = re.compile(r"Read (\d+) live rows? and (\d+) tombstone cells?")


@dataclass
class ReadCost:
    """What Cassandra reported reading for the statements run inside `CassandraStore.tracing()`."""

    statements: int = 0
    live_rows: int = 0
    tombstones: int = 0


_tracing: contextvars.ContextVar[ReadCost | None] = contextvars.ContextVar("cassmail_tracing", default=None)


#: The anchor row of every mailbox partition: the largest timeuuid, written with the UID counter.
ANCHOR = uuid.UUID(fields=(0xFFFFFFFF, 0xFFFF, 0x1FFF, 0xBF, 0xFF, 0xFFFFFFFFFFFF))


def _floor_uuid(timestamp_100ns: int) -> uuid.UUID:
    """The smallest timeuuid of a 100 ns tick: a bound for `id > bound` range reads."""
    t = max(timestamp_100ns, 0)
    return uuid.UUID(fields=(t & 0xFFFFFFFF, (t >> 32) & 0xFFFF, ((t >> 48) & 0x0FFF) | 0x1000, 0x80, 0x00, 0))


def _now_100ns() -> int:
    return int(time.time() * 10_000_000) + _EPOCH_OFFSET_100NS


class CassandraStore(CassandraSieve, CassandraQueue):
    def __init__(self, settings: CassandraSettings, max_message_size: int = 0) -> None:
        self.settings = settings
        self.max_message_size = max_message_size
        self._cluster: Cluster | None = None
        self._session: Session | None = None
        self._ps: dict[str, PreparedStatement] = {}
        # Chunk reads and writes in flight across every message of this process: backpressure
        # instead of filling the driver's socket buffers until it refuses requests.
        self._chunk_slots = asyncio.Semaphore(settings.max_chunks_in_flight)
        cl = ConsistencyLevel.name_to_value
        self._read_cl = cl[settings.read_consistency.upper()]
        self._write_cl = cl[settings.write_consistency.upper()]
        self._serial_cl = cl[settings.serial_consistency.upper()]
        self._queue_init()

    # ================================================================= connection

    def _make_cluster(self) -> Cluster:
        s = self.settings
        lb = TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=s.local_dc or None))
        profile = ExecutionProfile(
            load_balancing_policy=lb,
            request_timeout=s.request_timeout,
            consistency_level=self._read_cl,
            serial_consistency_level=self._serial_cl,
        )
        auth = PlainTextAuthProvider(s.username, s.password) if s.username else None
        return Cluster(
            contact_points=s.contact_points,
            port=s.port,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            auth_provider=auth,
            connect_timeout=s.connect_timeout,
            control_connection_timeout=s.connect_timeout,
            protocol_version=5,
        )

    async def open(self) -> None:
        if self._session is not None:
            return
        self._cluster = self._make_cluster()
        try:
            self._session = await asyncio.to_thread(self._cluster.connect)
        except DriverException as exc:
            self._cluster.shutdown()
            self._cluster = None
            raise StoreUnavailable(f"cannot reach Cassandra at {self._where()}: {_brief(exc)}") from exc
        except Exception as exc:  # the driver raises bare Exception subclasses on connect
            self._cluster.shutdown()
            self._cluster = None
            raise StoreUnavailable(f"cannot reach Cassandra at {self._where()}: {_brief(exc)}") from exc
        if self.settings.keyspace not in self._cluster.metadata.keyspaces:
            await self.close()
            raise StoreUnavailable(
                f"keyspace {self.settings.keyspace} does not exist on "
                f"{','.join(self.settings.contact_points)}:{self.settings.port}: run `cassmail schema apply`"
            )
        try:
            await self._prepare_all()
        except StoreUnavailable:
            await self.close()
            raise

    def _where(self) -> str:
        return f"{','.join(self.settings.contact_points)}:{self.settings.port} keyspace {self.settings.keyspace}"

    async def close(self) -> None:
        if self._cluster is not None:
            cluster, self._cluster, self._session = self._cluster, None, None
            await asyncio.to_thread(cluster.shutdown)

    @property
    def session(self) -> Session:
        if self._session is None:
            raise StoreUnavailable("store is not open")
        return self._session

    _STATEMENTS: dict[str, tuple[str, str]] = {
        # name: (cql, "r" read / "w" write / "s" serial read / "l" conditional write)
        "domain_add": ("INSERT INTO domains (bucket, domain) VALUES (0, ?)", "w"),
        "domain_del": ("DELETE FROM domains WHERE bucket = 0 AND domain = ?", "w"),
        "domain_get": ("SELECT domain FROM domains WHERE bucket = 0 AND domain = ?", "r"),
        "domain_list": ("SELECT domain FROM domains WHERE bucket = 0", "r"),
        "user_create": (
            "INSERT INTO users (user, password_hash, created, next_uidvalidity) VALUES (?, ?, ?, ?) IF NOT EXISTS",
            "l",
        ),
        "user_static": ("SELECT password_hash, next_uidvalidity FROM users WHERE user = ? LIMIT 1", "r"),
        "user_static_serial": ("SELECT password_hash, next_uidvalidity FROM users WHERE user = ? LIMIT 1", "s"),
        "user_passwd": ("UPDATE users SET password_hash = ? WHERE user = ? IF password_hash != null", "l"),
        "user_del": ("DELETE FROM users WHERE user = ?", "w"),
        "by_domain_add": ("INSERT INTO users_by_domain (domain, user) VALUES (?, ?)", "w"),
        "by_domain_del": ("DELETE FROM users_by_domain WHERE domain = ? AND user = ?", "w"),
        "by_domain_list": ("SELECT user FROM users_by_domain WHERE domain = ?", "r"),
        "users_alive": (
            "SELECT user, password_hash FROM users WHERE user IN ? PER PARTITION LIMIT 1",
            "r",
        ),
        "by_domain_domains": ("SELECT DISTINCT domain FROM users_by_domain", "r"),
        "alias_get": ("SELECT users FROM aliases WHERE domain = ? AND alias = ?", "r"),
        "alias_list": ("SELECT alias, users FROM aliases WHERE domain = ?", "r"),
        "alias_set": ("INSERT INTO aliases (domain, alias, users) VALUES (?, ?, ?)", "w"),
        "alias_del": ("DELETE FROM aliases WHERE domain = ? AND alias = ?", "w"),
        "alias_drop_user": ("UPDATE aliases SET users = users - ? WHERE domain = ? AND alias = ?", "w"),
        "alias_of_add": ("INSERT INTO aliases_by_user (user, alias) VALUES (?, ?)", "w"),
        "alias_of_del": ("DELETE FROM aliases_by_user WHERE user = ? AND alias = ?", "w"),
        "alias_of_list": ("SELECT alias FROM aliases_by_user WHERE user = ?", "r"),
        "alias_of_purge": ("DELETE FROM aliases_by_user WHERE user = ?", "w"),
        "mbox_list": (
            "SELECT mailbox, mailbox_id, uidvalidity, special_use, subscribed, low_water, low_water_due "
            "FROM users WHERE user = ?",
            "r",
        ),
        "mbox_get": (
            "SELECT mailbox_id, uidvalidity, special_use, subscribed, low_water, low_water_due FROM users "
            "WHERE user = ? AND mailbox = ?",
            "r",
        ),
        "mbox_get_serial": (
            "SELECT mailbox_id, uidvalidity, special_use, subscribed, low_water, low_water_due FROM users "
            "WHERE user = ? AND mailbox = ?",
            "s",
        ),
        "mbox_insert": (
            "INSERT INTO users (user, mailbox, mailbox_id, uidvalidity, special_use, subscribed, low_water, "
            "low_water_due) VALUES (?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS",
            "l",
        ),
        "mbox_insert_plain": (
            "INSERT INTO users (user, mailbox, mailbox_id, uidvalidity, special_use, subscribed) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            "l",
        ),
        "mbox_bump_uidvalidity": (
            "UPDATE users SET next_uidvalidity = ? WHERE user = ? IF next_uidvalidity = ?",
            "l",
        ),
        "mbox_subscribe": ("UPDATE users SET subscribed = ? WHERE user = ? AND mailbox = ? IF mailbox_id = ?", "l"),
        "mbox_delete_if": ("DELETE FROM users WHERE user = ? AND mailbox = ? IF mailbox_id = ?", "l"),
        "mbox_reassign": (
            "UPDATE users SET mailbox_id = ?, uidvalidity = ?, low_water = null, low_water_due = null "
            "WHERE user = ? AND mailbox = ? IF mailbox_id = ?",
            "l",
        ),
        "msg_insert": (
            "INSERT INTO messages (mailbox_id, id, size, flags, internal_date, body_id, chunk_size, shared, changed) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            "w",
        ),
        "msg_page": (
            "SELECT id, size, flags, internal_date, uid FROM messages WHERE mailbox_id = ? AND id > ? LIMIT ?",
            "r",
        ),
        "msg_page_first": (
            "SELECT id, size, flags, internal_date, uid FROM messages WHERE mailbox_id = ? LIMIT ?",
            "r",
        ),
        "msg_anchor": ("SELECT uidnext, recent_mark, uid FROM messages WHERE mailbox_id = ? AND id = ?", "s"),
        "msg_first_live": ("SELECT id, size FROM messages WHERE mailbox_id = ? AND id > ? LIMIT 16", "r"),
        "msg_first_live_all": ("SELECT id, size FROM messages WHERE mailbox_id = ? LIMIT 16", "r"),
        "mbox_set_low_water": (
            "UPDATE users SET low_water = ?, low_water_due = ? WHERE user = ? AND mailbox = ? IF mailbox_id = ?",
            "l",
        ),
        "msg_body_info": (
            "SELECT body_id, size, chunk_size FROM messages WHERE mailbox_id = ? AND id = ?",
            "r",
        ),
        "msg_body_infos": (
            "SELECT id, body_id, size, chunk_size, shared FROM messages WHERE mailbox_id = ? AND id IN ?",
            "r",
        ),
        "msg_walk": (
            "SELECT id, body_id, size, chunk_size, shared FROM messages WHERE mailbox_id = ? AND id > ? LIMIT ?",
            "r",
        ),
        "msg_walk_first": (
            "SELECT id, body_id, size, chunk_size, shared FROM messages WHERE mailbox_id = ? LIMIT ?",
            "r",
        ),
        "msg_summaries": (
            "SELECT id, size, flags, internal_date, uid FROM messages WHERE mailbox_id = ? AND id IN ?",
            "r",
        ),
        "msg_delete": ("DELETE FROM messages WHERE mailbox_id = ? AND id IN ?", "w"),
        "msg_purge": ("DELETE FROM messages WHERE mailbox_id = ?", "w"),
        "flags_set": ("UPDATE messages SET flags = ?, changed = ? WHERE mailbox_id = ? AND id = ?", "w"),
        "flags_add": ("UPDATE messages SET flags = flags + ?, changed = ? WHERE mailbox_id = ? AND id = ?", "w"),
        "flags_remove": ("UPDATE messages SET flags = flags - ?, changed = ? WHERE mailbox_id = ? AND id = ?", "w"),
        "msg_changed": ("UPDATE messages SET changed = ? WHERE mailbox_id = ?", "w"),
        "msg_changes_token": ("SELECT changed, uid FROM messages WHERE mailbox_id = ? AND id = ?", "r"),
        "uid_read": ("SELECT id, uid, size, uidnext FROM messages WHERE mailbox_id = ? AND id IN ?", "s"),
        "uid_bump": ("UPDATE messages SET uidnext = ? WHERE mailbox_id = ? IF uidnext = ?", "l"),
        "uid_bump_first": ("UPDATE messages SET uidnext = ? WHERE mailbox_id = ? IF uidnext = null", "l"),
        "uid_set": ("UPDATE messages SET uid = ? WHERE mailbox_id = ? AND id = ?", "l"),
        "uid_anchor": ("UPDATE messages SET uid = 0, changed = ? WHERE mailbox_id = ? AND id = ?", "l"),
        "recent_raise": ("UPDATE messages SET recent_mark = ? WHERE mailbox_id = ? IF recent_mark = ?", "l"),
        "recent_raise_first": ("UPDATE messages SET recent_mark = ? WHERE mailbox_id = ? IF recent_mark = null", "l"),
        "body_insert": ("INSERT INTO bodies (body_id, size, chunk_size, refs) VALUES (?, ?, ?, ?)", "w"),
        "body_release": ("UPDATE bodies SET refs = refs - ? WHERE body_id = ?", "w"),
        "body_refs": ("SELECT size, refs FROM bodies WHERE body_id = ?", "r"),
        "body_delete": ("DELETE FROM bodies WHERE body_id = ?", "w"),
        "chunk_insert": ("INSERT INTO body_chunks (body_id, idx, data) VALUES (?, ?, ?)", "w"),
        "chunk_get": ("SELECT data FROM body_chunks WHERE body_id = ? AND idx = ?", "r"),
        "chunk_delete": ("DELETE FROM body_chunks WHERE body_id = ? AND idx = ?", "w"),
        **QUEUE_STATEMENTS,
        **SIEVE_STATEMENTS,
    }

    async def _prepare_all(self) -> None:
        """Prepare every statement once, each with the consistency level of its class."""
        session = self.session

        qualify = re.compile(r"\b(FROM|INTO|UPDATE) (\w+)")
        keyspace = self.settings.keyspace

        def prepare() -> dict[str, PreparedStatement]:
            return {
                name: session.prepare(qualify.sub(rf"\1 {keyspace}.\2", cql))
                for name, (cql, _) in self._STATEMENTS.items()
            }

        try:
            prepared = await asyncio.to_thread(prepare)
        except DRIVER_FAILURES as exc:
            raise StoreUnavailable(
                f"cannot prepare statements in keyspace {self.settings.keyspace} "
                f"(has `cassmail schema apply` run?): {_brief(exc)}"
            ) from exc
        for name, ps in prepared.items():
            kind = self._STATEMENTS[name][1]
            ps.consistency_level = self._read_cl if kind == "r" else self._write_cl if kind in "wl" else self._serial_cl
            if kind == "l":
                ps.serial_consistency_level = self._serial_cl
            self._ps[name] = ps

    # ================================================================= execution

    async def _run(self, name: str, *params: Any) -> list[Any]:
        """Run a prepared statement; every page of the result, or StoreUnavailable."""
        return await self._exec(self._ps[name].bind(params))

    async def _exec(self, statement: Statement) -> list[Any]:
        """Run a statement, every page. A request the driver could not even send (its connection
        busy) is retried with backoff until request_timeout; any other failure is StoreUnavailable."""
        cost = _tracing.get()
        deadline = time.monotonic() + self.settings.request_timeout
        pause = 0.002
        while True:
            try:
                rf = self.session.execute_async(statement, timeout=self.settings.request_timeout, trace=cost is not None)
                rows: list[Any] = []
                while True:
                    page = await _wrap(rf)
                    if page:
                        rows.extend(page)
                    if cost is not None:
                        await asyncio.to_thread(_add_trace, cost, rf)
                    if not rf.has_more_pages:
                        return rows
                    rf.start_fetching_next_page()
            except NoHostAvailable as exc:
                if not _never_sent(exc) or time.monotonic() + pause > deadline:
                    raise StoreUnavailable(f"Cassandra: {_brief(exc)}") from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.1)
            except DriverException as exc:
                raise StoreUnavailable(f"Cassandra: {_brief(exc)}") from exc

    @staticmethod
    @contextlib.contextmanager
    def tracing() -> Iterator[ReadCost]:
        """Trace every statement run inside (in this task) and add up what Cassandra read.

        A diagnostic: it shows, for example, that a listing does not walk the
        tombstones of deleted mail. Tracing costs a write per statement; never
        leave it on.
        """
        cost = ReadCost()
        token = _tracing.set(cost)
        try:
            yield cost
        finally:
            _tracing.reset(token)

    async def _conditional(self, statement: Statement) -> tuple[bool, Any]:
        """Run a conditional statement or batch: (applied, first result row)."""
        rows = await self._exec(statement)
        row = rows[0] if rows else None
        return (bool(row[0]) if row is not None else False), row

    def _batch(self, batch_type: BatchType = BatchType.LOGGED, conditional: bool = False) -> BatchStatement:
        batch = BatchStatement(batch_type=batch_type, consistency_level=self._write_cl)
        if conditional:
            batch.serial_consistency_level = self._serial_cl
        return batch

    async def _gather_limited(self, coros: Iterable[Any]) -> list[Any]:
        """Run chunk operations of one message, at most chunk_concurrency at once and within the
        store-wide chunk budget, preserving order."""
        limit = asyncio.Semaphore(self.settings.chunk_concurrency)

        async def one(coro: Any) -> Any:
            async with limit, self._chunk_slots:
                return await coro

        return await asyncio.gather(*(one(c) for c in coros))

    # ================================================================= domains

    async def add_domain(self, domain: str) -> None:
        await self._run("domain_add", normalize_domain(domain))

    async def remove_domain(self, domain: str) -> None:
        domain = normalize_domain(domain)
        if not await self._run("domain_get", domain):
            raise NoSuchDomain(domain)
        users = await self._domain_users(domain)
        aliases = await self._domain_aliases(domain)
        if users or aliases:
            raise DomainInUse(domain, len(users), len(aliases))
        await self._run("domain_del", domain)

    async def list_domains(self) -> list[str]:
        return sorted(row.domain for row in await self._run("domain_list"))

    async def is_local_domain(self, domain: str) -> bool:
        return bool(await self._run("domain_get", normalize_domain(domain)))

    # ================================================================= users

    async def create_user(self, user: str, password_hash: str) -> None:
        """The users_by_domain row first, then the account and its default mailboxes in one
        conditional batch of the user's partition.

        The two rows live in different tables, and Cassandra allows a conditional (Paxos) batch
        only within one partition, so they cannot be written atomically. Writing the index row
        first makes the user partition the single commit point: a failure in between leaves
        an index row without an account, which every reader of the index ignores
        (`_domain_users` checks each one), so `user list`, `domain del` and a login all agree
        that the user does not exist, and a retry simply writes both again. The reverse order
        would leave an account that `user list` never shows."""
        key = address_key(user)
        password_hash = checked_password_hash(password_hash)
        domain = key.rpartition("@")[2]
        if not await self.is_local_domain(domain):
            raise NoSuchDomain(domain)
        if await self.get_alias(key) is not None:
            raise AliasExists(key)
        await self._run("by_domain_add", domain, key)
        base = int(time.time())
        # Account and default mailboxes in one conditional batch of the user's partition: all or nothing.
        batch = self._batch(conditional=True)
        batch.add(self._ps["user_create"], (key, password_hash, datetime.now(timezone.utc), base + len(DEFAULT_MAILBOXES)))
        for i, (name, special) in enumerate(DEFAULT_MAILBOXES.items()):
            batch.add(self._ps["mbox_insert_plain"], (key, name, new_message_id(), base + i, special, True))
        applied, _ = await self._conditional(batch)
        if not applied:
            raise UserExists(key)
        # Again, idempotent: a delete_user of the same address that ran between the two writes
        # removed the first one, and an account must never be missing from the index. The user
        # exists now, so a failure here is logged rather than reported as a failed creation.
        try:
            await self._run("by_domain_add", domain, key)
        except StoreUnavailable as exc:
            log.warning("user %s created; its users_by_domain row not rewritten: %s", key, exc)

    async def _account(self, key: str, serial: bool = False) -> Any:
        rows = await self._run("user_static_serial" if serial else "user_static", key)
        if not rows or rows[0].password_hash is None:
            raise NoSuchUser(key)
        return rows[0]

    async def get_password_hash(self, user: str) -> str:
        return (await self._account(address_key(user))).password_hash

    async def set_password_hash(self, user: str, password_hash: str) -> None:
        key = address_key(user)
        password_hash = checked_password_hash(password_hash)
        applied, _ = await self._conditional(self._ps["user_passwd"].bind((password_hash, key)))
        if not applied:
            raise NoSuchUser(key)

    async def delete_user(self, user: str) -> None:
        """Mail first (the account still lists the mailboxes, so a failure here is retried by
        deleting again), then the account and its users_by_domain row in one logged batch: a
        batch without a condition may span tables, and the batch log applies all of it or, if
        the coordinator dies, replays it, so no later read sees one row without the other for
        longer than the replay takes. Even then the readers of the index check the account
        (see create_user), so a user is never half listed."""
        key = address_key(user)
        await self._account(key)
        # Out of every alias before the account goes: a failure here leaves the user whole, and
        # deleting again finishes; the other order could leave aliases naming nobody.
        for alias in [row.alias for row in await self._run("alias_of_list", key)]:
            await self._drop_from_alias(alias, key)
        for info in await self._mailbox_rows(key):
            await self._purge_mailbox(info.mailbox_id)
        batch = self._batch(BatchType.LOGGED)
        batch.add(self._ps["user_del"], (key,))
        batch.add(self._ps["by_domain_del"], (key.rpartition("@")[2], key))
        batch.add(self._ps["alias_of_purge"], (key,))
        self._sieve_purge(batch, key)
        await self._exec(batch)

    async def list_users(self, domain: str | None = None) -> list[str]:
        if domain is not None:
            domains = [normalize_domain(domain)]
        else:
            domains = [row.domain for row in await self._run("by_domain_domains")]
        users: list[str] = []
        for d in domains:
            users.extend(await self._domain_users(d))
        return sorted(users)

    async def _domain_users(self, domain: str) -> list[str]:
        """The users of a domain that have an account: users_by_domain rows whose account was
        never written (a create_user that failed half way) are left out, not removed, since
        the same row may belong to a creation still in flight."""
        listed = [row.user for row in await self._run("by_domain_list", domain)]
        alive: set[str] = set()
        for group in _groups(listed, IN_BATCH):
            rows = await self._run("users_alive", group)
            alive.update(r.user for r in rows if r.password_hash is not None)
        return [u for u in listed if u in alive]

    # ================================================================= aliases

    async def set_alias(self, alias: str, users: Iterable[str]) -> None:
        """Checks, then the aliases_by_user rows, then the alias row (so the index never misses
        an alias that lists a user), then the index rows of users it no longer lists.

        Nothing here is a lightweight transaction: aliases are changed by an operator, and the
        delivery path only reads them. A user created at the same address at the same moment
        on another node is caught by looking again after the write (the alias is taken back)."""
        key, targets = check_alias(alias, users)
        domain = key.rpartition("@")[2]
        if not await self._run("domain_get", domain):
            raise NoSuchDomain(domain)
        await self._refuse_user_address(key)
        alive: set[str] = set()
        for group in _groups(list(targets), IN_BATCH):
            alive.update(r.user for r in await self._run("users_alive", group) if r.password_hash is not None)
        for target in targets:
            if target not in alive:
                raise NoSuchUser(target)
        before = await self.get_alias(key) or []
        await asyncio.gather(*(self._run("alias_of_add", target, key) for target in targets))
        await self._run("alias_set", domain, key, set(targets))
        try:
            await self._refuse_user_address(key)
        except UserExists:
            await self._run("alias_del", domain, key)
            raise
        await asyncio.gather(*(self._run("alias_of_del", old, key) for old in before if old not in targets))

    async def _refuse_user_address(self, key: str) -> None:
        if await self.user_exists(key):
            raise UserExists(key, "an alias cannot have a user's address")

    async def delete_alias(self, alias: str) -> None:
        key = address_key(alias)
        users = await self.get_alias(key)
        if users is None:
            raise NoSuchAlias(key)
        await self._run("alias_del", key.rpartition("@")[2], key)
        await asyncio.gather(*(self._run("alias_of_del", user, key) for user in users))

    async def get_alias(self, alias: str) -> list[str] | None:
        key = address_key(alias)
        rows = await self._run("alias_get", key.rpartition("@")[2], key)
        return sorted(rows[0].users) if rows and rows[0].users else None

    async def list_aliases(self, domain: str | None = None) -> list[Alias]:
        domains = [normalize_domain(domain)] if domain is not None else await self.list_domains()
        found: list[Alias] = []
        for d in domains:
            found.extend(await self._domain_aliases(d))
        return sorted(found, key=lambda a: a.address)

    async def _domain_aliases(self, domain: str) -> list[Alias]:
        """A domain's aliases: rows whose set of users is empty are none (see schema 003)."""
        return [Alias(r.alias, tuple(sorted(r.users))) for r in await self._run("alias_list", domain) if r.users]

    async def _drop_from_alias(self, alias: str, user: str) -> None:
        """Take a user out of an alias; the alias goes with its last user."""
        domain = alias.rpartition("@")[2]
        rows = await self._run("alias_get", domain, alias)
        users = set(rows[0].users or ()) if rows else set()
        if user not in users:
            return  # an index row left by a replaced alias
        if users == {user}:
            await self._run("alias_del", domain, alias)
        else:
            await self._run("alias_drop_user", {user}, domain, alias)

    # ================================================================= mailboxes

    async def _mailbox_rows(self, key: str) -> list[Any]:
        rows = [r for r in await self._run("mbox_list", key) if r.mailbox_id is not None]
        if not rows:
            await self._account(key)  # raises NoSuchUser
        return rows

    async def list_mailboxes(self, user: str) -> list[MailboxInfo]:
        rows = await self._mailbox_rows(address_key(user))
        return sorted((_info(r.mailbox, r) for r in rows), key=lambda i: (i.name != INBOX, i.name))

    async def _resolve(self, key: str, name: str, serial: bool = False) -> Any:
        """The row of a user's mailbox (mailbox_id, uidvalidity, ...), or NoSuchMailbox/NoSuchUser."""
        name = mailbox_name(name)
        rows = await self._run("mbox_get_serial" if serial else "mbox_get", key, name)
        if rows and rows[0].mailbox_id is not None:
            return rows[0]
        await self._account(key)
        raise NoSuchMailbox(key, name)

    async def mailbox_info(self, user: str, name: str) -> MailboxInfo:
        key = address_key(user)
        name = mailbox_name(name)
        return _info(name, await self._resolve(key, name))

    async def set_subscribed(self, user: str, name: str, subscribed: bool) -> None:
        key, name = address_key(user), mailbox_name(name)
        row = await self._resolve(key, name, serial=True)
        applied, _ = await self._conditional(self._ps["mbox_subscribe"].bind((subscribed, key, name, row.mailbox_id)))
        if not applied:
            raise NoSuchMailbox(key, name)

    async def _reserve_uidvalidity(self, key: str, count: int, batch: BatchStatement) -> tuple[BatchStatement, int]:
        """Add to a conditional batch the bump of the user's next UIDVALIDITY; return the first value."""
        account = await self._account(key, serial=True)
        current = account.next_uidvalidity or 1
        first = max(current, int(time.time()))
        batch.add(self._ps["mbox_bump_uidvalidity"], (first + count, key, account.next_uidvalidity))
        return batch, first

    async def create_mailbox(self, user: str, name: str, special_use: str | None = None) -> MailboxInfo:
        key = address_key(user)
        name = mailbox_name(name)
        for _ in range(LWT_ATTEMPTS):
            batch, uidvalidity = await self._reserve_uidvalidity(key, 1, self._batch(conditional=True))
            mailbox_id = new_message_id()
            batch.add(self._ps["mbox_insert"], (key, name, mailbox_id, uidvalidity, special_use, True, None, None))
            applied, row = await self._conditional(batch)
            if applied:
                return MailboxInfo(name, uidvalidity, special_use, True)
            if await self._run("mbox_get_serial", key, name):
                raise MailboxExists(key, name)
            await _backoff()
        raise StoreUnavailable(f"could not create mailbox {name!r} of {key}: too much contention")

    async def rename_mailbox(self, user: str, old: str, new: str) -> None:
        key = address_key(user)
        old, new = check_rename(key, old, new)
        for _ in range(LWT_ATTEMPTS):
            rows = {r.mailbox: r for r in await self._mailbox_rows(key)}
            if old not in rows:
                raise NoSuchMailbox(key, old)
            moves = [(old, new)] + [
                (name, new + name[len(old) :]) for name in sorted(rows) if name.startswith(old + HIERARCHY_DELIMITER)
            ]
            for _, target in moves:
                if target in rows:
                    raise MailboxExists(key, target)
            fresh = old == INBOX
            batch, uidvalidity = await self._reserve_uidvalidity(key, 1, self._batch(conditional=True))
            for source, target in moves:
                r = rows[source]
                batch.add(
                    self._ps["mbox_insert"],
                    (key, target, r.mailbox_id, r.uidvalidity, r.special_use, r.subscribed, r.low_water, r.low_water_due),
                )
                if fresh and source == INBOX:
                    # RFC 3501: renaming INBOX moves its mail and leaves a new, empty INBOX.
                    batch.add(self._ps["mbox_reassign"], (new_message_id(), uidvalidity, key, INBOX, r.mailbox_id))
                else:
                    batch.add(self._ps["mbox_delete_if"], (key, source, r.mailbox_id))
            applied, _ = await self._conditional(batch)
            if applied:
                return
            await _backoff()
        raise StoreUnavailable(f"could not rename mailbox {old!r} of {key}: too much contention")

    async def delete_mailbox(self, user: str, name: str) -> None:
        key = address_key(user)
        name = mailbox_name(name)
        if name == INBOX:
            raise MailboxNotAllowed("INBOX cannot be deleted")
        for _ in range(LWT_ATTEMPTS):
            row = await self._resolve(key, name, serial=True)
            applied, _ = await self._conditional(self._ps["mbox_delete_if"].bind((key, name, row.mailbox_id)))
            if applied:
                await self._purge_mailbox(row.mailbox_id)
                return
            await _backoff()
        raise StoreUnavailable(f"could not delete mailbox {name!r} of {key}: too much contention")

    async def _purge_mailbox(self, mailbox_id: uuid.UUID) -> None:
        """Release every body of a mailbox, then drop its partition with one tombstone."""
        cursor = None
        while True:
            rows = await (
                self._run("msg_walk", mailbox_id, cursor, 1000)
                if cursor
                else self._run("msg_walk_first", mailbox_id, 1000)
            )
            await self._release_bodies(mailbox_id, [r for r in rows if r.body_id is not None])
            if len(rows) < 1000:
                break
            cursor = rows[-1].id
        await self._run("msg_purge", mailbox_id)

    # ================================================================= delivery

    async def deliver(
        self, body: Body, targets: Sequence[Target], internal_date: datetime | None = None
    ) -> list[uuid.UUID]:
        view, targets, unique = prepare_delivery(body, targets, self.max_message_size)
        size = view.nbytes
        when = internal_date_utc(internal_date)
        # Resolve every target first: an unknown user or mailbox fails before anything is written.
        rows = await asyncio.gather(*(self._resolve(u, m) for (u, m) in unique))
        mailbox_ids = {k: r.mailbox_id for k, r in zip(unique, rows)}
        ids = {k: new_message_id() for k in unique}

        body_id = new_message_id()
        chunk = self.settings.chunk_size
        nchunks = math.ceil(size / chunk)
        await self._gather_limited(
            self._run("chunk_insert", body_id, i, bytes(view[i * chunk : (i + 1) * chunk])) for i in range(nchunks)
        )
        shared = len(unique) > 1
        if shared:
            refs = {_ref(mailbox_ids[k], ids[k]) for k in unique}
            await self._run("body_insert", body_id, size, chunk, refs)
        inserts = [
            (mailbox_ids[k], ids[k], size, set(t.flags) or None, when, body_id, chunk, shared, ids[k])
            for k, t in unique.items()
        ]
        if len(inserts) == 1:
            await self._run("msg_insert", *inserts[0])
        else:
            batch = self._batch(BatchType.LOGGED)
            for params in inserts:
                batch.add(self._ps["msg_insert"], params)
            await self._exec(batch)
        return [ids[(t.user, t.mailbox)] for t in targets]

    # ================================================================= listing and reading

    async def list_page(
        self, user: str, mailbox: str, after: uuid.UUID | None = None, limit: int = 500
    ) -> Page:
        if not 1 <= limit <= 10_000:
            raise InvalidInput(f"page limit must be 1..10000, got {limit}")
        key, name = address_key(user), mailbox_name(mailbox)
        row = await self._resolve(key, name)
        page = await self._page(row.mailbox_id, after or row.low_water, limit)
        if after is None and (page.items or page.cursor is None):
            await self._catch_up_low_water(key, name, row, page.items[0].id if page.items else None)
        return page

    async def _page(self, mailbox_id: uuid.UUID, after: uuid.UUID | None, limit: int) -> Page:
        rows = await (
            self._run("msg_page", mailbox_id, after, limit) if after else self._run("msg_page_first", mailbox_id, limit)
        )
        items = [_summary(r) for r in rows if r.size is not None]
        return Page(items, rows[-1].id if len(rows) == limit else None)

    async def get_summaries(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, MessageSummary]:
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        out: dict[uuid.UUID, MessageSummary] = {}
        for group in _groups(list(dict.fromkeys(ids)), IN_BATCH):
            for r in await self._run("msg_summaries", mailbox_id, group):
                if r.size is not None:
                    out[r.id] = _summary(r)
        return out

    async def read_chunks(
        self, user: str, mailbox: str, message_id: uuid.UUID, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        rows = await self._run("msg_body_info", mailbox_id, message_id)
        if not rows or rows[0].size is None:
            raise NoSuchMessage(mailbox, message_id)
        info = rows[0]
        size, chunk = info.size, info.chunk_size
        end = size if end is None else min(end, size)
        if start < 0 or start > end:
            raise InvalidInput(f"invalid byte range {start}..{end} of a {size}-byte message")
        if start == end:
            return
        first, last = start // chunk, (end - 1) // chunk
        window = self.settings.chunk_concurrency
        pending: dict[int, asyncio.Task[bytes | None]] = {}
        try:
            for idx in range(first, last + 1):
                for ahead in range(idx, min(idx + window, last + 1)):
                    if ahead not in pending:
                        pending[ahead] = asyncio.ensure_future(self._chunk(info.body_id, ahead))
                data = await pending.pop(idx)
                if data is None:
                    data = await self._chunk(info.body_id, idx, every_replica=True)
                if data is None:
                    raise await self._missing_chunk(mailbox_id, mailbox, message_id, info.body_id, idx)
                lo = start - idx * chunk if idx == first else 0
                hi = end - idx * chunk if idx == last else len(data)
                yield data[lo:hi] if (lo, hi) != (0, len(data)) else data
        finally:
            for task in pending.values():
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # read ahead and failed: nobody else will look at it

    async def _chunk(self, body_id: uuid.UUID, idx: int, every_replica: bool = False) -> bytes | None:
        """A chunk of a body; None when it is not there. `every_replica` asks all replicas (ALL):
        under a message row that is there, a chunk missing at a weaker level is one replica that
        has not applied the write yet while another has (RF=2 or more at ONE)."""
        statement = self._ps["chunk_get"].bind((body_id, idx))
        if every_replica:
            statement.consistency_level = ConsistencyLevel.ALL
        async with self._chunk_slots:
            rows = await self._exec(statement)
        return rows[0].data if rows else None

    async def _missing_chunk(
        self, mailbox_id: uuid.UUID, mailbox: str, message_id: uuid.UUID, body_id: uuid.UUID, idx: int
    ) -> NoSuchMessage | StoreUnavailable:
        """Why a chunk is missing, as the error to raise. A delete removes the message row before
        the chunks, so a row that is gone, or that names another body, means another session
        deleted the message meanwhile: NoSuchMessage (RFC 2180). Under a live message a missing
        chunk is a replica that has not seen the write yet: StoreUnavailable."""
        rows = await self._run("msg_body_info", mailbox_id, message_id)
        if not rows or rows[0].size is None or rows[0].body_id != body_id:
            return NoSuchMessage(mailbox, message_id)
        return StoreUnavailable(f"chunk {idx} of body {body_id} in {mailbox!r} not readable at this consistency")

    # ================================================================= flags and deletion

    async def store_flags(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], flags: Iterable[str], mode: FlagMode = "set"
    ) -> None:
        mode = check_flag_mode(mode)
        values = set(flag_set(flags))
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        wanted = [i for i in dict.fromkeys(ids) if i != ANCHOR]
        # Only touch rows that exist: an update of a deleted row would bring a ghost of it back.
        existing = await self.get_summaries(user, mailbox, wanted)
        statement = self._ps[f"flags_{mode}"]
        for group in _groups([i for i in wanted if i in existing], IN_BATCH):
            batch = self._batch(BatchType.UNLOGGED)
            token = new_message_id()
            for message_id in group:
                batch.add(statement, (values or None if mode == "set" else values, token, mailbox_id, message_id))
            await self._exec(batch)

    async def delete_messages(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> None:
        key, name = address_key(user), mailbox_name(mailbox)
        row = await self._resolve(key, name)
        mailbox_id = row.mailbox_id
        wanted = [i for i in dict.fromkeys(ids) if i != ANCHOR]
        if not wanted:
            return
        newest: uuid.UUID | None = None
        for group in _groups(wanted, IN_BATCH):
            rows = [r for r in await self._run("msg_body_infos", mailbox_id, group) if r.body_id is not None]
            batch = self._batch(BatchType.UNLOGGED)
            batch.add(self._ps["msg_delete"], (mailbox_id, group))
            batch.add(self._ps["msg_changed"], (new_message_id(), mailbox_id))
            await self._exec(batch)
            for r in rows:
                newest = _later(newest, r.id)
            # The messages are gone from here on: what follows only tidies up, and a failure of it
            # must not turn a done deletion into an error the client would retry or report.
            try:
                await self._release_bodies(mailbox_id, rows)
            except StoreUnavailable as exc:
                log.info("bodies of %d deleted messages in %s %r not released: %s", len(rows), key, name, exc)
        try:
            await self._advance_low_water(key, name, row, newest)
        except StoreUnavailable as exc:  # contention on the mailbox row; the next delete or listing moves it
            log.info("low-water mark of %s %r not moved: %s", key, name, exc)

    async def _release_bodies(self, mailbox_id: uuid.UUID, rows: Sequence[Any]) -> None:
        """Drop the chunks of bodies no copy refers to any more; best effort: a failure leaks garbage, never mail."""
        for r in rows:
            if r.shared:
                await self._run("body_release", {_ref(mailbox_id, r.id)}, r.body_id)
                body = await self._run("body_refs", r.body_id)
                # A missing row (not yet visible at this consistency) is never taken as "no references".
                if not body or body[0].size is None or body[0].refs:
                    continue
            await self._gather_limited(
                self._run("chunk_delete", r.body_id, i) for i in range(math.ceil(r.size / r.chunk_size))
            )
            if r.shared:
                await self._run("body_delete", r.body_id)

    async def _advance_low_water(self, key: str, name: str, mailbox: Any, deleted: uuid.UUID | None) -> None:
        """Move the low-water mark up to just below the oldest live message, but never past the grace
        period: a message that turns up late (slow replica, slow clock) must stay above it. The
        newest id deleted is kept as low_water_due, for listings to catch up with (see
        `_catch_up_low_water`). Two deletes at once may each keep their own: the lower one only
        stops the catching up early, and the next delete sets it again."""
        mailbox_id, current = mailbox.mailbox_id, mailbox.low_water
        due = _later(mailbox.low_water_due, deleted)
        rows = await (
            self._run("msg_first_live", mailbox_id, current)
            if current
            else self._run("msg_first_live_all", mailbox_id)
        )
        live = next((r.id for r in rows if r.size is not None), None)
        if live is None and len(rows) == 16:
            candidate = None  # sixteen ghosts in a row: leave the mark where it is
        else:
            limit = _now_100ns() - int(self.settings.tombstone_grace * 10_000_000)
            candidate = min(live.time - 1, limit) if live else limit
            if current is not None and candidate <= current.time:
                candidate = None
        if candidate is None and due == mailbox.low_water_due:
            return
        mark = _floor_uuid(candidate) if candidate is not None else current
        # Conditional, so a mailbox deleted or renamed meanwhile is not brought back as a ghost row.
        await self._conditional(self._ps["mbox_set_low_water"].bind((mark, due, key, name, mailbox_id)))

    async def _catch_up_low_water(self, key: str, name: str, mailbox: Any, first_live: uuid.UUID | None) -> None:
        """After a listing from the start: move the mark past tombstones a delete had to leave
        above it because they were younger than the grace, now that the grace allows.

        Without this, a mailbox whose recent mail was deleted walks those tombstones on every
        listing until the next delete after the grace. The listing has just read the oldest
        live message, so the only extra cost is the write, and it is rare: none while the mark
        is past low_water_due (the newest id ever deleted), the final move up to it as soon as
        the grace and the oldest live message allow, and in between (the grace still holding
        part of the deleted range back) at most one partial move per minute of progress (CATCH_UP_STEP_100NS).
        Idempotent: a repeated or concurrent catch-up writes the same or a lower mark, which is
        always safe (a lower mark only reads more tombstones)."""
        due, current = mailbox.low_water_due, mailbox.low_water
        if due is None or (current is not None and current.time > due.time):
            return
        limit = _now_100ns() - int(self.settings.tombstone_grace * 10_000_000)
        target = min(due.time + 1, limit, first_live.time - 1 if first_live is not None else due.time + 1)
        if current is not None and (
            target <= current.time or (target <= due.time and target - current.time < CATCH_UP_STEP_100NS)
        ):
            return
        try:
            await self._conditional(
                self._ps["mbox_set_low_water"].bind((_floor_uuid(target), due, key, name, mailbox.mailbox_id))
            )
        except StoreUnavailable as exc:  # the listing itself succeeded; the next one tries again
            log.info("low-water mark of %s %r not moved: %s", key, name, exc)

    # ================================================================= IMAP UIDs

    async def uid_next(self, user: str, mailbox: str) -> int:
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        anchor = await self._anchor(mailbox_id)
        return (anchor.uidnext if anchor else None) or 1

    async def _anchor(self, mailbox_id: uuid.UUID) -> Any:
        """The UID counter and the \\Recent mark (static columns), read at SERIAL through the
        anchor row: a point read, where a read of the static row alone would walk the tombstones
        at the head of the partition. None before the first UID assignment or \\Recent claim."""
        rows = await self._run("msg_anchor", mailbox_id, ANCHOR)
        return rows[0] if rows else None

    async def changes_token(self, user: str, mailbox: str) -> Hashable | None:
        """The `changed` column (schema 005), read through the anchor row; None before the mailbox
        was first numbered (no anchor yet: the listing is read).

        Also None while the last change is younger than a write may stay in flight: writes carry
        the timestamp their client gave them, so a write sent before the one that set `changed`
        can land after it (and after a listing) without changing the column, last-write-wins by
        timestamp keeping the newer value. Once no write that old can still arrive, an unchanged
        column means an unchanged mailbox."""
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        rows = await self._run("msg_changes_token", mailbox_id, ANCHOR)
        if not rows or rows[0].changed is None:
            return None
        changed = rows[0].changed
        if time.time() - timeuuid_seconds(changed) < self.settings.request_timeout + CHANGES_SETTLE:
            return None
        return (mailbox_id, changed)

    async def assign_uids(
        self,
        user: str,
        mailbox: str,
        ids: Sequence[uuid.UUID],
        renumber: Mapping[uuid.UUID, int] | None = None,
    ) -> dict[uuid.UUID, int]:
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        wanted = uid_work(ids, renumber)
        uids: dict[uuid.UUID, int] = {}
        for group in _groups(wanted, UID_BATCH):
            uids.update(await self._assign_group(mailbox_id, group, renumber))
        return uids

    async def _assign_group(
        self, mailbox_id: uuid.UUID, ids: list[uuid.UUID], renumber: Mapping[uuid.UUID, int] | None
    ) -> dict[uuid.UUID, int]:
        for _ in range(LWT_ATTEMPTS):
            # One SERIAL read gives the UIDs and the counter (a static column, returned with every
            # row) as one snapshot that sees every committed assignment. The batch below applies only
            # if the counter is unchanged, i.e. nobody assigned anything since this snapshot. Every
            # renumbering moves the counter too, so a renumber raced by another one fails here, and
            # its retry reads the message's new UID, no longer the one it was asked to replace.
            rows = await self._run("uid_read", mailbox_id, ids)
            alive = {r.id: r.uid for r in rows if r.size is not None}
            missing = [i for i in ids if i in alive and needs_uid(alive[i], i, renumber)]
            if not missing:
                return {i: alive[i] for i in ids if i in alive}
            uidnext = rows[0].uidnext
            first = uidnext or 1
            batch = self._batch(BatchType.UNLOGGED, conditional=True)
            if uidnext is None:
                batch.add(self._ps["uid_bump_first"], (first + len(missing), mailbox_id))
            else:
                batch.add(self._ps["uid_bump"], (first + len(missing), mailbox_id, uidnext))
            for offset, message_id in enumerate(missing):
                batch.add(self._ps["uid_set"], (first + offset, mailbox_id, message_id))
            batch.add(self._ps["uid_anchor"], (new_message_id(), mailbox_id, ANCHOR))
            applied, _ = await self._conditional(batch)
            if applied:
                alive.update({m: first + n for n, m in enumerate(missing)})
                return {i: alive[i] for i in ids if i in alive}
            await _backoff()
        raise StoreUnavailable("could not assign UIDs: too much contention")

    # ================================================================= IMAP \Recent

    async def recent_mark(self, user: str, mailbox: str) -> int:
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        anchor = await self._anchor(mailbox_id)
        return (anchor.recent_mark if anchor else None) or 1

    async def claim_recent(self, user: str, mailbox: str, below: int) -> int:
        """Compare-and-set of the mark from the value read at SERIAL, retried on contention like
        `_assign_group`; with the anchor row in the same conditional batch, so the mark is read
        by the same point read as the UID counter. A claim the mark already covers writes nothing."""
        below = check_recent_below(below)
        mailbox_id = (await self._resolve(address_key(user), mailbox)).mailbox_id
        for _ in range(LWT_ATTEMPTS):
            anchor = await self._anchor(mailbox_id)
            current = anchor.recent_mark if anchor else None
            mark = current or 1
            if mark >= below:
                return mark
            batch = self._batch(BatchType.UNLOGGED, conditional=True)
            if current is None:
                batch.add(self._ps["recent_raise_first"], (below, mailbox_id))
            else:
                batch.add(self._ps["recent_raise"], (below, mailbox_id, current))
            batch.add(self._ps["uid_anchor"], (new_message_id(), mailbox_id, ANCHOR))
            applied, _ = await self._conditional(batch)
            if applied:
                return mark
            await _backoff()
        raise StoreUnavailable("could not claim \\Recent: too much contention")


# ===================================================================== helpers


def _wrap(rf: ResponseFuture) -> asyncio.Future[Any]:
    """An asyncio future for the driver's current page (the driver calls back on its own thread)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def done(result: Any) -> None:
        loop.call_soon_threadsafe(_settle, fut, result, None)

    def failed(exc: BaseException) -> None:
        loop.call_soon_threadsafe(_settle, fut, None, exc)

    rf.add_callbacks(done, failed)
    return fut


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    elif isinstance(exc, (DriverException, NoHostAvailable)):
        fut.set_exception(exc)
    else:  # the driver reports some failures (e.g. connection errors) as plain exceptions
        fut.set_exception(StoreUnavailable(f"Cassandra: {_brief(exc)}"))


def _never_sent(exc: NoHostAvailable) -> bool:
    """True when every host refused the request before sending it (connection busy or out of
    stream ids), so sending it again cannot apply it twice."""
    errors = list(exc.errors.values())
    return bool(errors) and all(isinstance(e, (ConnectionBusy, NoConnectionsAvailable)) for e in errors)


def _add_trace(cost: ReadCost, rf: ResponseFuture) -> None:
    trace = rf.get_query_trace(max_wait=10)
    cost.statements += 1
    for event in trace.events:
        match = _READ_EVENT.search(event.description)
        if match:
            cost.live_rows += int(match.group(1))
            cost.tombstones += int(match.group(2))


def _brief(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 300 else text[:297] + "..."


def _info(name: str, row: Any) -> MailboxInfo:
    return MailboxInfo(name, row.uidvalidity, row.special_use, bool(row.subscribed))


def _summary(row: Any) -> MessageSummary:
    when = row.internal_date
    if when is not None and when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return MessageSummary(row.id, row.size, frozenset(row.flags or ()), when, row.uid)


def _later(a: uuid.UUID | None, b: uuid.UUID | None) -> uuid.UUID | None:
    """The later of two timeuuids (by time, then bytes); None counts as the earliest."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda u: (u.time, u.bytes))


def _ref(mailbox_id: uuid.UUID, message_id: uuid.UUID) -> str:
    return f"{mailbox_id}/{message_id}"


def _groups(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _backoff() -> None:
    await asyncio.sleep(random.uniform(0.005, 0.05))
