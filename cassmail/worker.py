"""One worker process of a node: its own store connection and every listener on one event loop.

The supervisor (cassmail.server) forks it; on SIGTERM it stops accepting, lets sessions in
progress finish for `node.stop_grace` seconds, cuts the rest, and closes the store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

from cassmail import store as stores
from cassmail.config import Settings
from cassmail.logs import kv
from cassmail.store.base import Store, StoreError, StoreUnavailable

log = logging.getLogger("cassmail.server")

#: Seconds the sessions still open after `node.stop_grace` have to unwind once their connections are cut.
CUT_GRACE = 3.0
#: Longest pause between two tries to open a store that is not ready.
OPEN_RETRY_PAUSE = 5.0


async def open_store(store: Store, wait: float, stop: asyncio.Event) -> bool:
    """Open the store, retrying for up to `wait` seconds while it is unavailable.

    A node started beside its Cassandra (a compose cluster after a host reboot, where nothing
    orders the containers) would otherwise exit and be restarted in a loop; waiting with one log
    line per try says what it waits for. Returns False when `stop` is set while waiting; raises
    the last StoreUnavailable once `wait` is spent.
    """
    deadline = time.monotonic() + wait
    tries = 0
    while True:
        try:
            await store.open()
        except StoreUnavailable as exc:
            tries += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            pause = min(OPEN_RETRY_PAUSE, left)
            log.warning(kv("store-open", result="retry", tries=tries, retry_in=f"{pause:.0f}s",
                           waited=f"{wait - left:.0f}s", error=exc))
            try:
                await asyncio.wait_for(stop.wait(), pause)
                return False
            except asyncio.TimeoutError:
                continue
        if tries:
            log.info(kv("store-open", result="ok", tries=tries + 1))
        return True


def loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's handler of exceptions nobody retrieved. A peer that resets its connection
    is no error of this node: asyncio's TLS transport (Python 3.11) leaves such a reset in a
    future nobody awaits when it comes during the TLS shutdown. It is logged as one line; every
    other exception goes to asyncio's default handler (with its traceback)."""
    exc = context.get("exception")
    if isinstance(exc, ConnectionError):
        log.info(kv("connection-reset", error=repr(exc)))
        return
    loop.default_exception_handler(context)


async def run_worker(settings: Settings) -> int:
    """One worker: a store connection and every listener on one event loop, until SIGTERM."""
    from cassmail import smtp, twisted_asyncio

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(loop_exception)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reactor = None
    if settings.pop3.enabled or settings.pop3s.enabled:
        # First: importing the Cassandra driver (or twisted.mail) would install Twisted's default reactor.
        reactor = twisted_asyncio.install(loop)
    store = stores.make_store(settings, serving=True)
    if settings.metrics.enabled:
        from cassmail import metrics

        store = metrics.TimedStore(store, metrics.installed())
    try:
        if not await open_store(store, settings.store.open_wait, stop):
            return 0  # asked to stop while waiting
    except StoreError as exc:
        log.error(kv("store-open", result="fail", error=exc))
        print(f"cassmail: error: {exc}", file=sys.stderr, flush=True)
        return 3
    outbound = None
    if settings.delivery.enabled:
        from cassmail.delivery import DeliveryWorker

        outbound = DeliveryWorker(settings, store, settings.node.workers or os.cpu_count() or 1)
        outbound.start()
    servers: list[tuple[Any, Any]] = list(await smtp.start(settings, store, outbound=outbound))
    ports: list = []
    #: Each listener's keeper of sessions (an SMTP handler, a POP3 factory, an IMAP listener):
    #: its `sessions` count and its `open` sessions, under the listener name its session lines
    #: carry (an implicit-TLS POP3 or IMAP listener's sessions are pop3 and imap ones, tls=True).
    keepers: list[tuple[str, Any]] = [(handler.role.name, handler) for _, handler in servers]
    from cassmail import imap

    for server, listener in await imap.start(settings, store):
        servers.append((server, listener))
        keepers.append(("imap", listener))
    if settings.managesieve.enabled:
        from cassmail import managesieve

        for server, sieve_listener in await managesieve.start(settings, store):
            servers.append((server, sieve_listener))
            keepers.append(("managesieve", sieve_listener))
    if reactor is not None:
        from cassmail import pop3

        for port, factory in pop3.start(settings, store, reactor):
            ports.append(port)
            keepers.append(("pop3", factory))
    sampler = None
    if settings.metrics.enabled:
        from cassmail import metrics

        def count(label: str) -> int:
            return sum(keeper.sessions for name, keeper in keepers if name == label)

        counts = {name: (lambda name=name: count(name)) for name in dict.fromkeys(name for name, _ in keepers)}
        sampler = asyncio.ensure_future(metrics.sample_sessions(metrics.installed(), counts))
    log.info(kv("worker-ready", listeners=len(servers) + len(ports)))

    def sessions() -> int:
        return sum(keeper.sessions for _, keeper in keepers)

    async def drain(seconds: float) -> None:
        """Wait until no session is open, for at most `seconds`."""
        deadline = loop.time() + seconds
        while sessions() and loop.time() < deadline:
            await asyncio.sleep(0.05)

    try:
        await stop.wait()
    finally:
        for port in ports:
            await port.stopListening().asFuture(loop)
        for server, _ in servers:
            server.close()
        # Sessions in progress may finish (a DATA being stored, a POP3 QUIT committing) for a while.
        await drain(settings.node.stop_grace)
        if sessions():
            # Cut them, and let them unwind (a command waiting on the store or on the client sees
            # its connection gone) while the store is still open: after store.close() they would
            # fail on a closed store or executor instead of ending.
            log.warning(kv("stop", result="sessions-cut", sessions=sessions(), grace=settings.node.stop_grace))
            for _, keeper in keepers:
                for session in list(keeper.open):
                    transport = session.transport
                    if transport is not None:
                        (getattr(transport, "abortConnection", None) or transport.abort)()
            await drain(CUT_GRACE)
        if outbound is not None:
            await outbound.stop()
        if sampler is not None:
            sampler.cancel()
        await store.close()
    return 0
