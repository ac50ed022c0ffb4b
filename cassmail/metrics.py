"""Prometheus metrics of a node: totals over every worker process, served at /metrics.

Why multiprocess mode: `cassmail serve` forks workers that share the listening
sockets, so one worker's counters are only a share of the node's. With
prometheus_client's multiprocess mode every process writes its values to its own
memory-mapped files in one private directory (PROMETHEUS_MULTIPROC_DIR, made by
the supervisor before it forks and removed when it stops) and the exporter adds
them up at each scrape. A dead worker's counter and histogram files stay, so a
total never goes down when a worker is killed and restarted; its gauge files are
dropped (`mark_process_dead`), so the open-session gauge counts live workers only.

The exporter is a child process of the supervisor, not a thread in it: the
supervisor forks workers for as long as the node runs, and forking a process that
has threads can copy a lock some thread holds. The supervisor binds the endpoint
before anything forks, so a port in use is one line at start-up.

What is counted comes from the structured log events (`cassmail.logs.kv`): every
front end already says there who, what and how long, so no protocol knows about
metrics. Labels take only bounded values (listener names, results, error kinds,
store operations), never a user, a peer or a mailbox. Store latency comes from
`TimedStore`, which wraps the Store contract and knows no backend.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cassmail import logs
from cassmail.config import LISTENER_PROTOCOLS
from cassmail.processes import pid_alive
from cassmail.store.base import Store

log = logging.getLogger("cassmail.metrics")

#: The variable prometheus_client reads to write values to files instead of memory.
ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Name of the private directories, `<prefix><supervisor pid>-<random>` in the temporary directory.
DIR_PREFIX = "cassmail-metrics-"
#: The path served; anything else is 404.
PATH = "/metrics"
#: Seconds between two samples of the sessions in progress, in each worker.
SAMPLE_INTERVAL = 1.0

#: Values the `listener` label takes: the listeners, and "node" for what belongs to none.
LISTENERS = ("smtp", "submission", "submissions", "lmtp", "pop3", "imap", "managesieve")
#: The SMTP-family listeners (they deliver and queue).
SMTP_LISTENERS = ("smtp", "submission", "submissions", "lmtp")
#: What an outbound attempt did for one recipient.
OUTBOUND_RESULTS = ("sent", "deferred", "bounced")
NODE = "node"
DELIVERY_RESULTS = ("ok", "tempfail", "too-large", "rejected", "over-quota")
#: What an MX check (step "auth": sender authentication, "spam": rspamd) made of a message.
INBOUND_STEPS = ("auth", "spam")
INBOUND_RESULTS = ("accept", "junk", "tempfail", "reject", "timeout", "unavailable", "too-large")
AUTH_RESULTS = ("ok", "fail", "tempfail", "error", "closed")
#: Any other value of a bounded label.
OTHER = "other"

#: Events that are failures whenever they happen: (listener when the event names none, kind).
#: "internal" is a bug caught before it reached a client. aiosmtpd's handler errors do not
#: say which of smtp, submission and lmtp they came from: they count under "smtp".
_ALWAYS_ERRORS: dict[str, tuple[str, str]] = {
    "session-error": ("smtp", "internal"),
    "pop3-error": ("pop3", "internal"),
    "imap-error": ("imap", "internal"),
}
#: Events that are bugs caught when their `result` is "error".
_ERROR_RESULTS: dict[str, str] = {"outbound": NODE, "queue-take": NODE}
#: Events that are failures when they carry `error=` (the store failed them) and a `result` of
#: _STORE_FAILED (none, or the store's); listener when the event names none. A client's own
#: trouble logged on the same event (POP3 retr result=stalled) is not the store's.
_STORE_FAILED = (None, "tempfail", "cut", "fail")
_STORE_ERRORS: dict[str, str] = {
    "delivery": "smtp", "rcpt": "smtp", "mail": "smtp", "auth": NODE, "retr": "pop3", "quit": "pop3",
    "imap-store": "imap", "imap-idle": "imap", "imap-uids": "imap", "imap-append": "imap", "imap-uidnext": "imap",
    "imap-renumber": "imap", "imap-recent": "imap", "store-open": NODE, "outbound": NODE, "queue-take": NODE,
    "dsn": NODE,
}
#: Seconds; mail sessions last from milliseconds (a delivery) to half an hour (an IMAP IDLE).
SESSION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
DELIVERY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Seconds from queueing to the final outcome: from a moment to the five-day lifetime.
QUEUE_AGE_BUCKETS = (1.0, 5.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0, 2 * 86400.0, 5 * 86400.0)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def _bounded(value: object, allowed: Iterable[str]) -> str:
    return value if isinstance(value, str) and value in allowed else OTHER


def _seconds(ms: object) -> float | None:
    return ms / 1000 if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None


# --------------------------------------------------------------------------- the metrics


class Metrics:
    """Every metric of a node, and the event observer that feeds them.

    `registry` None (multiprocess mode) registers nowhere: the exporter reads the files."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Any:
            return Counter(name, doc, list(labels), registry=registry)

        def histogram(name: str, doc: str, labels: Iterable[str], buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=registry)

        self.deliveries = counter(
            "cassmail_deliveries", "Messages offered by DATA (SMTP, submission, LMTP), by result",
            ("listener", "result"))
        self.delivery_bytes = counter(
            "cassmail_delivery_bytes", "Bytes of the messages delivered (as sent, before trace headers)", ("listener",))
        self.delivery_recipients = counter(
            "cassmail_delivery_recipients", "Recipients of the messages delivered", ("listener",))
        self.delivery_seconds = histogram(
            "cassmail_delivery_seconds", "From the end of DATA to the answer, every result", ("listener",),
            DELIVERY_BUCKETS)
        self.sessions = counter("cassmail_sessions", "Sessions ended (connections closed)", ("listener",))
        self.inbound = counter(
            "cassmail_inbound_checks", "MX checks by step (auth: SPF/DKIM/DMARC/ARC, spam: rspamd) and result; "
            "spam=unavailable counts messages rspamd did not judge (accepted unfiltered or deferred, by setting)",
            ("step", "result"))
        self.session_seconds = histogram(
            "cassmail_session_seconds", "Length of the sessions ended", ("listener",), SESSION_BUCKETS)
        self.sessions_open = Gauge(
            "cassmail_sessions_open", "Sessions in progress in the live workers (sampled each second)",
            ["listener"], multiprocess_mode="livesum", registry=registry)
        self.auth = counter(
            "cassmail_auth", "Password checks (SMTP AUTH, POP3, IMAP), by result", ("listener", "result"))
        self.errors = counter(
            "cassmail_errors",
            "Failures: kind=store when the store failed a request (the client was told to retry), "
            "kind=internal for a bug caught before it reached the client",
            ("listener", "kind"))
        self.worker_exits = counter(
            "cassmail_worker_exits",
            "Workers that exited unexpectedly (another is started unless the store could not be opened)")
        self.outbound_queued = counter(
            "cassmail_outbound_queued", "Messages queued for other domains (accepted by submission)")
        self.outbound_recipients_queued = counter(
            "cassmail_outbound_queued_recipients", "Recipients in other domains of the messages queued")
        self.outbound = counter(
            "cassmail_outbound", "Recipients in other domains: sent (a 2xx), bounced (a 5xx or the lifetime over: "
            "a DSN went to the sender, unless it was <>), and attempts deferred (4xx, no connection, ...: tried "
            "again later)",
            ("result",))
        self.outbound_seconds = histogram(
            "cassmail_outbound_seconds", "Length of delivery attempts (connection and transaction)", (),
            DELIVERY_BUCKETS)
        self.queue_age = histogram(
            "cassmail_outbound_queue_age_seconds", "Time from queueing to sent or bounced, per recipient", (),
            QUEUE_AGE_BUCKETS)
        self.store_seconds = histogram(
            "cassmail_store_seconds", "Store calls by operation; a stream counts the time spent waiting for its chunks",
            ("op",), STORE_BUCKETS)
        self.store_errors = counter(
            "cassmail_store_errors", "Store calls that raised, by operation and exception (its contract class)",
            ("op", "kind"))

    def touch(self, listeners: Iterable[str]) -> None:
        """Create the series of the enabled listeners at zero, so a rate() over them works from the
        first scrape and a listener that saw nothing shows 0, not nothing."""
        for listener in listeners:
            self.sessions.labels(listener)
            self.session_seconds.labels(listener)
            self.sessions_open.labels(listener).set(0)
            self.errors.labels(listener, "store")
            self.errors.labels(listener, "internal")
            if listener in SMTP_LISTENERS:
                for result in DELIVERY_RESULTS:
                    self.deliveries.labels(listener, result)
                self.delivery_bytes.labels(listener)
                self.delivery_seconds.labels(listener)
                self.delivery_recipients.labels(listener)
            if listener != "lmtp":  # LMTP has no AUTH
                for result in ("ok", "fail", "tempfail"):
                    self.auth.labels(listener, result)
        self.worker_exits.inc(0)
        for result in OUTBOUND_RESULTS:
            self.outbound.labels(result)
        self.outbound_queued.inc(0)
        self.outbound_recipients_queued.inc(0)

    def on_event(self, event: str, fields: Mapping[str, object]) -> None:
        """A `kv` observer: counts deliveries, sessions, password checks, errors and worker exits."""
        named = fields.get("listener")
        listener = named if isinstance(named, str) and named in LISTENERS else None
        if event == "delivery":
            listener = listener or "smtp"
            result = _bounded(fields.get("result"), DELIVERY_RESULTS)
            self.deliveries.labels(listener, result).inc()
            seconds = _seconds(fields.get("ms"))
            if seconds is not None:
                self.delivery_seconds.labels(listener).observe(seconds)
            size, rcpts = fields.get("size"), fields.get("rcpts")
            if result == "ok" and isinstance(size, int):
                self.delivery_bytes.labels(listener).inc(size)
            if result == "ok" and isinstance(rcpts, int):
                self.delivery_recipients.labels(listener).inc(rcpts)
            queued = fields.get("queued")
            if result == "ok" and isinstance(queued, int) and queued > 0:
                self.outbound_queued.inc()
                self.outbound_recipients_queued.inc(queued)
        elif event == "outbound" and fields.get("result") in OUTBOUND_RESULTS:
            # Every attempt is timed; a deferral is counted here, the final outcome below.
            if fields["result"] == "deferred":
                self.outbound.labels("deferred").inc()
            seconds = _seconds(fields.get("ms"))
            if seconds is not None:
                self.outbound_seconds.observe(seconds)
        elif event == "outbound-done" and fields.get("result") in OUTBOUND_RESULTS:
            self.outbound.labels(fields["result"]).inc()
            age = fields.get("age")
            if isinstance(age, (int, float)) and not isinstance(age, bool):
                self.queue_age.observe(age)
        elif event == "session":
            listener = listener or OTHER
            self.sessions.labels(listener).inc()
            seconds = _seconds(fields.get("ms"))
            if seconds is not None:
                self.session_seconds.labels(listener).observe(seconds)
        elif event == "auth" and fields.get("result") is not None:
            self.auth.labels(listener or OTHER, _bounded(fields["result"], AUTH_RESULTS)).inc()
        elif event == "worker-exit":
            self.worker_exits.inc()
        elif event == "inbound":
            for step in INBOUND_STEPS:
                if fields.get(step) is not None:
                    self.inbound.labels(step, _bounded(fields[step], INBOUND_RESULTS)).inc()
        if event in _ALWAYS_ERRORS:
            default, kind = _ALWAYS_ERRORS[event]
            self.errors.labels(listener or default, kind).inc()
        elif event in _ERROR_RESULTS and fields.get("result") == "error":
            self.errors.labels(listener or _ERROR_RESULTS[event], "internal").inc()
        elif event in _STORE_ERRORS and fields.get("error") is not None and fields.get("result") in _STORE_FAILED:
            self.errors.labels(listener or _STORE_ERRORS[event], "store").inc()


class _UnstructuredErrors(logging.Handler):
    """Counts ERROR records of cassmail (and asyncio's unhandled ones) that are not `kv` events,
    e.g. a log.exception("...") around a bug, as kind=internal; `kv` events are counted by
    Metrics.on_event already. ERROR always passes the log level, so none is missed."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__(logging.ERROR)
        self.metrics = metrics

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("event="):
            return
        parts = record.name.split(".")
        if parts[0] not in ("cassmail", "asyncio"):
            return
        listener = parts[1] if len(parts) > 1 and parts[1] in ("smtp", "pop3", "imap") else NODE
        self.metrics.errors.labels(listener, "internal").inc()


_installed: Metrics | None = None


def listener_label(name: str) -> str:
    """The `listener` label of a listener section: its own name, except the implicit-TLS POP3
    and IMAP listeners, whose sessions are counted with their protocol's (tls=True)."""
    return name if name in LISTENERS else LISTENER_PROTOCOLS.get(name, OTHER)


def install(listeners: Iterable[str], registry: Any = None) -> Metrics:
    """Define the metrics and start counting this process's events (and those of the workers
    it forks afterwards). Call after `logs.setup` and, for a node, after `prepare`."""
    global _installed
    if _installed is not None:
        raise RuntimeError("metrics are installed already in this process")
    metrics = Metrics(registry)
    metrics.touch(dict.fromkeys(listener_label(name) for name in listeners))
    logs.add_observer(metrics.on_event)
    logging.getLogger().addHandler(_UnstructuredErrors(metrics))
    _installed = metrics
    return metrics


def installed() -> Metrics:
    """The metrics `install` defined in this process or the supervisor that forked it."""
    if _installed is None:
        raise RuntimeError("metrics are not installed (is [metrics] enabled?)")
    return _installed


# --------------------------------------------------------------------------- store latency


def error_kind(exc: BaseException) -> str:
    """The exception's class in the store contract or the model (NoSuchUser, StoreUnavailable,
    InvalidInput, ...): a backend's own subclasses count as the contract class they refine,
    so the label stays bounded and names no backend. Anything else is "other"."""
    for cls in type(exc).__mro__:
        if cls.__module__ in ("cassmail.store.base", "cassmail.model") and issubclass(cls, Exception):
            return cls.__name__
    return OTHER


#: Every method of the Store contract (abstract or with a default), each timed as its own `op`.
CONTRACT_OPS = tuple(sorted(
    name for name, value in vars(Store).items() if not name.startswith("_") and inspect.isfunction(value)
))

_NOT_FAILURES = (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt, SystemExit)


class _Timed:
    """Records one store call: its duration in cassmail_store_seconds and, when it raised, the
    exception in cassmail_store_errors. A cancelled call (the client left, the worker stops)
    is neither: its duration says nothing about the store."""

    __slots__ = ("metrics", "op")

    def __init__(self, metrics: Metrics, op: str) -> None:
        self.metrics, self.op = metrics, op

    def done(self, seconds: float, exc: BaseException | None) -> None:
        if isinstance(exc, _NOT_FAILURES):
            return
        self.metrics.store_seconds.labels(self.op).observe(seconds)
        if exc is not None:
            self.metrics.store_errors.labels(self.op, error_kind(exc)).inc()


class _TimedStream:
    """A store stream (read_chunks, list_messages) that adds up the time spent waiting for each
    item, not the time the consumer takes between items (a slow client is not a slow store),
    and records it once, when the stream ends, fails or is closed. A stream dropped without
    being closed is not recorded."""

    def __init__(self, timed: _Timed, stream: Any, spent: float) -> None:
        self._timed = timed
        self._stream = stream if hasattr(stream, "__anext__") else stream.__aiter__()
        self._spent = spent
        self._open = True

    def __aiter__(self) -> _TimedStream:
        return self

    async def __anext__(self) -> Any:
        started = time.perf_counter()
        try:
            item = await self._stream.__anext__()
        except StopAsyncIteration:
            self._finish(started, None)
            raise
        except BaseException as exc:
            self._finish(started, exc)
            raise
        self._spent += time.perf_counter() - started
        return item

    async def aclose(self) -> None:
        started = time.perf_counter()
        try:
            close = getattr(self._stream, "aclose", None)
            if close is not None:
                await close()
        finally:
            self._finish(started, None)

    def _finish(self, started: float, exc: BaseException | None) -> None:
        if self._open:
            self._open = False
            self._timed.done(self._spent + time.perf_counter() - started, exc)


def _forward(op: str) -> Callable[..., Any]:
    def method(self: TimedStore, *args: Any, **kwargs: Any) -> Any:
        return self._call(op, args, kwargs)

    method.__name__ = op
    method.__qualname__ = f"TimedStore.{op}"
    method.__doc__ = f"Store.{op} of the wrapped store, timed as op={op!r}."
    return method


class TimedStore(Store):
    """Any Store, with every call of the contract timed (cassmail_store_seconds{op}) and its
    failures counted (cassmail_store_errors{op,kind}); results and exceptions pass unchanged.

    A coroutine method stays a coroutine, a stream stays a stream (see _TimedStream).
    Attributes outside the contract (a backend's own helpers) are forwarded untimed."""

    def __init__(self, inner: Store, metrics: Metrics) -> None:
        self._inner = inner
        self._metrics = metrics
        self._ops = {op: _Timed(metrics, op) for op in CONTRACT_OPS}

    @property  # type: ignore[override]
    def max_message_size(self) -> int:
        return self._inner.max_message_size

    @max_message_size.setter
    def max_message_size(self, value: int) -> None:
        self._inner.max_message_size = value

    @property  # type: ignore[override]
    def quota_exact(self) -> bool:
        return self._inner.quota_exact

    @property  # type: ignore[override]
    def keeps_view_snapshots(self) -> bool:
        return self._inner.keeps_view_snapshots

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        timed = self._ops[op]
        started = time.perf_counter()
        try:
            result = getattr(self._inner, op)(*args, **kwargs)
        except BaseException as exc:
            timed.done(time.perf_counter() - started, exc)
            raise
        if inspect.isawaitable(result):
            return self._await(timed, started, result)
        if hasattr(result, "__anext__") or hasattr(result, "__aiter__"):
            return _TimedStream(timed, result, time.perf_counter() - started)
        timed.done(time.perf_counter() - started, None)
        return result

    @staticmethod
    async def _await(timed: _Timed, started: float, awaitable: Any) -> Any:
        try:
            result = await awaitable
        except BaseException as exc:
            timed.done(time.perf_counter() - started, exc)
            raise
        timed.done(time.perf_counter() - started, None)
        return result


for _op in CONTRACT_OPS:
    setattr(TimedStore, _op, _forward(_op))
del _op
abc.update_abstractmethods(TimedStore)  # the methods exist now: the class is no longer abstract


async def sample_sessions(metrics: Metrics, counts: Mapping[str, Callable[[], int]],
                          interval: float = SAMPLE_INTERVAL) -> None:
    """Set cassmail_sessions_open of each listener from its session count, every `interval`
    seconds, until cancelled. Sampling keeps the gauge out of the protocols' code."""
    while True:
        for listener, count in counts.items():
            metrics.sessions_open.labels(listener).set(count())
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------- the multiprocess directory


def prepare() -> str:
    """Make this node's private metrics directory and put every process forked from now on in
    multiprocess mode. Directories left by supervisors that no longer run (killed with SIGKILL)
    are removed first."""
    parent = Path(tempfile.gettempdir())
    for old in parent.glob(DIR_PREFIX + "*"):
        pid = old.name[len(DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and old.is_dir() and old.stat().st_uid == os.getuid():
            shutil.rmtree(old, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
    os.environ[ENV] = path
    values = sys.modules.get("prometheus_client.values")
    if values is not None:  # imported before the variable was set: choose the file-backed values now
        values.ValueClass = values.get_value_class()  # type: ignore[attr-defined]
    return path


def cleanup(path: str) -> None:
    """Remove the directory `prepare` made (the supervisor, when it stops)."""
    shutil.rmtree(path, ignore_errors=True)
    if os.environ.get(ENV) == path:
        del os.environ[ENV]


def process_dead(pid: int, path: str) -> None:
    """A worker is gone: its live gauges stop counting; its counters stay in the totals."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)


# --------------------------------------------------------------------------- the endpoint


def bind(host: str, port: int) -> socket.socket:
    """The endpoint's listening socket, bound and listening. No SO_REUSEPORT: a second node
    given the same address must fail to start rather than share its scrapes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def start_exporter(sock: socket.socket, path: str) -> int:
    """Fork the process that serves /metrics from `path` on `sock`; returns its pid."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _serve(sock, path, parent)
    except _Orphaned:
        pass
    except BaseException:  # noqa: BLE001 - the supervisor logs the exit and starts another
        log.exception(logs.kv("metrics-exporter", result="fail"))
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


class _Orphaned(Exception):
    """The supervisor is gone (killed without a chance to stop the exporter): so is the node."""


def _serve(sock: socket.socket, path: str, parent: int) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # a client that stalls is dropped, not kept for ever

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if urlsplit(self.path).path != PATH:
                self.send_error(404, f"only {PATH} is served here")
                return
            try:
                body = generate_latest(registry)
            except Exception:  # noqa: BLE001 - one bad file must not kill the endpoint
                log.exception(logs.kv("metrics", result="error"))
                self.send_error(500, "metrics could not be collected")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # a scrape every few seconds would drown the node's own lines

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def service_actions(self) -> None:
            if os.getppid() != parent:
                raise _Orphaned

    server = Server(sock.getsockname()[:2], Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.serve_forever(poll_interval=1.0)


__all__ = [
    "Metrics", "TimedStore", "CONTRACT_OPS", "install", "installed", "prepare", "cleanup", "process_dead", "bind",
    "start_exporter", "sample_sessions", "error_kind",
]
