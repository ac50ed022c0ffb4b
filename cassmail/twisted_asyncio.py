"""Twisted on the worker's asyncio loop: one loop serves SMTP (aiosmtpd), POP3 and IMAP (Twisted).

Twisted's asyncio reactor is installed on the running loop before anything
imports `twisted.internet.reactor`; the loop is run by asyncio, never by
`reactor.run()`. Listening sockets are made here (SO_REUSEPORT, like the SMTP
listeners) and handed to Twisted, and coroutines and Deferreds are bridged
both ways.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from cassmail.config import ListenerSettings, host_port


def install(loop: asyncio.AbstractEventLoop) -> Any:
    """Install (once per process) and return Twisted's reactor running on `loop`."""
    import sys

    if "twisted.internet.reactor" in sys.modules:
        from twisted.internet import reactor

        if getattr(reactor, "_asyncioEventloop", None) is not loop:
            raise RuntimeError("a Twisted reactor is already installed on another loop")
        return reactor
    from twisted.internet import asyncioreactor

    asyncioreactor.install(eventloop=loop)
    from twisted.internet import reactor

    return reactor


def deferred(coro: Coroutine[Any, Any, Any]) -> Any:
    """A Deferred for a coroutine run as an asyncio task."""
    from twisted.internet.defer import Deferred

    return Deferred.fromFuture(asyncio.ensure_future(coro))


def tls_options(settings: ListenerSettings) -> Any | None:
    """Twisted TLS options (TLS 1.2+) from a listener's PEM files, or None without a certificate."""
    if not settings.tls_cert:
        return None
    from twisted.internet import ssl as tssl

    with open(settings.tls_cert, "rb") as cert, open(settings.tls_key, "rb") as key:
        certificate = tssl.PrivateCertificate.loadPEM(cert.read() + b"\n" + key.read())
    return tssl.CertificateOptions(
        privateKey=certificate.privateKey.original,
        certificate=certificate.original,
        raiseMinimumTo=tssl.TLSVersion.TLSv1_2,
    )


def listen(reactor: Any, settings: ListenerSettings, factory: Any) -> Any:
    """Listen for a Twisted factory on the listener's address with SO_REUSEPORT (so every worker
    has its own socket), with TLS from the first byte when `implicit_tls` is set."""
    host, port = host_port(settings.listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        # Accepted sockets inherit it: a reply's last small write must not wait for the
        # client's delayed ACK (Twisted does not set it; asyncio does for the SMTP side).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
        if settings.implicit_tls:
            from twisted.protocols.tls import TLSMemoryBIOFactory

            factory = TLSMemoryBIOFactory(tls_options(settings), False, factory)
        return reactor.adoptStreamPort(sock.fileno(), family, factory)
    finally:
        sock.close()  # Twisted holds its own duplicate of the descriptor


def listen_all(
    reactor: Any, listeners: Sequence[ListenerSettings], make_factory: Callable[[ListenerSettings, Any], Any]
) -> list[tuple[Any, Any]]:
    """(listening port, factory) of each enabled listener of one protocol, e.g. `[imap]` with
    STARTTLS beside `[imaps]` with TLS from the first byte; `make_factory(settings, tls)` builds
    each listener's factory from its own settings and TLS options."""
    started = []
    for settings in listeners:
        if settings.enabled:
            factory = make_factory(settings, tls_options(settings))
            started.append((listen(reactor, settings, factory), factory))
    return started


class ClientStalled(ConnectionError):
    """The client took none of what was sent to it for the write timeout; the connection is dropped."""


class WriteGate:
    """A push producer that tells the sending coroutine when the transport's buffer is full.

    `timeout` bounds how long a sender waits for a client that stopped reading: a message
    being sent must not let a client hold its session (and the worker's buffers) forever."""

    def __init__(self, transport: Any, timeout: float) -> None:
        self.transport, self.timeout = transport, timeout
        self.open = asyncio.Event()
        self.open.set()
        self.stopped = False

    async def wait(self) -> None:
        """Return once the transport takes more. Raises ConnectionError when the client went
        away, and ClientStalled, after aborting the connection (closing it politely would wait
        for the very buffer that does not drain), when it took nothing for `timeout` seconds."""
        if not self.stopped and not self.open.is_set():
            try:
                await asyncio.wait_for(self.open.wait(), self.timeout)
            except TimeoutError:
                self.transport.abortConnection()
                raise ClientStalled(f"the client took no data for {self.timeout:g} s") from None
        if self.stopped:
            raise ConnectionError("client went away")

    def pauseProducing(self) -> None:
        self.open.clear()

    def resumeProducing(self) -> None:
        self.open.set()

    def stopProducing(self) -> None:
        self.stopped = True
        self.open.set()
