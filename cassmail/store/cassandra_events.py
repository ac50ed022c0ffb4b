"""Change events of the Cassandra backend (schema/009_events.cql): how an IMAP IDLE session
hears of a change made on any node within about a second, at a cost that follows the number of
changes, not of sessions or mailboxes watched.

Every change of a mailbox's messages (a delivery, a numbering, a flag change, an expunge) is
followed by an event row in the partition of its second, written in the background once the
change itself is stored: a delivery's reply never waits for it, and an event that is lost (the
write failed) only delays the news to the IDLE sessions' slow fallback refresh. A worker's
poller reads the partitions of the last few seconds; an event stamped up to EVENT_WINDOW
seconds before it lands (a slow write, clocks of two nodes apart) is still read.

A worker has at most one event write in flight, and it begins EVENT_LINGER seconds after the
first change it carries: changes stored meanwhile, or while a write is out, go in the next write,
in one batch on the partition of its second (up to EVENTS_PER_WRITE rows). Under a stream of
changes, one request for many of them instead of one each; an event is held back no longer than
the linger and one write take, a small part of the pollers' period (imap.idle_poll).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Collection, Iterable
from typing import Any

from cassandra.query import BatchType

from cassmail.model import address_key, new_message_id, timeuuid_seconds
from cassmail.store.base import NoSuchMailbox, Store, StoreError
from cassmail.store.cassandra_cql import Cql
from cassmail.store.cassandra_tables import Tables, min_timeuuid

log = logging.getLogger(__name__)

#: Seconds an event may land after the time it carries and still be read.
EVENT_WINDOW = 2.0
#: Seconds an event waits for more changes to go out with it (see the module's docstring).
EVENT_LINGER = 0.05
#: Seconds a watched mailbox's id is trusted before it is resolved again (renamed, recreated).
#: Until then the events of a mailbox created again under a watched name are not matched to it;
#: IMAP's look at each watched mailbox every `imap.idle_refresh` (its changes token, which names
#: the mailbox's id) sees such a mailbox sooner.
WATCH_ID_TTL = 600.0
#: Rows of one event write at most (a batch of one partition, about 40 bytes a row: under
#: Cassandra's batch_size_warn_threshold of 5 KiB).
EVENTS_PER_WRITE = 100


class CassandraEvents(Store):
    """Mixed into CassandraStore: its executor, tables and mailbox lookup are used here."""

    cql: Cql
    tables: Tables
    _resolve: Any

    def _event_state(self) -> dict[tuple[str, str], tuple[uuid.UUID | None, float]]:
        if not hasattr(self, "_watch_ids"):
            self._watch_ids: dict[tuple[str, str], tuple[uuid.UUID | None, float]] = {}
            #: Mailboxes changed since the event write in flight began, in the order of their changes.
            self._events_due: dict[uuid.UUID, None] = {}
            #: The task writing events, if one is (done from the step that found nothing due).
            self._events_writer: asyncio.Task[None] | None = None
        return self._watch_ids

    def _notify(self, mailbox_ids: Iterable[uuid.UUID]) -> None:
        """Have an event written for each mailbox, in the background (see the module's docstring)."""
        self._event_state()
        self._events_due.update(dict.fromkeys(mailbox_ids))
        if self._events_writer is None or self._events_writer.done():
            self._events_writer = asyncio.ensure_future(self._write_events())

    async def _write_events(self) -> None:
        """Write what is due, one write at a time, until nothing is."""
        due = self._events_due
        while due:
            await asyncio.sleep(EVENT_LINGER)
            mailbox_ids = list(itertools.islice(due, EVENTS_PER_WRITE))
            for m in mailbox_ids:
                del due[m]
            at = new_message_id()
            second = int(timeuuid_seconds(at))
            statements = [self.tables.mailbox_events.insert_statement(second, at, m) for m in mailbox_ids]
            try:
                await self.cql.run(statements[0] if len(statements) == 1
                                   else self.cql.batch(BatchType.UNLOGGED, statements=statements))
            except StoreError as exc:
                log.info("change event of %d mailboxes not written: %s", len(mailbox_ids), exc)

    async def _settle_events(self) -> None:
        """Let the events in flight finish (at close)."""
        self._event_state()
        if self._events_writer is not None:
            await asyncio.wait([self._events_writer], timeout=5)

    async def changed_mailboxes(
        self, watched: Collection[tuple[str, str]], since: Any
    ) -> tuple[set[tuple[str, str]], Any]:
        """From the change events of the last seconds: one read however many mailboxes are
        watched. The value passed on is (time of this read, events already seen), so an event
        read again within EVENT_WINDOW is not reported twice."""
        now = time.time()
        ids = await self._watched_ids(watched)
        if since is None:
            return set(), (now, frozenset())
        last, seen = since
        start = last - EVENT_WINDOW
        after = min_timeuuid(start)
        rows = await self.tables.mailbox_events.since(range(int(start), int(now) + 1), after)
        read = {(r.at, r.mailbox_id) for r in rows}
        news = {mailbox_id for (_, mailbox_id) in read - seen}
        changed = {pair for pair, mailbox_id in ids.items() if mailbox_id is None or mailbox_id in news}
        return changed, (now, frozenset(read))

    async def _watched_ids(self, watched: Collection[tuple[str, str]]) -> dict[tuple[str, str], uuid.UUID | None]:
        """The mailbox id of each watched pair (None: the mailbox is gone), resolved again after
        WATCH_ID_TTL seconds."""
        cache = self._event_state()
        now = time.monotonic()
        out: dict[tuple[str, str], uuid.UUID | None] = {}
        for pair in watched:
            known = cache.get(pair)
            if known is None or now - known[1] > WATCH_ID_TTL:
                try:
                    mailbox_id = (await self._resolve(address_key(pair[0]), pair[1])).mailbox_id
                except NoSuchMailbox:
                    mailbox_id = None
                known = cache[pair] = (mailbox_id, now)
            out[pair] = known[0]
        for pair in set(cache) - set(watched):
            del cache[pair]
        return out
