"""Password guessing in parallel: a node answers only the first few of many simultaneous guesses
from one address, or at one account, whichever listener and worker process each reaches."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cassmail.auth import hash_password
from cassmail.config import Settings
from cassmail.store.base import Store
from tests.conftest import FAST_HASH, backend_settings_for, opened_store
from tests.nodes import Node, node_settings

#: How long the guesses are given to be answered; with the default delay (1 s, doubling) and
#: two free attempts, at most attempts 1-4 can be answered in it.
WINDOW = 3.5


@pytest.fixture(scope="module")
def settings(request: pytest.FixtureRequest) -> Settings:
    return backend_settings_for("mbox", request)  # the throttle is the node's, the same on any store


@pytest.fixture(scope="module")
async def store(settings: Settings) -> AsyncIterator[Store]:
    async with opened_store(settings) as opened:
        yield opened


@pytest.fixture(scope="module")
async def users(store: Store) -> dict[str, str]:
    domain = f"b{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    for name in ("anne", "bob", "carol"):
        await store.create_user(f"{name}@{domain}", hash_password(name, FAST_HASH))
    return {name: f"{name}@{domain}" for name in ("anne", "bob", "carol")}


async def _line(reader: asyncio.StreamReader, done: bytes) -> bytes:
    """Lines until one starting with `done`; that one."""
    while True:
        line = await reader.readline()
        if not line or line.startswith(done):
            return line


async def guess(node: Node, protocol: str, user: str, password: str, source: str,
                ready: asyncio.Queue[None], go: asyncio.Event) -> bytes | None:
    """One connection's one login attempt, sent once every connection is `ready` (`go`); its
    answer, or None when it was not answered within WINDOW."""
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port(protocol), local_addr=(source, 0))
    try:
        if protocol == "submission":
            await _line(reader, b"220 ")
            writer.write(b"EHLO guesser\r\n")
            await _line(reader, b"250 ")
            plain = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
            attempt, done = f"AUTH PLAIN {plain}\r\n", b""
        elif protocol == "pop3":
            await _line(reader, b"+OK")
            writer.write(f"USER {user}\r\n".encode())
            await _line(reader, b"+OK")
            attempt, done = f"PASS {password}\r\n", b""
        else:
            await _line(reader, b"* OK")
            attempt, done = f"g LOGIN {user} {password}\r\n", b"g "
        ready.put_nowait(None)
        await go.wait()
        writer.write(attempt.encode())
        try:
            return await asyncio.wait_for(_line(reader, done), WINDOW)
        except asyncio.TimeoutError:
            return None
    finally:
        writer.close()


async def burst(node: Node, logins: list[tuple[str, str, str]], password: str = "wrong") -> list[bytes | None]:
    """(protocol, user, source address) guesses, all sent at one moment; their answers."""
    ready: asyncio.Queue[None] = asyncio.Queue()
    go = asyncio.Event()
    tasks = [asyncio.ensure_future(guess(node, protocol, user, password, source, ready, go))
             for protocol, user, source in logins]
    for _ in logins:  # every connection greeted and ready
        await asyncio.wait_for(ready.get(), 30)
    go.set()
    return await asyncio.gather(*tasks)


def failure(answer: bytes) -> bool:
    return answer.startswith((b"535", b"-ERR", b"g NO"))


async def test_a_hundred_parallel_guesses_get_a_few_answers_across_listeners_and_workers(
        settings: Settings, users: dict[str, str], tmp_path: Path) -> None:
    plain = {"allow_plaintext_auth": True}
    node = Node(node_settings(settings), tmp_path, node={"workers": 2}, submission=plain, pop3=plain,
                imap=plain).start()
    protocols = ("submission", "pop3", "imap")
    try:
        # From one address, at a hundred accounts.
        domain = users["anne"].split("@")[1]
        answers = await burst(node, [(protocols[i % 3], users["anne"] if i == 0 else f"user{i}@{domain}", "127.0.0.1")
                                     for i in range(100)])
        answered = [a for a in answers if a is not None]
        assert 1 <= len(answered) <= 4, answered
        assert all(failure(a) for a in answered), answered
        # At one account, from forty addresses.
        answers = await burst(node, [(protocols[i % 3], users["carol"], f"127.0.1.{i + 1}") for i in range(40)])
        answered = [a for a in answers if a is not None]
        assert 1 <= len(answered) <= 4, answered
        # Someone else, from elsewhere, logs in at once.
        started = time.monotonic()
        [answer] = await burst(node, [("imap", users["bob"], "127.0.0.2")], password="bob")
        assert answer is not None and answer.startswith(b"g OK"), answer
        assert time.monotonic() - started < WINDOW / 2
    finally:
        assert node.stop() == 0
    log = node.log_text()
    assert "Traceback" not in log
    assert log.count("event=auth ") >= 3  # every answered attempt is logged once
