"""Mutated IMAP commands over a real socket (tests/imap_fuzz.py), every store: each gets OK, NO
or BAD (never NO [SERVERBUG]) or an announced BYE, and the node logs no traceback. A short run
here; `python -m tests.imap_fuzz --port P --user U --password W --count 20000` for a long one."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests import imap_fuzz
from tests.test_imap import plain_node  # noqa: F401 - a fixture

pytestmark = pytest.mark.cassandra

COUNT = int(os.environ.get("CASSMAIL_FUZZ_COUNT", "1500"))


async def test_mutated_commands_get_the_protocols_own_answers(plain_node, users) -> None:  # noqa: F811
    findings = await asyncio.to_thread(imap_fuzz.run, plain_node.port("imap"), users["carol"], "carol", COUNT, 3)
    assert not findings.problems, findings.problems[:10]
    assert findings.answers.get("OK", 0) > COUNT // 100 and findings.answers.get("BAD", 0) > COUNT // 2
    log = plain_node.log_text()
    assert "Traceback" not in log and "event=imap-error" not in log
