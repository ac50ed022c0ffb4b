"""The POP3 front end (RFC 1939, 2449, 5034, 2595) on Twisted, served from the worker's asyncio loop.

`start(settings, store, reactor)` listens on `[pop3] listen`; nothing here knows a backend.
Import this package only after `twisted_asyncio.install`: Twisted's mail modules pick a
reactor when they are imported.
"""

from __future__ import annotations

from typing import Any

from cassmail.config import Settings
from cassmail.pop3.server import Pop3Factory
from cassmail.store.base import Store
from cassmail.twisted_asyncio import listen, tls_options


def start(settings: Settings, store: Store, reactor: Any) -> list[tuple[Any, Pop3Factory]]:
    """(listening port, factory) of the enabled POP3 listener (none when disabled); the
    factory counts the sessions in progress (`sessions`)."""
    if not settings.pop3.enabled:
        return []
    factory = Pop3Factory(store, settings.pop3, tls_options(settings.pop3))
    return [(listen(reactor, settings.pop3, factory), factory)]
