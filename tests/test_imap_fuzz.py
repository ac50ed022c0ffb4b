"""Mutated IMAP commands over a real socket (tests/imap_fuzz.py), every store: each gets OK, NO
or BAD (never NO [SERVERBUG]) or an announced BYE, no command the server has whole goes
unanswered (a stall), the node logs no traceback, a fresh client is served afterwards and the
worker's memory stays flat. A short run here; CASSMAIL_FUZZ_COUNT and
CASSMAIL_FUZZ_SECONDS make it longer, or `python -m tests.imap_fuzz --port P --user U --password W
--count 20000` against a node by hand."""

from __future__ import annotations

import asyncio
import imaplib
import os

import pytest

from tests import imap_fuzz
from tests.conftest import backend_settings_for, opened_store
from tests.test_imap_faults import faulty_listener, new_user
from tests.test_imap import plain_node  # noqa: F401 - a fixture
from tests.wire_fuzz import RSS_SLACK_KIB, rss_growth_kib

pytestmark = pytest.mark.cassandra

COUNT = int(os.environ.get("CASSMAIL_FUZZ_COUNT", "1500"))
SECONDS = float(os.environ.get("CASSMAIL_FUZZ_SECONDS", "10"))


async def test_mutated_commands_get_the_protocols_own_answers(plain_node, users) -> None:  # noqa: F811
    findings = await asyncio.to_thread(imap_fuzz.run, plain_node.port("imap"), users["carol"], "carol", COUNT, 3,
                                       SECONDS, plain_node.process.pid)
    assert not findings.problems, findings.problems[:10]
    assert findings.answers.get("OK", 0) > findings.sent // 100 and findings.answers.get("BAD", 0) > findings.sent // 2
    log = plain_node.log_text()
    assert "Traceback" not in log and "event=imap-error" not in log
    assert rss_growth_kib(findings) < RSS_SLACK_KIB, findings.rss_kib
    client = imaplib.IMAP4("127.0.0.1", plain_node.port("imap"), timeout=10)
    client.login(users["carol"], "carol")
    assert client.select("INBOX")[0] == "OK"
    client.logout()


async def test_the_fuzzer_reports_a_command_left_unanswered_not_one_waiting_for_its_literal(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fuzzer counts as a stall: a LITERAL+ APPEND cut short leaves the server rightly
    waiting for the rest ("quiet", at once); a NOOP the server has whole and never answers (its
    store made to hang) is a stall once STALL seconds pass with nothing from the server."""
    monkeypatch.setattr(imap_fuzz, "STALL", 2.0)
    settings = backend_settings_for("mbox", request)
    async with opened_store(settings) as store:
        user = await new_user(store)
        async with faulty_listener(settings, store) as (wrapped, port):
            session = await asyncio.to_thread(imap_fuzz._Session, port, user, "anne")
            assert await asyncio.to_thread(session.command, b"APPEND Junk {10+}\r\nabc") == ("quiet", b"")
            session.close()
            session = await asyncio.to_thread(imap_fuzz._Session, port, user, "anne")
            answer = await asyncio.to_thread(session.command, b"SEARCH SUBJECT {3}")  # the `+`, then the literal
            assert answer == ("tagged", b"f3 OK SEARCH completed\r\n")
            wrapped.stalled = asyncio.Event()
            try:
                assert await asyncio.to_thread(session.command, b"NOOP") == ("stall", b"")
            finally:
                wrapped.stalled.set()
                session.close()
