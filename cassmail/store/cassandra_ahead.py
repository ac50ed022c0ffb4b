"""Numbering ahead (`store.cassandra.number_ahead`): UIDs for the mail a process delivered, given
in the background once one mailbox got enough of it.

A delivery writes its rows and no UID: a UID is a Paxos round on the mailbox's partition, kept off
the delivery's path (and a mailbox read over IMAP now and then numbers a few new messages at each
look, which costs little). A mailbox that gets much mail and is not read meanwhile (a new account
filled by a migration, a list archive) would leave all of it to its next SELECT, which then
numbers them all, 100,000 messages in several seconds. So each process notes, per mailbox, the
ids it delivered; when a mailbox got `number_ahead` of them within WINDOW seconds, one task
numbers them, a conditional batch per 1,024 (in the order of their ids), while delivery goes
on. What a failed or cut numbering leaves is numbered by the next listing, as before; what a
session numbered first is skipped.

Mail that trickles in is left alone: a mailbox read only over POP3 is never numbered, and its
deletions stay plain writes (a numbered mailbox's deletions are Paxos rounds, for QRESYNC's
VANISHED). A deletion by this process waits for the numbering of its mailbox and drops what was
noted (`forget`), so the two do not race; one on another process may, as an IMAP session's
numbering may: a message deleted between the numbering's read and its write keeps a row without
its body that every reader skips.

The ids noted are held in memory, at most TRACKED_IDS per process: the mailboxes that got mail
least recently are forgotten first (their mail is numbered at their next SELECT).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from cassmail.store.base import StoreError

log = logging.getLogger(__name__)

#: Ids noted per process at most (about 100 bytes each).
TRACKED_IDS = 100_000
#: Seconds within which a mailbox must get `number_ahead` messages to be numbered ahead.
WINDOW = 600.0
#: Seconds `close` lets numberings in progress run before it cuts them.
CLOSE_GRACE = 5.0


class NumberAhead:
    """The ids a process delivered per mailbox, and the numbering of a mailbox that got enough."""

    def __init__(self, threshold: int, number: Callable[[uuid.UUID, list[uuid.UUID]], Awaitable[object]]) -> None:
        #: Ids that start a numbering (0: never).
        self.threshold = threshold
        self._number = number
        #: mailbox id -> (when the first of its ids was noted, the ids), the most recent last
        self._noted: OrderedDict[uuid.UUID, tuple[float, list[uuid.UUID]]] = OrderedDict()
        self._count = 0
        self._running: dict[uuid.UUID, asyncio.Task[None]] = {}

    def delivered(self, mailbox_id: uuid.UUID, message_id: uuid.UUID) -> None:
        if self.threshold <= 0:
            return
        now = time.monotonic()
        since, ids = self._noted.pop(mailbox_id, None) or (now, [])
        if now - since > WINDOW:  # trickling in: start counting again
            self._count -= len(ids)
            since, ids = now, []
        ids.append(message_id)
        self._noted[mailbox_id] = (since, ids)
        self._count += 1
        while self._count > TRACKED_IDS:
            _, (_, dropped) = self._noted.popitem(last=False)
            self._count -= len(dropped)
        if len(ids) >= self.threshold and mailbox_id not in self._running:
            self._start(mailbox_id)

    async def forget(self, mailbox_id: uuid.UUID) -> None:
        """Drop what was noted of a mailbox and wait for its numbering in progress (a deletion
        is about to look at its messages)."""
        _, ids = self._noted.pop(mailbox_id, None) or (0.0, [])
        self._count -= len(ids)
        task = self._running.get(mailbox_id)
        if task is not None:
            await asyncio.wait([task])

    def _start(self, mailbox_id: uuid.UUID) -> None:
        _, ids = self._noted.pop(mailbox_id)
        self._count -= len(ids)
        ids.sort(key=lambda message_id: message_id.time)
        task = asyncio.ensure_future(self._run(mailbox_id, ids))
        self._running[mailbox_id] = task
        task.add_done_callback(lambda _, mailbox_id=mailbox_id: self._done(mailbox_id))

    async def _run(self, mailbox_id: uuid.UUID, ids: list[uuid.UUID]) -> None:
        try:
            await self._number(mailbox_id, ids)
        except StoreError as exc:  # the next listing numbers them
            log.info("numbering ahead of %d messages in mailbox %s left to the next listing: %s", len(ids), mailbox_id, exc)
        except Exception:  # noqa: BLE001 - a bug must not leave a task's error unread
            log.exception("numbering ahead of %d messages in mailbox %s failed", len(ids), mailbox_id)

    def _done(self, mailbox_id: uuid.UUID) -> None:
        self._running.pop(mailbox_id, None)
        _, ids = self._noted.get(mailbox_id) or (0.0, [])
        if len(ids) >= self.threshold > 0:
            self._start(mailbox_id)  # more came while it ran

    async def close(self) -> None:
        """Take no more; let numberings in progress finish for a moment, then cut them."""
        self.threshold = 0
        tasks = list(self._running.values())
        if tasks:
            _, cut = await asyncio.wait(tasks, timeout=CLOSE_GRACE)
            for task in cut:
                task.cancel()
            if cut:
                await asyncio.wait(cut)
        self._noted.clear()
        self._count = 0
