"""IMAP extensions beyond RFC 3501's base over real sockets, every store: ESEARCH, STATUS=SIZE,
APPENDLIMIT, COMPRESS=DEFLATE."""

from __future__ import annotations

import base64
import re
import socket
import zlib

import pytest

from cassmail.store.base import Store
from tests.test_imap import deliver, logged_in, message, plain_node  # noqa: F401 - plain_node is a fixture

pytestmark = pytest.mark.cassandra


_session = logged_in


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


def _mail(n: int, sender: str, subject: str, hour: int, refs: str = "") -> bytes:
    return (f"From: {sender}\r\nTo: anne@example.com\r\nSubject: {subject}\r\n"
            f"Date: Mon, 01 Jan 2024 {hour:02d}:00:00 +0000\r\nMessage-ID: <{'abcdefg'[n - 1]}@x.test>\r\n{refs}"
            f"\r\nbody {n}{'.' * n * 10}\r\n").encode()


#: Seven messages in mailbox order: a thread on "Plans" (one reply by In-Reply-To only), a lone
#: "Lunch", and two replies to a message that is not in the mailbox.
THREADED = [
    _mail(1, "Zed <zed@x.test>", "Plans", 10),
    _mail(2, "amy@x.test", "Re: Plans", 11, "References: <a@x.test>\r\n"),
    _mail(3, "Bob <bob@x.test>", "Lunch", 9),
    _mail(4, "Carl <carl@x.test>", "RE: [team] Plans", 12, "References: <a@x.test> <b@x.test>\r\n"),
    _mail(5, "Ann <yan@x.test>", "Re: Plans (fwd)", 13, "In-Reply-To: <a@x.test>\r\n"),
    _mail(6, "dee@x.test", "Re: Missing parent", 8, "References: <zz@x.test>\r\n"),
    _mail(7, "Eve <eve@x.test>", "Re: Missing parent", 14, "References: <zz@x.test>\r\n"),
]


async def test_sort_by_each_criterion_with_reverse_and_ties_in_mailbox_order(plain_node, store: Store,  # noqa: F811
                                                                             users) -> None:
    await deliver(store, users["anne"], THREADED, "Archive")
    raw = _session(plain_node, users["anne"], "anne", "Archive")
    caps = raw.cmd("CAPABILITY")[0]
    assert all(cap in caps for cap in (b" SORT ", b" SORT=DISPLAY", b" THREAD=ORDEREDSUBJECT", b" THREAD=REFERENCES"))

    def sort(args: str) -> bytes:
        lines = raw.cmd(args)
        assert lines[-1].startswith(b"t%d OK" % raw.n), lines
        return lines[0].rstrip(b"\r\n")

    assert sort("SORT (DATE) UTF-8 ALL") == b"* SORT 6 3 1 2 4 5 7"
    assert sort("SORT (ARRIVAL) UTF-8 ALL") == b"* SORT 1 2 3 4 5 6 7"
    assert sort("SORT (SUBJECT) UTF-8 ALL") == b"* SORT 3 6 7 1 2 4 5"  # base subjects; ties by number
    assert sort("SORT (REVERSE SUBJECT DATE) US-ASCII ALL") == b"* SORT 1 2 4 5 6 7 3"
    assert sort("SORT (FROM) UTF-8 ALL") == b"* SORT 2 3 4 6 7 5 1"  # amy bob carl dee eve yan zed
    assert sort("SORT (DISPLAYFROM) UTF-8 ALL") == b"* SORT 2 5 3 4 6 7 1"  # amy@ Ann Bob Carl dee@ Eve Zed
    by_size = sorted((1, 2, 4, 5), key=lambda n: len(THREADED[n - 1]), reverse=True)
    assert sort("SORT (REVERSE SIZE) UTF-8 SUBJECT plans") == b"* SORT " + b" ".join(b"%d" % n for n in by_size)
    assert sort("SORT (REVERSE ARRIVAL) UTF-8 NOT SUBJECT plans") == b"* SORT 7 6 3"
    uids = raw.cmd("UID SEARCH ALL")[0].split()[2:]
    assert sort("UID SORT (DATE) UTF-8 ALL") == b"* SORT " + b" ".join(uids[i - 1] for i in (6, 3, 1, 2, 4, 5, 7))
    assert sort("SORT (TO) UTF-8 UID 999999") == b"* SORT"
    for bad in ("SORT (BOGUS) UTF-8 ALL", "SORT (REVERSE) UTF-8 ALL", "SORT DATE UTF-8 ALL", "SORT () UTF-8 ALL",
                "THREAD FOO UTF-8 ALL", "SORT (DATE) UTF-8"):
        assert raw.cmd(bad)[-1].split(b" ", 2)[1] == b"BAD", bad
    assert b"NO [BADCHARSET" in raw.cmd("SORT (DATE) KOI8-R ALL")[-1]


async def test_thread_by_references_and_by_ordered_subject(plain_node, store: Store, users) -> None:  # noqa: F811
    await deliver(store, users["bob"], THREADED, "Archive")
    raw = _session(plain_node, users["bob"], "bob", "Archive")

    def thread(args: str) -> bytes:
        lines = raw.cmd(args)
        assert lines[-1].startswith(b"t%d OK THREAD completed" % raw.n) or \
            lines[-1].startswith(b"t%d OK UID THREAD completed" % raw.n), lines
        return lines[0].rstrip(b"\r\n")

    # 6 and 7 under a dummy for the absent <zz>; 5 answers <a> by In-Reply-To; roots by date.
    assert thread("THREAD REFERENCES UTF-8 ALL") == b"* THREAD ((6)(7))(3)(1 (2 4)(5))"
    assert thread("THREAD ORDEREDSUBJECT UTF-8 ALL") == b"* THREAD (6 7)(3)(1 (2)(4)(5))"
    # Only what the keys match is threaded: without 2, its child 4 hangs from 1 through a dummy.
    assert thread("THREAD REFERENCES UTF-8 NOT SUBJECT lunch NOT FROM amy") == b"* THREAD ((6)(7))(1 (4)(5))"
    assert thread("THREAD REFERENCES UTF-8 SUBJECT nothing-matches") == b"* THREAD"
    uids = raw.cmd("UID SEARCH ALL")[0].split()[2:]
    u = {i: uids[i - 1].decode() for i in range(1, 8)}
    assert thread("UID THREAD ORDEREDSUBJECT UTF-8 ALL") == \
        f"* THREAD ({u[6]} {u[7]})({u[3]})({u[1]} ({u[2]})({u[4]})({u[5]}))".encode()


def test_threads_merge_by_base_subject_when_references_are_missing() -> None:
    from datetime import datetime, timezone

    from cassmail.imap.sort import Node, references, render

    def node(n: int, subject: str, reply: bool) -> Node:
        return Node(n, datetime(2024, 1, 1, n, tzinfo=timezone.utc), n, subject, reply)

    # 1 "Hello", 2 "Re: Hello" with no references, 3 "Hello" again, 4 "Other".
    nodes = [node(1, "hello", False), node(2, "hello", True), node(3, "hello", False), node(4, "other", False)]
    links = {1: ("<1@x>", []), 2: ("<2@x>", []), 3: ("<3@x>", []), 4: ("<4@x>", [])}
    roots = references(nodes, links)
    # The reply joins the first original; two originals of one subject share a dummy parent.
    assert "".join(f"({render(r)})" for r in roots) == "((1 2)(3))(4)"


BLOB = bytes(range(256)) * 3  # every byte value, NUL included
MIXED = (b"From: a@x.test\r\nSubject: binary\r\nMIME-Version: 1.0\r\n"
         b"Content-Type: multipart/mixed; boundary=\"b\"\r\n\r\n"
         b"--b\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n"
         b"caf=C3=A9 and a soft=\r\n break\r\n"
         b"--b\r\nContent-Type: application/octet-stream\r\nContent-Transfer-Encoding: base64\r\n\r\n"
         + b"\r\n".join(base64.b64encode(BLOB)[i:i + 76] for i in range(0, len(base64.b64encode(BLOB)), 76))
         + b"\r\n--b\r\nContent-Type: application/x-thing\r\nContent-Transfer-Encoding: x-uuencode\r\n\r\n"
         b"begin 644 x\r\n`\r\nend\r\n--b--\r\n")


def _literal_after(lines: list[bytes], marker: bytes) -> bytes:
    """The literal that follows the response line ending in `marker {n}`."""
    for i, line in enumerate(lines):
        if re.search(re.escape(marker) + rb" ~\{\d+\}\r\n\Z", line):
            return lines[i + 1]
    raise AssertionError(f"no {marker!r} literal in {lines}")


async def test_binary_fetch_decodes_parts_and_append_takes_literal8(plain_node, store: Store, users) -> None:  # noqa: F811
    await deliver(store, users["carol"], [MIXED], "Archive")
    raw = _session(plain_node, users["carol"], "carol", "Archive")
    assert b" BINARY" in raw.cmd("CAPABILITY")[0]
    lines = raw.cmd("FETCH 1 (BINARY.PEEK[1] BINARY.SIZE[2] BINARY.PEEK[2]<1.4> FLAGS)")
    assert lines[-1].startswith(b"t%d OK" % raw.n)
    assert _literal_after(lines, b"BINARY[1]") == "café and a soft break".encode()  # the CRLF before a boundary is the boundary's
    assert b"BINARY.SIZE[2] %d" % len(BLOB) in b"".join(lines)
    assert _literal_after(lines, b"BINARY[2]<1>") == BLOB[1:5]
    assert b"\\Seen" not in b"".join(lines)  # PEEK and SIZE do not mark the message read
    lines = raw.cmd("FETCH 1 BINARY[2]")
    assert _literal_after(lines, b"BINARY[2]") == BLOB and b"\\Seen" in b"".join(lines)
    assert raw.cmd("FETCH 1 BINARY.PEEK[3]")[-1].startswith(b"t%d NO [UNKNOWN-CTE]" % raw.n)
    assert raw.cmd("FETCH 1 BINARY.PEEK[9]")[-1].startswith(b"t%d OK" % raw.n)  # no such part: empty
    for bad in ("FETCH 1 BINARY[HEADER]", "FETCH 1 BINARY.SIZE[1]<0.2>", "FETCH 1 BINARY"):
        assert raw.cmd(bad)[-1].split(b" ", 2)[1] == b"BAD", bad

    # APPEND of a message holding NUL bytes, as a literal8; it comes back byte for byte.
    nul = b"Subject: nul\r\nContent-Type: application/octet-stream\r\n\r\n" + BLOB
    raw.n += 1
    raw.send(b"t%d APPEND Archive ~{%d+}\r\n%s\r\n" % (raw.n, len(nul), nul))
    assert raw.until(b"t%d" % raw.n)[-1].startswith(b"t%d OK [APPENDUID" % raw.n)
    raw.cmd("NOOP")
    assert _literal_after(raw.cmd("FETCH 2 BINARY.PEEK[]"), b"BINARY[]") == nul
    # A literal8 anywhere else is a syntax error.
    raw.n += 1
    raw.send(b"t%d SEARCH SUBJECT ~{3+}\r\nnul\r\n" % raw.n)
    answer = raw.until(b"t%d" % raw.n)[-1]
    assert answer.startswith(b"t%d BAD " % raw.n) and answer.endswith(b"literal8 (~{n}) is only allowed for an APPEND message\r\n")
    assert raw.cmd("NOOP")[-1].startswith(b"t%d OK" % raw.n)


async def test_utf8_accept_names_mailboxes_in_utf8_and_appends_utf8_messages(plain_node, store: Store,  # noqa: F811
                                                                            users) -> None:
    user = users["anne"]
    raw = _session(plain_node, user, "anne")
    assert b" UTF8=ACCEPT" in raw.cmd("CAPABILITY")[0]
    assert raw.cmd("ENABLE UTF8=ACCEPT X-UNKNOWN")[0] == b"* ENABLED UTF8=ACCEPT\r\n"  # only what it has
    name = "Reçus/Ünïcode 日本"
    assert raw.cmd(f'CREATE "{name}"'.encode())[-1].startswith(b"t%d OK" % raw.n)
    listed = raw.cmd('LIST "" "Re*/*"')
    assert listed[0] == b'* LIST (\\HasNoChildren) "/" "' + name.encode() + b'"\r\n'
    head = "Subject: héllo wörld\r\nFrom: Jörg <jörg@exämple.test>\r\n\r\nbody ✓\r\n".encode()
    raw.n += 1
    raw.send(b't%d APPEND "%s" UTF8 (~{%d+}\r\n%s)\r\n' % (raw.n, name.encode(), len(head), head))
    assert raw.until(b"t%d" % raw.n)[-1].startswith(b"t%d OK [APPENDUID" % raw.n)
    status = raw.cmd(f'STATUS "{name}" (MESSAGES)'.encode())[0]
    assert status == b'* STATUS "' + name.encode() + b'" (MESSAGES 1)\r\n'
    assert raw.cmd(f'SELECT "{name}"'.encode())[-1].startswith(b"t%d OK" % raw.n)
    assert b"\r\n".join(raw.cmd("FETCH 1 BODY.PEEK[]")).count(head) == 1
    assert raw.cmd(b'SELECT "Re\xc3"')[-1].startswith(b"t%d NO [CANNOT]" % raw.n)  # not UTF-8
    # A client that did not enable it sees the same mailbox in modified UTF-7.
    other = _session(plain_node, user, "anne")
    assert other.cmd('LIST "" "Re*/*"')[0] == b'* LIST (\\HasNoChildren) "/" "Re&AOc-us/&ANw-n&AO8-code &ZeVnLA-"\r\n'
