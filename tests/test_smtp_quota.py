"""Storage quotas at SMTP, submission and LMTP, over real sockets with smtplib and swaks, on every
backend: a recipient over quota gets 552 5.2.2 (452 4.2.2 with quota_full_tempfail) on its own
while the other recipients of the same message get it. Where the store can tell cheaply (mbox,
Cassandra) the refusal comes at RCPT; where it cannot (WheelFS, whose usage is a walk) the
delivery after DATA decides: per recipient on LMTP, and on SMTP a DSN to the sender for a full
recipient when others took the message."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import smtplib
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cassmail.config import Settings
from cassmail.store.base import Store, Target
from tests.nodes import CLIENT_TLS, Node, inbox, node_settings, strip_trace
from tests.test_smtp import Raw

pytestmark = pytest.mark.cassandra

BODY = b"Subject: quota\r\n\r\n" + b"x" * 2000 + b"\r\n"


async def fill(store: Store, user: str, room: int = 0) -> None:
    """Give `user` a limit with `room` bytes left over what they hold (one message)."""
    await store.deliver(b"Subject: old\r\n\r\n" + b"y" * 500, [Target(user)])
    await store.set_quota(user, (await store.get_quota(user)).used + room)


async def rcpt_checked(store: Store, user: str) -> bool:
    """Whether the store tells at RCPT (cheaply) that `user` is full."""
    return await store.quota_allows(user, 1) is False


async def test_a_full_recipient_is_refused_while_the_other_recipient_of_the_message_gets_it(
        node: Node, store: Store, users: dict[str, str]) -> None:
    anne, bob, carol = users["anne"], users["bob"], users["carol"]
    await fill(store, anne)
    before = len(await inbox(store, anne))

    def send() -> dict[str, tuple[int, bytes]]:
        with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
            return client.sendmail(carol, [anne, bob], BODY)

    refused = await asyncio.to_thread(send)
    [received] = await inbox(store, bob)
    assert strip_trace(received)[1] == BODY
    assert len(await inbox(store, anne)) == before
    if await rcpt_checked(store, anne):
        assert refused == {anne: (552, f"5.2.2 <{anne}>: Mailbox full".encode())}
        assert await inbox(store, carol) == []
    else:  # found only after DATA: bob got it, so the 250 stands and carol gets a DSN for anne
        assert refused == {}
        [report] = await inbox(store, carol)
        assert b"Undelivered Mail Returned to Sender" in report and f"Final-Recipient: rfc822; {anne}".encode() in report
        assert b"Status: 5.2.2" in report


async def test_a_message_larger_than_the_room_left_is_refused_and_stores_nothing(
        node: Node, store: Store, users: dict[str, str]) -> None:
    """smtplib declares SIZE: the RCPT check counts it. Without a cheap check the delivery
    refuses it after DATA, the one recipient being full."""
    anne = users["anne"]
    await fill(store, anne, room=1000)

    def send() -> None:
        with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
            client.sendmail("someone@remote.test", [anne], BODY)

    if await store.quota_allows(anne, len(BODY)) is False:
        with pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
            await asyncio.to_thread(send)
        assert refused.value.recipients[anne][0] == 552
    else:
        with pytest.raises(smtplib.SMTPDataError) as refused_data:
            await asyncio.to_thread(send)
        assert refused_data.value.smtp_code == 552 and refused_data.value.smtp_error.startswith(b"5.2.2")
    assert len(await inbox(store, anne)) == 1
    assert (await store.get_quota(anne)).used <= (await store.get_quota(anne)).limit  # type: ignore[operator]


async def test_lmtp_answers_each_recipient_on_its_own_after_data(node: Node, store: Store,
                                                                 users: dict[str, str]) -> None:
    """No SIZE on the MAIL line: the RCPT check (one byte) passes, the 2 KB message does not fit
    anne's room; LMTP's reply per recipient says so for anne alone."""
    anne, bob = users["anne"], users["bob"]
    await fill(store, anne, room=100)
    raw = Raw(node.port("lmtp"))
    try:
        assert raw.cmd("LHLO mta.test").startswith("250")
        assert raw.cmd("MAIL FROM:<x@remote.test>").startswith("250")
        assert raw.cmd(f"RCPT TO:<{anne}>").startswith("250")
        assert raw.cmd(f"RCPT TO:<{bob}>").startswith("250")
        assert raw.cmd("DATA").startswith("354")
        raw.send(BODY + b".\r\n")
        assert raw.reply() == f"552 5.2.2 <{anne}>: Mailbox full"
        assert raw.reply().startswith("250 2.0.0 OK id=")
    finally:
        raw.close()
    assert len(await inbox(store, anne)) == 1 and len(await inbox(store, bob)) == 1


async def test_submission_to_a_full_local_user_and_from_one(node: Node, store: Store, users: dict[str, str]) -> None:
    """Submission refuses a full local recipient the same way; a sender over quota still sends,
    without the copy in Sent (the log says so)."""
    anne, bob, carol = users["anne"], users["bob"], users["carol"]
    await fill(store, bob)

    def submit(user: str, to: list[str]) -> dict[str, tuple[int, bytes]]:
        with smtplib.SMTP("127.0.0.1", node.port("submission"), timeout=30) as client:
            client.starttls(context=CLIENT_TLS)
            client.login(user, user.split("@")[0])
            return client.sendmail(user, to, BODY)

    refused = await asyncio.to_thread(submit, anne, [bob, carol])
    assert len(await inbox(store, carol)) == 1 and len(await inbox(store, bob)) == 1
    assert len(await inbox(store, anne, "Sent")) == 1
    if await rcpt_checked(store, bob):
        assert list(refused) == [bob] and refused[bob][0] == 552
    else:
        assert refused == {} and b"Status: 5.2.2" in (await inbox(store, anne))[0]
    await fill(store, anne)  # the sender is full now
    sent_before = len(await inbox(store, anne, "Sent"))
    assert await asyncio.to_thread(submit, anne, [carol]) == {}
    assert len(await inbox(store, carol)) == 2
    assert len(await inbox(store, anne, "Sent")) == sent_before
    assert "sent_copy=over-quota" in node.log_text()


async def test_swaks_sees_552_5_2_2(node: Node, store: Store, users: dict[str, str]) -> None:
    anne = users["anne"]
    await fill(store, anne)
    result = await asyncio.to_thread(subprocess.run, [
        "swaks", "--server", "127.0.0.1", "--port", str(node.port("smtp")), "--from", "x@remote.test",
        "--to", anne, "--body", "over quota"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    reply = f"552 5.2.2 <{anne}>: Mailbox full" if await rcpt_checked(store, anne) else "552 5.2.2 Mailbox full"
    assert reply in result.stdout, result.stdout


@contextlib.asynccontextmanager
async def tempfail_mx(backend_settings: Settings, store: Store) -> AsyncIterator[Any]:
    """An MX listener in this process with quota_full_tempfail = true, and a connected client."""
    from cassmail import smtp as smtp_front

    settings = node_settings(backend_settings)
    for name in ("smtp", "submission", "lmtp"):
        setattr(settings, name, dataclasses.replace(
            getattr(settings, name), enabled=name == "smtp", listen="127.0.0.1:0", domain_cache_seconds=0,
            tls_cert="", tls_key="", quota_full_tempfail=True))
    servers = [server for server, _ in await smtp_front.start(settings, store)]
    raw = await asyncio.to_thread(Raw, servers[0].sockets[0].getsockname()[1])
    try:
        yield raw
    finally:
        raw.close()
        for server in servers:
            server.close()


async def test_quota_full_tempfail_answers_452_4_2_2(backend_settings: Settings, store: Store,
                                                    users: dict[str, str]) -> None:
    anne = users["anne"]
    await fill(store, anne)
    async with tempfail_mx(backend_settings, store) as raw:

        async def cmd(line: str) -> str:
            return await asyncio.to_thread(raw.cmd, line)

        await cmd("EHLO mta.test")
        await cmd("MAIL FROM:<x@remote.test>")
        reply = await cmd(f"RCPT TO:<{anne}>")
        if not await rcpt_checked(store, anne):
            assert reply.startswith("250")
            await cmd("DATA")
            reply = await cmd("Subject: t\r\n\r\nbody\r\n.")
            assert reply == "452 4.2.2 Mailbox full, try again later"
        else:
            assert reply == f"452 4.2.2 <{anne}>: Mailbox full, try again later"
    assert len(await inbox(store, anne)) == 1
