"""The Cassandra backend of the Store contract.

Data model (schema/001_initial.cql): a user is a partition listing its
mailboxes; a mailbox is a partition of small message rows clustered by
timeuuid; bodies are cut into chunks, each chunk its own partition. Aliases
(schema/003_aliases.cql) are a partition per domain, a row per alias, with
an index of the aliases that list each user.

The outbound queue and DKIM keys (schema/006_outbound.cql) are in
cassandra_queue.py; Sieve scripts (schema/007_sieve.cql) in cassandra_sieve.py.
Every CQL statement is in cassandra_tables.py, one class per table, all run
by the one executor of cassandra_cql.py.

Delivery is plain idempotent writes at the write consistency level, in an
order that never shows a half-written message: chunks first, then (for a
body shared by several copies) its reference row, then the message rows in
one logged batch. Only UID allocation, IMAP \\Recent claims, mailbox creation
and user creation use lightweight transactions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, Session
from cassandra.policies import DCAwareRoundRobinPolicy, LoadBalancingPolicy, TokenAwarePolicy, WhiteListRoundRobinPolicy
from cassandra.query import BatchStatement, BatchType

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
    uuid_from_bytes,
)
from cassmail.store.base import (
    Alias,
    AliasExists,
    Body,
    DomainInUse,
    FlagMode,
    HEAD_LIMIT,
    MailboxExists,
    MailboxNotAllowed,
    NoSuchAlias,
    NoSuchDomain,
    NoSuchMailbox,
    NoSuchMessage,
    NoSuchUser,
    RecentClaim,
    StoreUnavailable,
    Target,
    UserExists,
    check_alias,
    changed_flags,
    check_flag_mode,
    check_recent_below,
    check_rename,
    checked_password_hash,
    expunge_floor,
    head_end,
    internal_date as internal_date_utc,
    needs_uid,
    prepare_delivery,
    uid_work,
)

from cassmail.store.cassandra_ahead import NumberAhead
from cassmail.store.cassandra_copy import CassandraCopies, Copies, body_ref
from cassmail.store.cassandra_counts import CHANGES_SETTLE, CassandraCounts, Tally
from cassmail.store.cassandra_cql import (
    DRIVER_FAILURES,
    Cql,
    ReadRetryPolicy,
    brief,
    contention_pause,
    decode_uuids_fast,
    reads_see_writes,
    row_factory,
)
from cassmail.store.cassandra_events import CassandraEvents
from cassmail.store.cassandra_io import ThreadConnection, loop_connection, refuse_blocking
from cassmail.store.cassandra_left import Known, Left
from cassmail.store.cassandra_queue import CassandraQueue
from cassmail.store.cassandra_quota import CassandraQuota
from cassmail.store.cassandra_sieve import CassandraSieve
from cassmail.store.cassandra_snapshots import CassandraSnapshots
from cassmail.store.cassandra_tables import ANCHOR, Tables

log = logging.getLogger(__name__)

#: Seconds two nodes' clocks may be apart, for `arrivals` (beyond the request timeout).
ARRIVAL_SKEW = 3.0
#: Rows of one read of the arrivals.
ARRIVALS_PAGE = 500
#: Rows (mailbox and account rows) a store keeps for reuse at most (then it starts afresh).
MAILBOX_CACHE_ROWS = 10_000
#: A read of at most this many chunks is one request (more are read one by one, read ahead
#: `chunk_concurrency` at a time); each counts as one of `max_chunks_in_flight`.
CHUNKS_READ_TOGETHER = 2
#: read_heads: first chunks of this many bodies per request at most, and of about this many bytes.
HEADS_PER_READ = 16
HEADS_BYTES = 1024 * 1024
#: Messages whose body a process remembers from a listing, at most (see `_BodyNotes`).
BODY_NOTES = 20_000
#: Copies a process remembers as it wrote them until they are numbered, at most (`Copies`).
COPIES_NOTED = 10_000
#: Rows per conditional batch when numbering messages or changing their flags: a Paxos round per
#: batch, so larger batches number a large mailbox faster (100,000 messages in 10 s with 1024, 16 s
#: with 256: loadtest/RESULTS.md). A batch of 1024 rows is a few hundred kilobytes, far under
#: max_mutation_size (conditional batches are not held to batch_size_fail_threshold).
UID_BATCH = 1024
#: Ids from which `_state` reads a slice rather than the keys.
STATE_SLICE_MIN = 64
#: Ids per `IN (...)` read or delete.
IN_BATCH = 100
#: Chunks per batch of deletions (a partition each): Cassandra warns of unlogged batches over
#: more partitions than its unlogged_batch_across_partitions_warn_threshold, 10 by default.
CHUNKS_PER_DELETE = 10
#: Smallest partial move of a low-water mark by a listing (100 ns units: one minute), so that
#: listings of a mailbox with recent deletions write at most about once a minute; also how much
#: newer deleted mail must be than low_water_due for a delete to move the mark.
CATCH_UP_STEP_100NS = 60 * 10_000_000
#: Attempts at one conditional write before giving up with StoreUnavailable.
LWT_ATTEMPTS = 32
_EPOCH_OFFSET_100NS = 0x01B21DD213814000


def _floor_uuid(timestamp_100ns: int) -> uuid.UUID:
    """The smallest timeuuid of a 100 ns tick: a bound for `id > bound` range reads."""
    t = max(timestamp_100ns, 0)
    return uuid.UUID(fields=(t & 0xFFFFFFFF, (t >> 32) & 0xFFFF, ((t >> 48) & 0x0FFF) | 0x1000, 0x80, 0x00, 0))


def _ticks(unix_seconds: float) -> int:
    """A time as a timeuuid's (100 ns ticks since 1582)."""
    return int(unix_seconds * 10_000_000) + _EPOCH_OFFSET_100NS


def _now_100ns() -> int:
    return _ticks(time.time())


class CassandraStore(CassandraSieve, CassandraQueue, CassandraEvents, CassandraQuota, CassandraCounts, CassandraSnapshots,
                     CassandraCopies):
    def __init__(self, settings: CassandraSettings, max_message_size: int = 0, loop_io: bool = False) -> None:
        #: The one executor of every statement; the tables hold the statements.
        self.cql = Cql(settings)
        #: Whether the event loop that opens the store reads and writes its connections
        #: (cassandra_io): only for a loop that runs as long as the store is open (a worker's),
        #: since the connections wait for it. Else the driver's thread does.
        self.loop_io = loop_io
        self.tables = Tables(self.cql)
        self.max_message_size = max_message_size
        self._cluster: Cluster | None = None
        # Chunk reads and writes in flight across every message of this process: backpressure
        # instead of filling the driver's socket buffers until it refuses requests.
        self._chunk_slots = asyncio.Semaphore(settings.max_chunks_in_flight)
        #: (user, mailbox) -> (when read, mailbox row), and (user, None) -> (when read, account
        #: row): for `_recent`.
        self._rows: dict[tuple[str, str | None], tuple[float, Any]] = {}
        self._bodies = _BodyNotes(BODY_NOTES)
        #: The statics each mailbox's last change by this process left (cassandra_left).
        self._left = Left()
        #: Copies made and not numbered yet (cassandra_copy).
        self._copies = Copies(COPIES_NOTED)
        self._count_bounds: dict[uuid.UUID, uuid.UUID] = {}  # (cassandra_counts)
        self._queue_init()
        self._ahead = NumberAhead(settings.number_ahead, self._assign)

    @property
    def settings(self) -> CassandraSettings:
        """The executor's: one copy, so a change (e.g. of request_timeout) reaches every statement."""
        return self.cql.settings

    @settings.setter
    def settings(self, settings: CassandraSettings) -> None:
        self.cql.settings = settings

    # ================================================================= connection

    def _make_cluster(self, only: str | None = None, loop: asyncio.AbstractEventLoop | None = None) -> Cluster:
        """The driver's cluster; with `only` (a contact point), one that connects to that node
        alone; with `loop` (the running one), one whose connections that loop serves
        (cassandra_io), else the driver's thread."""
        s = self.settings
        decode_uuids_fast()
        lb: LoadBalancingPolicy = TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=s.local_dc or None))
        if only is not None:
            lb = WhiteListRoundRobinPolicy([only])
        profile = ExecutionProfile(
            load_balancing_policy=lb,
            request_timeout=s.request_timeout,
            consistency_level=self.cql.read_cl,
            serial_consistency_level=self.cql.serial_cl,
            row_factory=row_factory,
            retry_policy=ReadRetryPolicy(),
        )
        auth = PlainTextAuthProvider(s.username, s.password) if s.username else None
        return Cluster(
            contact_points=s.contact_points if only is None else [only],
            port=s.port,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            auth_provider=auth,
            connect_timeout=s.connect_timeout,
            control_connection_timeout=s.connect_timeout,
            protocol_version=s.protocol_version,
            connection_class=ThreadConnection if loop is None else loop_connection(loop),
            # A statement is prepared on one node; a node that does not know it yet answers
            # UNPREPARED and the driver prepares it there and retries (nodes keep what was
            # prepared across restarts, and every front end prepares the same statements).
            prepare_on_all_hosts=False,
        )

    async def open(self) -> None:
        if self.cql.is_open:
            return
        self._ahead.threshold = self.settings.number_ahead
        self._cluster = self._make_cluster(loop=asyncio.get_running_loop() if self.loop_io else None)
        try:
            session = await asyncio.to_thread(self._cluster.connect)
            if self.loop_io:
                refuse_blocking(session, threading.get_ident())
            self.cql.session = session
        except Exception as exc:  # DriverException, and bare Exception subclasses the driver raises on connect
            cluster, self._cluster = self._cluster, None
            await asyncio.to_thread(cluster.shutdown)  # (not on the loop its connections wait for)
            raise StoreUnavailable(f"cannot reach Cassandra at {self._where()}: {brief(exc)}") from exc
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

    def _reads_see_writes(self) -> bool:
        """Whether this store's reads see every write acknowledged before them (`reads_see_writes`),
        in the keyspace's replication as the driver last saw it."""
        keyspace = self._cluster.metadata.keyspaces.get(self.settings.keyspace) if self._cluster else None
        return keyspace is not None and reads_see_writes(self.cql.read_cl, self.cql.write_cl,
                                                         keyspace.replication_strategy)

    def _where(self) -> str:
        return f"{','.join(self.settings.contact_points)}:{self.settings.port} keyspace {self.settings.keyspace}"

    async def close(self) -> None:
        await self._ahead.close()
        await self._settle_events()
        if self._cluster is not None:
            cluster, self._cluster, self.cql.session = self._cluster, None, None
            await asyncio.to_thread(cluster.shutdown)

    @property
    def session(self) -> Session:
        return self.cql.session

    async def _prepare_all(self) -> None:
        """Prepare every statement of every table once, each at the levels of its kind."""
        try:
            await asyncio.to_thread(self.tables.prepare)
        except DRIVER_FAILURES as exc:
            raise StoreUnavailable(
                f"cannot prepare statements in keyspace {self.settings.keyspace} "
                f"(has `cassmail schema apply` run?): {brief(exc)}"
            ) from exc

    #: Trace the statements run inside and add up what Cassandra read (a diagnostic).
    tracing = staticmethod(Cql.tracing)

    async def _gather_limited(self, coros: Iterable[Any]) -> list[Any]:
        """Run chunk operations of one message, at most chunk_concurrency at once and within the
        store-wide chunk budget, preserving order."""
        limit = asyncio.Semaphore(self.settings.chunk_concurrency)

        async def one(coro: Any) -> Any:
            async with limit, self._chunk_slots:
                return await coro

        return await asyncio.gather(*(one(c) for c in coros))

    async def _put_chunks(self, body_id: uuid.UUID, view: memoryview, chunk: int) -> None:
        """Write a body in chunks of `chunk` bytes, each copied out of `view` only once its write
        may start (a large message is not copied whole: it may be a spool file's mapping)."""

        async def put(i: int) -> None:
            await self.tables.body_chunks.insert(body_id, i, bytes(view[i * chunk : (i + 1) * chunk]))

        await self._gather_limited(put(i) for i in range(math.ceil(view.nbytes / chunk)))

    # ================================================================= domains

    async def add_domain(self, domain: str) -> None:
        await self.tables.domains.add(normalize_domain(domain))

    async def remove_domain(self, domain: str) -> None:
        domain = normalize_domain(domain)
        if not await self.tables.domains.exists(domain):
            raise NoSuchDomain(domain)
        users = await self._domain_users(domain)
        aliases = await self._domain_aliases(domain)
        if users or aliases:
            raise DomainInUse(domain, len(users), len(aliases))
        await self.tables.domains.delete(domain)

    async def list_domains(self) -> list[str]:
        return sorted(await self.tables.domains.all())

    async def is_local_domain(self, domain: str) -> bool:
        return await self.tables.domains.exists(normalize_domain(domain))

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
        await self.tables.users_by_domain.add(domain, key)
        base = int(time.time())
        # Account and default mailboxes in one conditional batch of the user's partition: all or nothing.
        users = self.tables.users
        batch = self.cql.batch(conditional=True)
        batch.add(users.create_statement(key, password_hash, datetime.now(timezone.utc), base + len(DEFAULT_MAILBOXES)))
        for i, (name, special) in enumerate(DEFAULT_MAILBOXES.items()):
            batch.add(users.insert_default_mailbox_statement(key, name, new_message_id(), base + i, special, True))
        applied, _ = await self.cql.conditional(batch)
        if not applied:
            raise UserExists(key)
        self._forget_user(key)
        # Again, idempotent: a delete_user of the same address that ran between the two writes
        # removed the first one, and an account must never be missing from the index. The user
        # exists now, so a failure here is logged rather than reported as a failed creation.
        try:
            await self.tables.users_by_domain.add(domain, key)
        except StoreUnavailable as exc:
            log.warning("user %s created; its users_by_domain row not rewritten: %s", key, exc)

    async def _account(self, key: str, serial: bool = False) -> Any:
        row = await self.tables.users.account(key, serial)
        if row is None or row.password_hash is None:
            self._rows.pop((key, None), None)
            raise NoSuchUser(key)
        self._keep(key, None, row)
        return row

    async def get_password_hash(self, user: str) -> str:
        return (await self._account(address_key(user))).password_hash

    async def set_password_hash(self, user: str, password_hash: str) -> None:
        key = address_key(user)
        password_hash = checked_password_hash(password_hash)
        if not await self.tables.users.set_password_hash(key, password_hash):
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
        for alias in await self.tables.aliases_by_user.aliases(key):
            await self._drop_from_alias(alias, key)
        for info in await self._mailbox_rows(key):
            await self._purge_mailbox(info.mailbox_id)
        batch = self.cql.batch(BatchType.LOGGED)
        batch.add(self.tables.users.delete_statement(key))
        batch.add(self.tables.users_by_domain.delete_statement(key.rpartition("@")[2], key))
        batch.add(self.tables.aliases_by_user.purge_statement(key))
        self._sieve_purge(batch, key)
        await self.cql.run(batch)
        self._forget_user(key)

    async def list_users(self, domain: str | None = None) -> list[str]:
        if domain is not None:
            domains = [normalize_domain(domain)]
        else:
            domains = await self.tables.users_by_domain.domains()
        users: list[str] = []
        for d in domains:
            users.extend(await self._domain_users(d))
        return sorted(users)

    async def _domain_users(self, domain: str) -> list[str]:
        """The users of a domain that have an account: users_by_domain rows whose account was
        never written (a create_user that failed half way) are left out, not removed, since
        the same row may belong to a creation still in flight."""
        listed = await self.tables.users_by_domain.users(domain)
        alive: set[str] = set()
        for group in _groups(listed, IN_BATCH):
            alive.update(await self.tables.users.with_account(group))
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
        if not await self.tables.domains.exists(domain):
            raise NoSuchDomain(domain)
        await self._refuse_user_address(key)
        alive: set[str] = set()
        for group in _groups(list(targets), IN_BATCH):
            alive.update(await self.tables.users.with_account(group))
        for target in targets:
            if target not in alive:
                raise NoSuchUser(target)
        before = await self.get_alias(key) or []
        await asyncio.gather(*(self.tables.aliases_by_user.add(target, key) for target in targets))
        await self.tables.aliases.set(domain, key, set(targets))
        try:
            await self._refuse_user_address(key)
        except UserExists:
            await self.tables.aliases.delete(domain, key)
            raise
        await asyncio.gather(*(self.tables.aliases_by_user.delete(old, key) for old in before if old not in targets))

    async def _refuse_user_address(self, key: str) -> None:
        if await self.user_exists(key):
            raise UserExists(key, "an alias cannot have a user's address")

    async def delete_alias(self, alias: str) -> None:
        key = address_key(alias)
        users = await self.get_alias(key)
        if users is None:
            raise NoSuchAlias(key)
        await self.tables.aliases.delete(key.rpartition("@")[2], key)
        await asyncio.gather(*(self.tables.aliases_by_user.delete(user, key) for user in users))

    async def get_alias(self, alias: str) -> list[str] | None:
        key = address_key(alias)
        users = await self.tables.aliases.users(key.rpartition("@")[2], key)
        return sorted(users) if users else None

    async def list_aliases(self, domain: str | None = None) -> list[Alias]:
        domains = [normalize_domain(domain)] if domain is not None else await self.list_domains()
        found: list[Alias] = []
        for d in domains:
            found.extend(await self._domain_aliases(d))
        return sorted(found, key=lambda a: a.address)

    async def _domain_aliases(self, domain: str) -> list[Alias]:
        """A domain's aliases: rows whose set of users is empty are none (see schema 003)."""
        return [Alias(r.alias, tuple(sorted(r.users))) for r in await self.tables.aliases.in_domain(domain) if r.users]

    async def _drop_from_alias(self, alias: str, user: str) -> None:
        """Take a user out of an alias; the alias goes with its last user."""
        domain = alias.rpartition("@")[2]
        users = set(await self.tables.aliases.users(domain, alias) or ())
        if user not in users:
            return  # an index row left by a replaced alias
        if users == {user}:
            await self.tables.aliases.delete(domain, alias)
        else:
            await self.tables.aliases.remove_user(domain, alias, user)

    # ================================================================= mailboxes

    async def _mailbox_rows(self, key: str) -> list[Any]:
        rows = [r for r in await self.tables.users.mailboxes(key) if r.mailbox_id is not None]
        if not rows:
            await self._account(key)  # raises NoSuchUser
        return rows

    async def list_mailboxes(self, user: str) -> list[MailboxInfo]:
        rows = await self._mailbox_rows(address_key(user))
        return sorted((_info(r.mailbox, r) for r in rows), key=lambda i: (i.name != INBOX, i.name))

    async def _resolve(self, key: str, name: str, serial: bool = False, cached: bool = False) -> Any:
        """The row of a user's mailbox (mailbox_id, uidvalidity, ...), or NoSuchMailbox/NoSuchUser.
        With `cached`, a row this store read less than `mailbox_cache` seconds ago will do: for
        calls on a mailbox's messages, never for delivery (mail must not go into a mailbox
        deleted a moment ago) or for a listing (which starts at the row's low-water mark).
        A copy may take one (COPY, MOVE: its source stays, so a copy into a mailbox deleted that
        second on another node is one made just before the deletion; its row is left in the
        purged partition, garbage that no reader lists, and counted in the quota usage until
        `cassmail user quota ADDRESS --recount`).
        A deletion may take one: the ids it deletes are a session's, of the mailbox as that
        session saw it; the mark it moves is decided on a read of the live messages from the
        row's mark, which only lags the mark as it is (a lower mark only reads more tombstones,
        see `_advance_low_water`); and its quota limit is at most as old as the row (a limit
        set that moment on another node: see cassandra_quota's drift)."""
        if cached and (hit := self._recent(key, name)) is not None:
            return hit  # (rows are kept by canonical name: one found is a valid name as it is)
        name = mailbox_name(name)
        if cached and (hit := self._recent(key, name)) is not None:
            return hit
        row = await self.tables.users.mailbox(key, name, serial)
        if row is not None and row.mailbox_id is not None:
            self._keep(key, name, row)
            return row
        self._rows.pop((key, name), None)
        await self._account(key)
        raise NoSuchMailbox(key, name)

    def _recent(self, key: str, name: str | None) -> Any:
        """A row of user `key` this store read less than `mailbox_cache` seconds ago, else None:
        of its mailbox `name`, or with None its account row (RCPT's quota check reuses the one its
        user lookup read; the delivery after DATA checks the limit again, on the mailbox row)."""
        hit = self._rows.get((key, name))
        if hit is not None and time.monotonic() - hit[0] < self.settings.mailbox_cache:
            return hit[1]
        return None

    def _keep(self, key: str, name: str | None, row: Any) -> None:
        """Keep a row just read for `_recent` (not when `mailbox_cache` is 0)."""
        if self.settings.mailbox_cache > 0:
            if len(self._rows) >= MAILBOX_CACHE_ROWS:
                self._rows.clear()
            self._rows[(key, name)] = (time.monotonic(), row)

    def _forget_user(self, key: str) -> None:
        """When this store changes one of the user's mailbox rows (creates, renames, deletes,
        subscribes), the user's quota limit, or deletes the user."""
        for pair in [pair for pair in self._rows if pair[0] == key]:
            del self._rows[pair]

    async def mailbox_info(self, user: str, name: str) -> MailboxInfo:
        key = address_key(user)
        name = mailbox_name(name)
        return _info(name, await self._resolve(key, name, cached=True))

    async def set_subscribed(self, user: str, name: str, subscribed: bool) -> None:
        key, name = address_key(user), mailbox_name(name)
        row = await self._resolve(key, name, serial=True)
        self._forget_user(key)
        if not await self.tables.users.set_subscribed(key, name, row.mailbox_id, subscribed):
            raise NoSuchMailbox(key, name)

    async def _reserve_uidvalidity(self, key: str, count: int, batch: BatchStatement) -> tuple[BatchStatement, int]:
        """Add to a conditional batch the bump of the user's next UIDVALIDITY; return the first value."""
        account = await self._account(key, serial=True)
        current = account.next_uidvalidity or 1
        first = max(current, int(time.time()))
        batch.add(self.tables.users.bump_uidvalidity_statement(key, first + count, account.next_uidvalidity))
        return batch, first

    async def create_mailbox(self, user: str, name: str, special_use: str | None = None) -> MailboxInfo:
        key = address_key(user)
        name = mailbox_name(name)
        users = self.tables.users
        for _ in range(LWT_ATTEMPTS):
            batch, uidvalidity = await self._reserve_uidvalidity(key, 1, self.cql.batch(conditional=True))
            mailbox_id = new_message_id()
            batch.add(users.insert_mailbox_statement(key, name, mailbox_id, uidvalidity, special_use, True, None, None))
            applied, row = await self.cql.conditional(batch)
            if applied:
                self._forget_user(key)
                return MailboxInfo(name, uidvalidity, special_use, True)
            if await users.mailbox(key, name, serial=True) is not None:
                raise MailboxExists(key, name)
            await _backoff()
        raise StoreUnavailable(f"could not create mailbox {name!r} of {key}: too much contention")

    async def rename_mailbox(self, user: str, old: str, new: str) -> None:
        key = address_key(user)
        old, new = check_rename(key, old, new)
        users = self.tables.users
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
            batch, uidvalidity = await self._reserve_uidvalidity(key, 1, self.cql.batch(conditional=True))
            for source, target in moves:
                r = rows[source]
                batch.add(users.insert_mailbox_statement(
                    key, target, r.mailbox_id, r.uidvalidity, r.special_use, r.subscribed, r.low_water, r.low_water_due
                ))
                if fresh and source == INBOX:
                    # RFC 3501: renaming INBOX moves its mail and leaves a new, empty INBOX.
                    batch.add(users.reassign_mailbox_statement(key, INBOX, r.mailbox_id, new_message_id(), uidvalidity))
                else:
                    batch.add(users.delete_mailbox_statement(key, source, r.mailbox_id))
            applied, _ = await self.cql.conditional(batch)
            if applied:
                self._forget_user(key)
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
            statement = self.tables.users.delete_mailbox_statement(key, name, row.mailbox_id)
            applied, _ = await self.cql.conditional(statement)
            if applied:
                self._forget_user(key)
                await self._quota_freed_totals(key, *await self._purge_mailbox(row.mailbox_id))
                return
            await _backoff()
        raise StoreUnavailable(f"could not delete mailbox {name!r} of {key}: too much contention")

    async def _purge_mailbox(self, mailbox_id: uuid.UUID) -> tuple[int, int]:
        """Release every body of a mailbox, then drop its partition with one tombstone; returns
        the bytes and number of the messages it held."""
        cursor = None
        size = count = 0
        while True:
            rows = await self.tables.messages.walk(mailbox_id, cursor, 1000)
            held = [r for r in rows if r.body_id is not None]
            size, count = size + sum(r.size or 0 for r in held), count + len(held)
            await self._release_bodies(mailbox_id, held)
            if len(rows) < 1000:
                break
            cursor = rows[-1].id
        await self.tables.messages.purge(mailbox_id)
        return size, count

    # ================================================================= delivery

    async def deliver(
        self, body: Body, targets: Sequence[Target], internal_date: datetime | None = None, *, copy: bool = False
    ) -> list[uuid.UUID]:
        """With `copy` (a message copied, CassandraCopies) the targets' rows may be ones this
        store read less than `mailbox_cache` ago (see `_resolve`)."""
        view, targets, unique = prepare_delivery(body, targets, self.max_message_size)
        size = view.nbytes
        when = internal_date_utc(internal_date)
        # Resolve every target first: an unknown user or mailbox fails before anything is written.
        rows = await asyncio.gather(*(self._resolve(u, m, cached=copy) for (u, m) in unique))
        counted = await self._quota_check(list(unique), rows, size)  # QuotaExceeded before any write
        mailbox_ids = {k: r.mailbox_id for k, r in zip(unique, rows)}

        body_id = new_message_id()
        chunk = self.settings.chunk_size
        await self._put_chunks(body_id, view, chunk)
        # Ids are stamped once the body is stored, just before the rows that carry them: a row
        # lands at most one write after its id's time, which `arrivals` relies on.
        ids = {k: new_message_id() for k in unique}
        shared = len(unique) > 1
        if shared:
            refs = {body_ref(mailbox_ids[k], ids[k]) for k in unique}
            await self.tables.bodies.insert(body_id, size, chunk, refs)
        inserts = [
            (mailbox_ids[k], ids[k], size, set(t.flags) or None, when, body_id, chunk, shared, ids[k])
            for k, t in unique.items()
        ]
        if len(inserts) == 1:
            await self.tables.messages.insert(*inserts[0])
        else:
            insert = self.tables.messages.insert_statement
            await self.cql.run(self.cql.batch(BatchType.LOGGED, statements=[insert(*params) for params in inserts]))
        self._notify(mailbox_ids.values())
        for k in unique:
            self._ahead.delivered(mailbox_ids[k], ids[k])
        await self._quota_count(counted)
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

    async def list_messages(self, user: str, mailbox: str, page_size: int = 500) -> AsyncIterator[MessageSummary]:
        """As `Store.list_messages`, with the next page asked for as soon as this one's rows are
        in: Cassandra reads it while the worker makes and takes in this one's summaries."""
        page = await self.list_page(user, mailbox, limit=page_size)  # (the first: the low-water mark)
        for item in page.items:
            yield item
        if page.cursor is None:
            return
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        async for item in self._after(mailbox_id, page.cursor, page_size):
            yield item

    async def _after(self, mailbox_id: uuid.UUID, after: uuid.UUID, page_size: int) -> AsyncIterator[MessageSummary]:
        """The summaries of the messages after `after`, in pages of `page_size`, each page asked
        for as soon as the one before is in."""
        messages = self.tables.messages
        ahead: asyncio.Future[list[Any]] | None = asyncio.ensure_future(messages.page(mailbox_id, after, page_size))
        try:
            while ahead is not None:
                rows = await ahead
                cursor = _cursor(rows, page_size)
                ahead = asyncio.ensure_future(messages.page(mailbox_id, cursor, page_size)) if cursor else None
                self._bodies.note(mailbox_id, rows)
                for item in _live(rows):
                    yield item
        finally:
            if ahead is not None:  # the reader stopped early, or a page failed
                ahead.cancel()
                ahead.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _page(self, mailbox_id: uuid.UUID, after: uuid.UUID | None, limit: int) -> Page:
        return self._taken_in(mailbox_id, await self.tables.messages.page(mailbox_id, after, limit), limit)

    def _taken_in(self, mailbox_id: uuid.UUID, rows: Sequence[Any], limit: int) -> Page:
        """A page of message rows read with a LIMIT of `limit`, their bodies' places noted."""
        self._bodies.note(mailbox_id, rows)
        return Page(_live(rows), _cursor(rows, limit))

    async def get_summaries(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, MessageSummary]:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        out: dict[uuid.UUID, MessageSummary] = {}
        for group in _groups(list(dict.fromkeys(ids)), IN_BATCH):
            for r in await self.tables.messages.summaries(mailbox_id, group):
                if r.size is not None:
                    out[r.id] = _summary(r)
        return out

    async def read_chunks(
        self, user: str, mailbox: str, message_id: uuid.UUID, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        info = self._bodies.get(mailbox_id, message_id) or await self.tables.messages.body_info(mailbox_id, message_id)
        if info is None or info.size is None:
            raise NoSuchMessage(mailbox, message_id)
        size, chunk = info.size, info.chunk_size
        end = size if end is None else min(end, size)
        if start < 0 or start > end:
            raise InvalidInput(f"invalid byte range {start}..{end} of a {size}-byte message")
        if start == end:
            return
        first, last = start // chunk, (end - 1) // chunk
        window = self.settings.chunk_concurrency
        pending: dict[int, asyncio.Task[bytes | None]] = {}
        # A few chunks are one request: most of a small read's cost is the request's, not its bytes.
        together = 0 < last - first < CHUNKS_READ_TOGETHER
        got: dict[int, bytes] = {}
        if together:
            async with self._chunk_slots:
                got = await self.tables.body_chunks.get_many(info.body_id, range(first, last + 1))
        try:
            for idx in range(first, last + 1):
                if together:
                    data = got.pop(idx, None)
                else:
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

    async def read_heads(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, bytes]:
        """As Store.read_heads, with the first chunks of many bodies in one request (HEADS_PER_READ
        bodies, about HEADS_BYTES of chunks, at most): a client listing the headers of a mailbox,
        or a SEARCH on a header field, makes a request per few messages, not one per message. A
        head longer than its first chunk, or a first chunk not there at this consistency, is read
        as one message's (`Store._read_head`: it tells a message gone from a replica behind)."""
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        bodies: dict[uuid.UUID, Any] = {}
        unknown = []
        for message_id in dict.fromkeys(ids):
            info = self._bodies.get(mailbox_id, message_id)
            if info is None:
                unknown.append(message_id)
            else:
                bodies[message_id] = info
        for group in _groups(unknown, IN_BATCH):
            bodies.update((r.id, r) for r in await self.tables.messages.body_infos(mailbox_id, group) if r.size is not None)
        reads: list[list[uuid.UUID]] = []
        budget = HEADS_BYTES
        for info in bodies.values():
            first = min(info.size, info.chunk_size)
            if not reads or budget + first > HEADS_BYTES or len(reads[-1]) >= HEADS_PER_READ:
                reads.append([])
                budget = 0
            reads[-1].append(info.body_id)
            budget += first

        async def read(body_ids: list[uuid.UUID]) -> dict[uuid.UUID, bytes]:
            async with self._chunk_slots:
                return await self.tables.body_chunks.firsts(body_ids)

        firsts: dict[uuid.UUID, bytes] = {}
        for found in await asyncio.gather(*(read(body_ids) for body_ids in reads)):
            firsts.update(found)
        out: dict[uuid.UUID, bytes] = {}
        for message_id, info in bodies.items():
            data = firsts.get(info.body_id)
            end = head_end(data) if data is not None else None
            if end is not None:
                out[message_id] = data[:end]
            elif data is not None and len(data) >= min(info.size, HEAD_LIMIT):
                out[message_id] = data[:HEAD_LIMIT]
            else:
                try:
                    out[message_id] = await self._read_head(user, mailbox, message_id)
                except NoSuchMessage:
                    pass
        return out

    async def _chunk(self, body_id: uuid.UUID, idx: int, every_replica: bool = False) -> bytes | None:
        """A chunk of a body; None when it is not there. `every_replica` asks all replicas (ALL):
        under a message row that is there, a chunk missing at a weaker level is one replica that
        has not applied the write yet while another has (RF=2 or more at ONE)."""
        async with self._chunk_slots:
            return await self.tables.body_chunks.get(body_id, idx, every_replica)

    async def _missing_chunk(
        self, mailbox_id: uuid.UUID, mailbox: str, message_id: uuid.UUID, body_id: uuid.UUID, idx: int
    ) -> NoSuchMessage | StoreUnavailable:
        """Why a chunk is missing, as the error to raise. A delete removes the message row before
        the chunks, so a row that is gone, or that names another body, means another session
        deleted the message meanwhile: NoSuchMessage (RFC 2180). Under a live message a missing
        chunk is a replica that has not seen the write yet: StoreUnavailable."""
        row = await self.tables.messages.body_info(mailbox_id, message_id)
        if row is None or row.size is None or row.body_id != body_id:
            return NoSuchMessage(mailbox, message_id)
        return StoreUnavailable(f"chunk {idx} of body {body_id} in {mailbox!r} not readable at this consistency")

    # ================================================================= flags and deletion

    async def store_flags(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], flags: Iterable[str], mode: FlagMode = "set",
        unchanged_since: int | None = None, modseqs: dict[uuid.UUID, int] | None = None,
        known: tuple[Mapping[uuid.UUID, MessageSummary], int] | None = None,
    ) -> set[uuid.UUID]:
        """Flags are written whole, in a conditional batch decided on the flags and MODSEQs read at
        SERIAL (`_change`), so no change is lost to another; or decided on `known` without a read
        when this process's last change of the mailbox left the MODSEQ they are known at
        (cassandra_left). When no Paxos round can be had (too few replicas of the mailbox up), a
        change without `unchanged_since` is still made, merged by Cassandra at the write level,
        without a MODSEQ: marking mail read keeps working in an outage, and a CONDSTORE client
        learns of that change with the message's next one."""
        mode = check_flag_mode(mode)
        values = flag_set(flags)
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        modified: set[uuid.UUID] = set()
        given: dict[uuid.UUID, int] = {}
        messages = self.tables.messages

        def plan(rows: list[Any], modseq: int, tally: Tally) -> list[Any]:
            modified.clear()
            given.clear()
            statements = []
            for r in rows:
                if r.size is None:
                    continue  # a ghost: an update would bring the deleted message back
                if unchanged_since is not None and r.uid is not None and (r.modseq or 1) > unchanged_since:
                    modified.add(r.id)
                    continue
                old = frozenset(r.flags or ())
                new = changed_flags(old, values, mode)
                if new != old:
                    tally.flags(r, new)
                    statements.append(messages.set_flags_statement(
                        mailbox_id, r.id, set(new) or None, modseq if r.uid else None))
                    if r.uid:
                        statements += messages.record_statements(mailbox_id, r.uid, modseq, r.id, r.uid, r.modseq)
                        given[r.id] = modseq
            return statements

        wanted = [i for i in dict.fromkeys(ids) if i != ANCHOR]
        for n, group in enumerate(_groups(wanted, UID_BATCH)):
            guess = None
            if known is not None and all(i in known[0] for i in group):
                guess = self._left.rows(mailbox_id, [known[0][i] for i in group], known[1])
            try:
                if await self._change(mailbox_id, group, plan, guess=guess) and modseqs is not None:
                    modseqs.update(given)
            except StoreUnavailable as exc:
                if unchanged_since is not None:
                    raise
                log.warning("flags of %d messages in %s changed without a MODSEQ: %s", len(wanted), mailbox_id, exc)
                await self._plain_flags(user, mailbox, mailbox_id, wanted[n * UID_BATCH :], values, mode)
                break
        return set(modified)

    async def _plain_flags(
        self, user: str, mailbox: str, mailbox_id: uuid.UUID, ids: list[uuid.UUID], values: frozenset[str],
        mode: FlagMode,
    ) -> None:
        existing = await self.get_summaries(user, mailbox, ids)  # an update of a deleted row would bring a ghost back
        flags = set(values) or None if mode == "set" else set(values)
        for group in _groups([i for i in ids if i in existing], IN_BATCH):
            batch = self.cql.batch(BatchType.UNLOGGED)
            token = new_message_id()
            for message_id in group:
                batch.add(self.tables.messages.plain_flags_statement(mode, mailbox_id, message_id, flags, token))
            batch.add(self.tables.messages.plain_at_statement(mailbox_id, token))  # STATUS counts are stale
            await self.cql.run(batch)
        self._notify([mailbox_id])

    async def delete_messages(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], modseqs: dict[uuid.UUID, int] | None = None,
        *, only_deleted: bool = False,
    ) -> set[uuid.UUID]:
        """Where reads see every acknowledged write, one read of the rows decides both whether the
        group needs a Paxos round at all and, as the first try of `_change`, what it deletes.
        With `only_deleted` the rows' flags decide too, in `plan`: the batch applies only if the
        mailbox's MODSEQ is still the one they were read at, so a \\Deleted taken away before it
        keeps the message. The mailbox's row may be one read up to `mailbox_cache` ago (see
        `_resolve`)."""
        key, name = address_key(user), mailbox_name(mailbox)
        row = await self._resolve(key, name, cached=True)
        mailbox_id = row.mailbox_id
        await self._ahead.forget(mailbox_id)
        wanted = [i for i in dict.fromkeys(ids) if i != ANCHOR]
        newest: uuid.UUID | None = None
        messages = self.tables.messages
        sees_writes = self._reads_see_writes()
        deleted: set[uuid.UUID] = set()
        for group in _groups(wanted, IN_BATCH):
            gone: list[Any] = []
            taken: list[uuid.UUID] = []
            forget: list[int] = []
            given: dict[uuid.UUID, int] = {}
            def plan(rows: list[Any], modseq: int, tally: Tally) -> list[Any]:
                if only_deleted:
                    rows = _flagged_deleted(rows)
                gone[:] = [r for r in rows if r.body_id is not None]
                taken[:] = [r.id for r in rows if r.size is not None]
                forget.clear()
                given.clear()
                if not rows:
                    return []
                statements = [messages.expunge_statement(mailbox_id, r.id) for r in rows]
                for r in rows:
                    tally.gone(r)
                numbered = [r for r in rows if r.size is not None and r.uid]
                for r in numbered:
                    statements += messages.record_statements(mailbox_id, r.uid, modseq, None, r.uid, r.modseq)
                    given[r.id] = modseq
                if numbered:
                    read = rows[0]
                    at = read.vanished_mark_at.replace(tzinfo=timezone.utc).timestamp() if read.vanished_mark_at else None
                    trim = expunge_floor(read.vanished_mark, at, read.vanished_floor, read.highest_modseq or 1,
                                         time.time(), self.vanished_keep)
                    if trim is not None:
                        floor, mark, now = trim
                        statements.append(messages.trim_statement(
                            mailbox_id, floor, mark, datetime.fromtimestamp(now, timezone.utc)))
                        if floor is not None and floor != read.vanished_floor:
                            forget.append(floor)
                return statements

            found = await (self._state(mailbox_id, group, serial=False) if sees_writes
                           else messages.body_infos(mailbox_id, group))
            if found and found[0].uidnext is None and found[0].highest_modseq is None:
                # Never numbered (POP3 only so far): no UID to remember, so a plain deletion, no
                # Paxos. (An IMAP session numbering one of these messages in the same instant keeps
                # its UID without an expunge record: it still sees the message go at its next
                # listing, and only a QRESYNC client reconnecting later would not be told.)
                if only_deleted:
                    found = _flagged_deleted(found)
                    group = [r.id for r in found]
                if group:
                    batch = self.cql.batch(BatchType.UNLOGGED)
                    batch.add(messages.delete_statement(mailbox_id, group))
                    changed = new_message_id()
                    batch.add(messages.changed_statement(mailbox_id, changed))
                    batch.add(messages.plain_at_statement(mailbox_id, changed))  # STATUS counts are stale
                    await self.cql.run(batch)
                    self._notify([mailbox_id])
                    gone = [r for r in found if r.body_id is not None]
                    deleted.update(r.id for r in found if r.size is not None)
            elif found:
                if await self._change(mailbox_id, group, plan, read=found if sees_writes else None):
                    deleted.update(taken)
                    if modseqs is not None:
                        modseqs.update(given)
                else:  # nothing applied (nothing left to delete as last read): nothing to free
                    gone.clear()
                    forget.clear()
            for r in gone:
                newest = _later(newest, r.id)
            await self._quota_freed(key, row, gone)
            # The messages are gone from here on: what follows only tidies up, and a failure of it
            # must not turn a done deletion into an error the client would retry or report.
            try:
                if forget:
                    await messages.forget_records(mailbox_id, forget[0])
                await self._release_bodies(mailbox_id, gone)
            except StoreUnavailable as exc:
                log.info("bodies of %d deleted messages in %s %r not released: %s", len(gone), key, name, exc)
        if newest is None:
            return deleted
        try:
            await self._advance_low_water(key, name, row, newest)
        except StoreUnavailable as exc:  # contention on the mailbox row; the next delete or listing moves it
            log.info("low-water mark of %s %r not moved: %s", key, name, exc)
        return deleted

    async def _change(
        self, mailbox_id: uuid.UUID, ids: list[uuid.UUID],
        plan: Callable[[list[Any], int, Tally], list[Any]],
        uids: Callable[[list[Any]], int] | None = None,
        read: list[Any] | None = None,
        guess: list[Any] | None = None,
    ) -> bool:
        """Apply a change to messages of one mailbox in one conditional batch: `plan` gets the
        rows of `ids` as read (with the counters, static columns on every row) and the
        MODSEQ this change gets, and returns its statements; `uids` (numbering) returns how many
        UIDs it hands out. The batch applies only if both counters are still as read, and it
        moves the MODSEQ counter (also for a change to unnumbered messages only, which needs no
        MODSEQ: it still must not apply over a concurrent change decided on the same read), so
        no change is lost to another and no MODSEQ or UID is handed out twice. Retried on
        contention. False when there was nothing to do. `read`: the rows of `ids` as the caller
        read them (`_state` at the read level, where reads see writes), for the first try.
        `guess`: the rows as they are known without a read (`Left.rows`), for a first try at any
        level; if the mailbox changed since, its batch does not apply, and the change goes on
        as without it."""
        messages = self.tables.messages
        # Where reads see every acknowledged write, the first try decides on a read at the read
        # level, without a Paxos round of its own: a change that overtook it, or one still in a
        # Paxos round (which the batch's own round finishes first), moved a counter, so the batch
        # does not apply and the next try reads at SERIAL.
        serial = not self._reads_see_writes()
        given = read
        tries = range(-1 if guess else 0, LWT_ATTEMPTS)  # (-1: the guess; a try that fails it is no contention)
        for attempt in tries:
            if attempt > 0:
                await _backoff(attempt)
                serial = True
            if attempt < 0:
                rows = guess or []
            elif given and not attempt and not serial:
                rows = given
            else:
                rows = await self._state(mailbox_id, ids, serial)
            if not rows and not serial:  # none there: as SERIAL says, a Paxos round finished first
                serial = True
                rows = await self._state(mailbox_id, ids, serial)
            if not rows:
                return False
            read = rows[0]
            highest = read.highest_modseq or 1
            tally = Tally(read)
            statements = plan(rows, highest + 1, tally)
            if not statements:
                return False
            if tally.valid:  # the STATUS counts stay true at the new MODSEQ (cassandra_counts)
                statements.append(messages.counts_statement(mailbox_id, tally.counts.values(), highest + 1))
            uidnext = read.uidnext
            if uids is not None:
                uidnext = (uidnext or 1) + uids(rows)
            batch = self.cql.batch(BatchType.UNLOGGED, conditional=True)
            batch.add(messages.advance_statement(mailbox_id, uidnext, highest + 1, (read.uidnext, read.highest_modseq),
                                                 read))
            for statement in statements:
                batch.add(statement)
            batch.add(messages.touch_anchor_statement(mailbox_id, new_message_id()))
            applied, _ = await self.cql.conditional(batch, contention_not_applied=True)
            if applied:
                self._notify([mailbox_id])
                self._left.applied(mailbox_id, uidnext, highest + 1, tally)
                return True
            self._left.forget(mailbox_id)
        raise StoreUnavailable("could not change messages: too much contention")

    async def _state(self, mailbox_id: uuid.UUID, ids: list[uuid.UUID], serial: bool = True) -> list[Any]:
        """The read of `_change` (at SERIAL, or at the read level: see there). Many ids
        (numbering a run of new mail, a change to a whole mailbox) are read as the slice from the
        first one's tick to the last one's, when that slice holds few other rows: Cassandra
        answers a slice of a thousand rows in two thirds of the time of an IN of a thousand keys."""
        messages = self.tables.messages
        if len(ids) < STATE_SLICE_MIN:
            return await messages.state(mailbox_id, ids, serial)
        ticks = [message_id.time for message_id in ids]
        limit = 2 * len(ids)
        rows = await messages.state_slice(mailbox_id, min(ticks), max(ticks), limit, serial)
        if len(rows) >= limit:  # the ids are spread among many others: read them by key
            return await messages.state(mailbox_id, ids, serial)
        wanted = set(ids)
        return [row for row in rows if row.id in wanted]

    async def _release_bodies(self, mailbox_id: uuid.UUID, rows: Sequence[Any]) -> None:
        """Drop the chunks of bodies no copy refers to any more; best effort: a failure leaks
        garbage, never mail."""
        await self._delete_chunks([
            r for r in rows
            if not r.shared or await self._release_shared(r.body_id, r.size, {body_ref(mailbox_id, r.id)})
        ])

    async def _release_shared(self, body_id: uuid.UUID, size: int, refs: set[str]) -> bool:
        """Drop references to a shared body; True when they were the last, and the caller is to
        delete its chunks. The last one's release deletes the body's row in a Paxos round, so a
        copy that adds its reference in the same instant (`CassandraCopies`) either comes first
        (the body stays) or finds the row gone (and copies nothing from it). A missing row, or
        one not yet visible at this consistency, is never taken as "no references"."""
        await self.tables.bodies.release(body_id, refs)
        body = await self.tables.bodies.refs(body_id)
        if body is None or body.size is None or body.refs:
            return False
        return await self.tables.bodies.delete_unreferenced(body_id, size)

    async def _delete_chunks(self, bodies: Sequence[Any]) -> None:
        """Every chunk of the bodies (rows with body_id, size and chunk_size), in unlogged batches
        of CHUNKS_PER_DELETE (each chunk is a partition of its own: one request per batch, not
        per chunk)."""
        chunks = [(b.body_id, i) for b in bodies for i in range(math.ceil(b.size / b.chunk_size))]
        delete = self.tables.body_chunks.delete_statement
        await self._gather_limited(
            self.cql.run(self.cql.batch(BatchType.UNLOGGED, statements=[delete(b, i) for b, i in group]))
            for group in _groups(chunks, CHUNKS_PER_DELETE)
        )

    async def _advance_low_water(self, key: str, name: str, mailbox: Any, deleted: uuid.UUID | None) -> None:
        """Move the low-water mark up to just below the oldest live message, but never past the grace
        period: a message that turns up late (slow replica, slow clock) must stay above it. The
        newest id deleted is kept as low_water_due, for listings to catch up with (see
        `_catch_up_low_water`). Two deletes at once may each keep their own: the lower one only
        stops the catching up early, and the next delete sets it again.

        At most once per CATCH_UP_STEP_100NS of deleted ids (a minute): a delete of mail less
        than that newer than low_water_due reads and writes nothing (a read of the oldest
        live message and a conditional write of the mailbox's row, each delete, were two of the
        five requests of an IMAP EXPUNGE). Meanwhile listings catch up as far as the kept due
        lets them, and a minute of deletions at most waits for the next delete to be caught up
        with: mail younger than the grace (hours, by default) is walked by listings anyway."""
        mailbox_id, current = mailbox.mailbox_id, mailbox.low_water
        due = _later(mailbox.low_water_due, deleted)
        if current is not None and mailbox.low_water_due is not None and due is not None and (
            due.time - mailbox.low_water_due.time < CATCH_UP_STEP_100NS
        ):
            return
        rows = await self.tables.messages.first_live(mailbox_id, current)
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
        await self._set_low_water(key, name, mailbox_id, mark, due)

    async def _set_low_water(self, key: str, name: str, mailbox_id: uuid.UUID, mark: uuid.UUID | None,
                             due: uuid.UUID | None) -> None:
        """Write the mailbox row's low-water mark and due (if the row still names `mailbox_id`).
        The row this store keeps for `_recent` then says the same, for the next deletion decides
        on it (see `_resolve`); when the write did not apply, the kept row goes."""
        applied = await self.tables.users.set_low_water(key, name, mailbox_id, mark, due)
        kept = self._rows.get((key, name))
        if kept is None or kept[1].mailbox_id != mailbox_id:
            return
        if applied:
            self._rows[(key, name)] = (kept[0], kept[1]._replace(low_water=mark, low_water_due=due))
        else:
            del self._rows[(key, name)]

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
            await self._set_low_water(key, name, mailbox.mailbox_id, _floor_uuid(target), due)
        except StoreUnavailable as exc:  # the listing itself succeeded; the next one tries again
            log.info("low-water mark of %s %r not moved: %s", key, name, exc)

    # ================================================================= IMAP UIDs

    async def uid_next(self, user: str, mailbox: str) -> int:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        anchor = await self._anchor(mailbox_id)
        return (anchor.uidnext if anchor else None) or 1

    async def _anchor(self, mailbox_id: uuid.UUID) -> Any:
        """The UID counter and the \\Recent mark (static columns), read at SERIAL through the
        anchor row: a point read, where a read of the static row alone would walk the tombstones
        at the head of the partition. None before the first UID assignment or \\Recent claim."""
        return await self.tables.messages.anchor(mailbox_id)

    async def changes_token(self, user: str, mailbox: str) -> Hashable | None:
        """The `changed` column (schema 005), read through the anchor row; None before the mailbox
        was first numbered (no anchor yet: the listing is read).

        Also None while the last change is younger than a write may stay in flight: writes carry
        the timestamp their client gave them, so a write sent before the one that set `changed`
        can land after it (and after a listing) without changing the column, last-write-wins by
        timestamp keeping the newer value. Once no write that old can still arrive, an unchanged
        column means an unchanged mailbox."""
        return (await self.changes_state(user, mailbox))[0]

    async def changes_state(self, user: str, mailbox: str) -> tuple[Hashable | None, int | None]:
        """The changes token and HIGHESTMODSEQ, both from the anchor row (one point read)."""
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        return self._changes_state(mailbox_id, await self.tables.messages.changes_token(mailbox_id))

    def _changes_state(self, mailbox_id: uuid.UUID, anchor: Any) -> tuple[Hashable | None, int]:
        """The changes token and HIGHESTMODSEQ from the anchor row as read (None: not there)."""
        if anchor is None:
            return None, 1
        highest = anchor.highest_modseq or 1
        changed = anchor.changed_key  # (the timeuuid's bytes)
        if changed is None or time.time() - timeuuid_seconds(uuid_from_bytes(changed)) < \
                self.settings.request_timeout + CHANGES_SETTLE:
            return None, highest
        return (mailbox_id, changed), highest

    async def assign_uids(
        self,
        user: str,
        mailbox: str,
        ids: Sequence[uuid.UUID],
        renumber: Mapping[uuid.UUID, int] | None = None,
        modseqs: dict[uuid.UUID, int] | None = None,
        listed_at: int | None = None,
    ) -> dict[uuid.UUID, int]:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        work = uid_work(ids, renumber)
        copies = self._copies.take(mailbox_id, work) if renumber is None else None
        if copies and len(work) <= UID_BATCH:  # copies this process made (COPY's COPYUID): as an APPEND's
            guess = self._left.rows(mailbox_id, copies, None)
            if guess is not None:
                found, _ = await self._assign_group(mailbox_id, work, None, modseqs, listed_at, guess=guess)
                return found
        return await self._assign(mailbox_id, work, renumber, modseqs, listed_at)

    async def _number_appended(self, target: Target, message: MessageSummary, modseqs: dict[uuid.UUID, int] | None,
                               recent: RecentClaim | None) -> dict[uuid.UUID, int]:
        """Decided without a read when this process changed the mailbox last (cassandra_left:
        the message's row is what the delivery wrote, which the batch checks is there without a
        UID); the batch also claims the UID for the appending session's \\Recent when the mark
        it knows is the UID (every UID below claimed): one Paxos round for both."""
        mailbox_id = (await self._resolve(address_key(target.user), target.mailbox, cached=True)).mailbox_id
        guess = self._left.rows(mailbox_id, [message], None)
        found, _ = await self._assign_group(mailbox_id, [message.id], None, modseqs, recent=recent, guess=guess)
        return found

    async def _assign(
        self, mailbox_id: uuid.UUID, ids: list[uuid.UUID], renumber: Mapping[uuid.UUID, int] | None = None,
        modseqs: dict[uuid.UUID, int] | None = None, listed_at: int | None = None,
    ) -> dict[uuid.UUID, int]:
        """`assign_uids` of a resolved mailbox, in batches of UID_BATCH; also numbering ahead's
        (cassandra_ahead.py), for the mail this process delivered.

        The first batch is decided on a SERIAL read (`_assign_group`); each one after it on what
        the one before left (`_next_batch`), with no read, and the next batch is made while the
        one before is in flight. A batch that does not apply is decided again on a read.

        Those later batches check that each of their messages is there and unnumbered, a read
        of each row inside the Paxos round (a third of the time of numbering 100,000 messages),
        unless the listing that found them unnumbered is known to be as good as that read: the
        SERIAL read saw no MODSEQ taken since `listed_at` but this listing's own (`modseqs`), so
        no numbering committed while it was read or before (its rows and every acknowledged write
        are read at levels that overlap, `reads_see_writes`), and the batches' own condition
        on the counters rules out any after. (A deletion without a Paxos round, in a mailbox
        never numbered, is not seen: the message it deletes in that instant is numbered anyway,
        which leaves a row with a UID and no message, skipped by every reader, and a gap in the
        UIDs.)"""
        groups = _groups(ids, UID_BATCH)
        uids: dict[uuid.UUID, int] = {}
        made: tuple[BatchStatement, _Numbered] | None = None  # the batch of the next group, and what it leaves
        for n, group in enumerate(groups):
            following = groups[n + 1] if n + 1 < len(groups) else None
            if made is not None:
                batch, ahead = made
                sent = asyncio.ensure_future(self.cql.conditional(batch, contention_not_applied=True))
                await asyncio.sleep(0)  # it goes out, and the next one is made while it is in flight
                made = self._next_batch(mailbox_id, following, ahead) if following else None
                applied, _ = await sent
                if applied:
                    self._notify([mailbox_id])
                    self._left.applied(mailbox_id, ahead.uidnext, ahead.highest, ahead.tally)
                    uids.update(zip(group, range(ahead.uidnext - len(group), ahead.uidnext)))
                    if modseqs is not None:
                        modseqs.update(dict.fromkeys(group, ahead.highest))
                    continue
            found, left = await self._assign_group(mailbox_id, group, renumber, modseqs, listed_at)
            uids.update(found)
            made = self._next_batch(mailbox_id, following, left) if left and following and renumber is None else None
        return uids

    def _next_batch(
        self, mailbox_id: uuid.UUID, ids: list[uuid.UUID], left: _Numbered
    ) -> tuple[BatchStatement, _Numbered]:
        """The conditional batch that numbers `ids` (none of which had a UID when listed) after
        the batch that `left` those counters and counts, and what it leaves in turn. It applies
        only if the counters are still those, and each message is there and still has no UID
        (`Messages.add_first_uids`); the STATUS counts move as `Tally.numbered` moves them."""
        messages = self.tables.messages
        first, modseq = left.uidnext, left.highest + 1
        ahead = _Numbered(first + len(ids), modseq, left.tally.copy(), left.listed)
        batch = self.cql.batch(BatchType.UNLOGGED, conditional=True)
        batch.add(messages.advance_statement(mailbox_id, ahead.uidnext, modseq, (first, left.highest), left.tally.read))
        messages.add_first_uids(batch, mailbox_id, ids, first, modseq, checked=not left.listed)
        if ahead.tally.valid:
            for uid, message_id in enumerate(ids, first):
                ahead.tally.numbered_first(message_id, uid)
            batch.add(messages.counts_statement(mailbox_id, ahead.tally.counts.values(), modseq))
        batch.add(messages.touch_anchor_statement(mailbox_id, new_message_id()))
        return batch, ahead

    async def _assign_group(
        self, mailbox_id: uuid.UUID, ids: list[uuid.UUID], renumber: Mapping[uuid.UUID, int] | None,
        modseqs: dict[uuid.UUID, int] | None, listed_at: int | None = None, recent: RecentClaim | None = None,
        guess: list[Any] | None = None,
    ) -> tuple[dict[uuid.UUID, int], _Numbered | None]:
        """Numbering through `_change`: the batch applies only if the counters are unchanged, i.e.
        nobody numbered or changed anything since the SERIAL read. Every renumbering moves the
        counters too, so a renumber raced by another one fails there, and its retry reads the
        message's new UID, no longer the one it was asked to replace. With what the batch left
        (counters, counts) when it applied, for the next batch to go on from. `guess`: as in
        `_change`. `recent`: a batch
        numbering one message at the UID the known mark names raises the mark past it too, on
        that condition (which holds whenever the counter does: the mark only grows, and never
        passes UIDNEXT)."""
        messages = self.tables.messages
        result: dict[uuid.UUID, int] = {}
        given: dict[uuid.UUID, int] = {}
        left: list[_Numbered] = []

        def missing(rows: list[Any]) -> list[Any]:
            alive = {r.id: r for r in rows if r.size is not None}
            return [alive[i] for i in ids if i in alive and needs_uid(alive[i].uid, i, renumber)]

        def plan(rows: list[Any], modseq: int, tally: Tally) -> list[Any]:
            todo = missing(rows)
            first = rows[0].uidnext or 1
            result.clear()
            result.update({r.id: r.uid for r in rows if r.size is not None and r.uid})
            given.clear()
            statements = []
            for offset, r in enumerate(todo):
                tally.numbered(r, first + offset)
                if isinstance(r, Known):  # not read: the batch checks it is there, without a UID
                    statements.append(messages.set_first_uid_statement(mailbox_id, r.id, first + offset, modseq))
                else:
                    statements.append(messages.set_uid_statement(mailbox_id, r.id, first + offset, modseq))
                statements += messages.record_statements(mailbox_id, first + offset, modseq, r.id, r.uid, r.modseq)
                if r.uid:  # renumbered: the UID it gives up is gone for clients that saw it
                    statements += messages.record_statements(mailbox_id, r.uid, modseq, None)
                result[r.id] = first + offset
                given[r.id] = modseq
            if recent is not None:  # (a known mark of 1 may be the unset one, which it cannot name)
                recent.won = recent.known > 1 and len(todo) == 1 and recent.known == first
                if recent.won:
                    statements.append(messages.raise_recent_statement(mailbox_id, first + 1, recent.known))
            listed = (renumber is None and listed_at is not None and modseqs is not None and listed_at < modseq
                      and set(range(listed_at + 1, modseq)) <= set(modseqs.values()) and self._reads_see_writes())
            left[:] = [_Numbered(first + len(todo), modseq, tally, listed)]
            return statements

        applied = await self._change(mailbox_id, ids, plan, uids=lambda rows: len(missing(rows)), guess=guess)
        if applied and modseqs is not None:
            modseqs.update(given)
        if recent is not None and not applied:
            recent.won = False
        return {i: result[i] for i in ids if i in result}, left[0] if applied else None

    async def highest_modseq(self, user: str, mailbox: str) -> int:
        """Read at the read level, not SERIAL: every SELECT asks, and a value a weak read shows too
        low only makes a client ask for more changes than it needs (never fewer)."""
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        anchor = await self.tables.messages.changes_token(mailbox_id)
        return (anchor.highest_modseq if anchor else None) or 1

    async def changed_since(self, user: str, mailbox: str, modseq: int) -> list[MessageSummary]:
        """From the MODSEQ records (schema 008), without the listing: their slice above `modseq`,
        then the rows they name. Below what the records can answer (MODSEQ 1: mail numbered
        before schema 008 has none; or a trimmed range) the listing is read instead."""
        changed, _ = await self._since(user, mailbox, modseq, changed=True, vanished=False)
        return changed

    async def vanished_since(self, user: str, mailbox: str, modseq: int) -> list[int] | None:
        _, vanished = await self._since(user, mailbox, modseq, changed=False, vanished=True)
        return vanished

    async def changes_since(self, user: str, mailbox: str, modseq: int) -> tuple[list[MessageSummary], list[int] | None]:
        return await self._since(user, mailbox, modseq, changed=True, vanished=True)

    async def _since(
        self, user: str, mailbox: str, modseq: int, changed: bool, vanished: bool
    ) -> tuple[list[MessageSummary], list[int] | None]:
        """What changed and what vanished above `modseq`, from one SERIAL read in the common case:
        the records slice above it, whose rows carry the counter and the floor (static columns);
        the anchor is read only when the slice is empty. Then the rows the records name."""
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        records = await self.tables.messages.records(mailbox_id, max(modseq, 0))
        state = records[0] if records else await self._anchor(mailbox_id)
        if state is None or modseq >= (state.highest_modseq or 1):
            return [], []
        floor = state.vanished_floor
        if vanished and floor is not None and modseq < floor:
            return [], None  # expunges forgotten: the client resynchronises in full
        gone = sorted({r.uid for r in records if r.changed_id is None and r.uid is not None}) if vanished else []
        if not changed:
            return [], gone
        if modseq < max(floor or 1, 1):  # below what the records answer: the listing
            return await super().changed_since(user, mailbox, modseq), gone
        named = [r.changed_id for r in records if r.changed_id is not None and r.changed_last is None]
        found = await self.get_summaries(user, mailbox, named)
        for r in records:
            if r.changed_last is not None:  # a run numbered in one batch (schema 015): its slice
                found.update((row.id, _summary(row)) for row in
                             await self.tables.messages.run(mailbox_id, r.changed_id, r.changed_last)
                             if row.size is not None)
        fresh = [s for s in found.values() if s.modseq is not None and s.modseq > modseq]
        return sorted(fresh, key=lambda s: (s.id.time, s.id.bytes)), gone

    def arrivals_mark(self, summaries: Iterable[MessageSummary], started: float | None = None) -> Hashable | None:
        """The time (100 ns ticks) of the newest message id listed, or when the listing began if
        that is later, or of now for an empty mailbox: ids are stamped just before their row is
        written (see `deliver`), and a row stamped more than the arrival window (see `arrivals`)
        before the listing began had landed by then. (From the newest id alone, every look of a
        mailbox that has been quiet since a burst would read that burst's last seconds again.)"""
        newest = max((s.id.time for s in summaries), default=None)
        if started is not None:
            return max(newest or 0, _ticks(started))
        return _now_100ns() if newest is None else newest

    async def arrivals(self, user: str, mailbox: str, mark: Hashable) -> tuple[list[MessageSummary], Hashable]:
        """The rows of ids stamped since `mark` less the arrival window: a row lands at most one
        write (the request timeout) after its id's time, plus the clocks of two nodes apart; a
        row later than that is seen by the next full listing (see MailboxView)."""
        mailbox_id, after, started = await self._arrivals_from(user, mailbox, mark)
        found = [s async for s in self._after(mailbox_id, after, ARRIVALS_PAGE)]
        return found, max([mark, started, *(s.id.time for s in found)])

    async def arrivals_state(
        self, user: str, mailbox: str, mark: Hashable
    ) -> tuple[list[MessageSummary], Hashable, Hashable | None, int | None]:
        """One read while fewer than a page arrived: the slice of the arrivals ends at the anchor
        row (the largest id), and the token and HIGHESTMODSEQ are static columns, on its every
        row. Past a page, the rest is read as `arrivals` reads it, and the token is None."""
        mailbox_id, after, started = await self._arrivals_from(user, mailbox, mark)
        rows = await self.tables.messages.arrivals(mailbox_id, after, ARRIVALS_PAGE)
        page = self._taken_in(mailbox_id, rows, ARRIVALS_PAGE)
        found = list(page.items)
        if page.cursor is None:
            token, highest = self._changes_state(mailbox_id, rows[-1] if rows and rows[-1].id == ANCHOR else None)
        else:
            token, highest = None, rows[0].highest_modseq or 1
            found += [s async for s in self._after(mailbox_id, page.cursor, ARRIVALS_PAGE)]
        return found, max([mark, started, *(s.id.time for s in found)]), token, highest

    async def _arrivals_from(self, user: str, mailbox: str, mark: Hashable) -> tuple[uuid.UUID, uuid.UUID, int]:
        """The mailbox's id, the id after which arrivals since `mark` are read, and now (in
        100 ns ticks: a row stamped a window before it has landed, see `arrivals_mark`)."""
        assert isinstance(mark, int)
        mailbox_id = (await self._resolve(address_key(user), mailbox_name(mailbox), cached=True)).mailbox_id
        window = int((self.settings.request_timeout + CHANGES_SETTLE + ARRIVAL_SKEW) * 10_000_000)
        return mailbox_id, _floor_uuid(mark - window), _now_100ns()

    # ================================================================= IMAP \Recent

    async def recent_mark(self, user: str, mailbox: str) -> int:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        anchor = await self._anchor(mailbox_id)
        return (anchor.recent_mark if anchor else None) or 1

    async def claim_recent(self, user: str, mailbox: str, below: int, known: int | None = None) -> int:
        """Compare-and-set of the mark from the value read at SERIAL, retried on contention like
        `_assign_group`; with the anchor row in the same conditional batch, so the mark is read
        by the same point read as the UID counter. A claim the mark already covers writes nothing.
        With `known`, the first try sets the mark from it without that read: a round that does
        not apply answers with the mark as it is, which the next try sets it from."""
        below = check_recent_below(below)
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        guess = known if known is not None and known > 1 else None
        for attempt in range(LWT_ATTEMPTS):
            if attempt:
                await _backoff(attempt)
            if guess is not None:
                current, guess = guess, None
            else:
                anchor = await self._anchor(mailbox_id)
                current = anchor.recent_mark if anchor else None
            mark = current or 1
            if mark >= below:
                return mark
            messages = self.tables.messages
            batch = self.cql.batch(BatchType.UNLOGGED, conditional=True)
            batch.add(messages.raise_recent_statement(mailbox_id, below, current))
            batch.add(messages.touch_anchor_statement(mailbox_id, new_message_id()))
            # A timed-out round that did apply is found by the next read: the mark is then past
            # `below`, and this session claims nothing (no message recent twice, at worst none).
            applied, row = await self.cql.conditional(batch, contention_not_applied=True)
            if applied:
                return mark
            if row is not None and getattr(row, "recent_mark", None) is not None:
                guess = row.recent_mark  # (a round that lost a race, not one that timed out)
        raise StoreUnavailable("could not claim \\Recent: too much contention")


# ===================================================================== helpers


def _info(name: str, row: Any) -> MailboxInfo:
    return MailboxInfo(name, row.uidvalidity, row.special_use, bool(row.subscribed))


def _summary(row: Any) -> MessageSummary:
    # The internal date is read in milliseconds (`toUnixTimestamp`): one call makes the datetime
    # in UTC, where the driver's naive one then took a `replace` of twice its cost.
    when = None if row.internal_ms is None else _from_timestamp(row.internal_ms / 1000, timezone.utc)
    # A message numbered before MODSEQs (schema 008) has none: MODSEQ 1 (see Store.highest_modseq).
    modseq = (row.modseq or 1) if row.uid else None
    return MessageSummary(row.id, row.size, _flag_set(row.flags), when, row.uid or None, modseq)


_from_timestamp = datetime.fromtimestamp

#: Flag sets listed so far, shared by the summaries that have them: a mailbox has few distinct
#: ones, and a summary kept in a view or a snapshot (cassmail.imap.view) then costs no set of its own.
_FLAG_SETS: dict[tuple[str, ...], frozenset[str]] = {}
_FLAG_SETS_KEPT = 4096


def _flag_set(flags: Iterable[str] | None) -> frozenset[str]:
    key = tuple(flags) if flags else ()  # (the driver's sets are sorted)
    found = _FLAG_SETS.get(key)
    if found is None:
        found = frozenset(key)
        if len(_FLAG_SETS) < _FLAG_SETS_KEPT:
            _FLAG_SETS[key] = found
    return found


def _flagged_deleted(rows: list[Any]) -> list[Any]:
    """The message rows whose stored flags hold \\Deleted (`delete_messages`' `only_deleted`)."""
    return [r for r in rows if r.flags and "\\Deleted" in r.flags]


def _later(a: uuid.UUID | None, b: uuid.UUID | None) -> uuid.UUID | None:
    """The later of two timeuuids (by time, then bytes); None counts as the earliest."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda u: (u.time, u.bytes))


class _Body(NamedTuple):
    body_id: uuid.UUID
    size: int
    chunk_size: int


class _BodyNotes:
    """Where the bodies of messages listed lately are: (mailbox id, message id) -> the row's
    (body_id as its 16 bytes, size, chunk_size), the `limit` noted last; `get` gives a `_Body`. A read of a noted message's body needs
    no read of its row first: POP3 lists its mailbox at login, then RETRs one message after the
    other; an IMAP client fetches what it just listed.

    A note never goes wrong: a message's row is written once with its body and only its flags
    and UID change after, and ids are never used again. A message deleted since it was noted
    reads as a missing chunk, which read_chunks already tells apart from a replica that is
    behind by reading the row (`_missing_chunk`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: keyed by the two ids' integers (a UUID's own hash is a Python call: two per row listed)
        self._notes: OrderedDict[tuple[int, int], tuple[bytes, int, int]] = OrderedDict()

    def note(self, mailbox_id: uuid.UUID, rows: Sequence[Any]) -> None:
        notes = self._notes
        mailbox = mailbox_id.int
        for r in rows:
            if r.body_key is not None and r.size is not None:
                notes[(mailbox, r.id.int)] = (r.body_key, r.size, r.chunk_size)
        for _ in range(len(notes) - self.limit):
            notes.popitem(last=False)

    def get(self, mailbox_id: uuid.UUID, message_id: uuid.UUID) -> _Body | None:
        found = self._notes.get((mailbox_id.int, message_id.int))
        if found is None:
            return None
        key, size, chunk_size = found
        return _Body(uuid_from_bytes(key), size, chunk_size)


def _live(rows: Sequence[Any]) -> list[MessageSummary]:
    """The summaries of a page of message rows, less rows without a message (a ghost, the anchor)."""
    return [_summary(r) for r in rows if r.size is not None]


def _cursor(rows: Sequence[Any], limit: int) -> uuid.UUID | None:
    """Where the page after a page of `limit` rows starts; None when it was the last."""
    return rows[-1].id if len(rows) == limit else None


@dataclass
class _Numbered:
    """What a numbering batch that applied left: the counters it set and the STATUS counts."""

    uidnext: int
    highest: int
    tally: Tally
    #: Whether the listing of the messages still to number is known to be true (see `_assign`).
    listed: bool = False


def _groups(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _backoff(attempt: int = 0) -> None:
    await asyncio.sleep(contention_pause(attempt))
