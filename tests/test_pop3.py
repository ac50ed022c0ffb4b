"""The POP3 front end as mail clients see it: a real `cassmail serve`, poplib and getmail6 over
real sockets, every backend in turn."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import json
import os
import poplib
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

import tests.nodes
from cassmail.model import uidl
from cassmail.store.base import Store, Target
from tests.nodes import CLIENT_TLS, Node, inbox, node_settings, strip_trace
from tests.outbound_peers import LmtpServer

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

    def close(self) -> None:
        self.file.close()  # the socket's file descriptor stays open while its file is
        self.sock.close()

    def login(self, user: str) -> None:
        assert self.cmd(f"USER {user}").startswith(b"+OK")
        assert self.cmd(f"PASS {user.split('@')[0]}").startswith(b"+OK")


@pytest.fixture(scope="module")
def second_node(backend_settings, tls_files, tmp_path_factory) -> Iterator[Node]:
    """Another `cassmail serve` on the same store: STLS offered, plaintext login allowed, no
    slow-down of failed logins, and a session closed after its second failed login."""
    running = Node(
        node_settings(backend_settings), tmp_path_factory.mktemp("pop3node"),
        pop3={**tls_files, "allow_plaintext_auth": True, "auth_failure_delay": 0.0, "max_auth_failures": 2},
    ).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text() and "Unhandled" not in running.log_text()


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


@pytest.mark.store_independent
def test_failed_logins_are_refused_and_slowed_down(node: Node, users) -> None:
    timings = []
    for attempt in range(4):
        if attempt % 2 == 0:  # two per session: the third failure of a session closes it
            raw = RawPop(node.port("pop3"), stls=True)
        raw.cmd(f"USER {users['bob']}")
        started = time.monotonic()
        assert raw.cmd("PASS wrong").startswith(b"-ERR [AUTH] Authentication failed")
        timings.append(time.monotonic() - started)
    assert timings[3] >= 1.0 > timings[0]  # 0.5 s after two failures, doubling: 1 s at the fourth
    raw = RawPop(node.port("pop3"), stls=True)  # counted per peer and user, not per session
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


async def test_mail_sent_by_smtp_on_one_node_is_fetched_by_pop3_on_another(node: Node, second_node: Node, users) -> None:
    import smtplib

    with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
        await asyncio.to_thread(client.sendmail, "x@remote.test", [users["anne"]], b"Subject: across\r\n\r\nnode A to B\r\n")
    session = poplib.POP3("127.0.0.1", second_node.port("pop3"), timeout=30)
    session.user(users["anne"])
    session.pass_("anne")
    [*_, last] = session.list()[1]
    _, lines, _ = session.retr(int(last.split()[0]))
    assert strip_trace(body_of(lines))[1] == b"Subject: across\r\n\r\nnode A to B\r\n"
    session.quit()


async def test_getmail6_fetches_200_messages_byte_exact(backend_settings, tmp_path: Path, store: Store, users) -> None:
    bodies = []
    for i in range(200):
        body = b"From: s%d@remote.test\r\nSubject: message %d\r\n\r\n" % (i, i)
        body += b"".join(b"line %d of %d %s\r\n" % (j, i, os.urandom(8).hex().encode()) for j in range(i % 7 + 1))
        body += b".leading dot line\r\n" if i % 5 == 0 else b""
        bodies.append(body)
        await store.deliver(body, [Target(users["carol"])])
    # getmail hands each message to a local LMTP server: its delivery agents that fork a child
    # (MDA_external, Maildir, Mboxrd) race the child's exit and sometimes wait 180 s for nothing
    lmtp = LmtpServer()
    lmtp.start()
    node = Node(node_settings(backend_settings), tmp_path, pop3={"allow_plaintext_auth": True}).start()
    try:
        rc = tmp_path / "getmailrc"
        rc.write_text(
            "[retriever]\ntype = SimplePOP3Retriever\nserver = 127.0.0.1\n"
            f"port = {node.port('pop3')}\nusername = {users['carol']}\npassword = carol\n\n"
            "[destination]\ntype = MDA_lmtp\nhost = 127.0.0.1\n"
            f"port = {lmtp.port}\noverride = {users['carol']}\n\n"
            "[options]\nread_all = true\ndelete = true\ndelivered_to = false\nreceived = false\nverbose = 0\n"
        )
        result = await asyncio.to_thread(
            subprocess.run, ["getmail", f"--getmaildir={tmp_path}", f"--rcfile={rc}"],
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        lmtp.stop()
        assert node.stop() == 0
    fetched = sorted(m.content for m in lmtp.mx.messages)
    assert fetched == sorted(bodies)
    assert await inbox(store, users["carol"]) == []  # delete = true: removed by QUIT


async def test_a_cassandra_that_times_out_gives_sys_temp_and_the_session_goes_on(request, tmp_path) -> None:
    import dataclasses
    import uuid

    from cassmail.store import make_store
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


# ----------------------------------------------------------------------------- STLS command injection


def test_commands_sent_behind_stls_in_the_same_packet_are_discarded(node: Node, users) -> None:
    """RFC 2595 3.1: what a man in the middle appends to the clear-text STLS line must not run
    as if it had come over TLS."""
    sock = socket.create_connection(("127.0.0.1", node.port("pop3")), timeout=30)
    assert sock.recv(1024).startswith(b"+OK")
    sock.sendall(f"STLS\r\nUSER {users['anne']}\r\nPASS anne\r\n".encode())
    plain = sock.makefile("rb")
    assert plain.readline().startswith(b"+OK Begin TLS")
    tls = CLIENT_TLS.wrap_socket(sock)
    replies = tls.makefile("rb")
    tls.sendall(b"STAT\r\n")
    assert replies.readline().startswith(b"-ERR Not authenticated")  # the first answer over TLS is STAT's
    tls.sendall(b"PASS anne\r\n")
    assert replies.readline().startswith(b"-ERR USER first")  # the injected USER was never seen
    tls.sendall(f"USER {users['anne']}\r\nPASS anne\r\nSTAT\r\nQUIT\r\n".encode())
    assert [replies.readline()[:3] for _ in range(4)] == [b"+OK"] * 4


def test_commands_queued_behind_a_login_and_stls_are_discarded(second_node: Node, users) -> None:
    """The same when STLS waits behind a login in progress (plaintext login allowed here)."""
    raw = RawPop(second_node.port("pop3"))
    raw.sock.sendall(f"USER {users['bob']}\r\nPASS wrong\r\nSTLS\r\nUSER {users['bob']}\r\nPASS bob\r\n".encode())
    assert raw.line().startswith(b"+OK")
    assert raw.line().startswith(b"-ERR [AUTH] Authentication failed")
    assert raw.line().startswith(b"+OK Begin TLS")
    tls = CLIENT_TLS.wrap_socket(raw.sock)
    replies = tls.makefile("rb")
    tls.sendall(b"STAT\r\n")
    assert replies.readline().startswith(b"-ERR Not authenticated")


# ----------------------------------------------------------------------------- pipelining


async def test_pipelined_commands_behind_long_ones_each_get_their_answer_in_order(node: Node, store: Store, users) -> None:
    bodies = [b"Subject: one\r\n\r\nfirst\r\n", b"Subject: two\r\n\r\nsecond\r\nmore\r\n"]
    for body in bodies:
        await store.deliver(body, [Target(users["anne"])])
    raw = RawPop(node.port("pop3"), stls=True)
    raw.sock.sendall(
        f"USER {users['anne']}\r\nPASS anne\r\nDELE 99\r\nRETR 1\r\nDELE 99\r\nNOOP\r\nBOGUS\r\nTOP 2 1\r\n"
        "RETR x\r\nLIST 2\r\nUSER again\r\nRETR 1\r\n\r\nDELE 2\r\nSTAT\r\n".encode()
    )
    assert raw.line().startswith(b"+OK Send PASS")
    assert raw.line().startswith(b"+OK")  # logged in
    assert raw.line() == b"-ERR No such message\r\n"  # replayed behind PASS
    assert raw.line() == b"+OK %d octets\r\n" % len(bodies[0]) and raw.multiline() == bodies[0]
    assert raw.line() == b"-ERR No such message\r\n"  # replayed behind RETR
    assert raw.line().startswith(b"+OK")
    assert raw.line() == b"-ERR Unknown command\r\n"
    assert raw.line().startswith(b"+OK") and raw.multiline() == b"Subject: two\r\n\r\nsecond\r\n"
    assert raw.line() == b"-ERR Bad message number\r\n"
    assert raw.line() == b"+OK 2 %d\r\n" % len(bodies[1])
    assert raw.line() == b"-ERR Already authenticated\r\n"
    assert raw.line().startswith(b"+OK") and raw.multiline() == bodies[0]
    assert raw.line() == b"-ERR Invalid command or arguments\r\n"  # the empty line
    assert raw.line() == b"+OK Message 2 deleted\r\n"
    assert raw.line() == b"+OK 1 %d\r\n" % len(bodies[0])
    assert raw.cmd("NOOP").startswith(b"+OK")  # and the session goes on
    assert raw.cmd("QUIT") == b"+OK Bye, 1 message(s) removed\r\n"
    assert await inbox(store, users["anne"]) == bodies[:1]
    log = node.log_text()
    assert "Unhandled" not in log and "Traceback" not in log


# ----------------------------------------------------------------------------- limits


def test_a_line_of_any_length_gets_err_and_the_session_goes_on(node: Node, users) -> None:
    raw = RawPop(node.port("pop3"))
    raw.sock.sendall(b"NOOP " + b"x" * (200 * 1024) + b"\r\nNOOP\r\n")
    assert raw.line() == b"-ERR Line too long\r\n"
    assert raw.line().startswith(b"+OK")
    for piece in (b"x" * 100_000, b"y" * 100_000 + b"\r", b"\nNOOP\r\n"):  # a line end split between packets
        raw.sock.sendall(piece)
        time.sleep(0.05)
    assert raw.line() == b"-ERR Line too long\r\n"
    assert raw.line().startswith(b"+OK")
    limit = 1024  # pop3.max_line_length's default: a line of exactly the limit is not too long
    for piece in (b"NOOP " + b"1" * (limit - 5) + b"\r", b"\n"):  # also with CR and LF in two packets
        raw.sock.sendall(piece)
        time.sleep(0.05)
    assert raw.line() != b"-ERR Line too long\r\n"
    raw = RawPop(node.port("pop3"), stls=True)
    raw.login(users["carol"])
    raw.sock.sendall(b"LIST\r\n" + b"z" * (300 * 1024) + b"\r\nSTAT\r\n")  # and in order among pipelined commands
    assert raw.line().startswith(b"+OK") and raw.multiline() == b""
    assert raw.line() == b"-ERR Line too long\r\n"
    assert raw.line() == b"+OK 0 0\r\n"
    assert raw.cmd("QUIT").startswith(b"+OK")


def _workers_rss(node: Node) -> int:
    """Resident bytes of the node's forked processes (its worker), from /proc."""
    assert node.process is not None
    pid = node.process.pid
    total = 0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        status = Path(f"/proc/{child}/status").read_text()
        total += int(re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M).group(1)) * 1024  # type: ignore[union-attr]
    return total


async def test_a_client_that_stops_reading_during_retr_backs_up_instead_of_growing_the_queue(
    second_node: Node, store: Store, users
) -> None:
    """RETR of 8 MB, not read, then 16 MB of pipelined commands: once max_pipelined_bytes (64 KiB)
    wait, the worker stops reading, so the client's send blocks after a few hundred KiB (kernel
    buffers) and the worker's memory does not grow by the 16 MB. Once the client reads, every
    command is answered, in order, none dropped."""
    big = b"Subject: big\r\n\r\n" + (b"x" * 76 + b"\r\n") * (8 * 1024 * 1024 // 78)
    small = b"Subject: small\r\n\r\nsmall\r\n"
    await store.deliver(big, [Target(users["carol"])])
    await store.deliver(small, [Target(users["carol"])])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # RETR cannot finish unread
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", second_node.port("pop3")))
    file = sock.makefile("rb")
    assert file.readline().startswith(b"+OK")
    # NOOP, STAT, LIST 2 and UIDL 1 with numbers padded to ~1000 bytes, and a line too long.
    cycle = [b"NOOP", b"STAT", b"LIST " + b"0" * 1000 + b"2", b"UIDL " + b"0" * 1000 + b"1", b"NOOP " + b"y" * 1500]
    sock.sendall(f"USER {users['carol']}\r\nPASS carol\r\n".encode() + b"".join(c + b"\r\n" for c in cycle))
    assert file.readline().startswith(b"+OK") and file.readline().startswith(b"+OK")
    answers = [file.readline() for _ in cycle]
    assert answers[2] == b"+OK 2 %d\r\n" % len(small) and answers[4] == b"-ERR Line too long\r\n"
    cycles = 16 * 1024 * 1024 // len(b"".join(c + b"\r\n" for c in cycle))
    flood = b"".join(c + b"\r\n" for c in cycle) * cycles + b"RETR 2\r\nQUIT\r\n"

    sock.sendall(b"RETR 1\r\n")
    await asyncio.sleep(1.5)  # the RETR fills the socket buffers and waits
    before = _workers_rss(second_node)
    sent = 0

    def send() -> None:
        nonlocal sent
        for start in range(0, len(flood), 64 * 1024):
            sock.sendall(flood[start : start + 64 * 1024])
            sent = start + len(flood[start : start + 64 * 1024])

    sender = asyncio.ensure_future(asyncio.to_thread(send))
    last, stalled_since = -1, time.monotonic()
    while time.monotonic() - stalled_since < 2.0:
        assert not sender.done(), f"all {len(flood)} bytes were read by the server, nothing backed up"
        if sent != last:
            last, stalled_since = sent, time.monotonic()
        await asyncio.sleep(0.1)
    assert sent < 4 * 1024 * 1024, sent  # the client's sends back up
    grown = _workers_rss(second_node) - before
    assert grown < 8 * 1024 * 1024, f"the worker grew by {grown} bytes"

    def read_all() -> bytes:
        chunks = []
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)

    received = await asyncio.to_thread(read_all)  # until the QUIT closes the connection
    await sender
    head = b"+OK %d octets\r\n" % len(big)
    assert received.startswith(head + big + b".\r\n")
    rest = received[len(head) + len(big) + 3 :]
    tail = b"+OK %d octets\r\n" % len(small) + small + b".\r\n+OK Bye, 0 message(s) removed\r\n"
    assert rest.endswith(tail)
    replies = rest[: -len(tail)]
    assert replies == b"".join(answers) * cycles  # every command answered, in order
    assert "Traceback" not in second_node.log_text()


def test_a_session_is_closed_after_max_auth_failures(second_node: Node, users) -> None:
    raw = RawPop(second_node.port("pop3"))
    token = base64.b64encode(f"\0{users['carol']}\0wrong".encode()).decode()
    raw.sock.sendall(f"USER {users['carol']}\r\nPASS wrong\r\nAUTH PLAIN {token}\r\nNOOP\r\n".encode())
    assert raw.line().startswith(b"+OK")
    assert raw.line() == b"-ERR [AUTH] Authentication failed\r\n"
    assert raw.line() == b"-ERR [AUTH] Authentication failed; too many failures, closing the connection\r\n"
    assert raw.closed()  # and the NOOP behind it got no answer
    raw = RawPop(second_node.port("pop3"))  # a new session starts counting afresh
    assert raw.cmd(f"USER {users['carol']}").startswith(b"+OK")
    assert raw.cmd("PASS wrong").startswith(b"-ERR [AUTH] Authentication failed\r\n")
    raw.login(users["carol"])
    assert raw.cmd("QUIT").startswith(b"+OK")


# ----------------------------------------------------------------------------- TOP


async def test_top_of_a_multi_megabyte_message(node: Node, store: Store, users) -> None:
    header = b"Subject: big\r\n" + b"".join(b"X-Filler-%d: %s\r\n" % (i, b"h" * 60) for i in range(2000)) + b"\r\n"
    lines = [b"line %07d %s\r\n" % (i, os.urandom(20).hex().encode()) for i in range(60_000)]
    body = header + b"".join(lines)
    assert len(header) > 128 * 1024 and len(body) > 3 * 1024 * 1024
    await store.deliver(body, [Target(users["bob"])])
    raw = RawPop(node.port("pop3"), stls=True)
    raw.login(users["bob"])
    assert raw.cmd("TOP 1 0").startswith(b"+OK") and raw.multiline() == header
    assert raw.cmd("TOP 1 3").startswith(b"+OK") and raw.multiline() == header + b"".join(lines[:3])
    assert raw.cmd("TOP 1 5000").startswith(b"+OK") and raw.multiline() == header + b"".join(lines[:5000])
    assert raw.cmd("RETR 1").startswith(b"+OK") and raw.multiline() == body


async def test_top_of_a_message_whose_header_section_is_empty(node: Node, store: Store, users) -> None:
    for body in (b"\r\nfirst\r\nsecond\r\n\r\nthird\r\n", b"\nfirst\nsecond\n\nthird\n"):
        await store.deliver(body, [Target(users["carol"])])
    raw = RawPop(node.port("pop3"), stls=True)
    raw.login(users["carol"])
    assert raw.cmd("TOP 1 0").startswith(b"+OK") and raw.multiline() == b"\r\n"
    assert raw.cmd("TOP 1 1").startswith(b"+OK") and raw.multiline() == b"\r\nfirst\r\n"
    assert raw.cmd("TOP 2 0").startswith(b"+OK") and raw.multiline() == b"\n"
    assert raw.cmd("TOP 2 2").startswith(b"+OK") and raw.multiline() == b"\nfirst\nsecond\n"


# ----------------------------------------------------------------------------- TLS and connections


@pytest.mark.store_independent
def test_implicit_tls(backend_settings, tls_files, tmp_path: Path, users) -> None:
    node = Node(node_settings(backend_settings), tmp_path, pop3={**tls_files, "implicit_tls": True}).start()
    try:
        client = poplib.POP3_SSL("127.0.0.1", node.port("pop3"), context=CLIENT_TLS, timeout=30)
        assert client.getwelcome().startswith(b"+OK")
        caps = client.capa()
        assert "USER" in caps and caps["SASL"] == ["PLAIN"] and "STLS" not in caps  # already secure
        client.user(users["carol"])
        assert client.pass_("carol").startswith(b"+OK")
        assert client.stat() == (0, 0)
        assert client.quit().startswith(b"+OK")
        with socket.create_connection(("127.0.0.1", node.port("pop3")), timeout=30) as plain:
            plain.sendall(b"CAPA\r\n")  # clear text on a TLS port is a failed handshake, never a greeting
            try:
                answer = plain.recv(1024)
            except ConnectionError:
                answer = b""
            assert not answer.startswith(b"+OK")
    finally:
        assert node.stop() == 0
    assert "event=session listener=pop3" in node.log_text() and "tls=True" in node.log_text()


@pytest.mark.store_independent
def test_connections_past_max_connections_are_turned_away(backend_settings, tls_files, tmp_path: Path, users) -> None:
    node = Node(node_settings(backend_settings), tmp_path, pop3={**tls_files, "max_connections": 2}).start()
    try:
        first, second = RawPop(node.port("pop3")), RawPop(node.port("pop3"), stls=True)
        assert first.greeting.startswith(b"+OK") and second.greeting.startswith(b"+OK")
        third = RawPop(node.port("pop3"))
        assert third.greeting == b"-ERR [SYS/TEMP] Too many connections, try again later\r\n" and third.closed()
        second.login(users["anne"])  # the ones let in are served
        assert second.cmd("STAT").startswith(b"+OK")
        assert first.cmd("QUIT").startswith(b"+OK") and first.closed()
        deadline = time.monotonic() + 10
        while True:  # the freed place is taken again (once the server has seen the close)
            fourth = RawPop(node.port("pop3"))
            if fourth.greeting.startswith(b"+OK") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert fourth.greeting.startswith(b"+OK")
        for client in (second, fourth):  # a session left open would hold the node's stop for its grace period
            client.close()
    finally:
        assert node.stop() == 0


# ----------------------------------------------------------------------------- two nodes, one mailbox


async def test_sessions_on_two_nodes_each_keep_their_own_view(node: Node, second_node: Node, store: Store, users) -> None:
    bodies = [b"Subject: one\r\n\r\nfirst\r\n", b"Subject: two\r\n\r\nsecond\r\n"]
    for body in bodies:
        await store.deliver(body, [Target(users["anne"])])
    a = pop(node, users["anne"])
    b = poplib.POP3("127.0.0.1", second_node.port("pop3"), timeout=30)
    b.user(users["anne"])
    b.pass_("anne")
    view = (2, sum(map(len, bodies)))
    assert a.stat() == b.stat() == view
    uidls = b.uidl()[1]
    assert a.uidl()[1] == uidls
    a.dele(1)
    assert a.quit() == b"+OK Bye, 1 message(s) removed"
    await store.deliver(b"Subject: three\r\n\r\nthird\r\n", [Target(users["anne"])])
    assert b.stat() == view and b.uidl()[1] == uidls  # numbers and sizes as at its login
    with pytest.raises(poplib.error_proto, match="-ERR Message was deleted by another session"):
        b.retr(1)
    with pytest.raises(poplib.error_proto, match="-ERR Message was deleted by another session"):
        b.top(1, 0)
    assert body_of(b.retr(2)[1]) == bodies[1]
    assert b.dele(1).startswith(b"+OK")  # deleting it again is harmless
    assert b.quit().startswith(b"+OK Bye")
    assert await inbox(store, users["anne"]) == [bodies[1], b"Subject: three\r\n\r\nthird\r\n"]


# ----------------------------------------------------------------------------- the store's side (a wrapped store)


class RecordingStore:
    """Wraps the real store inside a node's worker process, for fault injection and accounting:
    every `read_chunks` call is journalled with its byte range (`reads.jsonl`), and a method named
    in `faults.json` raises RuntimeError with the given text, as a bug in a backend would."""

    def __init__(self, inner: Store, directory: Path) -> None:
        self.inner = inner
        self.reads, self.faults = directory / "reads.jsonl", directory / "faults.json"

    def _fault(self, name: str) -> None:
        try:
            faults = json.loads(self.faults.read_text())
        except FileNotFoundError:
            return
        if name in faults:
            raise RuntimeError(faults[name])

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if inspect.isasyncgenfunction(attr):

            async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                self._fault(name)
                if name == "read_chunks":
                    call = inspect.signature(attr).bind(*args, **kwargs)
                    call.apply_defaults()
                    entry = {"id": str(call.arguments["message_id"]), "start": call.arguments["start"],
                             "end": call.arguments["end"]}
                    with open(self.reads, "a") as journal:
                        journal.write(json.dumps(entry) + "\n")
                async with aclosing(attr(*args, **kwargs)) as items:
                    async for item in items:
                        yield item

            return stream
        if inspect.iscoroutinefunction(attr):

            async def call(*args: Any, **kwargs: Any) -> Any:
                self._fault(name)
                return await attr(*args, **kwargs)

            return call
        return attr


def wrap_the_store(directory: str) -> None:
    """In a node's own process, before `cassmail serve` starts: its store becomes a RecordingStore."""
    from cassmail import store

    make_store = store.make_store
    store.make_store = lambda settings, **options: RecordingStore(make_store(settings, **options), Path(directory))  # type: ignore[assignment,return-value]


class Recorder:
    """The test's side of a RecordingStore: the journal of reads, and the faults to inject."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def fail(self, **faults: str) -> None:
        staged = self.directory / "faults.tmp"
        staged.write_text(json.dumps(faults))
        staged.rename(self.directory / "faults.json")  # the node never sees half a file

    def reads(self, message_id: Any) -> list[tuple[int, int | None]]:
        path = self.directory / "reads.jsonl"
        entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [(e["start"], e["end"]) for e in entries if e["id"] == str(message_id)]


@pytest.fixture(scope="module")
def recorded(backend_settings, tmp_path_factory) -> Iterator[tuple[Node, Recorder]]:
    """A real `cassmail serve` whose store is a RecordingStore; plaintext login allowed."""
    directory = tmp_path_factory.mktemp("recorded")
    shim = directory / "cassmail-recorded"
    shim.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        f"from tests.test_pop3 import wrap_the_store\nwrap_the_store({str(directory)!r})\n"
        "from cassmail.cli import main\nsys.exit(main())\n"
    )
    shim.chmod(0o755)
    running = Node(node_settings(backend_settings), directory, pop3={"allow_plaintext_auth": True, "auth_failure_delay": 0.0})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tests.nodes, "CASSMAIL", str(shim))
        running.start()
    yield running, Recorder(directory)
    assert running.stop() == 0
    assert "Unhandled" not in running.log_text()


async def test_top_asks_the_store_only_for_the_bytes_it_needs(recorded, store: Store, users) -> None:
    node, recorder = recorded
    head = b"Subject: big\r\n\r\n"
    lines = [b"%07d %s\r\n" % (i, os.urandom(35).hex().encode()) for i in range(50_000)]
    small_head = head + b"".join(lines)
    big_head = b"Subject: wide\r\n" + b"X-Filler: %s\r\n" % (b"h" * 100) * 1000 + b"\r\n" + b"".join(lines)
    [small_id] = await store.deliver(small_head, [Target(users["bob"])])
    [big_id] = await store.deliver(big_head, [Target(users["bob"])])
    assert len(small_head) > 3 * 1024 * 1024
    raw = RawPop(node.port("pop3"))
    raw.login(users["bob"])
    assert raw.cmd("TOP 1 0").startswith(b"+OK") and raw.multiline() == head
    assert raw.cmd("TOP 1 3").startswith(b"+OK") and raw.multiline() == head + b"".join(lines[:3])
    assert recorder.reads(small_id) == [(0, 64 * 1024)] * 2  # 64 KiB of a 4 MB message, each time
    # 110 KB of headers: the first 64 KiB has not got them all, the next range is four times larger
    separator = big_head.index(b"\r\n\r\n") + 4
    assert raw.cmd("TOP 2 2").startswith(b"+OK") and raw.multiline() == big_head[:separator] + b"".join(lines[:2])
    assert recorder.reads(big_id) == [(0, 64 * 1024), (64 * 1024, 320 * 1024)]
    assert raw.cmd("RETR 1").startswith(b"+OK") and raw.multiline() == small_head  # RETR streams it all at once
    assert recorder.reads(small_id)[2:] == [(0, None)]


async def test_a_bug_in_the_store_answers_err_and_the_session_goes_on(recorded, store: Store, users) -> None:
    node, recorder = recorded
    body = b"Subject: x\r\n\r\nx\r\n"
    await store.deliver(body, [Target(users["carol"])])
    raw = RawPop(node.port("pop3"))
    try:
        recorder.fail(get_password_hash="injected bug in login")
        assert raw.cmd(f"USER {users['carol']}").startswith(b"+OK")
        assert raw.cmd("PASS carol") == b"-ERR [SYS/TEMP] Internal error, try again later\r\n"
        assert raw.cmd("NOOP").startswith(b"+OK")
        recorder.fail(read_chunks="injected bug in reading")
        raw.login(users["carol"])
        raw.sock.sendall(b"RETR 1\r\nTOP 1 0\r\nSTAT\r\n")
        assert raw.line() == b"-ERR [SYS/TEMP] Internal error, try again later\r\n"
        assert raw.line() == b"-ERR [SYS/TEMP] Internal error, try again later\r\n"
        assert raw.line() == b"+OK 1 %d\r\n" % len(body)
        recorder.fail(delete_messages="injected bug in deleting")
        assert raw.cmd("RETR 1").startswith(b"+OK") and raw.multiline() == body
        assert raw.cmd("DELE 1").startswith(b"+OK")
        assert raw.cmd("QUIT") == b"-ERR [SYS/TEMP] Marked messages were not removed, try again later\r\n"
        assert raw.closed()
    finally:
        recorder.fail()
    assert await inbox(store, users["carol"]) == [body]
    log = node.log_text()
    for what in ("login", "reading", "deleting"):
        assert f"injected bug in {what}" in log
    assert "Unhandled" not in log
