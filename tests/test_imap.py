"""The IMAP front end as mail clients see it: a real `cassmail serve`, imaplib and mbsync over
real sockets, every backend in turn."""

from __future__ import annotations

import asyncio
import base64
import email
import imaplib
import quopri
import random
import re
import smtplib
import socket
import subprocess
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from email import policy
from email.header import decode_header, make_header
from email.mime.application import MIMEApplication
from email.mime.message import MIMEMessage
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path

import pytest

from cassmail.imap import mime, wire
from cassmail.store.base import Store, Target
from cassmail.imap.view import FULL_LISTING
from tests.nodes import CLIENT_TLS, Node, inbox, node_settings

pytestmark = pytest.mark.cassandra


def imap(node: Node, user: str | None = None, password: str | None = None) -> imaplib.IMAP4:
    """An imaplib session, upgraded with STARTTLS and logged in when a user is given."""
    client = imaplib.IMAP4("127.0.0.1", node.port("imap"), timeout=30)
    if user is not None:
        client.starttls(ssl_context=CLIENT_TLS)
        client.login(user, password or user.split("@")[0])
    return client


class Raw:
    """A line-level IMAP client: what imaplib would hide (untagged order, BAD texts)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.file = self.sock.makefile("rb")
        self.greeting = self.file.readline()
        self.n = 0

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def cmd(self, text: str | bytes) -> list[bytes]:
        """Send a tagged command; every line up to and including its tagged answer."""
        self.n += 1
        tag = b"t%d" % self.n
        self.send(tag + b" " + (text.encode() if isinstance(text, str) else text) + b"\r\n")
        return self.until(tag)

    def until(self, tag: bytes) -> list[bytes]:
        lines = []
        while True:
            line = self.file.readline()
            assert line, f"connection closed after {lines}"
            lines.append(line)
            m = re.search(rb"\{(\d+)\}\r\n\Z", line)
            if m:
                lines.append(self.file.read(int(m.group(1))))
            if line.startswith(tag + b" "):
                return lines

    def login(self, user: str, password: str) -> None:
        assert self.cmd(f'LOGIN "{user}" "{password}"')[-1].startswith(b"t%d OK" % self.n)


def logged_in(node: Node, user: str, password: str, mailbox: str | None = None) -> Raw:
    """A Raw session logged in (and with `mailbox` selected)."""
    raw = Raw(node.port("imap"))
    raw.login(user, password)
    if mailbox is not None:
        assert raw.cmd(f"SELECT {mailbox}")[-1].startswith(b"t%d OK" % raw.n)
    return raw


@pytest.fixture(scope="module")
def plain_node(backend_settings, tmp_path_factory) -> Node:
    """A node whose IMAP allows LOGIN in clear text (loopback tests of the protocol itself)."""
    running = Node(
        node_settings(backend_settings), tmp_path_factory.mktemp("imapnode"),
        imap={"allow_plaintext_auth": True, "idle_poll": 0.3, "auth_failure_delay": 0.0}, metrics={"enabled": True},
    ).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text()


async def deliver(store: Store, user: str, bodies: list[bytes], mailbox: str = "INBOX") -> None:
    for body in bodies:
        await store.deliver(body, [Target(user, mailbox)])


def message(i: int, extra: bytes = b"") -> bytes:
    return (b"From: sender%d@remote.test\r\nTo: anne@example.com\r\nSubject: message %d\r\n"
            b"Date: Mon, 02 Nov 2026 10:00:00 +0000\r\n\r\nbody of %d\r\n%s" % (i, i, i, extra))


# ----------------------------------------------------------------------------- login and TLS


def test_login_is_disabled_until_starttls(node: Node, users) -> None:
    client = imap(node)
    assert "LOGINDISABLED" in client.capabilities and "STARTTLS" in client.capabilities
    with pytest.raises(imaplib.IMAP4.error, match="PRIVACYREQUIRED"):
        client.login(users["anne"], "anne")
    client.starttls(ssl_context=CLIENT_TLS)
    assert "AUTH=PLAIN" in client.capabilities and "LOGINDISABLED" not in client.capabilities
    with pytest.raises(imaplib.IMAP4.error, match="AUTHENTICATIONFAILED"):
        client.login(users["anne"], "wrong")
    assert client.login(users["anne"], "anne")[0] == "OK"
    assert client.logout()[0] == "BYE"


def test_the_capabilities_are_the_ones_docs_protocols_md_shows(node: Node) -> None:
    """The CAPABILITY line of docs/protocols.md, before TLS and after STARTTLS, is what a client
    is told (APPENDLIMIT's value is the store's limit, which the test node sets lower)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "protocols.md").read_text()
    row = re.search(r"\| `\[imap\]`, `\[imaps\]` \(CAPABILITY\) \| `([^`]+)` \| `([^`]+)` instead of `([^`]+)` \|", text)
    assert row, "the IMAP row of the capability table"
    before, added, dropped = (group.split() for group in row.groups())
    after = [word for word in before if word not in dropped] + added

    def words(capabilities: Iterable[str]) -> list[str]:
        return sorted(re.sub(r"=\d+\Z", "=N", word.upper()) for word in capabilities)

    client = imap(node)
    assert words(client.capabilities) == words(before)
    client.starttls(ssl_context=CLIENT_TLS)
    assert words(client.capabilities) == words(after)
    client.logout()


def test_authenticate_plain(plain_node: Node, users) -> None:
    client = imaplib.IMAP4("127.0.0.1", plain_node.port("imap"))
    typ, _ = client.authenticate("PLAIN", lambda _: f"\0{users['bob']}\0bob".encode())
    assert typ == "OK"
    assert client.select("INBOX")[0] == "OK"


def test_lines_sent_after_starttls_in_clear_text_are_discarded(node: Node, users) -> None:
    """STARTTLS command injection: a LOGIN written in the same packet as STARTTLS (what a man in
    the middle would add) never runs, although the password is right."""
    sock = socket.create_connection(("127.0.0.1", node.port("imap")), timeout=30)
    reader = sock.makefile("rb")
    assert reader.readline().startswith(b"* OK")
    sock.sendall(b"a STARTTLS\r\nb LOGIN " + users["anne"].encode() + b" anne\r\n")
    assert reader.readline() == b"a OK Begin TLS negotiation now\r\n"
    tls = CLIENT_TLS.wrap_socket(sock, server_hostname="mx.test")
    reader = tls.makefile("rb")
    tls.sendall(b"c CAPABILITY\r\nd SELECT INBOX\r\n")
    lines = []
    while not lines or not lines[-1].startswith(b"d "):
        lines.append(reader.readline())
        assert lines[-1], lines
    assert not [line for line in lines if line.startswith(b"b ")], lines
    assert b"AUTH=PLAIN" in lines[0] and lines[1] == b"c OK CAPABILITY completed\r\n"  # not logged in ...
    assert lines[-1] == b"d BAD Command not allowed now\r\n"  # ... so no SELECT
    tls.sendall(b"e LOGIN " + users["anne"].encode() + b" anne\r\n")  # a LOGIN sent over TLS works
    assert reader.readline().startswith(b"e OK")
    tls.close()
    assert "event=imap-starttls" in node.log_text() and "dropped_bytes=" in node.log_text()


def test_authenticate_plain_is_refused_before_tls(node: Node, users) -> None:
    client = imap(node)
    with pytest.raises(imaplib.IMAP4.error, match=r"\[PRIVACYREQUIRED\]"):
        client.authenticate("PLAIN", lambda _: f"\0{users['anne']}\0anne".encode())
    assert client.state == "NONAUTH"
    client.starttls(ssl_context=CLIENT_TLS)
    assert client.authenticate("PLAIN", lambda _: f"\0{users['anne']}\0anne".encode())[0] == "OK"


# ----------------------------------------------------------------------------- SELECT, FETCH, SEARCH


def _select_codes(raw: Raw, command: str) -> dict[str, int]:
    """EXISTS, RECENT and the numeric response codes of a SELECT or EXAMINE."""
    lines = raw.cmd(command)
    assert lines[-1].split(b" ")[1] == b"OK", lines
    out = {}
    for line in lines:
        if m := re.match(rb"\* (\d+) (EXISTS|RECENT)\r\n", line):
            out[m.group(2).decode()] = int(m.group(1))
        if m := re.match(rb"\* OK \[(UNSEEN|UIDVALIDITY|UIDNEXT) (\d+)\]", line):
            out[m.group(1).decode()] = int(m.group(2))
    return out


def _status(client: imaplib.IMAP4, mailbox: str) -> dict[str, int]:
    typ, data = client.status(mailbox, "(MESSAGES RECENT UIDNEXT UIDVALIDITY UNSEEN)")
    assert typ == "OK", data
    items = re.search(rb"\((.*)\)", data[0]).group(1).split()
    return {items[i].decode(): int(items[i + 1]) for i in range(0, len(items), 2)}


async def test_uidnext_and_status_after_the_newest_messages_are_expunged(plain_node: Node, store: Store, users) -> None:
    user = users["bob"]
    await deliver(store, user, [message(i) for i in range(5)], "Trash")
    validity = (await store.mailbox_info(user, "Trash")).uidvalidity
    client = imap(plain_node)
    client.login(user, "bob")
    # nobody has numbered them yet: STATUS counts them RECENT and predicts their UIDs
    assert _status(client, "Trash") == {"MESSAGES": 5, "RECENT": 5, "UIDNEXT": 6, "UIDVALIDITY": validity, "UNSEEN": 5}
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "bob")
    assert _select_codes(raw, "SELECT Trash") == {"EXISTS": 5, "RECENT": 5, "UNSEEN": 1, "UIDVALIDITY": validity,
                                                 "UIDNEXT": 6}
    raw.cmd("STORE 1 +FLAGS (\\Seen)")
    raw.cmd("STORE 4:5 +FLAGS (\\Deleted)")
    assert raw.cmd("EXPUNGE")[:2] == [b"* 5 EXPUNGE\r\n", b"* 4 EXPUNGE\r\n"]
    # UIDs 4 and 5 were handed out: UIDNEXT stays 6 in SELECT and in STATUS alike
    assert _status(client, "Trash") == {"MESSAGES": 3, "RECENT": 0, "UIDNEXT": 6, "UIDVALIDITY": validity, "UNSEEN": 2}
    assert _select_codes(raw, "SELECT Trash") == {"EXISTS": 3, "RECENT": 0, "UNSEEN": 2, "UIDVALIDITY": validity,
                                                 "UIDNEXT": 6}
    assert _select_codes(raw, "EXAMINE Trash")["UIDNEXT"] == 6
    # a new message is numbered 6 by the SELECT that first sees it, which then predicts 7
    await deliver(store, user, [message(9)], "Trash")
    assert _status(client, "Trash") == {"MESSAGES": 4, "RECENT": 1, "UIDNEXT": 7, "UIDVALIDITY": validity, "UNSEEN": 3}
    assert _select_codes(raw, "SELECT Trash") == {"EXISTS": 4, "RECENT": 1, "UNSEEN": 2, "UIDVALIDITY": validity,
                                                 "UIDNEXT": 7}
    assert b"* 4 FETCH (UID 6)\r\n" in raw.cmd("FETCH 4 (UID)")
    # everything expunged: the empty mailbox still says 7
    raw.cmd("STORE 1:* +FLAGS.SILENT (\\Deleted)")
    raw.cmd("EXPUNGE")
    assert _select_codes(raw, "SELECT Trash") == {"EXISTS": 0, "RECENT": 0, "UIDVALIDITY": validity, "UIDNEXT": 7}
    assert _status(client, "Trash") == {"MESSAGES": 0, "RECENT": 0, "UIDNEXT": 7, "UIDVALIDITY": validity, "UNSEEN": 0}
    assert raw.cmd("UID FETCH * (UID)")[-1].split(b" ")[1] == b"OK"


async def test_select_reports_the_mailbox_and_fetch_is_byte_exact(plain_node: Node, store: Store, users) -> None:
    bodies = [message(i) for i in range(5)]
    bodies.append(b"From: x@y.z\r\nSubject: bare lf\n\nline one\nline two\n")  # stored as sent
    await deliver(store, users["anne"], bodies)
    await store.store_flags(users["anne"], "INBOX", [(await _ids(store, users["anne"]))[0]], ["\\Seen"], "add")
    raw = Raw(plain_node.port("imap"))
    raw.login(users["anne"], "anne")
    lines = b"".join(raw.cmd("SELECT INBOX"))
    assert b"* 6 EXISTS" in lines and b"* 6 RECENT" in lines
    assert b"[UNSEEN 2]" in lines and b"[UIDNEXT 7]" in lines and b"[UIDVALIDITY " in lines
    assert b"[READ-WRITE] SELECT completed" in lines
    client = imap(plain_node)
    client.login(users["anne"], "anne")
    client.select("INBOX")
    for n, body in enumerate(bodies, 1):
        typ, data = client.fetch(str(n), "(UID RFC822.SIZE BODY.PEEK[])")
        assert typ == "OK" and data[0][1] == body
        assert b"UID %d" % n in data[0][0] and b"RFC822.SIZE %d" % len(body) in data[0][0]
    typ, data = client.fetch("6", "(BODY.PEEK[HEADER] BODY.PEEK[TEXT] BODY.PEEK[]<5.10> BODY.PEEK[HEADER.FIELDS (subject)])")
    assert data[0][1] == b"From: x@y.z\r\nSubject: bare lf\n\n"
    assert data[1][1] == b"line one\nline two\n"
    assert data[2][1] == bodies[5][5:15] and b"BODY[]<5>" in data[2][0]
    assert data[3][1] == b"Subject: bare lf\n\r\n"
    # a non-PEEK body fetch sets \Seen, and says so
    typ, data = client.fetch("2", "(BODY[TEXT])")
    assert b"\\Seen" in b"".join(d if isinstance(d, bytes) else d[0] for d in data)
    assert "\\Seen" in (await store.get_summaries(users["anne"], "INBOX", [(await _ids(store, users["anne"]))[1]])).popitem()[1].flags
    typ, data = client.fetch("1:*", "(FLAGS)")
    assert len(data) == 6
    typ, data = client.fetch("1", "INTERNALDATE")
    assert re.search(rb'INTERNALDATE "\d\d-[A-Z][a-z]{2}-\d{4} \d\d:\d\d:\d\d \+0000"', data[0])


async def test_a_fetch_of_what_the_view_holds_answers_every_message_from_the_store_summaries(
    plain_node: Node, store: Store, users
) -> None:
    """FLAGS, UID, MODSEQ, INTERNALDATE and RFC822.SIZE come from the selected view without a read
    of any message (fetch.FROM_THE_VIEW): more messages than one wait for the client covers, each
    line as the store's summary says."""
    user, box = users["anne"], "ViewFetch"
    await store.create_mailbox(user, box)
    await deliver(store, user, [message(i, b"x" * i) for i in range(300)], box)
    ids = await _ids(store, user, box)
    await store.store_flags(user, box, ids[::7], ["\\Flagged", "$Later"], "add")
    raw = logged_in(plain_node, user, "anne", box)
    lines = raw.cmd("FETCH 1:* (UID FLAGS MODSEQ INTERNALDATE RFC822.SIZE)")
    assert lines[-1].startswith(b"t%d OK" % raw.n)
    values = _fetch_values([line for line in lines if b" FETCH " in line] + [lines[-1]])
    summaries = await store.get_summaries(user, box, ids)
    assert sorted(values) == list(range(1, 301))
    for seq, message_id in enumerate(ids, 1):
        summary, got = summaries[message_id], values[seq]
        assert int(got["UID"]) == summary.uid and int(got["RFC822.SIZE"]) == summary.size
        assert {f.decode() for f in got["FLAGS"]} - {"\\Recent"} == set(summary.flags)
        assert int(got["MODSEQ"][0]) == summary.modseq
        assert datetime.strptime(got["INTERNALDATE"].decode().strip(), "%d-%b-%Y %H:%M:%S %z") == summary.internal_date.replace(microsecond=0)
    raw.cmd("LOGOUT")


async def _ids(store: Store, user: str, mailbox: str = "INBOX") -> list:
    return [s.id async for s in store.list_messages(user, mailbox)]


def corpus() -> list[bytes]:
    """Messages whose MIME structure the tests check against Python's email package."""
    out = []
    inner = MIMEText("inner text\n", "plain", "utf-8")
    inner["Subject"] = "=?utf-8?q?h=C3=A9llo?="
    inner["From"] = '"Ann B" <ann@b.example>'
    mixed = MIMEMultipart("mixed")
    mixed["Subject"] = "nested"
    alt = MIMEMultipart("alternative")
    alt.attach(MIMEText("plain\nline 2\n"))
    alt.attach(MIMEText("<b>html</b>\n", "html"))
    mixed.attach(alt)
    attachment = MIMEApplication(bytes(range(256)) * 10, Name="data.bin")
    attachment.add_header("Content-Disposition", "attachment", filename="data.bin")
    mixed.attach(attachment)
    mixed.attach(MIMEMessage(inner))
    latin = MIMEText("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e " * 8 + "\nend\n", "plain", "iso-8859-1")  # quoted-printable
    latin.add_header("Content-Disposition", "inline", filename="notes.txt")
    mixed.attach(latin)
    out.append(mixed.as_bytes(policy=policy.SMTP))
    eight = MIMEText("caf\u00e9 cr\u00e8me\n", "plain", "utf-8")
    eight.replace_header("Content-Transfer-Encoding", "8bit")
    eight.set_payload("caf\u00e9 cr\u00e8me\n".encode())
    out.append(eight.as_bytes(policy=policy.SMTP))
    # malformed: a multipart without a boundary, an unterminated multipart, a bad Content-Type
    out.append(b"Content-Type: multipart/mixed\r\nSubject: no boundary\r\n\r\njust text\r\n")
    out.append(b'Content-Type: multipart/mixed; boundary="b1"\r\n\r\npreamble\r\n--b1\r\n'
               b"Content-Type: text/plain\r\n\r\nfirst\r\n--b1\r\n\r\nsecond, never closed\r\n")
    out.append(b"Content-Type: garbage\r\nSubject: =?bad?q?x?=\r\n\r\nbody\r\n")
    rng = random.Random(7)
    for depth in range(1, 4):  # random nesting
        def build(level: int) -> MIMEMultipart | MIMEText:
            if level == 0:
                return MIMEText("leaf %d\n" % rng.randrange(1000))
            box = MIMEMultipart(rng.choice(["mixed", "related", "alternative"]))
            for _ in range(rng.randrange(1, 4)):
                box.attach(build(level - 1))
            return box
        out.append(build(depth).as_bytes(policy=policy.SMTP))
    return out


def _leaves(msg: email.message.Message) -> list[tuple[str, bytes]]:
    if msg.is_multipart():
        return [leaf for part in msg.get_payload() for leaf in _leaves(part)]
    return [(msg.get_content_type(), msg.get_payload(decode=True) or b"")]


def _structure_leaves(structure: list) -> list[str]:
    """The content types of the leaves of a parsed BODYSTRUCTURE, through message/rfc822."""
    if isinstance(structure[0], list):  # multipart: the parts come before the subtype
        parts = []
        for item in structure:
            if not isinstance(item, list):
                break
            parts.append(item)
        return [t for part in parts for t in _structure_leaves(part)]
    ctype = f"{structure[0].decode().lower()}/{structure[1].decode().lower()}"
    if ctype == "message/rfc822":
        return _structure_leaves(structure[8])
    return [ctype]


def _pairs(value: list | None) -> dict[str, str]:
    """A BODYSTRUCTURE parameter list ("key" "value" ...) as a dict with lower-case keys."""
    value = value or []
    return {value[i].decode().lower(): value[i + 1].decode() for i in range(0, len(value), 2)}


def _email_params(msg: email.message.Message) -> dict[str, str]:
    """Content-Type parameters as the email package reads them (RFC 2231 values collapsed)."""
    if msg.get("content-type") is None:
        return {"charset": "us-ascii"} if msg.get_content_maintype() == "text" else {}
    return {k.lower(): email.utils.collapse_rfc2231_value(v) for k, v in (msg.get_params() or [])[1:]}


def _email_disposition(msg: email.message.Message) -> tuple[str, dict[str, str]] | None:
    if msg.get("content-disposition") is None:
        return None
    params = msg.get_params(header="content-disposition") or []
    return params[0][0].lower(), {k.lower(): email.utils.collapse_rfc2231_value(v) for k, v in params[1:]}


def _disposition(value: list | None) -> tuple[str, dict[str, str]] | None:
    return None if value is None else (value[0].decode().lower(), _pairs(value[1]))


def _check_structure(got: list, msg: email.message.Message, path: tuple[int, ...], sections: dict) -> None:
    """BODYSTRUCTURE of one entity against the email package's reading of it: type and subtype,
    parameters (charset, boundary, name), encoding, size and line count, disposition; into the
    parts of a multipart and the message of a message/rfc822. `sections` gives the bytes of a
    message/rfc822 body as the server hands them out (the email package does not keep them)."""
    where = ".".join(map(str, path)) or "top"
    if msg.get_content_maintype() == "multipart":
        parts = msg.get_payload()
        assert all(isinstance(p, list) for p in got[: len(parts)]) and not isinstance(got[len(parts)], list), where
        for i, (sub, part) in enumerate(zip(got, parts), 1):
            _check_structure(sub, part, path + (i,), sections)
        subtype, params, disposition = got[len(parts) : len(parts) + 3]
        assert subtype.decode().lower() == msg.get_content_subtype(), where
        assert _pairs(params) == _email_params(msg) and "boundary" in _pairs(params), where
        assert _disposition(disposition) == _email_disposition(msg), where
        return
    maintype, subtype, params, _cid, _description, encoding, size = got[:7]
    assert f"{maintype.decode()}/{subtype.decode()}".lower() == msg.get_content_type(), where
    assert _pairs(params) == _email_params(msg), (where, params)
    assert encoding.decode().lower() == str(msg.get("content-transfer-encoding", "7bit")).lower(), where
    if msg.get_content_type() == "message/rfc822":
        body = sections[path]
        assert int(size) == len(body) and int(got[9]) == len(body.splitlines()), where
        _check_structure(got[8], msg.get_payload(0), path, sections)
        extension = got[10:]
    else:
        # the part's bytes as stored: an encoded payload is ASCII; decoding 7bit/8bit returns the bytes
        cte = str(msg.get("content-transfer-encoding", "7bit")).lower()
        body = msg.get_payload().encode("ascii") if cte in ("base64", "quoted-printable") else msg.get_payload(decode=True)
        assert int(size) == len(body), (where, size, len(body))
        if maintype.lower() == b"text":
            assert int(got[7]) == len(body.splitlines()), where
            extension = got[8:]
        else:
            extension = got[7:]
    assert _disposition(extension[1]) == _email_disposition(msg), where


def _fetch_values(lines: list[bytes]) -> dict[int, dict[str, object]]:
    """The FETCH responses among a command's lines: sequence number -> item name -> value."""
    out: dict[int, dict[str, object]] = {}
    stream = parse_values(b"".join(lines[:-1]))
    for i in range(len(stream) - 3):
        if stream[i] == b"*" and stream[i + 2] == b"FETCH" and isinstance(stream[i + 3], list):
            items = stream[i + 3]
            out[int(stream[i + 1])] = {items[j].decode(): items[j + 1] for j in range(0, len(items), 2)}
    return out


def parse_values(data: bytes) -> list:
    """IMAP response data as Python values: parenthesised lists as lists, atoms, quoted strings
    and literals as bytes, NIL as None. Atoms keep their brackets (BODY[HEADER.FIELDS (A B)])."""
    pos = 0

    def values(nested: bool) -> list:
        nonlocal pos
        out: list = []
        while pos < len(data):
            c = data[pos : pos + 1]
            if c in (b" ", b"\r", b"\n"):
                pos += 1
            elif c == b")":
                pos += 1
                assert nested, "unbalanced )"
                return out
            elif c == b"(":
                pos += 1
                out.append(values(True))
            elif c == b'"':
                text = bytearray()
                pos += 1
                while data[pos : pos + 1] != b'"':
                    if data[pos : pos + 1] == b"\\":
                        pos += 1
                    text += data[pos : pos + 1]
                    pos += 1
                pos += 1
                out.append(bytes(text))
            elif c == b"{":
                m = re.compile(rb"\{(\d+)\}\r\n").match(data, pos)
                assert m, data[pos : pos + 20]
                out.append(data[m.end() : m.end() + int(m.group(1))])
                pos = m.end() + int(m.group(1))
            else:
                start = pos
                while pos < len(data) and data[pos : pos + 1] not in (b" ", b"(", b")", b"\r", b"\n"):
                    if data[pos : pos + 1] == b"[":
                        pos = data.index(b"]", pos)
                    pos += 1
                atom = data[start:pos]
                out.append(None if atom == b"NIL" else atom)
        assert not nested, "unbalanced ("
        return out

    return values(False)


async def test_bodystructure_and_sections_agree_with_the_email_package(plain_node: Node, store: Store, users) -> None:
    messages = corpus()
    await deliver(store, users["bob"], messages)
    client = imap(plain_node)
    client.login(users["bob"], "bob")
    client.select("INBOX")
    raw = Raw(plain_node.port("imap"))
    raw.login(users["bob"], "bob")
    raw.cmd("EXAMINE INBOX")
    checked = 0
    for n, raw_message in enumerate(messages, 1):
        [structure] = [v["BODYSTRUCTURE"] for v in _fetch_values(raw.cmd(f"FETCH {n} (BODYSTRUCTURE)")).values()]
        parsed = email.message_from_bytes(raw_message, policy=policy.compat32)
        expected = [t for t, _ in _leaves(parsed)]
        got = _structure_leaves(structure)
        if not any(part.defects or "/" not in part.get("content-type", "/").split(";")[0] for part in parsed.walk()):
            assert got == expected, (n, got, expected)
            entity = mime.parse(raw_message)
            sections = {path: _section_bytes(raw, n, path) for path in _message_paths(entity)}
            _check_structure(structure, parsed, (), sections)
            checked += 1
        else:  # malformed MIME: described, never an error
            assert got and all("/" in t for t in got)
        # every leaf section, decoded by its Content-Transfer-Encoding, is what the email package decodes
        entity = mime.parse(raw_message)
        pairs = list(zip(_leaf_paths(entity), _leaves(parsed)))
        assert len(pairs) == len(_leaves(parsed))
        for path, (ctype, payload) in pairs:
            section = ".".join(map(str, path)) or "1"
            typ, data = client.fetch(str(n), f"(BODY.PEEK[{section}])")
            part = data[0][1] if isinstance(data[0], tuple) else b""
            encoding = str(mime.part(entity, path).headers.get("content-transfer-encoding", "")).lower()
            if "base64" in encoding:
                part = base64.b64decode(part)
            elif "quoted-printable" in encoding:
                part = quopri.decodestring(part)
            # (the email package drops the last line end of a part that no close delimiter ends)
            assert part.replace(b"\r\n", b"\n").rstrip(b"\n") == payload.replace(b"\r\n", b"\n").rstrip(b"\n"), (
                n, section, ctype)
    assert checked == 5  # every well-formed message: the nested one, the 8-bit one, the random trees
    # ENVELOPE of the nested message names its encoded subject as sent
    typ, data = client.fetch("1", "(BODY.PEEK[3.HEADER.FIELDS (SUBJECT)] BODY.PEEK[3.TEXT] BODY.PEEK[1.2.MIME])")
    assert data[0][1].startswith(b"Subject: =?utf-8?q?h=C3=A9llo?=")
    assert data[1][1] == b"aW5uZXIgdGV4dAo=\r\n"
    assert b"Content-Type: text/html" in data[2][1]
    typ, data = client.fetch("1", "(BODY.PEEK[9])")  # a part that does not exist: empty, not an error
    assert typ == "OK"


def _leaf_paths(entity: mime.Entity, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Section numbers of the leaves, in the order the email package walks them."""
    if entity.message is not None:
        inner = entity.message
        return _leaf_paths(inner, path) if inner.parts else [path + (1,)]
    if entity.parts:
        return [p for i, part in enumerate(entity.parts, 1) for p in _leaf_paths(part, path + (i,))]
    return [path]


def _message_paths(entity: mime.Entity, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Section numbers of the message/rfc822 parts."""
    if entity.message is not None:
        return [path] + _message_paths(entity.message, path)
    return [p for i, part in enumerate(entity.parts, 1) for p in _message_paths(part, path + (i,))]


def _section_bytes(raw: Raw, n: int, path: tuple[int, ...]) -> bytes:
    [values] = _fetch_values(raw.cmd(f"FETCH {n} (BODY.PEEK[{'.'.join(map(str, path))}])")).values()
    return next(iter(values.values()))


ENVELOPE_MESSAGE = (
    b"Date: Tue, 03 Nov 2026 09:08:07 +0100\r\n"
    b'From: "Doe, Jane" <jane@a.example>\r\n'
    b"Sender: list-bounces@lists.example\r\n"
    b"To: =?utf-8?q?J=C3=B6rg?= <joerg@b.example>,\r\n plain@c.example\r\n"
    b"Cc: Carol <carol@d.example>\r\n"
    b"Bcc: hidden@e.example\r\n"
    b"Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?= and more\r\n"
    b"Message-ID: <abc@a.example>\r\n"
    b"In-Reply-To: <prev@a.example>\r\n"
    b"X-Mailer: test\r\n"
    b"\r\n"
    b"line one\r\nline two\r\n"
)


def _decoded(value: bytes | None) -> str | None:
    return None if value is None else str(make_header(decode_header(value.decode())))


def _envelope_addresses(value: list | None) -> list[tuple[str, str]] | None:
    """ENVELOPE addresses as (display name decoded, mailbox@host)."""
    if value is None:
        return None
    return [(_decoded(name) or "", f"{mailbox.decode()}@{host.decode()}") for name, _route, mailbox, host in value]


async def test_fetch_envelope_body_rfc822_and_macros(plain_node: Node, store: Store, users) -> None:
    user = users["anne"]
    when = datetime(2026, 11, 3, 8, 8, 9, tzinfo=timezone.utc)
    await store.deliver(ENVELOPE_MESSAGE, [Target(user, "Drafts")], when)
    expected = email.message_from_bytes(ENVELOPE_MESSAGE, policy=policy.default)
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "anne")
    raw.cmd("SELECT Drafts")
    [items] = _fetch_values(raw.cmd("FETCH 1 (ENVELOPE)")).values()
    date, subject, from_, sender, reply_to, to, cc, bcc, in_reply_to, message_id = items["ENVELOPE"]
    assert date.decode() == expected["date"] and subject.startswith(b"=?utf-8?q?")  # as written ...
    assert _decoded(subject) == expected["subject"] == "Gr\u00fc\u00dfe and more"  # ... decoding to the same text

    def addresses(name: str) -> list[tuple[str, str]]:
        return [(a.display_name, a.addr_spec) for a in expected[name].addresses]

    assert _envelope_addresses(from_) == addresses("from") == [("Doe, Jane", "jane@a.example")]
    assert _envelope_addresses(sender) == addresses("sender")
    assert _envelope_addresses(reply_to) == addresses("from")  # no Reply-To: the From
    assert _envelope_addresses(to) == addresses("to") == [("J\u00f6rg", "joerg@b.example"), ("", "plain@c.example")]
    assert _envelope_addresses(cc) == addresses("cc") and _envelope_addresses(bcc) == addresses("bcc")
    assert (in_reply_to, message_id) == (b"<prev@a.example>", b"<abc@a.example>")

    header, text = ENVELOPE_MESSAGE.split(b"\r\n\r\n", 1)
    # BODY without a section is BODYSTRUCTURE without the extension data
    [items] = _fetch_values(raw.cmd("FETCH 1 (BODY BODYSTRUCTURE)")).values()
    assert items["BODY"] == [b"text", b"plain", [b"charset", b"us-ascii"], None, None, b"7BIT", str(len(text)).encode(), b"2"]
    assert items["BODYSTRUCTURE"][:8] == items["BODY"] and len(items["BODYSTRUCTURE"]) == 12
    # RFC822.HEADER and BODY[HEADER.FIELDS.NOT] do not set \Seen ...
    [items] = _fetch_values(raw.cmd("FETCH 1 (RFC822.HEADER BODY.PEEK[HEADER.FIELDS.NOT (Bcc X-Mailer Subject)])")).values()
    assert items["RFC822.HEADER"] == header + b"\r\n\r\n"
    assert items["BODY[HEADER.FIELDS.NOT (Bcc X-Mailer Subject)]"] == b"".join(
        line + b"\r\n" for line in header.split(b"\r\n") if not line.startswith((b"Bcc:", b"X-Mailer:", b"Subject:"))
    ) + b"\r\n"
    assert b"\\Seen" not in b"".join(raw.cmd("FETCH 1 (FLAGS)"))
    # ... RFC822.TEXT does, and says so; RFC822 is the whole message
    out = raw.cmd("FETCH 1 (RFC822.TEXT)")
    [items] = _fetch_values(out).values()
    assert items["RFC822.TEXT"] == text and b"\\Seen" in items["FLAGS"]
    [items] = _fetch_values(raw.cmd("FETCH 1 (RFC822)")).values()
    assert items["RFC822"] == ENVELOPE_MESSAGE
    assert "\\Seen" in (await store.get_summaries(user, "Drafts", await _ids(store, user, "Drafts"))).popitem()[1].flags
    # the macros
    macro_items = {"FAST": {"FLAGS", "INTERNALDATE", "RFC822.SIZE"}}
    macro_items["ALL"] = macro_items["FAST"] | {"ENVELOPE"}
    macro_items["FULL"] = macro_items["ALL"] | {"BODY"}
    for macro, names in macro_items.items():
        [items] = _fetch_values(raw.cmd(f"FETCH 1 {macro}")).values()
        assert set(items) == names, (macro, items)
        assert items["FLAGS"] == [b"\\Recent", b"\\Seen"] and items["RFC822.SIZE"] == str(len(ENVELOPE_MESSAGE)).encode()
        assert items["INTERNALDATE"] == b"03-Nov-2026 08:08:09 +0000"
        if "ENVELOPE" in items:
            assert items["ENVELOPE"][9] == b"<abc@a.example>"
        if "BODY" in items:
            assert items["BODY"][:2] == [b"text", b"plain"]


async def test_search_keys(plain_node: Node, store: Store, users) -> None:
    user = users["carol"]
    await deliver(store, user, [message(i, b"needle\r\n" if i % 2 else b"") for i in range(6)])
    await store.deliver(b"From: boss@work.test\r\nSubject: =?utf-8?q?r=C3=A9union?=\r\n\r\n" + b"x" * 5000 + b"\r\n",
                        [Target(user)], datetime(2020, 1, 5, tzinfo=timezone.utc))
    client = imap(plain_node)
    client.login(user, "carol")
    client.select("INBOX")
    client.store("1,3", "+FLAGS", "(\\Flagged custom)")

    def search(*keys: str, uid: bool = False) -> list[int]:
        typ, data = client.uid("SEARCH", *keys) if uid else client.search(None, *keys)
        assert typ == "OK", data
        return [int(n) for n in data[0].split()]

    assert search("ALL") == [1, 2, 3, 4, 5, 6, 7]
    assert search("FLAGGED") == [1, 3] and search("KEYWORD", "custom") == [1, 3]
    assert search("UNFLAGGED", "NOT", "7") == [2, 4, 5, 6]
    assert search("BODY", "needle") == [2, 4, 6]
    assert search("TEXT", "sender3") == [4]
    assert search("FROM", "boss") == [7] and search("SUBJECT", "union") == [7]  # the decoded "réunion"
    assert search("HEADER", "Subject", '"message 2"') == [3]
    assert search("LARGER", "4000") == [7] and search("SMALLER", "4000") == [1, 2, 3, 4, 5, 6]
    assert search("BEFORE", "1-Jan-2021") == [7] and search("SINCE", "1-Jan-2021") == [1, 2, 3, 4, 5, 6]
    assert search("SENTON", "2-Nov-2026") == [1, 2, 3, 4, 5, 6]
    assert search("OR", "FLAGGED", "FROM", "boss") == [1, 3, 7]
    assert search("(FLAGGED", "BODY", "needle)") == []
    assert search("2:4") == [2, 3, 4] and search("UID", "5:*") == [5, 6, 7]
    assert search("UNSEEN", uid=True) == [1, 2, 3, 4, 5, 6, 7]
    typ, data = client.search("KOI8-R", "ALL")
    assert typ == "NO" and data[0].startswith(b"[BADCHARSET")
    # strings as literals, the way clients send non-ASCII text: imaplib sends `{7}` and waits for "+"
    client.literal = "r\u00e9union".encode()
    typ, data = client.search("UTF-8", "SUBJECT")
    assert typ == "OK" and data == [b"7"]
    client.literal = "r\u00e9union".encode()
    assert client.uid("SEARCH", "CHARSET", "UTF-8", "OR", "FLAGGED", "SUBJECT") == ("OK", [b"1 3 7"])
    client.literal = "caf\u00e9".encode()
    assert client.search("UTF-8", "SUBJECT") == ("OK", [b""])
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "carol")
    raw.cmd("EXAMINE INBOX")
    # several literals in one command, inside parentheses, synchronising and LITERAL+
    raw.n += 1
    raw.send(b"t%d SEARCH CHARSET UTF-8 (SUBJECT {5}\r\n" % raw.n)
    assert raw.file.readline().startswith(b"+ ")
    raw.send("r\u00e9un".encode() + b" FROM {4+}\r\nboss) NOT SUBJECT {1+}\r\nx\r\n")
    assert raw.until(b"t%d" % raw.n) == [b"* SEARCH 7\r\n", b"t%d OK SEARCH completed\r\n" % raw.n]
    raw.n += 1
    raw.send(b"t%d SEARCH HEADER {7+}\r\nSubject {0+}\r\n\r\n" % raw.n)  # an empty literal: any Subject
    assert raw.until(b"t%d" % raw.n)[0] == b"* SEARCH 1 2 3 4 5 6 7\r\n"
    assert raw.cmd("SEARCH SUBJECT {99999}")[-1] == b"t%d NO [TOOBIG] Literal too large\r\n" % raw.n
    assert raw.cmd('SEARCH SUBJECT "unterminated')[-1].split(b" ", 2)[1] == b"BAD"
    assert raw.cmd("NOOP")[-1].endswith(b"OK NOOP completed\r\n")


def _dated(n: int, date: str, to: str, cc: str | None = None, bcc: str | None = None) -> bytes:
    extra = (f"Cc: {cc}\r\n" if cc else "") + (f"Bcc: {bcc}\r\n" if bcc else "")
    return (f"From: s{n}@remote.test\r\nTo: {to}\r\n{extra}Subject: dated {n}\r\nDate: {date}\r\n\r\nbody {n}\r\n").encode()


async def test_search_flag_recent_date_and_address_keys(plain_node: Node, store: Store, users) -> None:
    user = users["bob"]
    box = "Archive"
    await deliver(store, user, [
        _dated(1, "Mon, 01 Jan 2024 12:00:00 +0000", "anne@x.example", cc="bob@y.example"),
        _dated(2, "Sun, 15 Jun 2025 12:00:00 +0000", "carol@z.example", bcc="dave@w.example"),
        _dated(3, "Sun, 20 Dec 2026 23:30:00 -0500", "anne@x.example", cc="Erin <erin@v.example>"),
    ], box)
    first = imap(plain_node)  # numbers messages 1-3, so they are not \Recent for the session below
    first.login(user, "bob")
    first.select(box)
    first.store("1", "+FLAGS", "(\\Answered \\Seen)")
    first.store("2", "+FLAGS", "(\\Deleted)")
    first.store("3", "+FLAGS", "(\\Draft $Work)")
    await deliver(store, user, [_dated(4, "Mon, 02 Feb 2026 08:00:00 +0100", "frank@u.example")], box)
    await store.deliver(_dated(5, "Tue, 03 Feb 2026 08:00:00 +0000", "gina@t.example"), [Target(user, box)],
                        datetime(2020, 1, 5, 10, 0, tzinfo=timezone.utc))
    client = imap(plain_node)
    client.login(user, "bob")
    client.select(box)  # numbers 4 and 5: its \Recent messages
    client.store("4", "+FLAGS", "(\\Seen)")

    def search(*keys: str) -> list[int]:
        typ, data = client.search(None, *keys)
        assert typ == "OK", data
        return [int(n) for n in data[0].split()]

    assert search("ANSWERED") == [1] and search("UNANSWERED") == [2, 3, 4, 5]
    assert search("DELETED") == [2] and search("UNDELETED") == [1, 3, 4, 5]
    assert search("DRAFT") == [3] and search("UNDRAFT") == [1, 2, 4, 5]
    assert search("SEEN") == [1, 4] and search("UNSEEN") == [2, 3, 5]
    assert search("RECENT") == [4, 5] and search("NEW") == [5] and search("OLD") == [1, 2, 3]
    assert search("KEYWORD", "$Work") == [3] and search("UNKEYWORD", "$Work") == [1, 2, 4, 5]
    assert search("ON", "5-Jan-2020") == [5] and search("ON", "6-Jan-2020") == []  # internal date
    assert search("SENTBEFORE", "1-Jan-2025") == [1] and search("SENTBEFORE", "15-Jun-2025") == [1]
    assert search("SENTSINCE", "1-Jan-2026") == [3, 4, 5] and search("SENTSINCE", "15-Jun-2025") == [2, 3, 4, 5]
    assert search("SENTON", "20-Dec-2026") == [3]  # the date as written in the header, zone and all
    assert search("TO", "anne@x") == [1, 3] and search("TO", "GINA") == [5]
    assert search("CC", "erin") == [3] and search("CC", "bob@y.example") == [1] and search("CC", "nobody") == []
    assert search("BCC", "dave") == [2]
    assert search("NOT", "TO", "anne", "UNSEEN", "SENTSINCE", "1-Jan-2026") == [5]
    assert first.search(None, "RECENT") == ("OK", [b"1 2 3"])


async def test_only_one_idling_session_gets_a_new_message_as_recent(plain_node: Node, store: Store, users) -> None:
    """RFC 3501: \\Recent belongs to one session. Two sessions idle on one mailbox in one worker,
    which share one watcher and so one listing: one of them is told RECENT 1, the other RECENT 0."""
    user = users["carol"]
    await deliver(store, user, [message(1)], "Junk")
    sessions = [Raw(plain_node.port("imap")) for _ in range(2)]
    for raw in sessions:
        raw.login(user, "carol")
        assert _select_codes(raw, "SELECT Junk")["EXISTS"] == 1
    assert [_select_codes(r, "SELECT Junk")["RECENT"] for r in sessions] == [0, 0]  # the first SELECT had it
    for raw in sessions:
        raw.n += 1
        raw.send(b"t%d IDLE\r\n" % raw.n)
        assert raw.file.readline().startswith(b"+ ")
    await deliver(store, user, [message(2)], "Junk")
    told = []
    for raw in sessions:
        assert raw.file.readline() == b"* 2 EXISTS\r\n"
        told.append(int(re.match(rb"\* (\d+) RECENT\r\n", raw.file.readline()).group(1)))
        raw.send(b"DONE\r\n")
        assert raw.until(b"t%d" % raw.n)[-1].endswith(b"OK IDLE terminated\r\n")
    assert sorted(told) == [0, 1], told
    flags = [b"".join(raw.cmd("FETCH 2 (FLAGS)")) for raw in sessions]
    assert [b"\\Recent" in f for f in flags] == [n == 1 for n in told]
    searched = [raw.cmd("SEARCH RECENT")[0] for raw in sessions]
    assert sorted(searched) == [b"* SEARCH\r\n", b"* SEARCH 2\r\n"]
    later = Raw(plain_node.port("imap"))
    later.login(user, "carol")
    assert _select_codes(later, "EXAMINE Junk")["RECENT"] == 0


def test_a_malformed_command_gets_bad_without_python_text(plain_node: Node, users) -> None:
    """Twisted's parsers put reprs of the input in their exceptions, Python's date checks their own
    messages: none of it reaches the client; the BAD says only which rule was broken."""
    raw = Raw(plain_node.port("imap"))
    raw.login(users["bob"], "bob")
    raw.cmd("SELECT INBOX")
    answers = {
        "NOOP extra arguments": b"Syntax error: unexpected arguments",
        "SEARCH SINCE 31-Feb-2026": b"Syntax error: bad date",
        "SEARCH LARGER many": b"Syntax error: LARGER needs a number",
        "FETCH 1 (BODY[1.x] FLAGS": b"Syntax error: bad FETCH attributes",
        "FETCH 1:2:3 FLAGS": b"Syntax error: bad sequence range",
        "STATUS INBOX MESSAGES": b"Syntax error: STATUS takes a list of items",
        "STORE 1 +FLAGS (\\Bogus)": b"Invalid argument",
        "UID FROB 1": b"Syntax error: UID goes with COPY, MOVE, FETCH, STORE, SEARCH or EXPUNGE",
        'APPEND INBOX (\\Seen) "31-Feb-2026 00:00:00 +0000" {3+}\r\nabc': b"Syntax error: bad date-time",
    }
    for command, text in answers.items():
        tag = b"t%d" % (raw.n + 1)
        last = raw.cmd(command)[-1]
        assert last == tag + b" BAD " + text + b"\r\n", (command, last)
    assert raw.cmd("CREATE &AGEAYgBj-")[-1].endswith(b" NO [CANNOT] Mailbox name is not in canonical modified UTF-7\r\n")
    for command in ('CREATE "a*b"', "RENAME INBOX Sent"):
        last = raw.cmd(command)[-1]
        assert last.split(b" ", 2)[1] == b"NO" and b"'" not in last, last  # no Python repr of the name
    assert raw.cmd("NOOP")[-1].endswith(b"OK NOOP completed\r\n")


async def test_store_flags_and_expunge_in_descending_order(plain_node: Node, store: Store, users) -> None:
    user = users["anne"]
    await deliver(store, user, [message(i) for i in range(5)], "Archive")
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "anne")
    raw.cmd("SELECT Archive")
    out = raw.cmd("STORE 2,4 +FLAGS (\\Deleted)")
    assert out[:2] == [b"* 2 FETCH (FLAGS (\\Deleted \\Recent))\r\n", b"* 4 FETCH (FLAGS (\\Deleted \\Recent))\r\n"]
    assert raw.cmd("STORE 1 +FLAGS.SILENT (\\Seen)") == [b"t4 OK STORE completed\r\n"]
    out = raw.cmd("UID STORE 5 FLAGS (\\Answered)")
    assert out[0] == b"* 5 FETCH (FLAGS (\\Answered \\Recent) UID 5)\r\n"
    out = raw.cmd("EXPUNGE")
    assert out[:2] == [b"* 4 EXPUNGE\r\n", b"* 2 EXPUNGE\r\n"]
    flags = {s.uid: s.flags async for s in store.list_messages(user, "Archive")}
    assert sorted(flags) == [1, 3, 5] and flags[1] == {"\\Seen"} and flags[5] == {"\\Answered"}
    # UID EXPUNGE removes only the deleted messages in its set
    raw.cmd("STORE 1:3 +FLAGS (\\Deleted)")
    out = raw.cmd("UID EXPUNGE 5")
    assert out == [b"* 3 EXPUNGE\r\n", b"t8 OK UID EXPUNGE completed\r\n"]
    assert [s.uid async for s in store.list_messages(user, "Archive")] == [1, 3]
    assert raw.cmd("CLOSE")[-1].startswith(b"t9 OK")
    assert [s.uid async for s in store.list_messages(user, "Archive")] == []


async def test_check_store_variants_examine_and_uid_copy_move(plain_node: Node, store: Store, users) -> None:
    user = users["carol"]
    await deliver(store, user, [message(i) for i in range(4)], "Sent")
    validity = {box: (await store.mailbox_info(user, box)).uidvalidity for box in ("Archive", "Trash")}
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "carol")
    raw.cmd("SELECT Sent")
    # CHECK brings the view up to date like NOOP
    await deliver(store, user, [message(4)], "Sent")
    assert raw.cmd("CHECK") == [b"* 5 EXISTS\r\n", b"* 5 RECENT\r\n", b"t3 OK CHECK completed\r\n"]
    # -FLAGS takes away only what it names; .SILENT answers no FETCH, yet the flags are stored
    raw.cmd("STORE 1:3 FLAGS (\\Seen \\Flagged)")
    assert raw.cmd("STORE 2 -FLAGS (\\Flagged)")[0] == b"* 2 FETCH (FLAGS (\\Recent \\Seen))\r\n"
    assert raw.cmd("UID STORE 1,3 -FLAGS (\\Seen)")[:2] == [b"* 1 FETCH (FLAGS (\\Flagged \\Recent) UID 1)\r\n",
                                                            b"* 3 FETCH (FLAGS (\\Flagged \\Recent) UID 3)\r\n"]
    assert raw.cmd("STORE 4:5 +FLAGS.SILENT (\\Answered $Done)") == [b"t7 OK STORE completed\r\n"]
    assert raw.cmd("STORE 5 -FLAGS.SILENT ($Done)") == [b"t8 OK STORE completed\r\n"]
    flags = {s.uid: s.flags async for s in store.list_messages(user, "Sent")}
    assert flags == {1: {"\\Flagged"}, 2: {"\\Seen"}, 3: {"\\Flagged"}, 4: {"\\Answered", "$Done"}, 5: {"\\Answered"}}
    # UID COPY: COPYUID names the source UIDs and the new ones; the source is untouched
    out = raw.cmd("UID COPY 2,4:5 Archive")
    dest = re.fullmatch(rb"t9 OK \[COPYUID (\d+) 2,4:5 (\d+):(\d+)\] UID COPY completed\r\n", out[-1])
    assert dest and int(dest.group(1)) == validity["Archive"], out
    copied = {s.uid: s.flags async for s in store.list_messages(user, "Archive")}
    assert sorted(copied) == list(range(int(dest.group(2)), int(dest.group(3)) + 1)) and len(copied) == 3
    assert list(copied.values()) == [{"\\Seen"}, {"\\Answered", "$Done"}, {"\\Answered"}]
    assert await inbox(store, user, "Archive") == [message(i) for i in (1, 3, 4)]
    # UID MOVE: COPYUID first, then EXPUNGE of the moved messages (descending), then the tagged OK
    out = raw.cmd("UID MOVE 1,3 Trash")
    assert re.fullmatch(rb"\* OK \[COPYUID %d 1,3 1:2\] Moved\r\n" % validity["Trash"], out[0]), out
    assert out[1:] == [b"* 3 EXPUNGE\r\n", b"* 1 EXPUNGE\r\n", b"t10 OK UID MOVE completed\r\n"]
    assert await inbox(store, user, "Trash") == [message(0), message(2)]
    assert [s.uid async for s in store.list_messages(user, "Sent")] == [2, 4, 5]
    assert raw.cmd("UID MOVE 99 Trash")[-1] == b"t11 OK UID MOVE completed\r\n"  # nothing to move
    # EXAMINE: read-only, and STORE, EXPUNGE and MOVE are refused
    out = raw.cmd("EXAMINE Sent")
    assert b"* OK [PERMANENTFLAGS ()] Limited\r\n" in out and out[-1] == b"t12 OK [READ-ONLY] EXAMINE completed\r\n"
    assert raw.cmd("STORE 1 +FLAGS (\\Deleted)")[-1] == b"t13 NO [READ-ONLY] Mailbox is read-only\r\n"
    assert raw.cmd("EXPUNGE")[-1] == b"t14 NO [READ-ONLY] Mailbox is read-only\r\n"
    assert raw.cmd("MOVE 1 Trash")[-1] == b"t15 NO [READ-ONLY] Mailbox is read-only\r\n"
    [items] = _fetch_values(raw.cmd("FETCH 2 (UID BODY[TEXT])")).values()  # no \Seen in a read-only mailbox
    assert items["UID"] == b"4" and items["BODY[TEXT]"] == b"body of 3\r\n" and "FLAGS" not in items
    assert "\\Seen" not in {s.uid: s.flags async for s in store.list_messages(user, "Sent")}[4]


async def test_append_copy_and_move_answer_with_uids(plain_node: Node, store: Store, users) -> None:
    user = users["bob"]
    client = imap(plain_node)
    client.login(user, "bob")
    when = imaplib.Time2Internaldate(datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc).timestamp())
    typ, data = client.append("Drafts", "(\\Draft $label)", when, b"Subject: draft\r\n\r\nhello\r\n")
    assert typ == "OK"
    validity, uid = re.search(rb"\[APPENDUID (\d+) (\d+)\]", data[0]).groups()
    [summary] = [s async for s in store.list_messages(user, "Drafts")]
    assert summary.flags == {"\\Draft", "$label"} and summary.uid == int(uid)
    assert summary.internal_date == datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
    assert int(validity) == (await store.mailbox_info(user, "Drafts")).uidvalidity
    assert client.append("Nowhere", None, None, b"x\r\n")[1][0].startswith(b"[TRYCREATE]")
    await deliver(store, user, [message(i) for i in range(3)], "Junk")
    client.select("Junk")
    typ, data = client.copy("1:2", "Archive")
    assert re.search(rb"\[COPYUID \d+ 1:2 \d+:\d+\]", data[0]), data
    assert len(await inbox(store, user, "Archive")) == 2
    typ, data = client._simple_command("MOVE", "3", "Trash")
    assert typ == "OK"
    assert any(b"COPYUID" in (r or b"") for r in client.untagged_responses.get("OK", []))
    assert client.untagged_responses.get("EXPUNGE") == [b"3"]
    assert await inbox(store, user, "Trash") == [message(2)] and len(await inbox(store, user, "Junk")) == 2
    assert client.copy("1", "Nowhere")[1][0].startswith(b"[TRYCREATE]")


async def test_a_large_message_moved_and_copied_back_comes_back_byte_exact(plain_node: Node, store: Store,
                                                                           users) -> None:
    """MOVE, COPY and EXPUNGE of a message of many chunks (on Cassandra the copies share its body)."""
    user = users["carol"]
    body = message(77, b"".join(b"line %06d of a large attachment\r\n" % i for i in range(20_000)))
    await deliver(store, user, [body], "Drafts")
    client = imap(plain_node)
    client.login(user, "carol")
    client.select("Drafts")
    typ, data = client._simple_command("MOVE", "1", "Archive")
    assert typ == "OK" and await inbox(store, user, "Drafts") == []
    client.select("Archive")
    [uid] = client.uid("SEARCH", "SUBJECT", '"message 77"')[1][0].split()
    assert client.uid("COPY", uid, "Drafts")[0] == "OK"
    assert client.uid("FETCH", uid, "BODY.PEEK[]")[1][0][1] == body
    assert client.uid("STORE", uid, "+FLAGS.SILENT", "(\\Deleted)")[0] == "OK"
    assert client.expunge()[0] == "OK"
    client.select("Drafts")
    assert client.fetch("1", "BODY.PEEK[]")[1][0][1] == body
    assert await inbox(store, user, "Drafts") == [body]
    client.logout()


def test_mailbox_management_with_special_use_and_utf7_names(plain_node: Node, users) -> None:
    client = imap(plain_node)
    client.login(users["carol"], "carol")
    typ, data = client.list()
    special = {re.search(rb'"/" (.+)$', line).group(1): line for line in data}
    assert b"\\Sent" in special[b"Sent"] and b"\\Trash" in special[b"Trash"] and b"\\Junk" in special[b"Junk"]
    assert special[b"Drafts"] == b'(\\HasNoChildren \\Drafts) "/" Drafts'
    assert special[b"Archive"] == b'(\\HasNoChildren \\Archive) "/" Archive'
    assert special[b"INBOX"] == b'(\\HasNoChildren) "/" INBOX'  # no special use
    name = wire.encode_mailbox("Caf\u00e9/R\u00e9sum\u00e9s")
    assert client.create(name)[0] == "OK"
    assert client.create(name)[1][0].startswith(b"[ALREADYEXISTS]")
    typ, data = client.list('""', "Caf*")
    assert typ == "OK" and any(name in line for line in data)
    assert client.rename(name, b"Projects")[0] == "OK"
    assert client.status("Projects", "(MESSAGES UIDNEXT UIDVALIDITY UNSEEN RECENT)")[0] == "OK"
    assert client.unsubscribe("Projects")[0] == "OK"
    assert not any(b"Projects" in line for line in client.lsub()[1] if line)
    assert client.subscribe("Projects")[0] == "OK"
    assert any(b"Projects" in line for line in client.lsub()[1] if line)
    assert client.delete("Projects")[0] == "OK"
    assert client.delete("INBOX")[0] == "NO"
    assert client.select("Projects")[0] == "NO"
    raw = Raw(plain_node.port("imap"))
    raw.login(users["carol"], "carol")
    assert raw.cmd("CREATE &Jjo-bad&")[-1].startswith(b"t2 NO [CANNOT]")  # invalid modified UTF-7
    assert raw.cmd("CREATE caf\xc3\xa9")[-1].startswith(b"t3 NO [CANNOT]")  # 8-bit instead of modified UTF-7


def test_namespace_id_enable_and_unselect(plain_node: Node, users) -> None:
    raw = Raw(plain_node.port("imap"))
    raw.login(users["anne"], "anne")
    assert raw.cmd("NAMESPACE")[0] == b'* NAMESPACE (("" "/")) NIL NIL\r\n'
    assert raw.cmd('ID ("name" "test")')[0].startswith(b'* ID ("name" "cassmail"')
    assert raw.cmd("ENABLE X-UNKNOWN")[0] == b"* ENABLED\r\n"  # nothing it offers
    raw.cmd("EXAMINE INBOX")
    assert raw.cmd("UNSELECT")[-1].endswith(b"OK UNSELECT completed\r\n")
    assert raw.cmd("FETCH 1 FLAGS")[-1].startswith(b"t%d BAD" % raw.n)  # no mailbox selected any more


# ----------------------------------------------------------------------------- IDLE and other sessions


async def test_idle_reports_new_mail_expunges_and_flag_changes(plain_node: Node, store: Store, users) -> None:
    user = users["anne"]
    await deliver(store, user, [message(1), message(2)], "Sent")
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "anne")
    raw.cmd("SELECT Sent")
    other = imap(plain_node)
    other.login(user, "anne")
    other.select("Sent")
    raw.n += 1
    raw.send(b"t%d IDLE\r\n" % raw.n)
    assert raw.file.readline().startswith(b"+ ")
    with smtplib.SMTP("127.0.0.1", plain_node.port("smtp")) as smtp:
        smtp.sendmail("x@remote.test", [user], message(3))  # goes to INBOX: not this mailbox
    await deliver(store, user, [message(3)], "Sent")
    started = time.monotonic()
    assert raw.file.readline() == b"* 3 EXISTS\r\n"
    assert time.monotonic() - started < 5
    raw.file.readline()  # RECENT
    other.store("1", "+FLAGS", "(\\Flagged)")
    assert raw.file.readline().startswith(b"* 1 FETCH (FLAGS (\\Flagged")
    other.store("2", "+FLAGS", "(\\Deleted)")
    other.expunge()
    line = raw.file.readline()
    if line.startswith(b"* 2 FETCH"):  # the flag change, when a look fell between STORE and EXPUNGE
        line = raw.file.readline()
    assert line == b"* 2 EXPUNGE\r\n"
    raw.send(b"DONE\r\n")
    assert raw.until(b"t%d" % raw.n)[-1] == b"t%d OK IDLE terminated\r\n" % raw.n


async def test_two_nodes_assign_each_uid_once_and_idle_hears_the_other_node(backend_settings, tmp_path: Path, store: Store, users) -> None:
    user = users["bob"]
    nodes = [Node(node_settings(backend_settings), tmp_path, imap={"allow_plaintext_auth": True, "idle_poll": 0.3}).start()
             for _ in range(2)]
    try:
        for rnd in range(3):
            await deliver(store, user, [message(rnd * 100 + i) for i in range(40)], "Archive")

            def select(node: Node) -> dict[bytes, int]:
                client = imap(node)
                client.login(user, "bob")
                client.select("Archive")
                typ, data = client.fetch("1:*", "(UID BODY.PEEK[HEADER.FIELDS (SUBJECT)])")
                return {d[1]: int(re.search(rb"UID (\d+)", d[0]).group(1)) for d in data if isinstance(d, tuple)}

            seen = await asyncio.gather(*(asyncio.to_thread(select, n) for n in nodes + nodes))
            assert all(s == seen[0] for s in seen)  # every session saw the same UID for each message
            uids = sorted(seen[0].values())
            assert uids == list(range(1, 40 * (rnd + 1) + 1))  # strictly ascending, none reused or skipped
        # IDLE on one node hears of a MOVE and a COPY made on the other
        await deliver(store, user, [message(900), message(901)])
        watcher = Raw(nodes[0].port("imap"))
        watcher.login(user, "bob")
        assert b"* 120 EXISTS\r\n" in watcher.cmd("SELECT Archive")
        watcher.n += 1
        watcher.send(b"t%d IDLE\r\n" % watcher.n)
        assert watcher.file.readline().startswith(b"+ ")
        mover = imaplib.IMAP4("127.0.0.1", nodes[1].port("imap"))
        mover.login(user, "bob")
        mover.select("INBOX")
        typ, data = mover._simple_command("MOVE", "1", "Archive")
        assert typ == "OK"
        assert watcher.file.readline() == b"* 121 EXISTS\r\n"
        watcher.file.readline()  # RECENT
        typ, data = mover.copy("1", "Archive")
        copied_uid = int(re.search(rb"COPYUID \d+ \d+ (\d+)", data[0]).group(1))
        assert watcher.file.readline() == b"* 122 EXISTS\r\n" and copied_uid == 122
        watcher.file.readline()
        watcher.send(b"DONE\r\n")
        out = watcher.until(b"t%d" % watcher.n)
        assert out[-1].endswith(b"OK IDLE terminated\r\n")
        fetched = watcher.cmd("UID FETCH 121:122 (BODY.PEEK[HEADER.FIELDS (SUBJECT)])")
        assert b"Subject: message 900\r\n\r\n" in fetched and b"Subject: message 901\r\n\r\n" in fetched
        # IDLE on one node hears of a flag change and an expunge made on the other
        watcher.n += 1
        watcher.send(b"t%d IDLE\r\n" % watcher.n)
        assert watcher.file.readline().startswith(b"+ ")
        mover.select("Archive")
        mover.store("5", "+FLAGS", "(\\Flagged)")
        assert watcher.file.readline() == b"* 5 FETCH (FLAGS (\\Flagged) UID 5)\r\n"
        mover.store("7", "+FLAGS", "(\\Deleted)")
        assert mover.expunge() == ("OK", [b"7"])
        line = watcher.file.readline()
        if line.startswith(b"* 7 FETCH"):  # the flag change, when a look fell between STORE and EXPUNGE
            line = watcher.file.readline()
        assert line == b"* 7 EXPUNGE\r\n"
        watcher.send(b"DONE\r\n")
        assert watcher.until(b"t%d" % watcher.n)[-1].endswith(b"OK IDLE terminated\r\n")
        assert b"* 7 FETCH (UID 8)\r\n" in watcher.cmd("FETCH 7 (UID)")
        watcher.cmd("LOGOUT")  # a session left open would hold its node's stop for the grace period
        mover.logout()
    finally:
        for n in nodes:
            assert n.stop() == 0


async def test_a_message_listed_late_gets_a_uid_above_all_others(plain_node: Node, store: Store, users,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A message stamped by a node whose clock is an hour slow sorts first in the store, yet the
    session sees it as the newest message: UIDs only grow and no sequence number shifts. (A view
    kept up to date from changes and recent arrivals sees it at its next full listing, within
    view.FULL_LISTING seconds.)"""
    from cassmail import model

    user = users["anne"]
    await deliver(store, user, [message(i) for i in range(3)], "Junk")
    raw = Raw(plain_node.port("imap"))
    raw.login(user, "anne")
    assert b"* 3 EXISTS\r\n" in raw.cmd("SELECT Junk")
    slow = model.new_message_id(time.time() - 3600)
    monkeypatch.setattr(type(store).__module__ + ".new_message_id", lambda *a: slow)
    await deliver(store, user, [b"Subject: from a slow clock\r\n\r\nlate\r\n"], "Junk")
    monkeypatch.undo()
    assert (await _ids(store, user, "Junk"))[0] == slow  # first in the store's order ...
    deadline = time.monotonic() + FULL_LISTING + 5
    while b"* 4 EXISTS\r\n" not in raw.cmd("NOOP"):
        assert time.monotonic() < deadline, "the late message never showed"
        time.sleep(0.5)
    out = b"".join(raw.cmd("FETCH 1:* (UID BODY.PEEK[HEADER.FIELDS (SUBJECT)])"))
    # ... and last here
    assert re.search(rb"\* 4 FETCH \(UID 4 BODY\[HEADER.FIELDS \(\w+\)\] \{\d+\}\r\nSubject: from a slow clock", out)
    assert [s.uid async for s in store.list_messages(user, "Junk")] == [4, 1, 2, 3]


async def test_a_later_select_starts_from_the_worker_snapshot_of_the_mailbox(plain_node: Node, store: Store,
                                                                               users) -> None:
    """A view a session closes is kept by its worker, and the next SELECT of that mailbox there
    starts from it: unchanged, with no listing at all; changed elsewhere meanwhile (flags, a new
    keyword, an expunge, a delivery), it shows what a listing shows, with \\Recent for the new
    message only."""
    from tests.test_metrics import scrape, value

    user, box = users["carol"], f"Snap{random.randrange(10**6)}"
    await store.create_mailbox(user, box)
    await deliver(store, user, [message(i) for i in range(4)], box)

    def listings() -> float:
        return value(scrape(plain_node), "cassmail_store_seconds_count", op="list_messages") or 0

    def session() -> Raw:
        raw = Raw(plain_node.port("imap"))
        raw.login(user, "carol")
        return raw

    first = session()
    assert b"* 4 RECENT\r\n" in first.cmd(f"SELECT {box}")
    first.cmd("LOGOUT")
    # (The first SELECT's claim of \\Recent is a change on mbox, and WheelFS gives no changes
    # token for a second after one: the next SELECT may list once.)
    time.sleep(1.2)
    for _ in range(2):
        second = session()
        before = listings()
        again = second.cmd(f"SELECT {box}")
        assert b"* 4 EXISTS\r\n" in again and b"* 0 RECENT\r\n" in again
        second.cmd("LOGOUT")
    assert listings() == before  # the snapshot was taken in without reading the mailbox
    second = session()
    second.cmd(f"SELECT {box}")
    second.cmd("STORE 2 +FLAGS (\\Flagged)")
    second.cmd("STORE 1 +FLAGS (\\Deleted)")
    assert b"* 1 EXPUNGE\r\n" in second.cmd("EXPUNGE")
    second.cmd("LOGOUT")  # its view (three messages, one flagged) is the snapshot now
    other = session()
    other.cmd(f"SELECT {box}")
    other.cmd("STORE 3 FLAGS (\\Seen $Label1)")  # changed by a view that stays open
    await deliver(store, user, [message(9)], box)

    third = session()
    restored = third.cmd(f"SELECT {box}")
    assert b"* 4 EXISTS\r\n" in restored and b"* 1 RECENT\r\n" in restored, restored
    assert b"$Label1" in b"".join(line for line in restored if line.startswith(b"* FLAGS"))  # announced
    fetched = third.cmd("FETCH 1:* (UID FLAGS)")[:-1]
    fresh = session()
    fresh.cmd(f"EXAMINE {box}")  # its own listing (read-only: it claims no \\Recent)
    listed = fresh.cmd("FETCH 1:* (UID FLAGS)")[:-1]
    assert [line.replace(b"\\Recent", b"").replace(b" )", b")").replace(b"( ", b"(") for line in fetched] == listed
    assert b"\\Recent" in fetched[-1] and len(listed) == 4
    flags = {int(m.group(1)): set(m.group(2).decode().split())
             for m in re.finditer(rb"UID (\d+) FLAGS \(([^)]*)\)", b"".join(listed))}
    assert flags == {s.uid: set(s.flags) async for s in store.list_messages(user, box)}
    for raw in (other, third, fresh):
        raw.cmd("LOGOUT")


async def test_a_select_on_another_node_starts_from_the_snapshot_the_store_keeps(cassandra_settings, tmp_path: Path) -> None:
    """On Cassandra a view of a large mailbox (here: 20 messages or more) is also left in the
    store when its session closes it, and a SELECT on another node starts from it without
    listing the mailbox, taking in what changed since (a flag change, an expunge, a delivery)
    as a session that stayed selected would."""
    import dataclasses

    from cassmail.config import Settings
    from tests.conftest import FAST_HASH, hash_password, opened_store
    from tests.test_metrics import scrape, value

    settings = Settings()
    settings.store.backend = "cassandra"
    settings.store.cassandra = dataclasses.replace(cassandra_settings)
    domain = f"snap{random.randrange(10**9)}.example"
    user, box = f"anne@{domain}", "Big"
    async with opened_store(settings) as store:
        await store.add_domain(domain)
        await store.create_user(user, hash_password("anne", FAST_HASH))
        await store.create_mailbox(user, box)
        await deliver(store, user, [message(i) for i in range(30)], box)
        imap_settings = {"allow_plaintext_auth": True, "store_snapshot_messages": 20}
        nodes = [Node(node_settings(settings), tmp_path, imap=imap_settings, metrics={"enabled": True}).start()
                 for _ in range(2)]
        try:
            first = logged_in(nodes[0], user, "anne", box)
            first.cmd("STORE 2 +FLAGS (\\Flagged)")
            assert await store.view_snapshot(user, box) is None
            first.cmd("LOGOUT")  # its view is left in the store, in the background
            deadline = time.monotonic() + 10
            while await store.view_snapshot(user, box) is None:
                assert time.monotonic() < deadline, "no snapshot was left in the store"
                await asyncio.sleep(0.1)
            other = logged_in(nodes[0], user, "anne", box)
            other.cmd("STORE 3 FLAGS (\\Seen $Label1)")
            other.cmd("STORE 1 +FLAGS (\\Deleted)")
            assert b"* 1 EXPUNGE\r\n" in other.cmd("EXPUNGE")
            await deliver(store, user, [message(99)], box)

            def count(node: Node, op: str) -> float:
                return value(scrape(node), "cassmail_store_seconds_count", op=op) or 0

            listed = count(nodes[1], "list_messages")
            third = logged_in(nodes[1], user, "anne")
            selected = third.cmd(f"SELECT {box}")
            assert count(nodes[1], "view_snapshot") == 1 and count(nodes[1], "list_messages") == listed
            assert b"* 30 EXISTS\r\n" in selected and b"* 1 RECENT\r\n" in selected, selected
            assert b"$Label1" in b"".join(line for line in selected if line.startswith(b"* FLAGS"))
            shown = {int(m.group(1)): set(m.group(2).decode().replace("\\Recent", "").split())
                     for m in re.finditer(rb"UID (\d+) FLAGS \(([^)]*)\)", b"".join(third.cmd("FETCH 1:* (UID FLAGS)")))}
            stored = {s.uid: set(s.flags) async for s in store.list_messages(user, box)}
            assert list(shown) == sorted(stored) and shown == stored and len(shown) == 30
            assert shown[3] == {"\\Seen", "$Label1"} and shown[2] == {"\\Flagged"} and 1 not in shown

            # A snapshot whose view's last full listing is long past: the SELECT starts from it
            # all the same, and the full listing comes at the refresh after it.
            from cassmail.imap.snapshots import decode, encode

            kept = await decode(await store.view_snapshot(user, box))
            assert kept is not None
            kept.full_at -= 3600
            await store.keep_view_snapshot(user, box, await encode(kept))
            listed, read = count(nodes[1], "list_messages"), count(nodes[1], "view_snapshot")
            fourth = logged_in(nodes[1], user, "anne", box)  # (the third's view is still open)
            assert count(nodes[1], "view_snapshot") == read + 1 and count(nodes[1], "list_messages") == listed
            fourth.cmd("NOOP")
            assert count(nodes[1], "list_messages") == listed + 1
            for raw in (other, third, fourth):
                raw.cmd("LOGOUT")
        finally:
            for n in nodes:
                assert n.stop() == 0
                assert "Traceback" not in n.log_text()


@pytest.mark.store_independent
def test_implicit_tls(backend_settings, tls_files, tmp_path: Path, users) -> None:
    node = Node(node_settings(backend_settings), tmp_path, imap={**tls_files, "implicit_tls": True}).start()
    try:
        client = imaplib.IMAP4_SSL("127.0.0.1", node.port("imap"), ssl_context=CLIENT_TLS, timeout=30)
        assert "AUTH=PLAIN" in client.capabilities and "STARTTLS" not in client.capabilities
        assert client.login(users["carol"], "carol")[0] == "OK"
        client.logout()
    finally:
        assert node.stop() == 0


# ----------------------------------------------------------------------------- large messages


async def test_a_large_message_is_streamed_byte_exact(plain_node: Node, store: Store, users) -> None:
    body = b"Subject: big\r\n\r\n" + b"".join(b"%08d " % i + bytes(random.Random(i).randbytes(30)).hex().encode() + b"\r\n"
                                          for i in range(300_000))
    await deliver(store, users["carol"], [body], "Archive")
    client = imap(plain_node)
    client.login(users["carol"], "carol")
    client.select("Archive")
    typ, data = client.fetch("1", "(BODY.PEEK[])")
    assert data[0][1] == body
    typ, data = client.fetch("1", "(BODY.PEEK[]<10000000.100>)")
    assert data[0][1] == body[10_000_000:10_000_100]


# ----------------------------------------------------------------------------- bad input


def test_bad_input_gets_bad_or_no_and_the_session_goes_on(plain_node: Node, users) -> None:
    raw = Raw(plain_node.port("imap"))
    assert raw.cmd("SELECT INBOX")[-1].split(b" ", 2)[1] == b"BAD"  # not logged in yet
    assert raw.cmd("FROBNICATE")[-1] == b"t2 BAD Unknown command\r\n"
    raw.login(users["anne"], "anne")
    raw.cmd("SELECT INBOX")
    assert raw.cmd("FETCH 1:* (FLAGS")[-1].split(b" ", 2)[1] == b"BAD"  # unbalanced parenthesis
    assert raw.cmd("SEARCH (OR SEEN")[-1].split(b" ", 2)[1] == b"BAD"
    assert raw.cmd("FETCH " + ",".join(str(i) for i in range(1, 20003, 2)) + " FLAGS")[-1].split(b" ", 2)[1] == b"BAD"
    assert raw.cmd("UID FETCH 1:4294967295 (FLAGS)")[-1].split(b" ", 2)[1] == b"OK"  # huge but valid: no walk
    assert raw.cmd("FETCH 0 FLAGS")[-1].split(b" ", 2)[1] == b"BAD"
    assert raw.cmd("STORE 1:* +FLAGS (\\Bogus)")[-1].split(b" ", 2)[1] == b"BAD"
    raw.n += 1
    raw.send(b"\xff\xfe garbage \x00\r\n")
    assert raw.file.readline().startswith(b"* BAD")
    assert raw.cmd("X" * 70_000)[-1] == b"t%d BAD Line too long\r\n" % raw.n
    assert raw.cmd("APPEND INBOX {999999999999}")[-1].split(b" ", 2)[1] == b"BAD"
    assert raw.cmd("APPEND INBOX {200000000}")[-1].split(b" ", 2)[1:] == [b"NO", b"[TOOBIG] Literal too large\r\n"]
    assert raw.cmd('LOGIN "unterminated')[-1].split(b" ", 2)[1] == b"BAD"
    # a name that is not modified UTF-7 is the name's trouble, not the command's: NO, and the session goes on
    assert raw.cmd("SELECT &Jjo")[-1].split(b" ", 2)[1:] == [b"NO", b"[CANNOT] Mailbox name is not valid modified UTF-7\r\n"]
    assert raw.cmd("SELECT &-nothing")[-1].split(b" ", 2)[1:] == [b"NO", b"[NONEXISTENT] No such mailbox\r\n"]
    assert raw.cmd("NOOP")[-1] == b"t%d OK NOOP completed\r\n" % raw.n
    # literals: synchronising and non-synchronising (LITERAL+)
    raw.n = 17
    raw.send(b"t17 CREATE {7}\r\n")
    assert raw.file.readline().startswith(b"+ ")
    raw.send(b"Lit/One\r\n")
    assert raw.until(b"t17")[-1] == b"t17 OK CREATE completed\r\n"
    raw.n += 1
    raw.send(b"t18 STATUS {7+}\r\nLit/One (MESSAGES)\r\n")
    assert raw.until(b"t18")[-2] == b'* STATUS Lit/One (MESSAGES 0)\r\n'
    raw.n += 1
    raw.send(b"t19 CREATE {9000000+}\r\n")  # too large and already on its way: the session ends
    assert raw.file.readline().startswith(b"* BYE")


@pytest.mark.store_independent
async def test_a_short_literal_then_silence_or_a_closed_connection(plain_node: Node, store: Store, users) -> None:
    """A client that announces more literal bytes than it sends: the session waits for them (as
    it must, they may be slow) and, when the client leaves instead, ends quietly; nothing is
    stored and no traceback is logged."""
    user = users["anne"]
    waiting = Raw(plain_node.port("imap"))
    waiting.login(user, "anne")
    waiting.send(b"a1 APPEND Junk {100}\r\n")
    assert waiting.file.readline().startswith(b"+ ")
    waiting.send(b"Subject: short\r\n\r\nonly this\r\n")
    waiting.sock.settimeout(1.5)
    with pytest.raises(TimeoutError):
        waiting.file.readline()  # no answer: the literal is not complete
    for opening in (b"a1 LOGIN {20}\r\n", b"a1 LOGIN {20+}\r\nanne", b"a1 CREATE {30+}\r\nabc"):
        leaving = Raw(plain_node.port("imap"))
        leaving.send(opening)
        if b"+}" not in opening:
            assert leaving.file.readline().startswith(b"+ ")
            leaving.send(b"ab")
        leaving.sock.close()
    waiting.sock.close()
    await asyncio.sleep(0.5)
    client = imap(plain_node)
    client.login(user, "anne")
    assert client.select("Junk") == ("OK", [b"0"]) and await inbox(store, user, "Junk") == []
    assert "Traceback" not in plain_node.log_text()


def test_pipelined_commands_are_answered_in_order(plain_node: Node, users) -> None:
    raw = Raw(plain_node.port("imap"))
    raw.login(users["carol"], "carol")
    raw.send(b"a1 SELECT INBOX\r\na2 FETCH 1:* (UID)\r\na3 NOOP\r\na4 LOGOUT\r\n")
    tags = []
    while True:
        line = raw.file.readline()
        if not line:
            break
        if line[:1] == b"a":
            tags.append(line.split()[0])
    assert tags == [b"a1", b"a2", b"a3", b"a4"]


# ----------------------------------------------------------------------------- mbsync


def _mbsync(tmp_path: Path, node: Node, user: str, password: str, *flags: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "mbsyncrc"
    local = tmp_path / "Maildir"
    local.mkdir(exist_ok=True)
    config.write_text(
        f"IMAPAccount test\nHost 127.0.0.1\nPort {node.port('imap')}\nUser {user}\nPass {password}\n"
        "SSLType None\nAuthMechs LOGIN\n\n"
        "IMAPStore remote\nAccount test\n\n"
        f"MaildirStore local\nPath {local}/\nInbox {local}/INBOX\n\n"
        "Channel sync\nFar :remote:\nNear :local:\nPatterns INBOX\nCreate Both\nSync All\nExpunge Both\n"
        f"SyncState {tmp_path}/state/\n"
    )
    (tmp_path / "state").mkdir(exist_ok=True)
    return subprocess.run(["mbsync", *flags, "-c", str(config), "sync"], capture_output=True, text=True, timeout=300)


def _maildir(local: Path) -> dict[bytes, tuple[Path, str]]:
    """The messages of a Maildir folder by Subject line: (file, Maildir flags such as "FS")."""
    out = {}
    for f in list((local / "cur").iterdir()) + list((local / "new").iterdir()):
        subject = re.search(rb"^Subject: ([^\r\n]*)", f.read_bytes(), re.M).group(1)
        out[subject] = (f, f.name.partition(":2,")[2])
    return out


def _set_maildir_flags(path: Path, flags: str) -> None:
    """What a mail client does to mark a message: move it to cur/ with the flags in its name."""
    path.rename(path.parent.parent / "cur" / (path.name.partition(":2,")[0] + ":2," + "".join(sorted(flags))))


async def _flags_by_subject(store: Store, user: str) -> dict[bytes, set[str]]:
    out = {}
    async for s in store.list_messages(user, "INBOX"):
        head = await store.read_message(user, "INBOX", s.id)
        out[re.search(rb"^Subject: ([^\r\n]*)", head, re.M).group(1)] = set(s.flags)
    return out


async def test_mbsync_syncs_500_messages_flags_and_deletions_both_ways_and_then_nothing(
        plain_node: Node, store: Store, users, tmp_path: Path) -> None:
    user = users["carol"]
    for mailbox in ("INBOX",):
        ids = await _ids(store, user, mailbox)
        if ids:
            await store.delete_messages(user, mailbox, ids)
    bodies = [message(i, b"x" * (i % 50) + b"\r\n") for i in range(500)]
    await deliver(store, user, bodies)
    first = _mbsync(tmp_path, plain_node, user, "carol")
    assert first.returncode == 0, first.stdout + first.stderr
    local = tmp_path / "Maildir" / "INBOX"
    files = list((local / "cur").iterdir()) + list((local / "new").iterdir())
    # mbsync stores LF line ends and adds its X-TUID header while it syncs
    fetched = sorted(re.sub(rb"X-TUID: [^\n]*\n", b"", f.read_bytes()) for f in files)
    assert fetched == sorted(b.replace(b"\r\n", b"\n") for b in bodies)
    # a message written locally goes up
    (local / "new" / "1.local:2,").write_bytes(b"Subject: from the laptop\r\n\r\nup\r\n")
    second = _mbsync(tmp_path, plain_node, user, "carol")
    assert second.returncode == 0, second.stdout + second.stderr
    assert b"Subject: from the laptop\r\n\r\nup\r\n" in [re.sub(rb"X-TUID: [^\r]*\r\n", b"", m) for m in await inbox(store, user)]

    # local changes go up: messages 0-9 read, 10-11 flagged and read, 20-24 deleted
    box = _maildir(local)
    for i in range(12):
        _set_maildir_flags(box[b"message %d" % i][0], "FS" if i >= 10 else "S")
    for i in range(20, 25):
        box[b"message %d" % i][0].unlink()
    up = _mbsync(tmp_path, plain_node, user, "carol")
    assert up.returncode == 0, up.stdout + up.stderr
    server = await _flags_by_subject(store, user)
    assert len(server) == 496 and not any(b"message %d" % i in server for i in range(20, 25))
    assert all(server[b"message %d" % i] == {"\\Seen"} for i in range(10))
    assert all(server[b"message %d" % i] == {"\\Seen", "\\Flagged"} for i in range(10, 12))
    assert all(not server[b"message %d" % i] for i in range(12, 500) if not 20 <= i < 25)

    # server changes come down: flags set and cleared, messages expunged
    client = imap(plain_node)
    client.login(user, "carol")
    client.select("INBOX")
    seqs = {int(re.search(rb"Subject: message (\d+)", d[1]).group(1)): int(d[0].split()[0])
            for d in client.fetch("1:*", "(BODY.PEEK[HEADER.FIELDS (SUBJECT)])")[1] if isinstance(d, tuple)
            and b"message" in d[1]}
    assert client.store(",".join(str(seqs[i]) for i in (30, 31)), "+FLAGS", "(\\Answered \\Seen)")[0] == "OK"
    assert client.store(str(seqs[10]), "-FLAGS", "(\\Flagged)")[0] == "OK"
    assert client.store(",".join(str(seqs[i]) for i in (40, 41, 42)), "+FLAGS", "(\\Deleted)")[0] == "OK"
    assert client.expunge()[0] == "OK"
    client.logout()
    down = _mbsync(tmp_path, plain_node, user, "carol")
    assert down.returncode == 0, down.stdout + down.stderr
    box = _maildir(local)
    assert len(box) == 493 and not any(b"message %d" % i in box for i in (20, 21, 22, 23, 24, 40, 41, 42))
    assert box[b"message 30"][1] == box[b"message 31"][1] == "RS"
    assert box[b"message 10"][1] == "S" and box[b"message 11"][1] == "FS" and box[b"message 0"][1] == "S"
    assert box[b"message 99"][1] == "" and box[b"from the laptop"][0].read_bytes().endswith(b"\r\n\r\nup\r\n")

    # nothing changed: the last run fetches, uploads, flags and deletes nothing (its IMAP dialogue,
    # -Dn, shows it) and leaves the Maildir as it was, file names (flags) and contents
    before = {f.relative_to(local): f.read_bytes() for f in local.rglob("*") if f.is_file()}
    third = _mbsync(tmp_path, plain_node, user, "carol", "-Dn")
    assert third.returncode == 0, third.stdout + third.stderr
    sent = [line for line in third.stdout.splitlines() if line.startswith(">>> ")]
    assert sent and not [line for line in sent if re.search(r"APPEND|BODY\.PEEK\[\]|STORE|EXPUNGE", line)], sent
    assert any("LOGOUT" in line for line in sent)
    assert {f.relative_to(local): f.read_bytes() for f in local.rglob("*") if f.is_file()} == before
    assert len(await _flags_by_subject(store, user)) == 493


async def test_idle_sessions_cost_no_listing_until_their_mailbox_changes(plain_node: Node, store: Store, users) -> None:
    """Push IDLE: twelve sessions idle on three mailboxes. While nothing changes the worker asks
    the store which watched mailboxes changed, a few times a second whatever the number of
    sessions, and lists none; after a delivery only the sessions of its mailbox read: what
    arrived, each for itself, where the store lists arrivals cheaply (Cassandra, mbox); else
    (WheelFS) the listing, once for all of them."""
    from tests.test_metrics import scrape, value

    user = users["anne"]
    boxes = ["INBOX", "Sent", "Drafts"]
    sessions = []
    for i in range(12):
        raw = Raw(plain_node.port("imap"))
        raw.login(user, "anne")
        raw.cmd(f"SELECT {boxes[i % 3]}")
        raw.n += 1
        raw.send(b"t%d IDLE\r\n" % raw.n)
        assert raw.file.readline().startswith(b"+ ")
        sessions.append(raw)

    def calls(samples: dict, op: str) -> float:
        return value(samples, "cassmail_store_seconds_count", op=op) or 0

    # the first poll lists each newly watched mailbox once (WheelFS: and once more when the
    # directories its \\Recent claims wrote in are a second old, see WheelFSStore.changes_token)
    time.sleep(2.5)
    before = scrape(plain_node)
    time.sleep(2.0)
    quiet = scrape(plain_node)
    assert calls(quiet, "list_messages") == calls(before, "list_messages")
    assert 2 <= calls(quiet, "changed_mailboxes") - calls(before, "changed_mailboxes") <= 2.0 / 0.3 + 2
    await deliver(store, user, [message(1)], "Sent")
    await asyncio.sleep(0.5)  # the store's change event is written in the background (of this loop)
    for raw in sessions[1::3]:
        assert raw.file.readline().endswith(b" EXISTS\r\n")
    told = scrape(plain_node)
    listed = calls(told, "list_messages") - calls(quiet, "list_messages")
    if store.arrivals_mark(()) is None:
        assert 1 <= listed <= 2  # Sent, for its four sessions (twice if a poll fell mid-delivery)
    else:  # (a view whose periodic full listing came due lists instead)
        read = sum(calls(told, op) - calls(quiet, op) for op in ("arrivals", "arrivals_state"))
        assert read >= 1 and read + listed >= 4 and listed <= 4
    for raw in sessions:
        raw.send(b"DONE\r\n")
        assert raw.until(b"t%d" % raw.n)[-1].endswith(b"OK IDLE terminated\r\n")


async def test_sessions_that_idle_again_and_again_do_not_hurry_the_poller(plain_node: Node, store: Store,
                                                                         users) -> None:
    """A client that leaves IDLE and enters it again after each command starts a new watcher each
    time; the worker's poller asks the store which mailboxes changed at its own pace (every
    idle_poll, 0.3 s here) however often that happens, and a delivery made right after an IDLE
    began is still pushed to it (the new watcher's first look comes after the poll's baseline)."""
    from tests.test_metrics import scrape, value

    user = users["anne"]
    steady = Raw(plain_node.port("imap"))  # keeps the poller running
    steady.login(user, "anne")
    steady.cmd("SELECT Drafts")
    steady.n += 1
    steady.send(b"t%d IDLE\r\n" % steady.n)
    assert steady.file.readline().startswith(b"+ ")
    restless = Raw(plain_node.port("imap"))
    restless.login(user, "anne")
    restless.cmd("SELECT Sent")
    time.sleep(1.0)

    def polls() -> float:
        return value(scrape(plain_node), "cassmail_store_seconds_count", op="changed_mailboxes") or 0

    before, started = polls(), time.monotonic()
    for _ in range(30):
        restless.n += 1
        restless.send(b"t%d IDLE\r\n" % restless.n)
        assert restless.file.readline().startswith(b"+ ")
        restless.send(b"DONE\r\n")
        assert restless.until(b"t%d" % restless.n)[-1].endswith(b"OK IDLE terminated\r\n")
    elapsed = time.monotonic() - started
    assert polls() - before <= elapsed / 0.3 + 2, "each new watcher hurried a poll"
    restless.n += 1
    restless.send(b"t%d IDLE\r\n" % restless.n)
    assert restless.file.readline().startswith(b"+ ")
    await deliver(store, user, [message(1)], "Sent")
    assert restless.file.readline().endswith(b" EXISTS\r\n")
    for raw in (steady, restless):
        raw.send(b"DONE\r\n")
        assert raw.until(b"t%d" % raw.n)[-1].endswith(b"OK IDLE terminated\r\n")


async def test_one_claim_of_recent_per_worker_however_many_sessions_are_told(plain_node: Node, store: Store,
                                                                            users) -> None:
    """\\Recent is claimed from the store by the first session of a worker told of a new message;
    the worker's other sessions on that mailbox know the mark moved past it and ask nothing (their
    claim would win nothing). The message is recent in exactly one session."""
    from tests.test_metrics import scrape, value

    user = users["bob"]
    await deliver(store, user, [message(6)])  # so that every session learns the mark at its SELECT
    sessions = []
    for _ in range(5):
        raw = Raw(plain_node.port("imap"))
        raw.login(user, "bob")
        raw.cmd("SELECT INBOX")
        sessions.append(raw)

    def claims() -> float:
        return value(scrape(plain_node), "cassmail_store_seconds_count", op="claim_recent") or 0

    before = claims()
    await deliver(store, user, [message(7)])
    told = [raw.cmd("NOOP") for raw in sessions]
    assert all(any(line.endswith(b"2 EXISTS\r\n") for line in lines) for lines in told), told
    recent = [int(line.split()[1]) for lines in told for line in lines if line.endswith(b" RECENT\r\n")]
    assert sorted(recent) == [0, 0, 0, 0, 2], told  # the first session's: the first message and the new one
    assert claims() - before == 1  # the node runs one worker
    for raw in sessions:
        raw.cmd("LOGOUT")
