"""What each listener keeps of its sessions in one worker, the same for SMTP, POP3 and IMAP, and
what every session does to its connection alike (`quick_ack`)."""

from __future__ import annotations

import asyncio
import socket
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


def quick_ack(transport: asyncio.BaseTransport | None) -> None:
    """Acknowledge what the client sends next at once, not after Linux's delayed-ACK timer (40 ms
    and more): for a client that was just asked for a message (SMTP's 354, an IMAP literal's
    continuation). One with Nagle's algorithm on that writes the message and what ends it apart
    (SMTP's CRLF . CRLF: postal does; the CRLF after an IMAP literal: imaplib does) sends the end
    only once the message is acknowledged, and the server, with nothing to answer before the
    end, held that ACK back: every message waited for the timer. TCP_QUICKACK takes the
    connection out of the delayed-ACK mode of request and answer until the server next answers;
    where there is no such option nothing is done."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    option = getattr(socket, "TCP_QUICKACK", None)
    if sock is None or option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, 1)
    except OSError:
        pass  # a connection already gone: the read that follows finds out
