"""The POP3 front end (RFC 1939, 2449, 5034, 2595) on Twisted, served from the worker's asyncio loop.

`start(settings, store, reactor)` listens on `[pop3] listen` and `[pop3s] listen`; nothing here knows a backend.
Import this package only after `twisted_asyncio.install`: Twisted's mail modules pick a
reactor when they are imported.
"""

from __future__ import annotations

from typing import Any

from cassmail.config import Settings
from cassmail.pop3.server import Pop3Factory
from cassmail.store.base import Store
from cassmail.twisted_asyncio import listen_all


def start(settings: Settings, store: Store, reactor: Any) -> list[tuple[Any, Pop3Factory]]:
    """(listening port, factory) of each enabled POP3 listener, `[pop3]` (STLS) and `[pop3s]`
    (implicit TLS); each factory counts its sessions in progress (`sessions`)."""
    return listen_all(reactor, (settings.pop3, settings.pop3s), lambda listener, tls: Pop3Factory(store, listener, tls))
