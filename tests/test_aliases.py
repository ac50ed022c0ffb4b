"""Aliases as mail clients and MTAs see them: a real `cassmail serve` on every backend, smtplib
and a line-level client over real sockets; aliases made through the store the node shares.

An alias is an address of a local domain that delivers to local users: RCPT TO it is accepted
on MX, submission and LMTP, each of its users gets the message once in INBOX (one store call
per message however many addresses and aliases name them), and a user it lists may use it as
MAIL FROM on submission."""

from __future__ import annotations

import asyncio
import smtplib

import pytest

from cassmail.store.base import Store, StoreUnavailable
from tests.nodes import CLIENT_TLS, Node, inbox, strip_trace
from tests.test_smtp import Raw, in_process, smtp, wait_for_log

pytestmark = pytest.mark.cassandra

BODY = b"Subject: to the team\r\n\r\nhello team\r\n"


def send(node: Node, sender: str, recipients: list[str], body: bytes = BODY) -> dict:
    with smtp(node) as client:
        return client.sendmail(sender, recipients, body)


async def test_rcpt_to_an_alias_reaches_each_user_once_even_when_the_user_is_named_too(
    node: Node, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob, carol = users["anne"], users["bob"], users["carol"]
    await store.set_alias(f"team@{domain}", [anne, bob])
    assert await asyncio.to_thread(send, node, "x@remote.test", [f"Team@{domain.upper()}", anne]) == {}
    [to_anne] = await inbox(store, anne)
    [to_bob] = await inbox(store, bob)
    assert to_anne == to_bob and strip_trace(to_anne)[1] == BODY  # one delivery, one copy each
    assert await inbox(store, carol) == []
    # the alias alone: the trace names the address the sender used
    assert await asyncio.to_thread(send, node, "x@remote.test", [f"team@{domain}"], b"Subject: 2\r\n\r\nx\r\n") == {}
    latest = (await inbox(store, bob))[-1]
    assert f"for <team@{domain}>".encode() in strip_trace(latest)[0]
    assert len(await inbox(store, anne)) == 2
    wait_for_log(node, rf"event=delivery listener=smtp .* rcpts=1 users=2 size=\d+ id=[0-9a-f]{{16}} result=ok")


async def test_two_aliases_sharing_a_user_deliver_once_per_user(
    node: Node, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob, carol = users["anne"], users["bob"], users["carol"]
    await store.set_alias(f"sales@{domain}", [anne, bob])
    await store.set_alias(f"support@{domain}", [bob, carol])
    assert await asyncio.to_thread(send, node, "x@remote.test", [f"sales@{domain}", f"support@{domain}"]) == {}
    copies = [await inbox(store, user) for user in (anne, bob, carol)]
    assert [len(c) for c in copies] == [1, 1, 1] and copies[0] == copies[1] == copies[2]


async def test_an_alias_is_one_store_delivery_and_looked_up_only_when_no_user_has_the_address(
    backend_settings, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob = users["anne"], users["bob"]
    await store.set_alias(f"team@{domain}", [anne, bob])
    async with in_process(backend_settings, store, "smtp") as (counting, cmd):
        await cmd("EHLO client.test")
        await cmd("MAIL FROM:<x@remote.test>")
        assert (await cmd(f"RCPT TO:<{anne}>")).startswith("250 2.1.5")
        assert counting.calls["get_alias"] == 0  # a user: no alias read
        assert (await cmd(f"RCPT TO:<team@{domain}>")).startswith("250 2.1.5")
        assert (await cmd(f"RCPT TO:<{bob}>")).startswith("250 2.1.5")
        assert counting.calls["get_alias"] == 1
        await cmd("DATA")
        assert (await cmd("Subject: one call\r\n\r\nx\r\n.")).startswith("250 2.0.0")
        assert counting.calls["deliver"] == 1
        # the alias read failing is a temporary error, never a 550 or a traceback
        await cmd("MAIL FROM:<x@remote.test>")
        counting.failing["get_alias"] = StoreUnavailable("injected: read timeout")
        assert (await cmd(f"RCPT TO:<team@{domain}>")).startswith("451 4.3.0")
        assert (await cmd(f"RCPT TO:<{anne}>")).startswith("250 2.1.5")  # users still work
    assert [len(await inbox(store, u)) for u in (anne, bob)] == [1, 1]


def submit(node: Node, login: str, password: str, sender: str, recipients: list[str]) -> dict:
    with smtp(node, "submission") as client:
        client.starttls(context=CLIENT_TLS)
        client.login(login, password)
        return client.sendmail(sender, recipients, BODY)


async def test_submission_from_an_alias_of_the_authenticated_user_is_accepted_with_a_copy_in_sent(
    node: Node, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob, carol = users["anne"], users["bob"], users["carol"]
    await store.set_alias(f"team@{domain}", [anne, bob])
    assert await asyncio.to_thread(submit, node, anne, "anne", f"Team@{domain}", [carol]) == {}
    [received] = await inbox(store, carol)
    [sent] = [s async for s in store.list_messages(anne, "Sent")]
    assert sent.flags == {"\\Seen"} and await store.read_message(anne, "Sent", sent.id) == received
    assert received.startswith(f"Return-Path: <Team@{domain}>".encode())
    assert f"(authenticated as {anne})".encode() in strip_trace(received)[0]


async def test_mail_from_an_alias_that_does_not_list_the_user_is_refused(
    node: Node, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob, carol = users["anne"], users["bob"], users["carol"]
    await store.set_alias(f"theirs@{domain}", [bob, carol])

    def try_senders() -> list[tuple[int, bytes]]:
        with smtp(node, "submission") as client:
            client.starttls(context=CLIENT_TLS)
            client.login(anne, "anne")
            replies = [client.docmd("MAIL FROM:", f"<theirs@{domain}>"), client.docmd("MAIL FROM:", f"<nobody@{domain}>")]
            replies.append(client.docmd("MAIL FROM:", f"<{anne}>"))  # the session goes on
            return replies

    theirs, nobody, own = await asyncio.to_thread(try_senders)
    assert theirs == (553, f"5.7.1 Sender address <theirs@{domain}> is not owned by the authenticated user {anne}".encode())
    assert nobody[0] == 553 and nobody[1].startswith(b"5.7.1 ")
    assert own[0] == 250
    # bob, whom the alias lists, may use it
    assert await asyncio.to_thread(submit, node, bob, "bob", f"theirs@{domain}", [anne]) == {}
    assert len(await inbox(store, anne)) == 1


async def test_lmtp_answers_one_reply_per_rcpt_line_for_an_alias(
    node: Node, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob = users["anne"], users["bob"]
    await store.set_alias(f"team@{domain}", [anne, bob])

    def hand_over() -> list[str]:
        raw = Raw(node.port("lmtp"))
        try:
            replies = [raw.cmd("LHLO mta.test"), raw.cmd("MAIL FROM:<a@remote.test>")]
            replies += [raw.cmd(f"RCPT TO:<team@{domain}>"), raw.cmd(f"RCPT TO:<{anne}>")]
            raw.cmd("DATA")
            raw.send(b"Subject: lmtp\r\n\r\nx\r\n.\r\n")
            replies += [raw.reply(), raw.reply()]  # one per accepted RCPT: the alias, anne
            replies.append(raw.cmd("NOOP"))  # and nothing more was sent
            return replies
        finally:
            raw.close()

    _, mail, team, to_anne, data_team, data_anne, noop = await asyncio.to_thread(hand_over)
    assert mail.startswith("250") and "\n" not in team and team.startswith("250 2.1.5")
    assert to_anne.startswith("250 2.1.5")
    assert data_team.startswith("250 2.0.0") and data_anne.startswith("250 2.0.0")
    assert noop.startswith("250") and not noop.startswith("250 2.0.0 OK id=")
    assert [len(await inbox(store, u)) for u in (anne, bob)] == [1, 1]
    assert b" with LMTP id " in strip_trace((await inbox(store, bob))[0])[0]


async def test_a_removed_alias_is_550_5_1_1(node: Node, store: Store, users: dict[str, str], domain: str) -> None:
    await store.set_alias(f"team@{domain}", [users["anne"]])
    await store.delete_alias(f"team@{domain}")
    with pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
        await asyncio.to_thread(send, node, "x@remote.test", [f"team@{domain}"])
    code, text = refused.value.recipients[f"team@{domain}"]
    assert code == 550 and text.startswith(b"5.1.1 ")
    assert await inbox(store, users["anne"]) == []


async def test_deleting_a_user_takes_them_out_of_the_aliases_mail_reaches(
    node: Node, store: Store, users: dict[str, str], domain: str
) -> None:
    anne, bob = users["anne"], users["bob"]
    await store.set_alias(f"team@{domain}", [anne, bob])
    await store.set_alias(f"bob-only@{domain}", [bob])
    await store.delete_user(bob)
    assert await asyncio.to_thread(send, node, "x@remote.test", [f"team@{domain}"]) == {}
    assert len(await inbox(store, anne)) == 1  # anne alone, and no 451 for a user who is gone
    with pytest.raises(smtplib.SMTPRecipientsRefused) as refused:
        await asyncio.to_thread(send, node, "x@remote.test", [f"bob-only@{domain}"])
    assert refused.value.recipients[f"bob-only@{domain}"][0] == 550  # its only user went: so did it
