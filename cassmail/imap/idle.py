"""IDLE (RFC 2177): the session waits for DONE and tells the client of changes meanwhile.

Changes made elsewhere are found by one `Watcher` per watched mailbox and worker: every
`idle_poll` seconds it lists the mailbox (giving UIDs to new messages) and hands the same
listing to every IDLE session on it, so the store is asked once per interval however many
sessions idle on the mailbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap.connection import LineTooLong
from cassmail.imap.errors import Bad
from cassmail.imap.view import Listing, read_listing
from cassmail.logs import kv
from cassmail.store.base import StoreError

if TYPE_CHECKING:
    from cassmail.imap.listener import Listener
    from cassmail.imap.session import Session

log = logging.getLogger("cassmail.imap")


async def idle(session: Session, args: c.Simple) -> str:
    session.continuation(b"idling")
    done = asyncio.ensure_future(session.conn.read_line())
    watcher = watch(session.listener, session.view.user, session.view.name) if session.view is not None else None
    try:
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
                try:
                    await session.refresh(True, news.result())
                except StoreError as exc:  # the client is still idling: it hears of it later
                    log.warning(kv("imap-idle", user=session.user, mailbox=session.view.name, error=exc))
                await session.conn.drain()
    finally:
        if not done.done():
            done.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await done
        if watcher is not None:
            watcher.release()
    try:
        line = done.result()
    except LineTooLong:
        raise Bad("Expected DONE") from None
    if line.strip().upper() != b"DONE":
        raise Bad("Expected DONE")
    return "IDLE terminated"


def watch(listener: Listener, user: str, mailbox: str) -> Watcher:
    key = (user, mailbox)
    found = listener.watchers.get(key)
    if found is None:
        found = listener.watchers[key] = Watcher(listener, key)
    found.users += 1
    return found


class Watcher:
    """One reader per watched mailbox and worker (see the module's docstring)."""

    def __init__(self, listener: Listener, key: tuple[str, str]) -> None:
        self.listener, self.key = listener, key
        self.users = 0
        self._next: asyncio.Future[Listing] = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        settings, store = self.listener.settings, self.listener.store
        while True:
            await asyncio.sleep(settings.idle_poll)
            try:
                # with the HIGHESTMODSEQ, for the sessions that have CONDSTORE on
                listing = await read_listing(store, self.key[0], self.key[1], settings.page_size, highest=True)
            except StoreError as exc:
                log.warning(kv("imap-idle", user=self.key[0], mailbox=self.key[1], error=exc))
                continue
            done, self._next = self._next, asyncio.get_running_loop().create_future()
            done.set_result(listing)

    async def next(self) -> Listing:
        """The next listing (waits for the next tick)."""
        return await asyncio.shield(self._next)

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self._task.cancel()
            self.listener.watchers.pop(self.key, None)
