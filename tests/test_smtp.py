"""The SMTP front end as mail clients and MTAs see it: a real `cassmail serve`, real sockets,
smtplib and swaks; every backend in turn."""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import random
import re
import smtplib
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from cassmail.config import Settings
from cassmail.model import INBOX
from cassmail.smtp.handler import advertised_size
from cassmail.store.base import MessageTooLarge, Store, StoreUnavailable
from tests.conftest import FAST_HASH, hash_password
from tests.nodes import CASSMAIL, CLIENT_TLS, MAX_SIZE, Node, inbox, node_settings, server_end_quickack, strip_trace

pytestmark = pytest.mark.cassandra

def smtp(node: Node, listener: str = "smtp") -> smtplib.SMTP:
    return smtplib.SMTP("127.0.0.1", node.port(listener), timeout=30)


class Raw:
    """A line-level SMTP client for what smtplib will not send."""

    def __init__(self, port: int, source: str | None = None) -> None:
        """`source`: the client's own address (another 127.x.y.z is another peer to the server)."""
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=30, source_address=(source, 0) if source else None
        )
        self.file = self.sock.makefile("rb")
        self.greeting = self.reply()

    def reply(self) -> str:
        lines = []
        while True:
            line = self.file.readline().decode("utf-8", "replace")
            assert line, "connection closed"
            lines.append(line.rstrip("\r\n"))
            if line[3:4] != "-":
                return "\n".join(lines)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def cmd(self, line: str | bytes) -> str:
        self.send((line.encode() if isinstance(line, str) else line) + b"\r\n")
        return self.reply()

    def starttls(self) -> None:
        """Switch to TLS after a 220 to STARTTLS (the reply was read by the caller)."""
        self.sock = CLIENT_TLS.wrap_socket(self.sock)
        self.file = self.sock.makefile("rb")

    def closed(self) -> bool:
        return self.file.readline() == b""

    def close(self) -> None:
        self.file.close()  # the socket's file descriptor stays open while its file is
        self.sock.close()


def wait_for_log(node: Node, pattern: str, timeout: float = 15) -> re.Match[str]:
    """The first line of the node's log matching `pattern`, waiting for it to be written."""
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(pattern, node.log_text(), re.M)
        if match or time.monotonic() > deadline:
            assert match, f"no log line matches {pattern!r}:\n{node.log_text()[-3000:]}"
            return match
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tight(backend_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node with settings other than the defaults: MX with max_command_length 2000 and
    max_commands 10; LMTP with an idle timeout of 2 s."""
    running = Node(
        node_settings(backend_settings),
        tmp_path_factory.mktemp("tight"),
        smtp={"max_command_length": 2000, "max_commands": 10},
        submission={"enabled": False},
        lmtp={"enabled": True, "timeout": 2.0},
        pop3={"enabled": False},
        imap={"enabled": False},
    ).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text()


@pytest.fixture(scope="module")
def rated(backend_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node with low rates and no exempt networks: MX with max_command_rate 10 a minute, LMTP
    with max_connection_rate 10 a minute; submission with both at 10 but loopback exempt, the
    default. (Node.start's probes connect from 127.0.0.1, so connection-rate tests use other
    127.x addresses, each a peer of its own.)"""
    running = Node(
        node_settings(backend_settings),
        tmp_path_factory.mktemp("rated"),
        smtp={"max_command_rate": 10, "rate_limit_exempt": []},
        submission={"max_command_rate": 10, "max_connection_rate": 1, "allow_plaintext_auth": True},
        lmtp={"enabled": True, "max_connection_rate": 10, "max_command_rate": 0, "rate_limit_exempt": []},
        pop3={"enabled": False},
        imap={"enabled": False},
    ).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text()


# ----------------------------------------------------------------------------- MX receive


def test_ehlo_advertises_what_works_and_no_auth_on_the_mx(node: Node) -> None:
    with smtp(node) as client:
        code, _ = client.ehlo("client.test")
        assert code == 250
        features = client.esmtp_features
        for keyword in ("pipelining", "8bitmime", "smtputf8", "enhancedstatuscodes", "starttls"):
            assert keyword in features, keyword
        assert features["size"] == str(advertised_size(MAX_SIZE))
        assert "auth" not in features


async def test_mail_to_local_users_is_stored_byte_exact_in_one_delivery(node: Node, store: Store, users) -> None:
    body = b"From: x@remote.test\r\nSubject: hello\r\n\r\nHello Anne and Bob.\r\n"
    with smtp(node) as client:
        refused = await asyncio.to_thread(client.sendmail, "x@remote.test", [users["anne"], users["bob"].upper()], body)
    assert refused == {}
    [anne] = await inbox(store, users["anne"])
    [bob] = await inbox(store, users["bob"])
    trace, original = strip_trace(anne)
    assert original == body and bob == anne  # one delivery, one body for both
    assert trace.startswith(b"Return-Path: <x@remote.test>\r\nReceived: from ")
    assert b"by mx.test (cassmail) with ESMTP id " in trace


async def test_dot_stuffing_bare_lf_8bit_and_long_lines_arrive_exactly(node: Node, store: Store, users) -> None:
    sent = (
        b"Subject: \xe2\x9c\x93 raw\r\n\r\n.leading dot\r\n..two dots\r\nbare\nLF\nlines\r\n"
        + b"\x00\x01\xfe\xff 8-bit\r\n" + b"L" * 20_000 + b"\r\n.\n\r\nend"
    )
    stuffed = sent.replace(b"\r\n.", b"\r\n..")
    raw = Raw(node.port("smtp"))
    assert raw.cmd("EHLO client.test").startswith("250")
    assert raw.cmd("MAIL FROM:<x@remote.test> BODY=8BITMIME").startswith("250 2.1.0")
    assert raw.cmd(f"RCPT TO:<{users['anne']}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd(stuffed + b"\r\n.").startswith("250 2.0.0")
    assert raw.cmd("QUIT").startswith("221")
    [stored] = await inbox(store, users["anne"])
    assert strip_trace(stored)[1] == sent + b"\r\n"


async def test_a_message_past_spool_above_arrives_exactly_in_every_copy(node: Node, store: Store, users) -> None:
    """DATA past smtp.spool_above (1 MiB) goes through a spool file: dot-stuffing is undone there
    in place (dotted lines fall on every side of the reader's 256 KiB blocks), the trace goes in
    the room in front of it, and both recipients get the message as sent."""
    rng = random.Random(5)
    lines = [rng.choice([b"", b".", b"..", b"x"]) + b"a" * rng.randrange(0, 120) for _ in range(40_000)]
    sent = b"Subject: spooled\r\n\r\n" + b"\r\n".join(lines) + b"\r\n"
    assert len(sent) > 2 << 20
    raw = Raw(node.port("smtp"))
    assert raw.cmd("EHLO client.test").startswith("250")
    assert raw.cmd("MAIL FROM:<x@remote.test>").startswith("250 2.1.0")
    for who in ("anne", "bob"):
        assert raw.cmd(f"RCPT TO:<{users[who]}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd((b"\r\n" + sent).replace(b"\r\n.", b"\r\n..")[2:] + b".").startswith("250 2.0.0")
    assert raw.cmd("QUIT").startswith("221")
    for who in ("anne", "bob"):
        *_, stored = await inbox(store, users[who])
        trace, original = strip_trace(stored)
        assert original == sent and trace.startswith(b"Return-Path: <x@remote.test>\r\n")


async def test_an_empty_message_and_a_first_line_dot_are_kept(node: Node, store: Store, users) -> None:
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    for payload in (b".", b"..first\r\n."):
        raw.cmd("MAIL FROM:<>")
        raw.cmd(f"RCPT TO:<{users['carol']}>")
        raw.cmd("DATA")
        assert raw.cmd(payload).startswith("250")
    stored = await inbox(store, users["carol"])
    assert [strip_trace(m)[1] for m in stored] == [b"", b".first\r\n"]
    assert strip_trace(stored[0])[0].startswith(b"Return-Path: <>\r\n")


def test_refusals_have_precise_codes_and_the_session_goes_on(node: Node, users) -> None:
    raw = Raw(node.port("smtp"))
    assert raw.greeting.startswith("220 mx.test ")  # the greeting has no enhanced code (RFC 2034)
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("503 5.5.1 ")  # before EHLO
    ehlo = raw.cmd("EHLO client.test").splitlines()
    assert ehlo[0] == "250-mx.test" and ehlo[-1] == "250 HELP"  # nor have EHLO's lines
    assert raw.cmd(f"RCPT TO:<{users['anne']}>").startswith("503 5.5.1 ")  # before MAIL
    assert raw.cmd("DATA").startswith("503 5.5.1 ")
    assert raw.cmd("MAIL FROM:<not an address>").startswith("553 5.1.7")
    assert raw.cmd("MAIL FROM:").startswith("501 5.5.4 Syntax: MAIL FROM: <address>")
    assert raw.cmd("MAIL TO:<a@b.test>").startswith("501 5.5.4 ")
    assert raw.cmd("MAIL FROM:<a@b.test> BODY=9BIT").startswith("501 5.5.4 ")
    assert raw.cmd("MAIL FROM:<a@b.test> SIZE=big").startswith("501 5.5.4 ")
    assert raw.cmd("MAIL FROM:<a@b.test> SMTPUTF8=yes").startswith("501 5.5.4 ")
    assert raw.cmd("MAIL FROM:<a@b.test> XOTHER=1").startswith("555 5.5.4 ")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("250 2.1.0")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("503 5.5.1 Error: nested MAIL command")
    domain = users["anne"].split("@")[1]
    assert raw.cmd(f"RCPT TO:<nobody@{domain}>").startswith("550 5.1.1")
    assert raw.cmd("RCPT TO:<someone@elsewhere.test>").startswith("550 5.7.1 Relaying denied")
    assert raw.cmd(f"RCPT TO:<a..b@{domain}>").startswith("501 5.1.3")
    assert raw.cmd(f"RCPT TO:<@{domain}>").startswith("553 5.1.3")
    assert raw.cmd("RCPT TO:<用户@" + domain + ">").startswith("553 5.6.7")  # needs SMTPUTF8
    assert raw.cmd("RCPT TO:").startswith("501 5.5.4 ")
    assert raw.cmd(f"RCPT TO:<{users['anne']}> NOTIFY=NEVER").startswith("555 5.5.4 ")
    assert raw.cmd("VRFY anne").startswith("252 2.5.2")
    assert raw.cmd("VRFY").startswith("501 5.5.4 ")
    assert raw.cmd("VRFY <<>").startswith("502 5.1.3 ")
    assert raw.cmd("EXPN staff").startswith("502 5.5.1 ")
    assert raw.cmd("HELP").startswith("250 2.0.0 Supported commands:")
    assert raw.cmd("HELP BOGUS").startswith("501 5.5.4 ")
    assert raw.cmd("AUTH PLAIN").startswith("538 5.7.11 ")  # no AUTH on the MX, least of all in clear text
    assert raw.cmd("STARTTLS now").startswith("501 5.5.4 ")
    assert raw.cmd("BOGUS").startswith("500 5.5.1 ")
    assert raw.cmd(b"\xff\xfe garbage").startswith("500 5.5.2 ")
    assert raw.cmd(b"").startswith("500 5.5.2 ")
    assert raw.cmd("NOOP " + "x" * 2000).startswith("500 5.5.2 ")  # command line too long
    assert raw.cmd("RSET now").startswith("501 5.5.4 ")
    assert raw.cmd("RSET").startswith("250 2.0.0")
    assert raw.cmd(f"MAIL FROM:<a@b.test> SIZE={advertised_size(MAX_SIZE) + 1}") == (
        "552 5.3.4 Error: message size exceeds fixed maximum message size"
    )
    assert raw.cmd(f"MAIL FROM:<a@b.test> SIZE={advertised_size(MAX_SIZE)}").startswith("250 2.1.0")
    assert raw.cmd("NOOP").startswith("250 2.0.0")
    assert raw.cmd("QUIT now").startswith("501 5.5.4 ")
    assert raw.cmd("HELO").startswith("501 5.5.4 ")
    assert raw.cmd("HELO client.test") == "250 mx.test"  # nor has HELO's
    assert raw.cmd("NOOP").startswith("250 2.0.0")
    assert raw.cmd("QUIT").startswith("221 2.0.0")


def test_five_unknown_commands_close_the_session(node: Node) -> None:
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    for n in range(4):
        assert raw.cmd(f"XCMD{n}") == f'500 5.5.1 Error: command "XCMD{n}" not recognized'
    assert raw.cmd("XCMD4") == "502 5.5.1 Too many unrecognized commands, goodbye."
    assert raw.closed()


def test_data_with_an_argument_is_501_5_5_4(node: Node, users) -> None:
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    raw.cmd("MAIL FROM:<a@b.test>")
    raw.cmd(f"RCPT TO:<{users['anne']}>")
    assert raw.cmd("DATA now") == "501 5.5.4 Syntax: DATA"
    assert raw.cmd("DATA").startswith("354 ")
    assert raw.cmd(b"Subject: x\r\n\r\nx\r\n.").startswith("250 2.0.0")


def test_the_command_length_limit_holds_after_ehlo_and_helo(node: Node, users) -> None:
    """max_command_length (512 here) bounds every line, CRLF not counted; after EHLO a MAIL
    line may be 36 bytes longer (SIZE and SMTPUTF8). Repeating EHLO does not stretch it."""

    def mail(length: int) -> str:
        line = "MAIL FROM:<a@b.test> SIZE="
        return line + "0" * (length - len(line) - 1) + "1"

    def noop(length: int) -> str:
        return "NOOP " + "x" * (length - 5)

    raw = Raw(node.port("smtp"))
    for _ in range(6):
        assert raw.cmd("EHLO client.test").startswith("250-")
    assert raw.cmd(noop(513)) == "500 5.5.2 Command line too long"
    assert raw.cmd(noop(512)) == "250 2.0.0 OK"
    assert raw.cmd(mail(549)) == "500 5.5.2 Command line too long"
    assert raw.cmd(f"RCPT TO:<{users['anne']}> " + "x" * 500) == "500 5.5.2 Command line too long"
    assert raw.cmd(mail(548)).startswith("250 2.1.0")
    assert raw.cmd("RSET").startswith("250")
    assert raw.cmd("HELO client.test") == "250 mx.test"
    assert raw.cmd(mail(513)) == "500 5.5.2 Command line too long"  # no extensions after HELO
    assert raw.cmd(noop(513)) == "500 5.5.2 Command line too long"
    assert raw.cmd(noop(512)) == "250 2.0.0 OK"
    assert raw.cmd("QUIT").startswith("221")


def test_a_longer_command_length_setting_is_applied(tight: Node) -> None:
    raw = Raw(tight.port("smtp"))
    raw.cmd("EHLO client.test")
    assert raw.cmd("NOOP " + "x" * 1500) == "250 2.0.0 OK"  # past aiosmtpd's own 1001-byte reader
    assert raw.cmd("NOOP " + "x" * 1995) == "250 2.0.0 OK"
    assert raw.cmd("NOOP " + "x" * 1996) == "500 5.5.2 Command line too long"
    assert raw.cmd("MAIL FROM:<a@b.test> SIZE=" + "0" * 2009 + "1").startswith("250 2.1.0")  # 2036
    raw.cmd("RSET")
    assert raw.cmd("MAIL FROM:<a@b.test> SIZE=" + "0" * 2010 + "1") == "500 5.5.2 Command line too long"
    assert raw.cmd("NOOP " + "x" * 100_000) == "500 5.5.2 Command line too long"  # drained, not read
    assert raw.cmd("HELO client.test") == "250 mx.test"
    assert raw.cmd("NOOP " + "x" * 1995) == "250 2.0.0 OK"
    assert raw.cmd("NOOP " + "x" * 1996) == "500 5.5.2 Command line too long"


def test_a_command_sent_more_than_max_commands_times_closes_with_421(tight: Node) -> None:
    raw = Raw(tight.port("smtp"))
    helo = f"max-commands-{uuid.uuid4().hex[:8]}.test"
    raw.cmd(f"EHLO {helo}")
    for _ in range(10):
        assert raw.cmd("NOOP") == "250 2.0.0 OK"
    assert raw.cmd("NOOP") == "421 4.7.0 NOOP sent too many times"
    assert raw.closed()
    wait_for_log(tight, rf"event=session listener=smtp peer=127\.0\.0\.1 helo={helo} .*result=limit ")


@pytest.mark.store_independent
def test_an_idle_session_is_closed_with_421_but_a_slow_message_is_not(tight: Node, users) -> None:
    raw = Raw(tight.port("lmtp"))  # this listener's timeout is 2 s
    raw.cmd("LHLO mta.test")
    raw.cmd("MAIL FROM:<a@b.test>")
    raw.cmd(f"RCPT TO:<{users['anne']}>")
    assert raw.cmd("DATA").startswith("354")
    for _ in range(8):  # 4 s of DATA, a block every 0.5 s: never idle for 2 s
        raw.send(b"x" * 100 + b"\r\n")
        time.sleep(0.5)
    assert raw.cmd(b".").startswith("250 2.0.0")
    started = time.monotonic()
    assert raw.reply() == "421 4.4.2 mx.test Error: timeout exceeded"
    assert 1.5 < time.monotonic() - started < 10
    assert raw.closed()
    wait_for_log(tight, r"event=session listener=lmtp peer=127\.0\.0\.1 helo=mta\.test .*deliveries=1 result=timeout ")


async def test_a_session_within_the_command_rate_delivers_and_data_lines_are_not_commands(
    rated: Node, store: Store, users
) -> None:
    """Ten commands a minute: a transaction whose DATA has 20,000 lines uses 4 of them, six more
    pass, the eleventh is 421 4.7.0 and the session is closed. (The bucket refills one command
    every 6 s; the test takes well under that.)"""
    body = b"Subject: many lines\r\n\r\n" + b"".join(b"NOOP line %d\r\n" % n for n in range(20_000))
    helo = f"rated-{uuid.uuid4().hex[:8]}.test"
    raw = Raw(rated.port("smtp"))
    assert raw.cmd(f"EHLO {helo}").startswith("250-")
    assert raw.cmd("MAIL FROM:<x@remote.test>").startswith("250 2.1.0")
    assert raw.cmd(f"RCPT TO:<{users['anne']}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd(body + b".").startswith("250 2.0.0")
    for _ in range(6):
        assert raw.cmd("NOOP") == "250 2.0.0 OK"
    assert raw.cmd("NOOP") == "421 4.7.0 Too many commands, slow down"
    assert raw.closed()
    [stored] = await inbox(store, users["anne"])
    assert strip_trace(stored)[1] == body
    wait_for_log(rated, rf"event=session listener=smtp peer=127\.0\.0\.1 helo={helo} .*deliveries=1 result=limit ")
    assert "event=command-rate listener=smtp peer=127.0.0.1 limit=10" in rated.log_text()


def test_pipelined_commands_past_the_command_rate_get_nothing_after_the_421(rated: Node) -> None:
    raw = Raw(rated.port("smtp"))
    raw.send(b"EHLO client.test\r\n" + b"NOOP\r\n" * 20)
    assert raw.reply().startswith("250-")
    for _ in range(9):
        assert raw.reply() == "250 2.0.0 OK"
    assert raw.reply() == "421 4.7.0 Too many commands, slow down"
    assert raw.closed()  # the ten NOOPs behind it are never answered


def test_over_long_lines_and_unknown_commands_count_against_the_command_rate(rated: Node) -> None:
    raw = Raw(rated.port("smtp"))
    assert raw.cmd("EHLO client.test").startswith("250-")
    for _ in range(3):
        assert raw.cmd("NOOP " + "x" * 5000) == "500 5.5.2 Command line too long"
        assert raw.cmd("") == "500 5.5.2 Error: bad syntax"
    assert raw.cmd("XFOO") == '500 5.5.1 Error: command "XFOO" not recognized'
    assert raw.cmd("XFOO") == '500 5.5.1 Error: command "XFOO" not recognized'
    assert raw.cmd("NOOP") == "250 2.0.0 OK"  # the tenth line; an over-long one counted once
    assert raw.cmd("NOOP") == "421 4.7.0 Too many commands, slow down"
    assert raw.closed()


@pytest.mark.store_independent
def test_a_peer_over_the_connection_rate_is_turned_away_before_the_greeting(rated: Node) -> None:
    """Ten connections a minute per address (LMTP here): the eleventh from 127.0.0.2 gets 421 4.7.0
    instead of the greeting, another address is still served, and the bucket refills (one
    connection every 6 s)."""
    port = rated.port("lmtp")
    first = [Raw(port, source="127.0.0.2") for _ in range(10)]
    assert all(raw.greeting.startswith("220 ") for raw in first)
    for raw in first:
        raw.close()
    refused = Raw(port, source="127.0.0.2")
    assert refused.greeting == "421 4.7.0 Too many connections from your address, try again later"
    assert refused.closed()
    other = Raw(port, source="127.0.0.3")
    assert other.greeting.startswith("220 ") and other.cmd("LHLO mta.test").startswith("250")
    wait_for_log(rated, r"event=session listener=lmtp peer=127\.0\.0\.2 .*result=throttled ")
    time.sleep(6.5)
    again = Raw(port, source="127.0.0.2")
    assert again.greeting.startswith("220 ") and again.cmd("LHLO mta.test").startswith("250")
    assert again.cmd("QUIT").startswith("221")


def test_exempt_networks_are_not_rate_limited(rated: Node) -> None:
    """Submission of `rated` has both rates low, but 127.0.0.0/8 is exempt by default."""
    clients = [Raw(rated.port("submission")) for _ in range(5)]
    assert all(raw.greeting.startswith("220 ") for raw in clients)
    raw = clients[0]
    assert raw.cmd("EHLO client.test").startswith("250-")
    for _ in range(30):
        assert raw.cmd("NOOP") == "250 2.0.0 OK"
    assert raw.cmd("QUIT").startswith("221")
    for other in clients:
        other.close()


def test_recipients_past_the_limit_get_452(node: Node, users) -> None:
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    raw.cmd("MAIL FROM:<a@b.test>")
    replies = [raw.cmd(f"RCPT TO:<{users['anne']}>") for _ in range(6)]
    assert all(r.startswith("250") for r in replies[:5])
    assert replies[5].startswith("452 4.5.3")


async def test_internationalised_addresses_with_smtputf8(node: Node, store: Store, domain: str) -> None:
    user = f"jürgen@{domain}"
    await store.create_user(user, hash_password("pw", FAST_HASH))
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    assert raw.cmd("MAIL FROM:<用户@例子.test> SMTPUTF8".encode()).startswith("250")
    assert raw.cmd(f"RCPT TO:<{user}>".encode()).startswith("250")
    raw.cmd("DATA")
    assert raw.cmd("Subject: ünïcödé\r\n\r\nhi\r\n.".encode()).startswith("250")
    [stored] = await inbox(store, user)
    trace, original = strip_trace(stored)
    assert "Return-Path: <用户@例子.test>".encode() in trace and b"with UTF8SMTPS" not in trace
    assert b" with UTF8SMTP id " in trace
    assert original == "Subject: ünïcödé\r\n\r\nhi\r\n".encode()


def test_an_oversize_message_is_refused_with_552_5_3_4(node: Node, users) -> None:
    raw = Raw(node.port("smtp"))
    helo = f"big-{uuid.uuid4().hex[:8]}.test"
    raw.cmd(f"EHLO {helo}")
    raw.cmd("MAIL FROM:<a@b.test>")
    raw.cmd(f"RCPT TO:<{users['anne']}>")
    raw.cmd("DATA")
    block = (b"y" * 998 + b"\r\n") * 1024
    blocks = MAX_SIZE // len(block) + 2
    for _ in range(blocks):
        raw.send(block)
    assert raw.cmd(b".") == "552 5.3.4 Message too big for system"
    assert raw.cmd("NOOP").startswith("250")  # the session goes on
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("250 2.1.0")  # and a new transaction can start
    wait_for_log(
        node,
        rf"event=delivery listener=smtp peer=127\.0\.0\.1 helo={helo} sender=a@b\.test rcpts=1 "
        rf"size={blocks * len(block)} result=too-large ms=\d+$",
    )


async def test_a_50_megabyte_message(node: Node, store: Store, users) -> None:
    body = b"Subject: big\r\n\r\n" + (os.urandom(38) .hex().encode() + b"\r\n") * (50 * 1024 * 1024 // 78)
    with smtp(node) as client:
        await asyncio.to_thread(client.sendmail, "big@remote.test", [users["bob"]], body)
    [summary] = [s async for s in store.list_messages(users["bob"], INBOX)]
    assert summary.size > len(body)
    stored = await store.read_message(users["bob"], INBOX, summary.id)
    assert strip_trace(stored)[1] == body


def test_pipelining_with_swaks(node: Node, users) -> None:
    result = subprocess.run(
        ["swaks", "--server", "127.0.0.1", "--port", str(node.port("smtp")), "--pipeline",
         "--from", "sender@remote.test", "--to", users["anne"], "--body", "pipelined body"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "250 2.0.0 OK id=" in result.stdout


async def test_a_hundred_concurrent_senders(node: Node, store: Store, users) -> None:
    def send(i: int) -> dict:
        with smtp(node) as client:
            return client.sendmail(f"s{i}@remote.test", [users["carol"]], b"Subject: %d\r\n\r\nbody %d\r\n" % (i, i))

    with concurrent.futures.ThreadPoolExecutor(100) as pool:
        results = await asyncio.get_running_loop().run_in_executor(None, lambda: list(pool.map(send, range(100))))
    assert results == [{}] * 100
    bodies = {strip_trace(m)[1] for m in await inbox(store, users["carol"])}
    assert bodies == {b"Subject: %d\r\n\r\nbody %d\r\n" % (i, i) for i in range(100)}


async def test_starttls_on_the_mx_reports_tls_in_the_trace(node: Node, store: Store, users) -> None:
    body = b"Subject: over tls\r\n\r\nsecret\r\n"

    def send() -> dict:
        with smtp(node) as client:
            client.ehlo("client.test")
            code, reply = client.starttls(context=CLIENT_TLS)
            assert (code, reply) == (220, b"2.0.0 Ready to start TLS")
            code, _ = client.ehlo("client.test")
            assert code == 250 and "starttls" not in client.esmtp_features
            return client.sendmail("x@remote.test", [users["anne"]], body)

    assert await asyncio.to_thread(send) == {}
    [stored] = await inbox(store, users["anne"])
    trace, original = strip_trace(stored)
    assert original == body
    assert b" with ESMTPS id " in trace and b"ESMTPSA" not in trace and b"authenticated as" not in trace
    assert re.search(rb"\n\t\(using TLSv1\.[23] with cipher [A-Z0-9_-]+\)\r\n", trace), trace


async def test_commands_injected_after_starttls_are_discarded(node: Node, store: Store, users) -> None:
    """CVE-2024-34083 style: commands in the same packet as STARTTLS (or behind a message's
    end marker, which the block DATA reader hands back to the line reader) are plaintext a
    man in the middle could have added; they must not run inside TLS."""
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    raw.send(b"STARTTLS\r\nEHLO evil.test\r\nMAIL FROM:<evil@evil.test>\r\n")
    assert raw.reply() == "220 2.0.0 Ready to start TLS"
    raw.starttls()
    assert raw.cmd("EHLO client.test").startswith("250-mx.test\n")  # not a reply to injected commands
    assert raw.cmd("MAIL FROM:<good@remote.test>").startswith("250 2.1.0")  # no MAIL is open
    assert raw.cmd(f"RCPT TO:<{users['anne']}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd(b"Subject: one\r\n\r\nx\r\n.").startswith("250 2.0.0")
    assert raw.cmd("NOOP") == "250 2.0.0 OK"  # and no stray reply is queued
    raw.close()

    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    raw.cmd("MAIL FROM:<good@remote.test>")
    raw.cmd(f"RCPT TO:<{users['bob']}>")
    assert raw.cmd("DATA").startswith("354")
    raw.send(b"Subject: two\r\n\r\nx\r\n.\r\nSTARTTLS\r\nEHLO evil.test\r\nMAIL FROM:<evil@evil.test>\r\n")
    assert raw.reply().startswith("250 2.0.0")
    assert raw.reply() == "220 2.0.0 Ready to start TLS"
    raw.starttls()
    assert raw.cmd("EHLO client.test").startswith("250-mx.test\n")
    assert raw.cmd("MAIL FROM:<good@remote.test>").startswith("250 2.1.0")
    assert raw.cmd("NOOP") == "250 2.0.0 OK"
    raw.close()
    for user in ("anne", "bob"):
        [stored] = await inbox(store, users[user])
        assert b"evil" not in stored


async def test_commands_pipelined_behind_the_end_of_data_are_answered(node: Node, store: Store, users) -> None:
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    raw.send(f"MAIL FROM:<one@remote.test>\r\nRCPT TO:<{users['carol']}>\r\nDATA\r\n".encode())
    assert [raw.reply()[:9] for _ in range(3)] == ["250 2.1.0", "250 2.1.5", "354 End d"]
    raw.send(
        b"Subject: first\r\n\r\n..dotted\r\n.\r\n"
        + f"MAIL FROM:<two@remote.test>\r\nRCPT TO:<{users['carol']}>\r\nDATA\r\n".encode()
    )
    assert [raw.reply()[:9] for _ in range(4)] == ["250 2.0.0", "250 2.1.0", "250 2.1.5", "354 End d"]
    raw.send(b"Subject: second\r\n\r\nbody\r\n.\r\nQUIT\r\n")
    assert raw.reply().startswith("250 2.0.0") and raw.reply().startswith("221 2.0.0")
    stored = await inbox(store, users["carol"])
    assert [strip_trace(m)[1] for m in stored] == [
        b"Subject: first\r\n\r\n.dotted\r\n", b"Subject: second\r\n\r\nbody\r\n"
    ]
    assert [strip_trace(m)[0].split(b"\r\n")[0] for m in stored] == [
        b"Return-Path: <one@remote.test>", b"Return-Path: <two@remote.test>"
    ]


async def test_quoted_local_parts(node: Node, store: Store, domain: str) -> None:
    user = f'"anne smith"@{domain}'
    await store.create_user(user, hash_password("pw", FAST_HASH))
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    assert raw.cmd('MAIL FROM:<"x y"@remote.test>').startswith("250 2.1.0")
    assert raw.cmd(f'RCPT TO:<"Anne Smith"@{domain.upper()}>').startswith("250 2.1.5")
    assert raw.cmd(f'RCPT TO:<"anne  smith"@{domain}>').startswith("550 5.1.1")  # another address
    raw.cmd("DATA")
    assert raw.cmd(b"Subject: quoted\r\n\r\nhi\r\n.").startswith("250 2.0.0")
    [stored] = await inbox(store, user)
    trace, original = strip_trace(stored)
    assert original == b"Subject: quoted\r\n\r\nhi\r\n"
    assert trace.startswith(b'Return-Path: <"x y"@remote.test>\r\n')
    assert f'for <"anne smith"@{domain}>;'.encode() in trace


async def test_a_client_leaving_in_the_middle_of_data_stores_nothing(node: Node, store: Store, users) -> None:
    helo = f"leaver-{uuid.uuid4().hex[:8]}.test"
    raw = Raw(node.port("smtp"))
    raw.cmd(f"EHLO {helo}")
    raw.cmd("MAIL FROM:<a@b.test>")
    raw.cmd(f"RCPT TO:<{users['bob']}>")
    assert raw.cmd("DATA").startswith("354")
    raw.send(b"Subject: half\r\n\r\n" + b"z" * 300_000)
    raw.close()
    wait_for_log(node, rf"event=session listener=smtp peer=127\.0\.0\.1 helo={helo} tls=False deliveries=0 result=dropped ms=\d+$")
    assert await inbox(store, users["bob"]) == []
    assert f"helo={helo} " not in "".join(line for line in node.log_text().splitlines() if "event=delivery" in line)
    assert "Traceback" not in node.log_text()


async def test_the_delivery_and_session_lines_are_logged(node: Node, store: Store, users) -> None:
    helo = f"logged-{uuid.uuid4().hex[:8]}.test"
    body = b"Subject: logged\r\n\r\nhello\r\n"

    def send() -> None:
        with smtp(node) as client:
            client.ehlo(helo)
            assert client.sendmail("x@remote.test", [users["anne"], users["bob"]], body) == {}

    await asyncio.to_thread(send)
    line = wait_for_log(
        node,
        rf"event=delivery listener=smtp peer=127\.0\.0\.1 helo={helo} sender=x@remote\.test rcpts=2 "
        rf"size={len(body)} id=(?P<id>[0-9a-f]{{16}}) result=ok ms=\d+$",
    )
    [stored] = await inbox(store, users["anne"])
    assert f" id {line['id']}".encode() in strip_trace(stored)[0]  # the queue id of the Received header
    wait_for_log(node, rf"event=session listener=smtp peer=127\.0\.0\.1 helo={helo} tls=False deliveries=1 result=quit ms=\d+$")


# ----------------------------------------------------------------------------- submission


def test_submission_offers_auth_only_after_starttls(node: Node, users) -> None:
    with smtp(node, "submission") as client:
        assert client.docmd("AUTH", "PLAIN") == (503, b"5.5.1 Error: send EHLO first")
        client.ehlo("client.test")
        assert "auth" not in client.esmtp_features and "starttls" in client.esmtp_features
        plain = "PLAIN " + base64.b64encode(f"\0{users['anne']}\0anne".encode()).decode()
        assert client.docmd("AUTH", plain) == (538, b"5.7.11 Encryption required for requested authentication mechanism")
        assert client.docmd("MAIL FROM:", f"<{users['anne']}>") == (530, b"5.7.0 Authentication required")
        client.starttls(context=CLIENT_TLS)
        client.ehlo("client.test")
        assert client.esmtp_features["auth"].split() == ["LOGIN", "PLAIN"]
        assert client.docmd("AUTH") == (501, b"5.5.4 Not enough value")
        assert client.docmd("AUTH", "PLAIN a b") == (501, b"5.5.4 Too many values")
        assert client.docmd("AUTH", "CRAM-MD5") == (504, b"5.5.4 Unrecognized authentication type")
        assert client.docmd("AUTH", "PLAIN !!!") == (501, b"5.5.2 Can't decode base64")
        assert client.docmd("AUTH", "LOGIN") == (334, base64.b64encode(b"User Name\0"))
        assert client.docmd("*") == (501, b"5.7.0 Auth aborted")
        assert client.docmd("AUTH", "LOGIN") == (334, base64.b64encode(b"User Name\0"))
        assert client.docmd("x" * 5000) == (500, b"5.5.6 Authentication Exchange line is too long")
        assert client.docmd("AUTH", plain) == (235, b"2.7.0 Authentication successful")
        assert client.docmd("AUTH", plain) == (503, b"5.5.1 Already authenticated")


async def test_authenticated_submission_copies_to_sent_and_traces_tls_and_auth(node: Node, store: Store, users) -> None:
    body = b"Subject: from anne\r\n\r\nhi bob\r\n"

    def submit() -> dict:
        with smtp(node, "submission") as client:
            client.starttls(context=CLIENT_TLS)
            client.login(users["anne"], "anne")
            return client.sendmail(users["anne"], [users["bob"]], body)

    assert await asyncio.to_thread(submit) == {}
    [received] = await inbox(store, users["bob"])
    [sent] = [s async for s in store.list_messages(users["anne"], "Sent")]
    assert sent.flags == {"\\Seen"}
    assert await store.read_message(users["anne"], "Sent", sent.id) == received
    trace, original = strip_trace(received)
    assert original == body
    assert b" with ESMTPSA id " in trace and b"(using TLSv1." in trace
    assert f"(authenticated as {users['anne']})".encode() in trace


def test_auth_login_with_swaks_over_starttls(node: Node, users) -> None:
    result = subprocess.run(
        ["swaks", "--server", "127.0.0.1", "--port", str(node.port("submission")), "--tls",
         "--auth", "LOGIN", "--auth-user", users["bob"], "--auth-password", "bob",
         "--from", users["bob"], "--to", users["carol"]],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "235 2.7.0 Authentication successful" in result.stdout


def test_submission_refuses_foreign_senders_and_bad_passwords_and_takes_remote_recipients(node: Node, users) -> None:
    with smtp(node, "submission") as client:
        client.starttls(context=CLIENT_TLS)
        client.ehlo("client.test")
        with pytest.raises(smtplib.SMTPAuthenticationError) as err:
            client.login(users["anne"], "wrong")
        assert err.value.smtp_code == 535
        client.login(users["anne"], "anne")
        assert client.docmd("MAIL FROM:", f"<{users['bob']}>")[0] == 553
        assert client.docmd("MAIL FROM:", "<>")[0] == 553
        assert client.docmd("MAIL FROM:", f"<{users['anne']}>")[0] == 250
        # An authenticated user may send anywhere (the message would be queued; see test_outbound.py).
        assert client.docmd("RCPT TO:", "<friend@elsewhere.test>") == (250, b"2.1.5 Recipient OK")
        assert client.docmd("RSET")[0] == 250


def test_too_many_failed_logins_close_the_session(node: Node, users) -> None:
    raw = Raw(node.port("submission"))
    raw.cmd("EHLO client.test")
    raw.cmd("STARTTLS")
    raw.sock = CLIENT_TLS.wrap_socket(raw.sock)
    raw.file = raw.sock.makefile("rb")
    raw.cmd("EHLO client.test")
    bad = base64.b64encode(f"\0{users['anne']}\0nope".encode()).decode()
    assert raw.cmd(f"AUTH PLAIN {bad}").startswith("535 5.7.8")
    assert raw.cmd(f"AUTH PLAIN {bad}").startswith("535 5.7.8")
    assert raw.cmd(f"AUTH PLAIN {bad}").startswith("421 4.7.0")
    assert raw.closed()


@pytest.mark.store_independent
async def test_implicit_tls_submission(backend_settings, tls_files, tmp_path, store: Store, users) -> None:
    node = Node(node_settings(backend_settings), tmp_path, submission={**tls_files, "implicit_tls": True}).start()
    try:
        def submit() -> dict:
            with smtplib.SMTP_SSL("127.0.0.1", node.port("submission"), context=CLIENT_TLS, timeout=30) as client:
                client.login(users["carol"], "carol")
                return client.sendmail(users["carol"], [users["anne"]], b"Subject: 465\r\n\r\nimplicit\r\n")

        assert await asyncio.to_thread(submit) == {}
    finally:
        assert node.stop() == 0
    [stored] = await inbox(store, users["anne"])
    assert b" with ESMTPSA id " in strip_trace(stored)[0]


# ----------------------------------------------------------------------------- LMTP


async def test_lmtp_answers_once_per_recipient(node: Node, store: Store, users) -> None:
    domain = users["anne"].split("@")[1]

    def hand_over() -> dict:
        with smtplib.LMTP("127.0.0.1", node.port("lmtp"), timeout=30) as client:
            # smtplib's LMTP reads a single DATA reply, so it is given a single deliverable recipient
            return client.sendmail("x@remote.test", [users["anne"], f"ghost@{domain}"], b"Subject: lmtp\r\n\r\nx\r\n")

    refused = await asyncio.to_thread(hand_over)
    assert list(refused) == [f"ghost@{domain}"] and refused[f"ghost@{domain}"][0] == 550
    [anne] = await inbox(store, users["anne"])
    assert b" with LMTP id " in strip_trace(anne)[0]
    raw = Raw(node.port("lmtp"))
    assert raw.cmd("EHLO x").startswith("500")  # LMTP speaks LHLO
    assert raw.cmd("LHLO mta.test").startswith("250")
    raw.cmd("MAIL FROM:<a@b.test>")
    raw.cmd(f"RCPT TO:<{users['anne']}>")
    raw.cmd(f"RCPT TO:<{users['carol']}>")
    raw.cmd("DATA")
    raw.send(b"Subject: two\r\n\r\nx\r\n.\r\n")
    assert raw.reply().startswith("250 2.0.0") and raw.reply().startswith("250 2.0.0")


# ----------------------------------------------------------------------------- the process


def test_sigterm_stops_the_node_cleanly(backend_settings, tmp_path) -> None:
    node = Node(node_settings(backend_settings), tmp_path, node={"workers": 2}).start()
    with smtp(node) as client:
        assert client.noop()[0] == 250
    assert node.stop() == 0
    assert "Traceback" not in node.log_text() and "event=stopped" in node.log_text()


def test_connections_past_the_limit_are_turned_away_with_421(backend_settings, tmp_path) -> None:
    node = Node(node_settings(backend_settings), tmp_path, smtp={"max_connections": 2}).start()
    try:
        first, second = Raw(node.port("smtp")), Raw(node.port("smtp"))
        assert first.greeting.startswith("220") and second.greeting.startswith("220")
        third = Raw(node.port("smtp"))
        assert third.greeting.startswith("421 4.7.0") and third.closed()
        assert first.cmd("QUIT").startswith("221")
        first.closed()
        fourth = Raw(node.port("smtp"))  # a freed place is taken again
        assert fourth.greeting.startswith("220")
        for client in (second, fourth):  # a session left open would hold the node's stop for its grace period
            client.close()
    finally:
        assert node.stop() == 0
    assert "event=session listener=smtp peer=127.0.0.1" in node.log_text()


def test_a_busy_address_is_one_clear_line(backend_settings, tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = Node(node_settings(backend_settings), tmp_path, smtp={"listen": f"127.0.0.1:{port}"})
        result = subprocess.run(
            [CASSMAIL, "--config", str(node.config), "serve"], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- store failures (fault injection)


class FailingStore:
    """Wraps the real store; raises on the named methods while `failing` names them, and counts
    the calls of each method in `calls`."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.failing: dict[str, Exception] = {}
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def call(*args, **kwargs):
            self.calls[name] += 1
            if name in self.failing:
                raise self.failing[name]
            return await attr(*args, **kwargs)

        return call


@contextlib.asynccontextmanager
async def in_process(backend_settings: Settings, store: Store, listener: str) -> AsyncIterator[tuple[FailingStore, Any]]:
    """One SMTP-family listener in this process over a store whose failures the test switches on
    (submission: clear-text AUTH allowed, no throttling), and a connected client's `cmd(line) -> reply`."""
    from cassmail import smtp as smtp_front

    settings = node_settings(backend_settings)
    for name in ("smtp", "submission", "lmtp"):
        setattr(settings, name, dataclasses.replace(
            getattr(settings, name), enabled=name == listener, listen="127.0.0.1:0", domain_cache_seconds=0,
            allow_plaintext_auth=True, auth_failure_delay=0, tls_cert="", tls_key="",
        ))
    wrapped = FailingStore(store)
    servers = [server for server, _ in await smtp_front.start(settings, wrapped)]  # type: ignore[arg-type]
    raw = await asyncio.to_thread(Raw, servers[0].sockets[0].getsockname()[1])

    async def cmd(line: str | bytes) -> str:
        return await asyncio.to_thread(raw.cmd, line)

    cmd.raw = raw  # type: ignore[attr-defined]  # for replies that follow the first
    try:
        yield wrapped, cmd
    finally:
        raw.close()
        for server in servers:
            server.close()


@pytest.fixture
async def flaky(backend_settings: Settings, store: Store) -> AsyncIterator[tuple[FailingStore, Any]]:
    """An MX listener in this process over a store whose failures the test switches on."""
    async with in_process(backend_settings, store, "smtp") as pair:
        yield pair


async def test_a_store_failure_at_data_is_451_and_nothing_is_stored(flaky, store: Store, users) -> None:
    failing, cmd = flaky
    await cmd("EHLO client.test")
    await cmd("MAIL FROM:<a@b.test>")
    await cmd(f"RCPT TO:<{users['anne']}>")
    await cmd("DATA")
    failing.failing["deliver"] = StoreUnavailable("injected: write timeout")
    assert (await cmd("Subject: x\r\n\r\nx\r\n.")).startswith("451 4.3.0")
    assert await inbox(store, users["anne"]) == []
    failing.failing.clear()
    await cmd("MAIL FROM:<a@b.test>")  # the session goes on, and the retry is stored
    await cmd(f"RCPT TO:<{users['anne']}>")
    await cmd("DATA")
    assert (await cmd("Subject: x\r\n\r\nx\r\n.")).startswith("250 2.0.0")
    assert len(await inbox(store, users["anne"])) == 1


async def test_a_store_failure_at_rcpt_or_a_bug_is_451_never_a_traceback(flaky, users) -> None:
    failing, cmd = flaky
    await cmd("EHLO client.test")
    await cmd("MAIL FROM:<a@b.test>")
    failing.failing["user_exists"] = StoreUnavailable("injected: cassandra down")
    assert (await cmd(f"RCPT TO:<{users['anne']}>")).startswith("451 4.3.0")
    failing.failing = {"user_exists": RuntimeError("injected bug")}
    reply = await cmd(f"RCPT TO:<{users['anne']}>")
    assert reply.startswith("451 4.3.0") and "RuntimeError" not in reply and "injected" not in reply
    failing.failing.clear()
    assert (await cmd(f"RCPT TO:<{users['anne']}>")).startswith("250")


async def test_a_bug_at_data_is_451_and_the_next_transaction_starts_afresh(flaky, store: Store, users) -> None:
    failing, cmd = flaky
    await cmd("EHLO client.test")
    await cmd("MAIL FROM:<a@b.test>")
    await cmd(f"RCPT TO:<{users['anne']}>")
    await cmd("DATA")
    failing.failing["deliver"] = RuntimeError("injected bug")
    reply = await cmd("Subject: x\r\n\r\nx\r\n.")
    assert reply.startswith("451 4.3.0") and "injected" not in reply
    assert await inbox(store, users["anne"]) == []
    failing.failing.clear()
    assert (await cmd("MAIL FROM:<c@d.test>")).startswith("250 2.1.0")  # not "503 nested MAIL"
    assert (await cmd(f"RCPT TO:<{users['bob']}>")).startswith("250 2.1.5")
    await cmd("DATA")
    assert (await cmd("Subject: y\r\n\r\ny\r\n.")).startswith("250 2.0.0")
    [stored] = await inbox(store, users["bob"])  # the new envelope only: c@d.test to bob
    assert stored.startswith(b"Return-Path: <c@d.test>\r\n") and b"for <" + users["bob"].encode() in stored
    assert await inbox(store, users["anne"]) == []


async def test_a_bug_at_lmtp_data_is_one_451_per_recipient(backend_settings: Settings, store: Store, users) -> None:
    async with in_process(backend_settings, store, "lmtp") as (failing, cmd):
        await cmd("LHLO mta.test")
        await cmd("MAIL FROM:<a@b.test>")
        await cmd(f"RCPT TO:<{users['anne']}>")
        await cmd(f"RCPT TO:<{users['bob']}>")
        await cmd("DATA")
        failing.failing["deliver"] = RuntimeError("injected bug")
        first = await cmd("Subject: x\r\n\r\nx\r\n.")
        second = await asyncio.to_thread(cmd.raw.reply)
        assert first.startswith("451 4.3.0") and second.startswith("451 4.3.0") and "injected" not in first + second
        failing.failing.clear()
        assert (await cmd("NOOP")).startswith("250")  # in step: the next reply is NOOP's own
        assert await inbox(store, users["anne"]) == [] and await inbox(store, users["bob"]) == []


async def test_the_store_refusing_the_size_is_552_5_3_4(flaky, store: Store, users) -> None:
    failing, cmd = flaky
    await cmd("EHLO client.test")
    await cmd("MAIL FROM:<a@b.test>")
    await cmd(f"RCPT TO:<{users['anne']}>")
    await cmd("DATA")
    failing.failing["deliver"] = MessageTooLarge(1000, 500)
    assert await cmd("Subject: x\r\n\r\nx\r\n.") == "552 5.3.4 Message too big for system"
    assert (await cmd("MAIL FROM:<a@b.test>")).startswith("250 2.1.0")


async def test_one_message_to_k_recipients_is_one_store_delivery(flaky, store: Store, users) -> None:
    failing, cmd = flaky
    await cmd("EHLO client.test")
    await cmd("MAIL FROM:<a@b.test>")
    for name in ("anne", "bob", "carol"):
        assert (await cmd(f"RCPT TO:<{users[name]}>")).startswith("250 2.1.5")
    await cmd("DATA")
    assert (await cmd("Subject: k\r\n\r\nthree\r\n.")).startswith("250 2.0.0")
    assert failing.calls["deliver"] == 1
    copies = [await inbox(store, users[name]) for name in ("anne", "bob", "carol")]
    assert [len(c) for c in copies] == [1, 1, 1] and copies[0] == copies[1] == copies[2]


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")  # clear-text AUTH on purpose here
async def test_a_store_failure_during_auth_is_454(backend_settings: Settings, store: Store, users) -> None:
    async with in_process(backend_settings, store, "submission") as (failing, cmd):
        await cmd("EHLO client.test")
        plain = "AUTH PLAIN " + base64.b64encode(f"\0{users['anne']}\0anne".encode()).decode()
        failing.failing["get_password_hash"] = StoreUnavailable("injected: read timeout")
        assert await cmd(plain) == "454 4.7.0 Temporary authentication failure"
        failing.failing.clear()
        assert await cmd(plain) == "235 2.7.0 Authentication successful"
        assert (await cmd(f"MAIL FROM:<{users['anne']}>")).startswith("250 2.1.0")


async def test_the_message_is_acknowledged_at_once_for_clients_that_send_the_end_marker_apart(
    backend_settings: Settings, store: Store, users
) -> None:
    """After 354 the server's end leaves the delayed-ACK mode that request and answer put it in:
    a client with Nagle's algorithm on that writes the message and then `.` on its own (postal
    does) would otherwise send the marker only when the delayed ACK of the message came, 40 ms
    and more later, for every message. Each DATA puts it out of that mode again."""
    async with in_process(backend_settings, store, "smtp") as (_, cmd):
        client = cmd.raw.sock
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        for n in range(2):
            await cmd("EHLO client.test" if n == 0 else "RSET")
            for line in ("MAIL FROM:<a@b.test>", f"RCPT TO:<{users['anne']}>", "NOOP", "NOOP"):
                assert (await cmd(line)).startswith("250")
            assert (await cmd("DATA")).startswith("354")
            assert await asyncio.to_thread(server_end_quickack, client) == 1
            await asyncio.to_thread(client.sendall, b"Subject: apart\r\n\r\nthe message\r\n")
            assert (await cmd(".")).startswith("250 ")
    messages = await inbox(store, users["anne"])
    assert [m.count(b"the message") for m in messages][-2:] == [1, 1]
