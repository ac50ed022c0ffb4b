"""IMAP pipelining over raw sockets: commands with literals (LITERAL+ `{n+}` and synchronising
`{n}`) sent in one write, byte by byte and split anywhere are all answered, in order; what a
client sends ahead of its answers is bounded; LIST patterns cannot stall a worker."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cassmail.store.base import Store, Target
from tests.conftest import backend_settings_for, opened_store
from tests.nodes import Node, node_settings
from tests.test_imap_faults import new_user

pytestmark = pytest.mark.cassandra

MESSAGE = b"Subject: x\r\n\r\nhi\r\n"  # 18 bytes: the issue's {18+}


@pytest.fixture(scope="module")
def pipe_node(backend_settings, tmp_path_factory) -> Iterator[Node]:
    running = Node(node_settings(backend_settings), tmp_path_factory.mktemp("pipenode"),
                   imap={"allow_plaintext_auth": True, "auth_failure_delay": 0.0, "max_pipelined_bytes": 64 * 1024}).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text()


class Wire:
    """A raw IMAP connection that reads whole responses (literals included)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.file = self.sock.makefile("rb")
        assert self.file.readline().startswith(b"* OK")
        #: Lines read while waiting for a continuation, to be read again by what comes next.
        self.pending: list[bytes] = []

    def line(self) -> bytes:
        return self.pending.pop(0) if self.pending else self._read()

    def _read(self) -> bytes:
        line = self.file.readline()
        assert line, "the server closed the connection"
        m = re.search(rb"\{(\d+)\}\r\n\Z", line)
        return line + self.file.read(int(m.group(1))) + self._read() if m else line

    def until(self, tag: bytes) -> list[bytes]:
        lines = []
        while not lines or not lines[-1].startswith(tag + b" "):
            lines.append(self.line())
        return lines

    def login(self, user: str, password: str, mailbox: bytes = b"INBOX") -> None:
        self.sock.sendall(b"L1 LOGIN %s %s\r\nL2 SELECT %s\r\n" % (user.encode(), password.encode(), mailbox))
        assert self.until(b"L1")[-1].startswith(b"L1 OK")
        assert self.until(b"L2")[-1].startswith(b"L2 OK")

    def send_in(self, data: bytes, cuts: list[int], tags: list[bytes]) -> None:
        """`data` in pieces cut at the given offsets, each its own write (with a pause, so the
        server reads them apart). After a synchronising literal's `{n}` the client stops, as
        RFC 3501 asks, until the server's `+`, and checks that the `+` came only once every
        command before that one was answered."""
        barriers = {m.end() for m in re.finditer(rb"\{\d+\}\r\n", data)}
        start = 0
        for cut in sorted({*cuts, *barriers, len(data)}):
            if cut > start:
                self.sock.sendall(data[start:cut])
                time.sleep(0.002)
            start = cut
            if cut in barriers:
                starts = {tag: data.find(tag + b" ") for tag in tags}
                waiting = max(start for start in starts.values() if start < cut)  # the command of this literal
                before = [tag for tag, start in starts.items() if start < waiting]
                while not (line := self._read()).startswith(b"+ "):
                    self.pending.append(line)
                answered = {line.split(b" ", 1)[0] for line in self.pending}
                assert answered >= set(before), (cut, self.pending)


def _answers(wire: Wire, tags: list[bytes]) -> dict[bytes, list[bytes]]:
    """Each tag's answer (the untagged lines since the previous tagged one, then its own),
    checking they come in the order sent and that no continuation is asked for."""
    got: dict[bytes, list[bytes]] = {}
    lines: list[bytes] = []
    while len(got) < len(tags):
        line = wire.line()
        assert not line.startswith(b"+ "), line
        lines.append(line)
        tag = line.split(b" ", 1)[0]
        if tag in tags:
            got[tag], lines = lines, []
    assert list(got) == tags
    return got


def _answers_after(wire: Wire, script: bytes, cuts: list[int], tags: list[bytes]) -> dict[bytes, list[bytes]]:
    wire.send_in(script, cuts, tags)
    return _answers(wire, tags)


@dataclass(frozen=True)
class Literal:
    """A command that takes literals, to be pipelined between two NOOPs: `command(tag, user,
    password)` gives it with its literals; it runs logged in with Junk selected (one message in
    it when `search`), or on a fresh connection when `fresh`; its answer must start `answer`
    and follow the untagged `untagged` line."""

    command: Callable[[bytes, bytes, bytes], bytes]
    answer: bytes = b"OK"
    untagged: bytes | None = None
    fresh: bool = False
    search: bool = False


LITERALS = {
    "append-literal-plus": Literal(lambda t, u, p: t + b" APPEND Junk {18+}\r\n" + MESSAGE + b"\r\n", b"OK [APPENDUID "),
    "append-synchronising": Literal(lambda t, u, p: t + b" APPEND Junk {18}\r\n" + MESSAGE + b"\r\n", b"OK [APPENDUID "),
    "login-literal-plus": Literal(lambda t, u, p: b"%s LOGIN {%d+}\r\n%s {%d+}\r\n%s\r\n" % (t, len(u), u, len(p), p),
                                  fresh=True),
    "login-synchronising": Literal(lambda t, u, p: b"%s LOGIN {%d}\r\n%s {%d}\r\n%s\r\n" % (t, len(u), u, len(p), p),
                                   fresh=True),
    "search-literal-plus": Literal(lambda t, u, p: t + b" SEARCH SUBJECT {1+}\r\nx\r\n", untagged=b"* SEARCH 1\r\n",
                                   search=True),
    "search-synchronising": Literal(lambda t, u, p: t + b" SEARCH CHARSET UTF-8 SUBJECT {1}\r\nx\r\n",
                                    untagged=b"* SEARCH 1\r\n", search=True),
}


async def _pipelined(port: int, store: Store, user: str, case: str, every_split: bool) -> None:
    """`c NOOP`, the case's command with its literals and `z NOOP` in one write, then (with
    `every_split`) cut at every byte, and byte by byte. Every answer comes, in order; a `+` only
    for a synchronising literal and only once the NOOP before it is answered; an APPENDed message
    is stored byte-exact."""
    literal = LITERALS[case]
    if literal.search:
        await store.deliver(MESSAGE, [Target(user, "Junk")])
    size = len(b"c0 NOOP\r\n" + literal.command(b"b0", user.encode(), b"anne") + b"z0 NOOP\r\n")
    splits = [[], *([cut] for cut in range(1, size)), list(range(1, size))] if every_split else [[]]
    wire = None
    for n, cuts in enumerate(splits):
        if wire is None or literal.fresh:
            wire = Wire(port)
            if not literal.fresh:
                wire.login(user, "anne", b"Junk")
        tags = [b"c%d" % n, b"b%d" % n, b"z%d" % n]
        script = b"%s NOOP\r\n%s%s NOOP\r\n" % (tags[0], literal.command(tags[1], user.encode(), b"anne"), tags[2])
        answers = _answers_after(wire, script, cuts, tags)
        assert all(a[-1].split(b" ", 2)[1] == b"OK" for a in answers.values()), (case, cuts, answers)
        assert answers[tags[1]][-1].startswith(tags[1] + b" " + literal.answer), (case, cuts, answers)
        if literal.untagged is not None:
            assert answers[tags[1]][:-1] == [literal.untagged], (case, cuts, answers)
    if case.startswith("append"):
        stored = [await store.read_message(user, "Junk", s.id) async for s in store.list_messages(user, "Junk")]
        assert stored == [MESSAGE] * len(splits)


@pytest.fixture(scope="module")
async def wire_node(request: pytest.FixtureRequest, tmp_path_factory) -> AsyncIterator[tuple[Node, Store]]:
    """A node on the mbox store for the every-split runs: literals are framed by the connection
    before any store sees a command, so one store (the quickest) is enough for them."""
    settings = backend_settings_for("mbox", request)
    async with opened_store(settings) as store:
        running = Node(node_settings(settings), tmp_path_factory.mktemp("wirenode"),
                       imap={"allow_plaintext_auth": True, "auth_failure_delay": 0.0}).start()
        yield running, store
        assert running.stop() == 0
        assert "Traceback" not in running.log_text()


@pytest.mark.parametrize("case", LITERALS)
async def test_a_literal_pipelined_behind_a_command_is_answered_in_every_split(wire_node, case: str) -> None:
    """The issue's stall (`c NOOP`, `b APPEND INBOX {18+}` with its message and `z NOOP` in one
    write, never answered past the NOOP), for every command that takes literals, with LITERAL+
    and synchronising literals, in one write, cut at every byte, and byte by byte."""
    running, store = wire_node
    await _pipelined(running.port("imap"), store, await new_user(store), case, every_split=True)


async def test_every_store_answers_literals_pipelined_behind_a_command(pipe_node: Node, store: Store) -> None:
    """The same commands in one write on every store (each case with a user of its own)."""
    for case in LITERALS:
        await _pipelined(pipe_node.port("imap"), store, await new_user(store), case, every_split=False)


def test_synchronising_literals_wait_for_their_turn_and_go_on(pipe_node: Node, users) -> None:
    """A `{n}` literal's continuation comes only once the commands before it are answered;
    after the literal, commands written in the same piece are answered too. LOGIN, APPEND and
    SEARCH with literals, pipelined."""
    user = users["bob"]
    wire = Wire(pipe_node.port("imap"))
    wire.sock.sendall(b"a NOOP\r\nb LOGIN {%d}\r\n" % len(user))
    assert wire.line() == b"a OK NOOP completed\r\n"
    assert wire.line().startswith(b"+ ")
    wire.sock.sendall(user.encode() + b" {3}\r\n")
    assert wire.line().startswith(b"+ ")
    wire.sock.sendall(b"bob\r\nc SELECT Drafts\r\nd APPEND Drafts {18}\r\n")
    answers = _answers(wire, [b"b", b"c"])
    assert answers[b"b"][-1].startswith(b"b OK") and answers[b"c"][-1].startswith(b"c OK")
    assert wire.line().startswith(b"+ ")
    wire.sock.sendall(MESSAGE + b"\r\ne SEARCH SUBJECT {1+}\r\nx\r\nf SEARCH CHARSET UTF-8 BODY {2}\r\n")
    assert _answers(wire, [b"d"])[b"d"][-1].startswith(b"d OK [APPENDUID")
    lines = wire.until(b"e")
    assert lines[-2:] == [b"* SEARCH 1\r\n", b"e OK SEARCH completed\r\n"], lines
    assert wire.line().startswith(b"+ ")
    wire.sock.sendall(b"hi\r\ng LOGOUT\r\n")
    assert wire.until(b"f")[-2:] == [b"* SEARCH 1\r\n", b"f OK SEARCH completed\r\n"]
    assert wire.until(b"g")[-1] == b"g OK LOGOUT completed\r\n"


def test_a_literal_too_large_is_refused_before_it_is_sent_and_the_session_goes_on(pipe_node: Node, users) -> None:
    wire = Wire(pipe_node.port("imap"))
    wire.login(users["carol"], "carol")
    wire.sock.sendall(b"a APPEND INBOX {200000000}\r\nb LOGIN {9000}\r\nc NOOP\r\n")
    assert wire.line() == b"a NO [TOOBIG] Literal too large\r\n"
    assert wire.line() == b"b NO [TOOBIG] Literal too large\r\n"
    assert wire.line().startswith(b"c OK")
    wire.sock.sendall(b"d APPEND INBOX {99999999999}\r\n")
    assert wire.line() == b"d BAD Syntax error: literal size out of range\r\n"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_commands_sent_behind_an_unread_fetch_are_bounded(pipe_node: Node, store: Store, users) -> None:
    """A client that fetches a large message without reading it and keeps sending commands: past
    max_pipelined_bytes the server stops reading, so the socket stops taking them (they back up
    in TCP, not in the worker); once the client reads, every one is answered, in order. (ID, not
    NOOP: tens of thousands of NOOPs would each list the mailbox once the FETCH is done.)"""
    user = users["anne"]
    big = b"Subject: big\r\n\r\n" + (b"x" * 998 + b"\r\n") * 20_000  # 20 MB
    await store.deliver(big, [Target(user, "Archive")])
    wire = Wire(pipe_node.port("imap"))
    wire.login(user, "anne", b"Archive")
    pid = pipe_node.process.pid
    before = _rss_kib(pid)
    wire.sock.sendall(b"f FETCH 1:* BODY.PEEK[]\r\n")
    time.sleep(0.5)
    wire.sock.setblocking(False)
    sent, n, started = 0, 0, time.monotonic()
    pending = b""
    # Commands of about 1 KB (the ID value limit): the loopback buffers hold megabytes, and each
    # command taken is answered afterwards, so fewer, larger ones keep the answering short.
    value = b"v" * 1000
    while time.monotonic() - started < 10:
        if not pending:
            n += 1
            pending = b'n%d ID ("k" "%s")\r\n' % (n, value)
        try:
            written = wire.sock.send(pending)
        except BlockingIOError:
            time.sleep(0.05)
            if time.monotonic() - started > 3:
                break  # the server has stopped taking them
            continue
        sent += written
        pending = pending[written:]
    assert sent < 20 * 1024 * 1024, f"the server kept reading: {sent} bytes of commands taken"
    grown = _rss_kib(pid) - before
    assert grown < 64 * 1024, f"the worker grew by {grown} KiB"
    wire.sock.setblocking(True)
    wire.sock.settimeout(20)
    rest = threading.Thread(target=wire.sock.sendall, args=(pending,))  # taken once the FETCH is read
    rest.start()
    lines = wire.until(b"f")
    rest.join()
    assert lines[-1] == b"f OK FETCH completed\r\n" and lines[0].endswith(big + b")\r\n")
    last = b"n%d" % n
    answered = 0
    while True:
        line = wire.line()
        if line.startswith(b"* ID "):
            continue
        answered += 1
        assert line == b"n%d OK ID completed\r\n" % answered, line
        if line.startswith(last + b" "):
            break
    assert answered == n


def test_list_wildcard_patterns_are_answered_at_once(pipe_node: Node, users) -> None:
    wire = Wire(pipe_node.port("imap"))
    wire.login(users["carol"], "carol")
    wire.sock.sendall(b"a CREATE " + b"a" * 30 + b"\r\n")
    assert wire.until(b"a")[-1].startswith(b"a OK")
    started = time.monotonic()
    for n, pattern in enumerate((b"*" * 16 + b"x", b"*" * 40, b"%*" * 500 + b"q", b"*a" * 1000 + b"b")):
        wire.sock.sendall(b'l%d LIST "" "%s"\r\n' % (n, pattern))
        assert wire.until(b"l%d" % n)[-1] == b"l%d OK LIST completed\r\n" % n
    assert time.monotonic() - started < 5


async def test_a_command_not_sent_within_the_command_timeout_ends_the_read_and_one_sent_in_time_does_not() -> None:
    """The connection's command timeout over a real socket: commands arriving every 0.1 s for
    longer than the timeout are all read (the timeout counts from each command's start, not
    from the first), then silence ends the next read with TimeoutError within about the
    timeout, and so does a command whose literal never comes."""
    from cassmail.imap.connection import Connection

    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    conn = Connection(max_line=8192, max_pipelined=65536, write_timeout=5)
    await loop.connect_accepted_socket(lambda: conn, ours)
    conn.command_timeout = 0.4

    async def read() -> bytes:
        frame = await conn.read_command(lambda first, index, before: None, 1 << 20, 1 << 20, lambda: None)
        return b"".join(frame.parts)

    async def send_slowly() -> None:
        for i in range(12):
            theirs.sendall(b"t%d NOOP\r\n" % i)
            await asyncio.sleep(0.1)

    sender = asyncio.ensure_future(send_slowly())
    started = time.monotonic()
    assert [await read() for _ in range(12)] == [b"t%d NOOP" % i for i in range(12)]
    assert time.monotonic() - started > 1.0  # longer than the timeout, in all
    await sender
    for partial in (b"", b"a APPEND INBOX {10+}\r\nhalf"):
        theirs.sendall(partial)
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await read()
        assert 0.35 < time.monotonic() - began < 1.2
        conn._buffer.clear()  # (what the client sent of the command is dropped with the session)
    theirs.sendall(b"u NOOP\r\n")
    assert await read() == b"u NOOP"
    conn.close()
    theirs.close()
