"""The bytes a view snapshot is kept as in the store (cassmail.imap.snapshots)."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone

from cassmail.imap.snapshots import decode, encode
from cassmail.imap.view import Snapshot
from cassmail.model import MessageSummary, new_message_id


def _snapshot() -> Snapshot:
    start = datetime(2026, 11, 27, 10, 0, 0, 123456, tzinfo=timezone.utc)
    flag_sets = [frozenset(), frozenset({"\\Seen"}), frozenset({"\\Seen", "$Label1", "\\Flagged"})]
    uids = [3, 7, 8, 1000]
    messages = {
        uid: MessageSummary(new_message_id(), 1000 + n, flag_sets[n % 3], start + timedelta(microseconds=n * 1001),
                            uid, None if n == 2 else 50 + n)
        for n, uid in enumerate(uids)
    }
    return Snapshot(123, uids, messages, frozenset({"$Label1", "$Gone"}), 77, 1001, ("token",), time.monotonic(),
                    2**60 + 5, time.monotonic() - 30)


async def test_a_snapshot_comes_back_from_its_bytes_as_the_store_state_it_was() -> None:
    before = _snapshot()
    data = await encode(before)
    assert data is not None
    after = await decode(data)
    assert after is not None
    assert after.uids == before.uids and after.messages == before.messages
    assert [type(s.id) for s in after.messages.values()] == [uuid.UUID] * 4
    assert (after.uidvalidity, after.keywords, after.highest, after.uid_next, after.mark) == \
        (123, frozenset({"$Label1", "$Gone"}), 77, 1001, 2**60 + 5)
    # The changes token is not kept (the view reads what changed since); the last full listing is
    # as long ago as it was, on this process's clock.
    assert after.token is None
    assert abs((time.monotonic() - after.full_at) - 30) < 1
    assert after.messages[8].modseq is None and after.messages[8].flags == frozenset({"\\Seen", "$Label1", "\\Flagged"})


async def test_bytes_that_are_not_a_whole_snapshot_are_none() -> None:
    data = await encode(_snapshot())
    assert data is not None
    for broken in (b"", b"CMV1", data[:-1], data + b"x", b"CMV2" + data[4:], data[:8] + b"[" + data[9:]):
        assert await decode(broken) is None


async def test_a_snapshot_whose_mark_is_not_a_number_is_not_kept() -> None:
    snapshot = _snapshot()
    snapshot.mark = ("mbox", 5)
    assert await encode(snapshot) is None
