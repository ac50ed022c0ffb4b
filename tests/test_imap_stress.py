"""Many concurrent IMAP sessions on one mailbox, pipelining a random mix of commands, each
checking the mailbox state it is told against what IMAP promises (tests/imap_stress.py): on
every store, with the sessions on one node and spread over two (on Cassandra, over two nodes of a
three-node cluster: tests/test_cluster.py).

The run is short here (CASSMAIL_STRESS_SECONDS, default 10 s); for a soak, run it longer from
the command line: `python -m tests.imap_stress --port P --user U --password W --seconds 600`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cassmail.store.base import Store
from tests import imap_stress
from tests.nodes import Node, node_settings

pytestmark = pytest.mark.cassandra

SECONDS = float(os.environ.get("CASSMAIL_STRESS_SECONDS", "10"))
SESSIONS = 10
#: Every kind of command the mix sends was answered OK at least once.
EXERCISED = ("APPEND OK", "FETCH OK", "STORE OK", "SEARCH OK", "COPY OK", "MOVE OK", "EXPUNGE OK", "NOOP OK",
             "CHECK OK", "IDLE OK", "LOGOUT OK", "LOGIN OK", "SELECT OK")


def _stress_node(backend_settings, directory: Path) -> Node:
    return Node(node_settings(backend_settings), directory,
                imap={"allow_plaintext_auth": True, "auth_failure_delay": 0.0, "idle_poll": 0.3}).start()


def _check(report: imap_stress.Report) -> None:
    assert not report.violations, "\n".join(report.violations[:10])
    assert report.flags_agree
    missing = [kind for kind in EXERCISED if not report.answers.get(kind)]
    assert not missing, f"never answered OK: {missing} ({report.answers})"
    assert report.messages_checked > 10


async def test_concurrent_pipelining_sessions_keep_the_mailbox_consistent(backend_settings, tmp_path: Path,
                                                                         store: Store, users) -> None:
    node = _stress_node(backend_settings, tmp_path)
    try:
        report = await asyncio.to_thread(imap_stress.run, [node.port("imap")], users["anne"], "anne", SESSIONS, SECONDS)
    finally:
        assert node.stop() == 0
    _check(report)
    assert "Traceback" not in node.log_text()


#: On Cassandra the sessions spread over two nodes are test_cluster.py's: two front ends, each with a
#: Cassandra node of its own as coordinator, on a cluster that replicates.
@pytest.mark.parametrize("backend_settings", ["mbox", "wheelfs"], indirect=True)
async def test_sessions_on_two_nodes_keep_one_mailbox_consistent(backend_settings, tmp_path: Path, store: Store,
                                                                  users) -> None:
    nodes = [_stress_node(backend_settings, tmp_path) for _ in range(2)]
    try:
        report = await asyncio.to_thread(imap_stress.run, [n.port("imap") for n in nodes], users["bob"], "bob",
                                         SESSIONS, SECONDS)
    finally:
        for n in nodes:
            assert n.stop() == 0
    _check(report)
    assert all("Traceback" not in n.log_text() for n in nodes)
