"""The IMAP front end over a store whose reads the test makes stale: an IMAP listener runs in
this process (on the test's event loop, as a worker runs it) over a wrapper that hides chosen
messages from listings, the way a read at consistency ONE can miss a recent write. The clients
are real sockets, driven from threads."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cassmail.config import Settings
from cassmail.model import MessageSummary
from cassmail.store.base import Store, Target
from tests.nodes import node_settings
from tests.test_imap import Raw, message

pytestmark = pytest.mark.cassandra


class StaleStore:
    """The real store, except that `list_messages` leaves out the ids in `hidden` (a stale
    replica's answer). Everything else, numbering included, goes to the real store."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.hidden: set[uuid.UUID] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def changes_token(self, user: str, mailbox: str) -> None:
        """None: the listings this wrapper makes stale differ without any change to the store."""
        return None

    async def list_messages(self, user: str, mailbox: str, page_size: int = 500) -> AsyncIterator[MessageSummary]:
        async for summary in self.inner.list_messages(user, mailbox, page_size):
            if summary.id not in self.hidden:
                yield summary


@pytest.fixture
async def stale_imap(backend_settings: Settings, store: Store) -> AsyncIterator[tuple[StaleStore, int]]:
    """(the wrapper, the port of an IMAP listener in this process over it)."""
    from cassmail import imap as imap_front

    settings = node_settings(backend_settings)
    settings.imap = dataclasses.replace(settings.imap, listen="127.0.0.1:0", allow_plaintext_auth=True,
                                        auth_failure_delay=0.0, idle_poll=0.2)
    wrapped = StaleStore(store)
    [(server, _listener)] = await imap_front.start(settings, wrapped)  # type: ignore[arg-type]
    yield wrapped, server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def cmd(raw: Raw, line: str) -> list[bytes]:
    return await asyncio.to_thread(raw.cmd, line)


async def _uids_and_subjects(raw: Raw) -> dict[int, bytes]:
    out = b"".join(await cmd(raw, "FETCH 1:* (UID BODY.PEEK[HEADER.FIELDS (SUBJECT)])"))
    return {int(uid): subject for uid, subject in re.findall(rb"UID (\d+) BODY\[[^\]]*\] \{\d+\}\r\n(Subject: [^\r]*)", out)}


async def test_a_message_listed_late_below_a_shown_uid_is_renumbered(stale_imap, store: Store, users,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Node A numbers m5 as UID 5; this node's reads miss m5, number m6 as UID 6 and show it. When
    m5 shows up here, UID 5 is below what the client has: m5 gets a new UID above all others and
    comes as a new message. Then a stale read hides m2, whose EXPUNGE is told; when m2 comes back
    it gets a new UID too (an expunged UID never comes back), and a session that still showed
    UID 2 is told EXPUNGE 2 and a new message."""
    caplog.set_level(logging.INFO, logger="cassmail.imap")
    wrapped, port = stale_imap
    user = users["anne"]
    for i in range(1, 5):
        await store.deliver(message(i), [Target(user, "Archive")])
    raw = await asyncio.to_thread(Raw, port)
    await asyncio.to_thread(raw.login, user, "anne")
    assert b"* 4 EXISTS\r\n" in await cmd(raw, "SELECT Archive")
    other = await asyncio.to_thread(Raw, port)  # a second session that only looks at the start and the end
    await asyncio.to_thread(other.login, user, "anne")
    assert b"* 4 EXISTS\r\n" in await cmd(other, "EXAMINE Archive")

    [m5] = await store.deliver(message(5), [Target(user, "Archive")])
    assert await store.assign_uids(user, "Archive", [m5]) == {m5: 5}  # "node A"
    wrapped.hidden.add(m5)
    await store.deliver(message(6), [Target(user, "Archive")])
    out = await cmd(raw, "NOOP")
    assert out[:2] == [b"* 5 EXISTS\r\n", b"* 5 RECENT\r\n"]  # this session numbered all five
    assert (await _uids_and_subjects(raw))[6] == b"Subject: message 6"

    wrapped.hidden.clear()  # m5 becomes visible here, with UID 5 < 6
    out = await cmd(raw, "NOOP")
    assert out[0] == b"* 6 EXISTS\r\n", out
    seen = await _uids_and_subjects(raw)
    assert list(seen) == [1, 2, 3, 4, 6, 7] and seen[7] == b"Subject: message 5"
    fetched = b"".join(await cmd(raw, "UID FETCH 7 (UID BODY.PEEK[])"))
    assert b"* 6 FETCH (UID 7 BODY[] {%d}\r\n" % len(message(5)) + message(5) in fetched
    assert await cmd(raw, "UID FETCH 5 (UID)") == [b"t%d OK UID FETCH completed\r\n" % raw.n]
    assert {s.id: s.uid async for s in store.list_messages(user, "Archive")}[m5] == 7
    assert b"[UIDNEXT 8]" in b"".join(await cmd(raw, "EXAMINE Archive")) and b"[UIDNEXT 8]" in b"".join(
        await cmd(raw, "SELECT Archive"))

    # a stale read hides m2, which the view showed: its EXPUNGE is told ...
    [m2] = [s.id async for s in store.list_messages(user, "Archive") if s.uid == 2]
    wrapped.hidden.add(m2)
    assert (await cmd(raw, "NOOP"))[0] == b"* 2 EXPUNGE\r\n"
    wrapped.hidden.clear()
    # ... and when it comes back it is a new message, UID 8, never UID 2 again
    out = await cmd(raw, "NOOP")
    assert out[0] == b"* 6 EXISTS\r\n", out
    seen = await _uids_and_subjects(raw)
    assert list(seen) == [1, 3, 4, 6, 7, 8] and seen[8] == b"Subject: message 2"
    assert b"BODY[] {%d}\r\n" % len(message(2)) + message(2) in b"".join(await cmd(raw, "UID FETCH 8 (BODY.PEEK[])"))
    # the session that showed UIDs 1 to 4 since its EXAMINE: EXPUNGE 2, then the new messages 6, 7, 8
    out = await cmd(other, "NOOP")
    assert out[0] == b"* 2 EXPUNGE\r\n" and b"* 6 EXISTS\r\n" in out, out
    assert list(await _uids_and_subjects(other)) == [1, 3, 4, 6, 7, 8]
    assert [s.uid async for s in store.list_messages(user, "Archive")] == [1, 8, 3, 4, 7, 6]
    assert "event=imap-renumber" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_two_sessions_renumbering_one_message_give_it_one_new_uid(stale_imap, store: Store, users) -> None:
    """Both sessions showed UID 3 while m2 (UID 2) was hidden; each renumbers it as it comes back,
    and both end with the same single new UID."""
    wrapped, port = stale_imap
    user = users["bob"]
    ids = [(await store.deliver(message(i), [Target(user, "Junk")]))[0] for i in range(1, 4)]
    sessions = [await asyncio.to_thread(Raw, port) for _ in range(2)]
    for raw in sessions:
        await asyncio.to_thread(raw.login, user, "bob")
        assert b"* 3 EXISTS\r\n" in await cmd(raw, "SELECT Junk")
    wrapped.hidden.add(ids[1])
    for raw in sessions:
        assert (await cmd(raw, "NOOP"))[0] == b"* 2 EXPUNGE\r\n"
    wrapped.hidden.clear()
    answers = await asyncio.gather(*(cmd(raw, "NOOP") for raw in sessions))
    assert all(a[0] == b"* 3 EXISTS\r\n" for a in answers), answers
    views = [await _uids_and_subjects(raw) for raw in sessions]
    assert views[0] == views[1] == {1: b"Subject: message 1", 3: b"Subject: message 3", 4: b"Subject: message 2"}
    assert [s.uid async for s in store.list_messages(user, "Junk")] == [1, 4, 3]
