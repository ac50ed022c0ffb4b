"""The IMAP front end over a store with faults the test injects: an IMAP listener runs in this
process (on the test's event loop, as a worker runs it) over a wrapper of the real store that
hides chosen messages from listings (the way a read at consistency ONE can miss a recent write),
makes UID numbering fail or race with another session's expunge, or holds or fails a body read
after its first chunk. The clients are real sockets, driven from threads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import imaplib
import logging
import re
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from cassmail.config import CassandraSettings, Settings
from cassmail.model import MessageSummary
from cassmail.store.base import Store, StoreUnavailable, Target
from tests.conftest import FAST_HASH, hash_password, opened_store
from tests.nodes import node_settings, server_end_quickack
from tests.test_imap import Raw, message

pytestmark = pytest.mark.cassandra


class FaultyStore:
    """The real store, with faults: `list_messages` leaves out the ids in `hidden` (a stale
    replica's answer), and while `stalled` is an event not set it waits for it (a store that
    does not answer); the next `assign_uids` of new ids raises `assign_error`, or, in the
    mailbox `expunge_before_numbering`, finds the first of them already expunged by another
    session; `read_chunks` of an id in `held` waits, once it has given its first chunk, until
    that event is set (`holding` tells when it is waiting), and of an id in `fail_once` raises
    StoreUnavailable there, once. Everything else goes to the real store."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.hidden: set[uuid.UUID] = set()
        self.stalled: asyncio.Event | None = None
        self.assign_error: Exception | None = None
        self.expunge_before_numbering: str | None = None
        self.held: dict[uuid.UUID, asyncio.Event] = {}
        self.holding = asyncio.Event()
        self.fail_once: set[uuid.UUID] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def arrivals_mark(self, summaries: Any, started: Any = None) -> None:
        """None: a view over this wrapper lists in full at every refresh, so the stale listings it
        makes are what the view compares with (not changed_since and arrivals, which it leaves
        alone)."""
        return None

    async def changes_token(self, user: str, mailbox: str) -> None:
        """None: the listings this wrapper makes stale differ without any change to the store."""
        return None

    async def changes_state(self, user: str, mailbox: str) -> tuple[None, None]:
        return None, None

    async def list_messages(self, user: str, mailbox: str, page_size: int = 500) -> AsyncIterator[MessageSummary]:
        if self.stalled is not None:
            await self.stalled.wait()
        async for summary in self.inner.list_messages(user, mailbox, page_size):
            if summary.id not in self.hidden:
                yield summary

    async def assign_uids(self, user: str, mailbox: str, ids: Sequence[uuid.UUID],
                          renumber: dict[uuid.UUID, int] | None = None,
                          modseqs: dict[uuid.UUID, int] | None = None,
                          listed_at: int | None = None) -> dict[uuid.UUID, int]:
        if ids and self.assign_error is not None:
            error, self.assign_error = self.assign_error, None
            raise error
        if ids and self.expunge_before_numbering == mailbox:
            self.expunge_before_numbering = None
            await self.inner.delete_messages(user, mailbox, [ids[0]])
        return await self.inner.assign_uids(user, mailbox, ids, renumber=renumber, modseqs=modseqs,
                                            listed_at=listed_at)

    async def append(self, body: bytes, target: Target, internal_date: Any = None,
                     modseqs: dict[uuid.UUID, int] | None = None, recent: Any = None) -> MessageSummary:
        """With `assign_error` set, the contract's own APPEND (deliver, then number with
        `assign_uids`) over this wrapper, so that the numbering meets the fault after the message
        is stored; else the store's (the mbox store numbers in the delivery's own write)."""
        if self.assign_error is not None:
            return await Store.append(self, body, target, internal_date, modseqs, recent)  # type: ignore[arg-type]
        return await self.inner.append(body, target, internal_date, modseqs, recent)

    _number_appended = Store._number_appended  # (the base's: through this wrapper's assign_uids)

    async def read_chunks(self, user: str, mailbox: str, message_id: uuid.UUID, start: int = 0,
                          end: int | None = None) -> AsyncIterator[bytes]:
        stream = self.inner.read_chunks(user, mailbox, message_id, start, end)
        try:
            first = True
            async for chunk in stream:
                yield chunk
                if first:
                    first = False
                    if message_id in self.fail_once:
                        self.fail_once.discard(message_id)
                        raise StoreUnavailable("injected: the store stopped answering after one chunk")
                    if message_id in self.held:
                        self.holding.set()
                        await self.held[message_id].wait()
        finally:
            await stream.aclose()


@contextlib.asynccontextmanager
async def faulty_listener(settings: Settings, store: Store) -> AsyncIterator[tuple[FaultyStore, int]]:
    """(the wrapper, the port of an IMAP listener in this process over it)."""
    from cassmail import imap as imap_front

    settings = node_settings(settings)
    settings.imap = dataclasses.replace(settings.imap, listen="127.0.0.1:0", allow_plaintext_auth=True,
                                        auth_failure_delay=0.0, idle_poll=0.2)
    wrapped = FaultyStore(store)
    [(server, _listener)] = await imap_front.start(settings, wrapped)  # type: ignore[arg-type]
    try:
        yield wrapped, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def faulty_imap(backend_settings: Settings, store: Store) -> AsyncIterator[tuple[FaultyStore, int]]:
    async with faulty_listener(backend_settings, store) as listening:
        yield listening


@pytest.fixture
async def chunked_imap(cassandra_settings: CassandraSettings) -> AsyncIterator[tuple[FaultyStore, int, str]]:
    """Cassandra with bodies in 4 KiB chunks read two ahead: (the wrapper, the port, a user whose
    password is "anne")."""
    settings = Settings()
    settings.store.backend = "cassandra"
    settings.store.cassandra = dataclasses.replace(cassandra_settings, chunk_size=4096, chunk_concurrency=2)
    async with opened_store(settings) as store:
        user = await new_user(store)
        async with faulty_listener(settings, store) as (wrapped, port):
            yield wrapped, port, user


async def new_user(store: Store) -> str:
    """anne, password "anne", in a fresh domain of a store the `users` fixture does not serve."""
    domain = f"t{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    await store.create_user(f"anne@{domain}", hash_password("anne", FAST_HASH))
    return f"anne@{domain}"


async def cmd(raw: Raw, line: str) -> list[bytes]:
    return await asyncio.to_thread(raw.cmd, line)


async def _uids_and_subjects(raw: Raw) -> dict[int, bytes]:
    out = b"".join(await cmd(raw, "FETCH 1:* (UID BODY.PEEK[HEADER.FIELDS (SUBJECT)])"))
    return {int(uid): subject for uid, subject in re.findall(rb"UID (\d+) BODY\[[^\]]*\] \{\d+\}\r\n(Subject: [^\r]*)", out)}


async def test_a_message_listed_late_below_a_shown_uid_is_renumbered(faulty_imap, store: Store, users,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Node A numbers m5 as UID 5; this node's reads miss m5, number m6 as UID 6 and show it. When
    m5 shows up here, UID 5 is below what the client has: m5 gets a new UID above all others and
    comes as a new message. Then a stale read hides m2, whose EXPUNGE is told; when m2 comes back
    it gets a new UID too (an expunged UID never comes back), and a session that still showed
    UID 2 is told EXPUNGE 2 and a new message."""
    caplog.set_level(logging.INFO, logger="cassmail.imap")
    wrapped, port = faulty_imap
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


async def test_two_sessions_renumbering_one_message_give_it_one_new_uid(faulty_imap, store: Store, users) -> None:
    """Both sessions showed UID 3 while m2 (UID 2) was hidden; each renumbers it as it comes back,
    and both end with the same single new UID."""
    wrapped, port = faulty_imap
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


def _bodies(lines: list[bytes]) -> dict[int, bytes]:
    """Sequence number -> BODY[] literal of each `* n FETCH (BODY[] {size}` response among `lines`
    (as Raw.until reads them: the literal is the element after its line)."""
    out = {}
    for i, line in enumerate(lines):
        m = re.match(rb"\* (\d+) FETCH \(BODY\[\] \{(\d+)\}\r\n\Z", line)
        if m:
            assert len(lines[i + 1]) == int(m.group(2)) and lines[i + 2].endswith(b")\r\n"), lines[i:i + 3]
            out[int(m.group(1))] = lines[i + 1]
    return out


async def _selected(port: int, user: str, password: str, mailbox: str) -> Raw:
    raw = await asyncio.to_thread(Raw, port)
    await asyncio.to_thread(raw.login, user, password)
    assert b" OK " in (await cmd(raw, f"SELECT {mailbox}"))[-1]
    return raw


async def test_a_body_expunged_while_its_literal_is_sent_is_padded_answered_no_and_the_session_goes_on(
        chunked_imap, caplog: pytest.LogCaptureFixture) -> None:
    """RFC 2180 on Cassandra: a 45 KB message (4 KiB chunks) is expunged by another session after
    its FETCH literal was announced and its first chunk sent, so the rest of its chunks are gone.
    The literal's length cannot be taken back: it is completed with padding, the messages around
    it come whole, the command answers NO [EXPUNGEISSUED], and the connection goes on (NOOP tells
    the EXPUNGE; the next FETCH is answered)."""
    caplog.set_level(logging.INFO, logger="cassmail.imap")
    wrapped, port, user = chunked_imap
    big = message(2, b"".join(b"line %05d of a body in many chunks\r\n" % i for i in range(1200)))
    bodies = [message(1), big, message(3)]
    ids = [(await wrapped.inner.deliver(body, [Target(user, "INBOX")]))[0] for body in bodies]
    reader = await _selected(port, user, "anne", "INBOX")
    expunger = await _selected(port, user, "anne", "INBOX")
    released = asyncio.Event()
    wrapped.held[ids[1]] = released
    fetching = asyncio.create_task(cmd(reader, "FETCH 1:3 BODY.PEEK[]"))
    await asyncio.wait_for(wrapped.holding.wait(), 20)  # the literal of message 2 is announced
    assert (await cmd(expunger, "STORE 2 +FLAGS.SILENT (\\Deleted)"))[-1].startswith(b"t3 OK")
    assert (await cmd(expunger, "EXPUNGE"))[0] == b"* 2 EXPUNGE\r\n"
    released.set()
    out = await asyncio.wait_for(fetching, 30)
    assert out[-1] == b"t3 NO [EXPUNGEISSUED] Some messages were expunged meanwhile\r\n", out[-1]
    got = _bodies(out)
    assert got[1] == bodies[0] and got[3] == bodies[2]
    real = got[2].rstrip(b" ")
    assert len(got[2]) == len(big) and 4096 <= len(real) < len(big) - 4096 and big.startswith(real), len(real)
    assert (await cmd(reader, "NOOP"))[0] == b"* 2 EXPUNGE\r\n"
    assert _bodies(await cmd(reader, "FETCH 2 BODY.PEEK[]")) == {2: bodies[2]}
    assert "event=imap-fetch-vanished" in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("cassmail") and r.levelno >= logging.WARNING], caplog.text


async def test_a_body_read_that_fails_midway_is_resumed_where_it_stopped(faulty_imap, store: Store, users,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The store stops answering after the first chunk of a literal (the message is still there):
    the read is taken up again from the byte it stopped at, and the client gets the message whole."""
    caplog.set_level(logging.INFO, logger="cassmail.imap")
    wrapped, port = faulty_imap
    user = users["carol"]
    big = message(1, b"".join(b"line %06d, long enough to take several chunks\r\n" % i for i in range(14000)))
    [failing] = await store.deliver(big, [Target(user, "Junk")])
    wrapped.fail_once.add(failing)
    raw = await _selected(port, user, "carol", "Junk")
    out = await cmd(raw, "FETCH 1 BODY.PEEK[]")
    assert out[-1] == b"t3 OK FETCH completed\r\n" and _bodies(out) == {1: big}
    assert not wrapped.fail_once and "event=imap-fetch-resume" in caplog.text


def _set_size(numbers: bytes) -> int:
    return sum(int(b) - int(a) + 1 if b else 1 for a, b in re.findall(rb"(\d+)(?::(\d+))?", numbers))


async def test_append_and_copy_answer_a_plain_ok_when_no_uid_can_be_had(faulty_imap, store: Store, users) -> None:
    """RFC 4315 lets a server leave APPENDUID and COPYUID out. When numbering fails (the store
    unavailable for it), the message is stored all the same and the answer is a plain OK; it gets
    its UID when a session next lists the mailbox, and the next APPEND and COPY carry their codes."""
    wrapped, port = faulty_imap
    user = users["anne"]
    client = await asyncio.to_thread(imaplib.IMAP4, "127.0.0.1", port, 20)
    await asyncio.to_thread(client.login, user, "anne")
    wrapped.assign_error = StoreUnavailable("injected: numbering timed out")
    assert await asyncio.to_thread(client.append, "Drafts", None, None, message(1)) == ("OK", [b"APPEND completed"])
    assert wrapped.assign_error is None  # the fault was met
    typ, data = await asyncio.to_thread(client.append, "Drafts", None, None, message(2))
    assert typ == "OK" and re.fullmatch(rb"\[APPENDUID \d+ \d+\] APPEND completed", data[0]), data
    assert await asyncio.to_thread(client.select, "Drafts") == ("OK", [b"2"])
    typ, data = await asyncio.to_thread(client.uid, "SEARCH", "ALL")
    assert (typ, data) == ("OK", [b"1 2"])
    wrapped.assign_error = StoreUnavailable("injected: numbering timed out")
    assert await asyncio.to_thread(client.copy, "1:2", "Archive") == ("OK", [b"COPY completed"])
    typ, data = await asyncio.to_thread(client.copy, "1:2", "Archive")
    assert typ == "OK" and re.fullmatch(rb"\[COPYUID \d+ 1:2 \d+:\d+\] COPY completed", data[0]), data
    assert len([s async for s in store.list_messages(user, "Archive")]) == 4
    await asyncio.to_thread(client.logout)


async def test_copyuid_is_left_out_when_a_copy_is_expunged_before_it_is_numbered(faulty_imap, store: Store,
                                                                                 users) -> None:
    """COPYUID pairs its two sets one to one: when another session expunged one of the copies
    before they were numbered, only some UIDs come back, and the answer is an OK without COPYUID
    rather than two sets of different lengths."""
    wrapped, port = faulty_imap
    user = users["bob"]
    for i in range(3):
        await store.deliver(message(i), [Target(user, "INBOX")])
    client = await asyncio.to_thread(imaplib.IMAP4, "127.0.0.1", port, 20)
    await asyncio.to_thread(client.login, user, "bob")
    assert (await asyncio.to_thread(client.select, "INBOX"))[0] == "OK"
    wrapped.expunge_before_numbering = "Trash"
    assert await asyncio.to_thread(client.copy, "1:3", "Trash") == ("OK", [b"COPY completed"])
    assert wrapped.expunge_before_numbering is None
    assert len([s async for s in store.list_messages(user, "Trash")]) == 2
    typ, data = await asyncio.to_thread(client.copy, "1,3", "Trash")
    m = re.fullmatch(rb"\[COPYUID \d+ ([\d:,]+) ([\d:,]+)\] COPY completed", data[0])
    assert typ == "OK" and m and m.group(1) == b"1,3" and _set_size(m.group(2)) == 2, data
    await asyncio.to_thread(client.logout)


async def test_a_literal_is_acknowledged_at_once_for_clients_that_send_the_crlf_after_it_apart(
    faulty_imap, store: Store, users
) -> None:
    """After the continuation of a synchronising literal the server's end leaves the delayed-ACK
    mode: imaplib (Nagle's algorithm on) sends the literal and then the CRLF that ends the command
    on its own, which would otherwise wait for the literal's delayed ACK, 40 ms and more, on every
    APPEND."""
    _, port = faulty_imap
    raw = await asyncio.to_thread(Raw, port)
    raw.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    assert (await cmd(raw, f"LOGIN {users['anne']} anne"))[-1].startswith(b"t1 OK")
    for n in range(2):
        for _ in range(3):
            assert (await cmd(raw, "NOOP"))[-1].split()[1] == b"OK"
        literal = message(n)
        await asyncio.to_thread(raw.send, b"a%d APPEND Drafts {%d}\r\n" % (n, len(literal)))
        assert (await asyncio.to_thread(raw.file.readline)).startswith(b"+ ")
        assert await asyncio.to_thread(server_end_quickack, raw.sock) == 1
        await asyncio.to_thread(raw.send, literal)
        await asyncio.to_thread(raw.send, b"\r\n")
        assert (await asyncio.to_thread(raw.until, b"a%d" % n))[-1].startswith(b"a%d OK" % n)
    assert len([s async for s in store.list_messages(users["anne"], "Drafts")]) >= 2
