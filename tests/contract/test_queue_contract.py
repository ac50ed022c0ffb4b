"""The outbound queue and the DKIM keys of the Store contract, run against every backend.

The queue is store-wide, so each test starts and ends with it empty (`empty_queue`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from cassmail.model import InvalidAddress, InvalidInput
from cassmail.store.base import MessageTooLarge, NoSuchDomain, NoSuchQueueEntry, QueuedRecipient, Store

pytestmark = pytest.mark.cassandra

MESSAGE = b"From: anne@here.example\r\nTo: bob@there.example\r\nSubject: out\r\n\r\nHello\r\n\xe2\x9c\x93 8-bit\r\n"


@pytest.fixture
async def empty_queue(store: Store) -> AsyncIterator[Store]:
    async def clear() -> None:
        for entry in await store.list_queue():
            await store.delete_queued(entry.id)

    await clear()
    yield store
    await clear()


async def test_an_enqueued_message_is_listed_with_its_envelope_and_read_back_byte_exact(empty_queue: Store) -> None:
    store = empty_queue
    before = time.time()
    entry_id = await store.enqueue(MESSAGE, "anne@here.example", ["Bob@There.example", "carol@else.example",
                                                                  "Bob@There.example"], smtputf8=True)
    entry = await store.get_queued(entry_id)
    assert entry.id == entry_id and entry.sender == "anne@here.example" and entry.size == len(MESSAGE)
    # Remote local parts keep their case (only the remote may fold it); duplicates are dropped.
    assert [r.address for r in entry.recipients] == ["Bob@there.example", "carol@else.example"]
    assert all(r.state == "pending" and r.reply == "" for r in entry.recipients)
    assert before - 1 <= entry.created <= time.time() + 1 and before - 1 <= entry.due <= time.time() + 1
    assert (entry.attempts, entry.held, entry.warned, entry.lease_owner, entry.smtputf8) == (0, False, False, "", True)
    assert await store.read_queued(entry_id) == MESSAGE
    assert [e.id for e in await store.list_queue()] == [entry_id]
    assert [e.id for e in await store.list_queue("ELSE.example")] == [entry_id]
    assert await store.list_queue("nowhere.example") == []
    large = MESSAGE + os.urandom(300 * 1024)  # in chunks on Cassandra (more than its 128 KiB kept in the entry in tests)
    large_id = await store.enqueue(large, "anne@here.example", ["dan@there.example"])
    assert await store.read_queued(large_id) == large and (await store.get_queued(large_id)).size == len(large)
    await store.finish(large_id)
    assert [e.id for e in await store.list_queue()] == [entry_id]


async def test_enqueue_refuses_what_it_cannot_deliver_before_writing(empty_queue: Store) -> None:
    store = empty_queue
    with pytest.raises(InvalidInput):
        await store.enqueue(MESSAGE, "anne@here.example", [])
    with pytest.raises(InvalidAddress):
        await store.enqueue(MESSAGE, "anne@here.example", ["not an address"])
    limit = store.max_message_size
    store.max_message_size = 1024
    try:
        with pytest.raises(MessageTooLarge):
            await store.enqueue(b"x" * 2048, "anne@here.example", ["bob@there.example"])
    finally:
        store.max_message_size = limit
    bounce = await store.enqueue(MESSAGE, "<>", ["bob@there.example"])
    assert (await store.get_queued(bounce)).sender == ""
    assert [e.id for e in await store.list_queue()] == [bounce]


async def test_a_due_entry_is_leased_to_one_worker_until_the_lease_runs_out(empty_queue: Store) -> None:
    store = empty_queue
    entry_id = await store.enqueue(MESSAGE, "anne@here.example", ["bob@there.example"])
    asked = time.time()
    [taken] = await store.take_due("node1/1", 10, lease=2.0)
    assert taken.id == entry_id and taken.lease_owner == "node1/1" and taken.lease_until >= asked + 1.9
    assert taken.recipients == (QueuedRecipient("bob@there.example"),)
    if time.time() < taken.lease_until - 0.2:  # (a machine too busy to ask again within the lease proves nothing)
        assert await store.take_due("node2/1", 10, lease=2.0) == []
        assert (await store.get_queued(entry_id)).lease_owner == "node1/1"
    await asyncio.sleep(max(taken.lease_until - time.time(), 0) + 0.3)
    [again] = await store.take_due("node2/1", 10, lease=30.0)  # the first worker died: its lease ran out
    assert again.id == entry_id and again.lease_owner == "node2/1"
    assert not await store.renew_lease(entry_id, "node1/1", 30.0)
    assert not await store.record_results(entry_id, "node1/1", [QueuedRecipient("bob@there.example", "sent", "250 ok")])
    assert await store.renew_lease(entry_id, "node2/1", 30.0)
    assert (await store.get_queued(entry_id)).recipients[0].state == "pending"


async def test_results_are_recorded_per_recipient_and_an_entry_is_finished_once_all_are_final(
    empty_queue: Store,
) -> None:
    store = empty_queue
    entry_id = await store.enqueue(MESSAGE, "anne@here.example", ["bob@there.example", "carol@else.example"])
    [taken] = await store.take_due("w", 10, lease=30.0)
    sent = QueuedRecipient("bob@there.example", "sent", "250 2.0.0 queued as 17", "mx.there.example[127.0.0.2]")
    assert await store.record_results(entry_id, "w", [sent])
    entry = await store.get_queued(entry_id)
    assert entry.recipients == (sent, QueuedRecipient("carol@else.example"))
    assert [r.address for r in entry.pending] == ["carol@else.example"]
    failed = QueuedRecipient("carol@else.example", "failed", "550 5.1.1 no such user", "mx.else.example[127.0.0.3]")
    assert await store.record_results(entry_id, "w", [failed])
    await store.finish(entry_id)
    await store.finish(entry_id)  # idempotent
    assert await store.list_queue() == []
    for call in (store.get_queued(entry_id), store.read_queued(entry_id)):
        with pytest.raises(NoSuchQueueEntry):
            await call
    assert await store.take_due("w", 10, lease=30.0) == []


async def test_a_rescheduled_entry_waits_for_its_due_time_and_counts_the_attempt(empty_queue: Store) -> None:
    store = empty_queue
    entry_id = await store.enqueue(MESSAGE, "anne@here.example", ["bob@there.example", "carol@else.example"])
    await store.take_due("w", 10, lease=30.0)
    deferred = QueuedRecipient("bob@there.example", "pending", "451 4.3.0 try later", "mx.there.example[127.0.0.2]")
    sent = QueuedRecipient("carol@else.example", "sent", "250 ok", "mx.else.example[127.0.0.3]")
    assert await store.reschedule(entry_id, "w", time.time() + 1.0, "451 4.3.0 try later", warned=True,
                                  results=[deferred, sent])
    assert not await store.reschedule(entry_id, "w", time.time(), "again")  # the lease was given up
    entry = await store.get_queued(entry_id)
    assert (entry.attempts, entry.last_error, entry.warned, entry.lease_owner) == (1, "451 4.3.0 try later", True, "")
    assert entry.recipients == (deferred, sent) and entry.due > time.time()
    assert await store.take_due("w2", 10, lease=30.0) == []
    await asyncio.sleep(1.2)
    [again] = await store.take_due("w2", 10, lease=30.0)
    assert again.attempts == 1 and again.warned and [r.address for r in again.pending] == ["bob@there.example"]
    assert await store.reschedule(entry_id, "w2", time.time() + 3600, "451 again")
    assert (await store.get_queued(entry_id)).attempts == 2


async def test_operators_hold_release_retry_and_delete_entries(empty_queue: Store) -> None:
    store = empty_queue
    first = await store.enqueue(MESSAGE, "anne@here.example", ["bob@there.example"])
    later = await store.enqueue(MESSAGE, "anne@here.example", ["carol@else.example"], due=time.time() + 3600)
    await store.hold_queued(first, True)
    assert (await store.get_queued(first)).held
    assert await store.take_due("w", 10, lease=30.0) == []  # held, and not due
    assert await store.retry_queued(later) == 1
    [taken] = await store.take_due("w", 10, lease=30.0)
    assert taken.id == later
    await store.hold_queued(first, False)
    [released] = await store.take_due("w", 10, lease=30.0)
    assert released.id == first and not released.held
    await store.delete_queued(later)
    assert [e.id for e in await store.list_queue()] == [first]
    ghost = uuid.uuid1()
    for call in (store.get_queued(ghost), store.hold_queued(ghost, True), store.delete_queued(ghost),
                 store.retry_queued(ghost)):
        with pytest.raises(NoSuchQueueEntry):
            await call
    assert await store.retry_queued() == 1  # every entry that is not held


async def test_two_workers_taking_at_once_never_get_the_same_entry(empty_queue: Store) -> None:
    store = empty_queue
    ids = {await store.enqueue(MESSAGE, "anne@here.example", [f"r{k}@there.example"]) for k in range(12)}
    got = await asyncio.gather(*(store.take_due(f"w{k}", 5, lease=30.0) for k in range(4)))
    taken = [e.id for batch in got for e in batch]
    assert len(taken) == len(set(taken)) and set(taken) <= ids and all(len(batch) <= 5 for batch in got)
    rest = await store.take_due("w9", 20, lease=30.0)
    assert {e.id for e in rest} | set(taken) == ids and not {e.id for e in rest} & set(taken)


async def test_dkim_keys_are_kept_per_local_domain(store: Store, domain: str) -> None:
    pem = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n"
    assert await store.get_dkim_key(domain) is None
    await store.set_dkim_key(domain.upper(), "s2026", pem)
    key = await store.get_dkim_key(domain)
    assert key is not None and (key.domain, key.selector, key.private_key_pem) == (domain, "s2026", pem)
    assert domain in [k.domain for k in await store.list_dkim_keys()]
    await store.set_dkim_key(domain, "s2027", pem)
    assert (await store.get_dkim_key(domain)).selector == "s2027"  # type: ignore[union-attr]
    with pytest.raises(NoSuchDomain):
        await store.set_dkim_key(f"remote-{uuid.uuid4().hex[:6]}.example", "s", pem)
    for selector, key_text in (("bad selector", pem), ("s", "not a key")):
        with pytest.raises(InvalidInput):
            await store.set_dkim_key(domain, selector, key_text)
    await store.delete_dkim_key(domain)
    await store.delete_dkim_key(domain)
    assert await store.get_dkim_key(domain) is None


async def test_an_entry_queued_with_a_lease_is_its_owners_until_the_lease_runs_out(empty_queue: Store) -> None:
    store = empty_queue
    entry_id = await store.enqueue(MESSAGE, "anne@here.example", ["bob@there.example"], lease=("accepting/1", 1.0))
    entry = await store.get_queued(entry_id)
    assert entry.lease_owner == "accepting/1" and entry.lease_until > time.time()
    assert await store.take_due("other/1", 10, lease=30.0) == []  # the accepting worker delivers it
    assert await store.renew_lease(entry_id, "accepting/1", 1.0)
    assert await store.read_queued(entry_id) == MESSAGE
    await asyncio.sleep(1.3)  # ... unless it died: then anyone takes it when the lease ran out
    [taken] = await store.take_due("other/1", 10, lease=30.0)
    assert taken.id == entry_id and taken.lease_owner == "other/1"
    assert not await store.reschedule(entry_id, "accepting/1", time.time(), "too late")
    sent = QueuedRecipient("bob@there.example", "sent", "250 ok")
    assert await store.record_results(entry_id, "other/1", [sent])
    await store.finish(entry_id)
    assert await store.list_queue() == []
