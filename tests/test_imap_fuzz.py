"""Mutated IMAP commands over a real socket (tests/imap_fuzz.py), every store: each gets OK, NO
or BAD (never NO [SERVERBUG]) or an announced BYE, the node logs no traceback, a fresh client is
served afterwards and the worker's memory stays flat. A short run here; CASSMAIL_FUZZ_COUNT and
CASSMAIL_FUZZ_SECONDS make it longer, or `python -m tests.imap_fuzz --port P --user U --password W
--count 20000` against a node by hand."""

from __future__ import annotations

import asyncio
import imaplib
import os

import pytest

from tests import imap_fuzz
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
