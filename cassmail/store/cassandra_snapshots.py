"""View snapshots of the Cassandra backend (schema/014_view_snapshots.cql): where an IMAP view of
a large mailbox is left when its session closes it, for a SELECT on any worker or node (see
Store.view_snapshot). A listing of 100,000 messages costs over a second of the worker's CPU and
as much of the node's; a snapshot of them is about 5 MB read by key.

A snapshot is written as parts of at most PART_BYTES, part 0 last, then the older snapshots of
the mailbox are deleted with one range deletion. A reader takes the newest snapshot whose part 0
it can read and reads its parts; one not whole at the read's consistency level is no snapshot.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cassmail.model import address_key, new_message_id
from cassmail.store.base import Store
from cassmail.store.cassandra_tables import Tables

#: Bytes of a snapshot per row: far below a mutation's limit (half the commit log segment).
PART_BYTES = 1 << 20
#: Rows looked at (taken, part; no data) to find the newest snapshot whose part 0 is stored.
HEADS = 64


class CassandraSnapshots(Store):
    """Mixed into CassandraStore: its tables and mailbox lookup are used here."""

    tables: Tables
    _resolve: Any
    keeps_view_snapshots = True

    async def view_snapshot(self, user: str, mailbox: str) -> bytes | None:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        table = self.tables.view_snapshots
        head = next((r for r in await table.heads(mailbox_id, HEADS) if r.part == 0), None)
        if head is None:
            return None
        rows = await table.parts(mailbox_id, head.taken)
        if [r.part for r in rows] != list(range(head.parts)):
            return None  # not whole here (a replica behind): the listing will do
        return b"".join(r.data for r in rows)

    async def keep_view_snapshot(self, user: str, mailbox: str, data: bytes) -> None:
        mailbox_id = (await self._resolve(address_key(user), mailbox, cached=True)).mailbox_id
        table, taken = self.tables.view_snapshots, new_message_id()
        parts = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
        await asyncio.gather(*(table.insert(mailbox_id, taken, n, len(parts), part)
                               for n, part in enumerate(parts) if n))
        await table.insert(mailbox_id, taken, 0, len(parts), parts[0])
        await table.drop_before(mailbox_id, taken)
