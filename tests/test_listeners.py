"""Listeners side by side, as every mail client's account set-up expects: submission with
STARTTLS (587) and with TLS from the first byte (465), POP3 on 110 and 995, IMAP on 143 and 993,
each pair at once on one node with its own settings; implicit-TLS sessions are logged tls=True."""

from __future__ import annotations

import imaplib
import poplib
import re
import smtplib
import time
from collections.abc import Iterator

import pytest

from cassmail import healthcheck
from cassmail.auth import hash_password
from cassmail.store import make_store
from tests.conftest import FAST_HASH, backend_settings_for
from tests.nodes import CLIENT_TLS, Node, node_settings

pytestmark = pytest.mark.cassandra


@pytest.fixture(scope="module")
def pairs(request: pytest.FixtureRequest, tls_files: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    settings = backend_settings_for("mbox", request)
    secure = {**tls_files, "implicit_tls": True, "enabled": True}
    node = Node(node_settings(settings), tmp_path_factory.mktemp("pairs"), submission={**tls_files},
                submissions=secure, pop3={**tls_files}, pop3s=secure, imap={**tls_files}, imaps=secure)
    import asyncio

    async def prepare() -> None:
        store = make_store(node.settings)
        await store.open()
        await store.add_domain("pairs.example")
        await store.create_user("anne@pairs.example", hash_password("anne", FAST_HASH))
        await store.close()

    asyncio.run(prepare())
    node.start()
    yield node
    assert node.stop() == 0
    assert "Traceback" not in node.log_text()


def wait_for(node: Node, pattern: str, timeout: float = 15) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, node.log_text(), re.M)
        if found:
            return found.group(0)
        time.sleep(0.1)
    raise AssertionError(f"no log line matches {pattern!r}")


def test_every_pair_serves_at_once_and_implicit_tls_sessions_say_tls_true(pairs: Node) -> None:
    assert healthcheck.check(pairs.settings) == []  # every listener greets, the implicit ones over TLS
    with smtplib.SMTP_SSL("127.0.0.1", pairs.port("submissions"), context=CLIENT_TLS, timeout=30) as client:
        client.login("anne@pairs.example", "anne")
        assert client.sendmail("anne@pairs.example", ["anne@pairs.example"], b"Subject: 465\r\n\r\nx\r\n") == {}
    with smtplib.SMTP("127.0.0.1", pairs.port("submission"), timeout=30) as client:
        client.starttls(context=CLIENT_TLS)
        client.login("anne@pairs.example", "anne")
        assert client.sendmail("anne@pairs.example", ["anne@pairs.example"], b"Subject: 587\r\n\r\nx\r\n") == {}
    pop = poplib.POP3_SSL("127.0.0.1", pairs.port("pop3s"), context=CLIENT_TLS, timeout=30)
    pop.user("anne@pairs.example")
    pop.pass_("anne")
    assert pop.stat()[0] == 2
    pop.quit()
    imap = imaplib.IMAP4_SSL("127.0.0.1", pairs.port("imaps"), ssl_context=CLIENT_TLS, timeout=30)
    imap.login("anne@pairs.example", "anne")
    assert imap.select("INBOX") == ("OK", [b"2"])
    imap.logout()
    wait_for(pairs, r"event=session listener=submissions peer=127\.0\.0\.1 .*user=anne@pairs\.example tls=True ")
    wait_for(pairs, r"event=session listener=submission peer=127\.0\.0\.1 .*user=anne@pairs\.example tls=True ")
    wait_for(pairs, r"event=session listener=pop3 .*user=anne@pairs\.example .*tls=True")
    wait_for(pairs, r"event=session listener=imap .*user=anne@pairs\.example tls=True")


def test_a_reset_left_unretrieved_by_the_tls_transport_is_one_line_other_exceptions_keep_theirs(caplog) -> None:
    import asyncio
    import logging

    from cassmail.worker import loop_exception

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.INFO):
            loop_exception(loop, {"message": "Future exception was never retrieved",
                                  "exception": ConnectionResetError(104, "Connection reset by peer")})
            loop_exception(loop, {"message": "Task exception was never retrieved", "exception": ValueError("bug")})
    finally:
        loop.close()
    reset, other = caplog.records
    assert reset.levelno == logging.INFO and "event=connection-reset" in reset.getMessage() and not reset.exc_info
    assert other.levelno == logging.ERROR and other.exc_info is not None  # asyncio's own handler, traceback kept
