"""The node's supervisor: `cassmail serve`.

`serve` is a small supervisor: it checks that every listening address can be
bound (and resolves port 0), then forks `node.workers` worker processes (one
per core by default). Each worker opens its own store connection and its own
listening sockets with SO_REUSEPORT, so the kernel spreads connections over
the workers; what they share is made before the fork (the login-attempt
table of cassmail.auth, the metrics directory). The supervisor restarts a worker
that dies and, on SIGTERM/SIGINT, asks every worker to stop (cassmail.worker:
it stops accepting, lets sessions in progress finish for a grace period, then
closes the store).

With `[metrics] enabled`, the supervisor makes a private directory for
prometheus_client's multiprocess mode before it forks, binds the HTTP endpoint
and forks an exporter process that serves /metrics from it (cassmail.metrics);
each worker counts its events and times its store calls into that directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import time

from cassmail import logs
from cassmail.config import LISTENER_PROTOCOLS, ConfigError, Settings, host_port
from cassmail.logs import kv
from cassmail.worker import run_worker

log = logging.getLogger("cassmail.server")

#: A worker that dies sooner than this after its start is restarted only after a pause.
RESTART_PAUSE = 1.0


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
    return_large_buffers()

    from cassmail import auth

    auth.share_failures(settings.auth)  # before the workers fork: they count login attempts together
    try:
        if workers == 1:
            return asyncio.run(run_worker(settings))
        return _supervise(settings, workers, exporter)
    finally:
        if exporter is not None:
            exporter.close()


#: Allocations from this size up get their own mapping, given back to the system when freed.
LARGE_BUFFER = 1 << 20


def return_large_buffers() -> None:
    """Make glibc map every allocation of LARGE_BUFFER or more on its own (inherited by the
    workers). By default its threshold rises to the size of each large block freed, so after
    one 25 MB message (or a password hash's 16 MiB) blocks that size come from the heap and
    the worker stays that much larger for good; with a fixed threshold they are unmapped when
    freed. Elsewhere than glibc this does nothing."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, LARGE_BUFFER)  # M_MMAP_THRESHOLD


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
