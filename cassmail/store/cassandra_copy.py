"""IMAP COPY and MOVE on the Cassandra backend: a copy of a large message refers to the body
already stored instead of writing it again, mixed into CassandraStore.

A body of more than SHARE_CHUNKS chunks is shared the way a delivery to several mailboxes
shares one (`bodies.refs`, schema/001): the copy's message row names the same body, and the
body's row lists every message row that refers to it; the chunks go with the last one
(`CassandraStore._release_shared`). Copying a 25 MB message is then a few small writes, not
25 MB read and 25 MB written, and a MOVE leaves the bytes where they are. A smaller body is read
and delivered again, as `Store._copy_one` does: its one or two chunks cost less to rewrite
than the Paxos round that sharing takes.

How a copy and a deletion of the same body stay apart:

- A body not shared yet (one delivery, one mailbox): the body's row is written with a reference
  for the source message and one for the copy, then the source row is marked shared in a
  conditional batch on its mailbox's counters (`_change`). A deletion of the source decided on
  the row before that mark moved the counters does not apply and is decided again, and then
  releases its reference instead of deleting the chunks; a deletion that came first leaves the
  batch nothing to mark, and the copy fails as the message is gone (NoSuchMessage).
- A shared body: the copy's reference is added in a Paxos round on the body's row, if the row is
  there. The last reference's release deletes that row in a Paxos round too, so either the copy
  comes first (the body stays) or the row is gone, and the copy reads the bytes instead (which
  fails as above when the message went).
- Then the copy's message row is written. A copy whose row write fails (a timed-out write may
  still have landed), or that stops in between (the worker dies), leaves its reference, which
  keeps the body for ever: garbage, never a message without its body.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from cassmail.config import CassandraSettings
from cassmail.model import MessageSummary, address_key, mailbox_name, new_message_id
from cassmail.store.base import NoSuchMessage, Store, Target
from cassmail.store.cassandra_cql import Cql
from cassmail.store.cassandra_tables import Tables

#: Bodies of more chunks than this are shared by their copies; smaller ones are copied.
SHARE_CHUNKS = 2


class CassandraCopies(Store):
    """Mixed into CassandraStore: its executor, tables, mailbox lookup, changes and quota
    counting are used here."""

    settings: CassandraSettings
    cql: Cql
    tables: Tables
    _resolve: Any
    _change: Any
    _notify: Any
    _ahead: Any
    _quota_check: Any
    _quota_count: Any
    _release_shared: Any
    _delete_chunks: Any
    _copies: Copies
    _recent: Any

    async def _copy_one(self, user: str, source: str, summary: MessageSummary, dest: str) -> uuid.UUID:
        """A numbered message's body of more than SHARE_CHUNKS chunks is shared; any other is
        copied byte for byte (`Store._copy_one`). (Only a numbered message's: its deletions are
        decided in Paxos rounds, which marking it shared takes part in; a mailbox never numbered
        is deleted from without one.) The copy's row is noted as written (`_copies`), for the
        numbering that follows to be decided without reading it back."""
        key = address_key(user)
        new_id = None
        if summary.uid and summary.size > SHARE_CHUNKS * self.settings.chunk_size:
            source_id = (await self._resolve(key, source, cached=True)).mailbox_id
            rows = [r for r in await self.tables.messages.body_infos(source_id, [summary.id]) if r.size is not None]
            if not rows:
                raise NoSuchMessage(source, summary.id)
            if math.ceil(rows[0].size / rows[0].chunk_size) > SHARE_CHUNKS:
                new_id = await self._copy_shared(key, source, source_id, rows[0], summary, dest)
        if new_id is None:  # (the bytes read and delivered again, to the target's row as kept)
            body = await self.read_message(user, source, summary.id)
            [new_id] = await self.deliver(body, [Target(user, dest, summary.flags)], summary.internal_date, copy=True)
        target = self._recent(key, mailbox_name(dest))  # (the row the copy read, when rows are kept)
        if target is not None:
            self._copies.note(target.mailbox_id, MessageSummary(new_id, summary.size, summary.flags,
                                                                summary.internal_date))
        return new_id

    async def _copy_shared(self, key: str, source: str, source_id: uuid.UUID, row: Any, summary: MessageSummary,
                           dest: str) -> uuid.UUID | None:
        """One copy referring to the body of `row`, the message's body row (see the module's
        docstring), with the flags and internal date of its `summary`; None when the
        body's row cannot be found (its last copy went, or at a weak consistency level it is not
        visible yet): the bytes are then copied, if the message is still there."""
        target = await self._resolve(key, dest, cached=True)  # (see `_resolve`: a copy's may be kept)
        counted = await self._quota_check([(key, dest)], [target], row.size)
        body_id, size = row.body_id, row.size
        new_id = new_message_id()
        refs = {body_ref(target.mailbox_id, new_id)}
        if row.shared:
            if not await self.tables.bodies.refer_if_there(body_id, size, refs):
                return None
        else:
            refs.add(body_ref(source_id, row.id))
            await self.tables.bodies.refer(body_id, size, row.chunk_size, refs)
            if not await self._mark_shared(source_id, row.id, body_id):
                # The source went first, its chunks with it (unless a copy made at the same time
                # shared it: then that copy's reference keeps them).
                if await self._release_shared(body_id, size, refs):
                    await self._delete_chunks([row])
                raise NoSuchMessage(source, row.id)
        await self.tables.messages.insert(target.mailbox_id, new_id, size, set(summary.flags) or None,
                                          summary.internal_date, body_id, row.chunk_size, True, new_id)
        self._notify([target.mailbox_id])
        self._ahead.delivered(target.mailbox_id, new_id)
        await self._quota_count(counted)
        return new_id

    async def _mark_shared(self, mailbox_id: uuid.UUID, message_id: uuid.UUID, body_id: uuid.UUID) -> bool:
        """Mark the source row shared, in a conditional batch on its mailbox's counters; False
        when the message is gone (or holds another body)."""
        there: list[bool] = []

        def plan(rows: list[Any], modseq: int, tally: Any) -> list[Any]:
            there[:] = [any(r.size is not None and r.body_id == body_id for r in rows)]
            if not there[0] or any(r.shared for r in rows):
                return []  # gone, or shared already (by another copy at the same time)
            return [self.tables.messages.share_statement(mailbox_id, message_id)]

        await self._change(mailbox_id, [message_id], plan)
        return bool(there and there[0])


class Copies:
    """The rows of the copies this process made lately and has not numbered yet, as it wrote them
    (the `limit` made last): IMAP numbers the copies right after COPY (for COPYUID), and a
    numbering of rows known as written is decided without a read when this process changed the
    mailbox last (cassandra_left), as an APPEND's is."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._rows: OrderedDict[tuple[int, int], MessageSummary] = OrderedDict()

    def note(self, mailbox_id: uuid.UUID, row: MessageSummary) -> None:
        self._rows[(mailbox_id.int, row.id.int)] = row
        if len(self._rows) > self.limit:
            self._rows.popitem(last=False)

    def take(self, mailbox_id: uuid.UUID, ids: Sequence[uuid.UUID]) -> list[MessageSummary] | None:
        """The rows of `ids` as written, if this process made every one of them (forgotten
        here either way); else None."""
        rows = [self._rows.pop((mailbox_id.int, i.int), None) for i in ids]
        return None if any(row is None for row in rows) else rows  # type: ignore[return-value]


def body_ref(mailbox_id: uuid.UUID, message_id: uuid.UUID) -> str:
    """A message row's reference in its body's row (`bodies.refs`)."""
    return f"{mailbox_id}/{message_id}"

