"""The IMAP front end (RFC 3501 and the extensions clients use) on the worker's asyncio loop.

`start(settings, store)` listens on `[imap] listen`; nothing here knows a backend. The shape:
`connection` reads commands and writes answers, `parse` turns a command's bytes into a typed
`commands.Command`, `session` is the state machine that runs them, and each command family
has its module (`login`, `mailboxes`, `selected`, `fetch`, `search`, `idle`) over the
selected mailbox's `view`, with `mime` and `wire` for the data formats; what CONDSTORE and
QRESYNC (RFC 7162) add to those commands is in `condstore`.
"""

from __future__ import annotations

from cassmail.imap.listener import Listener, start

__all__ = ["Listener", "start"]
