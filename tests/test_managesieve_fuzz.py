"""Hostile input to ManageSieve over real sockets: mutated commands (tests/managesieve_fuzz.py),
each answered OK, NO or BYE, never the internal error or a traceback, a fresh client served
afterwards and the worker's memory flat. Also the inputs the Sieve and ManageSieve fuzzers
found (tests/fuzz_targets.py), one by one. On the mbox store: what is tested is the parsing,
which is the same on every backend.

A short run by default; CASSMAIL_FUZZ_COUNT and CASSMAIL_FUZZ_SECONDS make it longer (or run
`python -m tests.managesieve_fuzz --help` against a node by hand, see docs/hardening.md).
"""

from __future__ import annotations

import asyncio
import base64
import os
import smtplib
import socket
import uuid
from collections.abc import AsyncIterator

import pytest
from sievelib.managesieve import Client

from cassmail.auth import hash_password
from cassmail.store import make_store
from cassmail.store.base import Store
from tests import managesieve_fuzz
from tests.conftest import FAST_HASH, backend_settings_for
from tests.nodes import Node, inbox, node_settings
from tests.wire_fuzz import RSS_SLACK_KIB, rss_growth_kib

#: sievelib warns of a plain-text login; this node allows them (allow_plaintext_auth).
pytestmark = pytest.mark.filterwarnings("ignore:Credentials are sent over an unencrypted connection")

COUNT = int(os.environ.get("CASSMAIL_FUZZ_COUNT", "4000"))
SECONDS = float(os.environ.get("CASSMAIL_FUZZ_SECONDS", "5"))
#: Scripts on this node are small, so that the fuzzer's literals past the limit are cheap to send.
MAX_SCRIPT = 4096


@pytest.fixture(scope="module")
async def sieve_node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[
        tuple[Node, Store, str]]:
    """A node on the mbox store with ManageSieve (plain-text logins allowed) and SMTP, and a user."""
    settings = node_settings(backend_settings_for("mbox", request))
    settings.sieve.max_script_size = MAX_SCRIPT
    store = make_store(settings)
    await store.open()
    domain = f"m{uuid.uuid4().hex[:8]}.test"
    user = f"anne@{domain}"
    await store.add_domain(domain)
    await store.create_user(user, hash_password("anne", FAST_HASH))
    off = {"enabled": False}
    running = Node(settings, tmp_path_factory.mktemp("sievefuzznode"), submission=off, lmtp=off, pop3=off, imap=off,
                   managesieve={"enabled": True, "allow_plaintext_auth": True, "auth_failure_delay": 0.0}).start()
    yield running, store, user
    assert running.stop() == 0
    await store.close()
    assert "Traceback" not in running.log_text()


def _client(node: Node, user: str) -> Client:
    """sievelib's ManageSieve client, logged in."""
    client = Client("127.0.0.1", node.port("managesieve"))
    assert client.connect(user, "anne", authmech="PLAIN")
    return client


async def test_mutated_managesieve_commands_get_managesieve_answers(sieve_node) -> None:
    node, _, user = sieve_node
    assert node.process is not None
    findings = await asyncio.to_thread(managesieve_fuzz.run, node.port("managesieve"), user, "anne", COUNT, SECONDS,
                                       5, node.process.pid)
    assert findings.sent > min(COUNT, 200), findings
    assert not findings.problems, findings.problems[:10]
    assert findings.answers.get("OK", 0) > findings.sent // 50 and findings.answers.get("NO", 0) > findings.sent // 2
    log = node.log_text()
    assert "Traceback" not in log and "session-error" not in log
    assert "command=PUTSCRIPT" in log  # logged on success only: the fuzzer got as far as storing scripts
    assert rss_growth_kib(findings) < RSS_SLACK_KIB, findings.rss_kib
    client = _client(node, user)
    assert client.putscript("after", "keep;\r\n") and client.setactive("after")
    assert client.listscripts()[0] == "after"
    client.logout()


async def test_a_date_zone_past_24_hours_is_refused_or_keeps_the_message(sieve_node) -> None:
    """Found by the sieve_script fuzz target: `:zone "+3237"` passed the check, and at delivery
    Python's timezone refused the offset with a ValueError that escaped the Sieve step (451 and a
    traceback for every message to the user). Now a literal zone out of range is refused when
    the script is checked, and one made by a variable fails the script at run time: the message
    is kept in INBOX."""
    node, store, user = sieve_node
    client = _client(node, user)
    assert not client.checkscript('require "date";\r\nif currentdate :zone "+3237" :is "year" "2026" { keep; }\r\n')
    assert "zone like +0100" in client.errmsg.decode()
    assert client.checkscript('require "date";\r\nif currentdate :zone "-2359" :is "year" "2026" { keep; }\r\n')
    script = ('require ["date", "variables", "fileinto"];\r\nset "zone" "+3237";\r\n'
              'if date :zone "${zone}" :is "date" "year" "2026" { fileinto "Junk"; }\r\n')
    assert client.putscript("zone", script) and client.setactive("zone")
    client.logout()
    subject = f"zone {uuid.uuid4().hex}"
    message = (f"From: b@x.test\r\nTo: {user}\r\nSubject: {subject}\r\n"
               "Date: Tue, 24 Nov 2026 10:00:00 +0000\r\n\r\nhi\r\n")
    with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as smtp:
        assert smtp.sendmail("b@x.test", [user], message) == {}
    assert any(subject.encode() in m for m in await inbox(store, user))
    assert "result=error" in node.log_text() and "bad zone '+3237'" in node.log_text()


def test_a_literal_size_holds_digits_and_at_most_one_plus(sieve_node) -> None:
    """`{5++}` is not a literal: NO, no bytes read for it, and the session goes on."""
    node, _, user = sieve_node
    with socket.create_connection(("127.0.0.1", node.port("managesieve")), timeout=10) as sock:
        reader = sock.makefile("rb")
        while not reader.readline().startswith(b"OK"):
            pass
        token = base64.b64encode(f"\0{user}\0anne".encode())
        sock.sendall(b'AUTHENTICATE "PLAIN" {%d++}\r\n' % len(token) + b'NOOP "still"\r\n')
        assert reader.readline() == b'NO "Bad literal size"\r\n'
        assert reader.readline() == b'OK (TAG "still") "Done"\r\n'
