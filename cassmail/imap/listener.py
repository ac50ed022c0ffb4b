"""An IMAP listener in one worker: the asyncio server, the sessions it holds, and what they
share (store, settings, login throttle, the watchers IDLE sessions share)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from typing import Any

from cassmail import auth
from cassmail.config import ImapSettings, Settings, host_port
from cassmail.imap import parse
from cassmail.imap.connection import Connection
from cassmail.imap.cache import Lru
from cassmail.imap.mime import Entity
from cassmail.imap.session import Session, load_commands
from cassmail.imap.snapshots import Snapshots
from cassmail.inbound.learn import Learner
from cassmail.logs import kv
from cassmail.sessions import Sessions
from cassmail.store.base import Store
from cassmail.tls import server_context

log = logging.getLogger("cassmail.imap")

#: Mailboxes whose STATUS counts a worker keeps.
STATUSES_KEPT = 10_000


class Listener(Sessions):
    """Shared by every session of one listener in one worker."""

    def __init__(self, store: Store, settings: ImapSettings, learner: Learner | None = None) -> None:
        load_commands()
        self.store, self.settings = store, settings
        #: What users flag as junk or not, taught to rspamd (inbound.rspamd_learn); None: not.
        self.learner = learner
        #: The context STARTTLS uses (None: not offered); implicit TLS is the server's own.
        self.tls = server_context(settings) if not settings.implicit_tls else None
        self.logins = auth.Logins("imap", settings)
        self.message_limit = parse.message_limit(store.max_message_size or (1 << 31))
        #: Parsed message headers by message id (a message's bytes never change), up to about
        #: header_cache_bytes.
        self.headers: Lru[Entity] = Lru(settings.header_cache_bytes)
        #: (user, mailbox) -> (changes token, STATUS values): a STATUS of a mailbox that did not
        #: change since is answered without listing it again.
        self.statuses: Lru[tuple[Hashable, dict[str, int]]] = Lru(STATUSES_KEPT)
        #: (user, mailbox, UIDVALIDITY) -> the highest \Recent mark a session learnt (MailboxView).
        self.recent_marks: Lru[int] = Lru(STATUSES_KEPT)
        #: The states of views closed here (and in the store, of large mailboxes), which the next
        #: SELECT of their mailbox starts from (MailboxView.restore).
        self.snapshots = Snapshots(store, settings)
        Sessions.__init__(self, settings.max_connections)
        #: (user, mailbox) -> the Watcher IDLE sessions on that mailbox share (cassmail.imap.idle).
        self.watchers: dict[tuple[str, str], Any] = {}
        #: The Poller that asks the store which watched mailboxes changed (cassmail.imap.idle).
        self.poller: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    def protocol(self) -> Connection:
        return _Accepted(self)

    async def serve(self, conn: Connection) -> None:
        transport = conn.transport
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) else str(peer)
        session = Session(self, conn, host, secure=transport.get_extra_info("ssl_object") is not None)
        admitted = self.opened(session)
        try:
            await session.run(admitted)
        finally:
            self.closed(session)
            log.info(kv("session", listener="imap", peer=host, user=session.user, tls=session.secure,
                        commands=session.commands, ms=int((time.monotonic() - session.opened_at) * 1000)))


class _Accepted(Connection):
    """A connection that starts its session once it is made."""

    def __init__(self, listener: Listener) -> None:
        settings = listener.settings
        super().__init__(settings.max_line_length, settings.max_pipelined_bytes, settings.write_timeout)
        self.listener = listener

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        task = asyncio.ensure_future(self.listener.serve(self))
        self.listener._tasks.add(task)  # held until done: a task nobody references may be collected
        task.add_done_callback(self.listener._tasks.discard)


async def start(settings: Settings, store: Store) -> list[tuple[asyncio.AbstractServer, Listener]]:
    """(server, listener) of each enabled IMAP listener: `[imap]` (STARTTLS) and `[imaps]` (TLS
    from the first byte)."""
    started = []
    learner = Learner(settings.inbound) if settings.inbound.rspamd_learn else None
    for listening in (settings.imap, settings.imaps):
        if not listening.enabled:
            continue
        listener = Listener(store, listening, learner)
        host, port = host_port(listening.listen)
        ssl = server_context(listening) if listening.implicit_tls else None
        server = await asyncio.get_running_loop().create_server(
            listener.protocol, host, port, ssl=ssl, reuse_port=True, backlog=1024)
        started.append((server, listener))
    return started
