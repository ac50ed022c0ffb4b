"""Hostile input over real sockets: mutated SMTP and POP3 commands (tests/smtp_fuzz.py,
tests/pop3_fuzz.py; IMAP's are in test_imap_fuzz.py), each answered with the protocol's own
reply, never an internal error or a traceback; a fresh client is served afterwards and the
worker's memory stays flat. Also the inputs those fuzzers and others found, one by one, and
SMTP's SIZE at its boundary, ten concurrent large messages with the worker's memory
measured, and `cassmail cluster up` refusing ports that are not its cluster's. On the mbox store: what is tested here is the protocols' parsing,
which is the same on every backend.

Short runs by default; CASSMAIL_FUZZ_COUNT and CASSMAIL_FUZZ_SECONDS make them longer (or run
`python -m tests.smtp_fuzz --help` against a node by hand, see docs/hardening.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import poplib
import smtplib
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import aiosmtpd.smtp
import pytest

from cassmail.auth import hash_password
from cassmail.config import ConfigError, Settings, load
from cassmail.model import Address, InvalidAddress, normalize_domain
from cassmail.store import make_store
from cassmail.smtp.handler import HEADER_RESERVE, TRACE_RESERVE, advertised_size
from cassmail.store.base import Store, Target
from tests import pop3_fuzz, smtp_fuzz
from tests.conftest import FAST_HASH, backend_settings_for
from tests.nodes import CASSMAIL, MAX_SIZE, Node, inbox, node_settings, strip_trace
from tests.test_smtp import Raw
from tests.wire_fuzz import RSS_SLACK_KIB, Findings, rss_growth_kib, rss_kib

COUNT = int(os.environ.get("CASSMAIL_FUZZ_COUNT", "4000"))
SECONDS = float(os.environ.get("CASSMAIL_FUZZ_SECONDS", "10"))
#: The store's message size limit on this node: small, so the SIZE boundary is cheap to reach.
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
async def hard(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[Node, Store, str]]:
    """A node on the mbox store with a small message limit, and a user with three messages."""
    settings = node_settings(backend_settings_for("mbox", request))
    settings.store.max_message_size = LIMIT
    store = make_store(settings)
    await store.open()
    domain = f"h{uuid.uuid4().hex[:8]}.test"
    user = f"anne@{domain}"
    await store.add_domain(domain)
    await store.create_user(user, hash_password("anne", FAST_HASH))
    for n in range(3):
        await store.deliver(b"Subject: m%d\r\nContent-Type: multipart/mixed; boundary=b\r\n\r\n--b\r\n\r\n"
                            b"part %d\r\n--b--\r\n" % (n, n), [Target(user)])
    plain = {"allow_plaintext_auth": True, "auth_failure_delay": 0.0}
    running = Node(settings, tmp_path_factory.mktemp("hardnode"), pop3=plain, imap=plain).start()
    yield running, store, user
    assert running.stop() == 0
    await store.close()
    assert "Traceback" not in running.log_text()


def _served_after(findings: Findings, node: Node) -> None:
    """What every fuzz run must leave: no problem, no traceback, flat memory."""
    assert findings.sent > min(COUNT, 200), findings
    assert not findings.problems, findings.problems[:10]
    log = node.log_text()
    assert "Traceback" not in log and "session-error" not in log and "pop3-error" not in log
    assert rss_growth_kib(findings) < RSS_SLACK_KIB, findings.rss_kib


async def test_mutated_smtp_commands_get_smtp_replies(hard) -> None:
    node, _, _ = hard
    assert node.process is not None
    findings = await asyncio.to_thread(smtp_fuzz.run, node.port("smtp"), COUNT, SECONDS, 5, node.process.pid)
    _served_after(findings, node)
    assert findings.answers.get("2xx", 0) > findings.sent // 50 and findings.answers.get("5xx", 0) > findings.sent // 2
    with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=10) as client:
        assert client.ehlo()[0] == 250 and client.noop()[0] == 250


async def test_mutated_pop3_commands_get_pop3_answers(hard) -> None:
    node, _, user = hard
    assert node.process is not None
    findings = await asyncio.to_thread(pop3_fuzz.run, node.port("pop3"), user, "anne", COUNT, SECONDS, 5,
                                       node.process.pid)
    _served_after(findings, node)
    assert findings.answers.get("+OK", 0) > findings.sent // 50 and findings.answers.get("-ERR", 0) > findings.sent // 2
    client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=10)
    client.user(user)
    client.pass_("anne")
    assert client.stat()[0] == 3
    client.quit()


# ----------------------------------------------------------------------------- SMTP, input by input

SENDER_SYNTAX = [
    b"MAIL FROM:<@a,@b:user@", b"MAIL FROM:<", b"MAIL FROM:<@", b"MAIL FROM:<a@", b"MAIL FROM:a@", b"MAIL FROM:<a@[",
    b'MAIL FROM:<"', b"MAIL FROM:<@a,@", b"MAIL FROM:<a@[ ", b'MAIL FROM:<"qu"h.b\\us._@[ ',
    b"MAIL FROM:<a@\xed\xa0\x80.test>", b"MAIL FROM:<a@\xff.test>",
    b"MAIL FROM:<\xff@b.test> SMTPUTF8",
]


@pytest.mark.parametrize("line", SENDER_SYNTAX, ids=repr)
def test_a_malformed_sender_is_553_5_1_7(hard, line: bytes) -> None:
    node, _, _ = hard
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    assert raw.cmd(line).startswith("553 5.1.7 ")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("250 2.1.0")  # the session goes on
    raw.close()


def test_malformed_recipients_and_vrfy_get_syntax_replies(hard) -> None:
    node, _, user = hard
    domain = user.split("@")[1]
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    assert raw.cmd("MAIL FROM:<a@b.test>").startswith("250 2.1.0")
    for line in (b"RCPT TO:<", b"RCPT TO:<@a,@b:user@", b"RCPT TO:<x@[", b'RCPT TO:<"'):
        assert raw.cmd(line).startswith("553 5.1.3 "), line
    for line in (b"RCPT TO:<anne@\xff>", b"RCPT TO:<\xed\xa0\x80@" + domain.encode() + b">"):
        assert raw.cmd(line).startswith("501 5.1.3 "), line
    for line in (b"VRFY <", b"VRFY <@a,@b:user@", b"VRFY <a@[", b"VRFY <a@[\xff"):
        reply = raw.cmd(line)
        assert reply.startswith("502 5.1.3 Could not VRFY"), (line, reply)
    assert raw.cmd(b"VRFY <a@[\xff").endswith("<a@[\\udcff")  # the client's bad byte is shown, not sent back
    assert raw.cmd(f"RCPT TO:<{user}>").startswith("250 2.1.5")
    raw.close()


def test_an_ascii_a_label_domain_needs_no_smtputf8(hard) -> None:
    node, _, _ = hard
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    assert raw.cmd("MAIL FROM:<user@xn--exmple-cua.test>").startswith("250 2.1.0")
    assert raw.cmd("RCPT TO:<user@xn--exmple-cua.test>").startswith("550 5.7.1 Relaying denied")
    assert raw.cmd("RCPT TO:<user@exämple.test>").startswith("553 5.6.7")  # the same domain in UTF-8 does
    raw.close()


def test_a_reply_never_carries_the_clients_control_characters(hard) -> None:
    node, _, _ = hard
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO client.test")
    raw.send(b"H\rELP\x00\x1b\r\n")
    line = raw.file.readline()
    assert line == b'500 5.5.1 Error: command "H?ELP??" not recognized\r\n'
    assert raw.cmd("NOOP").startswith("250")
    raw.close()


def test_the_address_parser_internals_are_those_this_version_was_tested_with() -> None:
    """The engine replaces aiosmtpd's `_getaddr` (cassmail/smtp/protocol.py) and turns its reply
    to an unparseable MAIL address into 553 5.1.7: if aiosmtpd changes either, this fails (the
    tested range is pinned in pyproject.toml)."""
    for command in ("smtp_MAIL", "smtp_RCPT", "smtp_VRFY"):
        assert "self._getaddr(arg)" in inspect.getsource(getattr(aiosmtpd.smtp.SMTP, command)), command
    assert list(inspect.signature(aiosmtpd.smtp.SMTP._getaddr).parameters) == ["self", "arg"]
    for command in ("smtp_MAIL", "smtp_RCPT"):
        assert '"553 5.1.3 Error: malformed address"' in inspect.getsource(getattr(aiosmtpd.smtp.SMTP, command))


@pytest.mark.parametrize("text", ["a@\udcff.test", "\udced@b.test", "a@b\ud800.test"])
def test_invalid_utf8_in_an_address_is_invalid_input(text: str) -> None:
    with pytest.raises(InvalidAddress, match="invalid UTF-8"):
        Address.parse(text)
    domain = text.rpartition("@")[2]
    if not domain.isascii():
        with pytest.raises(InvalidAddress, match="invalid UTF-8"):
            normalize_domain(domain)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    """Found by the config fuzz target: tomllib let the decoding error through as a traceback."""
    path = tmp_path / "cassmail.toml"
    path.write_bytes(b'[store]\nbackend = "mbox"\n# caf\xe9\n')
    with pytest.raises(ConfigError, match="not UTF-8 at byte 30"):
        load(path, env={})


# ----------------------------------------------------------------------------- SIZE


async def test_a_message_of_the_advertised_size_is_accepted_whatever_the_trace(hard) -> None:
    """The trace headers are added before the store checks its limit: the SIZE advertised leaves
    room for the longest of them, so DATA of exactly SIZE octets is stored, one more is not.
    (With the MX's checks on as well: test_inbound.py's SIZE test.)"""
    node, store, user = hard
    with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
        client.ehlo("h" * 300)  # cut to 128 characters in the Received header
        size = int(client.esmtp_features["size"])
        assert size == advertised_size(LIMIT) == LIMIT - HEADER_RESERVE
    sender = "s" * 64 + "@" + ".".join(["d" * 60] * 3) + ".test"
    raw = Raw(node.port("smtp"))
    raw.cmd("EHLO " + "h" * 300)
    assert raw.cmd(f"MAIL FROM:<{sender}> SIZE={size}").startswith("250 2.1.0")
    assert raw.cmd(f"RCPT TO:<{user}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    head = b"Subject: boundary\r\n\r\n"
    body = head + b"x" * (size - len(head) - 2) + b"\r\n"
    assert len(body) == size
    assert raw.cmd(body + b".").startswith("250 2.0.0")
    assert raw.cmd(f"MAIL FROM:<{sender}> SIZE={size + 1}").startswith("552 5.3.4")
    assert raw.cmd(f"MAIL FROM:<{sender}>").startswith("250 2.1.0")
    assert raw.cmd(f"RCPT TO:<{user}>").startswith("250 2.1.5")
    assert raw.cmd("DATA").startswith("354")
    assert raw.cmd(b"x" * (size + 3) + b"\r\n.").startswith("552 5.3.4")
    raw.close()
    stored = [m for m in await inbox(store, user) if b"Subject: boundary" in m]
    assert len(stored) == 1
    trace, original = strip_trace(stored[0])
    assert original == body and len(stored[0]) <= LIMIT and len(trace) < TRACE_RESERVE


# ----------------------------------------------------------------------------- large messages

#: Megabytes of each of the concurrent large messages (CASSMAIL_BIG_MESSAGE_MB=25 for the full
#: size the issue names; fewer here, so the default run stays short).
BIG_MB = int(os.environ.get("CASSMAIL_BIG_MESSAGE_MB", "8"))
CONCURRENT = 10


def test_large_messages_stay_out_of_the_workers_memory(tmp_path_factory: pytest.TempPathFactory, hard) -> None:
    """Ten concurrent large messages: past smtp.spool_above (1 MiB) DATA goes to a spool file
    that the store reads mapped, so the worker's own memory (RssAnon) grows by about
    spool_above per message, not by the messages' size; afterwards it is back where it was.
    The messages arrive whole."""
    small, _, user = hard
    settings = dataclasses.replace(small.settings)  # the same store, with the usual size limit
    settings.store = dataclasses.replace(small.settings.store, max_message_size=MAX_SIZE)
    node = Node(settings, tmp_path_factory.mktemp("bignode")).start()
    try:
        assert node.process is not None
        pid = node.process.pid
        body = b"Subject: big\r\n\r\n" + (b"y" * 76 + b"\r\n") * (BIG_MB * 1024 * 1024 // 78)

        def send() -> None:
            with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=120) as client:
                client.sendmail("big@remote.test", [user], body)

        send()  # the first message warms up what stays (imports, the store's first writes)
        time.sleep(0.5)
        before = {f: rss_kib(pid, f) for f in ("VmRSS", "RssAnon")}
        peak = dict(before)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for f in peak:
                    peak[f] = max(peak[f], rss_kib(pid, f))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        with ThreadPoolExecutor(CONCURRENT) as pool:
            for future in [pool.submit(send) for _ in range(CONCURRENT)]:
                future.result()
        done.set()
        sampler.join()
        time.sleep(0.5)
        after = {f: rss_kib(pid, f) for f in peak}
        print(" ".join(f"worker {f}: before {before[f] // 1024} MiB, peak {peak[f] // 1024} MiB, after "
                       f"{after[f] // 1024} MiB;" for f in peak) + f" ({CONCURRENT} x {BIG_MB} MB)")
        spool_kib = settings.smtp.spool_above // 1024
        assert peak["RssAnon"] - before["RssAnon"] < CONCURRENT * spool_kib + 16 * 1024, (before, peak)
        assert after["RssAnon"] - before["RssAnon"] < 16 * 1024, (before, after)
        stored = asyncio.run(_inbox_sizes(settings, user))
        assert stored.count(stored[-1]) >= CONCURRENT + 1 and stored[-1] > len(body), stored
    finally:
        assert node.stop() == 0


def test_a_spool_file_that_cannot_be_made_is_answered_451_and_the_session_goes_on(
        tmp_path_factory: pytest.TempPathFactory, hard) -> None:
    """When the spool directory is gone, a message past spool_above is read to its end and
    refused with 451 (the client keeps it), the error is logged without a traceback, and the
    next message of the session, a small one, is taken."""
    small, _, user = hard
    settings = dataclasses.replace(small.settings)
    settings.store = dataclasses.replace(small.settings.store, max_message_size=MAX_SIZE)
    spool = tmp_path_factory.mktemp("spool")
    node = Node(settings, tmp_path_factory.mktemp("spoolnode"), smtp={"spool_dir": str(spool)}).start()
    try:
        spool.rmdir()
        raw = Raw(node.port("smtp"))
        assert raw.cmd("EHLO client.test").startswith("250")
        for body, reply in ((b"Subject: big\r\n\r\n" + (b"z" * 76 + b"\r\n") * 30_000, "451 4.3.0"),
                            (b"Subject: small\r\n\r\nhi\r\n", "250 2.0.0")):
            assert raw.cmd("MAIL FROM:<x@remote.test>").startswith("250")
            assert raw.cmd(f"RCPT TO:<{user}>").startswith("250")
            assert raw.cmd("DATA").startswith("354")
            assert raw.cmd(body + b".").startswith(reply)
        assert raw.cmd("QUIT").startswith("221")
    finally:
        assert node.stop() == 0
    log = node.log_text()
    assert "result=tempfail" in log and "spool file" in log and "Traceback" not in log


async def _inbox_sizes(settings: Settings, user: str) -> list[int]:
    store = make_store(settings)
    await store.open()
    try:
        return [m.size async for m in store.list_messages(user, "INBOX")]
    finally:
        await store.close()


# ----------------------------------------------------------------------------- operator paper cuts


def test_cluster_up_refuses_ports_other_than_the_recorded_clusters(tmp_path) -> None:
    """`cassmail cluster up --native-port P` on a base directory whose cluster was made with
    other ports says so in one line, instead of silently keeping the old ones."""
    (tmp_path / "cluster.json").write_text(json.dumps({"nodes": 1, "rf": 1, "native_port": 19999, "storage_port": 17999}))
    env = {**os.environ, "CASSMAIL_CLUSTER": str(tmp_path)}
    for flags, said in ((["--native-port", "18888"], "--native-port 19999, not 18888"),
                        (["--storage-port", "17777"], "--storage-port 17999, not 17777")):
        result = subprocess.run([CASSMAIL, "cluster", "up", "--nodes", "1", *flags], env=env, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode != 0
        assert len(result.stderr.strip().splitlines()) == 1 and said in result.stderr, result.stderr
    assert json.loads((tmp_path / "cluster.json").read_text())["native_port"] == 19999


def test_every_private_name_of_aiosmtpd_the_engine_uses_is_in_the_pinned_version() -> None:
    """cassmail/smtp/ subclasses aiosmtpd's SMTP and, where aiosmtpd has no public way, uses its
    private names (and asyncio's StreamReader._buffer), each listed with its reason in
    `AIOSMTPD_PRIVATE`. Every private name the package reads, calls or overrides and does not own
    must be listed there; every one listed must be in the installed aiosmtpd in the shape the
    engine was written for (a method with the same parameters, an attribute of the same type on a
    live session). A release that renames or reshapes one fails here, not in production (the range
    is pinned in pyproject.toml)."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    import cassmail.smtp.protocol as protocol

    private = protocol.AIOSMTPD_PRIVATE
    source = "\n".join(path.read_text() for path in sorted(Path(protocol.__file__).parent.glob("*.py")))
    touched = set(re.findall(r"\.(_[a-z][a-z0-9_]*)\b", source))
    own = (set(re.findall(r"\bdef (_[a-z][a-z0-9_]*)\(", source))
           | set(re.findall(r"\bself\.(_[a-z][a-z0-9_]*)\s*(?::[^=\n]+)?=(?!=)", source))
           | set(re.findall(r"^\s+(_[a-z][a-z0-9_]*)\s*(?::[^=\n]+)?=(?!=)", source, re.MULTILINE)))
    theirs = inspect.getsource(aiosmtpd.smtp)
    # Names of our own that aiosmtpd also has are overrides of (or collisions with) its internals.
    overridden = {name for name in own if hasattr(aiosmtpd.smtp.SMTP, name) or re.search(rf"\bself\.{name}\b", theirs)}
    borrowed = (touched - own) | overridden
    assert borrowed == set(private), f"used but not listed: {sorted(borrowed - set(private))}; " \
                                     f"listed but not used: {sorted(set(private) - borrowed)}"

    for name, (owner, shape, why) in private.items():
        assert owner in (aiosmtpd.smtp.SMTP, asyncio.StreamReader) and why, name
        if isinstance(shape, tuple):
            method = getattr(owner, name, None)
            assert callable(method), f"{owner.__name__}.{name} is gone"
            assert tuple(inspect.signature(method).parameters) == shape, f"{owner.__name__}.{name} changed"

    class Handler:  # what the engine asks of its handler until the greeting
        trusted_networks = ()
        role = SimpleNamespace(name="test", lmtp=False)

        def opened(self, engine: object) -> bool:
            return True

        def closed(self, engine: object) -> None:
            pass

    async def live_session() -> None:
        loop = asyncio.get_running_loop()
        engines: list[protocol.CassmailSMTP] = []

        def make() -> protocol.CassmailSMTP:
            engines.append(protocol.CassmailSMTP(Handler(), hostname="test.invalid", loop=loop))
            return engines[-1]

        server = await loop.create_server(make, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        assert (await reader.readline()).startswith(b"220 test.invalid")
        engine = engines[0]
        # aiosmtpd's __init__ hands its reader to StreamReaderProtocol's, where the engine swaps it.
        assert isinstance(engine._reader, protocol._CommandReader)
        for name, (owner, shape, _why) in private.items():
            if isinstance(shape, type):
                holder = engine if owner is aiosmtpd.smtp.SMTP else engine._reader
                value = getattr(holder, name, None)
                assert isinstance(value, shape), f"{owner.__name__}.{name} is {type(value).__name__}, not {shape.__name__}"
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(live_session())
