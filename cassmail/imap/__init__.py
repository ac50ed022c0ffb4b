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
from cassmail.twisted_asyncio import listen_all


def start(settings: Settings, store: Store, reactor: Any) -> list[tuple[Any, ImapFactory]]:
    """(listening port, factory) of each enabled IMAP listener, `[imap]` and `[imaps]`; each
    factory counts its sessions in progress (`sessions`)."""
    return listen_all(reactor, (settings.imap, settings.imaps), lambda listener, tls: ImapFactory(store, listener, tls))
