"""What the Cassandra backend promises beyond the shared contract: data-model costs,
consistency levels from settings, failures as StoreUnavailable, and nothing half-visible."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from cassandra import ConsistencyLevel
from cassandra.query import BatchStatement, SimpleStatement

from cassmail.config import CassandraSettings
from cassmail.model import INBOX, MessageSummary, address_key, new_message_id
from cassmail.store import cassandra as cassandra_module
from cassmail.store import cassandra_events, cassandra_schema
from cassmail.store.base import (
    DomainInUse, NoSuchMailbox, NoSuchMessage, RecentClaim, Store, StoreError, StoreUnavailable, Target,
)
from cassmail.store.cassandra import CassandraStore
from tests.conftest import FAST_HASH, hash_password
from tests.contract.test_store_contract import recent_owners

pytestmark = pytest.mark.cassandra


async def _stores_on(settings: CassandraSettings) -> AsyncIterator:
    opened: list[CassandraStore] = []

    async def make(**changes: object) -> CassandraStore:
        store = CassandraStore(dataclasses.replace(settings, **changes))
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture
async def make_store(cassandra_settings: CassandraSettings) -> AsyncIterator:
    """Open extra stores on the test keyspace with other settings (another node, other levels)."""
    async for make in _stores_on(cassandra_settings):
        yield make


@pytest.fixture
def queue_settings(cassandra_settings: CassandraSettings) -> Iterator[CassandraSettings]:
    """A keyspace of its own, for a test of how the queue's readers move: the test keyspace's
    queue holds what the contract suite left (due rows of deleted entries among them), and its
    shards' low marks are where other tests moved them."""
    settings = dataclasses.replace(cassandra_settings, keyspace=f"cmq_{uuid.uuid4().hex[:8]}")
    cassandra_schema.apply(settings)
    yield settings
    cassandra_schema.drop(settings)


@pytest.fixture
async def make_queue_store(queue_settings: CassandraSettings) -> AsyncIterator:
    async for make in _stores_on(queue_settings):
        yield make


async def new_user(store: CassandraStore) -> str:
    domain = f"c{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    address = f"user@{domain}"
    await store.create_user(address, hash_password("pw", FAST_HASH))
    return address


async def deliver_many(store: CassandraStore, user: str, count: int, mailbox: str = INBOX) -> list[uuid.UUID]:
    limit = asyncio.Semaphore(64)

    async def one(i: int) -> uuid.UUID:
        async with limit:
            return (await store.deliver(b"Subject: %d\r\n\r\nbody\r\n" % i, [Target(user, mailbox)]))[0]

    ids = await asyncio.gather(*(one(i) for i in range(count)))
    return sorted(ids, key=lambda u: (u.time, u.bytes))


async def _cql(store: CassandraStore, query: str, *values: Any) -> list[Any]:
    return await store.cql.run((await asyncio.to_thread(store.session.prepare, query)).bind(values))


async def test_listing_after_mass_deletion_does_not_walk_the_tombstones(make_store) -> None:
    # Two mailboxes never numbered, so alike (a numbered one's listing also reads its anchor row).
    store = await make_store(tombstone_grace=0.0, number_ahead=0)
    user = await new_user(store)
    ids = await deliver_many(store, user, 5000)
    listed = [s.id async for s in store.list_messages(user, INBOX, page_size=1000)]
    assert listed == ids  # arrival order
    await store.delete_messages(user, INBOX, listed[:4990])

    with store.tracing() as after_deletion:
        page = await store.list_page(user, INBOX, limit=500)
    assert [s.id for s in page.items] == listed[4990:]

    # A mailbox of 10, listed from its low-water mark too (a read from the start of a partition
    # also counts its static row, e.g. the changes token).
    fresh = await new_user(store)
    first = await deliver_many(store, fresh, 11)
    await store.delete_messages(fresh, INBOX, first[:1])
    with store.tracing() as ten_messages:
        assert len((await store.list_page(fresh, INBOX, limit=500)).items) == 10

    assert after_deletion.live_rows == ten_messages.live_rows
    assert after_deletion.tombstones <= ten_messages.tombstones + 2
    # The measurement itself sees tombstones: the same read from the start of the partition walks them all.
    mailbox_id = (await store._resolve(user, INBOX)).mailbox_id
    with store.tracing() as unbounded:
        await store.tables.messages.page(mailbox_id, None, 500)
    assert unbounded.tombstones >= 4990


async def test_a_listing_after_the_grace_moves_the_mark_past_recent_deletions(make_store) -> None:
    """A delete cannot move the mark past mail younger than the grace; the first listing after
    the grace does, once, and the next listing reads no tombstones (also in an emptied mailbox)."""
    grace = 4.0
    store = await make_store(tombstone_grace=grace)
    user = await new_user(store)
    await store.create_mailbox(user, "Emptied")
    ids = await deliver_many(store, user, 300)
    gone = await deliver_many(store, user, 200, "Emptied")
    await store.delete_messages(user, INBOX, ids[:290])
    await store.delete_messages(user, "Emptied", gone)
    deleted_at = time.monotonic()

    async def mark(mailbox: str) -> uuid.UUID | None:
        return (await store._resolve(user, mailbox)).low_water

    marks = {name: await mark(name) for name in (INBOX, "Emptied")}
    with store.tracing() as within_grace:
        assert [s.id for s in (await store.list_page(user, INBOX)).items] == ids[290:]
        assert (await store.list_page(user, "Emptied")).items == []
    assert within_grace.tombstones >= 490  # the grace holds the mark below the deleted mail
    assert {name: await mark(name) for name in marks} == marks  # and a listing then writes nothing

    await asyncio.sleep(max(0.0, grace + 0.5 - (time.monotonic() - deleted_at)))
    for name in marks:
        await store.list_page(user, name)  # moves the mark
    moved = {name: await mark(name) for name in marks}
    assert all(moved[name] != marks[name] for name in marks)

    # A mailbox of 10, listed from its low-water mark too (a read from the start of a partition
    # also counts its static row, e.g. the changes token).
    fresh = await new_user(store)
    first = await deliver_many(store, fresh, 11)
    await store.delete_messages(fresh, INBOX, first[:1])
    with store.tracing() as ten_messages:
        assert len((await store.list_page(fresh, INBOX)).items) == 10
    with store.tracing() as inbox:
        assert [s.id for s in (await store.list_page(user, INBOX)).items] == ids[290:]
    with store.tracing() as emptied:
        assert (await store.list_page(user, "Emptied")).items == []
    assert inbox.live_rows == ten_messages.live_rows
    assert inbox.tombstones <= ten_messages.tombstones + 2 and emptied.tombstones <= 2
    # the mark stays put: the next listings read and write nothing more
    await asyncio.sleep(0.2)
    for name in marks:
        await store.list_page(user, name)
    assert {name: await mark(name) for name in marks} == moved
    # mail arriving after the move is listed
    late = await deliver_many(store, user, 5, "Emptied")
    assert [s.id for s in (await store.list_page(user, "Emptied")).items] == late


async def test_deletes_move_the_low_water_mark_at_most_once_per_minute_of_deleted_mail(make_store, monkeypatch) -> None:
    """The first delete of a mailbox moves its mark; a delete of mail less than a minute newer
    than the newest deleted before reads nor writes anything for it (two requests of every
    EXPUNGE); one of mail a minute newer does. Listings stay as they were."""
    store = await make_store(tombstone_grace=0.0)
    user = await new_user(store)
    ids = await deliver_many(store, user, 6)
    calls: list[str] = []
    for name in ("first_live", "set_low_water"):
        table = store.tables.messages if name == "first_live" else store.tables.users
        real = getattr(table, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(table, name, counted)
    await store.delete_messages(user, INBOX, ids[:2])
    assert calls == ["first_live", "set_low_water"]
    calls.clear()
    await store.delete_messages(user, INBOX, ids[2:4])
    assert calls == []
    monkeypatch.setattr(cassandra_module, "new_message_id", lambda: new_message_id(time.time() + 61))
    [later] = await store.deliver(b"Subject: later\r\n\r\nx\r\n", [Target(user)])
    await store.delete_messages(user, INBOX, [later])
    assert calls == ["first_live", "set_low_water"]
    assert [s.id async for s in store.list_messages(user, INBOX)] == ids[4:]


async def test_a_late_message_older_than_the_live_ones_is_still_listed_within_the_grace(make_store, monkeypatch) -> None:
    store = await make_store()  # default grace: hours
    user = await new_user(store)
    first, second = await deliver_many(store, user, 2)
    await store.delete_messages(user, INBOX, [first])
    # A node whose clock is a minute slow delivers now: its id sorts before `second`.
    monkeypatch.setattr(cassandra_module, "new_message_id", lambda: new_message_id(time.time() - 60))
    [late] = await store.deliver(b"late\r\n", [Target(user)])
    monkeypatch.undo()
    assert late.time < second.time
    assert {s.id async for s in store.list_messages(user, INBOX)} == {late, second}


async def test_arrivals_after_a_listing_read_only_the_window_before_it_began(make_store, monkeypatch) -> None:
    """A mailbox whose last burst ended a minute before a listing: the mark from when the listing
    began makes the next look at new arrivals read nothing of that burst (a mark from its newest
    message alone read the burst's last seconds at every look), and still find what came after,
    also a message stamped by a node whose clock is a few seconds behind."""
    store = await make_store()
    user = await new_user(store)
    monkeypatch.setattr(cassandra_module, "new_message_id", lambda: new_message_id(time.time() - 60))
    await deliver_many(store, user, 5)
    monkeypatch.undo()
    started = time.time()
    listed = [s async for s in store.list_messages(user, INBOX)]
    assert len(listed) == 5
    assert len((await store.arrivals(user, INBOX, store.arrivals_mark(listed)))[0]) == 5
    mark = store.arrivals_mark(listed, started)
    found, mark = await store.arrivals(user, INBOX, mark)
    assert found == []
    monkeypatch.setattr(cassandra_module, "new_message_id", lambda: new_message_id(time.time() - 2))
    [behind] = await store.deliver(b"Subject: behind\r\n\r\nx\r\n", [Target(user)])
    monkeypatch.undo()
    [now] = await store.deliver(b"Subject: now\r\n\r\nx\r\n", [Target(user)])
    found, _ = await store.arrivals(user, INBOX, mark)
    assert [s.id for s in found] == [behind, now]


async def test_a_listing_that_numbered_its_mail_takes_in_the_highestmodseq_after_it(make_store, monkeypatch) -> None:
    """A listing whose numbering took every MODSEQ above the HIGHESTMODSEQ read before it (one
    per batch of UIDs, each decided on the one below) knows nothing else changed up to the last
    of them: that is its HIGHESTMODSEQ, without another read, so the next look at changes does
    not read the numbering back. A change by someone else after the numbering is above it, and
    is what that look reads."""
    from cassmail.imap.view import read_listing

    monkeypatch.setattr(cassandra_module, "UID_BATCH", 16)
    store = await make_store()
    user = await new_user(store)
    await deliver_many(store, user, 40)
    before = await store.highest_modseq(user, INBOX)
    listing = await read_listing(store, user, INBOX, 100, highest=True)
    assert len(listing.assigned) == 40 and set(listing.modseqs.values()) == {before + 1, before + 2, before + 3}
    assert listing.highest == await store.highest_modseq(user, INBOX) == before + 3
    assert await store.changes_since(user, INBOX, listing.highest) == ([], [])

    first = (await deliver_many(store, user, 20))[0]
    numbering = store.assign_uids

    async def and_another_change(*args, **kwargs):  # another session's STORE while this one numbers
        got = await numbering(*args, **kwargs)
        await store.store_flags(user, INBOX, [first], ["\\Seen"], "add")
        return got

    monkeypatch.setattr(store, "assign_uids", and_another_change)
    before = await store.highest_modseq(user, INBOX)
    listing = await read_listing(store, user, INBOX, 100, highest=True)
    assert len(listing.assigned) == 20 and set(listing.modseqs.values()) == {before + 1, before + 2}
    assert listing.highest == before + 2 and await store.highest_modseq(user, INBOX) == before + 3
    changed, _ = await store.changes_since(user, INBOX, listing.highest)
    assert [(s.id, s.flags) for s in changed] == [(first, {"\\Seen"})]

    # Another session's change before the numbering: the numbering's MODSEQ is not the one
    # above the listing's, so the listing keeps the one read before it, and both are read.
    second = (await deliver_many(store, user, 5))[0]

    async def another_change_first(*args, **kwargs):
        await store.store_flags(user, INBOX, [first], ["\\Flagged"], "add")
        return await numbering(*args, **kwargs)

    monkeypatch.setattr(store, "assign_uids", another_change_first)
    before = await store.highest_modseq(user, INBOX)
    listing = await read_listing(store, user, INBOX, 100, highest=True)
    assert len(listing.assigned) == 5 and listing.highest == before
    changed, _ = await store.changes_since(user, INBOX, listing.highest)
    assert {s.id: s.flags for s in changed}[first] == {"\\Seen", "\\Flagged"} and second in {s.id for s in changed}


async def test_changes_tell_the_modseq_each_took_over_the_one_below(make_store) -> None:
    """store_flags, delete_messages and append tell the MODSEQ of each message they changed,
    deleted or numbered: the one above the mailbox's HIGHESTMODSEQ as the change found it (so a
    caller up to date to that one is up to date to this one), none for a message left as it
    was; what another node did in between shows as a gap."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 4)
    await store.assign_uids(user, INBOX, ids)
    start = await store.highest_modseq(user, INBOX)
    flagged: dict[uuid.UUID, int] = {}
    await store.store_flags(user, INBOX, ids[:2], ["\\Seen"], "add", modseqs=flagged)
    assert flagged == dict.fromkeys(ids[:2], start + 1)
    unchanged: dict[uuid.UUID, int] = {}
    await store.store_flags(user, INBOX, ids[:2], ["\\Seen"], "add", modseqs=unchanged)
    assert unchanged == {} and await store.highest_modseq(user, INBOX) == start + 1
    await other.store_flags(user, INBOX, [ids[3]], ["\\Flagged"], "add")  # start + 2, another's
    deleted: dict[uuid.UUID, int] = {}
    await store.delete_messages(user, INBOX, [ids[0], ids[1], uuid.uuid1()], modseqs=deleted)
    assert deleted == dict.fromkeys(ids[:2], start + 3)
    numbered: dict[uuid.UUID, int] = {}
    appended = await store.append(b"Subject: new\r\n\r\nx\r\n", Target(user), modseqs=numbered)
    new_id, uid = appended.id, appended.uid
    assert appended.modseq == start + 4 and uid == 5 and numbered == {new_id: start + 4} and await store.highest_modseq(user, INBOX) == start + 4
    changed, gone = await store.changes_since(user, INBOX, start + 3)
    assert [(s.id, s.modseq) for s in changed] == [(new_id, start + 4)] and gone == []


async def test_a_sessions_calls_reuse_the_mailbox_row_for_mailbox_cache_and_delivery_never(make_store) -> None:
    store = await make_store(mailbox_cache=0.5)
    other = await make_store()  # another node
    user = await new_user(store)
    reads = 0
    real = store.tables.users.mailbox

    async def counted(*args: object) -> object:
        nonlocal reads
        reads += 1
        return await real(*args)

    store.tables.users.mailbox = counted  # type: ignore[method-assign]
    [message_id] = await store.deliver(b"Subject: x\r\n\r\nx\r\n", [Target(user)])
    assert reads == 1
    for _ in range(3):  # what an IMAP command makes: one read of the row for all of them
        await store.changes_token(user, INBOX)
        await store.highest_modseq(user, INBOX)
        await store.store_flags(user, INBOX, [message_id], ["\\Seen"], "add")
        await store.get_summaries(user, INBOX, [message_id])
    assert reads == 1
    await store.deliver(b"Subject: y\r\n\r\ny\r\n", [Target(user)])
    assert reads == 2  # delivery reads it every time
    await store.delete_messages(user, INBOX, [message_id])  # an EXPUNGE: the row just read does
    assert reads == 2 and await store.get_summaries(user, INBOX, [message_id]) == {}
    # A rename made by this store is seen at once; one made by another node after mailbox_cache.
    await store.create_mailbox(user, "Old")
    info = await store.mailbox_info(user, "Old")
    await store.rename_mailbox(user, "Old", "New")
    with pytest.raises(NoSuchMailbox):
        await store.mailbox_info(user, "Old")
    assert (await store.mailbox_info(user, "New")).uidvalidity == info.uidvalidity
    await other.delete_mailbox(user, "New")
    await asyncio.sleep(0.6)
    with pytest.raises(NoSuchMailbox):
        await store.mailbox_info(user, "New")


async def test_change_events_of_many_deliveries_go_out_together_and_every_mailbox_is_reported(
    make_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One event write in flight per store, begun a linger after the first change: the mailboxes
    changed meanwhile go in the next write, one batch, and another node's watcher hears of every
    one of them."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    names = [f"Box{i}" for i in range(30)]
    for name in names:
        await store.create_mailbox(user, name)
    watched = [(user, name) for name in names]
    _, cursor = await other.changed_mailboxes(watched, None)
    writes: list[int] = []
    events = store.tables.mailbox_events.insert_statement(0, new_message_id(), uuid.uuid4()).prepared_statement.query_id
    real = store.cql.run

    async def counted(statement: object) -> object:
        if isinstance(statement, BatchStatement):
            rows = sum(1 for _, query_id, _ in statement._statements_and_parameters if query_id == events)
        else:
            rows = int(getattr(getattr(statement, "prepared_statement", None), "query_id", None) == events)
        if rows:
            writes.append(rows)
        return await real(statement)

    store.cql.run = counted  # type: ignore[method-assign]
    await asyncio.gather(*(store.deliver(b"Subject: e\r\n\r\ne\r\n", [Target(user, name)]) for name in names))
    await store._settle_events()
    assert sum(writes) == len(names)  # an event for each mailbox, none twice
    assert len(writes) < len(names) and max(writes) > 1  # in fewer writes than deliveries
    # Changes one after the other (a session's commands) within the linger: one write for all.
    monkeypatch.setattr(cassandra_events, "EVENT_LINGER", 1.0)
    writes.clear()
    for name in names[:5]:
        await store.deliver(b"Subject: f\r\n\r\nf\r\n", [Target(user, name)])
    await store._settle_events()
    assert writes == [5]
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + 10
    while seen != set(watched) and time.monotonic() < deadline:
        changed, cursor = await other.changed_mailboxes(watched, cursor)
        seen |= changed
        await asyncio.sleep(0.1)
    assert seen == set(watched)
    with other.tracing() as poll:
        await other.changed_mailboxes(watched, cursor)
    assert poll.statements == 1  # the partitions of the last few seconds, in one request


async def test_consistency_levels_come_from_settings(make_store) -> None:
    store = await make_store(read_consistency="LOCAL_ONE", write_consistency="QUORUM", serial_consistency="LOCAL_SERIAL")
    tables = store.tables
    assert tables.messages.prepared["page"].consistency_level == ConsistencyLevel.LOCAL_ONE
    assert tables.body_chunks.prepared["insert"].consistency_level == ConsistencyLevel.QUORUM
    assert tables.messages.prepared["insert"].consistency_level == ConsistencyLevel.QUORUM
    assert tables.messages.prepared["state"].consistency_level == ConsistencyLevel.LOCAL_SERIAL
    assert tables.users.prepared["create"].serial_consistency_level == ConsistencyLevel.LOCAL_SERIAL


async def test_a_read_that_timed_out_without_its_replicas_is_tried_once_through_the_next_node(make_store) -> None:
    """The store's retry policy (cassandra_cql.ReadRetryPolicy): a read whose coordinator heard
    too few replicas in time goes once more through the next node of its plan; a Paxos read's
    timeout is left to Cql.run's pauses, and the driver's own rules stay for the rest."""
    from cassandra import WriteType

    from cassmail.store.cassandra_cql import ReadRetryPolicy

    store = await make_store()
    policy = store._cluster.profile_manager.default.retry_policy
    assert isinstance(policy, ReadRetryPolicy)
    one, quorum, serial = ConsistencyLevel.ONE, ConsistencyLevel.QUORUM, ConsistencyLevel.SERIAL
    assert policy.on_read_timeout(None, one, 1, 0, False, 0) == (policy.RETRY_NEXT_HOST, None)
    assert policy.on_read_timeout(None, quorum, 2, 1, True, 0) == (policy.RETRY_NEXT_HOST, None)
    assert policy.on_read_timeout(None, one, 1, 0, False, 1) == (policy.RETHROW, None)  # once only
    assert policy.on_read_timeout(None, serial, 2, 1, False, 0) == (policy.RETHROW, None)
    assert policy.on_read_timeout(None, quorum, 2, 2, False, 0) == (policy.RETRY, quorum)  # (the driver's)
    assert policy.on_write_timeout(None, quorum, WriteType.SIMPLE, 2, 1, 0) == (policy.RETHROW, None)


@pytest.mark.parametrize("version", [4, 5])
async def test_the_native_protocol_version_comes_from_settings_and_carries_bodies_of_many_chunks(make_store,
                                                                                                  version) -> None:
    store = await make_store(protocol_version=version, chunk_size=4096)
    assert store._cluster.protocol_version == version
    user = await new_user(store)
    body = b"Subject: v%d\r\n\r\n" % version + bytes(range(256)) * 700  # 44 chunks
    [message_id] = await store.deliver(body, [Target(user)])
    assert b"".join([c async for c in store.read_chunks(user, INBOX, message_id)]) == body


async def test_the_drivers_connections_write_each_request_whole_and_read_in_large_pieces(make_store) -> None:
    """One send() per request: in the driver's 4 KiB pieces, Nagle's algorithm held each request's
    second piece for Cassandra's delayed ACK (40 ms), which made a submission's DATA take 47 ms
    on an idle server. And a recv() of up to IN_BUFFER_SIZE bytes, where the driver reads 4 KiB
    (CPU per body read). (`out_buffer_size` and `in_buffer_size` are the driver's class
    attributes: this fails loudly if they change.) A body of many chunks still reads back whole."""
    from cassandra.connection import Connection

    from cassmail.store.cassandra_io import IN_BUFFER_SIZE

    store = await make_store()
    await new_user(store)  # some traffic: every pool has its connection
    connections = [c for pool in store.session.get_pools() for c in pool.get_connections()]
    assert connections
    assert Connection.out_buffer_size == 4096, "the driver's write size changed: measure the store again"
    assert Connection.in_buffer_size == 4096, "the driver's read size changed: measure the store again"
    assert all(c.out_buffer_size == 1 << 20 and c.in_buffer_size == IN_BUFFER_SIZE for c in connections)
    user = await new_user(store)
    body = b"Subject: big\r\n\r\n" + os.urandom(3 * IN_BUFFER_SIZE).hex().encode()
    [message_id] = await store.deliver(body, [Target(user)])
    assert b"".join([c async for c in store.read_chunks(user, INBOX, message_id)]) == body


@pytest.mark.parametrize("version, read_size", [(4, 7), (4, 4096), (4, None), (5, None)])
async def test_a_serving_stores_connections_frame_answers_however_the_bytes_are_cut(cassandra_settings, monkeypatch,
                                                                                     version, read_size) -> None:
    """A worker's connections cut Cassandra's answers into frames themselves (cassandra_io,
    protocol v4; v5's checksummed segments stay the driver's): many reads at once, small answers
    and large ones, come back whole whether a recv() holds several frames, part of a header
    (7 bytes a read) or part of a body. (The driver's frame header and `process_msg` are its
    internals: this fails loudly if they change.)"""
    from cassandra.connection import Connection, _Frame, frame_header_v3

    from cassmail.store import cassandra_io

    assert frame_header_v3.format == ">BhBi" and callable(getattr(Connection, "process_msg", None))
    assert _Frame(4, 0, 1, 8, 9, 19).end_pos == 19 and Connection._is_checksumming_enabled is False
    if read_size:
        monkeypatch.setattr(cassandra_io.LoopConnection, "in_buffer_size", read_size)
    settings = dataclasses.replace(cassandra_settings, protocol_version=version, chunk_size=65536)
    async with CassandraStore(settings, loop_io=True) as store:
        user = await new_user(store)
        bodies = [b"Subject: %d\r\n\r\n" % n + os.urandom(n).hex().encode() for n in (10, 40_000, 300_000, 1_100_000)]
        ids = [(await store.deliver(body, [Target(user)]))[0] for body in bodies]

        async def read(message_id: uuid.UUID) -> bytes:
            return b"".join([c async for c in store.read_chunks(user, INBOX, message_id)])

        for _ in range(3):
            got = await asyncio.gather(*(read(i) for i in ids), *(store.uid_next(user, INBOX) for _ in range(20)))
            assert got[:4] == bodies and got[4:] == [1] * 20
        connections = [c for pool in store.session.get_pools() for c in pool.get_connections()]
        assert connections and all(isinstance(c, cassandra_io.LoopConnection) for c in connections)
        # v5 hands its segments to the driver once READY is answered; v4 never does
        assert all(c._is_checksumming_enabled == (version == 5) for c in connections)
        assert all(not c._body_missing and not c._head for c in connections)


@pytest.mark.parametrize("header", [b"\x02\x00\x00\x01\x08\x00\x00\x00\x00",  # a v2 header
                                    b"\x84\x00\x00\x01\x08\xff\xff\xff\xff"])  # a negative length
def test_a_worker_connection_that_reads_what_is_not_a_frame_is_defunct(header: bytes) -> None:
    """Bytes from Cassandra that are not a CQL v3+ frame end the connection (the driver then fails
    what was in flight on it and reconnects): no traceback on the loop, no frame made up. The
    connection is one end of a socket pair: the fault cannot be had from a real node."""
    import socket

    from cassmail.store.cassandra_io import LoopConnection

    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        connection = object.__new__(LoopConnection)
        connection._socket, connection._is_checksumming_enabled = ours, False
        connection._start_framing()
        connection.is_closed = connection.is_defunct = False
        failures: list[Exception] = []
        connection.defunct = lambda exc: (failures.append(exc), setattr(connection, "is_defunct", True))
        connection.process_msg = lambda frame, body: pytest.fail(f"a frame was made of {header!r}")
        theirs.sendall(header + b"x" * 40)
        connection._readable()
        assert len(failures) == 1 and "not a CQL frame" in str(failures[0]) and connection.is_defunct


async def test_the_driver_makes_uuids_and_timeuuids_with_the_stores_quick_constructor(make_store) -> None:
    """The driver decodes uuid and timeuuid values where cassandra_cql.decode_uuids_fast expects
    (its hooks are the driver's internals: this fails loudly if they move), and what comes back
    is a UUID like any other: equal, hashed, ordered by time and printed as uuid.UUID's."""
    from cassandra import cqltypes, deserializers

    from cassmail.model import uuid_from_bytes
    from cassmail.store.cassandra_cql import _uuid_from_bytes, decode_uuids_fast

    store = await make_store()
    assert decode_uuids_fast(), "the driver's uuid decoding moved: see cassandra_cql.decode_uuids_fast"
    assert cqltypes.TimeUUIDType.deserialize is uuid_from_bytes and cqltypes.UUIDType.deserialize is uuid_from_bytes
    assert deserializers.UUID is _uuid_from_bytes
    user = await new_user(store)
    ids = await deliver_many(store, user, 3)
    listed = [s.id async for s in store.list_messages(user, INBOX)]
    assert listed == ids and all(type(i) is uuid.UUID for i in listed)
    assert [(str(a), hash(a), a.time, a.version) for a in listed] == [(str(b), hash(b), b.time, b.version) for b in ids]
    from cassandra.query import SimpleStatement

    [row] = await store.cql.run(SimpleStatement("SELECT uuid() AS u, now() AS t FROM system.local"))
    assert type(row.u) is uuid.UUID and row.u.version == 4 and type(row.t) is uuid.UUID and row.t.version == 1
    with pytest.raises(ValueError):
        _uuid_from_bytes(bytes=b"short")


async def test_a_serving_stores_connections_are_served_by_its_event_loop(cassandra_settings) -> None:
    """A worker's store (`loop_io`) has its connections read and written by the loop that opened
    it (cassandra_io): the driver calls back on the loop's thread. The driver's blocking calls
    still work from another thread, and on the loop they fail at once instead of waiting for
    ever for an answer only the loop would read. Any other store keeps the driver's thread.
    (This uses the driver's `Connection` internals that cassandra_io names: it fails loudly if
    they change.)"""
    import threading

    from cassandra.connection import Connection

    from cassmail.store.cassandra_io import LoopConnection

    for name in ("_connect_socket", "_send_options_message", "process_io_buffer", "defunct",
                 "error_all_requests", "create_timer", "send_msg", "close"):
        assert callable(getattr(Connection, name, None)), f"the driver changed: Connection.{name}"
    version = SimpleStatement("SELECT release_version FROM system.local")
    async with CassandraStore(cassandra_settings, loop_io=True) as store:
        user = await new_user(store)
        connections = [c for pool in store.session.get_pools() for c in pool.get_connections()]
        assert connections and all(isinstance(c, LoopConnection) for c in connections)
        assert all(c.loop is asyncio.get_running_loop() and hasattr(c, "_iobuf") for c in connections)
        called_on: list[int] = []
        store.session.execute_async(version).add_callback(lambda rows: called_on.append(threading.get_ident()))
        [row] = await store.cql.run(version)
        assert row.release_version
        while not called_on:
            await asyncio.sleep(0.01)
        assert called_on == [threading.get_ident()]
        # another thread's request goes through the loop; the loop's own blocking call is refused
        rows = await asyncio.to_thread(store.session.execute, version)
        assert rows.one().release_version == row.release_version
        with pytest.raises(RuntimeError, match="blocks"):
            store.session.execute(version)
        assert await store.uid_next(user, INBOX) == 1  # and the store goes on
    async with CassandraStore(cassandra_settings) as store:
        connections = [c for pool in store.session.get_pools() for c in pool.get_connections()]
        assert connections and not any(isinstance(c, LoopConnection) for c in connections)
        assert (await asyncio.to_thread(store.session.execute, version)).one().release_version == row.release_version


async def test_a_connection_cassandra_closes_fails_its_requests_and_the_store_reconnects(cassandra_settings) -> None:
    """When Cassandra closes a connection of a worker's store (seen by the loop as the end of its
    stream), what was in flight on it fails as StoreUnavailable, nothing hangs, and the driver's
    new connection serves the store again."""
    import socket

    async with CassandraStore(cassandra_settings, loop_io=True) as store:
        user = await new_user(store)
        [connection] = [c for pool in store.session.get_pools() for c in pool.get_connections()]
        pending = asyncio.ensure_future(store.cql.run(SimpleStatement("SELECT release_version FROM system.local")))
        connection._socket.shutdown(socket.SHUT_RDWR)  # (as if Cassandra closed it)
        try:
            await asyncio.wait_for(pending, 10)
        except StoreUnavailable:
            pass  # (or it was answered before the end was seen: either is right)
        assert connection.is_closed or connection.is_defunct
        deadline = time.monotonic() + 30
        while True:
            try:
                assert await store.uid_next(user, INBOX) == 1
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the store did not reconnect"
                await asyncio.sleep(0.2)
        [again] = [c for pool in store.session.get_pools() for c in pool.get_connections()]
        assert again is not connection and not again.is_closed


async def test_a_batch_takes_statements_with_values_serialized_by_the_store(make_store) -> None:
    """`add_serialized` puts a prepared statement with values the store serialized into a batch
    through the driver's private `BatchStatement._add_statement_and_params` (the numbering's
    thousands of statements a batch, `Messages.add_first_uids`): this fails loudly if the driver
    changes it. The UIDs, MODSEQs and MODSEQ records written so read back as bound ones do."""
    from cassmail.store.cassandra_tables import record_id

    assert callable(getattr(BatchStatement, "_add_statement_and_params", None)), "the driver changed: see add_serialized"
    store = await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 3)
    mailbox_id = (await store._resolve(address_key(user), INBOX)).mailbox_id
    batch = store.cql.batch(conditional=True)
    store.tables.messages.add_first_uids(batch, mailbox_id, ids, 2**40, 7)
    assert len(batch) == 4  # a UID each, and one MODSEQ record of the run
    applied, _ = await store.cql.conditional(batch)
    assert applied
    rows = {r.id: r for r in await store.tables.messages.state(mailbox_id, ids)}
    assert [(rows[i].uid, rows[i].modseq) for i in ids] == [(2**40 + n, 7) for n in range(3)]
    [record] = await store.tables.messages.records(mailbox_id, 6)
    assert (record.uid, record.changed_id, record.changed_last) == (2**40, ids[0], ids[-1])
    assert record_id(7, 2**40).time == 7 and record_id(7, 2**40).node == 2**40
    again = store.cql.batch(conditional=True)  # numbered now: the condition holds no more
    store.tables.messages.add_first_uids(again, mailbox_id, ids[:1], 1, 8)
    assert (await store.cql.conditional(again))[0] is False


async def test_too_few_replicas_for_the_write_level_is_unavailable_and_shows_nothing(cassandra_settings) -> None:
    """RF=3 on a one-node cluster: QUORUM writes cannot succeed, ONE writes can."""
    settings = dataclasses.replace(cassandra_settings, keyspace=f"cmrf3_{uuid.uuid4().hex[:8]}", write_consistency="ONE")
    cassandra_schema.apply(settings)
    try:
        async with CassandraStore(settings) as one:
            user = await new_user(one)  # account creation is a Paxos round: it needs a quorum, so before RF=3
        cassandra_schema.apply(dataclasses.replace(settings, replication_factor=3))
        async with CassandraStore(settings) as one, CassandraStore(
            dataclasses.replace(settings, write_consistency="QUORUM")
        ) as quorum:
            with pytest.raises(StoreUnavailable) as err:
                await quorum.deliver(b"Subject: x\r\n\r\nx\r\n", [Target(user)])
            assert "Cannot achieve consistency level QUORUM" in str(err.value)
            assert [s async for s in one.list_messages(user, INBOX)] == []
            await one.deliver(b"ok\r\n", [Target(user)])
            assert len([s async for s in one.list_messages(user, INBOX)]) == 1
    finally:
        cassandra_schema.drop(settings)


async def test_a_delivery_that_fails_before_its_rows_are_written_is_invisible(make_store, monkeypatch) -> None:
    store = await make_store()
    user = await new_user(store)
    async def failing_insert(*params: object) -> None:
        raise StoreUnavailable("injected: write timeout")

    monkeypatch.setattr(store.tables.messages, "insert", failing_insert)
    with pytest.raises(StoreUnavailable):
        await store.deliver(b"x" * 200_000, [Target(user)])
    monkeypatch.undo()
    assert [s async for s in store.list_messages(user, INBOX)] == []


async def test_an_unreachable_cassandra_is_unavailable_with_a_clear_message() -> None:
    settings = CassandraSettings(contact_points=["127.0.0.1"], port=1, connect_timeout=2.0)
    with pytest.raises(StoreUnavailable) as err:
        await CassandraStore(settings).open()
    assert "cannot reach Cassandra at 127.0.0.1:1" in str(err.value)


async def test_a_request_that_times_out_is_unavailable(make_store) -> None:
    store = await make_store()
    user = await new_user(store)
    store.settings = dataclasses.replace(store.settings, request_timeout=0.000001)
    with pytest.raises(StoreUnavailable):
        await store.deliver(b"x" * 300_000, [Target(user)])


async def test_a_listing_numbers_what_it_found_while_it_reads_on(make_store, monkeypatch) -> None:
    """A listing starts numbering once it has found NUMBER_WHILE_LISTING unnumbered messages (10
    here) and goes on reading meanwhile; what it finds while a call runs goes into the next.
    The UIDs follow the listing's order, and the HIGHESTMODSEQ after the numbering is taken in
    as with one call."""
    from cassmail.imap import view
    from cassmail.imap.view import read_listing

    monkeypatch.setattr(view, "NUMBER_WHILE_LISTING", 10)
    monkeypatch.setattr(cassandra_module, "UID_BATCH", 8)
    store = await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 45)
    listed: list[uuid.UUID] = []
    calls: list[tuple[int, int]] = []  # (messages listed when a call began, ids it was given)
    listing_of, numbering = store.list_messages, store.assign_uids

    async def counted(*args, **kwargs):
        async for summary in listing_of(*args, **kwargs):
            listed.append(summary.id)
            yield summary

    async def noted(user_, mailbox, asked, **kwargs):
        calls.append((len(listed), len(asked)))
        return await numbering(user_, mailbox, asked, **kwargs)

    monkeypatch.setattr(store, "list_messages", counted)
    monkeypatch.setattr(store, "assign_uids", noted)
    before = await store.highest_modseq(user, INBOX)
    listing = await read_listing(store, user, INBOX, 5, highest=True)
    assert len(calls) >= 2 and calls[0][0] < 45  # the first while the listing read on
    assert sum(n for _, n in calls) == 45
    assert [listing.assigned[i] for i in ids] == list(range(1, 46))
    assert listing.highest == await store.highest_modseq(user, INBOX) > before


async def test_a_listing_nothing_else_changed_is_numbered_without_reading_each_message_again(
        make_store, monkeypatch) -> None:
    """A listing's numbering checks each message in its batches (a read inside the Paxos round)
    only when the listing may be out of date: when the SERIAL read finds a MODSEQ taken since
    the HIGHESTMODSEQ read before the listing that is not the listing's own. Here another node
    numbers a message after the listing read it: the batches from then on check, the one with
    that message does not apply and is decided again on a read, and no UID is given twice."""
    from cassmail.imap import view
    from cassmail.imap.view import read_listing

    monkeypatch.setattr(view, "NUMBER_WHILE_LISTING", 10)
    monkeypatch.setattr(cassandra_module, "UID_BATCH", 4)
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    checks: list[bool] = []
    adding = store.tables.messages.add_first_uids

    def noted(*args, checked=True, **kwargs):
        checks.append(checked)
        return adding(*args, checked=checked, **kwargs)

    monkeypatch.setattr(store.tables.messages, "add_first_uids", noted)
    ids = await deliver_many(store, user, 45)
    listing = await read_listing(store, user, INBOX, 5, highest=True)
    assert [listing.assigned[i] for i in ids] == list(range(1, 46))
    assert checks and not any(checks)  # nothing else changed: no message read again
    assert listing.highest == await store.highest_modseq(user, INBOX)

    more = await deliver_many(store, user, 45)
    listing_of = store.list_messages
    taken: dict[uuid.UUID, int] = {}

    async def and_elsewhere(*args, **kwargs):
        async for summary in listing_of(*args, **kwargs):
            yield summary
            if summary.id == more[33]:  # listed unnumbered; numbered elsewhere before this listing's turn
                taken.update(await other.assign_uids(user, INBOX, [summary.id]))

    monkeypatch.setattr(store, "list_messages", and_elsewhere)
    checks.clear()
    listing = await read_listing(store, user, INBOX, 5, highest=True)
    assert taken and any(checks) and not all(checks)
    listed = {s.id: s.uid async for s in store.list_messages(user, INBOX)}
    assert sorted(listed.values()) == list(range(1, 91))  # every message one UID, none given twice
    assert listed[more[33]] == taken[more[33]]
    assert {i: listed[i] for i in listing.assigned} == listing.assigned


def test_reads_see_writes_where_the_replicas_they_touch_overlap() -> None:
    from cassandra.metadata import NetworkTopologyStrategy, SimpleStrategy

    from cassmail.store.cassandra_cql import reads_see_writes

    one, three = SimpleStrategy({"replication_factor": "1"}), SimpleStrategy({"replication_factor": "3"})
    two_centres = NetworkTopologyStrategy({"dc1": "3", "dc2": "3"})
    level = ConsistencyLevel
    assert reads_see_writes(level.ONE, level.ONE, one)
    assert not reads_see_writes(level.ONE, level.ONE, three)
    assert reads_see_writes(level.QUORUM, level.QUORUM, three)
    assert reads_see_writes(level.LOCAL_QUORUM, level.LOCAL_QUORUM, three)
    assert reads_see_writes(level.ONE, level.ALL, three)
    assert not reads_see_writes(level.ONE, level.QUORUM, three)
    assert reads_see_writes(level.QUORUM, level.QUORUM, two_centres)
    assert not reads_see_writes(level.LOCAL_QUORUM, level.LOCAL_QUORUM, two_centres)
    assert not reads_see_writes(level.ONE, level.ONE, object())


async def test_numbering_in_many_batches_on_two_nodes_at_once_gives_each_message_one_uid(
        make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large mailbox is numbered in batches of UID_BATCH rows, a Paxos round each: made 16 here,
    so 120 messages take eight batches, interleaved with another node's numbering of a part."""
    from cassmail.store import cassandra

    monkeypatch.setattr(cassandra, "UID_BATCH", 16)
    node_a, node_b = await make_store(), await make_store()
    user = await new_user(node_a)
    ids = await deliver_many(node_a, user, 120)
    results = await asyncio.gather(node_a.assign_uids(user, INBOX, ids), node_b.assign_uids(user, INBOX, ids[40:]))
    final = await node_b.assign_uids(user, INBOX, ids)
    assert sorted(final.values()) == list(range(1, 121))
    for result in results:
        assert {i: final[i] for i in result} == result
    assert await node_a.uid_next(user, INBOX) == 121


def serial_reads(store: CassandraStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the SERIAL reads of rows (`state`, `state_slice`) the store makes from now on."""
    reads: list[str] = []
    for name in ("state", "state_slice"):
        def spy(*args: object, _read=getattr(store.tables.messages, name), _name=name) -> object:
            reads.append(_name)
            return _read(*args)
        monkeypatch.setattr(store.tables.messages, name, spy)
    return reads


async def test_numbering_reads_once_and_reads_again_where_a_message_was_numbered_or_deleted_meanwhile(
        make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Numbering in many batches decides the first on a SERIAL read and each later one on what
    the one before left: a read for 64 messages in batches of 16. A later batch applies only if
    each of its messages is still there and unnumbered, so one whose messages another node
    numbered or deleted since the listing is decided again on a read."""
    from cassmail.store import cassandra

    monkeypatch.setattr(cassandra, "UID_BATCH", 16)
    node_a, node_b = await make_store(), await make_store()
    user = await new_user(node_a)
    reads = serial_reads(node_a, monkeypatch)

    ids = await deliver_many(node_a, user, 64)
    modseqs: dict[uuid.UUID, int] = {}
    given = await node_a.assign_uids(user, INBOX, ids, modseqs=modseqs)
    assert list(given) == ids and list(given.values()) == list(range(1, 65))
    assert len(reads) == 1
    assert sorted(set(modseqs.values())) == [2, 3, 4, 5] and await node_a.highest_modseq(user, INBOX) == 5
    # The later batches' MODSEQ records are one per run (schema 015), read back as their messages:
    changed, _ = await node_b.changes_since(user, INBOX, 2)
    assert [(s.id, s.uid, s.modseq) for s in changed] == [(i, n + 1, 3 + (n - 16) // 16) for n, i in enumerate(ids)][16:]
    await node_b.store_flags(user, INBOX, [ids[20]], ["\\Seen"], "add")  # a message of a run changes again
    changed, _ = await node_b.changes_since(user, INBOX, 4)
    assert [s.uid for s in changed] == [21, *range(49, 65)]
    assert [s.uid for s in (await node_b.changes_since(user, INBOX, 5))[0]] == [21]

    more = await deliver_many(node_a, user, 64)  # listed unnumbered; then, elsewhere:
    taken = await node_b.assign_uids(user, INBOX, [more[20], more[40]])
    assert sorted(taken.values()) == [65, 66]
    await node_b.delete_messages(user, INBOX, [more[50]])
    reads.clear()
    given = await node_a.assign_uids(user, INBOX, more)
    assert len(reads) == 4  # the first batch, and the three whose messages changed
    assert given[more[20]] == 65 and given[more[40]] == 66 and more[50] not in given
    listed = {s.id: s.uid async for s in node_a.list_messages(user, INBOX)}
    assert {i: listed[i] for i in given} == given
    assert sorted(listed.values()) == list(range(1, 128))  # every message one UID, none given twice
    assert await node_a.uid_next(user, INBOX) == 128


async def test_a_run_of_new_mail_is_read_as_a_slice_and_ids_spread_among_others_by_key(
        make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Numbering reads the rows it decides on at SERIAL: a run of ids as the slice from the first
    to the last (other rows in it are read and left alone), ids spread among many others by key.
    Either way exactly the ids asked for are numbered, in their order."""
    store = await make_store()
    user = await new_user(store)
    ids = [(await store.deliver(b"Subject: %d\r\n\r\nx\r\n" % i, [Target(user)]))[0] for i in range(300)]
    reads = serial_reads(store, monkeypatch)

    async def numbered(asked: list[uuid.UUID]) -> dict[uuid.UUID, int]:
        reads.clear()
        given = await store.assign_uids(user, INBOX, asked)
        assert list(given) == asked and list(given.values()) == sorted(given.values())
        return given

    assert list((await numbered(ids[:100])).values()) == list(range(1, 101))
    assert reads == ["state_slice"]
    await numbered(ids[100::2])  # among as many unnumbered ones, which stay so
    assert reads == ["state_slice"]
    spread = ids[101:300:4]  # 50 ids among 200 rows: the slice is too full, so by key
    monkeypatch.setattr(cassandra_module, "STATE_SLICE_MIN", 32)  # (under 64 ids are read by key anyway)
    await numbered(spread)
    assert reads == ["state_slice", "state"]
    listed = {s.id: s.uid async for s in store.list_messages(user, INBOX)}
    assert sorted(i for i, uid in listed.items() if uid) == sorted(ids[:100] + ids[100::2] + spread)
    assert sorted(uid for uid in listed.values() if uid) == list(range(1, 251))


async def test_mail_delivered_in_bulk_to_one_mailbox_is_numbered_in_the_background(make_store) -> None:
    """store.cassandra.number_ahead (50 here): once a process delivered that many messages to one
    mailbox, it gives them UIDs in the background, while delivery goes on; what is left under the
    threshold, and a mailbox that got less, wait for their next listing."""
    store = await make_store(number_ahead=50)
    user, quiet = await new_user(store), await new_user(store)
    ids = await deliver_many(store, user, 120)
    await deliver_many(store, quiet, 49)

    async def uids(address: str) -> dict[uuid.UUID, int | None]:
        return {s.id: s.uid async for s in store.list_messages(address, INBOX)}

    for _ in range(200):  # until the numberings started by the deliveries are done
        if not store._ahead._running:
            break
        await asyncio.sleep(0.05)
    assert not store._ahead._running
    # Each numbering takes every id noted when it starts: the first 50, then the 50 or more that
    # came while it ran (how many more depends on the timing), so 100 to 120 are numbered, and
    # exactly the ids noted since (fewer than 50) are not.
    listed = await uids(user)
    numbered = sorted(uid for uid in listed.values() if uid)
    assert 100 <= len(numbered) <= 120 and numbered == list(range(1, len(numbered) + 1))
    assert await store.uid_next(user, INBOX) == len(numbered) + 1
    assert not any((await uids(quiet)).values())
    left = [i for i in ids if not listed[i]]
    mailbox_id = (await store._resolve(address_key(user), INBOX)).mailbox_id
    assert sorted(left) == sorted(store._ahead._noted.get(mailbox_id, (0.0, []))[1])
    assert sorted((await store.assign_uids(user, INBOX, left)).values()) == list(range(len(numbered) + 1, 121))
    status = await store.mailbox_status(user, INBOX, recent=True)  # the counts follow the numberings
    assert (status.messages, status.unseen, status.uid_next, status.recent) == (120, 120, 121, 120)
    # A deletion waits for the numbering of its mailbox, so no numbered row outlives its message.
    emptied = await new_user(store)
    doomed = await deliver_many(store, emptied, 60)  # a numbering starts at the 50th
    await store.delete_messages(emptied, INBOX, doomed)
    mailbox_id = (await store._resolve(address_key(emptied), INBOX)).mailbox_id
    assert [r.id for r in await store.tables.messages.page(mailbox_id, None, 500) if r.uid and r.size is None] == []
    assert [s async for s in store.list_messages(emptied, INBOX)] == []


async def test_two_nodes_assigning_uids_at_once_never_collide(make_store) -> None:
    node_a, node_b = await make_store(), await make_store()
    user = await new_user(node_a)
    everything: list[uuid.UUID] = []
    for _ in range(5):  # rounds of new mail seen by four sessions on two nodes at once
        ids = await deliver_many(node_a, user, 100)
        everything += ids
        results = await asyncio.gather(
            node_a.assign_uids(user, INBOX, ids),
            node_b.assign_uids(user, INBOX, ids),
            node_b.assign_uids(user, INBOX, ids[50:]),
            node_a.assign_uids(user, INBOX, ids[25:75]),
        )
        final = await node_a.assign_uids(user, INBOX, everything)
        for result in results:
            mismatched = {i: (uid, final[i]) for i, uid in result.items() if final[i] != uid}
            assert not mismatched, f"{len(mismatched)} ids got two UIDs"
        assert len(set(final.values())) == len(everything)
    assert await node_b.uid_next(user, INBOX) == max(final.values()) + 1


async def test_a_paxos_round_that_times_out_under_contention_is_read_again_not_unavailable(make_store,
                                                                                          monkeypatch) -> None:
    """Sessions on two coordinators contend for one mailbox's counter: Cassandra then answers a CAS
    write timeout (the round's outcome unknown). UID assignment and \\Recent claims read the state
    again and go on; here the first round of each is made to time out after it applied."""
    from cassandra import ConsistencyLevel as CL, WriteTimeout, WriteType

    store = await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 3)
    real, timed_out = store.cql.run, []

    async def applies_then_times_out(statement):
        rows = await real(statement)
        if isinstance(statement, BatchStatement) and statement.serial_consistency_level is not None \
                and len(timed_out) < 2:
            timed_out.append(statement)
            try:
                raise WriteTimeout("CAS operation timed out", consistency=CL.SERIAL, required_responses=1,
                                   received_responses=0, write_type=WriteType.CAS)
            except WriteTimeout as exc:
                raise StoreUnavailable(f"Cassandra: {exc}") from exc
        return rows

    monkeypatch.setattr(store.cql, "run", applies_then_times_out)
    uids = await store.assign_uids(user, INBOX, ids)
    assert sorted(uids.values()) == [1, 2, 3] and len(timed_out) == 1
    assert await store.claim_recent(user, INBOX, 4) == 4  # its own timed-out claim: it claims nothing
    assert len(timed_out) == 2 and await store.recent_mark(user, INBOX) == 4
    monkeypatch.undo()
    assert await store.assign_uids(user, INBOX, ids) == uids


async def test_two_nodes_renumbering_one_message_give_it_one_new_uid(make_store) -> None:
    """Sessions on two nodes that both saw a message with a UID below what they had shown renumber
    it at once, while a third assigns new mail: one new UID for it, none handed out twice."""
    node_a, node_b = await make_store(), await make_store()
    user = await new_user(node_a)
    ids = await deliver_many(node_a, user, 20)
    first = await node_a.assign_uids(user, INBOX, ids)
    fresh = await deliver_many(node_a, user, 10)
    old = ids[7]
    results = await asyncio.gather(
        *(node.assign_uids(user, INBOX, [old], renumber={old: first[old]}) for node in (node_a, node_b) * 3),
        node_b.assign_uids(user, INBOX, fresh),
    )
    renumbered = {r[old] for r in results[:-1]}
    assert len(renumbered) == 1 and renumbered.pop() > max(first.values())
    final = await node_b.assign_uids(user, INBOX, ids + fresh)
    assert len(set(final.values())) == 30 and first[old] not in final.values()
    assert await node_a.uid_next(user, INBOX) == 32  # 30 first UIDs and one renumbering


async def test_two_nodes_claiming_recent_at_once_give_each_uid_to_one_session(make_store) -> None:
    """Sessions on two nodes SELECT the same mailbox as new mail arrives: each claims up to the
    UIDNEXT it saw; of all of them exactly one owns \\Recent for each UID."""
    node_a, node_b = await make_store(), await make_store()
    user = await new_user(node_a)
    belows = [4, 9, 9, 15, 4, 22, 18, 30, 30, 27, 41, 35, 41, 50, 2, 50]
    nodes = [node_a, node_b] * (len(belows) // 2)
    results = await asyncio.gather(*(node.claim_recent(user, INBOX, below) for node, below in zip(nodes, belows)))
    assert sorted(recent_owners(zip(belows, results))) == list(range(1, 50))
    assert await node_b.recent_mark(user, INBOX) == 50


async def test_a_claim_of_recent_from_a_known_mark_reads_nothing_and_a_stale_one_learns_from_its_round(
    make_store
) -> None:
    """A session that knows the mark (it claimed or read it before) claims from it: one Paxos
    round, no read of the anchor. When another node raised the mark meanwhile the round does not
    apply and answers with the mark as it is, and the claim goes on from there; claims from two
    nodes with stale marks still give each UID to one session."""
    store, other = await make_store(mailbox_cache=60.0), await make_store()
    user = await new_user(store)
    assert await store.claim_recent(user, INBOX, 5) == 1
    with store.tracing() as known:
        assert await store.claim_recent(user, INBOX, 8, known=5) == 5
    assert known.statements == 1  # the conditional batch alone
    assert await other.claim_recent(user, INBOX, 12) == 8
    anchors: list[uuid.UUID] = []
    real = store.tables.messages.anchor

    async def anchor(mailbox_id: uuid.UUID) -> object:
        anchors.append(mailbox_id)
        return await real(mailbox_id)

    store.tables.messages.anchor = anchor  # type: ignore[method-assign]
    assert await store.claim_recent(user, INBOX, 15, known=8) == 12  # stale: learnt 12 from the round
    assert await store.claim_recent(user, INBOX, 14, known=9) == 15  # stale and covered: nothing written
    assert await store.claim_recent(user, INBOX, 20, known=15) == 15
    assert anchors == [] and await other.recent_mark(user, INBOX) == 20
    belows = [24, 29, 29, 35, 24, 42, 38, 50, 50, 47, 61, 55, 61, 70, 22, 70]
    nodes = [store, other] * (len(belows) // 2)
    results = await asyncio.gather(*(node.claim_recent(user, INBOX, below, known=20 + i % 3)
                                     for i, (node, below) in enumerate(zip(nodes, belows))))
    assert sorted(recent_owners(zip(belows, results))) == list(range(20, 70))
    assert await other.recent_mark(user, INBOX) == 70


async def test_an_append_claims_recent_in_its_numbering_round_when_the_mark_it_knows_is_the_uid(
    make_store
) -> None:
    """APPEND to the session's selected mailbox: when the mark the session knows is the UID the
    message gets (every UID below is claimed), the numbering's one Paxos round claims it too. A
    stale mark loses only the claim: the message is numbered by the next try, and is claimed as
    any other message by the session that lists it first. (The mark never passes UIDNEXT, and
    only grows: a known mark equal to the UIDNEXT read is the mark, so the claim's condition
    never fails the round.)"""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    [first] = await store.deliver(b"Subject: 1\r\n\r\nx\r\n", [Target(user)])
    await store.assign_uids(user, INBOX, [first])
    assert await store.claim_recent(user, INBOX, 2) == 1
    rounds: list[object] = []
    real = store.cql.conditional

    async def conditional(statement: Any, contention_not_applied: bool = False) -> tuple[bool, Any]:
        rounds.append(statement)
        return await real(statement, contention_not_applied)

    store.cql.conditional = conditional  # type: ignore[method-assign]
    claim = RecentClaim(2)
    uid = (await store.append(b"Subject: 2\r\n\r\nx\r\n", Target(user), recent=claim)).uid
    assert uid == 2 and claim.won and len(rounds) == 1  # one round: the UID and the claim
    assert await other.recent_mark(user, INBOX) == 3
    assert await store.claim_recent(user, INBOX, 3, known=3) == 3 and len(rounds) == 1  # covered: nothing
    # another node numbers and claims a message meanwhile: the known mark (3) is stale
    [third] = await other.deliver(b"Subject: 3\r\n\r\nx\r\n", [Target(user)])
    assert await other.assign_uids(user, INBOX, [third]) == {third: 3}
    assert await other.claim_recent(user, INBOX, 4, known=3) == 3
    rounds.clear()
    stale = RecentClaim(3)
    appended = await store.append(b"Subject: 4\r\n\r\nx\r\n", Target(user), recent=stale)
    fourth, uid = appended.id, appended.uid
    # two rounds: the first decided on what this store's own last change left, which the other
    # node's numbering made stale, did not apply; the second, on a read, found 4, not 3: no claim
    assert uid == 4 and not stale.won and len(rounds) == 2
    assert (await other.get_summaries(user, INBOX, [fourth]))[fourth].uid == 4
    assert await other.recent_mark(user, INBOX) == 4  # unclaimed: the first session to list it has it
    assert await other.claim_recent(user, INBOX, 5, known=4) == 4
    unknown = RecentClaim(1)  # (the mark may be unset: a claim cannot name it)
    uid = (await store.append(b"Subject: 5\r\n\r\nx\r\n", Target(user), recent=unknown)).uid
    assert uid == 5 and not unknown.won and await other.recent_mark(user, INBOX) == 5


async def test_a_change_after_this_stores_own_is_decided_on_what_it_left_and_on_what_the_caller_knows(
    make_store
) -> None:
    """A flag change whose caller knows the messages as of the MODSEQ this store's own last change
    of the mailbox left (an IMAP view after its session's change) is one Paxos round, without a
    read. Knowledge at another MODSEQ is read as before; a change by another node meanwhile makes
    the round not apply, and the change is decided again on a read: nothing is lost, and the
    STATUS counts stay those of the listing."""
    from cassmail.store.cassandra_left import Known
    from cassmail.store.cassandra_tables import Messages

    assert set(Known._fields) == set(Messages._STATE.split(", "))  # a known row has what a read row has
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    ids = [(await store.deliver(b"Subject: %d\r\n\r\nx\r\n" % n, [Target(user)]))[0] for n in range(3)]
    await store.assign_uids(user, INBOX, ids)
    reads: list[bool] = []
    rounds: list[object] = []
    real_state, real_conditional = store.tables.messages.state, store.cql.conditional

    async def state(mailbox_id: uuid.UUID, wanted: list[uuid.UUID], serial: bool = True) -> list[object]:
        reads.append(serial)
        return await real_state(mailbox_id, wanted, serial)

    async def conditional(statement: Any, contention_not_applied: bool = False) -> tuple[bool, Any]:
        rounds.append(statement)
        return await real_conditional(statement, contention_not_applied)

    store.tables.messages.state = state  # type: ignore[method-assign]
    store.cql.conditional = conditional  # type: ignore[method-assign]
    known = await store.get_summaries(user, INBOX, ids)
    highest = await store.highest_modseq(user, INBOX)
    modseqs: dict[uuid.UUID, int] = {}
    await store.store_flags(user, INBOX, [ids[0]], ["\\Seen"], "add", modseqs=modseqs, known=(known, highest))
    assert reads == [] and len(rounds) == 1 and modseqs == {ids[0]: highest + 1}
    await store.store_flags(user, INBOX, [ids[1]], ["\\Seen"], "add", known=(known, highest))  # not the last
    assert reads == [False] and len(rounds) == 2
    known, highest = await store.get_summaries(user, INBOX, ids), await store.highest_modseq(user, INBOX)
    await other.store_flags(user, INBOX, [ids[2]], ["\\Flagged"], "add")  # the store does not know of it
    reads.clear()
    rounds.clear()
    await store.store_flags(user, INBOX, [ids[2]], ["\\Seen"], "add", known=(known, highest))
    assert reads == [False] and len(rounds) == 2  # the round on what it knew did not apply
    flags = {s.id: s.flags async for s in other.list_messages(user, INBOX)}
    assert flags == {ids[0]: {"\\Seen"}, ids[1]: {"\\Seen"}, ids[2]: {"\\Seen", "\\Flagged"}}
    assert await store.mailbox_status(user, INBOX) == await Store.mailbox_status(store, user, INBOX)
    # An APPEND's numbering decides on the row its delivery wrote, and the batch checks that the
    # message is there without a UID: one numbered meanwhile (here by this same store) keeps its UID.
    body = b"Subject: 4\r\n\r\nx\r\n"
    uid = (await store.append(body, Target(user))).uid
    assert uid == 4 and await other.uid_next(user, INBOX) == 5
    [late] = await store.deliver(body, [Target(user)])
    assert await store.assign_uids(user, INBOX, [late]) == {late: 5}
    reads.clear()
    delivered = MessageSummary(late, len(body), frozenset(), datetime.now(timezone.utc))
    assert await store._number_appended(Target(user), delivered, None, None) == {late: 5}
    assert reads == [False] and await other.uid_next(user, INBOX) == 6  # the guess failed; read; no new UID


async def test_a_change_decides_on_a_plain_read_and_one_overtaken_meanwhile_is_retried_after_a_serial_read(
    make_store
) -> None:
    """Where reads see every acknowledged write (here RF=1, ONE), a flag change reads the rows at
    the read level, with no Paxos round of its own; a change another node made between that read
    and the batch moved the counters, so the batch does not apply and the change is decided again
    on a SERIAL read. Neither change is lost."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    ids = [(await store.deliver(b"Subject: %d\r\n\r\nx\r\n" % n, [Target(user)]))[0] for n in range(2)]
    await store.assign_uids(user, INBOX, ids)
    assert store._reads_see_writes()
    reads: list[bool] = []
    real = store.tables.messages.state

    async def state(mailbox_id: uuid.UUID, wanted: list[uuid.UUID], serial: bool = True) -> list[object]:
        reads.append(serial)
        rows = await real(mailbox_id, wanted, serial)
        if len(reads) == 1:  # another node changes the mailbox between this read and the batch
            await other.store_flags(user, INBOX, [ids[1]], ["\\Flagged"], "add")
        return rows

    store.tables.messages.state = state  # type: ignore[method-assign]
    await store.store_flags(user, INBOX, [ids[0]], ["\\Seen"], "add")
    assert reads == [False, True]
    flags = {s.id: s.flags async for s in other.list_messages(user, INBOX)}
    assert flags == {ids[0]: {"\\Seen"}, ids[1]: {"\\Flagged"}}
    reads.clear()
    await store.store_flags(user, INBOX, [ids[1]], ["\\Seen"], "add")  # nobody in the way: one plain read
    assert reads == [False]
    assert {s.id: s.flags async for s in other.list_messages(user, INBOX)}[ids[1]] == {"\\Seen", "\\Flagged"}


async def test_reading_the_recent_mark_or_a_covered_claim_is_two_reads_and_no_paxos_write(make_store) -> None:
    store = await make_store(mailbox_cache=0)
    user = await new_user(store)
    await store.claim_recent(user, INBOX, 10)
    with store.tracing() as mark:
        assert await store.recent_mark(user, INBOX) == 10
    with store.tracing() as covered:
        assert await store.claim_recent(user, INBOX, 7) == 10
    # the mailbox row, then the anchor row at SERIAL; a covered claim stops there
    assert mark.statements == covered.statements == 2
    cached = await make_store()  # mailbox_cache: the row read for the first call does for the next
    await cached.recent_mark(user, INBOX)
    with cached.tracing() as again:
        assert await cached.claim_recent(user, INBOX, 7) == 10
    assert again.statements == 1


async def test_a_body_deleted_between_two_chunks_is_no_such_message_a_lost_chunk_unavailable(make_store) -> None:
    store = await make_store()
    user = await new_user(store)
    chunk, window = store.settings.chunk_size, store.settings.chunk_concurrency
    body = os.urandom(chunk * (window + 4))  # chunks past the read-ahead are read after the delete
    [gone] = await store.deliver(body, [Target(user)])
    stream = store.read_chunks(user, INBOX, gone)
    received = await anext(stream)
    await store.delete_messages(user, INBOX, [gone])
    with pytest.raises(NoSuchMessage):
        async for piece in stream:
            received += piece
    assert len(received) < len(body) and body.startswith(received)
    # a chunk missing under a live message is a replica that has not seen the write: unavailable
    [kept] = await store.deliver(body, [Target(user)])
    mailbox_id = (await store._resolve(user, INBOX)).mailbox_id
    row = await store.tables.messages.body_info(mailbox_id, kept)
    await store.tables.body_chunks.delete(row.body_id, window + 2)
    with pytest.raises(StoreUnavailable, match=f"chunk {window + 2} of body"):
        await store.read_message(user, INBOX, kept)


async def test_a_body_listed_is_read_without_its_row_and_one_deleted_since_is_no_such_message(make_store) -> None:
    """POP3 lists its mailbox at login, then RETRs: the listing noted where each body is."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    bodies = [b"Subject: %d\r\n\r\nbody %d\r\n" % (n, n) for n in range(3)]
    ids = [(await store.deliver(body, [Target(user)]))[0] for body in bodies]
    with store.tracing() as unlisted:
        assert await store.read_message(user, INBOX, ids[0]) == bodies[0]
    assert unlisted.statements == 2  # the message row, then its one chunk
    assert [s.id async for s in store.list_messages(user, INBOX)] == ids
    with store.tracing() as listed:
        assert await store.read_message(user, INBOX, ids[1]) == bodies[1]
    assert listed.statements == 1
    await other.delete_messages(user, INBOX, [ids[2]])  # by another process: this one's note stays
    with pytest.raises(NoSuchMessage):
        await store.read_message(user, INBOX, ids[2])


async def test_a_body_of_two_chunks_is_one_request_and_a_chunk_missing_from_it_is_read_again(make_store) -> None:
    store = await make_store()
    user = await new_user(store)
    chunk = store.settings.chunk_size
    body = os.urandom(chunk + 1000)
    [message] = await store.deliver(body, [Target(user)])
    [listed] = [s async for s in store.list_messages(user, INBOX)]
    assert listed.id == message
    with store.tracing() as whole:
        assert await store.read_message(user, INBOX, message) == body
    assert whole.statements == 1
    with store.tracing() as across:  # a range across the chunks' border
        assert b"".join([c async for c in store.read_chunks(user, INBOX, message, chunk - 10, chunk + 10)]) == \
            body[chunk - 10:chunk + 10]
    assert across.statements == 1
    mailbox_id = (await store._resolve(user, INBOX)).mailbox_id
    row = await store.tables.messages.body_info(mailbox_id, message)
    await store.tables.body_chunks.delete(row.body_id, 1)
    with store.tracing() as missing, pytest.raises(StoreUnavailable, match="chunk 1 of body"):
        await store.read_message(user, INBOX, message)
    assert missing.statements == 3  # both chunks, chunk 1 again at ALL, then the message row


async def test_a_chunk_missing_at_the_read_level_is_asked_of_every_replica_before_giving_up(make_store, monkeypatch) -> None:
    """At ONE with RF >= 2 the replica that answers may not have applied a chunk another one has."""
    store = await make_store()
    user = await new_user(store)
    body = os.urandom(store.settings.chunk_size * 2 + 10)
    [kept] = await store.deliver(body, [Target(user)])
    real, levels = store.cql.run, []

    async def first_chunk_read_misses(statement):
        prepared = getattr(statement, "prepared_statement", None)
        if prepared is not None and prepared.query_string.startswith("SELECT data FROM"):
            levels.append(statement.consistency_level)
            if len(levels) == 1:
                return []  # the lagging replica answered
        return await real(statement)

    monkeypatch.setattr(store.cql, "run", first_chunk_read_misses)
    assert await store.read_message(user, INBOX, kept) == body
    assert levels[0] != ConsistencyLevel.ALL and levels.count(ConsistencyLevel.ALL) == 1  # the missed chunk only


async def test_a_deletion_whose_tidying_up_fails_is_still_done_and_says_so(make_store, monkeypatch) -> None:
    """The rows are gone once the delete batch is stored: freeing bodies and moving the low-water mark
    (a conditional write, contended by other sessions) must not turn that into an error."""
    store = await make_store()
    user = await new_user(store)
    ids = [(await store.deliver(b"Subject: x\r\n\r\n" + b"y" * 100_000, [Target(user)]))[0] for _ in range(3)]

    async def contended(*args, **kw):
        raise StoreUnavailable("Cassandra: CAS operation timed out (contention)")

    monkeypatch.setattr(store.tables.users, "set_low_water", contended)
    monkeypatch.setattr(store, "_release_bodies", contended)
    await store.delete_messages(user, INBOX, ids[:2])
    monkeypatch.undo()
    assert set(await store.get_summaries(user, INBOX, ids)) == {ids[2]}


async def body_of(store: CassandraStore, user: str, mailbox: str, message_id: uuid.UUID) -> Any:
    """The message row's (body_id, chunk_size, size, shared)."""
    mailbox_id = (await store._resolve(user, mailbox)).mailbox_id
    [row] = await store.tables.messages.body_infos(mailbox_id, [message_id])
    return row


async def chunks_there(store: CassandraStore, body_id: uuid.UUID, count: int) -> int:
    return sum([await store.tables.body_chunks.get(body_id, i) is not None for i in range(count)])


async def test_a_copy_of_a_large_message_refers_to_its_body_and_the_last_deletion_frees_it(make_store) -> None:
    """COPY of a numbered message of more than SHARE_CHUNKS chunks writes no chunk: the copy
    names the same body, also a copy of a copy; deleting the original (a MOVE) keeps the body,
    and the last deletion frees it. A small message, and one never numbered (a mailbox only
    POP3 reads deletes without a Paxos round), are copied byte for byte. Flags and internal
    date carry."""
    store = await make_store()
    user = await new_user(store)
    body = b"Subject: big\r\n\r\n" + bytes(range(256)) * 1200  # 307,217 bytes: five 64 KiB chunks
    when = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
    [original] = await store.deliver(body, [Target(user, INBOX, frozenset({"\\Flagged", "$Work"}))], when)
    [small] = await store.deliver(b"Subject: small\r\n\r\nx\r\n", [Target(user)])
    [unnumbered] = await store.deliver(body, [Target(user)])
    await store.assign_uids(user, INBOX, [original, small])
    writes: list[int] = []
    real = store.tables.body_chunks.insert

    async def counted(body_id: uuid.UUID, idx: int, data: bytes) -> None:
        writes.append(idx)
        await real(body_id, idx, data)

    store.tables.body_chunks.insert = counted  # type: ignore[method-assign]
    copy, small_copy = await store.copy_messages(user, INBOX, [original, small], "Archive")
    assert len(writes) == 1  # the small one's only
    await store.copy_messages(user, INBOX, [unnumbered], "Drafts")  # never numbered: copied byte for byte
    assert len(writes) == 6
    first = await body_of(store, user, INBOX, original)
    assert first.shared and (await body_of(store, user, "Archive", copy)).body_id == first.body_id
    assert await store.read_message(user, "Archive", copy) == body
    assert await store.read_message(user, "Archive", small_copy) == b"Subject: small\r\n\r\nx\r\n"
    [summary] = (await store.get_summaries(user, "Archive", [copy])).values()
    assert summary.flags == {"\\Flagged", "$Work"} and summary.internal_date == when and summary.size == len(body)
    await store.assign_uids(user, "Archive", [copy])  # (as the IMAP session's COPY does)
    [again] = await store.copy_messages(user, "Archive", [copy], "Trash")  # a copy of a copy
    assert len(writes) == 6 and (await store.tables.bodies.refs(first.body_id)).refs == {
        f"{(await store._resolve(user, m)).mailbox_id}/{i}" for m, i in ((INBOX, original), ("Archive", copy), ("Trash", again))}

    await store.delete_messages(user, INBOX, [original])  # MOVE's second half
    assert await chunks_there(store, first.body_id, 5) == 5
    await store.delete_messages(user, "Archive", [copy])
    assert await store.read_message(user, "Trash", again) == body
    await store.delete_messages(user, "Trash", [again])
    assert await chunks_there(store, first.body_id, 5) == 0
    assert await store.tables.bodies.refs(first.body_id) is None


async def test_a_copy_racing_the_deletion_of_its_source_fails_cleanly_or_keeps_the_body(make_store, monkeypatch) -> None:
    """The source is expunged while a copy of it is being made: before the copy marks it shared
    (the copy fails with NoSuchMessage, nothing is left behind: no copy, no chunk, no body row),
    or after (the copy is made and keeps the body). Two copies of one message at once share it."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    body = b"Subject: big\r\n\r\n" + b"z" * 300_000

    [first] = await store.deliver(body, [Target(user)])
    await store.assign_uids(user, INBOX, [first])
    row = await body_of(store, user, INBOX, first)
    refer = store.tables.bodies.refer

    async def expunged_meanwhile(*args: object) -> None:
        await refer(*args)
        await other.delete_messages(user, INBOX, [first])

    monkeypatch.setattr(store.tables.bodies, "refer", expunged_meanwhile)
    with pytest.raises(NoSuchMessage):
        await store.copy_messages(user, INBOX, [first], "Archive")
    monkeypatch.undo()
    assert [s async for s in store.list_messages(user, "Archive")] == []
    assert await chunks_there(store, row.body_id, 5) == 0 and await store.tables.bodies.refs(row.body_id) is None

    [second] = await store.deliver(body, [Target(user)])
    await store.assign_uids(user, INBOX, [second])
    row = await body_of(store, user, INBOX, second)
    mark = store._mark_shared

    async def expunged_after(*args: object) -> bool:
        done = await mark(*args)
        await other.delete_messages(user, INBOX, [second])
        return done

    monkeypatch.setattr(store, "_mark_shared", expunged_after)
    [kept] = await store.copy_messages(user, INBOX, [second], "Archive")
    monkeypatch.undo()
    assert await store.read_message(user, "Archive", kept) == body
    await store.delete_messages(user, "Archive", [kept])
    assert await chunks_there(store, row.body_id, 5) == 0

    [third] = await store.deliver(body, [Target(user)])
    await store.assign_uids(user, INBOX, [third])
    row = await body_of(store, user, INBOX, third)
    copies = await asyncio.gather(store.copy_messages(user, INBOX, [third], "Archive"),
                                  other.copy_messages(user, INBOX, [third], "Archive"))
    made = [c for [c] in copies]
    assert [await store.read_message(user, "Archive", c) for c in made] == [body, body]
    for mailbox, ids in ((INBOX, [third]), ("Archive", made[:1])):
        await store.delete_messages(user, mailbox, ids)
        assert await chunks_there(store, row.body_id, 5) == 5
    await store.delete_messages(user, "Archive", made[1:])
    assert await chunks_there(store, row.body_id, 5) == 0

    # A shared source whose last other copy goes first: the copy fails, nothing is left behind.
    [fourth] = await store.deliver(body, [Target(user)])
    await store.assign_uids(user, INBOX, [fourth])
    [copy] = await store.copy_messages(user, INBOX, [fourth], "Archive")
    await store.assign_uids(user, "Archive", [copy])
    row = await body_of(store, user, "Archive", copy)

    async def both_gone() -> None:
        await other.delete_messages(user, INBOX, [fourth])
        await other.delete_messages(user, "Archive", [copy])

    monkeypatch.setattr(store, "_quota_check", _then(store._quota_check, both_gone))
    with pytest.raises(NoSuchMessage):
        await store.copy_messages(user, "Archive", [copy], "Trash")
    monkeypatch.undo()
    assert [s async for s in store.list_messages(user, "Trash")] == []
    assert await chunks_there(store, row.body_id, 5) == 0 and await store.tables.bodies.refs(row.body_id) is None


def _then(call, after):
    """`call`, then `after()` awaited once, the first time `call` is made."""
    pending = [after]

    async def wrapped(*args, **kwargs):
        result = await call(*args, **kwargs)
        if pending:
            await pending.pop()()
        return result

    return wrapped


async def test_deleting_the_last_copy_frees_the_body_chunks(make_store) -> None:
    store = await make_store()
    user = await new_user(store)
    single, *_ = await store.deliver(b"s" * 150_000, [Target(user)])
    shared_a, shared_b = await store.deliver(b"t" * 150_000, [Target(user, "Archive"), Target(user, "Trash")])

    async def chunks_of(mailbox: str, message_id: uuid.UUID) -> int:
        mailbox_id = (await store._resolve(user, mailbox)).mailbox_id
        info = await store.tables.messages.body_info(mailbox_id, message_id)
        return sum([await store.tables.body_chunks.get(info.body_id, i) is not None for i in range(3)]), info.body_id

    count, single_body = await chunks_of(INBOX, single)
    assert count == 3  # 150,000 bytes in 64 KiB chunks
    await store.delete_messages(user, INBOX, [single])
    assert not any([await store.tables.body_chunks.get(single_body, i) for i in range(3)])

    _, shared_body = await chunks_of("Archive", shared_a)
    await store.delete_messages(user, "Archive", [shared_a])
    assert all([await store.tables.body_chunks.get(shared_body, i) for i in range(3)])  # Trash still refers to it
    await store.delete_messages(user, "Trash", [shared_b])
    assert not any([await store.tables.body_chunks.get(shared_body, i) for i in range(3)])
    assert await store.tables.bodies.refs(shared_body) is None

    # Many at once (a POP3 QUIT after many DELEs): their chunks go in batches of CHUNKS_PER_DELETE.
    many = [(await store.deliver(b"m" * 150_000, [Target(user)]))[0] for _ in range(7)]
    bodies = [(await chunks_of(INBOX, m))[1] for m in many]
    batches: list[int] = []
    deletion = store.tables.body_chunks.delete_statement(uuid.uuid4(), 0).prepared_statement.query_id
    real = store.cql.run

    async def counted(statement: object) -> object:
        if isinstance(statement, BatchStatement):
            chunks = sum(1 for _, query_id, _ in statement._statements_and_parameters if query_id == deletion)
            if chunks:
                batches.append(chunks)
        return await real(statement)

    store.cql.run = counted  # type: ignore[method-assign]
    await store.delete_messages(user, INBOX, many)
    store.cql.run = real  # type: ignore[method-assign]
    assert sorted(batches) == [1, 10, 10]  # 21 chunks
    assert not any([await store.tables.body_chunks.get(b, i) for b in bodies for i in range(3)])


async def test_a_queued_message_up_to_queue_inline_max_is_one_write_and_a_larger_one_is_chunked(make_store) -> None:
    """Most outbound mail is kept in its queue entry: one write queues it and one delete
    finishes it; past `queue_inline_max` the body goes to chunks, which finishing deletes."""
    store = await make_store()
    assert store.settings.queue_inline_max == 128 * 1024 and store.settings.chunk_size == 64 * 1024
    small = b"Subject: q\r\n\r\n" + os.urandom(100_000)  # over a chunk, under the limit
    large = b"Subject: q\r\n\r\n" + os.urandom(150_000)
    small_id = await store.enqueue(small, "a@here.example", ["b@there.example"])
    large_id = await store.enqueue(large, "a@here.example", ["b@there.example"])
    [small_head] = await store.tables.queue.entry(small_id)
    [large_head] = await store.tables.queue.entry(large_id)
    assert small_head.body_id is None and await store.tables.queue.body(small_id) == small
    assert large_head.body_id is not None and await store.tables.queue.body(large_id) is None
    chunks = [await store.tables.body_chunks.get(large_head.body_id, i) for i in range(3)]
    assert b"".join(chunks) == large  # type: ignore[arg-type]
    assert await store.read_queued(small_id) == small and await store.read_queued(large_id) == large
    for entry_id in (small_id, large_id):
        await store.finish(entry_id)
    assert not any([await store.tables.body_chunks.get(large_head.body_id, i) for i in range(3)])
    assert await store.tables.queue.entry(small_id) == [] and await store.tables.queue.entry(large_id) == []


async def test_schema_apply_is_idempotent_and_records_its_version(cassandra_settings) -> None:
    assert cassandra_schema.apply(cassandra_settings) == []
    async with CassandraStore(cassandra_settings) as store:
        query = f"SELECT version, name FROM {cassandra_settings.keyspace}.schema_migrations"
        rows = await _cql(store, query)
    applied = sorted((r.version, r.name) for r in rows)  # one partition per version: in token order
    assert applied == [(1, "initial"), (2, "low_water_due"), (3, "aliases"), (4, "recent"), (5, "changes"),
                       (6, "outbound"), (7, "sieve"), (8, "modseq"), (9, "events"), (10, "quota"), (11, "counts"),
                       (12, "plain_bodies"), (13, "body_compaction"), (14, "view_snapshots"),
                       (15, "modseq_runs"), (16, "sieve_mark")]


def test_two_schema_files_of_one_version_are_refused(tmp_path) -> None:
    """A keyspace records the versions applied: a second file of a version already applied
    somewhere (two branches that each added the next number) would never run there."""
    for name in ("001_initial.cql", "002_recent.cql", "002_queue.cql"):
        (tmp_path / name).write_text("CREATE TABLE IF NOT EXISTS t (a int PRIMARY KEY);\n")
    with pytest.raises(StoreError, match="002_queue.cql and 002_recent.cql .* share version 2"):
        cassandra_schema.migrations(tmp_path)
    assert [m.version for m in cassandra_schema.migrations()] == list(range(1, len(cassandra_schema.migrations()) + 1))


async def test_schema_apply_alters_the_replication_to_the_settings_and_sends_every_statement_to_one_node(
    cassandra_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes made by one coordinator in order cannot conflict, so the nodes' agreement is
    awaited at the end instead of after each of the dozens of statements (a second each on a
    cluster): the session that makes them holds connections to one node only (the first contact
    point that answers: one that does not is passed over)."""
    from cassandra.cluster import Session

    settings = dataclasses.replace(cassandra_settings, keyspace=f"cmalter_{uuid.uuid4().hex[:8]}",
                                   contact_points=["127.0.0.254", *cassandra_settings.contact_points],
                                   connect_timeout=2.0)
    nodes: list[tuple[object, ...]] = []
    real_execute = Session.execute

    def execute(self: Session, query: object, *args: object, **kwargs: object) -> object:
        nodes.append(tuple(str(h.endpoint) for h in self.get_pool_state()))
        return real_execute(self, query, *args, **kwargs)

    monkeypatch.setattr(Session, "execute", execute)
    try:
        assert any("created keyspace" in line for line in cassandra_schema.apply(settings))
        assert len(nodes) > len(cassandra_schema.migrations())
        assert set(nodes) == {(f"{cassandra_settings.contact_points[0]}:{cassandra_settings.port}",)}
        monkeypatch.undo()
        changed = cassandra_schema.apply(dataclasses.replace(settings, replication_factor=2))
        assert any("altered keyspace" in line and "repair" in line for line in changed)
        assert cassandra_schema.apply(dataclasses.replace(settings, replication_factor=2)) == []
    finally:
        cassandra_schema.drop(settings)


async def test_many_concurrent_large_deliveries_wait_for_room_instead_of_failing(make_store) -> None:
    """48 deliveries of 2 MB at once would fill the driver's socket buffers; the store holds them back."""
    store = await make_store(chunk_size=256 * 1024)
    user = await new_user(store)
    body = os.urandom(2 * 1024 * 1024)
    ids = await asyncio.gather(*(store.deliver(body, [Target(user)]) for _ in range(48)))
    assert len({i for [i] in ids}) == 48
    assert len([s async for s in store.list_messages(user, INBOX)]) == 48
    assert await store.read_message(user, INBOX, ids[-1][0]) == body


def test_only_requests_that_were_never_sent_are_retried() -> None:
    from cassandra import OperationTimedOut
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionBusy
    from cassandra.pool import NoConnectionsAvailable

    from cassmail.store.cassandra_cql import _never_sent

    assert _never_sent(NoHostAvailable("x", {"h1": ConnectionBusy("busy"), "h2": NoConnectionsAvailable()}))
    assert not _never_sent(NoHostAvailable("x", {"h1": ConnectionBusy("busy"), "h2": OSError("reset")}))
    assert not _never_sent(NoHostAvailable("x", {"h1": OperationTimedOut("timed out")}))
    assert not _never_sent(NoHostAvailable("x", {}))


def test_a_paxos_round_of_unknown_outcome_counts_as_contention_and_nothing_else_does() -> None:
    """Cassandra 5 answers a proposal that fewer than a quorum accepted with CAS_WRITE_UNKNOWN
    (0x1700), for which driver 3.x has no class: its decoder must still give the code, or
    contended mailboxes would answer NO [UNAVAILABLE] again (this fails loudly if it changes)."""
    import io
    import struct

    from cassandra import ConsistencyLevel, ReadTimeout, Unavailable, WriteTimeout, WriteType
    from cassandra.protocol import ErrorMessage

    from cassmail.store.cassandra_cql import _settle, contended

    text = b"CAS operation result is unknown - proposal accepted by 1 but not a quorum."
    wire = struct.pack(">iH", 0x1700, len(text)) + text + struct.pack(">Hii", ConsistencyLevel.QUORUM, 1, 2)
    unknown = ErrorMessage.recv_body(io.BytesIO(wire), 5)

    async def settled(exc: BaseException) -> BaseException:
        fut = asyncio.get_running_loop().create_future()
        _settle(fut, None, exc)
        return fut.exception()

    raised = asyncio.run(settled(unknown))
    assert isinstance(raised, StoreUnavailable) and contended(raised)

    def wrapped(cause: Exception) -> StoreUnavailable:
        exc = StoreUnavailable("x")
        exc.__cause__ = cause
        return exc

    assert contended(wrapped(WriteTimeout("t", write_type=WriteType.CAS)))
    assert contended(wrapped(ReadTimeout("t", consistency=ConsistencyLevel.SERIAL)))
    assert not contended(wrapped(WriteTimeout("t", write_type=WriteType.SIMPLE)))
    assert not contended(wrapped(ReadTimeout("t", consistency=ConsistencyLevel.ONE)))
    assert not contended(wrapped(Unavailable("down", consistency=ConsistencyLevel.SERIAL)))
    assert not contended(StoreUnavailable("no cause"))


async def test_a_user_creation_that_fails_half_way_is_neither_listed_nor_found(make_store, monkeypatch) -> None:
    """create_user writes the users_by_domain row, then the account; the account write fails."""
    store = await make_store()
    kept = await new_user(store)
    domain = kept.rpartition("@")[2]
    half = f"half@{domain}"
    real = store.cql.conditional

    async def account_write_fails(statement: object) -> tuple[bool, object]:
        raise StoreUnavailable("injected: Paxos round timed out")

    monkeypatch.setattr(store.cql, "conditional", account_write_fails)
    with pytest.raises(StoreUnavailable):
        await store.create_user(half, hash_password("pw", FAST_HASH))
    monkeypatch.setattr(store.cql, "conditional", real)
    assert await store.tables.users_by_domain.users(domain) == [half, kept]  # the index row was written
    assert not await store.user_exists(half)
    assert await store.list_users(domain) == [kept] and half not in await store.list_users()
    with pytest.raises(DomainInUse) as err:
        await store.remove_domain(domain)
    assert err.value.users == 1  # the half-created user is not counted
    # the operator's retry creates it whole
    await store.create_user(half, hash_password("pw", FAST_HASH))
    assert await store.user_exists(half) and await store.list_users(domain) == [half, kept]


async def test_a_user_deletion_that_fails_at_the_last_write_leaves_the_user_whole(make_store, monkeypatch) -> None:
    store = await make_store()
    user = await new_user(store)
    domain = user.rpartition("@")[2]
    await store.deliver(b"x\r\n", [Target(user)])
    real = store.cql.run

    async def batch_fails(statement: object) -> list:
        if isinstance(statement, BatchStatement):
            raise StoreUnavailable("injected: write timeout")
        return await real(statement)

    monkeypatch.setattr(store.cql, "run", batch_fails)
    with pytest.raises(StoreUnavailable):
        await store.delete_user(user)
    monkeypatch.setattr(store.cql, "run", real)
    # mail went first; the account and its index row are still there together, and a retry finishes
    assert await store.user_exists(user) and await store.list_users(domain) == [user]
    await store.delete_user(user)
    assert not await store.user_exists(user) and await store.list_users(domain) == []
    await store.remove_domain(domain)


async def test_an_index_row_without_an_account_is_ignored_by_every_reader(make_store) -> None:
    """What a deletion by an older version (account removed, index row not) leaves behind."""
    store = await make_store()
    user = await new_user(store)
    domain = user.rpartition("@")[2]
    await store.cql.run(store.tables.users.delete_statement(user))
    assert not await store.user_exists(user)
    assert await store.list_users(domain) == [] and user not in await store.list_users()
    await store.remove_domain(domain)  # not DomainInUse
    assert domain not in await store.list_domains()


def _no_host(*_: object, **__: object) -> None:
    """What the driver raises when every node went away: a plain Exception, not a DriverException."""
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionShutdown

    raise NoHostAvailable("Unable to complete the operation against any hosts", {"127.0.0.1": ConnectionShutdown("gone")})


async def test_cassandra_dying_during_schema_apply_or_prepare_is_unavailable(cassandra_settings, monkeypatch) -> None:
    from cassandra.cluster import Session

    settings = dataclasses.replace(cassandra_settings, keyspace=f"cmdie_{uuid.uuid4().hex[:8]}")
    real_execute = Session.execute

    def dies_after_the_keyspace(self: Session, query: object, *args: object, **kwargs: object) -> object:
        if "schema_migrations" in str(query):
            _no_host()
        return real_execute(self, query, *args, **kwargs)

    try:
        monkeypatch.setattr(Session, "execute", dies_after_the_keyspace)
        with pytest.raises(StoreUnavailable, match="schema apply failed: .*Unable to complete"):
            await asyncio.to_thread(cassandra_schema.apply, settings)
        monkeypatch.undo()
        assert any("applied schema 001_initial" in line for line in cassandra_schema.apply(settings))  # a rerun finishes
        monkeypatch.setattr(Session, "prepare", _no_host)
        store = CassandraStore(settings)
        with pytest.raises(StoreUnavailable, match="cannot prepare statements"):
            await store.open()
        assert store._cluster is None  # closed, no driver threads left behind
    finally:
        monkeypatch.undo()
        cassandra_schema.drop(settings)


async def test_taking_from_a_queue_that_delivered_many_walks_no_tombstones(make_queue_store, monkeypatch) -> None:
    """300 entries queued, taken and finished leave their due rows deleted; the next look at the
    queue reads from where each shard's first live row was, so it reads what an empty queue
    reads: no tombstone. A reader starting over from the shards' low marks (its sweep) is the
    one that walks them, and the measurement sees that it does."""
    from cassmail.store import cassandra_queue

    monkeypatch.setattr(cassandra_queue, "SETTLE_SECONDS", 0.0)
    store = await make_queue_store(tombstone_grace=0.0)
    # Within one minute if it can be: a minute left behind gets its low mark (grace 0), and then
    # no reader walks its tombstones, the sweep below included.
    left = cassandra_queue.BUCKET_SECONDS - time.time() % cassandra_queue.BUCKET_SECONDS
    if left < 10:  # (what follows takes 2-4 s)
        await asyncio.sleep(left + 0.1)
    first_bucket = int(time.time() // cassandra_queue.BUCKET_SECONDS)
    await asyncio.gather(*(store.enqueue(b"Subject: q\r\n\r\nx\r\n", "a@here.example", [f"r{k}@there.example"])
                           for k in range(300)))
    done = 0
    while done < 300:
        taken = await store.take_due("w", 100, lease=60.0)
        assert taken, f"only {done} of 300 taken"
        for entry in taken:
            await store.finish(entry.id)
        done += len(taken)
    await asyncio.sleep(0.05)
    with store.tracing() as after_delivery:
        assert await store.take_due("w", 100, lease=60.0) == []
    assert after_delivery.tombstones == 0 and after_delivery.live_rows == 0
    # One read for every shard at once (each keeps its own position; the read starts at the
    # lowest) while they are all in this minute or the one before, and (the grace being 0) a
    # write of a shard's low mark for each minute it leaves behind: more when the test itself
    # ran across minutes.
    minutes = int(time.time() // cassandra_queue.BUCKET_SECONDS) - first_bucket + 1
    if minutes == 1:
        assert after_delivery.statements == 1
    assert 1 <= after_delivery.statements <= 2 * max(2, minutes) * cassandra_queue.SHARDS
    sweeping = await make_queue_store(tombstone_grace=0.0)
    with sweeping.tracing() as sweep:
        assert await sweeping.take_due("w2", 100, lease=60.0) == []
    # With no minute left behind the sweep walks every deleted row. (A run slow enough to cross
    # into the next minute despite the wait above moved the low marks of the shards it left behind
    # past their tombstones: no reader walks those.)
    if int(time.time() // cassandra_queue.BUCKET_SECONDS) == first_bucket:
        assert sweep.tombstones >= 300


async def test_a_take_reads_past_the_rows_of_held_entries_to_the_mail_due_behind_them(make_queue_store) -> None:
    """Entries an operator holds keep their due rows until a reader finds them held, and none is
    taken. A take whose look at the queue found only such rows looks again from past them in
    the same call, so a worker is not told the queue is empty while mail is due behind them."""
    from cassmail.store import cassandra_queue

    store, operator = await make_queue_store(), await make_queue_store()
    message = b"Subject: q\r\n\r\nx\r\n"
    live = await store.enqueue(message, "a@here.example", ["b@there.example"])
    shard = live.int % cassandra_queue.SHARDS
    held = 0
    while held < 3:  # due minutes before the live entry, in its shard (and a few in others)
        entry_id = await store.enqueue(message, "a@here.example", ["b@there.example"], due=time.time() - 150)
        await operator.hold_queued(entry_id, True)
        held += entry_id.int % cassandra_queue.SHARDS == shard
    # A look at a shard reads its first minute with rows: the first look finds held entries only.
    taken = await store.take_due("w", 10, lease=60.0)
    assert [entry.id for entry in taken] == [live]
    assert await store.take_due("w", 10, lease=60.0) == []
    assert all(entry.held for entry in await store.list_queue() if entry.id != live)


async def test_a_changes_token_is_none_while_an_older_write_could_still_land(make_store) -> None:
    """Writes carry their client's timestamp: one sent before the write that set `changed` can
    land after a listing without changing the column. So a token younger than the request
    timeout (plus CHANGES_SETTLE) is None, and the IMAP view lists the mailbox again."""
    from cassmail.store import cassandra

    store = await make_store()
    domain = f"c{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    user = f"tok@{domain}"
    await store.create_user(user, "$scrypt$x")
    [message_id] = await store.deliver(b"Subject: t\r\n\r\nx\r\n", [Target(user)])
    await store.assign_uids(user, "INBOX", [message_id])
    assert await store.changes_token(user, "INBOX") is None  # the last change is a moment old
    # An IMAP refresh reads the token with HIGHESTMODSEQ, which it wants most while the token is
    # young: one point read for both (the mailbox row is cached from the calls above).
    highest = await store.highest_modseq(user, "INBOX")
    assert highest > 1
    with store.tracing() as young:
        assert await store.changes_state(user, "INBOX") == (None, highest)
    assert young.statements == 1
    # While the token is young the refresh reads the arrivals anyway: with the token, in the
    # same read (the slice ends at the anchor row; the token is in static columns).
    mark = store.arrivals_mark([s async for s in store.list_messages(user, "INBOX")])
    [arrived] = await store.deliver(b"Subject: a\r\n\r\nx\r\n", [Target(user)])
    with store.tracing() as together:
        found, _, token, state_highest = await store.arrivals_state(user, "INBOX", mark)
    assert together.statements == 1
    assert arrived in {s.id for s in found} and (token, state_highest) == (None, highest)
    settled = cassandra.CHANGES_SETTLE
    try:
        cassandra.CHANGES_SETTLE = -store.settings.request_timeout  # as if the window had passed
        token = await store.changes_token(user, "INBOX")
        assert token is not None and await store.changes_token(user, "INBOX") == token
        assert await store.changes_state(user, "INBOX") == (token, highest)
        assert (await store.arrivals_state(user, "INBOX", mark))[2:] == (token, highest)
    finally:
        cassandra.CHANGES_SETTLE = settled


async def test_arrivals_of_more_than_a_page_come_whole_with_no_token(make_store, monkeypatch) -> None:
    """Past a page the anchor row is not in the first read: every arrival is still read, and the
    token is None (the view then reads what changed, as for a young one)."""
    from cassmail.store import cassandra

    monkeypatch.setattr(cassandra, "ARRIVALS_PAGE", 3)
    store = await make_store()
    monkeypatch.setattr(cassandra, "CHANGES_SETTLE", -store.settings.request_timeout)  # tokens trusted at once
    domain = f"c{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    user = f"page@{domain}"
    await store.create_user(user, "$scrypt$x")
    await store.assign_uids(user, "INBOX", await store.deliver(b"Subject: t\r\n\r\nx\r\n", [Target(user)]))
    mark = store.arrivals_mark([s async for s in store.list_messages(user, "INBOX")])
    assert (await store.arrivals_state(user, "INBOX", mark))[2] is not None  # one page: the token
    ids = [(await store.deliver(b"Subject: t\r\n\r\nx\r\n", [Target(user)]))[0] for _ in range(3)]
    found, _, token, highest = await store.arrivals_state(user, "INBOX", mark)
    assert set(ids) <= {s.id for s in found} and token is None
    assert highest == await store.highest_modseq(user, "INBOX")


async def test_an_imap_refresh_after_a_young_token_reads_the_arrivals_and_the_token_at_once(make_store) -> None:
    """A refresh right after a change (the token then young, so untrusted) is one request when
    nothing changed since: the arrivals with the token, not the token and then the arrivals."""
    from cassmail.imap.view import MailboxView

    store = await make_store()
    domain = f"c{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    user = f"view@{domain}"
    await store.create_user(user, "$scrypt$x")
    await store.deliver(b"Subject: t\r\n\r\nx\r\n", [Target(user)])
    view = MailboxView(store, user, "INBOX", 1, False, 500)
    changes = await view.refresh(True)  # the first: a full listing, which numbers the message
    assert changes.exists == 1 and view.token is None
    with store.tracing() as again:
        assert not (await view.refresh(True)).exists
    assert again.statements == 1
    [new] = await store.deliver(b"Subject: n\r\n\r\nx\r\n", [Target(user)])
    assert (await view.refresh(True)).exists == 2 and view.messages[view.uids[-1]].id == new


def test_a_new_keyspace_gets_each_alter_written_into_its_create_table() -> None:
    statements = [
        "CREATE TABLE IF NOT EXISTS t (\n    a text,\n    b map<text, int>,\n    PRIMARY KEY ((a), b)\n)",
        "CREATE TABLE IF NOT EXISTS u (\n    k text PRIMARY KEY\n) WITH CLUSTERING ORDER BY (k ASC)",
        "ALTER TABLE t ADD IF NOT EXISTS c bigint static",
        "ALTER TABLE t ADD IF NOT EXISTS (\n    d timeuuid,\n    e frozen<list<text>>\n)",
        "ALTER TABLE u WITH compression = {'enabled': 'false'}",
        "ALTER TABLE t WITH compaction = {'class': 'UnifiedCompactionStrategy', 'scaling_parameters': 'T8'}",
    ]
    assert cassandra_schema.folded(statements) == [
        "CREATE TABLE IF NOT EXISTS t (\n    a text,\n    b map<text, int>,\n    c bigint static,\n    d timeuuid,\n"
        "    e frozen<list<text>>,\n    PRIMARY KEY ((a), b)\n)"
        " WITH compaction = {'class': 'UnifiedCompactionStrategy', 'scaling_parameters': 'T8'}",
        "CREATE TABLE IF NOT EXISTS u (\n    k text PRIMARY KEY\n) WITH CLUSTERING ORDER BY (k ASC)"
        " AND compression = {'enabled': 'false'}",
    ]
    # What a CREATE already says, and statements of any other kind, are left as they are.
    for other in ("ALTER TABLE t ADD IF NOT EXISTS a int", "ALTER TABLE t DROP b", "DROP TABLE t",
                  "ALTER TABLE v ADD IF NOT EXISTS x int", "CREATE INDEX IF NOT EXISTS ON t (a)"):
        assert cassandra_schema.folded([*statements[:2], other]) is None, other
    assert cassandra_schema.folded([statements[1], "ALTER TABLE u WITH CLUSTERING ORDER BY (k DESC)"]) is None
    assert len(cassandra_schema.folded([s for m in cassandra_schema.migrations() for s in m.statements])) == 17


def test_a_keyspace_made_at_once_has_the_tables_of_one_made_migration_by_migration(cassandra_settings,
                                                                                   tmp_path) -> None:
    """The suite's keyspace was new, so its ALTERs went into its CREATEs; this one gets schema 001
    first and every later ALTER as written: every column, type, key and table option is the same."""
    settings = dataclasses.replace(cassandra_settings, keyspace=f"cmsteps_{uuid.uuid4().hex[:8]}")
    first = tmp_path / "schema"
    first.mkdir()
    initial = min(cassandra_schema.SCHEMA_DIR.glob("*.cql"))
    (first / initial.name).write_bytes(initial.read_bytes())
    store = CassandraStore(cassandra_settings)
    cluster = store._make_cluster()
    try:
        cassandra_schema.apply(settings, first)
        assert len(cassandra_schema.apply(settings)) == len(cassandra_schema.migrations()) - 1
        session = cluster.connect()

        def described(keyspace: str) -> tuple[set[tuple[Any, ...]], dict[str, dict[str, Any]]]:
            columns = {(r.table_name, r.column_name, r.kind, r.position, r.clustering_order, r.type) for r in
                       session.execute("SELECT * FROM system_schema.columns WHERE keyspace_name = %s", (keyspace,))}
            tables = {r.table_name: {k: v for k, v in r._asdict().items() if k not in ("keyspace_name", "id")}
                      for r in session.execute("SELECT * FROM system_schema.tables WHERE keyspace_name = %s",
                                               (keyspace,))}
            return columns, tables

        made_at_once, step_by_step = described(cassandra_settings.keyspace), described(settings.keyspace)
        assert made_at_once[0] == step_by_step[0]
        assert made_at_once[1] == step_by_step[1]
        assert len(step_by_step[1]) == 18  # (17 and schema_migrations)
    finally:
        cluster.shutdown()
        cassandra_schema.drop(settings)


async def test_a_keyspace_from_before_modseqs_is_upgraded_and_its_numbered_mail_has_modseq_1(
    cassandra_settings, tmp_path
) -> None:
    """Schema 008 (MODSEQs) goes onto a keyspace at version 7 with `schema apply`; mail numbered
    before it (UIDs, no MODSEQ, no counter) reads as MODSEQ 1 and changes from there on."""
    settings = dataclasses.replace(cassandra_settings, keyspace=f"cmold_{uuid.uuid4().hex[:8]}")
    old = tmp_path / "schema"
    old.mkdir()
    for path in sorted(cassandra_schema.SCHEMA_DIR.glob("*.cql")):
        if int(path.name[:3]) < 8:
            (old / path.name).write_bytes(path.read_bytes())
    try:
        cassandra_schema.apply(settings, old)
        assert cassandra_schema.apply(settings)[0] == "applied schema 008_modseq"
        async with CassandraStore(settings) as store:
            user = await new_user(store)
            ids = [(await store.deliver(b"Subject: %d\r\n\r\nx\r\n" % i, [Target(user)]))[0] for i in range(3)]
            await store.assign_uids(user, INBOX, ids)
            # what version 7 left: UIDs and their counter, no MODSEQ anywhere
            mailbox_id = (await store._resolve(user, INBOX)).mailbox_id
            for message_id in ids:
                await _cql(store, f"UPDATE {settings.keyspace}.messages SET modseq = null WHERE mailbox_id = ? AND id = ?",
                           mailbox_id, message_id)
            await _cql(store, f"UPDATE {settings.keyspace}.messages SET highest_modseq = null WHERE mailbox_id = ?",
                       mailbox_id)
            assert [(s.uid, s.modseq) async for s in store.list_messages(user, INBOX)] == [(1, 1), (2, 1), (3, 1)]
            assert await store.highest_modseq(user, INBOX) == 1
            await store.store_flags(user, INBOX, [ids[1]], ["\\Seen"], "add")
            await store.delete_messages(user, INBOX, [ids[2]])
            assert [(s.uid, s.modseq) async for s in store.list_messages(user, INBOX)] == [(1, 1), (2, 2)]
            assert await store.vanished_since(user, INBOX, 1) == [3]
            assert await store.highest_modseq(user, INBOX) == 3
    finally:
        cassandra_schema.drop(settings)


async def test_changes_since_a_modseq_are_read_from_the_modseq_records_not_the_listing(make_store) -> None:
    """CONDSTORE/QRESYNC resynchronisation reads what changed, not the mailbox: 300 messages, 3
    changed and 2 expunged since the client's MODSEQ, and the reads see a handful of rows."""
    store = await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 300)
    await store.assign_uids(user, INBOX, ids)
    mark = await store.highest_modseq(user, INBOX)
    await store.store_flags(user, INBOX, [ids[10], ids[200]], ["\\Seen"], "add")
    await store.store_flags(user, INBOX, [ids[10], ids[250]], ["$Done"], "add")  # ids[10] changes twice
    await store.delete_messages(user, INBOX, [ids[5], ids[6]])
    with store.tracing() as cost:
        changed = await store.changed_since(user, INBOX, mark)
        vanished = await store.vanished_since(user, INBOX, mark)
    assert [s.id for s in changed] == [ids[10], ids[200], ids[250]]
    assert changed[0].flags == {"\\Seen", "$Done"} and changed[0].modseq == await store.highest_modseq(user, INBOX) - 1
    assert vanished == [6, 7]
    assert 5 <= cost.live_rows <= 20, cost  # records and rows of what changed, and the counters


async def test_a_flag_change_without_a_paxos_quorum_is_made_without_a_modseq(make_store, monkeypatch) -> None:
    """Too few replicas up for a Paxos round: STORE still marks mail read (merged at the write
    level, MODSEQ unchanged), while an UNCHANGEDSINCE, which needs the round, is unavailable."""
    store = await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 2)
    await store.assign_uids(user, INBOX, ids)
    before = {s.id: s.modseq async for s in store.list_messages(user, INBOX)}

    async def no_quorum(*args, **kw):
        raise StoreUnavailable("Cassandra: not enough replicas for SERIAL")

    monkeypatch.setattr(store, "_change", no_quorum)
    assert await store.store_flags(user, INBOX, ids, ["\\Seen"], "add") == set()
    with pytest.raises(StoreUnavailable):
        await store.store_flags(user, INBOX, ids, ["\\Flagged"], "add", unchanged_since=10)
    monkeypatch.undo()
    after = {s.id: (s.flags, s.modseq) async for s in store.list_messages(user, INBOX)}
    assert after == {i: (frozenset({"\\Seen"}), before[i]) for i in ids}


async def test_a_mailbox_never_numbered_is_deleted_from_without_paxos(make_store, monkeypatch) -> None:
    """POP3-only mail (no UID ever handed out) has no UID to remember: DELE needs no Paxos round."""
    store = await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 3)

    async def no_quorum(*args, **kw):
        raise StoreUnavailable("Cassandra: not enough replicas for SERIAL")

    monkeypatch.setattr(store.cql, "conditional", no_quorum)
    await store.delete_messages(user, INBOX, ids[:2])
    monkeypatch.undo()
    assert [s.id async for s in store.list_messages(user, INBOX)] == ids[2:]


async def test_status_counts_are_kept_through_changes_and_read_without_the_listing(make_store) -> None:
    """STATUS of 2,000 messages: the first counts them all (at ALL) and keeps the counts; flag
    changes, numbering and expunges keep them true in their own conditional batches; later
    STATUS reads the statics and the few rows delivered since, not the listing. A flag change
    made without a Paxos round (an outage) makes the next STATUS count again."""
    from cassmail.store.cassandra_counts import FOLD_ROWS

    # A short request timeout: mail older than request_timeout + 2 s is folded into the counts.
    store = await make_store(request_timeout=1.0)
    user = await new_user(store)
    ids = await deliver_many(store, user, 2000)
    await store.store_flags(user, INBOX, ids[:300], ["\\Seen"], "add")  # (unnumbered: no count moves)
    await asyncio.sleep(3.2)

    requests = [0]

    async def status() -> tuple[object, int]:
        with store.tracing() as cost:
            got = await store.mailbox_status(user, INBOX)
        assert got == await Store.mailbox_status(store, user, INBOX)  # the listing's count
        requests[0] = cost.statements
        return got, cost.live_rows

    first, _ = await status()  # counts everything and keeps it
    assert (first.messages, first.unseen, first.uid_next) == (2000, 1700, 2001)
    again, rows = await status()
    # the statics (and no tail), with the rows above the bound this store saw, in one request
    assert again == first and rows <= 3 and requests[0] == 1
    await store.assign_uids(user, INBOX, ids)
    await store.store_flags(user, INBOX, ids[300:350], ["\\Seen", "\\Deleted"], "add")
    await store.delete_messages(user, INBOX, ids[:10])
    new = await deliver_many(store, user, 5)
    after, rows = await status()
    assert (after.messages, after.unseen, after.deleted, after.uid_next) == (1995, 1655, 50, 2006)
    assert rows <= 10 and requests[0] == 1  # the statics and the five new rows
    # An outage's flag change: merged without a MODSEQ, it leaves the counts stale.
    mailbox_id = (await store._resolve(address_key(user), INBOX)).mailbox_id
    await store._plain_flags(user, INBOX, mailbox_id, new, frozenset({"\\Seen"}), "add")
    outage, rows = await status()
    assert outage.unseen == 1650 and rows >= 1995  # counted again from every row
    # Mail delivered since: read as the tail, however long, while it is younger than the next
    # bound (request_timeout + 2 s); folded into the counts once FOLD_ROWS of it are older.
    young = FOLD_ROWS + 10
    await deliver_many(store, user, young)
    _, rows = await status()
    assert young <= rows < young + 10  # the tail alone, not read again at ALL
    await deliver_many(store, user, 600)
    await asyncio.sleep(3.2)
    _, rows = await status()
    assert 2 * (young + 600) <= rows < 2 * (young + 600) + 100  # the tail, and again at ALL to fold it
    folded, rows = await status()
    assert folded.messages == 1995 + young + 600 and rows <= 3


async def test_the_heads_of_many_messages_take_a_request_per_sixteen(make_store) -> None:
    """read_heads reads the first chunks of up to HEADS_PER_READ bodies in one request (an IMAP
    client listing the headers of a mailbox, a SEARCH on a header field), and a body's first
    chunk is one request however large the message. A process that has not listed the mailbox
    reads where the bodies are first, a hundred messages a request."""
    from cassmail.store.cassandra import HEADS_PER_READ

    store, other = await make_store(), await make_store()
    user = await new_user(store)
    ids = [(await store.deliver(b"Subject: %d\r\n\r\nbody\r\n" % n, [Target(user)]))[0] for n in range(40)]
    [large] = await store.deliver(b"Subject: large\r\n\r\n" + os.urandom(500_000), [Target(user)])
    with other.tracing() as cost:
        heads = await other.read_heads(user, INBOX, [*ids, large])
    assert heads == {**{m: b"Subject: %d\r\n\r\n" % n for n, m in enumerate(ids)}, large: b"Subject: large\r\n\r\n"}
    reads = -(-41 // HEADS_PER_READ)
    assert cost.statements == 2 + reads  # the mailbox's row, where the 41 bodies are, their first chunks
    [_ async for _ in store.list_messages(user, INBOX)]
    with store.tracing() as cost:
        assert await store.read_heads(user, INBOX, [*ids, large]) == heads
    assert cost.statements == reads


async def test_copies_are_numbered_without_a_read_when_this_process_changed_the_target_last(make_store) -> None:
    """IMAP numbers the copies of a COPY right after it (COPYUID). The copies' rows are what this
    process wrote, so when its last change of the target left the counters it knows, the
    numbering is the conditional batch alone, as an APPEND's; when another process changed the
    target meanwhile the batch does not apply, and the numbering is decided on a read, with the
    UIDs right."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    ids = await deliver_many(store, user, 3)
    await store.assign_uids(user, INBOX, ids)
    first = await store.copy_messages(user, INBOX, ids[:1], "Archive")
    assert await store.assign_uids(user, "Archive", first) == {first[0]: 1}  # (never changed here: a read)
    second = await store.copy_messages(user, INBOX, ids[1:], "Archive")
    with store.tracing() as cost:
        assert await store.assign_uids(user, "Archive", second) == {second[0]: 2, second[1]: 3}
    assert cost.statements == 1
    third = await store.copy_messages(user, INBOX, ids[:1], "Archive")
    fourth = await other.copy_messages(user, INBOX, ids[1:2], "Archive")
    assert await other.assign_uids(user, "Archive", fourth) == {fourth[0]: 4}
    with store.tracing() as cost:
        assert await store.assign_uids(user, "Archive", third) == {third[0]: 5}
    assert cost.statements > 1
    listed = {s.id: s async for s in store.list_messages(user, "Archive")}
    assert {i: listed[i].uid for i in first + second + fourth + third} == {
        first[0]: 1, second[0]: 2, second[1]: 3, fourth[0]: 4, third[0]: 5}
    assert (await store.mailbox_status(user, "Archive")).messages == 5


async def test_a_copy_takes_the_targets_row_as_kept_and_a_delivery_reads_it(make_store, monkeypatch) -> None:
    """COPY resolves its target before it copies (IMAP reads its UIDVALIDITY): the copy then
    writes to the row this store read within `mailbox_cache`, and checks the quota with the
    limit on that row, with no read of either of its own, while a delivery reads the row every
    time. With `mailbox_cache` 0 the copy reads the row again."""
    for cache, copy_reads in ((1.0, 0), (0.0, 2)):
        store = await make_store(mailbox_cache=cache)
        user = await new_user(store)
        ids = await deliver_many(store, user, 2)
        await store.assign_uids(user, INBOX, ids)
        read: list[str] = []
        real = store.tables.users.mailbox

        async def mailbox(key: str, name: str, serial: bool = False) -> Any:
            read.append(name)
            return await real(key, name, serial)

        async def account(key: str, serial: bool = False) -> Any:
            read.append("account")
            return await real_account(key, serial)

        real_account = store.tables.users.account
        monkeypatch.setattr(store.tables.users, "mailbox", mailbox)
        monkeypatch.setattr(store.tables.users, "account", account)
        store._forget_user(user)  # (no account row kept: only what the COPY reads now)
        await store.mailbox_info(user, "Archive")  # (as IMAP's COPY does first)
        read.clear()
        copies = await store.copy_messages(user, INBOX, ids[:1], "Archive")
        assert read.count("Archive") == copy_reads and "account" not in read
        assert [s.id async for s in store.list_messages(user, "Archive")] == copies
        assert await store.read_message(user, "Archive", copies[0]) == await store.read_message(user, INBOX, ids[0])
        read.clear()
        await store.deliver(b"Subject: d\r\n\r\nx\r\n", [Target(user, "Archive")])
        assert read == ["Archive"]


async def test_status_reads_the_changes_token_with_the_counts_in_one_request(make_store) -> None:
    """IMAP STATUS on Cassandra: once this process knows the bound of the counts, the changes
    token, HIGHESTMODSEQ and the counts come from one request; the token is the one a refresh
    reads; with that token known, no counts are made; a change gives new counts, and no token
    until it is old enough to be trusted."""
    store = await make_store(request_timeout=1.0)
    user = await new_user(store)
    ids = await deliver_many(store, user, 20)
    await store.assign_uids(user, INBOX, ids)
    await store.store_flags(user, INBOX, ids[:5], ["\\Seen"], "add")
    await asyncio.sleep(3.2)  # (older than request_timeout + 2 s: a token, and counts kept)
    await store.mailbox_status(user, INBOX)  # counts the mailbox; the bound is known from here on
    with store.tracing() as cost:
        token, highest, counts = await store.status_state(user, INBOX, False, True, None)
    assert cost.statements == 1
    assert token is not None and (token, highest) == await store.changes_state(user, INBOX)
    assert counts == await Store.mailbox_status(store, user, INBOX) and counts.unseen == 15
    with store.tracing() as cost:
        assert await store.status_state(user, INBOX, False, True, token) == (token, highest, None)
    assert cost.statements == 1
    await store.store_flags(user, INBOX, ids[5:7], ["\\Seen"], "add")
    young, newer, counts = await store.status_state(user, INBOX, False, True, token)
    assert young is None and newer > highest and counts is not None and counts.unseen == 13


async def test_a_status_that_folds_the_counts_between_a_changes_read_and_its_batch_makes_it_decide_again(
    make_store, monkeypatch
) -> None:
    """A STATUS moves the bound of the counts (and the counts) without a MODSEQ. A flag change
    that read the counts before such a fold and wrote them after it would leave counts made on
    the old bound under the new one (the mail between the two bounds counted by neither): its
    batch is conditional on the bound too, so it does not apply and is decided again."""
    from cassmail.store import cassandra_counts

    store, other = await make_store(request_timeout=1.0), await make_store(request_timeout=1.0)
    user = await new_user(store)
    ids = await deliver_many(store, user, 3)
    await store.assign_uids(user, INBOX, ids)
    await asyncio.sleep(3.2)
    assert (await other.mailbox_status(user, INBOX)).messages == 3  # counted, and kept
    later = await deliver_many(store, user, 3)
    await asyncio.sleep(3.2)
    monkeypatch.setattr(cassandra_counts, "FOLD_ROWS", 2)  # the next STATUS folds the three
    reads: list[bool] = []
    real = store.tables.messages.state

    async def state(mailbox_id: uuid.UUID, wanted: list[uuid.UUID], serial: bool = True) -> list[object]:
        reads.append(serial)
        rows = await real(mailbox_id, wanted, serial)
        if len(reads) == 1:  # another node's STATUS folds the counts between this read and the batch
            with other.tracing() as cost:
                await other.mailbox_status(user, INBOX)
            assert cost.live_rows >= 6  # the tail, and again at ALL to fold it
        return rows

    store.tables.messages.state = state  # type: ignore[method-assign]
    await store.store_flags(user, INBOX, [ids[0], later[0]], ["\\Seen"], "add")
    assert reads == [False, True]  # decided again
    got = await other.mailbox_status(user, INBOX)
    assert got == await Store.mailbox_status(other, user, INBOX)  # the listing's count
    assert (got.messages, got.unseen) == (6, 4)


async def test_body_chunks_are_kept_uncompressed_and_compacted_in_tiers_of_eight(cassandra_settings) -> None:
    """Schema 012: the table of bodies has compression off (mail bodies are mostly compressed
    already; LZ4 cost Cassandra a third of its CPU per message delivered, loadtest/RESULTS.md).
    Schema 013: it is compacted by the unified strategy in tiers of eight (write-once chunks,
    rewritten less often than by size tiers of four)."""
    async with CassandraStore(cassandra_settings) as store:
        rows = await _cql(store, "SELECT compression, compaction FROM system_schema.tables "
                          "WHERE keyspace_name = ? AND table_name = 'body_chunks'", cassandra_settings.keyspace)
        [row] = list(rows)
        assert row.compression.get("enabled") == "false", row.compression
        assert row.compaction["class"].endswith("UnifiedCompactionStrategy"), row.compaction
        assert row.compaction.get("scaling_parameters") == "T8", row.compaction


async def test_a_deliverys_sieve_step_reads_nothing_for_a_user_whose_account_says_no_script(make_store) -> None:
    """The account row RCPT reads carries the Sieve mark (schema 016): for a user without an
    active script the delivery after it makes no request; a script activated on another node
    is run from the next RCPT on, and one deactivated there is not."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    assert await store.user_exists(user)  # RCPT
    with store.tracing() as cost:
        assert await store.active_sieve_script(user) is None
    assert cost.statements == 0
    await other.put_sieve_script(user, "rules", "keep;")
    await other.set_active_sieve_script(user, "rules")
    assert await store.user_exists(user)
    assert await store.active_sieve_script(user) == ("rules", "keep;")
    await other.set_active_sieve_script(user, None)
    assert await store.user_exists(user)
    with store.tracing() as cost:
        assert await store.active_sieve_script(user) is None
    assert cost.statements == 0


async def test_an_account_made_before_the_sieve_mark_still_has_its_script_run(make_store) -> None:
    """An account of a keyspace from before schema 016 has no mark (null), and its script was
    activated by naming it alone: its deliveries read the Sieve row as before."""
    store = await make_store()
    user = await new_user(store)
    await _cql(store, f"UPDATE {store.settings.keyspace}.users SET sieve = null WHERE user = ?", user)
    await store.put_sieve_script(user, "rules", "keep;")
    await store.tables.sieve_scripts.set_active(user, "rules")  # what activation wrote then
    assert await store.user_exists(user)
    assert await store.active_sieve_script(user) == ("rules", "keep;")


async def test_a_deactivation_crossed_by_an_activation_leaves_the_script_marked(make_store, monkeypatch) -> None:
    """Session A deactivates while session B, on another node, activates: B names the script and
    marks it between A's clearing of the name and A's clearing of the mark. A reads the name
    again after its mark and marks the script back, so its deliveries still run it."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    await store.put_sieve_script(user, "rules", "keep;")
    await store.set_active_sieve_script(user, "rules")
    unmark = store.tables.users.set_sieve_mark

    async def crossed(key: str, mark: bool) -> bool:
        if not mark:
            monkeypatch.setattr(store.tables.users, "set_sieve_mark", unmark)
            await other.set_active_sieve_script(user, "rules")
        return await unmark(key, mark)

    monkeypatch.setattr(store.tables.users, "set_sieve_mark", crossed)
    await store.set_active_sieve_script(user, None)
    assert store.tables.users.set_sieve_mark == unmark  # (the crossing happened)
    assert (await store.tables.users.account(user)).sieve is True
    assert await store.user_exists(user)
    assert await store.active_sieve_script(user) == ("rules", "keep;")
    assert [s.active for s in await store.list_sieve_scripts(user)] == [True]


async def test_a_sieve_mark_never_makes_a_deleted_user_live_again(make_store) -> None:
    """A script activated while the user is being deleted: the mark is conditional on the
    account, so the address can be created again."""
    store = await make_store()
    user = await new_user(store)
    await store.put_sieve_script(user, "rules", "keep;")
    await store.delete_user(user)
    assert not await store.tables.users.set_sieve_mark(user, True)
    assert await store.tables.users.account(user) is None
    await store.create_user(user, hash_password("pw", FAST_HASH))
    assert (await store.tables.users.account(user)).sieve is False


async def test_an_expunge_whose_first_round_loses_to_an_undelete_keeps_the_message_whole(make_store) -> None:
    """`delete_messages(only_deleted=True)` decides on the rows it read; when another session
    takes \\Deleted away before the conditional batch, the batch does not apply, the rows read
    again at SERIAL hold no \\Deleted, and nothing is deleted: not the row, not the body's
    chunks, not the quota usage."""
    store, other = await make_store(), await make_store()
    user = await new_user(store)
    body = b"Subject: kept\r\n\r\n" + os.urandom(3000)
    [message_id] = await store.deliver(body, [Target(user)])
    await store.assign_uids(user, INBOX, [message_id])
    await store.store_flags(user, INBOX, [message_id], ["\\Deleted"], "add")
    used = (await store.get_quota(user)).used
    real = store.cql.conditional
    rounds: list[bool] = []

    async def conditional(statement: Any, contention_not_applied: bool = False) -> tuple[bool, Any]:
        if not rounds:  # between the read and the first round: the other session's un-delete
            await other.store_flags(user, INBOX, [message_id], ["\\Deleted"], "remove")
        result = await real(statement, contention_not_applied)
        rounds.append(result[0])
        return result

    store.cql.conditional = conditional  # type: ignore[method-assign]
    assert await store.delete_messages(user, INBOX, [message_id], only_deleted=True) == set()
    assert rounds == [False]  # the first round lost; the second read found nothing to delete
    assert await other.read_message(user, INBOX, message_id) == body
    assert (await other.get_quota(user)).used == used
