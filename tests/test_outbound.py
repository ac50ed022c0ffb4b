"""Outbound mail end to end: a real `cassmail serve` with its queue workers, on each store,
sending to remote MXs of the test's own (aiosmtpd with STARTTLS on 127.0.0.2 and .3) found
through a DNS server of the test's own (dnslib on loopback, `relay.nameservers`), and to
remotes that misbehave. Users submit with smtplib and read their DSNs with poplib. A second
node, on the mbox store only, sends through a smarthost (`relay.relayhost`, AUTH over
STARTTLS) and checks certificates (`relay.tls = "verify"`).

What no store changes (routing, the SMTP client, loops) runs on one store, mbox, to keep the
suite short; what the queue does runs on every store.

Every remote host listens on the same port (`relay.port`), as MXs on many machines listen
on 25. Retries, lifetime and leases are made short by settings, so a day's schedule plays
in seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email
import email.policy
import json
import poplib
import re
import smtplib
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dkim
import pytest

from cassmail.config import Settings
from cassmail.store.base import Store, Target
from tests.conftest import FAST_HASH, backend_settings_for, hash_password, opened_store
from tests.nodes import CASSMAIL, CLIENT_TLS, Node, inbox, node_settings
from tests.outbound_peers import BadRemote, Dns, RemoteMx, free_port_on, ipv6_loopback

pytestmark = pytest.mark.cassandra

#: The stores this module runs on (the WheelFS store's cue-less layout shares all its queue code).
OUTBOUND_BACKENDS = ["cassandra", "mbox", "wheelfs"]
GOOD, IMPLICIT, PLAIN, DOWN = "127.0.0.2", "127.0.0.3", "127.0.0.9", "127.0.0.10"
BAD = {"garbage": "127.0.0.4", "silent": "127.0.0.5", "huge": "127.0.0.6", "close-mid-data": "127.0.0.7"}
TRUSTED = "127.0.0.11"  # a client the submission listener trusts without AUTH (Postfix's mynetworks)
RELAY, REUSE, CHECKED = "127.0.0.12", "127.0.0.13", "127.0.0.14"
SIX = "::1"  # the AAAA of six.test, when this machine's loopback has IPv6
#: The smarthost's account (AUTH PLAIN/LOGIN, offered only after STARTTLS).
RELAY_LOGIN = ("cassmail-node", "relay-secret")
LIFETIME = 8.0
DELAY_WARNING = 3.0


@dataclass
class World:
    dns: Dns
    port: int
    good: RemoteMx
    implicit: RemoteMx
    plain: BadRemote
    bad: dict[str, BadRemote]
    #: A provider's smarthost (AUTH required, only over STARTTLS); a plain MX for counting
    #: sessions; an MX with a self-signed certificate for `tls = "verify"`; one on ::1 (or None).
    relay: RemoteMx
    reuse: RemoteMx
    checked: RemoteMx
    six: RemoteMx | None


@pytest.fixture(scope="module")
def world(tls_files: dict[str, str]) -> Iterator[World]:
    six_hosts = [SIX] if ipv6_loopback() else []
    port = free_port_on(GOOD, IMPLICIT, PLAIN, DOWN, RELAY, REUSE, CHECKED, *BAD.values(), *six_hosts)
    dns = Dns().start()
    zone = dns.zone
    zone.add("remote.test", "MX", "10 mx1.remote.test.")
    zone.add("mx1.remote.test", "A", GOOD)
    zone.add("implicit.test", "A", IMPLICIT)  # no MX: the domain itself is the MX (RFC 5321 5.1)
    zone.add("nullmx.test", "MX", "0 .")  # RFC 7505: accepts no mail
    zone.add("plain.test", "MX", "10 mx.plain.test.")
    zone.add("mx.plain.test", "A", PLAIN)
    zone.add("down.test", "MX", "10 mx.down.test.")
    zone.add("mx.down.test", "A", DOWN)  # nothing listens there
    for mode, host in BAD.items():
        zone.add(f"{mode}.test", "MX", f"10 mx.{mode}.test.")
        zone.add(f"mx.{mode}.test", "A", host)
    zone.add("servfail.test", "MX", "10 mx1.remote.test.")  # a test makes it SERVFAIL for a while
    zone.add("six.test", "A", DOWN)  # no MX; its A refuses connections, its AAAA is ::1
    if six_hosts:
        zone.add("six.test", "AAAA", SIX)
    zone.add("reuse.test", "MX", "10 mx.reuse.test.")
    zone.add("mx.reuse.test", "A", REUSE)
    zone.add("smarthost.test", "A", RELAY)
    zone.add("mx.checked.test", "A", CHECKED)
    good = RemoteMx(GOOD, port, tls_files)
    implicit = RemoteMx(IMPLICIT, port, None)
    relay = RemoteMx(RELAY, port, tls_files, login=RELAY_LOGIN)
    reuse = RemoteMx(REUSE, port, None)
    checked = RemoteMx(CHECKED, port, tls_files)
    six = RemoteMx(SIX, port, None) if six_hosts else None
    controllers = [c for c in (good, implicit, relay, reuse, checked, six) if c is not None]
    for controller in controllers:
        controller.start()
    plain = BadRemote(PLAIN, port, "plain").start()
    bad = {mode: BadRemote(host, port, mode).start() for mode, host in BAD.items()}
    try:
        yield World(dns, port, good, implicit, plain, bad, relay, reuse, checked, six)
    finally:
        for remote in (plain, *bad.values()):
            remote.stop()
        for controller in controllers:
            controller.stop()
        dns.stop()


@pytest.fixture(scope="module", params=OUTBOUND_BACKENDS)
def out_settings(request: pytest.FixtureRequest) -> Settings:
    return backend_settings_for(request.param, request)


@pytest.fixture(scope="module")
async def out_store(out_settings: Settings) -> AsyncIterator[Store]:
    async with opened_store(out_settings) as opened:
        yield opened


@dataclass
class Outbound:
    node: Node
    store: Store
    world: World
    #: Sent as the node started, to a domain whose MX never answers: it bounces at LIFETIME.
    doomed: dict[str, Any]
    backend: str

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CASSMAIL, "--config", str(self.node.config), *args], capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL)

    def log_lines(self, pattern: str) -> list[str]:
        return re.findall(rf"^.*{pattern}.*$", self.node.log_text(), re.M)


async def make_users(store: Store, *names: str) -> dict[str, str]:
    """Users (password = their name) in a fresh local domain."""
    domain = f"o{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    out = {}
    for name in names:
        out[name] = f"{name}@{domain}"
        await store.create_user(out[name], hash_password(name, FAST_HASH))
    return out


def submit(node: Node, user: str, recipients: list[str], body: bytes, sender: str | None = None) -> dict:
    with smtplib.SMTP("127.0.0.1", node.port("submission"), timeout=30) as client:
        client.starttls(context=CLIENT_TLS)
        client.login(user, user.split("@")[0])
        return client.sendmail(sender or user, recipients, body)


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        await asyncio.sleep(0.1)


def on_one_store(outbound: Outbound) -> None:
    """Routing, the SMTP client and loop detection do not depend on the store: run on mbox only."""
    if outbound.backend != "mbox":
        pytest.skip("store-independent: runs on the mbox store only")


def pop_all(node: Node, user: str) -> list[bytes]:
    client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
    try:
        client.user(user)
        client.pass_(user.split("@")[0])
        count = client.stat()[0]
        return [b"\r\n".join(client.retr(n)[1]) + b"\r\n" for n in range(1, count + 1)]
    finally:
        client.quit()


def report(message: bytes) -> tuple[str, list[dict[str, str]], bytes]:
    """A DSN's (subject, per-recipient fields, the original headers it carries)."""
    parsed = email.message_from_bytes(message, policy=email.policy.default)
    assert parsed.get_content_type() == "multipart/report" and parsed.get_param("report-type") == "delivery-status"
    parts = list(parsed.iter_parts())
    assert [p.get_content_type() for p in parts] == ["text/plain", "message/delivery-status", "text/rfc822-headers"]
    status_blocks = parts[1].get_payload()
    recipients = [dict(block.items()) for block in status_blocks[1:]]
    return str(parsed["Subject"]), recipients, parts[2].get_payload(decode=True)


@pytest.fixture(scope="module")
async def outbound(out_settings: Settings, out_store: Store, world: World, tls_files: dict[str, str],
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Outbound]:
    node = Node(
        node_settings(out_settings), tmp_path_factory.mktemp("outbound"),
        submission={**tls_files, "trusted_networks": [TRUSTED]}, pop3={"allow_plaintext_auth": True},
        imap={"enabled": False},
        lmtp={"enabled": False},
        delivery={"enabled": True, "min_backoff": 1.0, "max_backoff": 2.0, "max_lifetime": LIFETIME,
                  "delay_warning": DELAY_WARNING, "lease": 10.0, "poll_interval": 0.2, "destination_concurrency": 2},
        relay={"nameservers": [world.dns.address], "port": world.port, "connect_timeout": 2.0, "timeout": 3.0,
               "connection_reuse_time": 1.0, "dns_timeout": 3.0},
        metrics={"enabled": True},
    )
    people = await make_users(out_store, "dora")
    node.start()
    try:
        body = b"Subject: into the void\r\nFrom: " + people["dora"].encode() + b"\r\n\r\nnobody home\r\n"
        assert await asyncio.to_thread(submit, node, people["dora"], ["someone@down.test"], body) == {}
        nulls = [await out_store.enqueue(b"Subject: a bounce\r\n\r\nx\r\n", "", [rcpt])
                 for rcpt in ("reject-null@remote.test", "nobody@down.test")]
        doomed = {"sender": people["dora"], "since": time.monotonic(), "nulls": nulls}
        yield Outbound(node, out_store, world, doomed, out_settings.store.backend)
    finally:
        assert node.stop() == 0
        assert "Traceback" not in node.log_text(), node.log_text()[-5000:]


# ----------------------------------------------------------------------------- delivered


async def test_remote_mail_is_delivered_byte_exact_over_starttls_with_a_valid_dkim_signature(
    outbound: Outbound,
) -> None:
    store, world = outbound.store, outbound.world
    people = await make_users(store, "anne", "bob")
    anne, domain = people["anne"], people["anne"].split("@")[1]
    added = outbound.cli("dkim", "add", domain, "--selector", "t1")
    assert added.returncode == 0, added.stderr
    record = re.search(r'^t1\._domainkey\.(\S+)\. IN TXT \( (.*) \)$', added.stdout, re.M)
    assert record and record.group(1) == domain, added.stdout
    world.dns.zone.add(f"t1._domainkey.{domain}", "TXT", record.group(2))
    friend = f"Friend-{uuid.uuid4().hex[:6]}@remote.test"  # the remote keeps what every backend's run sent
    body = (f"From: Anne <{anne}>\r\nTo: {friend}\r\nSubject: hello out there\r\n"
            f"Message-ID: <{uuid.uuid4().hex}@{domain}>\r\n\r\nGr\xfc\xdfe \u2713\r\n.leading dot\r\n").encode()
    assert await asyncio.to_thread(submit, outbound.node, anne, [friend, people["bob"]], body) == {}
    [got] = await eventually(lambda: asyncio.sleep(0, world.good.mx.for_recipient(friend)))
    [sent] = [s async for s in store.list_messages(anne, "Sent")]
    copy = await store.read_message(anne, "Sent", sent.id)
    # What left is the Sent copy (trace headers and the client's bytes) with a DKIM-Signature in front.
    assert got.content.startswith(b"DKIM-Signature: ") and got.content.endswith(copy)
    assert dkim.verify(got.content, dnsfunc=lambda name, timeout=5: world.dns.txt(name.decode().rstrip(".")))
    assert b"d=" + domain.encode() in got.content[: len(got.content) - len(copy)]
    assert got.tls and got.sender == anne and "BODY=8BITMIME" in got.options
    [local] = [s async for s in store.list_messages(people["bob"], "INBOX")]  # the local recipient as today
    assert await store.read_message(people["bob"], "INBOX", local.id) == copy
    await eventually(lambda: asyncio.sleep(0, outbound.log_lines(rf"event=outbound .*rcpt={friend} "
                                                                 r"remote=mx1\.remote\.test\[127\.0\.0\.2\] .*result=sent")))
    # The line is written as the remote's 250 comes; the entry is finished just after it.
    async def finished() -> bool:
        return not [e for e in await store.list_queue() if any(r.address == friend for r in e.recipients)]
    await eventually(finished)


async def test_a_temporary_failure_is_retried_and_delivered_once(outbound: Outbound) -> None:
    people = await make_users(outbound.store, "erin")
    rcpt = f"tempfail-1-{uuid.uuid4().hex[:6]}@remote.test"
    assert await asyncio.to_thread(submit, outbound.node, people["erin"], [rcpt], b"Subject: retry\r\n\r\nx\r\n") == {}
    await eventually(lambda: asyncio.sleep(0, outbound.world.good.mx.for_recipient(rcpt)))
    await asyncio.sleep(1.5)  # a second copy would have come by now
    assert len(outbound.world.good.mx.for_recipient(rcpt)) == 1
    deferred = outbound.log_lines(rf"event=outbound .*rcpt={rcpt} .*result=deferred reply=\"451 4\.2\.0 Mailbox busy")
    sent = outbound.log_lines(rf"event=outbound .*rcpt={rcpt} .*result=sent .*attempt=2 ")
    assert len(deferred) == 1 and len(sent) == 1, outbound.node.log_text()[-3000:]


async def test_a_permanent_failure_bounces_one_dsn_that_the_sender_reads_by_pop3(outbound: Outbound) -> None:
    people = await make_users(outbound.store, "fred")
    fred = people["fred"]
    body = b"Subject: to nobody\r\nX-Tag: original-header\r\n\r\nlost\r\n"
    friend = f"friend-{uuid.uuid4().hex[:6]}@remote.test"
    assert await asyncio.to_thread(submit, outbound.node, fred, ["reject@remote.test", friend], body) == {}
    await eventually(lambda: asyncio.to_thread(pop_all, outbound.node, fred))
    await asyncio.sleep(1.0)  # nothing else is coming
    [dsn] = await asyncio.to_thread(pop_all, outbound.node, fred)
    subject, recipients, original = report(dsn)
    assert subject == "Undelivered Mail Returned to Sender"
    assert recipients == [{**recipients[0], "Final-Recipient": "rfc822; reject@remote.test", "Action": "failed",
                           "Status": "5.1.1", "Remote-MTA": "dns; mx1.remote.test",
                           "Diagnostic-Code": "smtp; 550 5.1.1 No such user here"}]
    assert b"X-Tag: original-header" in original and b"Subject: to nobody" in original
    assert email.message_from_bytes(dsn)["From"].startswith("Mail Delivery System <MAILER-DAEMON@")
    assert len(outbound.world.good.mx.for_recipient(friend)) == 1  # the other one was delivered


async def test_null_mx_bounces_at_once_and_a_domain_without_mx_gets_its_own_address(outbound: Outbound) -> None:
    people = await make_users(outbound.store, "gina")
    gina = people["gina"]
    implicit = f"y-{uuid.uuid4().hex[:6]}@implicit.test"
    assert await asyncio.to_thread(submit, outbound.node, gina, ["x@nullmx.test", implicit],
                                   b"Subject: two\r\n\r\nx\r\n") == {}
    await eventually(lambda: asyncio.sleep(0, outbound.world.implicit.mx.for_recipient(implicit)))
    [dsn] = await eventually(lambda: asyncio.to_thread(pop_all, outbound.node, gina))
    _, [nullmx], _ = report(dsn)
    assert nullmx["Final-Recipient"] == "rfc822; x@nullmx.test" and nullmx["Status"] == "5.1.10"
    assert "null MX" in nullmx["Diagnostic-Code"]
    [got] = outbound.world.implicit.mx.for_recipient(implicit)
    assert not got.tls  # 127.0.0.3 offers no STARTTLS: sent in clear ("may" is opportunistic)


async def test_per_destination_concurrency_holds(outbound: Outbound) -> None:
    people = await make_users(outbound.store, "hugo")
    mx = outbound.world.good.mx
    mx.slow_seconds, mx.most_open = 0.7, 0
    tag = uuid.uuid4().hex[:6]
    rcpts = [f"slow-{tag}-{k}@remote.test" for k in range(6)]

    def send_all() -> None:
        for rcpt in rcpts:
            assert submit(outbound.node, people["hugo"], [rcpt], b"Subject: slow\r\n\r\nx\r\n") == {}

    await asyncio.to_thread(send_all)
    await eventually(lambda: asyncio.sleep(0, all(mx.for_recipient(r) for r in rcpts)), timeout=60)
    # destination_concurrency = 2 on a node of one worker: never more than two connections at once,
    # and both were used (the six slow messages did not go one by one).
    assert mx.most_open == 2, mx.most_open
    assert all(len(mx.for_recipient(r)) == 1 for r in rcpts)


async def test_a_trusted_network_submits_without_auth_and_others_must_authenticate(outbound: Outbound) -> None:
    rcpt = f"app-{uuid.uuid4().hex[:6]}@remote.test"

    def send(source: str) -> dict:
        with smtplib.SMTP("127.0.0.1", outbound.node.port("submission"), timeout=30,
                          source_address=(source, 0)) as client:
            return client.sendmail("app@anywhere.example", [rcpt], b"Subject: from an app\r\n\r\nx\r\n")

    with pytest.raises(smtplib.SMTPSenderRefused) as refused:
        await asyncio.to_thread(send, "127.0.0.1")
    assert refused.value.smtp_code == 530
    assert await asyncio.to_thread(send, TRUSTED) == {}
    [got] = await eventually(lambda: asyncio.sleep(0, outbound.world.good.mx.for_recipient(rcpt)))
    assert got.sender == "app@anywhere.example"


# ----------------------------------------------------------------------------- what the remote lacks


async def test_8bit_mail_to_a_remote_without_8bitmime_is_downgraded_and_utf8_addresses_bounce(
    outbound: Outbound,
) -> None:
    people = await make_users(outbound.store, "ivan")
    ivan = people["ivan"]
    tag = uuid.uuid4().hex[:6]
    body = f"Subject: 8bit\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nGr\xfc\xdfe {tag}\r\n".encode()
    assert await asyncio.to_thread(submit, outbound.node, ivan, [f"x-{tag}@plain.test"], body) == {}
    plain = outbound.world.plain
    [(commands, data)] = await eventually(lambda: asyncio.sleep(0, [r for r in plain.received if tag.encode() in r[1]
                                                                    or tag.encode() in r[0]]))
    assert data.isascii() and b"BODY=8BITMIME" not in commands
    parsed = email.message_from_bytes(data, policy=email.policy.default)
    assert parsed["Content-Transfer-Encoding"] == "quoted-printable" and f"Gr\xfc\xdfe {tag}" in parsed.get_content()

    def utf8_submit() -> None:
        with smtplib.SMTP("127.0.0.1", outbound.node.port("submission"), timeout=30) as client:
            client.starttls(context=CLIENT_TLS)
            client.login(ivan, "ivan")
            client.sendmail(ivan, ["j\xfcrgen@plain.test"], b"Subject: utf8\r\n\r\nx\r\n", mail_options=["SMTPUTF8"])

    await asyncio.to_thread(utf8_submit)
    [dsn] = await eventually(lambda: asyncio.to_thread(pop_all, outbound.node, ivan))
    _, [failed], _ = report(dsn)
    assert failed["Status"] == "5.6.7" and "SMTPUTF8" in failed["Diagnostic-Code"]


# ----------------------------------------------------------------------------- remotes that misbehave


async def test_misbehaving_remotes_each_defer_with_a_logged_reason_and_nothing_is_lost(outbound: Outbound) -> None:
    people = await make_users(outbound.store, "kim")
    tag = uuid.uuid4().hex[:6]
    rcpts = {mode: f"to-{tag}@{mode}.test" for mode in BAD}
    for rcpt in rcpts.values():
        assert await asyncio.to_thread(submit, outbound.node, people["kim"], [rcpt], b"Subject: bad\r\n\r\nx\r\n") == {}
    reasons = {
        "garbage": r"Malformed SMTP response", "silent": r"timed out|no greeting", "huge": r"Response too long",
        "close-mid-data": r"connection lost|Unexpected EOF|Connection lost",
    }
    for mode, rcpt in rcpts.items():
        lines = await eventually(lambda rcpt=rcpt: asyncio.sleep(0, outbound.log_lines(
            rf"event=outbound .*rcpt={re.escape(rcpt)} .*result=deferred")), timeout=15)
        assert re.search(reasons[mode], lines[0]), (mode, lines[0])
        assert outbound.world.bad[mode].connections >= 1
    queued = {r.address for e in await outbound.store.list_queue() for r in e.pending}
    assert set(rcpts.values()) <= queued  # all still queued: nothing lost
    # The remotes are mended (their MX now points at a good one), and the operator retries now.
    records = outbound.world.dns.zone.records
    try:
        for mode in BAD:
            records[(f"mx.{mode}.test", "A")] = [GOOD]
        retried = outbound.cli("queue", "retry", "--all")
        assert retried.returncode == 0 and "due now" in retried.stdout, retried.stderr
        for rcpt in rcpts.values():
            await eventually(lambda rcpt=rcpt: asyncio.sleep(0, outbound.world.good.mx.for_recipient(rcpt)), timeout=15)
    finally:
        for mode, host in BAD.items():
            records[(f"mx.{mode}.test", "A")] = [host]


# ----------------------------------------------------------------------------- routing, loops, connections (one store)


async def test_a_dns_servfail_defers_with_a_logged_reason_and_the_mail_goes_once_dns_answers(
    outbound: Outbound,
) -> None:
    on_one_store(outbound)
    people = await make_users(outbound.store, "lena")
    rcpt = f"x-{uuid.uuid4().hex[:6]}@servfail.test"
    zone = outbound.world.dns.zone
    zone.failing.add("servfail.test")
    try:
        assert await asyncio.to_thread(submit, outbound.node, people["lena"], [rcpt], b"Subject: dns\r\n\r\nx\r\n") == {}
        [line] = await eventually(lambda: asyncio.sleep(0, outbound.log_lines(
            rf"event=outbound .*rcpt={rcpt} remote=servfail\.test route=mx result=deferred "
            r'reply="451 4\.4\.3 MX lookup for servfail\.test failed: .*SERVFAIL.*" attempt=1 ms=\d+$')))
        entry_id = re.search(r" id=(\w+) ", line).group(1)  # type: ignore[union-attr]
        [entry] = [e for e in await outbound.store.list_queue("servfail.test") if e.id.hex == entry_id]
        assert [(r.address, r.state) for r in entry.recipients] == [(rcpt, "pending")]
        assert outbound.world.good.mx.for_recipient(rcpt) == []
    finally:
        zone.failing.discard("servfail.test")
    # The next attempt (min_backoff 1 s) finds the MX and delivers it, once.
    await eventually(lambda: asyncio.sleep(0, outbound.world.good.mx.for_recipient(rcpt)))
    assert outbound.log_lines(rf"event=outbound id={entry_id} rcpt={rcpt} remote=mx1\.remote\.test\[{GOOD}\] "
                              r"route=mx result=sent .* attempt=[2-9]")
    assert len(outbound.world.good.mx.for_recipient(rcpt)) == 1


async def test_a_domain_without_mx_is_reached_on_its_aaaa_address_when_its_a_address_refuses(
    outbound: Outbound,
) -> None:
    on_one_store(outbound)
    if outbound.world.six is None:
        pytest.skip("this machine's loopback has no IPv6 (::1)")
    people = await make_users(outbound.store, "mona")
    rcpt = f"v6-{uuid.uuid4().hex[:6]}@six.test"
    assert await asyncio.to_thread(submit, outbound.node, people["mona"], [rcpt], b"Subject: six\r\n\r\nx\r\n") == {}
    [got] = await eventually(lambda: asyncio.sleep(0, outbound.world.six.mx.for_recipient(rcpt)))  # type: ignore[union-attr]
    assert got.peer == SIX and got.sender == people["mona"]
    [line] = await eventually(lambda: asyncio.sleep(0, outbound.log_lines(rf"event=outbound .*rcpt={rcpt} ")))
    assert re.search(r"remote=six\.test\[::1\] route=mx result=sent .* attempt=1 ", line), line


async def test_a_loop_bounces_at_once_with_one_dsn_per_message_and_the_other_recipients_are_sent(
    outbound: Outbound,
) -> None:
    on_one_store(outbound)
    people = await make_users(outbound.store, "nora")
    nora, tag = people["nora"], uuid.uuid4().hex[:6]
    hops, named, other = f"hops-{tag}@remote.test", f"named-{tag}@remote.test", f"other-{tag}@remote.test"
    # 50 Received: fields, and submission adds the 51st: more than delivery.max_hops (50).
    many = b"".join(b"Received: from relay%d.example by relay%d.example; Thu, 1 Jan 2026 00:00:00 +0000\r\n"
                    % (k, k + 1) for k in range(50))
    assert await asyncio.to_thread(submit, outbound.node, nora, [hops], many + b"Subject: round\r\n\r\nx\r\n") == {}
    looped = f"Delivered-To: {named}\r\nSubject: again\r\n\r\nx\r\n".encode()
    assert await asyncio.to_thread(submit, outbound.node, nora, [named, other], looped) == {}
    await eventually(lambda: asyncio.sleep(0, len(outbound.log_lines(rf"event=outbound-done .*rcpt=(?:{hops}|{named}) "
                                                                     r".*result=bounced")) == 2))
    # Each bounced recipient's DSN went out before its failure was recorded: nothing more is coming.
    dsns = await asyncio.to_thread(pop_all, outbound.node, nora)
    assert len(dsns) == 2, [report(m)[1] for m in dsns]
    failed = {r["Final-Recipient"]: r for m in dsns for r in report(m)[1]}
    assert set(failed) == {f"rfc822; {hops}", f"rfc822; {named}"}
    assert all(r["Status"] == "5.4.6" and r["Action"] == "failed" for r in failed.values())
    assert "Too many hops (51 Received: fields)" in failed[f"rfc822; {hops}"]["Diagnostic-Code"]
    assert "Delivered-To names this recipient" in failed[f"rfc822; {named}"]["Diagnostic-Code"]
    for rcpt in (hops, named):
        [line] = outbound.log_lines(rf"event=outbound id=\w+ rcpt={rcpt} ")
        assert re.search(r' result=bounced reply="554 5\.4\.6 .*mail loop" attempt=1 ms=\d+$', line), line
        assert outbound.world.good.mx.for_recipient(rcpt) == []
    [sent] = await eventually(lambda: asyncio.sleep(0, outbound.world.good.mx.for_recipient(other)))
    assert sent.recipients == [other]


async def test_one_connection_carries_several_messages_to_one_destination(outbound: Outbound) -> None:
    on_one_store(outbound)
    mx = outbound.world.reuse.mx
    before = mx.sessions
    tag = uuid.uuid4().hex[:6]
    rcpts = [f"r{k}-{tag}@reuse.test" for k in range(6)]
    due = time.time() + 1.0  # all due at once: six deliveries to one destination side by side
    for rcpt in rcpts:
        await outbound.store.enqueue(f"Subject: {rcpt}\r\n\r\nx\r\n".encode(), "op@sender.example", [rcpt], due=due)
    await eventually(lambda: asyncio.sleep(0, all(mx.for_recipient(r) for r in rcpts)))
    assert all(len(mx.for_recipient(r)) == 1 for r in rcpts)
    # destination_concurrency = 2: six messages over at most two connections, so the
    # connections carried several each (the remote counts the sessions it was opened).
    sessions = mx.sessions - before
    assert 1 <= sessions <= 2, sessions


# ----------------------------------------------------------------------------- the queue seen by an operator


async def test_the_queue_commands_show_hold_release_and_delete(outbound: Outbound) -> None:
    store = outbound.store
    tag = uuid.uuid4().hex[:6]
    first, second = f"a-{tag}@remote.test", f"b-{tag}@remote.test"
    held = await store.enqueue(b"Subject: wait\r\n\r\nx\r\n", "op@sender.example", [first], due=time.time() + 600)
    gone = await store.enqueue(b"Subject: drop\r\n\r\nx\r\n", "op@sender.example", [second], due=time.time() + 600)
    assert outbound.cli("queue", "hold", held.hex).returncode == 0
    listed = json.loads(outbound.cli("queue", "list", "--domain", "remote.test", "--json").stdout)
    mine = {e["id"]: e for e in listed if e["id"] in (held.hex, gone.hex)}
    assert mine[held.hex]["held"] and not mine[gone.hex]["held"]
    assert mine[held.hex]["recipients"] == [{"address": first, "state": "pending", "reply": "", "remote": ""}]
    table = outbound.cli("queue", "list").stdout
    assert re.search(rf"^{held.hex} .* held  <op@sender\.example> -> {first}$", table, re.M), table
    shown = outbound.cli("queue", "show", held.hex)
    assert "sender:      op@sender.example" in shown.stdout and "Subject: wait" in shown.stdout
    assert outbound.cli("queue", "delete", gone.hex).returncode == 0
    missing = outbound.cli("queue", "show", gone.hex)
    assert missing.returncode == 1 and "no such queue entry" in missing.stderr
    assert outbound.cli("queue", "show", "nonsense").returncode == 1
    assert outbound.cli("queue", "release", held.hex).returncode == 0
    await eventually(lambda: asyncio.sleep(0, outbound.world.good.mx.for_recipient(first)))
    assert outbound.world.good.mx.for_recipient(second) == []


# ----------------------------------------------------------------------------- the lifetime (sent at the start)


async def test_a_remote_down_past_the_lifetime_bounces_after_one_delay_warning_and_the_null_sender_never_bounces(
    outbound: Outbound,
) -> None:
    doomed = outbound.doomed
    sender = doomed["sender"]
    await asyncio.sleep(max(0.0, doomed["since"] + LIFETIME + 3 - time.monotonic()))
    messages = await eventually(lambda: asyncio.to_thread(lambda: len(pop_all(outbound.node, sender)) >= 2
                                                          and pop_all(outbound.node, sender)))
    await asyncio.sleep(1.0)
    assert len(await asyncio.to_thread(pop_all, outbound.node, sender)) == 2
    subjects = [report(m)[0] for m in messages]
    assert subjects == ["Delayed Mail (still being retried)", "Undelivered Mail Returned to Sender"]
    _, [delayed], _ = report(messages[0])
    _, [failed], _ = report(messages[1])
    assert delayed["Action"] == "delayed" and delayed["Final-Recipient"] == "rfc822; someone@down.test"
    assert failed["Action"] == "failed" and failed["Status"] == "4.4.7"
    assert "cannot connect" in failed["Diagnostic-Code"] and "expired" in failed["Diagnostic-Code"]
    # The two from <> were given up the same way (one refused, one expired): no DSN for either.
    for entry_id in doomed["nulls"]:
        assert outbound.log_lines(rf"event=outbound-done id={entry_id.hex} .*result=bounced")
        assert not outbound.log_lines(rf"event=dsn id={entry_id.hex}")
    remaining = {e.id for e in await outbound.store.list_queue()}
    assert not remaining & set(doomed["nulls"])


def test_the_counters_say_what_was_queued_sent_deferred_and_bounced(outbound: Outbound) -> None:
    """Last in the module: what the tests above did, as the node's Prometheus endpoint counts it."""
    from tests.test_metrics import scrape

    samples = scrape(outbound.node)

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    sent = len(outbound.log_lines(r"event=outbound-done .*result=sent"))
    bounced = len(outbound.log_lines(r"event=outbound-done .*result=bounced"))
    assert sent >= 10 and value("cassmail_outbound_total", result="sent") == sent
    assert bounced >= 6 and value("cassmail_outbound_total", result="bounced") == bounced  # 5.1.1, null MX,
    # SMTPUTF8, the null sender's 5xx, and the two that outlived the lifetime
    deferred = len(outbound.log_lines(r"event=outbound .*result=deferred"))
    assert deferred >= 5 and value("cassmail_outbound_total", result="deferred") == deferred
    assert value("cassmail_outbound_queued_total") >= 10
    assert value("cassmail_outbound_queued_recipients_total") >= value("cassmail_outbound_queued_total")
    assert value("cassmail_outbound_queue_age_seconds_count") == sent + bounced
    assert value("cassmail_store_seconds_count", op="enqueue") >= value("cassmail_outbound_queued_total")


# ----------------------------------------------------------------------------- a smarthost, verified TLS (mbox)


@dataclass
class Smarthost:
    """A node that sends everything through `relay.relayhost` (smarthost.test, AUTH over
    STARTTLS), but for the transport map's checked.test (verify: the default `relay.tls`) and
    loose.test (may, by `relay.tls_policy`), both to an MX with a self-signed certificate."""

    node: Node
    store: Store
    settings: Settings
    world: World

    def log_lines(self, pattern: str) -> list[str]:
        return re.findall(rf"^.*{pattern}.*$", self.node.log_text(), re.M)


@pytest.fixture(scope="module")
async def smarthost(world: World, tls_files: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
                    request: pytest.FixtureRequest) -> AsyncIterator[Smarthost]:
    settings = node_settings(backend_settings_for("mbox", request))
    checked = f"[mx.checked.test]:{world.port}"
    node = Node(
        settings, tmp_path_factory.mktemp("smarthost"), submission={**tls_files}, imap={"enabled": False},
        pop3={"enabled": False}, lmtp={"enabled": False},
        delivery={"enabled": True, "min_backoff": 1.0, "max_backoff": 2.0, "lease": 10.0, "poll_interval": 0.2},
        relay={"nameservers": [world.dns.address], "port": world.port, "connect_timeout": 2.0, "timeout": 3.0,
               "dns_timeout": 3.0, "connection_reuse_time": 0.0, "relayhost": f"[smarthost.test]:{world.port}",
               "relayhost_username": RELAY_LOGIN[0], "relayhost_password": RELAY_LOGIN[1], "tls": "verify",
               "tls_policy": {"loose.test": "may"}, "transport": {"checked.test": checked, "loose.test": checked}},
    )
    async with opened_store(settings) as store:
        node.start()
        try:
            yield Smarthost(node, store, settings, world)
        finally:
            assert node.stop() == 0
            assert "Traceback" not in node.log_text(), node.log_text()[-5000:]


async def test_a_relayhost_takes_mail_for_any_domain_over_starttls_after_auth(smarthost: Smarthost) -> None:
    people = await make_users(smarthost.store, "olga")
    rcpt = f"friend-{uuid.uuid4().hex[:6]}@anywhere.example"  # no DNS record: the relayhost routes it
    assert await asyncio.to_thread(submit, smarthost.node, people["olga"], [rcpt], b"Subject: via\r\n\r\nx\r\n") == {}
    [got] = await eventually(lambda: asyncio.sleep(0, smarthost.world.relay.mx.for_recipient(rcpt)))
    assert got.tls and got.login == RELAY_LOGIN[0] and got.sender == people["olga"]
    await eventually(lambda: asyncio.sleep(0, smarthost.log_lines(
        rf"event=outbound .*rcpt={rcpt} remote=smarthost\.test\[{RELAY}\] route=relayhost result=sent")))


async def test_a_relayhost_without_starttls_defers_and_nothing_is_sent_in_clear(smarthost: Smarthost) -> None:
    people = await make_users(smarthost.store, "pia")
    rcpt = f"friend-{uuid.uuid4().hex[:6]}@anywhere.example"
    records = smarthost.world.dns.zone.records
    records[("smarthost.test", "A")] = [IMPLICIT]  # an MX that offers no STARTTLS (and takes mail without AUTH)
    try:
        assert await asyncio.to_thread(submit, smarthost.node, people["pia"], [rcpt], b"Subject: clear?\r\n\r\nx\r\n") == {}
        await eventually(lambda: asyncio.sleep(0, smarthost.log_lines(
            rf"event=outbound .*rcpt={rcpt} remote=smarthost\.test\[{IMPLICIT}\] route=relayhost result=deferred "
            rf'reply="451 4\.4\.2 smarthost\.test\[{IMPLICIT}\]: TLS is required \(encrypt\) but the remote does not '
            r'offer STARTTLS"')))
        assert smarthost.world.implicit.mx.for_recipient(rcpt) == []
        assert [r.state for e in await smarthost.store.list_queue("anywhere.example") for r in e.recipients
                if r.address == rcpt] == ["pending"]
    finally:
        records[("smarthost.test", "A")] = [RELAY]
    # The relayhost offers TLS again: the next attempt sends it there, after AUTH.
    [got] = await eventually(lambda: asyncio.sleep(0, smarthost.world.relay.mx.for_recipient(rcpt)))
    assert got.tls and got.login == RELAY_LOGIN[0]
    assert smarthost.world.implicit.mx.for_recipient(rcpt) == []


async def test_tls_verify_refuses_an_unverifiable_certificate_and_defers(smarthost: Smarthost) -> None:
    people = await make_users(smarthost.store, "rita")
    tag = uuid.uuid4().hex[:6]
    strict, loose = f"s-{tag}@checked.test", f"l-{tag}@loose.test"
    mx = smarthost.world.checked.mx
    assert await asyncio.to_thread(submit, smarthost.node, people["rita"], [loose, strict],
                                   b"Subject: tls\r\n\r\nx\r\n") == {}
    # One next hop, one self-signed certificate: "may" sends over it, "verify" will not (and
    # the connection made for "may" does not carry what must be verified).
    [got] = await eventually(lambda: asyncio.sleep(0, mx.for_recipient(loose)))
    assert got.tls and got.recipients == [loose]
    [line] = await eventually(lambda: asyncio.sleep(0, smarthost.log_lines(rf"event=outbound .*rcpt={strict} ")))
    assert re.search(rf"remote=mx\.checked\.test\[{CHECKED}\] route=transport result=deferred "
                     rf'reply="451 4\.4\.2 mx\.checked\.test\[{CHECKED}\]: TLS handshake failed: .*certificate verify failed',
                     line), line
    assert mx.for_recipient(strict) == []
    # The remote holds the message before the worker has its 250 and records it: wait for that.
    async def recorded() -> Any:
        for e in await smarthost.store.list_queue("checked.test"):
            if {r.address: r.state for r in e.recipients} == {strict: "pending", loose: "sent"}:
                return e
    entry = await eventually(recorded)
    await smarthost.store.delete_queued(entry.id)  # it would be retried until the lifetime ends


async def test_a_submission_whose_queue_write_fails_is_451_and_leaves_no_local_copy(
    smarthost: Smarthost, tls_files: dict[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cassmail import smtp as smtp_front
    from cassmail.delivery import DeliveryWorker
    from cassmail.store.base import StoreUnavailable

    store = smarthost.store
    people = await make_users(store, "sara", "tom")
    sara, tom = people["sara"], people["tom"]
    remote = f"far-{uuid.uuid4().hex[:6]}@anywhere.example"
    # This process's own submission listener over the node's store, with a delivery worker of
    # one slot: the message is handed over to it, and a failed queue write gives the slot back.
    settings = dataclasses.replace(smarthost.settings)
    settings.delivery = dataclasses.replace(settings.delivery, concurrency=1)
    settings.relay = dataclasses.replace(smarthost.node.settings.relay)
    settings.submission = dataclasses.replace(settings.submission, enabled=True, listen="127.0.0.1:0", **tls_files)
    for name in ("smtp", "submissions", "lmtp"):
        setattr(settings, name, dataclasses.replace(getattr(settings, name), enabled=False))
    worker = DeliveryWorker(settings, store)
    servers = [server for server, _ in await smtp_front.start(settings, store, outbound=worker)]
    port = servers[0].sockets[0].getsockname()[1]

    def send() -> dict:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
            client.starttls(context=CLIENT_TLS)
            client.login(sara, "sara")
            return client.sendmail(sara, [tom, remote], b"Subject: both\r\n\r\nx\r\n")

    async def refused(*args: Any, **kwargs: Any) -> uuid.UUID:
        raise StoreUnavailable("injected: the queue write timed out")

    try:
        monkeypatch.setattr(store, "enqueue", refused)
        with pytest.raises(smtplib.SMTPDataError) as failed:
            await asyncio.to_thread(send)
        assert failed.value.smtp_code == 451 and b"4.3.0" in failed.value.smtp_error
        assert b"injected" not in failed.value.smtp_error
        assert await inbox(store, tom) == [] and await inbox(store, sara, "Sent") == []
        assert worker.reserve() is not None  # the one slot was given back
        worker.unreserve()
        monkeypatch.undo()
        assert await asyncio.to_thread(send) == {}  # the sender's retry: one copy of everything
        assert len(await inbox(store, tom)) == 1 and len(await inbox(store, sara, "Sent")) == 1
        # Handed over to this process's worker, which sends it through the relayhost at once.
        await eventually(lambda: asyncio.sleep(0, smarthost.world.relay.mx.for_recipient(remote)))
    finally:
        for server in servers:
            server.close()
        await worker.stop()
    assert len(smarthost.world.relay.mx.for_recipient(remote)) == 1


async def test_a_bounce_to_a_sender_over_quota_is_dropped_not_retried(outbound: Outbound) -> None:
    """The DSN cannot be stored (the sender is over quota): it is dropped and logged, and the
    entry is finished rather than tried again (which would send the delivered copy twice)."""
    people = await make_users(outbound.store, "quinn")
    quinn = people["quinn"]
    await outbound.store.deliver(b"Subject: old\r\n\r\n" + b"y" * 500, [Target(quinn)])
    await outbound.store.set_quota(quinn, 1)
    friend = f"friend-{uuid.uuid4().hex[:6]}@remote.test"
    body = b"Subject: from a full mailbox\r\n\r\nx\r\n"
    assert await asyncio.to_thread(submit, outbound.node, quinn, ["reject@remote.test", friend], body) == {}
    await eventually(lambda: asyncio.sleep(0, outbound.log_lines(rf"event=dsn .*to={quinn} result=dropped")))
    await asyncio.sleep(1.0)  # a second attempt would have come by now
    assert len(outbound.world.good.mx.for_recipient(friend)) == 1
    assert len(await inbox(outbound.store, quinn)) == 1 and await inbox(outbound.store, quinn, "Sent") == []
