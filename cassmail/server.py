"""Wires settings, the store and the listeners into a running node.

`serve` is a small supervisor: it checks that every listening address can be
bound (and resolves port 0), then forks `node.workers` worker processes (one
per core by default). Each worker opens its own store connection and its own
listening sockets with SO_REUSEPORT, so the kernel spreads connections over
the workers and no state is shared between them. The supervisor restarts a
worker that dies and, on SIGTERM/SIGINT, asks every worker to stop: a worker
stops accepting, lets sessions in progress finish for a grace period, then
closes the store.

With `[metrics] enabled`, the supervisor makes a private directory for
prometheus_client's multiprocess mode before it forks, binds the HTTP endpoint
and forks an exporter process that serves /metrics from it (cassmail.metrics);
each worker counts its events and times its store calls into that directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from cassmail import logs
from cassmail.config import LISTENER_PROTOCOLS, ConfigError, Settings, host_port
from cassmail.logs import kv
from cassmail.store.base import Store, StoreError, StoreUnavailable

log = logging.getLogger("cassmail.server")

#: Seconds a stopping worker waits for sessions in progress.
STOP_GRACE = 10.0
#: Seconds the sessions still open after it have to unwind once their connections are cut.
CUT_GRACE = 3.0
#: A worker that dies sooner than this after its start is restarted only after a pause.
RESTART_PAUSE = 1.0


def make_store(settings: Settings) -> Store:
    """The configured backend, not yet opened. Backends are imported here only, on demand."""
    backend = settings.store.backend
    if backend == "cassandra":
        from cassmail.store.cassandra import CassandraStore

        return CassandraStore(settings.store.cassandra, max_message_size=settings.store.max_message_size)
    if backend == "mbox":
        from cassmail.store.mbox import MboxStore

        return MboxStore(settings.store.mbox, max_message_size=settings.store.max_message_size)
    if backend == "wheelfs":
        from cassmail.store.wheelfs import WheelFSStore

        return WheelFSStore(settings.store.wheelfs, max_message_size=settings.store.max_message_size)
    raise ConfigError(f"store.backend: {backend!r} is not available in this version of cassmail (use mbox, cassandra or wheelfs)")


#: Every listener a node can run, by its settings section.
LISTENERS = tuple(LISTENER_PROTOCOLS)


def enabled_listeners(settings: Settings) -> dict[str, tuple[str, int]]:
    """Name -> (host, port) of every listener this node runs."""
    return {name: host_port(getattr(settings, name).listen) for name in LISTENERS if getattr(settings, name).enabled}


def _reserve(address: tuple[str, int]) -> socket.socket:
    """Bind (without listening) so the address is known to be free and port 0 gets a number;
    with SO_REUSEPORT the workers can bind the same address beside it."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {address[0]}:{address[1]}: {exc.strerror}") from None
    return sock


def serve(settings: Settings) -> int:
    """Run the node until SIGTERM/SIGINT; returns the exit code."""
    logs.setup(settings.node.log_level)
    from cassmail.tls import TLSConfigError, server_context

    for name in enabled_listeners(settings):
        try:
            server_context(getattr(settings, name))  # a bad certificate is one line now, not a worker crash later
        except TLSConfigError as exc:
            raise ConfigError(f"{name}.tls_cert: {exc}") from None
    reserved = {name: _reserve(addr) for name, addr in enabled_listeners(settings).items()}
    if not reserved:
        raise ConfigError(f"no listener is enabled: enable at least one of {', '.join(f'[{n}]' for n in LISTENERS)}")
    for name, sock in reserved.items():
        host, port = sock.getsockname()[:2]
        setattr(getattr(settings, name), "listen", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    workers = settings.node.workers or os.cpu_count() or 1
    metrics_sock = _bind_metrics(settings) if settings.metrics.enabled else None
    listening = " ".join(f"{name}={getattr(settings, name).listen}" for name in reserved)
    if metrics_sock is not None:
        listening += f" metrics={settings.metrics.listen}"
    log.info(kv("start", node=settings.node.name, workers=workers, backend=settings.store.backend, listen=listening))
    print(f"cassmail: serving {listening} with {workers} worker(s)", flush=True)
    exporter = _Exporter(settings, metrics_sock) if metrics_sock is not None else None
    try:
        if workers == 1:
            return asyncio.run(run_worker(settings))
        return _supervise(settings, workers, exporter)
    finally:
        if exporter is not None:
            exporter.close()


def _bind_metrics(settings: Settings) -> socket.socket:
    """The metrics endpoint, bound and listening before anything forks; port 0 gets its number."""
    from cassmail import metrics

    host, port = host_port(settings.metrics.listen)
    try:
        sock = metrics.bind(host, port)
    except OSError as exc:
        raise ConfigError(f"metrics.listen: cannot listen on {host}:{port}: {exc.strerror}") from None
    host, port = sock.getsockname()[:2]
    settings.metrics.listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return sock


class _Exporter:
    """The node's metrics: the multiprocess directory, the counters of this process (inherited
    by the workers it forks) and the process serving /metrics."""

    def __init__(self, settings: Settings, sock: socket.socket) -> None:
        from cassmail import metrics

        self.path = metrics.prepare()  # before any metric exists, so every value goes to a file
        metrics.install(enabled_listeners(settings))
        self.sock = sock
        self.pid: int | None = metrics.start_exporter(sock, self.path)

    def exited(self, pid: int, code: int, stopping: bool) -> bool:
        """True when `pid` was the exporter; it is started again unless the node is stopping."""
        from cassmail import metrics

        if pid != self.pid:
            return False
        self.pid = None
        if not stopping:
            log.error(kv("metrics-exit", pid=pid, code=code))
            time.sleep(RESTART_PAUSE)
            self.pid = metrics.start_exporter(self.sock, self.path)
        return True

    def worker_exited(self, pid: int) -> None:
        from cassmail import metrics

        metrics.process_dead(pid, self.path)

    def close(self) -> None:
        """Stop the exporter and remove the directory."""
        from cassmail import metrics

        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = None
        self.sock.close()
        metrics.cleanup(self.path)


def _supervise(settings: Settings, workers: int, exporter: _Exporter | None = None) -> int:
    children: dict[int, float] = {}
    stopping = False

    def spawn() -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if exporter is not None:
                exporter.sock.close()  # else a scrape would wait on it for ever once the exporter is gone
            code = 1
            try:
                code = asyncio.run(run_worker(settings))
            finally:
                logging.shutdown()
                os._exit(code)
        children[pid] = time.monotonic()

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in range(workers):
        spawn()
    exit_code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        code = os.waitstatus_to_exitcode(status)
        if exporter is not None and exporter.exited(pid, code, stopping):
            continue
        started = children.pop(pid, None)
        if started is None:
            continue
        if exporter is not None:
            exporter.worker_exited(pid)
        if stopping:
            continue
        log.error(kv("worker-exit", worker=pid, code=code))
        if code == 3:  # the store could not be opened: restarting will not help
            exit_code = 3
            stop(signal.SIGTERM, None)
            continue
        if time.monotonic() - started < RESTART_PAUSE:
            time.sleep(RESTART_PAUSE)
        spawn()
    log.info(kv("stopped", node=settings.node.name))
    return exit_code


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


async def run_worker(settings: Settings) -> int:
    """One worker: a store connection and every listener on one event loop, until SIGTERM."""
    from cassmail import smtp, twisted_asyncio

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reactor = None
    if settings.pop3.enabled or settings.pop3s.enabled:
        # First: importing the Cassandra driver (or twisted.mail) would install Twisted's default reactor.
        reactor = twisted_asyncio.install(loop)
    store = make_store(settings)
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
        await drain(STOP_GRACE)
        if sessions():
            # Cut them, and let them unwind (a command waiting on the store or on the client sees
            # its connection gone) while the store is still open: after store.close() they would
            # fail on a closed store or executor instead of ending.
            log.warning(kv("stop", result="sessions-cut", sessions=sessions(), grace=STOP_GRACE))
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
