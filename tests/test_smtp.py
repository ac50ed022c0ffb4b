"""The SMTP front end as mail clients and MTAs see it: a real `cassmail serve`, real sockets,
smtplib and swaks; every backend in turn."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import os
import smtplib
import socket
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cassmail.config import Settings
from cassmail.model import INBOX
from cassmail.store.base import Store, StoreUnavailable
from tests.conftest import FAST_HASH, hash_password
from tests.nodes import CASSMAIL, CLIENT_TLS, MAX_SIZE, Node, inbox, node_settings, strip_trace

pytestmark = pytest.mark.cassandra

def smtp(node: Node, listener: str = "smtp") -> smtplib.SMTP:
    return smtplib.SMTP("127.0.0.1", node.port(listener), timeout=30)


class Raw:
    """A line-level SMTP client for what smtplib will not send."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
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

    def closed(self) -> bool:
        return self.file.readline() == b""

    def close(self) -> None:
        self.sock.close()


# ----------------------------------------------------------------------------- MX receive


def test_ehlo_advertises_what_works_and_no_auth_on_the_mx(node: Node) -> None:
    with smtp(node) as client:
        code, _ = client.ehlo("client.test")
        assert code == 250
        features = client.esmtp_features
        for keyword in ("pipelining", "8bitmime", "smtputf8", "enhancedstatuscodes", "starttls"):
            assert keyword in features, keyword
        assert features["size"] == str(MAX_SIZE)
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
    assert raw.greeting.startswith("220")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("503")  # before EHLO
    raw.cmd("EHLO client.test")
    assert raw.cmd(f"RCPT TO:<{users['anne']}>").startswith("503 5.")  # before MAIL
    assert raw.cmd("DATA").startswith("503 5.")
    assert raw.cmd("MAIL FROM:<not an address>").startswith("553 5.1.7")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("250")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("503 5.")  # nested MAIL
    domain = users["anne"].split("@")[1]
    assert raw.cmd(f"RCPT TO:<nobody@{domain}>").startswith("550 5.1.1")
    assert raw.cmd("RCPT TO:<someone@elsewhere.test>").startswith("550 5.7.1 Relaying denied")
    assert raw.cmd(f"RCPT TO:<a..b@{domain}>").startswith("501 5.1.3")
    assert raw.cmd(f"RCPT TO:<@{domain}>").startswith("553 5.1.3")
    assert raw.cmd("RCPT TO:<用户@" + domain + ">").startswith("553 5.6.7")  # needs SMTPUTF8
    assert raw.cmd("VRFY anne").startswith("252 2.5.2")
    assert raw.cmd("EXPN staff").startswith("502 5.")
    assert raw.cmd("BOGUS").startswith("500 5.")
    assert raw.cmd(b"\xff\xfe garbage").startswith("500 5.")
    assert raw.cmd("NOOP " + "x" * 2000).startswith("500 5.")  # command line too long
    assert raw.cmd("RSET").startswith("250 2.0.0")
    assert raw.cmd("MAIL FROM:<a@b.test> SIZE=999999999999").startswith("552")
    assert raw.cmd("NOOP").startswith("250 2.0.0")
    assert raw.cmd("QUIT").startswith("221 2.0.0")


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
    raw.cmd("EHLO client.test")
    raw.cmd("MAIL FROM:<a@b.test>")
    raw.cmd(f"RCPT TO:<{users['anne']}>")
    raw.cmd("DATA")
    block = (b"y" * 998 + b"\r\n") * 1024
    for _ in range(MAX_SIZE // len(block) + 2):
        raw.send(block)
    assert raw.cmd(b".").startswith("552 5.3.4")
    assert raw.cmd("NOOP").startswith("250")  # the session goes on


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


def test_starttls_on_the_mx_reports_tls_in_the_trace(node: Node) -> None:
    with smtp(node) as client:
        client.starttls(context=CLIENT_TLS)
        code, _ = client.ehlo("client.test")
        assert code == 250 and "starttls" not in client.esmtp_features


# ----------------------------------------------------------------------------- submission


def test_submission_offers_auth_only_after_starttls(node: Node, users) -> None:
    with smtp(node, "submission") as client:
        client.ehlo("client.test")
        assert "auth" not in client.esmtp_features and "starttls" in client.esmtp_features
        assert client.docmd("AUTH", "PLAIN " + base64.b64encode(b"\0anne\0anne").decode())[0] == 538
        assert client.docmd("MAIL FROM:", f"<{users['anne']}>")[0] == 530  # authentication required
        client.starttls(context=CLIENT_TLS)
        client.ehlo("client.test")
        assert client.esmtp_features["auth"].split() == ["LOGIN", "PLAIN"]


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


def test_submission_refuses_foreign_senders_remote_domains_and_bad_passwords(node: Node, users) -> None:
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
        code, text = client.docmd("RCPT TO:", "<friend@elsewhere.test>")
        assert code == 550 and b"5.7.1 Delivery to other domains is not available" in text


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
    """Wraps the real store; raises on the named methods while `failing` names them."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.failing: dict[str, Exception] = {}

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def call(*args, **kwargs):
            if name in self.failing:
                raise self.failing[name]
            return await attr(*args, **kwargs)

        return call


@pytest.fixture
async def flaky(backend_settings: Settings, store: Store) -> AsyncIterator[tuple[FailingStore, Any]]:
    """An MX listener in this process over a store whose failures the test switches on, and a
    connected client's `cmd(line) -> reply`."""
    from cassmail import smtp as smtp_front

    settings = node_settings(backend_settings)
    settings.smtp = dataclasses.replace(settings.smtp, listen="127.0.0.1:0", domain_cache_seconds=0)
    settings.submission = dataclasses.replace(settings.submission, enabled=False)
    wrapped = FailingStore(store)
    servers = [server for server, _ in await smtp_front.start(settings, wrapped)]  # type: ignore[arg-type]
    raw = await asyncio.to_thread(Raw, servers[0].sockets[0].getsockname()[1])

    async def cmd(line: str) -> str:
        return await asyncio.to_thread(raw.cmd, line)

    yield wrapped, cmd
    raw.close()
    for server in servers:
        server.close()


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
