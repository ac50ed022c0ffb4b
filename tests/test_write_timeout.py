"""A client that stops reading while a message is sent to it is cut off after `write_timeout`.

POP3 RETR and IMAP FETCH stream a message with flow control: when the client's socket stops
taking bytes the sender waits. Without a bound, a client could hold its session, the store
stream and the worker's buffers forever; with it, the connection is dropped, the node logs why,
and every other session goes on.
"""

from __future__ import annotations

import imaplib
import poplib
import socket
import time
from collections.abc import Iterator

import pytest

from cassmail.store.base import Store, Target
from tests.nodes import Node, node_settings

pytestmark = pytest.mark.cassandra

WRITE_TIMEOUT = 1.0  # (the least write_timeout allows)
BIG = b"Subject: big\r\n\r\n" + (b"y" * 76 + b"\r\n") * (8 * 1024 * 1024 // 78)


@pytest.fixture(scope="module")
def stall_node(backend_settings, tmp_path_factory) -> Iterator[Node]:
    plain = {"allow_plaintext_auth": True, "auth_failure_delay": 0.0, "write_timeout": WRITE_TIMEOUT}
    running = Node(node_settings(backend_settings), tmp_path_factory.mktemp("stall"), pop3=plain,
                   imap={"enabled": True, **plain}).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text() and "Unhandled" not in running.log_text()


def _unread_client(port: int) -> tuple[socket.socket, object]:
    """A client whose receive buffer is small, so that an 8 MB answer cannot fit unread."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock, sock.makefile("rb")


def stuck_retr(port: int, user: str, password: str) -> socket.socket:
    """A POP3 client that asked for message 1 and reads none of it."""
    sock, file = _unread_client(port)
    assert file.readline().startswith(b"+OK")
    sock.sendall(f"USER {user}\r\nPASS {password}\r\n".encode())
    assert file.readline().startswith(b"+OK") and file.readline().startswith(b"+OK")
    sock.sendall(b"RETR 1\r\n")
    return sock


def stuck_fetch(port: int, user: str, password: str) -> socket.socket:
    """An IMAP client that fetched message 1 of INBOX and reads none of it."""
    sock, file = _unread_client(port)
    assert file.readline().startswith(b"* OK")
    sock.sendall(f"a LOGIN {user} {password}\r\nb SELECT INBOX\r\n".encode())
    while not file.readline().startswith(b"b OK"):
        pass
    sock.sendall(b"c FETCH 1 BODY.PEEK[]\r\n")
    return sock


def _drain_after(sock: socket.socket, seconds: float) -> tuple[int, float]:
    """Wait without reading, then read until the server's end closes: (bytes read, seconds it took
    the connection to end after the wait). A connection the server aborted ends at once."""
    time.sleep(seconds)
    start, total = time.monotonic(), 0
    try:
        while chunk := sock.recv(1 << 20):
            total += len(chunk)
    except ConnectionResetError:
        pass
    return total, time.monotonic() - start


async def test_pop3_retr_to_a_client_that_stops_reading_is_cut_off(stall_node: Node, store: Store, users) -> None:
    await store.deliver(BIG, [Target(users["anne"])])
    sock = stuck_retr(stall_node.port("pop3"), users["anne"], "anne")
    received, ended_in = _drain_after(sock, WRITE_TIMEOUT + 2)
    assert received < len(BIG), "the whole message fitted in the buffers: the client never stalled the server"
    assert ended_in < 5, "the connection was still open long after write_timeout"
    assert "result=stalled" in stall_node.log_text()
    # The node goes on serving, the mailbox too (nothing was deleted).
    client = poplib.POP3("127.0.0.1", stall_node.port("pop3"), timeout=30)
    client.user(users["anne"])
    client.pass_("anne")
    assert client.stat()[0] == 1
    client.quit()


async def test_imap_fetch_to_a_client_that_stops_reading_is_cut_off(stall_node: Node, store: Store, users) -> None:
    await store.deliver(BIG, [Target(users["bob"])])
    sock = stuck_fetch(stall_node.port("imap"), users["bob"], "bob")
    received, ended_in = _drain_after(sock, WRITE_TIMEOUT + 2)
    assert received < len(BIG)
    assert ended_in < 5
    assert f"the client took no data for {WRITE_TIMEOUT:g} s" in stall_node.log_text()
    session = imaplib.IMAP4("127.0.0.1", stall_node.port("imap"), timeout=30)
    session.login(users["bob"], "bob")
    assert session.select("INBOX") == ("OK", [b"1"])
    typ, data = session.fetch("1", "(BODY.PEEK[])")
    assert typ == "OK" and data[0][1] == BIG  # a client that reads gets all of it
    session.logout()


async def test_a_node_stopping_cuts_the_sessions_its_grace_period_did_not_end(
    backend_settings, store: Store, users, tmp_path
) -> None:
    """SIGTERM while a RETR and a FETCH wait on clients that do not read: after the grace period
    the worker cuts them, they unwind while the store is still open, and the node exits 0 with no
    traceback (before, they failed on a closed store once the worker had gone on)."""
    plain = {"allow_plaintext_auth": True, "auth_failure_delay": 0.0}
    node = Node(node_settings(backend_settings), tmp_path, pop3=plain, imap={"enabled": True, **plain},
                node={"stop_grace": 2.0}).start()
    clients: list[socket.socket] = []
    try:
        await store.deliver(BIG, [Target(users["carol"])])
        clients += [stuck_retr(node.port("pop3"), users["carol"], "carol"),
                    stuck_fetch(node.port("imap"), users["carol"], "carol")]
        time.sleep(1.0)  # both are now waiting on their clients
        started = time.monotonic()
        assert node.stop(timeout=60) == 0
        assert 2.0 <= time.monotonic() - started < 12  # the grace period (node.stop_grace), then the cut
    finally:
        node.stop()
        for client in clients:
            client.close()
    log = node.log_text()
    assert "result=sessions-cut" in log and "grace=2.0" in log
    assert "Traceback" not in log and "pop3-error" not in log and "Unhandled" not in log, log[-3000:]
