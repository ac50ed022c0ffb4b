"""The IMAP front end (RFC 3501 and the extensions clients use) on Twisted, served from the
worker's asyncio loop.

`start(settings, store, reactor)` listens on `[imap] listen`; nothing here knows a backend.
Import this package only after `twisted_asyncio.install`: Twisted's mail modules pick a
reactor when they are imported.
"""

from __future__ import annotations

from typing import Any

from cassmail.config import Settings
from cassmail.imap.session import ImapFactory
from cassmail.store.base import Store
from cassmail.twisted_asyncio import listen, tls_options


def start(settings: Settings, store: Store, reactor: Any) -> list[tuple[Any, ImapFactory]]:
    """(listening port, factory) of the enabled IMAP listener (none when disabled); the factory
    counts the sessions in progress (`sessions`)."""
    if not settings.imap.enabled:
        return []
    factory = ImapFactory(store, settings.imap, tls_options(settings.imap))
    return [(listen(reactor, settings.imap, factory), factory)]
