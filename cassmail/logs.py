"""Structured logs: one line per event, `key=value` pairs (logfmt), so they are read by people and by tools.

Every line says who (peer, user), what (event, result) and how long (ms).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping


def _quote(value: object) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\\') or not text.isprintable():
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').encode("unicode_escape").decode("ascii") + '"'
    return text


#: Called with (event, fields) for every event `kv` formats (cassmail.metrics counts from them).
Observer = Callable[[str, Mapping[str, object]], None]
_observers: list[Observer] = []


def add_observer(observer: Observer) -> None:
    """Have `observer` see every event from now on, in this process and the workers it forks.

    Events are seen where `kv` formats them, before the logger's level is checked: a node
    logging at WARNING still counts its deliveries. An observer must be cheap and must not log."""
    _observers.append(observer)


def remove_observer(observer: Observer) -> None:
    """Undo `add_observer` (a no-op when it was not added)."""
    if observer in _observers:
        _observers.remove(observer)


def kv(event: str, **fields: object) -> str:
    """`event=NAME k=v ...`, values quoted when they contain spaces, quotes or control characters.

    Each call is one event: the observers (see `add_observer`) see it too."""
    for observer in _observers:
        try:
            observer(event, fields)
        except Exception:  # noqa: BLE001 - counting an event must never fail the work it describes
            pass
    parts = [f"event={event}"]
    parts += [f"{key}={_quote(value)}" for key, value in fields.items() if value is not None]
    return " ".join(parts)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"ts={stamp} level={record.levelname.lower()} pid={os.getpid()} logger={record.name} {record.getMessage()}"
        if record.exc_info:
            line += " exc=" + _quote(self.formatException(record.exc_info).replace("\n", " | "))
        return line


def setup(level: str = "INFO") -> None:
    """Log to standard error in the structured format (called once by `cassmail serve`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiosmtpd logs every command at INFO: our own session and delivery lines say what matters.
    logging.getLogger("mail.log").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("cassandra").setLevel(max(logging.WARNING, root.level))
    # aiosmtpd warns (per session) about choices the settings made on purpose, e.g. plaintext AUTH.
    warnings.filterwarnings("ignore", module="aiosmtpd")


class Timer:
    """Milliseconds since creation, for the `ms=` field."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def ms(self) -> int:
        return int((time.perf_counter() - self.start) * 1000)
