"""Two `cassmail serve` nodes sharing one WheelFS store directory, driven by smtplib and poplib:
what one node is told, the other shows; a deletion on one is a deletion on both."""

from __future__ import annotations

import asyncio
import poplib
import smtplib
from collections.abc import Iterator
from pathlib import Path

import pytest

from cassmail.auth import hash_password
from cassmail.config import Settings, WheelFSSettings
from cassmail.model import INBOX, uidl
from cassmail.store import make_store
from cassmail.store.base import Store
from tests.conftest import FAST_HASH
from tests.nodes import Node, node_settings


def wheelfs_settings(root: Path, cues: bool) -> Settings:
    settings = Settings()
    settings.store.backend = "wheelfs"
    settings.store.wheelfs = WheelFSSettings(root=str(root), cues=cues, home_site="here", rep_sites=2)
    return node_settings(settings)


@pytest.fixture(params=[True, False], ids=["cues", "no-cues"])
def two_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Settings, Node, Node]]:
    settings = wheelfs_settings(tmp_path / "shared", request.param)
    nodes = [Node(settings, tmp_path, pop3={"allow_plaintext_auth": True}) for _ in range(2)]
    try:
        for node in nodes:
            node.start()
        yield settings, nodes[0], nodes[1]
    finally:
        for node in nodes:
            assert node.stop() == 0
            assert "Traceback" not in node.log_text()


def send(node: Node, rcpt: str, count: int, tag: str) -> None:
    with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
        for i in range(count):
            client.sendmail("x@remote.test", [rcpt], f"Subject: {tag} {i}\r\n\r\nfrom {tag}\r\n".encode())


def uidls(node: Node, user: str) -> list[str]:
    session = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
    session.user(user)
    session.pass_("pw")
    out = [line.split()[1].decode() for line in session.uidl()[1]]
    session.quit()
    return out


async def test_two_nodes_on_one_directory_share_deliveries_deletions_and_uids(two_nodes) -> None:
    settings, a, b = two_nodes
    store: Store = make_store(settings)
    await store.open()
    try:
        await store.add_domain("shared.example")
        user = "anne@shared.example"
        await store.create_user(user, hash_password("pw", FAST_HASH))

        # both nodes take mail at once while this process keeps assigning UIDs (as an IMAP session would)
        assigned: dict[object, int] = {}
        sending = asyncio.gather(asyncio.to_thread(send, a, user, 15, "A"), asyncio.to_thread(send, b, user, 15, "B"))
        while not sending.done():
            ids = [s.id async for s in store.list_messages(user, INBOX)]
            for message_id, uid in (await store.assign_uids(user, INBOX, ids)).items():
                assert assigned.setdefault(message_id, uid) == uid
            await asyncio.sleep(0.01)
        await sending

        # every message is listed by both nodes, in the same order
        listed = [s async for s in store.list_messages(user, INBOX)]
        assert len(listed) == 30
        assert uidls(a, user) == uidls(b, user) == [uidl(s.id) for s in listed]
        final = await store.assign_uids(user, INBOX, [s.id for s in listed])
        assert all(final[i] == uid for i, uid in assigned.items())
        assert sorted(final.values()) == list(range(1, 31))

        # node A deletes five (POP3 DELE, QUIT); node B no longer shows them, and they stay gone
        session = poplib.POP3("127.0.0.1", a.port("pop3"), timeout=30)
        session.user(user)
        session.pass_("pw")
        for n in (1, 2, 3, 29, 30):
            session.dele(n)
        session.quit()
        kept = [uidl(s.id) for s in listed[3:28]]
        assert uidls(b, user) == kept
        assert [uidl(s.id) async for s in store.list_messages(user, INBOX)] == kept

        # UIDs go on growing after deletions, whichever node delivers
        await asyncio.to_thread(send, b, user, 1, "late")
        [*_, late] = [s async for s in store.list_messages(user, INBOX)]
        assert (await store.assign_uids(user, INBOX, [late.id]))[late.id] == 31
    finally:
        await store.close()
