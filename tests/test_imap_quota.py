"""IMAP QUOTA (RFC 9208) over real sockets with imaplib, every store: the capabilities, the one
quota root "" of a user with a limit (STORAGE in KiB), none for a user without, SETQUOTA refused,
APPEND, COPY and MOVE over the limit answered NO [OVERQUOTA] with nothing changed, and the STATUS
items DELETED and DELETED-STORAGE that QUOTA=RES-STORAGE brings."""

from __future__ import annotations

import asyncio
import imaplib

import pytest

from cassmail.store.base import Store, Target
from tests.nodes import Node
from tests.test_imap import Raw, imap

pytestmark = pytest.mark.cassandra

BODY = b"From: a@remote.test\r\nSubject: q\r\n\r\n" + b"x" * 3000 + b"\r\n"  # 3,037 bytes: 3 KiB rounded up


def client_for(node: Node, user: str) -> imaplib.IMAP4:
    return imap(node, user)


async def test_a_user_with_a_limit_has_the_quota_root_and_one_without_has_none(
        node: Node, store: Store, users: dict[str, str]) -> None:
    anne = users["anne"]
    client = await asyncio.to_thread(client_for, node, anne)
    try:
        caps = client.capabilities
        assert "QUOTA" in caps and "QUOTA=RES-STORAGE" in caps and "QUOTASET" not in caps
        assert await asyncio.to_thread(client.getquotaroot, "INBOX") == ("OK", [[b"INBOX"], [None]])
        typ, data = await asyncio.to_thread(client._simple_command, "GETQUOTA", '""')
        assert typ == "NO" and data == [b"[NONEXISTENT] No such quota root"]
        await store.deliver(BODY, [Target(anne)])
        await store.set_quota(anne, 10 * 1024 * 1024 + 1000)  # the limit rounds down, the usage up
        assert await asyncio.to_thread(client.getquotaroot, "INBOX") == \
            ("OK", [[b'INBOX ""'], [b'"" (STORAGE 3 10240)']])
        assert await asyncio.to_thread(client.getquota, '""') == ("OK", [b'"" (STORAGE 3 10240)'])
        # a mailbox that does not exist (yet) names the root it would have (RFC 9208 4.1.2)
        assert (await asyncio.to_thread(client.getquotaroot, "Projects/2027"))[1][0] == [b'Projects/2027 ""']
        typ, data = await asyncio.to_thread(client._simple_command, "GETQUOTA", "other")
        assert typ == "NO" and b"NONEXISTENT" in data[0]
        typ, data = await asyncio.to_thread(client._simple_command, "GETQUOTAROOT", "&Jjo")  # not modified UTF-7
        assert typ == "NO" and data[0].startswith(b"[CANNOT]")
    finally:
        await asyncio.to_thread(client.logout)


async def test_setquota_is_refused_and_bad_quota_commands_are_bad(node: Node, users: dict[str, str]) -> None:
    raw = await asyncio.to_thread(Raw, node.port("imap"))
    try:
        assert (await asyncio.to_thread(raw.cmd, "GETQUOTAROOT INBOX"))[-1] == b"t1 BAD Command not allowed now\r\n"
    finally:
        raw.sock.close()
    client = await asyncio.to_thread(client_for, node, users["anne"])
    try:
        for args in ('"" (STORAGE 512)', '"" ()', '"" (STORAGE 512 MESSAGE 100)'):
            typ, data = await asyncio.to_thread(client._simple_command, "SETQUOTA", args)
            assert (typ, data) == ("NO", [b"[NOPERM] Quotas are set by the administrator"])
        for command, args in (("SETQUOTA", '"" (STORAGE)'), ("SETQUOTA", '"" (STORAGE -1)'),
                              ("SETQUOTA", '"" (STORAGE 99999999999999999999)'), ("SETQUOTA", '""'),
                              ("GETQUOTA", ""), ("GETQUOTAROOT", ""), ("GETQUOTA", '"" extra')):
            with pytest.raises(imaplib.IMAP4.error, match="BAD"):
                await asyncio.to_thread(client._simple_command, command, *([args] if args else []))
    finally:
        await asyncio.to_thread(client.logout)


async def test_append_copy_and_move_over_the_limit_answer_overquota_and_change_nothing(
        node: Node, store: Store, users: dict[str, str]) -> None:
    anne = users["anne"]
    for _ in range(3):
        await store.deliver(BODY, [Target(anne)])
    await store.set_quota(anne, 4 * len(BODY) + 100)  # room for one more copy, not two
    client = await asyncio.to_thread(client_for, node, anne)
    try:
        typ, data = await asyncio.to_thread(client.append, "Archive", None, None, BODY + b"y" * 2000)
        assert typ == "NO" and data[0].startswith(b"[OVERQUOTA]")
        assert await asyncio.to_thread(client.select, "INBOX") == ("OK", [b"3"])
        for command in ("COPY", "MOVE"):
            typ, data = await asyncio.to_thread(client._simple_command, command, "1:2", "Archive")
            assert typ == "NO" and data[0].startswith(b"[OVERQUOTA]"), (command, data)
        assert [s async for s in store.list_messages(anne, "Archive")] == []
        assert len([s async for s in store.list_messages(anne, "INBOX")]) == 3  # MOVE deleted nothing
        assert (await store.get_quota(anne)).used == 3 * len(BODY)
        typ, _ = await asyncio.to_thread(client.copy, "1", "Archive")  # one copy fits
        assert typ == "OK"
        typ, data = await asyncio.to_thread(client.append, "Archive", None, None, BODY)
        assert typ == "NO" and data[0].startswith(b"[OVERQUOTA]")
        # STATUS DELETED and DELETED-STORAGE (KiB, as STORAGE): what an EXPUNGE would free
        await asyncio.to_thread(client.store, "2:3", "+FLAGS", "(\\Deleted)")
        typ, data = await asyncio.to_thread(client.status, "INBOX", "(MESSAGES DELETED DELETED-STORAGE)")
        assert data == [b"INBOX (MESSAGES 3 DELETED 2 DELETED-STORAGE 6)"]
        typ, data = await asyncio.to_thread(client._simple_command, "LIST", '""', "INBOX", "RETURN",
                                            "(STATUS (DELETED))")
        assert client.untagged_responses.pop("STATUS") == [b"INBOX (DELETED 2)"]
        await asyncio.to_thread(client.expunge)
        assert (await store.get_quota(anne)).used == 2 * len(BODY)
        typ, data = await asyncio.to_thread(client.getquotaroot, "INBOX")
        assert data[1] == [b'"" (STORAGE 6 11)']
        typ, _ = await asyncio.to_thread(client.append, "Archive", None, None, BODY)  # room again
        assert typ == "OK"
    finally:
        await asyncio.to_thread(client.logout)
