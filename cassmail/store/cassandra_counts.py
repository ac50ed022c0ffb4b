"""STATUS counts of the Cassandra backend (schema/011_counts.cql), mixed into CassandraStore.

IMAP STATUS asks how many messages a mailbox holds, how many lack \\Seen, their bytes, those
with \\Deleted, and UIDNEXT. Counting them from the listing costs a read of every message row; a
mailbox of 100,000 messages takes seconds. Instead the mailbox's partition keeps the counts in
static columns, for the messages older than a bound (`counted_through`), and STATUS adds the
messages above the bound (the tail: mail delivered since the counts were made) from a short read.

Keeping the counts true without a Paxos round on the delivery path:

- *Deliveries* write no count: a new message's id is the time it was delivered, so it falls in
  the tail until a STATUS folds the tail into the counts. The bound is always at least
  `request_timeout` + 2 s older than the read a fold is made from, so no delivery older than the
  bound can land after it (the assumption `changes_token` makes too); and the fold reads at ALL,
  so a row acknowledged by any one replica is seen.
- *Changes* (numbering, flags, expunges) are conditional batches decided on a SERIAL read of the
  rows and of the statics (`CassandraStore._change`). When the counts were true before a
  change (counts_modseq = highest_modseq), its batch writes them changed by what it did, with the
  new MODSEQ; when they were not, it leaves them, still untrue. A change to a message in the
  tail changes no count (the tail is read as it is).
- *Plain changes* (a flag change made without a Paxos round in an outage, a deletion in a
  mailbox never numbered) move `plain_at`, a column no conditional batch writes: counts made at
  another plain_at are not trusted.

Counts that are not true are made again by the next STATUS, from a read of the whole mailbox at
ALL, and kept only if nothing changed meanwhile (a conditional write on the counters and the
bound it read). A STATUS that cannot read at ALL (a replica down) answers from a read at the read
level and keeps nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import uuid
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from cassmail.model import address_key
from cassmail.store.base import MailboxStatus, Store, StoreUnavailable
from cassmail.store.cassandra_cql import Cql
from cassmail.store.cassandra_tables import ANCHOR, FIRST_REAL, Tables, min_timeuuid

log = logging.getLogger(__name__)

#: Seconds beyond the request timeout a write may take to land (also CassandraStore.changes_token's).
CHANGES_SETTLE = 2.0
#: Rows older than the next bound that a STATUS reads above the current one before it folds them
#: into the counts (each STATUS reads them all until then; a fold costs a read of them at ALL and
#: a conditional write, and only a STATUS makes one).
FOLD_ROWS = 64
#: Rows per page of those reads.
PAGE = 1000
#: Mailboxes whose bound of the counts a process remembers, at most (then it starts afresh).
BOUNDS_KEPT = 10_000


@dataclass
class Counts:
    """What STATUS counts, over some set of messages (the order of the `count_*` columns)."""

    messages: int = 0
    unseen: int = 0
    size: int = 0
    deleted: int = 0
    deleted_size: int = 0
    unnumbered: int = 0
    uid_max: int = 0

    @classmethod
    def of(cls, row: Any) -> Counts:
        """The counts a row of statics carries (nothing counted: zeros)."""
        return cls(*(getattr(row, f"count_{f.name}") or 0 for f in dataclasses.fields(cls)))

    def values(self) -> tuple[int, ...]:
        return dataclasses.astuple(self)

    def add(self, flags: Any, size: int, uid: int | None, sign: int = 1) -> None:
        """Count a message in (`sign` 1) or out (-1). The highest UID is never lowered."""
        flags = flags or ()
        self.messages += sign
        self.unseen += sign * ("\\Seen" not in flags)
        self.size += sign * size
        if "\\Deleted" in flags:
            self.deleted += sign
            self.deleted_size += sign * size
        if uid is None:
            self.unnumbered += sign
        elif sign > 0:
            self.uid_max = max(self.uid_max, uid)

    def __add__(self, other: Counts) -> Counts:
        out = Counts(*(a + b for a, b in zip(self.values(), other.values())))
        out.uid_max = max(self.uid_max, other.uid_max)
        return out


def counts_true(row: Any) -> bool:
    """Whether the counts a row of statics carries are true (see the module's docstring)."""
    return (row.counted_through is not None and row.counts_modseq == (row.highest_modseq or 1)
            and row.counts_plain == row.plain_at)


def below(message_id: uuid.UUID, bound: uuid.UUID) -> bool:
    """Whether a message id sorts below a bound made by `min_timeuuid` (Cassandra's order)."""
    return message_id.time < bound.time


class Tally:
    """What one change's conditional batch does to the counts, from its SERIAL read (`read`: a
    row of `Messages.state`, which carries the statics); `valid` false: the counts were not true
    and are left as they are."""

    def __init__(self, read: Any) -> None:
        #: The statics it started from.
        self.read = read
        self.valid = counts_true(read)
        self.counts = Counts.of(read)
        self.bound = read.counted_through

    def _counted(self, row: Any) -> bool:
        return self.valid and row.size is not None and below(row.id, self.bound)

    def flags(self, row: Any, new: Any) -> None:
        if self._counted(row):
            self.counts.add(row.flags, row.size, row.uid, -1)
            self.counts.add(new, row.size, row.uid)

    def numbered(self, row: Any, uid: int) -> None:
        if self._counted(row):
            self.counts.add(row.flags, row.size, row.uid, -1)
            self.counts.add(row.flags, row.size, uid)

    def numbered_first(self, message_id: uuid.UUID, uid: int) -> None:
        """`numbered` for a message that had no UID, whose row the batch itself checks is there:
        its flags and size count out and in again, so only its id matters."""
        if self.valid and below(message_id, self.bound):
            self.counts.unnumbered -= 1
            self.counts.uid_max = max(self.counts.uid_max, uid)

    def copy(self) -> Tally:
        other = copy.copy(self)
        other.counts = dataclasses.replace(self.counts)
        return other

    def gone(self, row: Any) -> None:
        if self._counted(row):
            self.counts.add(row.flags, row.size, row.uid, -1)


class CassandraCounts(Store):
    """Mixed into CassandraStore: its executor, tables, settings and mailbox lookup are used here."""

    cql: Cql
    tables: Tables
    _resolve: Any
    _changes_state: Any
    #: mailbox id -> the bound of its counts (counted_through) as this process last read it.
    _count_bounds: dict[uuid.UUID, uuid.UUID]

    async def mailbox_status(self, user: str, mailbox: str, recent: bool = False) -> MailboxStatus:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        head, first, _ = await self._head(mailbox_id)
        return await self._counted(user, mailbox, mailbox_id, recent, head, first)

    async def status_state(
        self, user: str, mailbox: str, recent: bool, modseq: bool, known: Hashable | None
    ) -> tuple[Hashable | None, int | None, MailboxStatus | None]:
        """One request when this process knows the bound of the counts and fewer than a page of
        rows lie above it: the anchor row (the largest id) is then among the rows read with the
        statics, and the token is its `changed`. Else the token is None (the counts are read as
        `mailbox_status` reads them, and a STATUS with no token is not kept)."""
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        head, first, rows = await self._head(mailbox_id)
        if rows is not None and len(rows) < PAGE:
            token, highest = self._changes_state(mailbox_id, rows[-1] if rows and rows[-1].id == ANCHOR else None)
        else:
            token, highest = None, (head.highest_modseq or 1) if head is not None else 1
        if token is not None and token == known:
            return token, highest, None
        return token, highest, await self._counted(user, mailbox, mailbox_id, recent, head, first)

    async def _counted(self, user: str, mailbox: str, mailbox_id: uuid.UUID, recent: bool, head: Any,
                       first: list[Any] | None) -> MailboxStatus:
        """The counts from the statics `head` and the rows above their bound (`first`: the first
        page of them, when read with the statics)."""
        if head is None:  # nothing was ever written in it
            return MailboxStatus(0, 0, 0, 0, 0, 1, 0 if recent else None)
        valid = counts_true(head)
        base = Counts.of(head) if valid else Counts()
        start = head.counted_through if valid else FIRST_REAL
        mark = (head.recent_mark or 1) if recent else 0
        if recent and valid and base.uid_max >= mark:
            # counted mail numbered but not claimed yet: which of it is \Recent takes the listing
            return await super().mailbox_status(user, mailbox, recent)
        bound = min_timeuuid(time.time() - self.settings.request_timeout - CHANGES_SETTLE)
        fold = not valid
        rows = await self._tail(mailbox_id, start, everywhere=fold, first=first if valid else None)
        if rows is None:  # ALL could not be read: answer from the read level, keep nothing
            fold, rows = False, await self._tail(mailbox_id, start, everywhere=False)
            assert rows is not None
        if not fold and len(rows) >= FOLD_ROWS and below(start, bound) and \
                sum(below(r.id, bound) for r in rows) >= FOLD_ROWS:
            everywhere = await self._tail(mailbox_id, start, everywhere=True)
            if everywhere is not None:
                fold, rows = True, everywhere
        tail, older = Counts(), Counts()
        recents = base.unnumbered
        for r in rows:
            tail.add(r.flags, r.size, r.uid)
            if below(r.id, bound):
                older.add(r.flags, r.size, r.uid)
            recents += r.uid is None or r.uid >= mark
        if fold and below(start, bound):
            await self._keep_counts(mailbox_id, base + older, bound, head)
        total = base + tail
        return MailboxStatus(total.messages, total.unseen, total.size, total.deleted, total.deleted_size,
                             (head.uidnext or 1) + total.unnumbered, recents if recent else None)

    async def _head(self, mailbox_id: uuid.UUID) -> tuple[Any, list[Any] | None, list[Any] | None]:
        """The statics (None when the partition holds nothing) and, when this process knows the
        bound of the counts and it has not moved, the first page of the rows above it, read with
        them in one request (else None: `_tail` reads them); and the rows of that request (None
        when it was not made)."""
        messages = self.tables.messages
        known = self._count_bounds.get(mailbox_id)
        head, first, rows = None, None, None
        if known is not None:
            rows = await messages.statics_after(mailbox_id, known, PAGE)
            if rows:  # (none: not even the anchor row, which every change writes)
                head = rows[0]
                first = rows if head.counted_through == known else None
            else:
                rows = None  # (no row above the bound, not even the anchor: the statics alone)
        if head is None:
            head = await messages.statics(mailbox_id)
        if head is not None and head.counted_through is not None:
            self._remember_bound(mailbox_id, head.counted_through)
        return head, first, rows

    async def _tail(self, mailbox_id: uuid.UUID, start: uuid.UUID, everywhere: bool,
                    first: list[Any] | None = None) -> list[Any] | None:
        """Every message row above `start`; `everywhere`: read at ALL (None when it cannot be);
        `first`: the first page of them (at the read level), already read."""
        messages = self.tables.messages
        rows: list[Any] = []
        after = start
        while True:
            try:
                if first is not None and not everywhere:
                    page, first = first, None
                else:
                    page = (await messages.page_everywhere(mailbox_id, after, PAGE) if everywhere
                            else await messages.page(mailbox_id, after, PAGE))
            except StoreUnavailable:
                if not everywhere:
                    raise
                return None
            rows += [r for r in page if r.size is not None]
            if len(page) < PAGE:
                return rows
            after = page[-1].id

    async def _keep_counts(self, mailbox_id: uuid.UUID, counts: Counts, bound: uuid.UUID, head: Any) -> None:
        """Keep counts made from a read at ALL, if nothing changed since `head` was read."""
        try:
            kept, _ = await self.cql.conditional(self.tables.messages.store_counts_statement(
                mailbox_id, counts.values(), bound, head), contention_not_applied=True)
        except StoreUnavailable as exc:  # the next STATUS counts again
            log.info("STATUS counts of %s not kept: %s", mailbox_id, exc)
            return
        if kept:
            self._remember_bound(mailbox_id, bound)

    def _remember_bound(self, mailbox_id: uuid.UUID, bound: uuid.UUID) -> None:
        if len(self._count_bounds) >= BOUNDS_KEPT:
            self._count_bounds.clear()
        self._count_bounds[mailbox_id] = bound
