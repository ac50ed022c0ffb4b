"""IMAP extensions beyond RFC 3501's base over real sockets, every store: ESEARCH, STATUS=SIZE,
APPENDLIMIT, COMPRESS=DEFLATE."""

from __future__ import annotations

import re
import socket
import zlib

import pytest

from cassmail.store.base import Store
from tests.test_imap import Raw, deliver, message, plain_node  # noqa: F401 - plain_node is a fixture

pytestmark = pytest.mark.cassandra


def _session(node, user: str, password: str, mailbox: str | None = None) -> Raw:
    raw = Raw(node.port("imap"))
    raw.login(user, password)
    if mailbox is not None:
        assert raw.cmd(f"SELECT {mailbox}")[-1].startswith(b"t%d OK" % raw.n)
    return raw


async def test_esearch_status_size_and_appendlimit(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["anne"]
    bodies = [message(i) for i in range(1, 6)]
    await deliver(store, user, bodies, "Archive")
    raw = _session(plain_node, user, "anne", "Archive")
    caps = raw.cmd("CAPABILITY")[0]
    assert b" ESEARCH" in caps and b" STATUS=SIZE" in caps and re.search(rb" APPENDLIMIT=\d+", caps)
    raw.cmd("STORE 2,3,5 +FLAGS (\\Seen)")
    tag = b"t%d" % (raw.n + 1)
    assert raw.cmd("SEARCH RETURN (MIN MAX COUNT ALL) SEEN")[0] == \
        b'* ESEARCH (TAG "' + tag + b'") MIN 2 MAX 5 ALL 2:3,5 COUNT 3\r\n'
    tag = b"t%d" % (raw.n + 1)
    assert raw.cmd("UID SEARCH RETURN () UNSEEN")[0] == b'* ESEARCH (TAG "' + tag + b'") UID ALL 1,4\r\n'
    tag = b"t%d" % (raw.n + 1)
    assert raw.cmd("SEARCH RETURN (COUNT MIN) DELETED")[0] == b'* ESEARCH (TAG "' + tag + b'") COUNT 0\r\n'
    assert raw.cmd("SEARCH RETURN (BOGUS) ALL")[-1].split(b" ", 2)[1] == b"BAD"
    status = raw.cmd("STATUS Archive (MESSAGES SIZE APPENDLIMIT)")[0]
    limit = int(re.search(rb"APPENDLIMIT=(\d+)", caps).group(1))
    assert status == b"* STATUS Archive (MESSAGES 5 SIZE %d APPENDLIMIT %d)\r\n" % (sum(map(len, bodies)), limit)
    raw.n += 1
    raw.send(b"t%d APPEND Archive {%d}\r\n" % (raw.n, limit + 1))
    assert raw.file.readline() == b"t%d NO [TOOBIG] Literal too large\r\n" % raw.n


class Deflated:
    """A raw IMAP client after COMPRESS DEFLATE: writes deflated, reads inflated."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = zlib.compressobj(6, zlib.DEFLATED, -15)
        self.inflate = zlib.decompressobj(-15)
        self.plain = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(self.out.compress(data) + self.out.flush(zlib.Z_SYNC_FLUSH))

    def until(self, tag: bytes) -> bytes:
        while not re.search(rb"(^|\r\n)" + re.escape(tag) + rb" [^\r]*\r\n", self.plain):
            data = self.sock.recv(1 << 16)
            assert data, f"closed after {self.plain[-300:]!r}"
            self.plain += self.inflate.decompress(data)
        out, self.plain = self.plain, b""
        return out


async def test_compress_deflate_both_ways_with_pipelining(plain_node, store: Store, users) -> None:  # noqa: F811
    """After `COMPRESS DEFLATE` both directions are raw DEFLATE; a pipelined APPEND, a FETCH of a
    large message and a repeated COMPRESS work through it."""
    user = users["bob"]
    big = b"Subject: big\r\n\r\n" + b"".join(b"line %d of a long message\r\n" % i for i in range(40_000))
    await deliver(store, user, [big], "Junk")
    raw = _session(plain_node, user, "bob", "Junk")
    assert b"COMPRESS=DEFLATE" in raw.cmd("CAPABILITY")[0]
    assert raw.cmd("COMPRESS DEFLATE")[-1] == b"t%d OK DEFLATE active\r\n" % raw.n
    deflated = Deflated(raw.sock)
    small = message(7)
    deflated.send(b"c1 NOOP\r\nc2 APPEND Junk {%d+}\r\n%s\r\nc3 FETCH 1 BODY.PEEK[]\r\n" % (len(small), small))
    got = deflated.until(b"c3")
    assert b"c1 OK NOOP completed" in got and b"c2 OK [APPENDUID" in got
    assert b"BODY[] {%d}\r\n%s)" % (len(big), big) in got and got.endswith(b"c3 OK FETCH completed\r\n")
    deflated.send(b"c4 COMPRESS DEFLATE\r\nc5 FETCH 2 (BODY.PEEK[HEADER.FIELDS (SUBJECT)])\r\n")
    got = deflated.until(b"c5")
    assert b"c4 NO [COMPRESSIONACTIVE]" in got and b"Subject: message 7" in got
    deflated.send(b"c6 LOGOUT\r\n")
    assert deflated.until(b"c6").endswith(b"c6 OK LOGOUT completed\r\n")


def test_a_corrupt_deflate_stream_ends_the_session_quietly(plain_node, users) -> None:  # noqa: F811
    raw = _session(plain_node, users["carol"], "carol")
    assert raw.cmd("COMPRESS DEFLATE")[-1].endswith(b"OK DEFLATE active\r\n")
    raw.send(b"\xff" * 64)  # not a DEFLATE stream
    raw.sock.settimeout(10)
    assert raw.sock.recv(100) == b""  # closed, without a traceback in the log (checked by the fixture)
    assert _session(plain_node, users["carol"], "carol").cmd("NOOP")[-1].endswith(b"OK NOOP completed\r\n")
