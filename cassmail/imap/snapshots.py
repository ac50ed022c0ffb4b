"""Where a closed view's state waits for the next SELECT of its mailbox (MailboxView.restore):
in the worker that closed it, and for a large mailbox also in the store, for every other worker
and node (Store.view_snapshot).

A SELECT without a snapshot lists every message: over a second of a worker's CPU, and as much
of the store's, for 100,000 messages. From a snapshot it reads only what changed since it was
taken (MailboxView._changes), as a session that stayed selected would.

In the store a snapshot is bytes (`encode`, `decode`): a JSON header, then a fixed-size record
per message. Only the store's state goes in, as of the view's last refresh; the changes token
does not (the view reads what changed since the snapshot's HIGHESTMODSEQ and arrivals mark, the
way every view refreshes). A worker writes the snapshot of a mailbox at most every SHARE_PERIOD,
and only when the view moved past what it last read or wrote there (a higher HIGHESTMODSEQ, or
a full listing newer by SHARE_PERIOD), in the background: closing a view never waits for it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import struct
import time
from collections.abc import Hashable
from datetime import datetime, timedelta, timezone

from cassmail.config import ImapSettings
from cassmail.imap.cache import Lru
from cassmail.imap.view import Snapshot
from cassmail.logs import kv
from cassmail.model import MessageSummary, uuid_from_bytes
from cassmail.store.base import Store, StoreError

log = logging.getLogger("cassmail.imap")

#: Seconds between two snapshots of one mailbox written by one worker.
SHARE_PERIOD = 60.0
#: Mailboxes whose last snapshot in the store a worker remembers (see `Snapshots.shared`).
SHARED_KEPT = 10_000

MAGIC = b"CMV1"
#: id, internal date (microseconds since 1970; NO_DATE: none), size, UID, MODSEQ (0: none),
#: the index of its flag set in the header's table.
RECORD = struct.Struct(">16sqQQQH")
NO_DATE = -(1 << 63)
#: Records encoded or decoded between two yields to the event loop.
SLICE = 10_000


class Snapshots:
    """The snapshots one listener's sessions share."""

    def __init__(self, store: Store, settings: ImapSettings) -> None:
        self.store = store
        #: (user, mailbox) -> the last view of it closed here, up to snapshot_messages messages.
        self.kept: Lru[Snapshot] = Lru(settings.snapshot_messages)
        #: Views of at least this many messages go to the store too (0: none do).
        self.share_from = settings.store_snapshot_messages if store.keeps_view_snapshots else 0
        #: (user, mailbox) -> (HIGHESTMODSEQ, last full listing, when written or read) of the
        #: snapshot in the store, as this worker last wrote or read it (monotonic times).
        self.shared: Lru[tuple[int, float, float]] = Lru(SHARED_KEPT)
        self._tasks: set[asyncio.Task[None]] = set()

    async def get(self, user: str, name: str, uidvalidity: int) -> Snapshot | None:
        """This worker's snapshot of the mailbox, else the store's; None: the view lists it all."""
        found = self.kept.get((user, name))
        if found is not None and found.uidvalidity == uidvalidity:
            return found
        if not self.share_from:
            return None
        try:
            data = await self.store.view_snapshot(user, name)
        except StoreError as exc:  # (NoSuchMailbox too) a cache: the listing will do
            log.warning(kv("imap-snapshot", user=user, mailbox=name, read=False, error=exc))
            return None
        found = await decode(data) if data is not None else None
        if found is None or found.uidvalidity != uidvalidity:
            return None
        self.shared.put((user, name), (found.highest, found.full_at, time.monotonic()))
        return found

    def put(self, user: str, name: str, snapshot: Snapshot) -> None:
        key = (user, name)
        self.kept.put(key, snapshot, len(snapshot.uids))
        if not self.share_from or len(snapshot.uids) < self.share_from:
            return
        now, known = time.monotonic(), self.shared.get(key)
        if known is not None:
            highest, full_at, when = known
            if now - when < SHARE_PERIOD or (snapshot.highest <= highest and snapshot.full_at < full_at + SHARE_PERIOD):
                return  # (written lately, or the store's is as new and its full listing recent enough)
        self.shared.put(key, (snapshot.highest, snapshot.full_at, now))
        task = asyncio.ensure_future(self._share(user, name, snapshot))
        self._tasks.add(task)  # held until done: a task nobody references may be collected
        task.add_done_callback(self._tasks.discard)

    async def _share(self, user: str, name: str, snapshot: Snapshot) -> None:
        data = await encode(snapshot)
        if data is None:
            return
        try:
            await self.store.keep_view_snapshot(user, name, data)
        except StoreError as exc:
            log.warning(kv("imap-snapshot", user=user, mailbox=name, written=False, error=exc))


def _wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


def _monotonic(wall: float) -> float:
    """A moment of another process (or node's clock) on this one's monotonic clock, never later
    than now."""
    return time.monotonic() - max(time.time() - wall, 0.0)


async def encode(snapshot: Snapshot) -> bytes | None:
    """The snapshot as bytes for the store; None for one that cannot be (a mark that is not an
    int, a summary whose UID is not its key, more distinct flag sets than a record can name)."""
    mark = snapshot.mark
    if mark is not None and not isinstance(mark, int):
        return None
    tables: dict[frozenset[str], int] = {}
    records: list[bytes] = []
    epoch, tick = datetime(1970, 1, 1, tzinfo=timezone.utc), timedelta(microseconds=1)
    for start in range(0, len(snapshot.uids), SLICE):
        for uid in snapshot.uids[start : start + SLICE]:
            s = snapshot.messages[uid]
            if s.uid != uid:
                return None
            flags = tables.setdefault(s.flags, len(tables))
            date = s.internal_date
            if date is not None and date.tzinfo is None:
                date = date.replace(tzinfo=timezone.utc)
            when = NO_DATE if date is None else (date - epoch) // tick
            records.append(RECORD.pack(s.id.bytes, when, s.size, uid, s.modseq or 0, flags))
        await asyncio.sleep(0)
    if len(tables) > 0xFFFF:
        return None
    header = json.dumps({
        "uidvalidity": snapshot.uidvalidity, "highest": snapshot.highest, "uid_next": snapshot.uid_next,
        "mark": mark, "full_at": _wall(snapshot.full_at), "keywords": sorted(snapshot.keywords),
        "flags": [sorted(f) for f in tables], "count": len(records),
    }).encode()
    return b"".join([MAGIC, struct.pack(">I", len(header)), header, *records])


async def decode(data: bytes) -> Snapshot | None:
    """A snapshot from `encode`'s bytes; None for bytes that are not one (another version).

    The cyclic garbage collector is off meanwhile: the summaries made here hold no cycles, yet
    every collection their allocations would set off walks them and all the worker holds (a
    third to a half of the time of 100,000 of them)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return await _decode(data)
    finally:
        if collecting:
            gc.enable()


async def _decode(data: bytes) -> Snapshot | None:
    try:
        if data[:4] != MAGIC:
            return None
        (size,) = struct.unpack_from(">I", data, 4)
        header = json.loads(data[8 : 8 + size])
        body = memoryview(data)[8 + size :]
        if len(body) != header["count"] * RECORD.size:
            return None
        flag_sets = [frozenset(f) for f in header["flags"]]
        uids: list[int] = []
        messages: dict[int, MessageSummary] = {}
        utc, from_timestamp, make_id = timezone.utc, datetime.fromtimestamp, uuid_from_bytes
        step = SLICE * RECORD.size
        for start in range(0, len(body), step):
            for raw_id, when, length, uid, modseq, flags in RECORD.iter_unpack(body[start : start + step]):
                date = None if when == NO_DATE else from_timestamp(when / 1e6, utc)
                messages[uid] = MessageSummary(make_id(raw_id), length, flag_sets[flags], date,
                                               uid, modseq or None)
                uids.append(uid)
            await asyncio.sleep(0)
        mark: Hashable | None = header["mark"]
        return Snapshot(header["uidvalidity"], uids, messages, frozenset(header["keywords"]), header["highest"],
                        header["uid_next"], None, 0.0, mark, _monotonic(header["full_at"]))
    except (ValueError, KeyError, IndexError, TypeError, struct.error):
        return None
