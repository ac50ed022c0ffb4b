"""Every CQL statement of the Cassandra store, one class per table (schema/*.cql).

A table object owns its statements: their CQL, the consistency class of each (`Kind`), their
preparation when the store opens, and typed methods that run them through the store's one
executor (`Cql`). A method named `..._statement` returns a bound statement instead of running
it, for a batch: batches that span tables are put together by the store from such pieces.
What to read and write when, and why, is the store's (cassandra.py, cassandra_queue.py,
cassandra_sieve.py); nothing here decides anything.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, ClassVar

from cassandra import ConsistencyLevel
from cassandra.query import BatchStatement, BoundStatement, PreparedStatement

from cassmail.store.base import QueuedRecipient
from cassmail.store.cassandra_cql import Cql, Kind, add_serialized

READ, WRITE, SERIAL_READ, CONDITIONAL = Kind.READ, Kind.WRITE, Kind.SERIAL_READ, Kind.CONDITIONAL

#: The anchor row of every mailbox partition: the largest timeuuid, written with the UID counter.
ANCHOR = uuid.UUID(fields=(0xFFFFFFFF, 0xFFFF, 0x1FFF, 0xBF, 0xFF, 0xFFFFFFFFFFFF))
#: Below every real message id (1970): listings start here, above the MODSEQ records (schema 008).
FIRST_REAL = uuid.UUID(fields=(0x13814000, 0xD211, 0x11B2, 0x80, 0x00, 0))
#: Statements prepared at once when a store opens.
PREPARE_THREADS = 8

_MAX_MODSEQ_TICKS = 0x01B21DD213814000  # 1970 in 100 ns ticks since 1582: where FIRST_REAL is


def _timeuuid(ticks: int, clock_seq: int, node: int) -> uuid.UUID:
    return uuid.UUID(fields=(ticks & 0xFFFFFFFF, (ticks >> 32) & 0xFFFF, ((ticks >> 48) & 0x0FFF) | 0x1000,
                             clock_seq >> 8, clock_seq & 0xFF, node))


def min_timeuuid(unix_seconds: float) -> uuid.UUID:
    """The smallest timeuuid of a moment, in Cassandra's order (cf. minTimeuuid): a bound for
    `at > ?` range reads."""
    return _timeuuid(int(unix_seconds * 10_000_000) + _MAX_MODSEQ_TICKS, 0x8080, 0x808080808080)


def record_id(modseq: int, uid: int) -> uuid.UUID:
    """The clustering id of the MODSEQ record (schema 008) of UID `uid` changed or expunged at
    MODSEQ `modseq`: a timeuuid whose time is the MODSEQ (so records sort by it, below
    FIRST_REAL) and whose node field is the UID (so one MODSEQ may record many UIDs)."""
    return uuid.UUID(bytes=_record_key(_checked_modseq(modseq), uid))


def _checked_modseq(modseq: int) -> int:
    if not 0 < modseq < _MAX_MODSEQ_TICKS:
        raise ValueError(f"MODSEQ out of range for a MODSEQ record: {modseq}")
    return modseq


_RECORD_KEY = struct.Struct(">IHHHHI")
_BIGINT = struct.Struct(">q")


def _record_key(modseq: int, uid: int) -> bytes:
    """`record_id`'s 16 bytes (time low, mid and high with version 1, clock sequence 0x8000, the
    UID as the 48-bit node), packed at once: the numbering makes one per message."""
    return _RECORD_KEY.pack(modseq & 0xFFFFFFFF, (modseq >> 32) & 0xFFFF, ((modseq >> 48) & 0x0FFF) | 0x1000, 0x8000,
                            (uid >> 32) & 0xFFFF, uid & 0xFFFFFFFF)


def _after_modseq(modseq: int) -> uuid.UUID:
    """Above every MODSEQ record of `modseq`: Cassandra orders timeuuids of one time by their
    remaining bytes taken as signed, so the largest is 0xBF7F 7F7F7F7F7F7F (cf. maxTimeuuid)."""
    return _timeuuid(modseq, 0xBF7F, 0x7F7F7F7F7F7F)


class Table:
    """One table's statements, prepared once per store."""

    #: name -> (consistency class, CQL naming the table unqualified: the keyspace is added when prepared).
    STATEMENTS: ClassVar[dict[str, tuple[Kind, str]]] = {}

    def __init__(self, cql: Cql) -> None:
        self.cql = cql
        self.prepared: dict[str, PreparedStatement] = {}

    def bind(self, name: str, *params: Any) -> BoundStatement:
        return self.prepared[name].bind(params)

    async def _run(self, name: str, *params: Any) -> list[Any]:
        return await self.cql.run(self.bind(name, *params))

    async def _conditional(self, name: str, *params: Any) -> tuple[bool, Any]:
        return await self.cql.conditional(self.bind(name, *params))


def _first(rows: list[Any]) -> Any:
    return rows[0] if rows else None


# ===================================================================== accounts and addresses


class Domains(Table):
    """`domains`: the local domains, one small partition."""

    STATEMENTS = {
        "add": (WRITE, "INSERT INTO domains (bucket, domain) VALUES (0, ?)"),
        "delete": (WRITE, "DELETE FROM domains WHERE bucket = 0 AND domain = ?"),
        "get": (READ, "SELECT domain FROM domains WHERE bucket = 0 AND domain = ?"),
        "all": (READ, "SELECT domain FROM domains WHERE bucket = 0"),
    }

    async def add(self, domain: str) -> None:
        await self._run("add", domain)

    async def delete(self, domain: str) -> None:
        await self._run("delete", domain)

    async def exists(self, domain: str) -> bool:
        return bool(await self._run("get", domain))

    async def all(self) -> list[str]:
        return [row.domain for row in await self._run("all")]


class Users(Table):
    """`users`: a partition per user; the account in static columns, a row per mailbox."""

    _MAILBOX = "mailbox_id, uidvalidity, special_use, subscribed, low_water, low_water_due"
    STATEMENTS = {
        "create": (
            CONDITIONAL,
            "INSERT INTO users (user, password_hash, created, next_uidvalidity, sieve) VALUES (?, ?, ?, ?, false) "
            "IF NOT EXISTS",
        ),
        # With the Sieve mark (schema 016): a delivery's Sieve step reuses the row RCPT read.
        "account": (READ, "SELECT password_hash, next_uidvalidity, quota_limit, sieve FROM users WHERE user = ? LIMIT 1"),
        "account_serial": (
            SERIAL_READ,
            "SELECT password_hash, next_uidvalidity, quota_limit, sieve FROM users WHERE user = ? LIMIT 1",
        ),
        "set_password": (CONDITIONAL, "UPDATE users SET password_hash = ? WHERE user = ? IF password_hash != null"),
        "delete": (WRITE, "DELETE FROM users WHERE user = ?"),
        "with_account": (READ, "SELECT user, password_hash FROM users WHERE user IN ? PER PARTITION LIMIT 1"),
        "mailboxes": (READ, f"SELECT mailbox, {_MAILBOX} FROM users WHERE user = ?"),
        # With the account's storage limit (schema 010): a delivery reads this row anyway.
        "mailbox": (READ, f"SELECT {_MAILBOX}, quota_limit FROM users WHERE user = ? AND mailbox = ?"),
        "mailbox_serial": (SERIAL_READ, f"SELECT {_MAILBOX} FROM users WHERE user = ? AND mailbox = ?"),
        "insert_mailbox": (
            CONDITIONAL,
            f"INSERT INTO users (user, mailbox, {_MAILBOX}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS",
        ),
        "insert_default_mailbox": (
            CONDITIONAL,
            "INSERT INTO users (user, mailbox, mailbox_id, uidvalidity, special_use, subscribed) "
            "VALUES (?, ?, ?, ?, ?, ?)",
        ),
        "bump_uidvalidity": (
            CONDITIONAL,
            "UPDATE users SET next_uidvalidity = ? WHERE user = ? IF next_uidvalidity = ?",
        ),
        "subscribe": (
            CONDITIONAL,
            "UPDATE users SET subscribed = ? WHERE user = ? AND mailbox = ? IF mailbox_id = ?",
        ),
        "delete_mailbox": (CONDITIONAL, "DELETE FROM users WHERE user = ? AND mailbox = ? IF mailbox_id = ?"),
        "reassign_mailbox": (
            CONDITIONAL,
            "UPDATE users SET mailbox_id = ?, uidvalidity = ?, low_water = null, low_water_due = null "
            "WHERE user = ? AND mailbox = ? IF mailbox_id = ?",
        ),
        "set_low_water": (
            CONDITIONAL,
            "UPDATE users SET low_water = ?, low_water_due = ? WHERE user = ? AND mailbox = ? IF mailbox_id = ?",
        ),
        "set_quota_limit": (CONDITIONAL, "UPDATE users SET quota_limit = ? WHERE user = ? IF password_hash != null"),
        "set_sieve_mark": (CONDITIONAL, "UPDATE users SET sieve = ? WHERE user = ? IF password_hash != null"),
    }

    def create_statement(self, user: str, password_hash: str, created: datetime, next_uidvalidity: int) -> BoundStatement:
        return self.bind("create", user, password_hash, created, next_uidvalidity)

    async def account(self, user: str, serial: bool = False) -> Any:
        """The account's row (password_hash, next_uidvalidity, quota_limit, sieve), None when the
        partition is empty."""
        return _first(await self._run("account_serial" if serial else "account", user))

    async def set_password_hash(self, user: str, password_hash: str) -> bool:
        applied, _ = await self._conditional("set_password", password_hash, user)
        return applied

    async def set_sieve_mark(self, user: str, mark: bool) -> bool:
        """Whether the user may have an active Sieve script; False when there is no account."""
        applied, _ = await self._conditional("set_sieve_mark", mark, user)
        return applied

    def delete_statement(self, user: str) -> BoundStatement:
        return self.bind("delete", user)

    async def with_account(self, users: Sequence[str]) -> set[str]:
        """Which of these users have an account (a password hash)."""
        return {r.user for r in await self._run("with_account", users) if r.password_hash is not None}

    async def mailboxes(self, user: str) -> list[Any]:
        return await self._run("mailboxes", user)

    async def mailbox(self, user: str, mailbox: str, serial: bool = False) -> Any:
        """A mailbox's row, None when there is none."""
        return _first(await self._run("mailbox_serial" if serial else "mailbox", user, mailbox))

    def insert_mailbox_statement(
        self, user: str, mailbox: str, mailbox_id: uuid.UUID, uidvalidity: int, special_use: str | None,
        subscribed: bool, low_water: uuid.UUID | None, low_water_due: uuid.UUID | None,
    ) -> BoundStatement:
        return self.bind("insert_mailbox", user, mailbox, mailbox_id, uidvalidity, special_use, subscribed,
                         low_water, low_water_due)

    def insert_default_mailbox_statement(
        self, user: str, mailbox: str, mailbox_id: uuid.UUID, uidvalidity: int, special_use: str | None,
        subscribed: bool,
    ) -> BoundStatement:
        """A mailbox of a new account: in the account's conditional batch, so no condition of its own."""
        return self.bind("insert_default_mailbox", user, mailbox, mailbox_id, uidvalidity, special_use, subscribed)

    def bump_uidvalidity_statement(self, user: str, new: int, expected: int | None) -> BoundStatement:
        return self.bind("bump_uidvalidity", new, user, expected)

    async def set_subscribed(self, user: str, mailbox: str, mailbox_id: uuid.UUID, subscribed: bool) -> bool:
        applied, _ = await self._conditional("subscribe", subscribed, user, mailbox, mailbox_id)
        return applied

    def delete_mailbox_statement(self, user: str, mailbox: str, mailbox_id: uuid.UUID) -> BoundStatement:
        return self.bind("delete_mailbox", user, mailbox, mailbox_id)

    def reassign_mailbox_statement(
        self, user: str, mailbox: str, old_id: uuid.UUID, new_id: uuid.UUID, uidvalidity: int
    ) -> BoundStatement:
        return self.bind("reassign_mailbox", new_id, uidvalidity, user, mailbox, old_id)

    async def set_low_water(
        self, user: str, mailbox: str, mailbox_id: uuid.UUID, mark: uuid.UUID | None, due: uuid.UUID | None
    ) -> bool:
        applied, _ = await self._conditional("set_low_water", mark, due, user, mailbox, mailbox_id)
        return applied

    async def set_quota_limit(self, user: str, limit: int | None) -> bool:
        """False when the user has no account (nothing written)."""
        applied, _ = await self._conditional("set_quota_limit", limit, user)
        return applied


class UsersByDomain(Table):
    """`users_by_domain`: the users of each domain (rows without an account are ignored by readers)."""

    STATEMENTS = {
        "add": (WRITE, "INSERT INTO users_by_domain (domain, user) VALUES (?, ?)"),
        "delete": (WRITE, "DELETE FROM users_by_domain WHERE domain = ? AND user = ?"),
        "users": (READ, "SELECT user FROM users_by_domain WHERE domain = ?"),
        "domains": (READ, "SELECT DISTINCT domain FROM users_by_domain"),
    }

    async def add(self, domain: str, user: str) -> None:
        await self._run("add", domain, user)

    def delete_statement(self, domain: str, user: str) -> BoundStatement:
        return self.bind("delete", domain, user)

    async def users(self, domain: str) -> list[str]:
        return [row.user for row in await self._run("users", domain)]

    async def domains(self) -> list[str]:
        return [row.domain for row in await self._run("domains")]


class Aliases(Table):
    """`aliases`: a partition per domain, a row per alias holding its users."""

    STATEMENTS = {
        "get": (READ, "SELECT users FROM aliases WHERE domain = ? AND alias = ?"),
        "in_domain": (READ, "SELECT alias, users FROM aliases WHERE domain = ?"),
        "set": (WRITE, "INSERT INTO aliases (domain, alias, users) VALUES (?, ?, ?)"),
        "delete": (WRITE, "DELETE FROM aliases WHERE domain = ? AND alias = ?"),
        "remove_user": (WRITE, "UPDATE aliases SET users = users - ? WHERE domain = ? AND alias = ?"),
    }

    async def users(self, domain: str, alias: str) -> set[str] | None:
        """The alias's users; None (or an empty set) when there is no such alias."""
        row = _first(await self._run("get", domain, alias))
        return row.users if row is not None else None

    async def in_domain(self, domain: str) -> list[Any]:
        """Rows of (alias, users)."""
        return await self._run("in_domain", domain)

    async def set(self, domain: str, alias: str, users: set[str]) -> None:
        await self._run("set", domain, alias, users)

    async def delete(self, domain: str, alias: str) -> None:
        await self._run("delete", domain, alias)

    async def remove_user(self, domain: str, alias: str, user: str) -> None:
        await self._run("remove_user", {user}, domain, alias)


class AliasesByUser(Table):
    """`aliases_by_user`: which aliases list a user."""

    STATEMENTS = {
        "add": (WRITE, "INSERT INTO aliases_by_user (user, alias) VALUES (?, ?)"),
        "delete": (WRITE, "DELETE FROM aliases_by_user WHERE user = ? AND alias = ?"),
        "aliases": (READ, "SELECT alias FROM aliases_by_user WHERE user = ?"),
        "purge": (WRITE, "DELETE FROM aliases_by_user WHERE user = ?"),
    }

    async def add(self, user: str, alias: str) -> None:
        await self._run("add", user, alias)

    async def delete(self, user: str, alias: str) -> None:
        await self._run("delete", user, alias)

    async def aliases(self, user: str) -> list[str]:
        return [row.alias for row in await self._run("aliases", user)]

    def purge_statement(self, user: str) -> BoundStatement:
        return self.bind("purge", user)


# ===================================================================== mail


class Messages(Table):
    """`messages`: a partition per mailbox, a small row per message clustered by its timeuuid id;
    the UID counter, the \\Recent mark and the changes token are static columns, read and
    written through the anchor row (ANCHOR)."""

    _SUMMARY = "id, size, flags, toUnixTimestamp(internal_date) AS internal_ms, uid, modseq"
    #: What a change decides on (read at SERIAL): the rows and the counters and trim state.
    _COUNTS = ("count_messages, count_unseen, count_size, count_deleted, count_deleted_size, count_unnumbered, "
               "count_uid_max")
    _STATE = ("id, uid, size, flags, modseq, body_id, chunk_size, shared, "
              "uidnext, highest_modseq, vanished_floor, vanished_mark, vanished_mark_at, "
              f"{_COUNTS}, counted_through, counts_modseq, plain_at, counts_plain")
    #: What STATUS reads of the statics (the counters, the counts and their validity).
    _STATICS = (f"uidnext, highest_modseq, recent_mark, {_COUNTS}, counted_through, counts_modseq, plain_at, "
                "counts_plain")
    _BODY = "id, body_id, size, chunk_size, shared"
    _BODY_COUNTERS = f"{_BODY}, flags, uidnext, highest_modseq"
    STATEMENTS = {
        "insert": (
            WRITE,
            "INSERT INTO messages (mailbox_id, id, size, flags, internal_date, body_id, chunk_size, shared, changed) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ),
        "page": (READ, f"SELECT {_SUMMARY}, uuidAsBlob(body_id) AS body_key, chunk_size FROM messages "
                          "WHERE mailbox_id = ? AND id > ? LIMIT ?"),
        # (the changes token and HIGHESTMODSEQ are static: on every row, the anchor's too; the
        # token as its bytes, which the driver does not make a UUID of on every row)
        "arrivals": (READ, f"SELECT {_SUMMARY}, uuidAsBlob(body_id) AS body_key, chunk_size, "
                           "uuidAsBlob(changed) AS changed_key, highest_modseq "
                           "FROM messages WHERE mailbox_id = ? AND id > ? LIMIT ?"),
        "anchor": (
            SERIAL_READ,
            "SELECT uidnext, recent_mark, uid, highest_modseq, vanished_floor FROM messages WHERE mailbox_id = ? AND id = ?",
        ),
        "first_live": (READ, "SELECT id, size FROM messages WHERE mailbox_id = ? AND id > ? LIMIT 16"),
        "body_info": (READ, "SELECT body_id, size, chunk_size FROM messages WHERE mailbox_id = ? AND id = ?"),
        "body_infos": (READ, f"SELECT {_BODY_COUNTERS} FROM messages WHERE mailbox_id = ? AND id IN ?"),
        "share": (CONDITIONAL, "UPDATE messages SET shared = true WHERE mailbox_id = ? AND id = ?"),
        "delete": (WRITE, "DELETE FROM messages WHERE mailbox_id = ? AND id IN ?"),
        "changed": (WRITE, "UPDATE messages SET changed = ? WHERE mailbox_id = ?"),
        "flags_set": (WRITE, "UPDATE messages SET flags = ?, changed = ? WHERE mailbox_id = ? AND id = ?"),
        "flags_add": (WRITE, "UPDATE messages SET flags = flags + ?, changed = ? WHERE mailbox_id = ? AND id = ?"),
        "flags_remove": (WRITE, "UPDATE messages SET flags = flags - ?, changed = ? WHERE mailbox_id = ? AND id = ?"),
        "walk": (READ, f"SELECT {_BODY} FROM messages WHERE mailbox_id = ? AND id > ? LIMIT ?"),
        "summaries": (READ, f"SELECT {_SUMMARY} FROM messages WHERE mailbox_id = ? AND id IN ?"),
        "purge": (WRITE, "DELETE FROM messages WHERE mailbox_id = ?"),
        "changes_token": (READ, "SELECT uuidAsBlob(changed) AS changed_key, uid, highest_modseq FROM messages "
                                "WHERE mailbox_id = ? AND id = ?"),
        "state": (SERIAL_READ, f"SELECT {_STATE} FROM messages WHERE mailbox_id = ? AND id IN ?"),
        "state_slice": (
            SERIAL_READ, f"SELECT {_STATE} FROM messages WHERE mailbox_id = ? AND id >= ? AND id < ? LIMIT ?",
        ),
        "advance": (
            CONDITIONAL,
            "UPDATE messages SET uidnext = ?, highest_modseq = ? WHERE mailbox_id = ? "
            "IF uidnext = ? AND highest_modseq = ? AND counted_through = ? AND plain_at = ?",
        ),
        "set_uid": (CONDITIONAL, "UPDATE messages SET uid = ?, modseq = ? WHERE mailbox_id = ? AND id = ?"),
        # (a message that is there has a size, and no size is negative)
        "set_first_uid": (
            CONDITIONAL,
            "UPDATE messages SET uid = ?, modseq = ? WHERE mailbox_id = ? AND id = ? IF uid = null AND size >= 0",
        ),
        "set_flags": (CONDITIONAL, "UPDATE messages SET flags = ?, modseq = ? WHERE mailbox_id = ? AND id = ?"),
        "set_flags_unnumbered": (CONDITIONAL, "UPDATE messages SET flags = ? WHERE mailbox_id = ? AND id = ?"),
        "expunge": (CONDITIONAL, "DELETE FROM messages WHERE mailbox_id = ? AND id = ?"),
        "record": (CONDITIONAL, "INSERT INTO messages (mailbox_id, id, uid, changed_id) VALUES (?, ?, ?, ?)"),
        "record_run": (
            CONDITIONAL, "INSERT INTO messages (mailbox_id, id, uid, changed_id, changed_last) VALUES (?, ?, ?, ?, ?)",
        ),
        "run": (READ, f"SELECT {_SUMMARY} FROM messages WHERE mailbox_id = ? AND id >= ? AND id <= ?"),
        "unrecord": (CONDITIONAL, "DELETE FROM messages WHERE mailbox_id = ? AND id = ?"),
        "trim": (
            CONDITIONAL,
            "UPDATE messages SET vanished_floor = ?, vanished_mark = ?, vanished_mark_at = ? WHERE mailbox_id = ?",
        ),
        "records": (
            SERIAL_READ,
            "SELECT uid, changed_id, changed_last, highest_modseq, vanished_floor FROM messages "
            "WHERE mailbox_id = ? AND id > ? AND id < ?",
        ),
        "forget_records": (WRITE, "DELETE FROM messages WHERE mailbox_id = ? AND id > ? AND id < ?"),
        "touch_anchor": (CONDITIONAL, "UPDATE messages SET uid = 0, changed = ? WHERE mailbox_id = ? AND id = ?"),
        # STATUS counts (schema 011)
        "statics": (
            READ,
            f"SELECT {_STATICS} FROM messages WHERE mailbox_id = ? LIMIT 1",
        ),
        # (the statics on every row; the rows, those above a bound, as `page` has them for STATUS)
        "statics_after": (
            READ,
            f"SELECT {_STATICS}, id, size, flags, uid, uuidAsBlob(changed) AS changed_key FROM messages "
            "WHERE mailbox_id = ? AND id > ? LIMIT ?",
        ),
        "counts": (
            CONDITIONAL,
            "UPDATE messages SET count_messages = ?, count_unseen = ?, count_size = ?, count_deleted = ?, "
            "count_deleted_size = ?, count_unnumbered = ?, count_uid_max = ?, counts_modseq = ? WHERE mailbox_id = ?",
        ),
        "store_counts": (
            CONDITIONAL,
            "UPDATE messages SET count_messages = ?, count_unseen = ?, count_size = ?, count_deleted = ?, "
            "count_deleted_size = ?, count_unnumbered = ?, count_uid_max = ?, counts_modseq = ?, counted_through = ?, "
            "counts_plain = ? WHERE mailbox_id = ? IF highest_modseq = ? AND plain_at = ? AND counted_through = ?",
        ),
        "plain_at": (WRITE, "UPDATE messages SET plain_at = ? WHERE mailbox_id = ?"),
        "raise_recent": (CONDITIONAL, "UPDATE messages SET recent_mark = ? WHERE mailbox_id = ? IF recent_mark = ?"),
        "raise_recent_first": (
            CONDITIONAL,
            "UPDATE messages SET recent_mark = ? WHERE mailbox_id = ? IF recent_mark = null",
        ),
    }

    def insert_statement(
        self, mailbox_id: uuid.UUID, message_id: uuid.UUID, size: int, flags: set[str] | None,
        internal_date: datetime, body_id: uuid.UUID, chunk_size: int, shared: bool, changed: uuid.UUID,
    ) -> BoundStatement:
        return self.bind("insert", mailbox_id, message_id, size, flags, internal_date, body_id, chunk_size, shared,
                         changed)

    async def insert(
        self, mailbox_id: uuid.UUID, message_id: uuid.UUID, size: int, flags: set[str] | None,
        internal_date: datetime, body_id: uuid.UUID, chunk_size: int, shared: bool, changed: uuid.UUID,
    ) -> None:
        await self.cql.run(self.insert_statement(mailbox_id, message_id, size, flags, internal_date, body_id,
                                                 chunk_size, shared, changed))

    async def page(self, mailbox_id: uuid.UUID, after: uuid.UUID | None, limit: int) -> list[Any]:
        """Summary rows after `after` (from the first real message id when None), with where
        their bodies are: body_key (body_id's 16 bytes, left undecoded: most are never read)
        and chunk_size."""
        return await self._run("page", mailbox_id, after or FIRST_REAL, limit)

    async def arrivals(self, mailbox_id: uuid.UUID, after: uuid.UUID, limit: int) -> list[Any]:
        """`page` with the changes token and HIGHESTMODSEQ on each row (static columns): the rows
        after `after` up to the anchor, which is the last row of every partition."""
        return await self._run("arrivals", mailbox_id, after, limit)

    async def anchor(self, mailbox_id: uuid.UUID) -> Any:
        """The anchor row (uidnext, recent_mark) at SERIAL; None before it was first written."""
        return _first(await self._run("anchor", mailbox_id, ANCHOR))

    async def first_live(self, mailbox_id: uuid.UUID, after: uuid.UUID | None) -> list[Any]:
        """Up to 16 rows (id, size) after `after` (from the first real message id when None)."""
        return await self._run("first_live", mailbox_id, after or FIRST_REAL)

    async def body_info(self, mailbox_id: uuid.UUID, message_id: uuid.UUID) -> Any:
        """(body_id, size, chunk_size) of a message; None when there is no row."""
        return _first(await self._run("body_info", mailbox_id, message_id))

    async def body_infos(self, mailbox_id: uuid.UUID, ids: Sequence[uuid.UUID]) -> list[Any]:
        """Body rows of these ids and their flags, with the counters (static: null before the
        first numbering)."""
        return await self._run("body_infos", mailbox_id, ids)

    def delete_statement(self, mailbox_id: uuid.UUID, ids: Sequence[uuid.UUID]) -> BoundStatement:
        """A plain deletion (a mailbox never numbered: see CassandraStore.delete_messages)."""
        return self.bind("delete", mailbox_id, ids)

    def changed_statement(self, mailbox_id: uuid.UUID, changed: uuid.UUID) -> BoundStatement:
        return self.bind("changed", changed, mailbox_id)

    def plain_flags_statement(
        self, mode: str, mailbox_id: uuid.UUID, message_id: uuid.UUID, flags: set[str] | None, changed: uuid.UUID
    ) -> BoundStatement:
        """A flag change merged by Cassandra, without a MODSEQ (see CassandraStore.store_flags)."""
        return self.bind(f"flags_{mode}", flags, changed, mailbox_id, message_id)

    async def walk(self, mailbox_id: uuid.UUID, after: uuid.UUID | None, limit: int) -> list[Any]:
        """Body rows after `after` (from the first real message id when None)."""
        return await self._run("walk", mailbox_id, after or FIRST_REAL, limit)

    async def summaries(self, mailbox_id: uuid.UUID, ids: Sequence[uuid.UUID]) -> list[Any]:
        return await self._run("summaries", mailbox_id, ids)

    async def purge(self, mailbox_id: uuid.UUID) -> None:
        """The whole partition, with one tombstone."""
        await self._run("purge", mailbox_id)

    async def changes_token(self, mailbox_id: uuid.UUID) -> Any:
        """The anchor row's (changed_key: the token's 16 bytes, uid, highest_modseq) at the read
        level; None before it was first written."""
        return _first(await self._run("changes_token", mailbox_id, ANCHOR))

    async def state(self, mailbox_id: uuid.UUID, ids: Sequence[uuid.UUID], serial: bool = True) -> list[Any]:
        """The rows of these ids with the counters and trim state (static columns, on every row),
        at SERIAL (or at the read level): what a conditional batch decides on. No rows when none
        of the ids is there."""
        return await self.cql.run(self._at(self.bind("state", mailbox_id, ids), serial))

    async def state_slice(self, mailbox_id: uuid.UUID, first: int, last: int, limit: int,
                          serial: bool = True) -> list[Any]:
        """As `state`, for the rows whose ids' times (100 ns ticks) are `first` to `last`, at most
        `limit`: from the smallest timeuuid of `first` in Cassandra's order (which takes the
        bytes after the time as signed) to the smallest of the tick after `last`."""
        low, high = _timeuuid(first, 0x8080, 0x808080808080), _timeuuid(last + 1, 0x8080, 0x808080808080)
        return await self.cql.run(self._at(self.bind("state_slice", mailbox_id, low, high, limit), serial))

    def _at(self, statement: BoundStatement, serial: bool) -> BoundStatement:
        if not serial:
            statement.consistency_level = self.cql.read_cl
        return statement

    def advance_statement(
        self, mailbox_id: uuid.UUID, uidnext: int | None, modseq: int | None,
        was: tuple[int | None, int | None], read: Any,
    ) -> BoundStatement:
        """Set both counters, if both are still `was` (uidnext, highest_modseq; None: not set) and
        the bound of the STATUS counts (counted_through) and `plain_at` are still those of the
        statics `read`: the batch writes counts made on that bound, and a STATUS may move it
        without a MODSEQ (CassandraCounts._keep_counts); a plain change (`plain_at`) changed rows
        the batch was decided on without a MODSEQ."""
        return self.bind("advance", uidnext, modseq, mailbox_id, *was, read.counted_through, read.plain_at)

    def set_uid_statement(self, mailbox_id: uuid.UUID, message_id: uuid.UUID, uid: int, modseq: int) -> BoundStatement:
        return self.bind("set_uid", uid, modseq, mailbox_id, message_id)

    def set_first_uid_statement(self, mailbox_id: uuid.UUID, message_id: uuid.UUID, uid: int, modseq: int
                                ) -> BoundStatement:
        """`set_uid` on the condition that the message is there and has no UID yet."""
        return self.bind("set_first_uid", uid, modseq, mailbox_id, message_id)

    def add_first_uids(
        self, batch: BatchStatement, mailbox_id: uuid.UUID, ids: Sequence[uuid.UUID], first: int, modseq: int,
        checked: bool = True,
    ) -> None:
        """Into a conditional batch: UIDs from `first` on for `ids` (in the partition's order), at
        MODSEQ `modseq`, and one MODSEQ record of the run (schema 015; `run`); `checked`: each on
        the condition that its message is there and has no UID yet (so the batch applies only if
        all are). The values are serialized here (the columns are bigints and timeuuids), not
        bound one statement at a time: a first SELECT of mail never numbered makes one statement
        per message, and `PreparedStatement.bind` took four fifths of the time of making them."""
        set_uid = self.prepared["set_first_uid" if checked else "set_uid"]
        mailbox, stamp = mailbox_id.bytes, _BIGINT.pack(_checked_modseq(modseq))
        for uid, message_id in enumerate(ids, first):
            add_serialized(batch, set_uid, [_BIGINT.pack(uid), stamp, mailbox, message_id.bytes])
        batch.add(self.bind("record_run", mailbox_id, record_id(modseq, 0), first, ids[0], ids[-1]))

    async def run(self, mailbox_id: uuid.UUID, first: uuid.UUID, last: uuid.UUID) -> list[Any]:
        """Summary rows from `first` to `last`, both included: a run record's messages, and any
        other message between them."""
        return await self._run("run", mailbox_id, first, last)

    def set_flags_statement(
        self, mailbox_id: uuid.UUID, message_id: uuid.UUID, flags: set[str] | None, modseq: int | None
    ) -> BoundStatement:
        if modseq is None:
            return self.bind("set_flags_unnumbered", flags, mailbox_id, message_id)
        return self.bind("set_flags", flags, modseq, mailbox_id, message_id)

    def expunge_statement(self, mailbox_id: uuid.UUID, message_id: uuid.UUID) -> BoundStatement:
        return self.bind("expunge", mailbox_id, message_id)

    def record_statements(
        self, mailbox_id: uuid.UUID, uid: int, modseq: int, message_id: uuid.UUID | None,
        old_uid: int | None = None, old_modseq: int | None = None,
    ) -> list[BoundStatement]:
        """The MODSEQ record of a change: message `message_id` now has UID `uid` and MODSEQ
        `modseq` (None: UID `uid` was expunged at `modseq`); its record of its last change
        (`old_uid` at `old_modseq`, if any: none for mail numbered before schema 008) goes."""
        statements = [self.bind("record", mailbox_id, record_id(modseq, uid), uid, message_id)]
        if old_uid and old_modseq and old_modseq > 1:
            statements.append(self.bind("unrecord", mailbox_id, record_id(old_modseq, old_uid)))
        return statements

    def trim_statement(self, mailbox_id: uuid.UUID, floor: int | None, mark: int, at: datetime) -> BoundStatement:
        return self.bind("trim", floor, mark, at, mailbox_id)

    async def records(self, mailbox_id: uuid.UUID, above: int) -> list[Any]:
        """The MODSEQ records (uid, changed_id: None for an expunge) above `above`, at SERIAL;
        each row also carries the mailbox's highest_modseq and vanished_floor (static columns)."""
        return await self._run("records", mailbox_id, _after_modseq(above), FIRST_REAL)

    async def forget_records(self, mailbox_id: uuid.UUID, upto: int) -> None:
        """Drop the MODSEQ records at or below `upto` (one range tombstone)."""
        await self._run("forget_records", mailbox_id, _after_modseq(0), _after_modseq(upto))

    def touch_anchor_statement(self, mailbox_id: uuid.UUID, changed: uuid.UUID) -> BoundStatement:
        return self.bind("touch_anchor", changed, mailbox_id, ANCHOR)

    async def statics(self, mailbox_id: uuid.UUID) -> Any:
        """The partition's static columns that STATUS needs (counters, counts, their validity);
        None when the partition holds nothing."""
        return _first(await self._run("statics", mailbox_id))

    async def statics_after(self, mailbox_id: uuid.UUID, after: uuid.UUID, limit: int) -> list[Any]:
        """`statics` with the rows after `after` (id, size, flags, uid, changed_key; up to
        `limit`): STATUS's tail above the bound of the counts in the same request. The anchor row,
        which every change writes, is among them when they are fewer than `limit` (the largest
        id), and its `changed` is the changes token."""
        return await self._run("statics_after", mailbox_id, after, limit)

    def counts_statement(self, mailbox_id: uuid.UUID, counts: Sequence[int], modseq: int) -> BoundStatement:
        """The counts (in `_COUNTS` order) true at `modseq`, for a change's conditional batch."""
        return self.bind("counts", *counts, modseq, mailbox_id)

    def store_counts_statement(
        self, mailbox_id: uuid.UUID, counts: Sequence[int], through: uuid.UUID, read: Any
    ) -> BoundStatement:
        """Counts made from a read of the mailbox whose statics were `read`, kept only if no change
        (conditional or plain) and no other count was made since."""
        return self.bind("store_counts", *counts, read.highest_modseq or 1, through, read.plain_at, mailbox_id,
                         read.highest_modseq, read.plain_at, read.counted_through)

    def plain_at_statement(self, mailbox_id: uuid.UUID, at: uuid.UUID) -> BoundStatement:
        return self.bind("plain_at", at, mailbox_id)

    async def page_everywhere(self, mailbox_id: uuid.UUID, after: uuid.UUID, limit: int) -> list[Any]:
        """`page` read at ALL: a row written at any write level is seen if any replica has it."""
        statement = self.bind("page", mailbox_id, after, limit)
        statement.consistency_level = ConsistencyLevel.ALL
        return await self.cql.run(statement)

    def share_statement(self, mailbox_id: uuid.UUID, message_id: uuid.UUID) -> BoundStatement:
        return self.bind("share", mailbox_id, message_id)

    def raise_recent_statement(self, mailbox_id: uuid.UUID, new: int, expected: int | None) -> BoundStatement:
        if expected is None:
            return self.bind("raise_recent_first", new, mailbox_id)
        return self.bind("raise_recent", new, mailbox_id, expected)


class Bodies(Table):
    """`bodies`: the copies still referring to a body delivered to several mailboxes, or
    copied (IMAP COPY, MOVE) to another."""

    STATEMENTS = {
        "insert": (WRITE, "INSERT INTO bodies (body_id, size, chunk_size, refs) VALUES (?, ?, ?, ?)"),
        # (added to, never overwritten: two copies of one body made at once each keep theirs)
        "refer": (WRITE, "UPDATE bodies SET size = ?, chunk_size = ?, refs = refs + ? WHERE body_id = ?"),
        "refer_if_there": (CONDITIONAL, "UPDATE bodies SET refs = refs + ? WHERE body_id = ? IF size = ?"),
        "release": (WRITE, "UPDATE bodies SET refs = refs - ? WHERE body_id = ?"),
        "refs": (READ, "SELECT size, refs FROM bodies WHERE body_id = ?"),
        "delete_unreferenced": (CONDITIONAL, "DELETE FROM bodies WHERE body_id = ? IF size = ? AND refs = null"),
    }

    async def insert(self, body_id: uuid.UUID, size: int, chunk_size: int, refs: set[str]) -> None:
        await self._run("insert", body_id, size, chunk_size, refs)

    async def refer(self, body_id: uuid.UUID, size: int, chunk_size: int, refs: set[str]) -> None:
        await self._run("refer", size, chunk_size, refs, body_id)

    async def refer_if_there(self, body_id: uuid.UUID, size: int, refs: set[str]) -> bool:
        """Add references to a body whose row is there (a Paxos round); False when it is not."""
        applied, _ = await self._conditional("refer_if_there", refs, body_id, size)
        return applied

    async def release(self, body_id: uuid.UUID, refs: set[str]) -> None:
        await self._run("release", refs, body_id)

    async def refs(self, body_id: uuid.UUID) -> Any:
        """The row (size, refs); None when there is none (or it is not visible yet)."""
        return _first(await self._run("refs", body_id))

    async def delete_unreferenced(self, body_id: uuid.UUID, size: int) -> bool:
        """Delete the row if it is there and refers to nothing (a Paxos round): True when this
        call did, and so owns the deletion of the chunks."""
        applied, _ = await self._conditional("delete_unreferenced", body_id, size)
        return applied


class BodyChunks(Table):
    """`body_chunks`: a partition per chunk of a body (mail and queued mail)."""

    STATEMENTS = {
        "insert": (WRITE, "INSERT INTO body_chunks (body_id, idx, data) VALUES (?, ?, ?)"),
        "get": (READ, "SELECT data FROM body_chunks WHERE body_id = ? AND idx = ?"),
        "get_many": (READ, "SELECT idx, data FROM body_chunks WHERE body_id = ? AND idx IN ?"),
        "firsts": (READ, "SELECT body_id, data FROM body_chunks WHERE body_id IN ? AND idx = 0"),
        "delete": (WRITE, "DELETE FROM body_chunks WHERE body_id = ? AND idx = ?"),
    }

    async def insert(self, body_id: uuid.UUID, idx: int, data: bytes) -> None:
        await self._run("insert", body_id, idx, data)

    async def get(self, body_id: uuid.UUID, idx: int, every_replica: bool = False) -> bytes | None:
        """A chunk, None when it is not there; `every_replica` reads at ALL."""
        statement = self.bind("get", body_id, idx)
        if every_replica:
            statement.consistency_level = ConsistencyLevel.ALL
        row = _first(await self.cql.run(statement))
        return row.data if row is not None else None

    async def get_many(self, body_id: uuid.UUID, idxs: Sequence[int]) -> dict[int, bytes]:
        """Chunks of a body by their index, in one request; those not there are left out."""
        return {r.idx: r.data for r in await self._run("get_many", body_id, list(idxs))}

    async def firsts(self, body_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, bytes]:
        """The first chunk of each body, in one request; those not there are left out."""
        return {r.body_id: r.data for r in await self._run("firsts", list(body_ids))}

    async def delete(self, body_id: uuid.UUID, idx: int) -> None:
        await self._run("delete", body_id, idx)

    def delete_statement(self, body_id: uuid.UUID, idx: int) -> BoundStatement:
        return self.bind("delete", body_id, idx)


# ===================================================================== outbound (schema/006_outbound.cql)

_ENTRY_COLUMNS = (
    "id, rcpt, sender, created, due, attempts, held, warned, lease_owner, lease_until, last_error, size, "
    "body_id, chunk_size, smtputf8, state, reply, remote"
)


class Queue(Table):
    """`queue`: a partition per queued message, envelope and lease static, a row per recipient."""

    STATEMENTS = {
        "insert_entry": (
            WRITE,
            "INSERT INTO queue (id, sender, created, due, attempts, held, warned, lease_owner, lease_until, "
            "last_error, size, body, body_id, chunk_size, smtputf8) "
            "VALUES (?, ?, ?, ?, 0, false, false, ?, ?, '', ?, ?, ?, ?, ?)",
        ),
        "insert_recipient": (
            WRITE, "INSERT INTO queue (id, rcpt, state, reply, remote) VALUES (?, ?, 'pending', '', '')"
        ),
        "entry": (READ, f"SELECT {_ENTRY_COLUMNS} FROM queue WHERE id = ?"),
        "entry_serial": (SERIAL_READ, f"SELECT {_ENTRY_COLUMNS} FROM queue WHERE id = ?"),
        "all": (READ, f"SELECT {_ENTRY_COLUMNS} FROM queue"),
        "body": (READ, "SELECT body FROM queue WHERE id = ? LIMIT 1"),
        "take": (
            CONDITIONAL,
            "UPDATE queue SET lease_owner = ?, lease_until = ? WHERE id = ? "
            "IF lease_until < ? AND held = false AND due <= ?",
        ),
        "renew": (CONDITIONAL, "UPDATE queue SET lease_until = ? WHERE id = ? IF lease_owner = ?"),
        "result": (
            CONDITIONAL,
            "UPDATE queue SET state = ?, reply = ?, remote = ?, updated = ? WHERE id = ? AND rcpt = ? IF lease_owner = ?",
        ),
        "release": (
            CONDITIONAL,
            "UPDATE queue SET due = ?, attempts = ?, last_error = ?, warned = ?, lease_owner = '', lease_until = ? "
            "WHERE id = ? IF lease_owner = ?",
        ),
        "retry": (CONDITIONAL, "UPDATE queue SET due = ? WHERE id = ? IF held = false"),
        "hold": (CONDITIONAL, "UPDATE queue SET held = true WHERE id = ? IF EXISTS"),
        "unhold": (CONDITIONAL, "UPDATE queue SET held = false, due = ? WHERE id = ? IF EXISTS"),
        "delete": (WRITE, "DELETE FROM queue WHERE id = ?"),
    }

    def entry_statement(
        self, entry_id: uuid.UUID, sender: str, created: datetime, due: datetime, lease_owner: str,
        lease_until: datetime, size: int, body: bytes | None, body_id: uuid.UUID | None, chunk_size: int,
        smtputf8: bool,
    ) -> BoundStatement:
        """The envelope and lease (static columns)."""
        return self.bind("insert_entry", entry_id, sender, created, due, lease_owner, lease_until, size, body,
                         body_id, chunk_size, smtputf8)

    def recipient_statement(self, entry_id: uuid.UUID, rcpt: str) -> BoundStatement:
        return self.bind("insert_recipient", entry_id, rcpt)

    async def entry(self, entry_id: uuid.UUID, serial: bool = False) -> list[Any]:
        """The rows of an entry's partition (the statics repeat on each)."""
        return await self._run("entry_serial" if serial else "entry", entry_id)

    async def all(self) -> list[Any]:
        return await self._run("all")

    async def body(self, entry_id: uuid.UUID) -> bytes | None:
        """A body kept in the entry; None when there is none (or it is not visible yet)."""
        row = _first(await self._run("body", entry_id))
        return row.body if row is not None else None

    async def take(self, entry_id: uuid.UUID, owner: str, until: datetime, now: datetime) -> tuple[bool, Any]:
        """The lease, if it is free, the entry not held and due: (applied, the current row)."""
        return await self._conditional("take", owner, until, entry_id, now, now)

    async def renew(self, entry_id: uuid.UUID, owner: str, until: datetime) -> bool:
        applied, _ = await self._conditional("renew", until, entry_id, owner)
        return applied

    def result_statement(
        self, entry_id: uuid.UUID, owner: str, result: QueuedRecipient, stamp: datetime
    ) -> BoundStatement:
        return self.bind("result", result.state, result.reply, result.remote, stamp, entry_id, result.address, owner)

    def release_statement(
        self, entry_id: uuid.UUID, owner: str, due: datetime, attempts: int, error: str, warned: bool,
        lease_until: datetime,
    ) -> BoundStatement:
        return self.bind("release", due, attempts, error, warned, lease_until, entry_id, owner)

    async def retry(self, entry_id: uuid.UUID, due: datetime) -> bool:
        applied, _ = await self._conditional("retry", due, entry_id)
        return applied

    async def hold(self, entry_id: uuid.UUID) -> bool:
        applied, _ = await self._conditional("hold", entry_id)
        return applied

    async def unhold(self, entry_id: uuid.UUID, due: datetime) -> bool:
        applied, _ = await self._conditional("unhold", due, entry_id)
        return applied

    def delete_statement(self, entry_id: uuid.UUID) -> BoundStatement:
        return self.bind("delete", entry_id)

    async def delete(self, entry_id: uuid.UUID) -> None:
        await self.cql.run(self.delete_statement(entry_id))


class QueueDue(Table):
    """`queue_due`: what is due when, a partition per (shard, minute)."""

    STATEMENTS = {
        "insert": (WRITE, "INSERT INTO queue_due (shard, bucket, due, id) VALUES (?, ?, ?, ?)"),
        "delete": (WRITE, "DELETE FROM queue_due WHERE shard = ? AND bucket = ? AND due = ? AND id = ?"),
        "page": (
            READ,
            "SELECT due, id FROM queue_due WHERE shard = ? AND bucket = ? AND due >= ? AND due <= ? LIMIT ?",
        ),
        "pages": (
            READ,
            "SELECT shard, bucket, due, id FROM queue_due WHERE shard IN ? AND bucket IN ? AND due >= ? AND due <= ? "
            "PER PARTITION LIMIT ?",
        ),
    }

    async def insert(self, shard: int, bucket: int, due: datetime, entry_id: uuid.UUID) -> None:
        await self._run("insert", shard, bucket, due, entry_id)

    def delete_statement(self, shard: int, bucket: int, due: datetime, entry_id: uuid.UUID) -> BoundStatement:
        return self.bind("delete", shard, bucket, due, entry_id)

    async def delete(self, shard: int, bucket: int, due: datetime, entry_id: uuid.UUID) -> None:
        await self.cql.run(self.delete_statement(shard, bucket, due, entry_id))

    async def page(self, shard: int, bucket: int, start: datetime, end: datetime, limit: int) -> list[Any]:
        """Rows (due, id) of one partition due from `start` to `end`."""
        return await self._run("page", shard, bucket, start, end, limit)

    async def pages(self, shards: Sequence[int], buckets: Sequence[int], start: datetime, end: datetime,
                    limit: int) -> dict[tuple[int, int], list[Any]]:
        """`page` of every (shard, bucket) named, in one request: rows (due, id) by partition."""
        found: dict[tuple[int, int], list[Any]] = {}
        for row in await self._run("pages", list(shards), list(buckets), start, end, limit):
            found.setdefault((row.shard, row.bucket), []).append(row)
        return found


class QueueShards(Table):
    """`queue_shards`: each shard's durable low mark (the first minute that may hold a due row)."""

    STATEMENTS = {
        "all": (READ, "SELECT shard, low_bucket FROM queue_shards"),
        "init": (CONDITIONAL, "INSERT INTO queue_shards (shard, low_bucket) VALUES (?, ?) IF NOT EXISTS"),
        "set": (WRITE, "UPDATE queue_shards SET low_bucket = ? WHERE shard = ?"),
    }

    async def all(self) -> dict[int, int | None]:
        return {r.shard: r.low_bucket for r in await self._run("all")}

    async def init(self, shard: int, bucket: int) -> tuple[bool, Any]:
        """(applied, the row there before when not)."""
        return await self._conditional("init", shard, bucket)

    async def set(self, shard: int, bucket: int) -> None:
        await self._run("set", bucket, shard)


class DkimKeys(Table):
    """`dkim_keys`: a domain's signing key."""

    STATEMENTS = {
        "set": (WRITE, "INSERT INTO dkim_keys (domain, selector, private_key, created) VALUES (?, ?, ?, ?)"),
        "get": (READ, "SELECT domain, selector, private_key FROM dkim_keys WHERE domain = ?"),
        "delete": (WRITE, "DELETE FROM dkim_keys WHERE domain = ?"),
        "all": (READ, "SELECT domain, selector, private_key FROM dkim_keys"),
    }

    async def set(self, domain: str, selector: str, private_key: str, created: datetime) -> None:
        await self._run("set", domain, selector, private_key, created)

    async def get(self, domain: str) -> Any:
        """The row (domain, selector, private_key); None when there is none."""
        return _first(await self._run("get", domain))

    async def delete(self, domain: str) -> None:
        await self._run("delete", domain)

    async def all(self) -> list[Any]:
        return await self._run("all")


# ===================================================================== Sieve (schema/007_sieve.cql)


class SieveScripts(Table):
    """`sieve_scripts`: a partition per user, a row per script; the active one's name is static."""

    STATEMENTS = {
        "put": (WRITE, "INSERT INTO sieve_scripts (user, name, content) VALUES (?, ?, ?)"),
        "get": (READ, "SELECT content FROM sieve_scripts WHERE user = ? AND name = ?"),
        "list": (READ, "SELECT name, active FROM sieve_scripts WHERE user = ?"),
        "active": (READ, "SELECT active FROM sieve_scripts WHERE user = ? LIMIT 1"),
        "set_active": (WRITE, "UPDATE sieve_scripts SET active = ? WHERE user = ?"),
        "delete": (WRITE, "DELETE FROM sieve_scripts WHERE user = ? AND name = ?"),
        "insert_new": (CONDITIONAL, "INSERT INTO sieve_scripts (user, name, content) VALUES (?, ?, ?) IF NOT EXISTS"),
        "delete_in_batch": (CONDITIONAL, "DELETE FROM sieve_scripts WHERE user = ? AND name = ?"),
        "set_active_in_batch": (CONDITIONAL, "UPDATE sieve_scripts SET active = ? WHERE user = ?"),
        "purge": (WRITE, "DELETE FROM sieve_scripts WHERE user = ?"),
    }

    async def put(self, user: str, name: str, content: str) -> None:
        await self._run("put", user, name, content)

    async def get(self, user: str, name: str) -> Any:
        """The script's row (content); None when there is none."""
        return _first(await self._run("get", user, name))

    async def list(self, user: str) -> list[Any]:
        """Rows (name, active)."""
        return await self._run("list", user)

    async def active(self, user: str) -> str | None:
        row = _first(await self._run("active", user))
        return row.active if row is not None else None

    async def set_active(self, user: str, name: str | None) -> None:
        await self._run("set_active", name, user)

    async def delete(self, user: str, name: str) -> None:
        await self._run("delete", user, name)

    def insert_new_statement(self, user: str, name: str, content: str) -> BoundStatement:
        return self.bind("insert_new", user, name, content)

    def delete_statement(self, user: str, name: str) -> BoundStatement:
        """For a conditional batch."""
        return self.bind("delete_in_batch", user, name)

    def set_active_statement(self, user: str, name: str | None) -> BoundStatement:
        """For a conditional batch."""
        return self.bind("set_active_in_batch", name, user)

    def purge_statement(self, user: str) -> BoundStatement:
        return self.bind("purge", user)


class SieveVacation(Table):
    """`sieve_vacation`: who has had a vacation reply, each record with its time to live."""

    STATEMENTS = {
        "note": (CONDITIONAL, "INSERT INTO sieve_vacation (user, key) VALUES (?, ?) IF NOT EXISTS USING TTL ?"),
        "purge": (WRITE, "DELETE FROM sieve_vacation WHERE user = ?"),
    }

    async def note(self, user: str, key: str, ttl: int) -> bool:
        applied, _ = await self._conditional("note", user, key, ttl)
        return applied

    def purge_statement(self, user: str) -> BoundStatement:
        return self.bind("purge", user)


# ===================================================================== change events (schema/009_events.cql)


class MailboxEvents(Table):
    """`mailbox_events`: a partition per second, a row per change of a mailbox's messages."""

    STATEMENTS = {
        "insert": (WRITE, "INSERT INTO mailbox_events (second, at, mailbox_id) VALUES (?, ?, ?)"),
        "since": (READ, "SELECT at, mailbox_id FROM mailbox_events WHERE second IN ? AND at > ?"),
    }

    def insert_statement(self, second: int, at: uuid.UUID, mailbox_id: uuid.UUID) -> BoundStatement:
        return self.bind("insert", second, at, mailbox_id)

    async def since(self, seconds: Sequence[int], after: uuid.UUID) -> list[Any]:
        """(at, mailbox_id) of the events of these seconds after `after`: one request for the few
        partitions a poll reads."""
        return await self._run("since", list(seconds), after)


class QuotaUsage(Table):
    """`quota_usage`: bytes and messages of each user with a storage limit, as counters (schema
    010). An update is never retried (not idempotent): see cassandra_quota.py for the drift."""

    STATEMENTS = {
        "get": (READ, "SELECT bytes, messages FROM quota_usage WHERE user = ?"),
        "add": (WRITE, "UPDATE quota_usage SET bytes = bytes + ?, messages = messages + ? WHERE user = ?"),
    }

    async def get(self, user: str) -> tuple[int, int]:
        """(bytes, messages); (0, 0) for a user never counted."""
        row = _first(await self._run("get", user))
        return (row.bytes or 0, row.messages or 0) if row is not None else (0, 0)

    async def add(self, user: str, size: int, messages: int) -> None:
        await self._run("add", size, messages, user)


# ===================================================================== view snapshots (schema/014_view_snapshots.cql)


class ViewSnapshots(Table):
    """`view_snapshots`: a partition per mailbox, a row per part of each snapshot, newest first."""

    STATEMENTS = {
        "heads": (READ, "SELECT taken, part, parts FROM view_snapshots WHERE mailbox_id = ? LIMIT ?"),
        "parts": (READ, "SELECT part, data FROM view_snapshots WHERE mailbox_id = ? AND taken = ?"),
        "insert": (WRITE, "INSERT INTO view_snapshots (mailbox_id, taken, part, parts, data) VALUES (?, ?, ?, ?, ?)"),
        "drop_before": (WRITE, "DELETE FROM view_snapshots WHERE mailbox_id = ? AND taken < ?"),
    }

    async def heads(self, mailbox_id: uuid.UUID, limit: int) -> list[Any]:
        """(taken, part, parts) of the newest rows, without their data."""
        return await self._run("heads", mailbox_id, limit)

    async def parts(self, mailbox_id: uuid.UUID, taken: uuid.UUID) -> list[Any]:
        return await self._run("parts", mailbox_id, taken)

    async def insert(self, mailbox_id: uuid.UUID, taken: uuid.UUID, part: int, parts: int, data: bytes) -> None:
        await self._run("insert", mailbox_id, taken, part, parts, data)

    async def drop_before(self, mailbox_id: uuid.UUID, taken: uuid.UUID) -> None:
        await self._run("drop_before", mailbox_id, taken)


class Tables:
    """Every table of the keyspace, each with its statements, sharing one executor."""

    def __init__(self, cql: Cql) -> None:
        self.domains = Domains(cql)
        self.users = Users(cql)
        self.users_by_domain = UsersByDomain(cql)
        self.aliases = Aliases(cql)
        self.aliases_by_user = AliasesByUser(cql)
        self.messages = Messages(cql)
        self.bodies = Bodies(cql)
        self.body_chunks = BodyChunks(cql)
        self.queue = Queue(cql)
        self.queue_due = QueueDue(cql)
        self.queue_shards = QueueShards(cql)
        self.dkim_keys = DkimKeys(cql)
        self.sieve_scripts = SieveScripts(cql)
        self.sieve_vacation = SieveVacation(cql)
        self.mailbox_events = MailboxEvents(cql)
        self.quota_usage = QuotaUsage(cql)
        self.view_snapshots = ViewSnapshots(cql)

    def all(self) -> Iterable[Table]:
        return [t for t in vars(self).values() if isinstance(t, Table)]

    def prepare(self) -> None:
        """Blocking: every statement of every table, PREPARE_THREADS at a time (each is a round
        trip to a node, most of it waiting)."""
        work = [(table, name, kind, text) for table in self.all() for name, (kind, text) in table.STATEMENTS.items()]
        with ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="cassmail-prepare") as pool:
            done = list(pool.map(lambda w: w[0].cql.prepare(w[2], w[3]), work))
        for (table, name, _, _), prepared in zip(work, done):
            table.prepared[name] = prepared
