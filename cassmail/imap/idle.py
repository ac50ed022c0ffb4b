"""IDLE (RFC 2177): the session waits for DONE and tells the client of changes meanwhile.

Changes made elsewhere are pushed, not polled per session: one `Poller` per listener and worker
asks the store every `idle_poll` seconds which of the mailboxes its IDLE sessions watch have
changed (`Store.changed_mailboxes`: on Cassandra a read of the last seconds' change events, on
mbox an inotify read), however many sessions and mailboxes there are. Only a mailbox reported
changed is looked at, once, by its `Watcher`, which tells every IDLE session on it: where the
store lists new arrivals cheaply (Cassandra, mbox) each session then reads what changed since
its own view (`MailboxView.refresh`: a request or two, whatever the mailbox's size); elsewhere
(WheelFS) the watcher reads the listing once and hands it to them all.
A newly watched mailbox is looked at at the next poll (see `Poller.watch`), unless its changes
token is still the one its first session's view was last brought up to date with (an IDLE that
starts a watcher first brings its view up to date, so usually it is). Every `idle_refresh`
seconds each watched one is looked at again, in case a change's event was lost: its
`changes_token` first, and the sessions are told only when that differs from the token read
before the last look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from cassmail.imap import commands as c
from cassmail.imap.connection import LineTooLong
from cassmail.imap.errors import Bad
from cassmail.imap.view import TOKEN_TRUST, Listing, MailboxView, lists_arrivals, read_listing
from cassmail.logs import kv
from cassmail.store.base import StoreError

if TYPE_CHECKING:
    from cassmail.imap.listener import Listener
    from cassmail.imap.session import Session

log = logging.getLogger("cassmail.imap")


async def idle(session: Session, args: c.Simple) -> str:
    session.continuation(b"idling")
    done = asyncio.ensure_future(session.conn.read_line())
    watcher = None
    news: asyncio.Future[Listing] | None = None
    try:
        view = session.view
        if view is not None:
            if (view.user, view.name) not in session.listener.watchers:
                # What changed since the session's last command is told now, which leaves the
                # view's changes token current: the new watcher's first look then finds the
                # mailbox unchanged and reads no listing.
                await _refresh(session)
            watcher = watch(session.listener, view)
        if watcher is not None and watcher.users > 1:
            # Joining a watcher other sessions share: what it handed out before this session
            # joined is told now, what changes after, the watcher tells. (A new watcher's first
            # look, at the next poll, lists the mailbox unless nothing changed since the view's
            # last refresh.)
            await _refresh(session)
        while True:
            waiting: set[asyncio.Future[object]] = {done}  # type: ignore[arg-type]
            news = asyncio.ensure_future(watcher.next()) if watcher is not None else None
            if news is not None:
                waiting.add(news)  # type: ignore[arg-type]
            finished, _ = await asyncio.wait(waiting, timeout=session.settings.timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            if news is not None and news not in finished:
                news.cancel()
            if done in finished:
                break
            if not finished:  # RFC 2177: a client re-issues IDLE at least every 29 minutes
                session.untagged(b"BYE Autologout; idle for too long")
                session.closing = True
                return "IDLE terminated"
            if news is not None and session.view is not None:
                await _refresh(session, news.result())
    finally:
        # Neither read may be left running, nor its failure unretrieved ("Task exception was
        # never retrieved"): a session cut while idling leaves both behind.
        for pending in (done, news):
            if pending is not None:
                if not pending.done():
                    pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
        if watcher is not None:
            watcher.release()
    try:
        line = done.result()
    except LineTooLong:
        raise Bad("Expected DONE") from None
    if line.strip().upper() != b"DONE":
        raise Bad("Expected DONE")
    return "IDLE terminated"


async def _refresh(session: Session, listing: Listing | None = None) -> None:
    assert session.view is not None
    try:
        await session.refresh(True, listing)
    except StoreError as exc:  # the client is still idling: it hears of it later
        log.warning(kv("imap-idle", user=session.user, mailbox=session.view.name, error=exc))
    await session.conn.drain()


def watch(listener: Listener, view: MailboxView) -> Watcher:
    key = (view.user, view.name)
    found = listener.watchers.get(key)
    if found is None:
        found = listener.watchers[key] = Watcher(listener, key)
        if view.token is not None and time.monotonic() - view.listed_at < TOKEN_TRUST:
            # The token the view was last brought up to date with: while the store's is still
            # that one, the first look reads no listing (the session has it all).
            found.token = view.token
        poller(listener).watch()
    found.users += 1
    return found


def poller(listener: Listener) -> Poller:
    if listener.poller is None:
        listener.poller = Poller(listener)
    return listener.poller


class Poller:
    """Asks the store which watched mailboxes changed (see the module's docstring); runs while
    any mailbox is watched."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._cursor: Any = None
        self._task: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """A mailbox newly watched is looked at by the next round, after that round took its
        state as the baseline of later ones (a look before the baseline would miss a change
        made between the two). A running poller is not hurried for it: on Cassandra a round
        reads every mailbox's change events of the last seconds, hundreds of rows, and clients
        that IDLE again after each command start many watchers; the session brought its view
        up to date just before, and the round comes within `idle_poll` seconds."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        listener, settings = self.listener, self.listener.settings
        while listener.watchers:
            watchers = dict(listener.watchers)
            try:
                changed, self._cursor = await listener.store.changed_mailboxes(list(watchers), self._cursor)
            except StoreError as exc:
                log.warning(kv("imap-idle", error=exc))
                changed = set(watchers)  # cannot tell: list them all, as a poll would
            now = asyncio.get_running_loop().time()
            for key, watcher in watchers.items():
                if key in changed:
                    watcher.list()
                elif watcher.listed_at is None or now - watcher.listed_at >= settings.idle_refresh:
                    watcher.list(unless_unchanged=True)  # (a new one too: see `watch`)
            await asyncio.sleep(settings.idle_poll)
        self._cursor = None  # nothing watched: the next start begins from then

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Watcher:
    """What IDLE sessions on one mailbox in one worker share: the look when the poller reports
    the mailbox changed (one at a time; a report during a look asks for one more), and what it
    hands them: the listing it read, or None where each session reads what changed itself."""

    def __init__(self, listener: Listener, key: tuple[str, str]) -> None:
        self.listener, self.key = listener, key
        self.users = 0
        self.listed_at: float | None = None
        #: The mailbox's changes token read just before the last look (None: not known).
        self.token: Hashable | None = None
        #: Whether the watcher reads the listing for its sessions (the store has no cheap way
        #: to find what arrived), else each reads what changed itself.
        self.lists = not lists_arrivals(listener.store)
        self._next: asyncio.Future[Listing | None] = asyncio.get_running_loop().create_future()
        self._reading: asyncio.Task[None] | None = None
        self._again = False

    def list(self, unless_unchanged: bool = False) -> None:
        """Read the listing and hand it to the sessions; `unless_unchanged`: not when the
        mailbox's changes token is still the one read before the last listing."""
        self.listed_at = asyncio.get_running_loop().time()
        if self._reading is not None and not self._reading.done():
            self._again = True
            return
        self._reading = asyncio.ensure_future(self._read(unless_unchanged))

    async def _read(self, unless_unchanged: bool) -> None:
        settings, store = self.listener.settings, self.listener.store
        while True:
            self._again = False
            try:
                # Read before the listing: a change made between the two shows at the next look.
                token = await store.changes_token(*self.key)
            except StoreError:
                token = None
            unchanged = unless_unchanged and token is not None and token == self.token
            unless_unchanged = False  # a report during this read asks for a listing
            self.token = token
            if unchanged:
                if not self._again:
                    return
                continue
            try:
                # with the HIGHESTMODSEQ, for the sessions that have CONDSTORE on
                listing = (await read_listing(store, self.key[0], self.key[1], settings.page_size, highest=True)
                           if self.lists else None)
            except StoreError as exc:
                log.warning(kv("imap-idle", user=self.key[0], mailbox=self.key[1], error=exc))
                self.token = None  # not taken in: the next look lists whatever the token says
            else:
                done, self._next = self._next, asyncio.get_running_loop().create_future()
                done.set_result(listing)
            if not self._again:
                return

    async def next(self) -> Listing | None:
        """What the next look hands out (when the mailbox changes): the listing, or None (each
        session reads what changed itself)."""
        return await asyncio.shield(self._next)

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            if self._reading is not None:
                self._reading.cancel()
            self.listener.watchers.pop(self.key, None)
