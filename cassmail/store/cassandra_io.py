"""How the store's requests travel to Cassandra: the driver's connections, and who does their I/O.

The driver (cassandra-driver 3.x) does the socket I/O of its connections on a thread of its own
(libev's) and calls back there. Every request of the store then crosses threads twice: the
event loop hands it to the driver's thread (a wake-up of that thread), and the answer comes
back to the loop (a wake-up of the loop, `threads.Inbox`), each with its own fight for the GIL.
Measured alone, that was about 40% of the CPU a request cost the process (below).

`LoopConnection` is a connection of the driver whose socket the event loop of a worker's store
(`make_store(settings, serving=True)`: a loop that runs as long as the store is open) reads and
writes itself: a request is written by the task that makes it (one send()), answers
are read when the loop finds the socket readable, and the driver's callbacks run on the loop,
where the awaiting future is settled at once (`cassandra_cql._wrap`). Measured alone, one
process reading a 200-byte row 8 at a time: 280-310 us of CPU a request with libev's thread,
160-190 with the loop (30-40% less; at 32 at a time 200-215 and 110-120). The driver's own
threads (its executor, its reconnections and heartbeats, a blocking `prepare` run in a thread)
still use these connections: what they send is handed to the loop, and they wait for the
answer as before, which is why the loop must keep running: a store opened on a loop that runs
only now and then (a command, a benchmark's set-up, a test) uses `ThreadConnection`, the driver's
libev connection, as do callers with no loop (`cassmail schema apply`, dropping a keyspace).

The loop also cuts the answers into frames itself (protocol v4, `LoopConnection._readable`):
the driver's buffer copied a 256 KiB chunk three to ten times on its way to the row decoder.

What this uses of the driver: the `Connection` base class, as its libev and asyncio connections
do (its `_connect_socket`, `_send_options_message`, `_iobuf`, `process_io_buffer`, `defunct`,
`error_all_requests` and `close`; the `push` its `send_msg` calls; the `create_timer` its requests
set their timeouts with), and for the frames its `process_msg`, `_Frame`, `frame_header_v3`,
`PROTOCOL_VERSION_MASK` and `_is_checksumming_enabled` (v5's checksummed segments are left to
`process_io_buffer`). A test fails loudly if they change (tests/test_cassandra_store.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from cassandra.cluster import DefaultConnection
from cassandra.connection import (
    PROTOCOL_VERSION_MASK, Connection, ConnectionShutdown, ProtocolError, _Frame, frame_header_v3,
)

#: What the driver's connections read a recv(), where the driver reads 4 KiB: 64 calls and
#: appends for a chunk of a body. One process reading 200-450 KB bodies, 8 at a time: 1.45-1.82 ms
#: of CPU per body at 4 KiB, 1.34-1.59 at 64 KiB. Not more: Python allocates the whole size for
#: every recv(), and past glibc's mmap threshold (128 KiB) that is an mmap, an mremap and a
#: munmap for each small answer (13 us a recv() instead of 1.4).
IN_BUFFER_SIZE = 64 * 1024
#: A request is written with one send(), where the driver cuts it into 4 KiB pieces
#: (`out_buffer_size`). With the pieces, Nagle's algorithm held the second piece of a request
#: until the first was acknowledged, and Cassandra, holding half a request it cannot answer,
#: delays that ACK by 40 ms: a submission's DATA took 47 ms on an idle server. TCP_NODELAY would
#: end the wait too, but costs both sides CPU under load (every small request its own packet).
OUT_BUFFER_SIZE = 1 << 20

_AGAIN = (BlockingIOError, InterruptedError)
#: A frame's header (protocol v3 and later) after its version byte, and the whole header's size.
_HEADER = frame_header_v3
_HEADER_SIZE = 1 + frame_header_v3.size


class ThreadConnection(DefaultConnection):  # type: ignore[misc,valid-type]
    """The driver's own connection (libev's thread does its I/O), with the read and write sizes
    above (the driver's class attributes): for blocking callers with no event loop."""

    out_buffer_size = OUT_BUFFER_SIZE
    in_buffer_size = IN_BUFFER_SIZE


def loop_connection(loop: asyncio.AbstractEventLoop) -> type[LoopConnection]:
    """The connection class of a store opened on `loop` (called on that loop's thread)."""
    return type("LoopConnection", (LoopConnection,), {"loop": loop, "loop_thread": threading.get_ident()})


#: The driver's blocking calls on a Session: they wait for an answer that only the loop reads.
BLOCKING = ("execute", "prepare", "set_keyspace")


def refuse_blocking(session: Any, loop_thread: int) -> None:
    """Make the driver's blocking calls on `session` fail at once when made on the loop's thread,
    where they would wait for ever (the loop that would read the answer is the one waiting);
    from other threads (`asyncio.to_thread`) they work as before."""
    for name in BLOCKING:
        blocking = getattr(session, name)

        def guarded(*args: Any, _blocking: Callable[..., Any] = blocking, _name: str = name, **kwargs: Any) -> Any:
            if threading.get_ident() == loop_thread:
                raise RuntimeError(f"Session.{_name} blocks, and on the event loop that serves the store's "
                                   "connections it would wait for ever: run it in a thread")
            return _blocking(*args, **kwargs)

        setattr(session, name, guarded)


class _Timer:
    """A timeout of the driver's (a request's), run on the loop; started and cancelled from any
    thread."""

    __slots__ = ("_cancelled", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_loop: bool, timeout: float, callback: Callable[[], Any]) -> None:
        self._loop, self._cancelled = loop, False
        self._handle: asyncio.TimerHandle | None = None
        if on_loop:
            self._handle = loop.call_later(timeout, callback)
        else:
            def start() -> None:
                if not self._cancelled:
                    self._handle = loop.call_later(timeout, callback)
            try:
                loop.call_soon_threadsafe(start)
            except RuntimeError:  # the loop is closed: nothing it would time out is awaited
                pass

    def cancel(self) -> None:
        self._cancelled = True
        handle = self._handle
        if handle is not None:
            handle.cancel()  # (marks it, and counts it for the loop's clean-up of its timers:
            # from another thread a lost count only delays that clean-up)

    def __lt__(self, other: _Timer) -> bool:  # (the driver may sort timers)
        return id(self) < id(other)


class LoopConnection(Connection):  # type: ignore[misc]
    """A connection whose socket one event loop reads and writes (see the module's docstring).
    Made for a loop by `loop_connection`."""

    loop: asyncio.AbstractEventLoop
    loop_thread: int
    out_buffer_size = OUT_BUFFER_SIZE
    in_buffer_size = IN_BUFFER_SIZE

    @classmethod
    def initialize_reactor(cls) -> None:
        """No reactor: the loop is the store's."""

    @classmethod
    def handle_fork(cls) -> None:
        """Nothing shared to clean: each process opens its own store on its own loop."""

    @classmethod
    def create_timer(cls, timeout: float, callback: Callable[[], Any]) -> _Timer:
        return _Timer(cls.loop, threading.get_ident() == cls.loop_thread, timeout, callback)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Connection.__init__(self, *args, **kwargs)
        #: What is waiting to be written, in order; the lock: other threads add to it too.
        self._out: deque[bytes | memoryview] = deque()
        self._out_lock = threading.Lock()
        self._flush_due = False  # a flush is scheduled on the loop
        self._writing = False  # the loop watches the socket for room to write
        self._connect_socket()  # (blocking: the driver makes connections on its own threads)
        self._socket.setblocking(False)
        self._fd = self._socket.fileno()
        self._start_framing()
        self._on_loop(self.loop.add_reader, self._fd, self._readable)
        self._send_options_message()

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if threading.get_ident() == self.loop_thread:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ writing

    def push(self, data: bytes) -> None:
        """Write one request whole (the driver's `send_msg`): at once on the loop's thread when
        nothing is waiting before it, else after what is."""
        if threading.get_ident() == self.loop_thread:
            with self._out_lock:
                if self._out:
                    self._out.append(data)
                    return
            self._write(data)
            return
        with self._out_lock:
            self._out.append(data)
            if self._flush_due:
                return
            self._flush_due = True
        self.loop.call_soon_threadsafe(self._flush)

    def _write(self, data: bytes | memoryview) -> bool:
        """Send `data`; what the socket did not take waits first in line. False when it did not
        all go."""
        try:
            sent = self._socket.send(data)
        except _AGAIN:
            sent = 0
        except OSError as exc:
            self.loop.call_soon(self.defunct, exc)  # (not inside the driver's send_msg)
            return False
        if sent == len(data):
            return True
        with self._out_lock:
            self._out.appendleft(memoryview(data)[sent:])
        if sent == 0:  # full: the driver refuses requests (ConnectionBusy) until it drains, as
            self._socket_writable = False  # its own connections do
        if not self._writing and not self.is_closed:
            self._writing = True
            self.loop.add_writer(self._fd, self._flush)
        return False

    def _flush(self) -> None:
        """Write what waits, on the loop, until the socket takes no more."""
        with self._out_lock:
            self._flush_due = False
        while True:
            with self._out_lock:
                if not self._out:
                    break
                data = self._out.popleft()
            if not self._write(data):
                return
        self._socket_writable = True
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)

    # ------------------------------------------------------------------ reading

    def _readable(self) -> None:
        """Read what the socket has and answer every whole frame in it. A frame's body is cut
        from what recv() gave (one copy); the rest of a large one is read with one recv() of
        just its size and joined once. (The driver's `process_io_buffer` copies each read into
        its buffer, reads the body out of that, and copies what follows it, other frames
        included, into a new buffer per frame: for a 256 KiB chunk, three to ten copies.)"""
        size = self.in_buffer_size
        try:
            while not (self.is_closed or self.is_defunct):
                if self._is_checksumming_enabled:
                    self._read_for_driver()
                    return
                if self._body_missing:
                    data = self._socket.recv(self._body_missing)
                    if not data:
                        break
                    self._body_parts.append(data)
                    self._body_missing -= len(data)
                    if self._body_missing:
                        return  # (the loop calls again when more is there)
                    self._frame_done()
                    continue
                data = self._socket.recv(size)
                if not data:
                    break
                self._frames(data)
                if len(data) < size:
                    return
            else:
                return
        except _AGAIN:
            return
        except OSError as exc:
            self.defunct(exc)
            return
        self.close()  # (Cassandra closed it: recv() gave b"")

    def _start_framing(self) -> None:
        """Nothing read yet. Frames are read here (see `_readable`): the head of a frame not yet
        whole, and the large frame being read (its header, its body's parts so far, how much is
        missing). The one place these are set up, for the connection and for whatever reads
        frames as it does (loadtest/bench_frames.py, the tests)."""
        self._head = b""
        self._frame: _Frame | None = None
        self._body_parts: list[bytes] = []
        self._body_missing = 0

    def _frames(self, data: bytes) -> None:
        """Answer every whole frame in what was read (after what was left of the last read), and
        start the large one that is not whole yet. What follows READY on v5 is the driver's to
        frame (its checksummed segments); a header that is not a v3+ frame's ends the connection."""
        buf = self._head + data if self._head else data
        size, pos = len(buf), 0
        self._head = b""
        while size - pos >= _HEADER_SIZE:
            version = buf[pos] & PROTOCOL_VERSION_MASK
            flags, stream, opcode, length = _HEADER.unpack_from(buf, pos + 1)
            if version < 3 or length < 0:
                self.defunct(ProtocolError(f"not a CQL frame of v3 or later: version {version}, length {length}"))
                return
            body = pos + _HEADER_SIZE
            frame = _Frame(version, flags, stream, opcode, _HEADER_SIZE, _HEADER_SIZE + length)
            if body + length > size:
                self._frame, self._body_parts = frame, [buf[body:]]
                self._body_missing = body + length - size
                return
            pos = body + length
            self.process_msg(frame, buf[body:pos])
            if self.is_defunct:
                return
            if self._is_checksumming_enabled:  # (v5: READY was answered, segments follow)
                if pos < size:
                    self._iobuf.write(buf[pos:])
                    self.process_io_buffer()
                return
        self._head = buf[pos:]

    def _frame_done(self) -> None:
        frame, parts = self._frame, self._body_parts
        self._start_framing()  # (the head is empty: a large frame's rest is read to its size)
        assert frame is not None
        self.process_msg(frame, parts[0] if len(parts) == 1 else b"".join(parts))

    def _read_for_driver(self) -> None:
        """The driver's own reading: its buffer and `process_io_buffer` (v5's checksummed
        segments)."""
        size = self.in_buffer_size
        data: bytes | None = None
        try:
            while True:
                data = self._socket.recv(size)
                if not data:
                    break
                self._iobuf.write(data)
                if len(data) < size:
                    break
        except _AGAIN:
            pass
        except OSError as exc:
            self.defunct(exc)
            return
        if self._iobuf.tell():
            self.process_io_buffer()
        if data == b"":
            self.close()  # (Cassandra closed it)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        with self.lock:
            if self.is_closed:
                return
            self.is_closed = True
        try:
            self._on_loop(self._forget_socket)
        except RuntimeError:  # the loop is closed: nothing watches the socket any more
            self._socket.close()
        if not self.is_defunct:
            self.error_all_requests(ConnectionShutdown(f"Connection to {self.endpoint} was closed"))
            self.connected_event.set()  # (nobody waits for a connection that will not come)

    def _forget_socket(self) -> None:
        try:
            self.loop.remove_reader(self._fd)
            if self._writing:
                self.loop.remove_writer(self._fd)
        except (ValueError, OSError):  # (the loop closed meanwhile)
            pass
        self._socket.close()

