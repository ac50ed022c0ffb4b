"""The outbound queue and DKIM keys of the Cassandra store (schema/006_outbound.cql).

Accepting (`enqueue`) is plain writes at the write level: the body's chunks, then the
entry (its partition in one batch), then its row in `queue_due`. No lightweight
transaction is on that path. The accepting process's worker usually holds the new
entry's lease from the start (written with it: a new row has no other writer) and
delivers it at once, so a healthy delivery takes no lightweight transaction at all.

Taking: "what is due now" is read from `queue_due`, a partition per (shard, minute),
sixteen shards. Each reader (a worker process) remembers, per shard, where it last
found the first live row: every row before it was already deleted (a tombstone) when
it read, so its next read starts there and walks neither the tombstones of the
entries delivered before nor earlier minutes. New rows arrive at the current time, after
that position; a row that turns up late behind it (a slow replica at consistency ONE,
a node with a slow clock) is found by the sweep: every `SWEEP_SECONDS` the reader
starts again from the shard's durable low mark (`queue_shards`), which moves only past
minutes older than the tombstone grace that read empty. While every shard's position is in
the current minute or the one before, all sixteen are read in one request (`_read_ahead`):
an idle worker's look is one request. An entry is taken with one
lightweight transaction on its lease (`IF lease_until < now AND held = false`); then its
due row moves to the lease's end, so if the worker dies the entry is due again when
the lease runs out, on any node.

Every later write of a worker to its entry (results, reschedule, lease renewal) is
conditional on still holding the lease, so a worker whose lease ran out cannot undo
what the next one recorded; `finish` is a plain delete of the whole partition (an
entry is finished only when every recipient is sent or failed, so whoever finishes it
loses nothing).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from cassandra.query import BatchType

from cassmail.model import new_message_id, normalize_domain
from cassmail.store.base import (
    Body,
    DkimKey,
    NoSuchDomain,
    NoSuchQueueEntry,
    QueuedRecipient,
    QueueEntry,
    Store,
    StoreUnavailable,
    check_dkim_key,
    check_enqueue,
)
from cassmail.store.cassandra_cql import Cql
from cassmail.store.cassandra_tables import Tables

#: Shards of `queue_due`: a busy minute is spread over this many partitions.
SHARDS = 16
#: Seconds per `queue_due` partition.
BUCKET_SECONDS = 60
#: A reader's position never passes rows younger than this (a write still arriving, a clock
#: a little behind), so they are read again until they are this old.
SETTLE_SECONDS = 10.0
#: How often a reader starts again from the durable low marks, to find rows that arrived late.
SWEEP_SECONDS = 600.0
#: Minutes one shard's reader moves through per take: a sweep over the default grace (3 h) is done
#: in one call, a longer one in a few.
BUCKETS_PER_TAKE = 240
#: Looks at the shards per take at most, while each found only stale rows.
TAKE_ROUNDS = 8
#: Rows of a shard read per look, at the least.
MIN_PAGE = 16
#: Reads of a queued body before a missing chunk is reported (see read_queued).
READ_ATTEMPTS = 4
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

def _ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(max(seconds, 0.0), tz=timezone.utc)


def _secs(when: datetime | None) -> float:
    if when is None:
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def _bucket(seconds: float) -> int:
    return int(seconds // BUCKET_SECONDS)


def _shard(entry_id: uuid.UUID) -> int:
    return entry_id.int % SHARDS


def _entry(rows: Sequence[Any]) -> QueueEntry | None:
    """An entry from its partition's rows (statics repeat on each), None when it has no envelope."""
    if not rows or rows[0].sender is None:
        return None
    head = rows[0]
    recipients = tuple(
        QueuedRecipient(r.rcpt, r.state or "pending", r.reply or "", r.remote or "") for r in rows if r.rcpt is not None
    )
    return QueueEntry(
        id=head.id, sender=head.sender, recipients=recipients, size=head.size or 0, created=_secs(head.created),
        due=_secs(head.due), attempts=head.attempts or 0, held=bool(head.held), warned=bool(head.warned),
        last_error=head.last_error or "", lease_owner=head.lease_owner or "", lease_until=_secs(head.lease_until),
        smtputf8=bool(head.smtputf8),
    )


@dataclass(frozen=True)
class _Ahead:
    """Rows of `queue_due` read for every shard at once (see `_read_ahead`): the minutes read,
    and the rows found by (shard, minute)."""

    buckets: set[int]
    rows: dict[tuple[int, int], list[Any]]


@dataclass(frozen=True)
class _Held:
    """Where an entry's due row is (its lease's end, or its due time when free) and what a
    worker's later writes need: attempts and warning so far, and the body's place."""

    until: float
    attempts: int
    warned: bool
    #: The body's chunks, or None when the body is kept in the entry.
    body_id: uuid.UUID | None
    size: int
    chunk_size: int

    @classmethod
    def of(cls, entry: QueueEntry, head: Any) -> _Held:
        return cls(max(entry.due, entry.lease_until), entry.attempts, entry.warned, head.body_id, head.size or 0,
                   head.chunk_size or 0)


class CassandraQueue(Store):
    """Mixed into CassandraStore: its executor, tables and chunk helpers are used here."""

    cql: Cql
    tables: Tables
    _gather_limited: Any
    _put_chunks: Any
    _chunk: Any
    settings: Any

    def _queue_init(self) -> None:
        #: shard -> (bucket, seconds): this reader found no live row of the shard before it.
        self._cursor: dict[int, tuple[int, float]] = {}
        self._swept_at = 0.0
        #: Entries this process holds a lease on: where their due row is, and what a reschedule
        #: or finish needs without reading them again.
        self._held: dict[uuid.UUID, _Held] = {}

    # ----------------------------------------------------------------- accepting

    async def enqueue(
        self, body: Body, sender: str, recipients: Sequence[str], *, smtputf8: bool = False, due: float | None = None,
        lease: tuple[str, float] | None = None,
    ) -> uuid.UUID:
        view, sender, rcpts = check_enqueue(body, sender, recipients, self.max_message_size)
        entry_id, body_id = new_message_id(), new_message_id()
        now = time.time()
        due = now if due is None else due
        owner, until = (lease[0], now + lease[1]) if lease else ("", 0.0)
        chunk = self.settings.chunk_size
        size = view.nbytes
        # Kept in the entry: one write to accept and one delete to finish, where chunks cost a
        # write and a delete each (most mail; store.cassandra.queue_inline_max).
        inline = size <= max(chunk, self.settings.queue_inline_max)
        if inline:
            body_id, chunk = None, 0
        else:
            await self._put_chunks(body_id, view, chunk)
        queue = self.tables.queue
        batch = self.cql.batch(BatchType.UNLOGGED)  # one partition: applied as a whole
        batch.add(queue.entry_statement(entry_id, sender, _ts(now), _ts(due), owner, _ts(until), size,
                                        bytes(view) if inline else None, body_id, chunk, smtputf8))
        for rcpt in rcpts:
            batch.add(queue.recipient_statement(entry_id, rcpt))
        if lease:
            # Its due row is at the lease's end, when no reader can yet be looking for it: both
            # writes at once (a due row whose entry was never written is skipped, and dropped
            # once it is older than the tombstone grace).
            await asyncio.gather(self.cql.run(batch), self._put_due(entry_id, max(due, until)))
        else:
            await self.cql.run(batch)  # the entry before its due row: a reader finds it whole
            await self._put_due(entry_id, due)
        if lease:
            self._held[entry_id] = _Held(until, 0, False, body_id, size, chunk)
        return entry_id

    async def _put_due(self, entry_id: uuid.UUID, when: float) -> None:
        await self.tables.queue_due.insert(_shard(entry_id), _bucket(when), _ts(when), entry_id)

    async def _drop_due(self, entry_id: uuid.UUID, when: datetime | float) -> None:
        at = when if isinstance(when, datetime) else _ts(when)
        await self.tables.queue_due.delete(_shard(entry_id), _bucket(_secs(at)), at, entry_id)

    # ----------------------------------------------------------------- taking

    async def _lows(self, now: float) -> dict[int, int]:
        rows = await self.tables.queue_shards.all()
        for shard in range(SHARDS):
            if rows.get(shard) is None:
                # The first reader of a new queue: nothing is due before its start (less an hour of clock skew).
                start = _bucket(now - 3600)
                applied, row = await self.tables.queue_shards.init(shard, start)
                rows[shard] = start if applied else row.low_bucket
        return rows

    async def take_due(self, owner: str, limit: int, lease: float) -> list[QueueEntry]:
        now = time.time()
        if now - self._swept_at > SWEEP_SECONDS or len(self._cursor) < SHARDS:
            self._cursor = {shard: (low, 0.0) for shard, low in (await self._lows(now)).items()}
            self._swept_at = now
        # A round that read only stale rows (entries finished, deleted or taken by others) moved
        # the positions past them: the entries due behind them are looked at in the same call.
        for _ in range(TAKE_ROUNDS):
            before = dict(self._cursor)
            read, taken = await self._take_round(owner, limit, lease, time.time())
            if taken or not read or self._cursor == before:
                return taken
        return []

    async def _take_round(self, owner: str, limit: int, lease: float, now: float) -> tuple[bool, list[QueueEntry]]:
        """One look at every shard from this reader's positions: (whether it read any row, what it took)."""
        # At least a few rows a shard: a page of one row that is stale would be read again and
        # again (a page's last row is where the next one starts, as rows may share a due time).
        page = max(limit, MIN_PAGE)
        ahead = await self._read_ahead(now, page)
        scans = await asyncio.gather(*(self._scan(shard, now, page, ahead) for shard in range(SHARDS)))
        candidates = [(shard, row) for shard, (_, rows) in enumerate(scans) for row in rows]
        random.shuffle(candidates)  # workers of every node start at different entries
        seen: set[uuid.UUID] = set()
        taken: list[QueueEntry] = []
        left: dict[int, list[float]] = {}
        failure: StoreUnavailable | None = None
        for shard, row in candidates:
            if len(taken) >= limit:
                left.setdefault(shard, []).append(_secs(row.due))
                continue
            if row.id in seen:
                continue  # a second row of one entry (a stale one a failed write left): one take a call
            seen.add(row.id)
            try:
                entry = await self._take(row.id, row.due, owner, lease, now)
            except StoreUnavailable as exc:
                # This entry's replicas cannot decide a lease now (a Paxos quorum is down):
                # the others go on; it stays due, and is looked at again next time.
                left.setdefault(shard, []).append(_secs(row.due))
                failure = exc
                continue
            if entry is not None:
                taken.append(entry)
        settled = now - SETTLE_SECONDS
        for shard, (bucket, rows) in enumerate(scans):
            if not rows:
                continue
            # Every row read was taken, found stale or is someone else's now, except those left
            # for later; past the last row read nothing was due (unless the page was full).
            if shard in left:
                reached = min(left[shard])
            elif len(rows) >= page:
                reached = _secs(rows[-1].due)
            else:
                reached = min(now, (bucket + 1) * BUCKET_SECONDS)
            if self._cursor[shard][0] == bucket:  # else an earlier minute is still settling: stay there
                self._cursor[shard] = (bucket, max(self._cursor[shard][1], min(reached, settled)))
        if failure is not None and not taken:
            raise failure
        return bool(candidates), taken

    async def _read_ahead(self, now: float, limit: int) -> _Ahead | None:
        """While every shard's position is in the current minute or the one before (a reader
        that keeps up), the rows `_scan` will want of every shard, in one request: from the
        lowest position to now, `limit` a partition. None otherwise (a reader catching up after
        its sweep reads shard by shard)."""
        buckets = {bucket for bucket, _ in self._cursor.values()}
        current = _bucket(now)
        if len(buckets) != 1 or not 0 <= current - min(buckets) <= 1:
            return None
        spanned = list(range(min(buckets), current + 1))
        start = min(position for _, position in self._cursor.values())
        rows = await self.tables.queue_due.pages(range(SHARDS), spanned, _ts(start), _ts(now), limit)
        return _Ahead(set(spanned), rows)

    async def _scan(self, shard: int, now: float, limit: int, ahead: _Ahead | None = None) -> tuple[int, list[Any]]:
        """The due rows of one shard from this reader's position (and the minute they are in);
        minutes left behind read empty are never read again by this reader until its sweep,
        nor by anyone once they are older than the tombstone grace. A minute `ahead` holds is
        not read again unless its page there was full (rows from below this shard's position
        may be in it: rows there are dead, or late, which only finds them sooner)."""
        bucket, position = self._cursor[shard]
        settled = now - SETTLE_SECONDS
        grace = now - self.settings.tombstone_grace
        moving = True  # the position follows while every minute read so far was dead and settled
        for _ in range(BUCKETS_PER_TAKE):
            if bucket > _bucket(now):
                break
            rows = ahead.rows.get((shard, bucket), []) if ahead is not None and bucket in ahead.buckets else None
            if rows is None or len(rows) >= limit:
                rows = await self.tables.queue_due.page(shard, bucket, _ts(position), _ts(now), limit)
            if rows:
                return bucket, rows
            end = (bucket + 1) * BUCKET_SECONDS
            if moving and end > settled:  # the current minute, or one whose rows may still arrive
                self._cursor[shard] = (bucket, max(position, min(settled, end)))
                moving = False
            elif moving:
                if end < grace:
                    await self.tables.queue_shards.set(shard, bucket + 1)
                self._cursor[shard] = (bucket + 1, 0.0)
            bucket, position = bucket + 1, 0.0
        return bucket, []

    async def _take(self, entry_id: uuid.UUID, row_due: datetime, owner: str, lease: float, now: float) -> QueueEntry | None:
        until = now + lease
        # The row at the lease's end is written before the lease: an entry's next look time
        # (its due time or its lease's end) always has its row, so a row at another time is
        # stale, and whoever finds one may drop it.
        await self._put_due(entry_id, until)
        # The entry is read at the read level beside the lease: an entry no worker ever held is
        # as it was queued, so no serial read is needed for it (the common case).
        read = asyncio.ensure_future(self.tables.queue.entry(entry_id))
        read.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved if unused
        try:
            applied, current = await self.tables.queue.take(entry_id, owner, _ts(until), _ts(now))
        except StoreUnavailable:
            read.cancel()
            await self._drop_due_quietly(entry_id, until)
            raise
        if not applied:
            read.cancel()
            await self._drop_due_quietly(entry_id, until)
            if getattr(current, "lease_until", None) is not None:
                # The entry is not free now: held (a release writes a new due row), leased (its
                # holder's row is at the lease's end) or due later (its row is there): this
                # row is stale.
                await self._drop_due(entry_id, row_due)
            elif _secs(row_due) < now - self.settings.tombstone_grace:
                await self._drop_due(entry_id, row_due)  # no entry, for longer than a write can be late
            return None
        try:
            rows = (await asyncio.gather(read, self._drop_due(entry_id, row_due)))[0]
        except StoreUnavailable:
            rows = []
        entry = _entry(rows)
        if entry is None or entry.attempts or entry.lease_owner not in ("", owner) or entry.held:
            rows = await self.tables.queue.entry(entry_id, serial=True)
            entry = _entry(rows)
        if entry is None:  # deleted between the lease and the read
            await self._drop_due(entry_id, until)
            return None
        entry = replace(entry, lease_owner=owner, lease_until=until)
        self._held[entry_id] = _Held.of(entry, rows[0])
        return entry

    async def _drop_due_quietly(self, entry_id: uuid.UUID, when: float) -> None:
        """Remove a due row written for a change that did not happen; if even that fails, the
        row is stale and the next reader drops it."""
        try:
            await self._drop_due(entry_id, when)
        except StoreUnavailable:
            pass

    async def _holding(self, entry_id: uuid.UUID) -> _Held | None:
        """What this process knows of an entry it took, else what the store says now."""
        held = self._held.get(entry_id)
        if held is None:
            rows = await self.tables.queue.entry(entry_id, serial=True)
            entry = _entry(rows)
            held = _Held.of(entry, rows[0]) if entry is not None else None
        return held

    async def renew_lease(self, entry_id: uuid.UUID, owner: str, lease: float) -> bool:
        until = time.time() + lease
        await self._put_due(entry_id, until)  # before the lease moves (see _take)
        applied = await self.tables.queue.renew(entry_id, owner, _ts(until))
        old = self._held.pop(entry_id, None)
        if not applied:
            await self._drop_due_quietly(entry_id, until)
            return False
        if old is not None:
            await self._drop_due(entry_id, old.until)
            self._held[entry_id] = replace(old, until=until)
        return True

    async def read_queued(self, entry_id: uuid.UUID) -> bytes:
        held = await self._holding(entry_id)
        if held is None:
            raise NoSuchQueueEntry(entry_id)
        body_id = held.body_id
        for attempt in range(READ_ATTEMPTS):
            try:
                if body_id is None:
                    inline = await self.tables.queue.body(entry_id)
                    if inline is None:
                        raise StoreUnavailable(f"queued message {entry_id} not readable at this consistency")
                    return bytes(inline)
                chunks = await self._gather_limited(
                    self._chunk(body_id, i) for i in range(math.ceil(held.size / held.chunk_size))
                )
                if any(chunk is None for chunk in chunks):
                    raise StoreUnavailable(f"queued message {entry_id} not readable at this consistency")
                return b"".join(chunks)  # type: ignore[arg-type]
            except StoreUnavailable:
                # Taken a moment after it was queued: at consistency ONE the replica asked may
                # not have applied the chunk yet.
                if attempt == READ_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")  # pragma: no cover

    def _result_batch(self, entry_id: uuid.UUID, owner: str, results: Sequence[QueuedRecipient]) -> Any:
        batch = self.cql.batch(conditional=True)
        stamp = datetime.now(timezone.utc)
        for r in results:
            batch.add(self.tables.queue.result_statement(entry_id, owner, r, stamp))
        return batch

    async def record_results(self, entry_id: uuid.UUID, owner: str, results: Sequence[QueuedRecipient]) -> bool:
        if not results:
            return True
        applied, _ = await self.cql.conditional(self._result_batch(entry_id, owner, results))
        return bool(applied)

    async def reschedule(
        self, entry_id: uuid.UUID, owner: str, due: float, error: str, *, warned: bool = False,
        results: Sequence[QueuedRecipient] = (),
    ) -> bool:
        held = await self._holding(entry_id)
        self._held.pop(entry_id, None)
        if held is None:
            return False
        batch = self._result_batch(entry_id, owner, results)
        batch.add(self.tables.queue.release_statement(entry_id, owner, _ts(due), held.attempts + 1, error[:1000],
                                                 warned or held.warned, _EPOCH))
        await self._put_due(entry_id, due)  # before the entry says so (see _take)
        applied, _ = await self.cql.conditional(batch)
        if not applied:
            await self._drop_due_quietly(entry_id, due)
            return False
        await self._drop_due(entry_id, held.until)
        return True

    async def finish(self, entry_id: uuid.UUID) -> None:
        held = await self._holding(entry_id)
        self._held.pop(entry_id, None)
        if held is None:
            await self.tables.queue.delete(entry_id)
            return
        # The entry and its due row in one request (two small partitions: an unlogged batch).
        batch = self.cql.batch(BatchType.UNLOGGED)
        batch.add(self.tables.queue.delete_statement(entry_id))
        at = _ts(held.until)
        batch.add(self.tables.queue_due.delete_statement(_shard(entry_id), _bucket(held.until), at, entry_id))
        work = [self.cql.run(batch)]
        if held.body_id is not None and held.chunk_size:
            chunks = self.tables.body_chunks
            work += [chunks.delete(held.body_id, i) for i in range(math.ceil(held.size / held.chunk_size))]
        await self._gather_limited(work)

    # ----------------------------------------------------------------- operators

    async def list_queue(self, domain: str | None = None) -> list[QueueEntry]:
        wanted = normalize_domain(domain) if domain else None
        partitions: dict[uuid.UUID, list[Any]] = {}
        for row in await self.tables.queue.all():
            partitions.setdefault(row.id, []).append(row)
        entries = [e for e in (_entry(rows) for rows in partitions.values()) if e is not None]
        if wanted is not None:
            entries = [e for e in entries if any(r.address.rpartition("@")[2] == wanted for r in e.recipients)]
        return sorted(entries, key=lambda e: (e.created, e.id.bytes))

    async def get_queued(self, entry_id: uuid.UUID) -> QueueEntry:
        entry = _entry(await self.tables.queue.entry(entry_id))
        if entry is None:
            raise NoSuchQueueEntry(entry_id)
        return entry

    async def retry_queued(self, entry_id: uuid.UUID | None = None) -> int:
        entries = [await self.get_queued(entry_id)] if entry_id is not None else await self.list_queue()
        count = 0
        now = time.time()
        for entry in entries:
            await self._put_due(entry.id, now)  # before the entry says so (see _take)
            if await self.tables.queue.retry(entry.id, _ts(now)):
                count += 1
            else:
                await self._drop_due_quietly(entry.id, now)
        return count

    async def hold_queued(self, entry_id: uuid.UUID, held: bool) -> None:
        now = time.time()
        if held:
            applied = await self.tables.queue.hold(entry_id)
        else:
            await self._put_due(entry_id, now)  # before the entry says so (see _take)
            applied = await self.tables.queue.unhold(entry_id, _ts(now))
        if not applied:
            if not held:
                await self._drop_due_quietly(entry_id, now)
            raise NoSuchQueueEntry(entry_id)

    async def delete_queued(self, entry_id: uuid.UUID) -> None:
        if await self._holding(entry_id) is None:
            raise NoSuchQueueEntry(entry_id)
        await self.finish(entry_id)

    # ----------------------------------------------------------------- DKIM keys

    async def set_dkim_key(self, domain: str, selector: str, private_key_pem: str) -> None:
        domain, selector, private_key_pem = check_dkim_key(domain, selector, private_key_pem)
        if not await self.is_local_domain(domain):
            raise NoSuchDomain(domain)
        await self.tables.dkim_keys.set(domain, selector, private_key_pem, datetime.now(timezone.utc))

    async def get_dkim_key(self, domain: str) -> DkimKey | None:
        row = await self.tables.dkim_keys.get(normalize_domain(domain))
        return DkimKey(row.domain, row.selector, row.private_key) if row is not None else None

    async def delete_dkim_key(self, domain: str) -> None:
        await self.tables.dkim_keys.delete(normalize_domain(domain))

    async def list_dkim_keys(self) -> list[DkimKey]:
        return sorted((DkimKey(r.domain, r.selector, r.private_key) for r in await self.tables.dkim_keys.all()),
                      key=lambda k: k.domain)
