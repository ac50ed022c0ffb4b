"""Users' junk decisions taught to rspamd: what a user flags as junk or moves into Junk over IMAP
is sent to rspamd's controller as spam (`POST /learnspam`), what they take back as ham
(`/learnham`), so its Bayes classifier learns this site's mail.

Learning runs in the background of the worker: the user's STORE or MOVE is answered at once. At
most `CONCURRENCY` messages are sent at a time and `BACKLOG` wait; past that a decision is
dropped (and logged): a spam filter's training is best effort, a user's command is not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterable
from urllib.parse import urlsplit

from cassmail.config import InboundSettings
from cassmail.inbound.spam import SpamFilterUnavailable, post
from cassmail.logs import kv
from cassmail.store.base import NoSuchMessage, Store, StoreError

log = logging.getLogger("cassmail.inbound")

CONCURRENCY = 4
BACKLOG = 1000
#: Flags that say "junk" and "not junk" (RFC 5788's registry; Thunderbird and Apple Mail set them).
JUNK_FLAGS = frozenset({"\\junk", "$junk"})
NOT_JUNK_FLAGS = frozenset({"$notjunk"})


class Learner:
    """The background sender of one worker."""

    def __init__(self, settings: InboundSettings) -> None:
        url = settings.rspamd_controller_url
        if not url:
            normal = urlsplit(settings.rspamd_url)
            url = f"http://{normal.hostname}:11334"
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 11334
        self.base = parts.path.rstrip("/")
        self.password, self.timeout = settings.rspamd_password, settings.rspamd_timeout
        self.junk_mailbox = settings.junk_mailbox
        self._queue: asyncio.Queue[tuple[Store, str, str, uuid.UUID, bool]] = asyncio.Queue(BACKLOG)
        self._workers: list[asyncio.Task[None]] = []

    def judged(self, store: Store, user: str, mailbox: str, ids: Iterable[uuid.UUID], spam: bool) -> None:
        """Learn these messages (in `mailbox`) as spam or as ham, later."""
        if not self._workers:
            self._workers = [asyncio.ensure_future(self._work()) for _ in range(CONCURRENCY)]
        for message_id in ids:
            try:
                self._queue.put_nowait((store, user, mailbox, message_id, spam))
            except asyncio.QueueFull:
                log.warning(kv("rspamd-learn", user=user, result="dropped", why="backlog full"))
                return

    def is_junk(self, name: str, special_use: str | None) -> bool:
        return special_use == "\\Junk" or name == self.junk_mailbox

    async def _work(self) -> None:
        while True:
            store, user, mailbox, message_id, spam = await self._queue.get()
            try:
                await self._learn(store, user, mailbox, message_id, spam)
            finally:
                self._queue.task_done()

    async def _learn(self, store: Store, user: str, mailbox: str, message_id: uuid.UUID, spam: bool) -> None:
        kind = "spam" if spam else "ham"
        try:
            message = await store.read_message(user, mailbox, message_id)
        except NoSuchMessage:
            return  # deleted meanwhile: nothing to learn
        except StoreError as exc:
            log.warning(kv("rspamd-learn", user=user, kind=kind, result="fail", error=exc))
            return
        fields = [("Host", f"{self.host}:{self.port}"), ("Content-Length", str(len(message))), ("Connection", "close")]
        if self.password:
            fields.append(("Password", self.password))
        try:
            reply = await asyncio.wait_for(post(self.host, self.port, f"{self.base}/learn{kind}", fields, message),
                                           self.timeout)
        except (TimeoutError, OSError, SpamFilterUnavailable) as exc:
            log.warning(kv("rspamd-learn", user=user, kind=kind, result="fail", error=str(exc) or "no answer in time"))
            return
        status = reply.split(b"\r\n", 1)[0].split()
        code = status[1].decode("ascii", "replace") if len(status) > 1 else "?"
        if code == "200":
            log.info(kv("rspamd-learn", user=user, kind=kind, result="ok"))
            return
        _, _, body = reply.partition(b"\r\n\r\n")
        try:
            error = str(json.loads(body).get("error", ""))
        except (ValueError, AttributeError):
            error = body[:200].decode("utf-8", "replace")
        # rspamd answers 208 for a message it learned already: not a failure of ours.
        log.info(kv("rspamd-learn", user=user, kind=kind, result="already" if code == "208" else "refused",
                    status=code, error=error))
