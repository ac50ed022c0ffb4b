"""What each listener keeps of its sessions in one worker, the same for SMTP, POP3 and IMAP."""

from __future__ import annotations

from typing import Any


class Sessions:
    """The sessions of one listener in one worker: how many are open (`sessions`: the metrics
    and a stopping worker's drain read it), the sessions themselves (`open`: a stopping worker
    cuts those its grace period did not end), and the bound `max_connections` puts on them."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.sessions = 0
        self.open: set[Any] = set()

    def opened(self, session: Any) -> bool:
        """Count a new session; False when it is one too many, for the protocol to turn it away
        in its own words (it is counted until it closes all the same)."""
        self.sessions += 1
        self.open.add(session)
        return self.sessions <= self.max_connections

    def closed(self, session: Any) -> None:
        if session in self.open:
            self.open.discard(session)
            self.sessions -= 1
