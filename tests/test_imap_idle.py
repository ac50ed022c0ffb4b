"""The IDLE watcher's look every `idle_refresh` seconds (cassmail/imap/idle.py), on every store: it
reads the mailbox's changes token and tells the idle sessions only when the token moved, so a
quiet mailbox costs no more than that read, and a change whose report was lost still reaches
them. Where the store lists arrivals cheaply (Cassandra, mbox) the watcher lists nothing: each
session reads what changed itself; elsewhere (WheelFS) it hands them the listing it read."""

from __future__ import annotations

import asyncio
import copy
import time
from types import SimpleNamespace
from typing import Any

from cassmail.config import ImapSettings, Settings
from cassmail.imap.idle import watch
from cassmail.store.base import Store, Target
from tests.conftest import opened_store


class LostReports:
    """Fault injection: the real store, except that `changed_mailboxes` reports nothing (every
    change event lost); counts the listings and token reads asked of it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.listings = 0
        self.tokens = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def changed_mailboxes(self, watched: Any, since: Any) -> tuple[set[tuple[str, str]], Any]:
        return set(), since

    def list_messages(self, *args: Any, **kwargs: Any) -> Any:
        self.listings += 1
        return self.store.list_messages(*args, **kwargs)

    async def changes_token(self, user: str, mailbox: str) -> Any:
        self.tokens += 1
        return await self.store.changes_token(user, mailbox)


def handed(watcher: Any, faulty: LostReports, listings: int, summaries: int, told: Any) -> None:
    """What a look that found a change handed the sessions: the listing (`summaries` messages),
    the `listings`-th one the watcher read; or None, and no listing read, where each session
    reads what changed itself."""
    if watcher.lists:
        assert len(told.summaries) == summaries and faulty.listings == listings
    else:
        assert told is None and faulty.listings == 0


async def test_a_new_watch_lists_nothing_while_the_token_is_the_one_the_view_was_brought_up_to_date_with(
    backend_settings: Settings, users
) -> None:
    """The first IDLE on a mailbox in a worker does not list it when nothing changed since the
    session's view last took in the store's state (its changes token still holds); a change made
    after, even one whose report is lost, is listed and handed out."""
    settings = copy.deepcopy(backend_settings)
    settings.store.cassandra.request_timeout = 1.0  # (see the test below)
    user = users["anne"]
    async with opened_store(settings) as store:
        await store.deliver(b"Subject: one\r\n\r\none\r\n", [Target(user)])
        await store.assign_uids(user, "INBOX", [s.id async for s in store.list_messages(user, "INBOX")])
        deadline = time.monotonic() + 15
        while (token := await store.changes_token(user, "INBOX")) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert token is not None
        faulty = LostReports(store)
        listener = SimpleNamespace(settings=ImapSettings(idle_poll=0.2, idle_refresh=1.0), store=faulty,
                                   watchers={}, poller=None)
        view = SimpleNamespace(user=user, name="INBOX", token=token, listed_at=time.monotonic())
        watcher = watch(listener, view)  # type: ignore[arg-type]
        try:
            await asyncio.sleep(0.8)
            assert faulty.tokens >= 1 and faulty.listings == 0  # looked at, not listed
            await store.deliver(b"Subject: two\r\n\r\ntwo\r\n", [Target(user)])
            handed(watcher, faulty, 1, 2, await asyncio.wait_for(watcher.next(), 8))
        finally:
            watcher.release()
            listener.poller.stop()


async def test_a_quiet_mailbox_is_not_listed_again_and_a_lost_report_is_caught_up(
    backend_settings: Settings, users
) -> None:
    settings = copy.deepcopy(backend_settings)
    # Cassandra's token is unknown (None: list) until no write older than the last change can
    # still land, request_timeout + 2 s after it: a short timeout keeps this test short.
    settings.store.cassandra.request_timeout = 1.0
    user = users["anne"]
    async with opened_store(settings) as store:
        await store.deliver(b"Subject: one\r\n\r\none\r\n", [Target(user)])
        faulty = LostReports(store)
        listener = SimpleNamespace(settings=ImapSettings(idle_poll=0.2, idle_refresh=1.0), store=faulty,
                                   watchers={}, poller=None)
        view = SimpleNamespace(user=user, name="INBOX", token=None, listed_at=0.0)  # a view that knows no token
        watcher = watch(listener, view)  # type: ignore[arg-type]
        try:
            first = await asyncio.wait_for(watcher.next(), 5)  # the first poll looks at a new watch
            handed(watcher, faulty, 1, 1, first)
            if not watcher.lists:  # (no listing numbered the message, as a session's would)
                await store.assign_uids(user, "INBOX", [s.id async for s in store.list_messages(user, "INBOX")])
            # Once the token has settled (the message was numbered, a change), one more look
            # tells the sessions, with that token; from then on the mailbox is quiet.
            deadline = time.monotonic() + 15
            while await store.changes_token(user, "INBOX") is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.5)
            listings, tokens, quiet = faulty.listings, faulty.tokens, watcher._next
            await asyncio.sleep(2.5)
            assert faulty.tokens - tokens >= 2  # looked at every second or so ...
            assert faulty.listings == listings and not quiet.done()  # ... and nothing told: nothing changed
            # A delivery whose report is lost: the next look finds the token moved and tells.
            await store.deliver(b"Subject: two\r\n\r\ntwo\r\n", [Target(user)])
            handed(watcher, faulty, listings + 1, 2, await asyncio.wait_for(watcher.next(), 8))
        finally:
            watcher.release()
            listener.poller.stop()
