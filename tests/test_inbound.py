"""The MX's checks between DATA and the store, end to end: a real `cassmail serve`, a DNS server of
the test's own on loopback holding SPF, DKIM and DMARC records, messages signed by dkimpy with the
test's keys (and forged or altered ones), a real rspamd (every one of its actions driven by its own
GTUBE test strings or a rule of the test's own rspamd configuration), with a relay in front of it
that breaks connections on demand; results read back over IMAP and POP3. On the Cassandra and
mbox stores."""

from __future__ import annotations

import asyncio
import dataclasses
import email.header
import email.utils
import imaplib
import poplib
import random
import re
import smtplib
import string
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import dkim
import pytest
import spf

from cassmail.config import Settings
from cassmail.delivery.dkim import generate
from cassmail.inbound import authcheck
from cassmail.inbound.authcheck import RESULTS_MAX
from cassmail.smtp.handler import HEADER_RESERVE, TRACE_RESERVE, advertised_size
from cassmail.store import make_store
from cassmail.store.base import Store, Target
from tests.conftest import FAST_HASH, backend_settings_for, hash_password
from tests.inbound_peers import GTUBE, GTUBE_ADD_HEADER, GTUBE_REWRITE_SUBJECT, Breaker, RedisServer, RspamdServer
from tests.nodes import Node, node_settings
from tests.outbound_peers import Dns, free_port_on
from tests.test_smtp import Raw

pytestmark = pytest.mark.cassandra

AUTHSERV = "mx.test"
#: The store's message size limit of the `marking` node: small, so the SIZE boundary is cheap.
LIMIT = 64 * 1024


def txt(text: str) -> str:
    """A TXT record's rdata in zone-file form, cut into strings of at most 200 characters."""
    return " ".join(f'"{text[i:i + 200]}"' for i in range(0, len(text), 200))


@dataclass
class World:
    dns: Dns
    keys: dict[str, bytes]  # domain -> private key PEM (selector "sel")
    rspamd: RspamdServer
    breaker: Breaker  # in front of rspamd, for the `marking` node


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    dns = Dns().start()
    redis = RedisServer().start()
    rspamd = RspamdServer(tmp_path_factory.mktemp("rspamd"), dns.address, redis=redis.address, test_rules=True)
    zone = dns.zone
    keys: dict[str, bytes] = {}
    for domain in ("good.test", "reject.test", "lists.test", "brand.co.uk"):
        pem, public = generate(1024)
        keys[domain] = pem.encode()
        zone.add(f"sel._domainkey.{domain}", "TXT", txt(f"v=DKIM1; k=rsa; p={public}"))
    zone.add("good.test", "TXT", txt("v=spf1 ip4:127.0.0.1 -all"))
    zone.add("_dmarc.good.test", "TXT", txt("v=DMARC1; p=reject"))
    zone.add("mail.good.test", "TXT", txt("v=spf1 ip4:127.0.0.1 -all"))
    zone.add("reject.test", "TXT", txt("v=spf1 ip4:192.0.2.1 -all"))
    zone.add("_dmarc.reject.test", "TXT", txt("v=DMARC1; p=reject; adkim=s"))
    zone.add("quarantine.test", "TXT", txt("v=spf1 ip4:192.0.2.1 -all"))
    zone.add("_dmarc.quarantine.test", "TXT", txt("v=DMARC1; p=quarantine"))
    zone.add("lists.test", "TXT", txt("v=spf1 ip4:127.0.0.1 -all"))
    zone.add("nodmarc.test", "TXT", txt("v=spf1 ?all"))
    # The policy lives at the organisational domain only (co.uk is a public suffix).
    zone.add("_dmarc.brand.co.uk", "TXT", txt("v=DMARC1; p=none; sp=reject"))
    zone.add("news.brand.co.uk", "TXT", txt("v=spf1 ip4:192.0.2.1 -all"))
    zone.add("broken.test", "TXT", txt("v=spf1 ip4:127.0.0.1 -all"))
    zone.failing.add("_dmarc.broken.test")
    rspamd_started = rspamd.start_process()
    breaker = Breaker(("127.0.0.1", rspamd.port)).start()
    try:
        yield World(dns, keys, rspamd_started, breaker)
    finally:
        breaker.stop()
        rspamd.stop()
        redis.stop()
        dns.stop()


@pytest.fixture(scope="module", params=["cassandra", "mbox"])
def in_settings(request: pytest.FixtureRequest) -> Settings:
    return backend_settings_for(request.param, request)


@pytest.fixture(scope="module")
async def in_store(in_settings: Settings) -> AsyncIterator[Store]:
    opened = make_store(in_settings)
    await opened.open()
    yield opened
    await opened.close()


def _node(settings: Settings, world: World, directory: Path, limit: int | None = None, **inbound: object) -> Node:
    settings = node_settings(settings)
    if limit is not None:
        settings.store = dataclasses.replace(settings.store, max_message_size=limit)
    return Node(
        settings, directory,
        submission={"allow_plaintext_auth": True}, lmtp={"enabled": False},
        pop3={"allow_plaintext_auth": True}, imap={"allow_plaintext_auth": True},
        relay={"nameservers": [world.dns.address], "dns_timeout": 3.0},
        inbound={"authentication": True, "authserv_id": AUTHSERV, **inbound},
        metrics={"enabled": True},
    )


@pytest.fixture(scope="module")
def mx(in_settings: Settings, world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """Sender authentication with the default policies, and rspamd."""
    node = _node(in_settings, world, tmp_path_factory.mktemp("mx"), rspamd_url=world.rspamd.url, rspamd_learn=True,
                 rspamd_controller_url=world.rspamd.controller_url).start()
    world.rspamd.wait()
    yield node
    assert node.stop() == 0
    assert "Traceback" not in node.log_text(), node.log_text()[-3000:]


@pytest.fixture(scope="module")
def strict(in_settings: Settings, world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """SPF fail refused, and an rspamd that is not there with rspamd_failure = tempfail."""
    closed = free_port_on("127.0.0.1")
    node = _node(in_settings, world, tmp_path_factory.mktemp("strict"), spf_reject_fail=True,
                 rspamd_url=f"http://127.0.0.1:{closed}", rspamd_failure="tempfail", rspamd_timeout=2.0).start()
    yield node
    assert node.stop() == 0
    assert "Traceback" not in node.log_text(), node.log_text()[-3000:]


@pytest.fixture(scope="module")
def marking(in_settings: Settings, world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """rspamd through the breaker, spam only marked (rspamd_file_junk = false), rspamd_failure at
    its default (accept), and a small message size limit."""
    node = _node(in_settings, world, tmp_path_factory.mktemp("marking"), limit=LIMIT, rspamd_url=world.breaker.url,
                 rspamd_file_junk=False, rspamd_timeout=5.0).start()
    world.rspamd.wait()
    yield node
    assert node.stop() == 0
    assert "Traceback" not in node.log_text(), node.log_text()[-3000:]


@pytest.fixture
async def rcpt(in_store: Store) -> str:
    domain = f"i{uuid.uuid4().hex[:10]}.example"
    await in_store.add_domain(domain)
    address = f"rita@{domain}"
    await in_store.create_user(address, hash_password("rita", FAST_HASH))
    return address


def message(sender: str, subject: str, body: bytes = b"Hello Rita, see you at noon.\r\n", extra: bytes = b"") -> bytes:
    return (f"From: Sender <{sender}>\r\nTo: rita@example.net\r\nSubject: {subject}\r\n"
            f"Message-ID: <{uuid.uuid4().hex}@{sender.rpartition('@')[2]}>\r\n"
            f"Date: {email.utils.formatdate(usegmt=True)}\r\nMIME-Version: 1.0\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n").encode() + extra + b"\r\n" + body


def sign(world: World, domain: str, msg: bytes) -> bytes:
    return dkim.sign(msg, b"sel", domain.encode(), world.keys[domain],
                     include_headers=[b"from", b"to", b"subject", b"message-id", b"date"]) + msg


def send(node: Node, sender: str, rcpt: str, msg: bytes, helo: str = "mail.good.test") -> tuple[int, str]:
    """(code, text) of the reply to the end of DATA."""
    with smtplib.SMTP("127.0.0.1", node.port("smtp"), local_hostname=helo, timeout=30) as client:
        try:
            client.sendmail(sender, [rcpt], msg)
        except smtplib.SMTPDataError as exc:
            return exc.smtp_code, exc.smtp_error.decode()
        return 250, ""


def imap_messages(node: Node, user: str, mailbox: str = "INBOX") -> list[bytes]:
    client = imaplib.IMAP4("127.0.0.1", node.port("imap"), timeout=30)
    try:
        client.login(user, user.split("@")[0])
        typ, _ = client.select(f'"{mailbox}"', readonly=True)
        assert typ == "OK", mailbox
        typ, data = client.fetch("1:*", "(BODY.PEEK[])") if int(_[0]) else ("OK", [])
        return [part[1] for part in data if isinstance(part, tuple)]
    finally:
        client.logout()


def pop_messages(node: Node, user: str) -> list[bytes]:
    client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
    try:
        client.user(user)
        client.pass_(user.split("@")[0])
        return [b"\r\n".join(client.retr(n)[1]) + b"\r\n" for n in range(1, client.stat()[0] + 1)]
    finally:
        client.quit()


def results(stored: bytes) -> list[str]:
    """The Authentication-Results fields of a stored message, unfolded."""
    head = stored.split(b"\r\n\r\n", 1)[0].decode("utf-8", "replace")
    return [re.sub(r"\r\n[ \t]+", " ", m) for m in re.findall(r"^Authentication-Results:[^\r\n]*(?:\r\n[ \t][^\r\n]*)*", head, re.M)]


def head_of(stored: bytes) -> bytes:
    return stored.split(b"\r\n\r\n", 1)[0] + b"\r\n"


def inbound_lines(node: Node) -> list[str]:
    """The node's `event=inbound` log lines, one per checked message, oldest first."""
    return [line for line in node.log_text().splitlines() if "event=inbound " in line]


def inbound_counts(node: Node) -> dict[str, float]:
    """cassmail_inbound_checks_total by its labels, from the node's Prometheus endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{node.port('metrics')}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^cassmail_inbound_checks_total\{(.*?)\} (\S+)$", text, re.M)}


# ----------------------------------------------------------------------------- sender authentication


async def test_a_signed_aligned_message_passes_everything_and_says_so_in_one_header(mx: Node, world: World,
                                                                                    rcpt: str) -> None:
    msg = sign(world, "good.test", message("anna@good.test", "lunch"))
    assert await asyncio.to_thread(send, mx, "anna@good.test", rcpt, msg) == (250, "")
    [stored] = await asyncio.to_thread(imap_messages, mx, rcpt)
    [header] = results(stored)
    assert header.startswith(f"Authentication-Results: {AUTHSERV}; ")
    assert "spf=pass smtp.mailfrom=anna@good.test" in header
    assert "spf=pass smtp.helo=mail.good.test" in header
    assert "dkim=pass header.d=good.test header.s=sel header.b=" in header
    assert "dmarc=pass header.from=good.test" in header and "arc=none" in header
    assert stored.endswith(msg)  # the message itself is untouched, byte for byte
    assert b"X-Spam-Status: No, score=" in stored and b"X-Spam-Flag" not in stored
    assert await asyncio.to_thread(imap_messages, mx, rcpt, "Junk") == []


async def test_a_forged_sender_of_a_reject_domain_gets_550_and_nothing_is_stored(mx: Node, rcpt: str) -> None:
    msg = message("ceo@reject.test", "wire the money")
    code, text = await asyncio.to_thread(send, mx, "ceo@reject.test", rcpt, msg)
    assert code == 550 and text.startswith("5.7.1") and "DMARC" in text and "reject.test" in text
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []


async def test_an_altered_signed_message_fails_dkim_and_strict_alignment_refuses_it(mx: Node, world: World,
                                                                                     rcpt: str) -> None:
    signed = sign(world, "reject.test", message("ceo@reject.test", "invoice"))
    altered = signed.replace(b"Hello Rita", b"Hello Rota")
    code, _ = await asyncio.to_thread(send, mx, "ceo@reject.test", rcpt, altered)
    assert code == 550
    # Signed by good.test: a valid signature, but not aligned with From: reject.test (adkim=s).
    other = sign(world, "good.test", message("ceo@reject.test", "invoice"))
    code, _ = await asyncio.to_thread(send, mx, "anna@good.test", rcpt, other)
    assert code == 550
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []


async def test_a_quarantine_domain_failing_dmarc_is_filed_into_junk(mx: Node, rcpt: str) -> None:
    msg = message("promo@quarantine.test", "you won")
    assert await asyncio.to_thread(send, mx, "promo@quarantine.test", rcpt, msg) == (250, "")
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []
    [stored] = await asyncio.to_thread(imap_messages, mx, rcpt, "Junk")
    [header] = results(stored)
    assert "spf=fail smtp.mailfrom=promo@quarantine.test" in header
    assert "dkim=none" in header and "dmarc=fail (p=quarantine) header.from=quarantine.test" in header


async def test_junk_is_created_when_the_user_deleted_it(mx: Node, in_store: Store, rcpt: str) -> None:
    await in_store.delete_mailbox(rcpt, "Junk")
    assert await asyncio.to_thread(send, mx, "promo@quarantine.test", rcpt, message("promo@quarantine.test", "x")) \
        == (250, "")
    assert len(await asyncio.to_thread(imap_messages, mx, rcpt, "Junk")) == 1


async def test_the_organisational_domain_comes_from_the_public_suffix_list(mx: Node, world: World,
                                                                            rcpt: str) -> None:
    """news.brand.co.uk has no record: brand.co.uk's sp=reject applies, not co.uk's (none)."""
    code, _ = await asyncio.to_thread(send, mx, "news@news.brand.co.uk", rcpt, message("news@news.brand.co.uk", "news"))
    assert code == 550
    # Signed by the organisational domain: relaxed alignment passes.
    signed = sign(world, "brand.co.uk", message("news@news.brand.co.uk", "news"))
    assert await asyncio.to_thread(send, mx, "news@news.brand.co.uk", rcpt, signed) == (250, "")
    [stored] = await asyncio.to_thread(pop_messages, mx, rcpt)
    [header] = results(stored)
    assert "dkim=pass header.d=brand.co.uk" in header and "dmarc=pass header.from=news.brand.co.uk" in header


async def test_a_dns_failure_is_a_temporary_451_never_a_pass(mx: Node, rcpt: str) -> None:
    code, text = await asyncio.to_thread(send, mx, "a@broken.test", rcpt, message("a@broken.test", "hi"))
    assert code == 451 and text.startswith("4.7.5"), text
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []


async def test_every_signature_is_reported_and_forged_results_with_our_id_are_removed(mx: Node, world: World,
                                                                                       rcpt: str) -> None:
    forged = (f"Authentication-Results: {AUTHSERV}; dkim=pass header.d=bank.test; dmarc=pass\r\n"
              f"Authentication-Results: (comment) {AUTHSERV.upper()} ; spf=pass\r\n"
              "Authentication-Results: relay.elsewhere.test; spf=pass smtp.mailfrom=x@good.test\r\n").encode()
    msg = message("anna@good.test", "two signatures", extra=forged)
    signed = sign(world, "good.test", msg)
    # A second signature by another domain whose key does not match (it claims lists.test,
    # signed with good.test's key).
    bad = dkim.sign(signed, b"sel", b"lists.test", world.keys["good.test"], include_headers=[b"from", b"subject"])
    assert await asyncio.to_thread(send, mx, "anna@good.test", rcpt, bad + signed) == (250, "")
    [stored] = await asyncio.to_thread(imap_messages, mx, rcpt)
    found = results(stored)
    ours = [h for h in found if re.match(rf"Authentication-Results: {AUTHSERV};", h)]
    assert len(ours) == 1 and "dkim=pass header.d=bank.test" not in stored.decode()
    assert "Authentication-Results: relay.elsewhere.test;" in stored.decode()  # someone else's, kept
    assert not re.search(rf"\(comment\) {AUTHSERV.upper()}", stored.decode())
    header = ours[0]
    assert "dkim=fail" in header and "header.d=lists.test" in header
    assert "dkim=pass header.d=good.test" in header and "dmarc=pass" in header


async def test_with_the_checks_off_forged_results_with_our_id_are_still_removed(
        in_settings: Settings, world: World, rcpt: str, tmp_path: Path) -> None:
    """Checks off is the default: a forged `dmarc=pass` in this host's name must not reach users."""
    forged = (f"Authentication-Results: {AUTHSERV}; dkim=pass header.d=bank.test; dmarc=pass\r\n"
              "Authentication-Results: relay.elsewhere.test; spf=pass smtp.mailfrom=x@good.test\r\n").encode()
    node = _node(in_settings, world, tmp_path, authentication=False).start()
    try:
        assert await asyncio.to_thread(send, node, "anna@good.test", rcpt,
                                       message("anna@good.test", "forged", extra=forged)) == (250, "")
        [stored] = await asyncio.to_thread(imap_messages, node, rcpt)
    finally:
        assert node.stop() == 0
    assert "Traceback" not in node.log_text()
    assert results(stored) == ["Authentication-Results: relay.elsewhere.test; spf=pass smtp.mailfrom=x@good.test"]
    assert "forged_ar=1" in node.log_text()


async def test_an_arc_sealed_message_from_a_list_is_validated(mx: Node, world: World, rcpt: str) -> None:
    original = message("member@nodmarc.test", "list post")
    relayed = b"Authentication-Results: lists.test; spf=pass smtp.mailfrom=member@nodmarc.test\r\n" + original
    seal = dkim.arc_sign(relayed, b"sel", b"lists.test", world.keys["lists.test"], b"lists.test",
                         include_headers=[b"from", b"to", b"subject"])
    sealed = b"".join(seal) + relayed
    assert await asyncio.to_thread(send, mx, "bounce@lists.test", rcpt, sealed, "mx.lists.test") == (250, "")
    # The same chain with the body changed after sealing.
    tampered = sealed.replace(b"see you at noon", b"see you at one")
    assert await asyncio.to_thread(send, mx, "bounce@lists.test", rcpt, tampered, "mx.lists.test") == (250, "")
    first, second = await asyncio.to_thread(imap_messages, mx, rcpt)
    assert "arc=pass" in results(first)[0] and "arc=fail" in results(second)[0]
    assert "spf=pass smtp.mailfrom=bounce@lists.test" in results(first)[0]


async def test_submission_is_not_checked(mx: Node, in_store: Store, rcpt: str) -> None:
    msg = message(rcpt, "from myself")
    with smtplib.SMTP("127.0.0.1", mx.port("submission"), timeout=30) as client:
        client.login(rcpt, "rita")
        assert client.sendmail(rcpt, [rcpt], msg) == {}
    [stored] = await asyncio.to_thread(imap_messages, mx, rcpt)
    assert results(stored) == [] and b"X-Spam-" not in stored


async def test_spf_fail_is_refused_only_where_the_operator_says_so(mx: Node, strict: Node, rcpt: str) -> None:
    msg = message("x@nodmarc.test", "spf")
    # The default MX accepts an SPF fail of a domain without DMARC (the A-R header says fail)...
    assert await asyncio.to_thread(send, mx, "x@reject.test", rcpt, message("x@nodmarc.test", "spf")) == (250, "")
    [stored] = await asyncio.to_thread(imap_messages, mx, rcpt)
    assert "spf=fail smtp.mailfrom=x@reject.test" in results(stored)[0]
    # ...spf_reject_fail refuses it.
    code, text = await asyncio.to_thread(send, strict, "x@reject.test", rcpt, msg)
    assert code == 550 and text.startswith("5.7.23")


MALFORMED = [
    b"no header block at all, only text\r\n",
    b"From: \r\nFrom: a@good.test, b@reject.test\r\n\r\nx\r\n",
    b"From: =?utf-8?q?=FF=FE?= <@>\r\nSubject: \xff\xfe\r\n\r\n\x00\x01\r\n",
    b"DKIM-Signature: v=1; a=rsa-sha256; d=good.test; s=sel; h=from; bh=!!; b=%%%\r\nFrom: a@good.test\r\n\r\nx\r\n",
    b"DKIM-Signature: garbage\r\nDKIM-Signature: v=1; a=rsa-sha256; d=" + b"x" * 70 + b".test; s=s; h=from; "
    b"bh=AAAA; b=AAAA\r\nFrom: a@" + b"y" * 70 + b".test\r\n\r\nx\r\n",
    b"ARC-Seal: i=1; a=rsa-sha256; cv=none; d=lists.test; s=sel; b=!!\r\nARC-Message-Signature: i=x\r\n"
    b"ARC-Authentication-Results: i=1; lists.test; spf=pass\r\nFrom: a@nodmarc.test\r\n\r\nx\r\n",
]


async def test_malformed_messages_get_an_answer_never_an_internal_error(mx: Node, rcpt: str) -> None:
    """Hostile headers are the checks' permerror or fail, not a 451 the sender would retry forever."""
    for msg in MALFORMED:
        code, text = await asyncio.to_thread(send, mx, "a@nodmarc.test", rcpt, msg, "[127.0.0.1]")
        assert code in (250, 550), (msg[:60], code, text)
        assert "Internal error" not in text
    # rspamd may judge them spam: filed into Junk then.
    stored = [*await asyncio.to_thread(imap_messages, mx, rcpt), *await asyncio.to_thread(imap_messages, mx, rcpt, "Junk")]
    assert len(stored) >= 4 and all(len(results(m)) == 1 for m in stored)


# ----------------------------------------------------------------------------- rspamd


async def test_rspamd_rejects_gtube_and_adds_headers_to_clean_mail(mx: Node, world: World, rcpt: str) -> None:
    spam = sign(world, "good.test", message("anna@good.test", "offer", body=GTUBE + b"\r\n"))
    code, text = await asyncio.to_thread(send, mx, "anna@good.test", rcpt, spam)
    assert code == 550 and "spam" in text
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []
    forged = b"X-Spam-Status: No, score=-100\r\nX-Spam-Flag: NO\r\n"
    clean = sign(world, "good.test", message("anna@good.test", "agenda", extra=forged))
    assert await asyncio.to_thread(send, mx, "anna@good.test", rcpt, clean) == (250, "")
    [stored] = await asyncio.to_thread(pop_messages, mx, rcpt)
    head = stored.split(b"\r\n\r\n", 1)[0]
    assert re.search(rb"^X-Spam-Status: No, score=-?\d+\.\d\d required=\d+\.\d\d\r$", head, re.M)
    assert b"X-Spam-Action: no action" in head and b"X-Spam-Flag: NO" not in head
    assert head.count(b"X-Spam-Status:") == 1


async def test_what_users_call_junk_and_not_junk_over_imap_is_taught_to_rspamd(mx: Node, world: World, rcpt: str,
                                                                               in_store: Store) -> None:
    # Words of its own for each message and run: rspamd does not learn what it has learned already
    # (208), nor a message its Bayes already puts in the class with certainty, which words shared
    # with an earlier message or run (the other store's) can bring about.
    def words() -> str:
        return " ".join("".join(random.choices(string.ascii_lowercase, k=9)) for _ in range(80))

    bodies = [message("anna@good.test", f"deal {n}", body=f"{words()}\r\n".encode()) for n in range(3)]
    for body in bodies:
        await in_store.deliver(body, [Target(rcpt)])
    before = world.rspamd.learned()

    def learned(more: int, spam: int, ham: int) -> bool:
        """rspamd counts `more` learns, and the node logged that many of each kind for rita."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            log = mx.log_text()
            kinds = [line for line in log.splitlines() if "event=rspamd-learn" in line and f"user={rcpt}" in line]
            done = (sum("kind=spam result=ok" in line for line in kinds), sum("kind=ham result=ok" in line for line in kinds))
            if world.rspamd.learned() >= before + more and done == (spam, ham):
                return True
            time.sleep(0.2)
        return False

    def session(commands: list[str]) -> list[bytes]:
        with imaplib.IMAP4("127.0.0.1", mx.port("imap")) as client:
            client.login(rcpt, "rita")
            client.select("INBOX")
            answers = []
            for command in commands:
                verb, _, rest = command.partition(" ")
                typ, data = client.uid(verb, *rest.split(" ", 1)) if verb != "NOOP" else client.noop()
                assert typ == "OK", (command, data)
                answers.append(data)
            return answers

    [[uids]] = await asyncio.to_thread(session, ["SEARCH ALL"])
    first, second, third = uids.split()
    # Flagged junk (Thunderbird's $Junk): learned as spam; moved into Junk (Apple Mail): spam too.
    await asyncio.to_thread(session, [f"STORE {first.decode()} +FLAGS ($Junk)", f"MOVE {second.decode()} Junk"])
    assert await asyncio.to_thread(learned, 2, 2, 0), world.rspamd.log()
    # Taken back out of Junk: learned as ham; a flag that says nothing about junk teaches nothing.
    with imaplib.IMAP4("127.0.0.1", mx.port("imap")) as client:
        client.login(rcpt, "rita")
        client.select("Junk")
        assert client.uid("MOVE", "1:*", "INBOX")[0] == "OK"
    await asyncio.to_thread(session, [f"STORE {third.decode()} +FLAGS (\\Flagged)"])
    assert await asyncio.to_thread(learned, 3, 2, 1), world.rspamd.log()
    assert "event=rspamd-learn" in mx.log_text() and "result=fail" not in mx.log_text()


async def test_an_unreachable_rspamd_is_a_tempfail_when_set_so(strict: Node, world: World, rcpt: str) -> None:
    clean = sign(world, "good.test", message("anna@good.test", "agenda"))
    code, text = await asyncio.to_thread(send, strict, "anna@good.test", rcpt, clean)
    assert code == 451 and text.startswith("4.7.1") and "Spam filter" in text
    assert re.search(r"event=inbound .*verdict=tempfail .*spam=unavailable", strict.log_text())


async def test_rspamd_add_header_and_rewrite_subject_file_the_message_into_junk(mx: Node, world: World,
                                                                              rcpt: str) -> None:
    """rspamd's own GTUBE variants: "add header" and "rewrite subject" are spam kept for the user
    to see, in Junk, flagged; the second with the Subject rspamd wrote."""
    marked = sign(world, "good.test", message("anna@good.test", "cheap pills", body=GTUBE_ADD_HEADER + b"\r\n"))
    assert await asyncio.to_thread(send, mx, "anna@good.test", rcpt, marked) == (250, "")
    renamed = sign(world, "good.test", message("anna@good.test", "quarterly report",
                                                body=GTUBE_REWRITE_SUBJECT + b"\r\n"))
    assert await asyncio.to_thread(send, mx, "anna@good.test", rcpt, renamed) == (250, "")
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []
    first, second = map(head_of, await asyncio.to_thread(imap_messages, mx, rcpt, "Junk"))
    assert b"X-Spam-Action: add header\r\n" in first and b"\r\nSubject: cheap pills\r\n" in first
    assert b"X-Spam-Action: rewrite subject\r\n" in second
    assert b"\r\nSubject: *** SPAM *** quarterly report\r\n" in second and b"Subject: quarterly report" not in second
    for head in (first, second):
        assert b"X-Spam-Flag: YES\r\n" in head and b"X-Spam-Status: Yes, score=" in head
        assert "dkim=pass header.d=good.test" in results(head)[0]  # as the message came, before the rewrite
    assert re.search(r"verdict=junk .*spam=junk spam_action=rewrite-subject", inbound_lines(mx)[-1])


async def test_rspamd_greylist_and_soft_reject_defer_the_message_with_451(mx: Node, world: World, rcpt: str) -> None:
    """The test rspamd's own rule gives these two actions on demand (a Subject naming them)."""
    for action in ("greylist", "soft reject"):
        msg = sign(world, "good.test", message("anna@good.test", f"news [rspamd-action: {action}]"))
        code, text = await asyncio.to_thread(send, mx, "anna@good.test", rcpt, msg)
        assert code == 451 and text.startswith("4.7.1") and "spam filter" in text, (action, code, text)
        line = inbound_lines(mx)[-1]
        assert re.search(rf"verdict=tempfail .*spam=tempfail spam_action={action.replace(' ', '-')} ", line), line
    assert await asyncio.to_thread(imap_messages, mx, rcpt) == []
    assert await asyncio.to_thread(imap_messages, mx, rcpt, "Junk") == []


async def test_with_rspamd_file_junk_off_spam_is_only_marked_and_stays_in_inbox(marking: Node, world: World,
                                                                              rcpt: str) -> None:
    marked = sign(world, "good.test", message("anna@good.test", "cheap pills", body=GTUBE_ADD_HEADER + b"\r\n"))
    # An encoded Subject: rspamd decodes it, adds its prefix and encodes the result again.
    renamed = sign(world, "good.test", message("anna@good.test", "=?utf-8?q?r=C3=A9sum=C3=A9?=",
                                                body=GTUBE_REWRITE_SUBJECT + b"\r\n"))
    # A Subject so long that rspamd's would pass RFC 5322's line limit: it is kept.
    long_subject = "long " * 197
    kept = sign(world, "good.test", message("anna@good.test", long_subject, body=GTUBE_REWRITE_SUBJECT + b"\r\n"))
    for msg in (marked, renamed, kept):
        assert await asyncio.to_thread(send, marking, "anna@good.test", rcpt, msg) == (250, "")
        assert "verdict=accept " in inbound_lines(marking)[-1] and " spam=junk " in inbound_lines(marking)[-1]
    assert "subject=kept" in inbound_lines(marking)[-1]
    assert await asyncio.to_thread(imap_messages, marking, rcpt, "Junk") == []
    first, second, third = map(head_of, await asyncio.to_thread(imap_messages, marking, rcpt))
    assert all(b"X-Spam-Flag: YES\r\n" in head for head in (first, second, third))
    assert b"X-Spam-Action: add header\r\n" in first and b"\r\nSubject: cheap pills\r\n" in first
    [subject] = re.findall(rb"^Subject: ([^\r]*)\r$", second, re.M)
    assert str(email.header.make_header(email.header.decode_header(subject.decode()))) == "*** SPAM *** r\u00e9sum\u00e9"
    assert f"\r\nSubject: {long_subject}\r\n".encode() in third


async def test_an_unreachable_rspamd_is_by_default_accepted_unfiltered_logged_and_counted(marking: Node, world: World,
                                                                                        rcpt: str) -> None:
    """rspamd_failure = accept: rspamd down (connection refused) or failing (the connection closed
    unanswered) lets the message in without X-Spam-* fields, with a log line and a counter that
    say so; the sender authentication still ran."""
    before, lines = await asyncio.to_thread(inbound_counts, marking), len(inbound_lines(marking))
    try:
        for fault in ("refuse", "close"):
            world.breaker.set(fault)
            msg = sign(world, "good.test", message("anna@good.test", f"agenda ({fault})"))
            assert await asyncio.to_thread(send, marking, "anna@good.test", rcpt, msg) == (250, "")
    finally:
        world.breaker.set("pass")
    refused, closed = inbound_lines(marking)[lines:]
    for line in (refused, closed):
        assert re.search(r"verdict=accept .*dmarc=pass .*spam=unavailable spam_error=", line), line
    assert "Errno 111" in refused  # ECONNREFUSED
    stored = await asyncio.to_thread(imap_messages, marking, rcpt)
    assert len(stored) == 2 and all(b"X-Spam-" not in m and len(results(m)) == 1 for m in stored)
    after = await asyncio.to_thread(inbound_counts, marking)
    key = 'result="unavailable",step="spam"'
    assert after.get(key, 0) == before.get(key, 0) + 2, (before, after)
    # Back: filtered again.
    msg = sign(world, "good.test", message("anna@good.test", "agenda (back)"))
    assert await asyncio.to_thread(send, marking, "anna@good.test", rcpt, msg) == (250, "")
    assert b"X-Spam-Action: no action" in (await asyncio.to_thread(imap_messages, marking, rcpt))[-1]


# ----------------------------------------------------------------------------- SIZE


def filler(n: int) -> bytes:
    """`n` (>= 2) bytes of text lines, each at most 998 characters and CRLF."""
    lines = []
    while n > 1002:
        lines.append(b"x" * 998 + b"\r\n")
        n -= 1000
    if n > 1000:
        lines.append(b"x" * (n // 2 - 2) + b"\r\n")
        n -= n // 2
    return b"".join(lines) + b"x" * (n - 2) + b"\r\n"


def forged_signature(n: int) -> bytes:
    """A DKIM-Signature of a long made-up domain and selector (its key is not found)."""
    domain = ".".join([f"{n:02d}" + "d" * 58] * 3) + ".test"
    return (f"DKIM-Signature: v=1; a=rsa-sha256; c=relaxed/relaxed; d={domain};\r\n"
            f"\ts={'s' * 50}; h=from:subject; bh=AAAA; b=AAAA\r\n").encode()


def message_of_size(world: World, size: int) -> bytes:
    """A message of exactly `size` bytes that makes the checks add all they can: three valid DKIM
    signatures and sixteen that fail with long domains (a long Authentication-Results), rspamd's
    "rewrite subject" test string (X-Spam-* fields and a longer Subject)."""
    forged = b"".join(forged_signature(n) for n in range(16))
    pad = 2
    for _ in range(4):
        body = (b"--b\r\nContent-Type: text/plain\r\n\r\n" + GTUBE_REWRITE_SUBJECT + b"\r\n"
                b"--b\r\nContent-Type: text/plain\r\n\r\n" + filler(pad) + b"--b--\r\n")
        msg = message("anna@good.test", "big one", body=body,
                      extra=b"").replace(b"text/plain; charset=utf-8", b"multipart/mixed; boundary=b")
        for domain in ("lists.test", "brand.co.uk", "good.test"):
            msg = sign(world, domain, msg)
        msg = forged + msg
        if len(msg) == size:
            return msg
        pad += size - len(msg)
    raise AssertionError(f"no message of {size} bytes")


async def test_a_message_of_the_advertised_size_is_stored_whatever_the_checks_add(marking: Node, world: World,
                                                                                rcpt: str) -> None:
    """SIZE leaves room for the trace and for every header the checks may add (the
    Authentication-Results field is bounded however many signatures come): DATA of exactly
    SIZE octets is stored; one more is refused while DATA is read, before any check runs."""
    raw = Raw(marking.port("smtp"))
    ehlo = raw.cmd("EHLO mail.good.test")
    size = int(re.search(r"^250[- ]SIZE (\d+)$", ehlo, re.M).group(1))
    assert size == advertised_size(LIMIT) == LIMIT - HEADER_RESERVE
    msg = await asyncio.to_thread(message_of_size, world, size)
    assert raw.cmd(f"MAIL FROM:<anna@good.test> SIZE={size}").startswith("250 2.1.0")
    assert raw.cmd(f"RCPT TO:<{rcpt}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd(msg + b".").startswith("250 2.0.0")
    [stored] = await asyncio.to_thread(imap_messages, marking, rcpt)
    assert stored.endswith(msg[msg.index(b"Message-ID:"):])  # below the rewritten Subject, as sent
    assert size < len(stored) <= LIMIT and len(stored) - size > TRACE_RESERVE  # more than the trace alone
    head = head_of(stored)
    assert b"\r\nSubject: *** SPAM *** big one\r\n" in head and b"X-Spam-Flag: YES\r\n" in head
    [field] = re.findall(rb"^Authentication-Results:.*?\r\n(?=\S)", head, re.M | re.S)
    assert len(field) <= RESULTS_MAX
    [header] = results(head)
    assert header.count("dkim=pass") == 3 and "more DKIM signatures not reported)" in header
    # One octet more: refused at MAIL when announced, else at the end of DATA, unchecked.
    checked = len(inbound_lines(marking))
    assert raw.cmd(f"MAIL FROM:<anna@good.test> SIZE={size + 1}").startswith("552 5.3.4")
    assert raw.cmd("MAIL FROM:<anna@good.test>").startswith("250 2.1.0")
    assert raw.cmd(f"RCPT TO:<{rcpt}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd(msg[:-2] + b"x\r\n.").startswith("552 5.3.4")
    raw.close()
    assert len(inbound_lines(marking)) == checked
    assert "result=too-large" in [line for line in marking.log_text().splitlines() if "event=delivery " in line][-1]
    assert len(await asyncio.to_thread(imap_messages, marking, rcpt)) == 1


def test_the_added_headers_are_bounded_whatever_the_message_holds() -> None:
    """What the SIZE reserve rests on: an Authentication-Results field of any number of the longest
    results stays within RESULTS_MAX (passing signatures first), and a rewritten Subject that
    would grow the message too much is not used."""
    from cassmail.inbound.spam import SUBJECT_GROWTH_MAX, rewrite_subject

    long = "\u00e9" * 400 + ".test"
    outcome = authcheck.AuthOutcome(
        spf_mfrom="pass", sender="x" * 64 + "@" + long, helo=long, from_domain=long, dmarc="pass",
        dmarc_reason="\u00e9" * 300,
        dkim=[authcheck.DkimResult("fail", long, long, "AAAAAAAA", "\u00e9" * 300) for _ in range(30)]
        + [authcheck.DkimResult("pass", "good.test", "sel", "BBBBBBBB")])
    field = outcome.header(AUTHSERV)
    assert len(field) <= RESULTS_MAX and field.endswith(b"\r\n") and b"\n" not in field[:-2].replace(b"\r\n\t", b"")
    text = field.decode()
    assert text.index("dkim=pass header.d=good.test") < text.index("dkim=fail")
    shown = text.count("dkim=")
    assert f"({31 - shown} more DKIM signatures not reported)" in text
    few = authcheck.AuthOutcome(dkim=[authcheck.DkimResult("pass", "good.test", "sel", "BBBBBBBB")] * 3)
    assert b"not reported" not in few.header(AUTHSERV) and few.header(AUTHSERV).count(b"dkim=pass") == 3
    # A value ending in a line break is no token: it cannot end the field early.
    assert b"\n" not in authcheck.AuthOutcome(sender="a@b.test\n").header(AUTHSERV).replace(b"\r\n", b"")

    msg = b"From: a@b.test\r\nSubject: hello\r\n\r\nbody\r\n"
    assert rewrite_subject(msg, "*** SPAM *** hello") == b"From: a@b.test\r\nSubject: *** SPAM *** hello\r\n\r\nbody\r\n"
    assert rewrite_subject(msg, "x" * (SUBJECT_GROWTH_MAX + 10)) is None
    assert rewrite_subject(msg, "a\r\nBcc: x@y.test") == b"From: a@b.test\r\nSubject: aBcc: x@y.test\r\n\r\nbody\r\n"
    assert rewrite_subject(b"From: a@b.test\r\n\r\nx\r\n", "*** SPAM *** ") == (
        b"Subject: *** SPAM ***\r\nFrom: a@b.test\r\n\r\nx\r\n")


async def test_the_metrics_count_what_the_checks_decided(mx: Node, rcpt: str) -> None:
    before = await asyncio.to_thread(inbound_counts, mx)
    assert (await asyncio.to_thread(send, mx, "ceo@reject.test", rcpt, message("ceo@reject.test", "m")))[0] == 550
    spam = message("anna@good.test", "m", body=GTUBE + b"\r\n")
    assert (await asyncio.to_thread(send, mx, "anna@good.test", rcpt, spam))[0] == 550
    after = await asyncio.to_thread(inbound_counts, mx)
    for key in ('result="reject",step="auth"', 'result="accept",step="auth"', 'result="reject",step="spam"'):
        assert after.get(key, 0) == before.get(key, 0) + 1, (key, before, after)


def test_inbound_settings_are_checked_at_start() -> None:
    from cassmail import config

    for override, key in (("inbound.rspamd_failure=drop", "inbound.rspamd_failure"),
                          ('inbound.rspamd_url="https://spam.example"', "inbound.rspamd_url"),
                          ("inbound.timeout=0", "inbound.timeout"),
                          ('inbound.authserv_id="mx example"', "inbound.authserv_id")):
        with pytest.raises(config.ConfigError, match=key):
            config.load(overrides=[override], env={})


# ----------------------------------------------------------------------------- library internals


def test_pyspf_still_asks_dns_through_its_module_function() -> None:
    """SPF lookups reach the node's resolver only because pyspf 2.0.x calls `spf.DNSLookup` from
    `query.dns`: this fails loudly when a pyspf release changes that."""
    import inspect

    assert spf.DNSLookup is authcheck._spf_dns
    assert "DNSLookup(" in inspect.getsource(spf.query.dns)
