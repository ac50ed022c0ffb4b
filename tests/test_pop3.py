"""The POP3 front end as mail clients see it: a real `cassmail serve`, poplib and getmail6 over
real sockets, every backend in turn."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import poplib
import socket

import subprocess
import time
from pathlib import Path

import pytest

from cassmail.model import uidl
from cassmail.store.base import Store, Target
from tests.nodes import CLIENT_TLS, Node, inbox, node_settings, strip_trace

pytestmark = pytest.mark.cassandra


def pop(node: Node, user: str | None = None, password: str | None = None) -> poplib.POP3:
    """A poplib session, upgraded with STLS and logged in when a user is given."""
    client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
    if user is not None:
        client.stls(context=CLIENT_TLS)
        client.user(user)
        client.pass_(password or user.split("@")[0])
    return client


def body_of(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\r\n" for line in lines)


class RawPop:
    """A POP3 client that reads replies byte for byte (what poplib normalises away)."""

    def __init__(self, port: int, stls: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.file = self.sock.makefile("rb")
        self.greeting = self.line()
        if stls:
            assert self.cmd("STLS").startswith(b"+OK")
            self.sock = CLIENT_TLS.wrap_socket(self.sock)
            self.file = self.sock.makefile("rb")

    def line(self) -> bytes:
        data = self.file.readline()
        assert data, "connection closed"
        return data

    def cmd(self, text: str | bytes) -> bytes:
        self.sock.sendall((text.encode() if isinstance(text, str) else text) + b"\r\n")
        return self.line()

    def multiline(self) -> bytes:
        """The body of a multi-line answer, exactly as sent, then unstuffed (RFC 1939 3)."""
        out = bytearray()
        while True:
            line = self.file.readline()
            assert line, "connection closed"
            if line == b".\r\n":
                return bytes(out)
            out += line[1:] if line.startswith(b".") else line

    def closed(self) -> bool:
        return self.file.readline() == b""


# ----------------------------------------------------------------------------- capabilities and TLS


def test_capabilities_before_and_after_stls(node: Node) -> None:
    client = pop(node)
    assert client.getwelcome().startswith(b"+OK") and b"<" not in client.getwelcome()  # no APOP timestamp
    before = client.capa()
    assert "STLS" in before and "USER" not in before and "SASL" not in before
    for keyword in ("TOP", "UIDL", "PIPELINING", "RESP-CODES"):
        assert keyword in before
    client.stls(context=CLIENT_TLS)
    after = client.capa()
    assert "USER" in after and after["SASL"] == ["PLAIN"] and "STLS" not in after
    client.quit()


def test_plaintext_login_is_refused_before_stls(node: Node, users) -> None:
    client = pop(node)
    with pytest.raises(poplib.error_proto, match=r"\[AUTH\] Plaintext authentication is disallowed"):
        client.user(users["anne"])
    with pytest.raises(poplib.error_proto, match=r"\[AUTH\]"):
        client._shortcmd("AUTH PLAIN " + base64.b64encode(f"\0{users['anne']}\0anne".encode()).decode())
    assert client.noop().startswith(b"+OK")  # the session goes on
    client.quit()


# ----------------------------------------------------------------------------- the maildrop


async def test_stat_list_uidl_retr_and_top_show_the_mailbox_exactly(node: Node, store: Store, users) -> None:
    bodies = [
        b"Subject: one\r\n\r\nfirst\r\n",
        b"Subject: dots\r\n\r\n.leading\r\n..two\r\n.\r\nend\r\n",
        b"Subject: 8bit \xc3\xa9\xff\r\n\r\n\x00\x01 binary-ish\r\n" + b"z" * 1500 + b"\r\n",  # poplib reads lines of up to 2048 bytes
    ]
    ids = [(await store.deliver(b, [Target(users["anne"])]))[0] for b in bodies]
    client = pop(node, users["anne"])
    assert client.stat() == (3, sum(map(len, bodies)))
    _, listing, _ = client.list()
    assert listing == [b"%d %d" % (i + 1, len(b)) for i, b in enumerate(bodies)]
    _, uidls, _ = client.uidl()
    assert uidls == [b"%d %s" % (i + 1, uidl(m).encode()) for i, m in enumerate(ids)]
    assert client.uidl(2) == b"+OK 2 " + uidl(ids[1]).encode()
    for number, body in enumerate(bodies, 1):
        response, lines, octets = client.retr(number)
        assert response == b"+OK %d octets" % len(body)
        assert body_of(lines) == body
    _, top, _ = client.top(2, 1)
    assert body_of(top) == b"Subject: dots\r\n\r\n.leading\r\n"
    _, top0, _ = client.top(3, 0)
    assert body_of(top0) == b"Subject: 8bit \xc3\xa9\xff\r\n\r\n"
    client.quit()


async def test_bare_lf_and_lines_starting_with_dots_are_sent_byte_exact(node: Node, store: Store, users) -> None:
    body = b"Subject: lf\n\n.a\nb\r\n.\n..\r\nno final newline"
    await store.deliver(body, [Target(users["bob"])])
    raw = RawPop(node.port("pop3"), stls=True)
    assert raw.cmd(f"USER {users['bob']}").startswith(b"+OK")
    assert raw.cmd("PASS bob").startswith(b"+OK")
    assert raw.cmd("RETR 1") == b"+OK %d octets\r\n" % len(body)
    assert raw.multiline() == body + b"\r\n"  # a CRLF is added only before the terminating dot
    assert raw.cmd("TOP 1 1").startswith(b"+OK")
    assert raw.multiline() == b"Subject: lf\n\n.a\n"


async def test_uidls_are_stable_across_sessions_and_the_view_is_fixed_at_login(node: Node, store: Store, users) -> None:
    await store.deliver(b"Subject: a\r\n\r\na\r\n", [Target(users["carol"])])
    first = pop(node, users["carol"])
    assert first.stat()[0] == 1
    await store.deliver(b"Subject: b\r\n\r\nb\r\n", [Target(users["carol"])])
    assert first.stat()[0] == 1  # mail that arrives during a session waits for the next login
    first_uidls = first.uidl()[1]
    first.quit()
    second = pop(node, users["carol"])
    assert second.stat()[0] == 2
    assert second.uidl()[1][:1] == first_uidls
    second.quit()


async def test_dele_marks_rset_unmarks_and_quit_deletes_in_one_go(node: Node, store: Store, users) -> None:
    for i in range(4):
        await store.deliver(b"Subject: %d\r\n\r\n%d\r\n" % (i, i), [Target(users["anne"])])
    client = pop(node, users["anne"])
    assert client.dele(1).startswith(b"+OK")
    with pytest.raises(poplib.error_proto, match="Message deleted"):
        client.retr(1)
    with pytest.raises(poplib.error_proto, match="Message deleted"):
        client.dele(1)
    assert client.stat()[0] == 3 and [line.split()[0] for line in client.list()[1]] == [b"2", b"3", b"4"]
    client.rset()
    assert client.stat()[0] == 4
    client.dele(2)
    client.dele(4)
    assert client.quit().startswith(b"+OK Bye, 2 message(s) removed")
    assert [strip(m) for m in await inbox(store, users["anne"])] == [b"0", b"2"]


def strip(message: bytes) -> bytes:
    return message.rsplit(b"\r\n\r\n", 1)[1].strip()


async def test_a_dropped_connection_deletes_nothing(node: Node, store: Store, users) -> None:
    await store.deliver(b"Subject: keep\r\n\r\nkeep\r\n", [Target(users["bob"])])
    client = pop(node, users["bob"])
    client.dele(1)
    client.sock.close()  # no QUIT
    await asyncio.sleep(0.5)
    assert len(await inbox(store, users["bob"])) == 1


async def test_another_mailbox_with_the_bar_suffix(node: Node, store: Store, users) -> None:
    await store.deliver(b"Subject: sent\r\n\r\nx\r\n", [Target(users["anne"], "Sent")])
    client = pop(node, users["anne"] + "|Sent", "anne")
    assert client.stat()[0] == 1
    client.quit()
    missing = pop(node)
    missing.stls(context=CLIENT_TLS)
    missing.user(users["anne"] + "|Nope")
    with pytest.raises(poplib.error_proto, match="No such mailbox: Nope"):
        missing.pass_("anne")
    missing.quit()


async def test_two_sessions_on_one_mailbox_each_keep_a_consistent_view(node: Node, store: Store, users) -> None:
    await store.deliver(b"Subject: shared\r\n\r\nx\r\n", [Target(users["carol"])])
    a, b = pop(node, users["carol"]), pop(node, users["carol"])
    a.dele(1)
    a.quit()
    with pytest.raises(poplib.error_proto, match="deleted by another session"):
        b.retr(1)
    b.dele(1)
    assert b.quit().startswith(b"+OK")
    assert await inbox(store, users["carol"]) == []


async def test_auth_plain_with_and_without_an_initial_response(node: Node, users) -> None:
    raw = RawPop(node.port("pop3"), stls=True)
    token = base64.b64encode(f"\0{users['anne']}\0anne".encode())
    assert raw.cmd(b"AUTH PLAIN " + token).startswith(b"+OK")
    second = RawPop(node.port("pop3"), stls=True)
    assert second.cmd("AUTH PLAIN") == b"+ \r\n"
    assert second.cmd(token).startswith(b"+OK")
    assert second.cmd("QUIT").startswith(b"+OK")


def test_failed_logins_are_refused_and_slowed_down(node: Node, users) -> None:
    raw = RawPop(node.port("pop3"), stls=True)
    timings = []
    for _ in range(4):
        raw.cmd(f"USER {users['bob']}")
        started = time.monotonic()
        assert raw.cmd("PASS wrong").startswith(b"-ERR [AUTH] Authentication failed")
        timings.append(time.monotonic() - started)
    assert timings[3] >= 1.0 > timings[0]  # 0.5 s after two failures, doubling: 1 s at the fourth
    raw.cmd(f"USER nobody@{users['bob'].split('@')[1]}")
    assert raw.cmd("PASS x").startswith(b"-ERR [AUTH] Authentication failed")  # unknown users look the same


def test_bad_input_gets_err_and_the_session_goes_on(node: Node, users) -> None:
    raw = RawPop(node.port("pop3"))
    assert raw.cmd("STAT").startswith(b"-ERR Not authenticated")
    assert raw.cmd("RETR 1").startswith(b"-ERR Not authenticated")
    assert raw.cmd("BOGUS").startswith(b"-ERR Unknown command")
    assert raw.cmd(b"\xff\xfe\x00 garbage").startswith(b"-ERR")
    assert raw.cmd("NOOP " + "x" * 5000).startswith(b"-ERR Line too long")
    assert raw.cmd("APOP anne 0123456789abcdef").startswith(b"-ERR APOP is not supported")
    assert raw.cmd("PASS x").startswith(b"-ERR")
    raw = RawPop(node.port("pop3"), stls=True)
    raw.cmd(f"USER {users['carol']}")
    assert raw.cmd("PASS carol").startswith(b"+OK")
    for bad in ("RETR", "RETR x", "RETR 0", "RETR 999", "TOP 1", "TOP 1 -2", "DELE", "LIST 7", "UIDL abc", "USER again"):
        reply = raw.cmd(bad)
        assert reply.startswith(b"-ERR") and b"Error" not in reply and b"Traceback" not in reply, (bad, reply)
    assert raw.cmd("NOOP").startswith(b"+OK")
    assert raw.cmd("QUIT").startswith(b"+OK")


@pytest.mark.slow
async def test_a_50_megabyte_message_is_streamed(node: Node, store: Store, users) -> None:
    body = b"Subject: big\r\n\r\n" + (os.urandom(38).hex().encode() + b"\r\n") * (50 * 1024 * 1024 // 78)
    await store.deliver(body, [Target(users["bob"])])
    raw = RawPop(node.port("pop3"), stls=True)
    raw.cmd(f"USER {users['bob']}")
    raw.cmd("PASS bob")
    assert raw.cmd("RETR 1") == b"+OK %d octets\r\n" % len(body)
    assert hashlib.sha256(raw.multiline()).digest() == hashlib.sha256(body).digest()


# ----------------------------------------------------------------------------- other nodes, other clients


async def test_mail_sent_by_smtp_on_one_node_is_fetched_by_pop3_on_another(
    node: Node, backend_settings, tmp_path, users
) -> None:
    other = Node(node_settings(backend_settings), tmp_path, pop3={"allow_plaintext_auth": True}).start()
    try:
        import smtplib

        with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
            await asyncio.to_thread(client.sendmail, "x@remote.test", [users["anne"]], b"Subject: across\r\n\r\nnode A to B\r\n")
        session = poplib.POP3("127.0.0.1", other.port("pop3"), timeout=30)
        session.user(users["anne"])
        session.pass_("anne")
        [*_, last] = session.list()[1]
        _, lines, _ = session.retr(int(last.split()[0]))
        assert strip_trace(body_of(lines))[1] == b"Subject: across\r\n\r\nnode A to B\r\n"
        session.quit()
    finally:
        assert other.stop() == 0


async def test_getmail6_fetches_200_messages_byte_exact(backend_settings, tmp_path: Path, store: Store, users) -> None:
    bodies = []
    for i in range(200):
        body = b"From: s%d@remote.test\r\nSubject: message %d\r\n\r\n" % (i, i)
        body += b"".join(b"line %d of %d %s\r\n" % (j, i, os.urandom(8).hex().encode()) for j in range(i % 7 + 1))
        body += b".leading dot line\r\n" if i % 5 == 0 else b""
        bodies.append(body)
        await store.deliver(body, [Target(users["carol"])])
    node = Node(node_settings(backend_settings), tmp_path, pop3={"allow_plaintext_auth": True}).start()
    try:
        received = tmp_path / "received"
        received.mkdir()
        rc = tmp_path / "getmailrc"
        rc.write_text(
            "[retriever]\ntype = SimplePOP3Retriever\nserver = 127.0.0.1\n"
            f"port = {node.port('pop3')}\nusername = {users['carol']}\npassword = carol\n\n"
            # one file per message, written by a shell: the bytes getmail hands to a delivery agent
            "[destination]\ntype = MDA_external\npath = /bin/sh\n"
            f"arguments = ('-c', 'cat > {received}/msg.$$$$')\nallow_root_commands = true\n\n"
            "[options]\nread_all = true\ndelete = true\ndelivered_to = false\nreceived = false\nverbose = 0\n"
        )
        result = await asyncio.to_thread(
            subprocess.run, ["getmail", f"--getmaildir={tmp_path}", f"--rcfile={rc}"],
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        assert node.stop() == 0
    prefix = b"Return-Path: <unknown>\n"  # getmail adds it to a message without one
    fetched = [p.read_bytes() for p in received.iterdir()]
    assert all(f.startswith(prefix) for f in fetched)
    fetched = sorted(f[len(prefix) :] for f in fetched)
    # and hands messages over with LF line ends: the only other change it makes
    assert fetched == sorted(b.replace(b"\r\n", b"\n") for b in bodies)
    assert await inbox(store, users["carol"]) == []  # delete = true: removed by QUIT


async def test_a_cassandra_that_times_out_gives_sys_temp_and_the_session_goes_on(request, tmp_path) -> None:
    import dataclasses
    import uuid

    from cassmail.server import make_store
    from tests.conftest import FAST_HASH, backend_settings_for, hash_password

    settings = node_settings(backend_settings_for("cassandra", request))
    store = make_store(settings)
    await store.open()
    domain = f"t{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    await store.create_user(f"anne@{domain}", hash_password("anne", FAST_HASH))
    await store.close()
    settings.store.cassandra = dataclasses.replace(settings.store.cassandra, request_timeout=0.000001)
    node = Node(settings, tmp_path, pop3={"allow_plaintext_auth": True}).start()
    try:
        raw = RawPop(node.port("pop3"))
        raw.cmd(f"USER anne@{domain}")
        assert raw.cmd("PASS anne").startswith(b"-ERR [SYS/TEMP] Mail store unavailable")
        assert raw.cmd("NOOP").startswith(b"+OK")
        assert raw.cmd("QUIT").startswith(b"+OK")
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log_text()


async def test_sigterm_lets_a_pop3_session_finish_its_quit(backend_settings, tmp_path, store: Store, users) -> None:
    await store.deliver(b"Subject: bye\r\n\r\nx\r\n", [Target(users["bob"])])
    node = Node(node_settings(backend_settings), tmp_path, pop3={"allow_plaintext_auth": True}).start()
    client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
    client.user(users["bob"])
    client.pass_("bob")
    client.dele(1)
    node.process.send_signal(15)  # SIGTERM while the session is open
    await asyncio.sleep(0.5)
    assert client.quit().startswith(b"+OK Bye, 1 message(s) removed")
    assert node.process.wait(30) == 0
    assert await inbox(store, users["bob"]) == []
