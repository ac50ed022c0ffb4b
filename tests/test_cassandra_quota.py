"""The Cassandra store's storage quotas beyond the shared contract (cassandra_quota.py): counters
kept only for users with a limit, drift from a counter update that failed, and the recount
that repairs it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import pytest

from cassmail.config import CassandraSettings
from cassmail.model import INBOX
from cassmail.store.base import Quota, QuotaExceeded, StoreUnavailable, Target
from cassmail.store.cassandra import CassandraStore
from tests.test_cassandra_store import new_user

pytestmark = pytest.mark.cassandra

BODY = b"Subject: q\r\n\r\n" + b"x" * 986  # 1000 bytes


@pytest.fixture
async def store(cassandra_settings: CassandraSettings) -> AsyncIterator[CassandraStore]:
    async with CassandraStore(cassandra_settings) as opened:
        yield opened


async def test_a_user_without_a_limit_has_no_counter_and_setting_one_counts_the_mailboxes(store: CassandraStore
                                                                                         ) -> None:
    user = await new_user(store)
    await store.deliver(BODY, [Target(user), Target(user, "Sent")])
    assert await store.tables.quota_usage.get(user) == (0, 0)  # nothing counted without a limit
    assert await store.get_quota(user) == Quota(None, 2000, 2)  # counted from the listings
    await store.set_quota(user, 5000)
    assert await store.tables.quota_usage.get(user) == (2000, 2)
    await store.deliver(BODY, [Target(user)])
    assert await store.tables.quota_usage.get(user) == (3000, 3)
    await store.set_quota(user, 4000)  # a limit changed, not set anew: no recount
    await store.set_quota(user, None)
    await store.deliver(BODY, [Target(user)])  # uncounted again
    assert await store.tables.quota_usage.get(user) == (3000, 3)
    await store.set_quota(user, 10_000)  # counted again, the difference added
    assert await store.tables.quota_usage.get(user) == (4000, 4)


async def test_a_lost_counter_update_is_drift_that_a_recount_repairs(store: CassandraStore,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A counter update is never retried: when it fails the delivery still succeeds (its mail is
    stored), the usage is short by it and the log says so; a recount adds it back."""
    user = await new_user(store)
    await store.set_quota(user, 3000)
    real_add = store.tables.quota_usage.add

    async def lost(user: str, size: int, messages: int) -> None:
        raise StoreUnavailable("Cassandra: write timeout (simulated)")

    monkeypatch.setattr(store.tables.quota_usage, "add", lost)
    with caplog.at_level(logging.WARNING, logger="cassmail.store.cassandra_quota"):
        [kept] = await store.deliver(BODY, [Target(user)])
    assert "quota-drift" in caplog.text and "bytes=1000" in caplog.text
    monkeypatch.setattr(store.tables.quota_usage, "add", real_add)
    assert [s.id async for s in store.list_messages(user, INBOX)] == [kept]
    assert await store.get_quota(user) == Quota(3000, 0, 0)  # drifted: one message short
    for _ in range(3):  # the drift lets one message more in than the limit allows
        await store.deliver(BODY, [Target(user)])
    with pytest.raises(QuotaExceeded):
        await store.deliver(BODY, [Target(user)])
    assert await store.get_quota(user) == Quota(3000, 3000, 3)
    assert await store.recount_quota(user) == Quota(3000, 4000, 4)
    assert await store.get_quota(user) == Quota(3000, 4000, 4)
    # and a deletion whose update is lost leaves it too high, until the next recount
    monkeypatch.setattr(store.tables.quota_usage, "add", lost)
    await store.delete_messages(user, INBOX, [kept])
    monkeypatch.setattr(store.tables.quota_usage, "add", real_add)
    assert (await store.get_quota(user)).used == 4000
    assert await store.recount_quota(user) == Quota(3000, 3000, 3)


async def test_deleting_a_mailbox_takes_its_mail_off_the_counter(store: CassandraStore) -> None:
    user = await new_user(store)
    await store.set_quota(user, 10_000)
    await store.create_mailbox(user, "Lists")
    for _ in range(3):
        await store.deliver(BODY, [Target(user, "Lists")])
    await store.deliver(BODY, [Target(user)])
    assert await store.tables.quota_usage.get(user) == (4000, 4)
    await store.delete_mailbox(user, "Lists")
    assert await store.tables.quota_usage.get(user) == (1000, 1)


async def test_rcpts_quota_check_reuses_the_account_row_its_user_lookup_read(
        store: CassandraStore, cassandra_settings: CassandraSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """RCPT looks the user up (the account row, limit included) and then asks whether the message
    fits: one read of the row, not two, for `mailbox_cache` seconds. A limit this store sets is
    seen at once; one set elsewhere once the row is older than that (and by the delivery, which
    checks the limit on the mailbox row it reads, at once)."""
    store.settings = dataclasses.replace(store.settings, mailbox_cache=60.0)  # a slow test stays in it
    user = await new_user(store)
    await store.set_quota(user, 1500)
    await store.deliver(BODY, [Target(user)])
    reads = 0
    real_account = store.tables.users.account

    async def counted(key: str, serial: bool = False) -> object:
        nonlocal reads
        reads += 1
        return await real_account(key, serial)

    monkeypatch.setattr(store.tables.users, "account", counted)
    assert await store.user_exists(user)
    assert await store.quota_allows(user, 400) is True
    assert await store.quota_allows(user, 600) is False
    assert reads == 1
    await store.set_quota(user, 5000)  # this store's own change: forgotten at once
    assert await store.quota_allows(user, 600) is True
    async with CassandraStore(cassandra_settings) as other:  # another node lowers the limit
        await other.set_quota(user, 1000)
    assert await store.quota_allows(user, 600) is True  # the row read a moment ago
    with pytest.raises(QuotaExceeded):
        await store.deliver(BODY, [Target(user)])  # the delivery reads the limit afresh
    store.settings = dataclasses.replace(store.settings, mailbox_cache=0.0)
    assert await store.quota_allows(user, 600) is False
