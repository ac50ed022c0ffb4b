"""The Cassandra driver's connection as the store uses it: each request written whole, by the
thread that makes it, and a request's timer armed without waking the driver's I/O thread.

The driver's libev connection (cassandra-driver 3.x, `cassandra.io.libevreactor`) queues every
request for its I/O thread and wakes that thread twice per request: once so that it writes the
request, once so that it looks at the request's timeout timer. On a small VM each wake-up costs
a context switch and a hand-over of the GIL, and they were a good part of what a request cost
the event loop's thread. Here:

- `push` writes the request from the calling thread when nothing is queued before it (a
  non-blocking send of a few hundred bytes); only what the socket does not take is queued, and
  the I/O thread woken for it. The I/O thread's own writes (`handle_write`) take the same lock
  around their send, so two writers never interleave the bytes of two requests.
- `create_timer` wakes the I/O thread only when the new timer ends before every timer it
  already knows of (all requests have the same timeout, so under load it never does); the
  thread looks at new timers each time it wakes, and it wakes for every response.
- Requests are written in one send() where the driver cuts them into 4 KiB pieces
  (`out_buffer_size`): with the pieces, Nagle's algorithm held the second piece of a request
  until the first was acknowledged, and Cassandra, holding half a request it cannot answer,
  delays that ACK by 40 ms (a submission's DATA took 47 ms on an idle server).

The attributes used are private to the driver (pinned in pyproject.toml);
tests/test_cassandra_store.py::test_the_drivers_connections_write_each_request_whole fails if
they change. Over TLS, and with a reactor other than libev, the driver's own code runs.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

from cassandra.cluster import DefaultConnection
from cassandra.connection import NONBLOCKING, Timer

try:
    from cassandra.io import libevreactor
except ImportError:  # pragma: no cover - the driver was built without libev
    libevreactor = None  # type: ignore[assignment]

#: Whether the lean paths below apply: the driver's default connection is its libev one.
LEAN = libevreactor is not None and DefaultConnection is getattr(libevreactor, "LibevConnection", None)


class StoreConnection(DefaultConnection):  # type: ignore[misc,valid-type]
    """See the module's docstring."""

    out_buffer_size = 1 << 20

    @classmethod
    def create_timer(cls, timeout: float, callback: Any) -> Any:
        if not LEAN:
            return super().create_timer(timeout, callback)
        loop = libevreactor._global_loop
        timer = Timer(timeout, callback)
        earliest = loop._timers.next_timeout
        loop._timers.add_timer(timer)
        if earliest is None or timer.end < earliest:
            loop._notifier.send()  # it would sleep past this one's end
        return timer

    def _lean(self) -> bool:
        return LEAN and not isinstance(self._socket, ssl.SSLSocket)

    def push(self, data: bytes) -> None:
        if not self._lean():
            super().push(data)
            return
        with self._deque_lock:
            if not self.deque and self._socket_writable:
                try:
                    sent = self._socket.send(data)
                except OSError as err:
                    if err.args[0] not in NONBLOCKING:
                        self.deque.append(data)  # the I/O thread's send meets the error and reports it
                        libevreactor._global_loop.notify()
                        return
                    sent = 0
                if sent >= len(data):
                    return
                data = data[sent:]
            self.deque.append(data)
        libevreactor._global_loop.notify()

    def handle_write(self, watcher: Any, revents: int, errno: int | None = None) -> None:
        if not self._lean() or revents & libevreactor.libev.EV_ERROR:
            super().handle_write(watcher, revents, errno)
            return
        while True:
            with self._deque_lock:
                if not self.deque:
                    self._socket_writable = True
                    return
                next_msg = self.deque.popleft()
                try:
                    sent = self._socket.send(next_msg)
                except socket.error as err:
                    self.deque.appendleft(next_msg)
                    if err.args[0] in NONBLOCKING:
                        self._socket_writable = False
                        return
                    failure: Exception | None = err
                else:
                    failure = None
                    if sent < len(next_msg):
                        self.deque.appendleft(next_msg[sent:])
                        if sent == 0:
                            self._socket_writable = False
                            return
            if failure is not None:
                self.defunct(failure)
                return
