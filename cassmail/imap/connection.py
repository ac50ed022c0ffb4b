"""The IMAP connection: bytes in (lines and literals, read only as fast as commands are answered)
and bytes out (with flow control), on an asyncio transport.

A session reads one command, answers it, then reads the next, so whatever a client pipelines
waits here as raw bytes until its turn. Three bounds keep one client from taking a worker:

- a command line longer than `max_line` is skipped up to its end (never buffered whole) and
  answered BAD;
- bytes sent ahead of what the session is reading are held up to `max_pipelined`; past it the
  connection stops reading from the socket, so a client that sends while it does not read
  backs up in TCP instead of in the worker's memory;
- a write the client does not take for `write_timeout` seconds aborts the connection.

Literals (`{n}` synchronising, `{n+}` LITERAL+) are read as part of their command, so a command
is always complete before it runs, and a synchronising literal's continuation request is sent
only when its command's turn has come.
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cassmail import auth

#: A literal announced at the end of a line: `{n}`, `{n+}` (LITERAL+), `~{n}` / `~{n+}` (BINARY).
LITERAL_MARKER = re.compile(rb"(~?)\{(\d{1,20})(\+?)\}\Z")
#: RFC 3501 number: 32 bits.
MAX_LITERAL_NUMBER = 0xFFFFFFFF

#: Output waiting to be written is handed to the transport once it reaches this many bytes, and
#: otherwise when the session next lets the event loop run: the lines of one response (a FETCH of
#: fifty messages' flags, a SELECT) go out in one send instead of one per line.
OUTPUT_BATCH = 64 * 1024


class Closed(ConnectionError):
    """The client went away (end of stream or reset) while the session waited for its bytes."""


class LineTooLong(Exception):
    """A line longer than the limit; it was read to its end and dropped. `start` is its first
    bytes (for the tag of the BAD)."""

    def __init__(self, start: bytes) -> None:
        super().__init__("line too long")
        self.start = start


class LiteralTooLarge(Exception):
    """A literal over its limit. A synchronising one was not sent (the client waits for the
    continuation): the command is answered and the session goes on. A non-synchronising one is
    on its way and cannot be told from commands: the session must end."""

    def __init__(self, start: bytes, synchronising: bool, valid: bool = True) -> None:
        super().__init__("literal too large")
        #: False when the size is no IMAP number at all (above 4294967295): a syntax error.
        self.start, self.synchronising, self.valid = start, synchronising, valid


@dataclass(frozen=True, slots=True)
class Frame:
    """One command as the client sent it: `parts` alternate text and literal data (text,
    literal, text, ..., text), the `{n}` markers taken out of the text; `binary` names the
    literals sent as `~{n}`."""

    parts: tuple[bytes, ...]
    binary: frozenset[int] = frozenset()


#: The largest size of a literal that carries a message, or None for a string literal: from the
#: command's first line, the literal's index in the command and the text just before it.
MessageLimit = Callable[[bytes, int, bytes], "int | None"]


class Connection(asyncio.Protocol):
    """Reader and writer over one transport. The session is a coroutine that reads commands with
    `read_command`/`read_line` and writes with `write` and `drain`."""

    def __init__(self, max_line: int, max_pipelined: int, write_timeout: float) -> None:
        self.max_line, self.max_pipelined, self.write_timeout = max_line, max_pipelined, write_timeout
        self.transport: Any = None
        self._buffer = bytearray()
        #: Bytes the pending read is sure to take (a literal's length): they do not count as sent ahead.
        self._wanted = 0
        self._data = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._reading_paused = False
        self.eof = False
        self.lost = False
        #: A line too long to hold is being dropped up to its end (the skip may span reads).
        self._skipping = False
        #: COMPRESS=DEFLATE: the streams, and compressed bytes received but not inflated yet.
        self._inflate: Any = None
        self._deflate: Any = None
        self._deflated = b""
        #: Written, not yet handed to the transport (see OUTPUT_BATCH), and the pending flush.
        self._out: list[bytes] = []
        self._out_size = 0
        self._flush_soon: asyncio.Handle | None = None
        #: Seconds a command may take to arrive (None: for ever), when the one being read began
        #: (None: none is), and the timer that checks (see `_command_begins`).
        self.command_timeout: float | None = None
        self._reading_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._inflate is not None:
            self._deflated += data
            self._inflate_more()
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Plain bytes from the client (after decompression, with COMPRESS)."""
        if self._skipping:
            end = data.find(b"\n")
            if end < 0:
                return
            data = data[end + 1 :]
            self._skipping = False
        self._buffer += data
        self._data.set()
        if not self._reading_paused and len(self._buffer) > self._wanted + self.max_pipelined + self.max_line:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        self._data.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.eof = True
        self._stop_timer()
        self._data.set()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ------------------------------------------------------------------ reading

    def _consumed(self) -> None:
        if self._deflated:
            self._inflate_more()
        if self._reading_paused and len(self._buffer) <= self._wanted + self.max_pipelined and not self.lost \
                and not self._deflated:
            self._reading_paused = False
            self.transport.resume_reading()

    async def _more(self) -> None:
        if self._deflated:  # compressed bytes held back by the bound: the reader needs them now
            before = len(self._buffer)
            self._inflate_more(at_least=64 * 1024)
            if len(self._buffer) > before or self._skipping:
                return
        if self.eof:
            raise Closed("the client closed the connection")
        self.flush()  # what the client waits for before it sends more
        self._data.clear()
        if self._reading_paused:  # the reader needs bytes the bound is holding back
            self._reading_paused = False
            self.transport.resume_reading()
        await self._data.wait()
        if self._timed_out:
            self._timed_out = False
            raise TimeoutError("no command for the command timeout")

    async def read_line(self) -> bytes:
        """The next line without its CRLF (or LF). Raises LineTooLong (the line is skipped to its
        end, never held whole), Closed."""
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                self._consumed()
                if end > self.max_line + 1:  # it came in whole, yet is no shorter for that
                    raise LineTooLong(line[:64])
                return line[:-1] if line.endswith(b"\r") else line
            if len(self._buffer) > self.max_line:
                head = bytes(self._buffer[:64])
                self._buffer.clear()
                self._skipping = True  # data_received drops bytes up to the line's end
                while self._skipping:
                    await self._more()
                raise LineTooLong(head)
            start = len(self._buffer)
            await self._more()

    async def read_exact(self, size: int) -> bytes:
        """Exactly `size` bytes (a literal). Raises Closed."""
        self._wanted = size
        try:
            while len(self._buffer) < size:
                await self._more()
            data = bytes(self._buffer[:size])
            del self._buffer[:size]
        finally:
            self._wanted = 0
        self._consumed()
        return data

    async def read_command(self, message_limit: MessageLimit, max_string: int, max_strings: int,
                           continuation: Callable[[], None]) -> Frame:
        """One command with its literals. A literal `message_limit` names (an APPEND's message)
        may be as large as it says; any other is a string of at most `max_string` bytes, and
        a command's strings add up to at most `max_strings`. `continuation` is called before a
        synchronising literal is read. Raises LiteralTooLarge, LineTooLong, Closed, and
        TimeoutError when the command took longer than `command_timeout` to arrive."""
        self._command_begins()
        try:
            return await self._read_command(message_limit, max_string, max_strings, continuation)
        finally:
            self._reading_since = None

    def _command_begins(self) -> None:
        """Note when the command began to be read. One timer per connection checks the time, and
        sets itself again for the rest of the command's time when it finds one read for less: a
        client that sends a command as soon as it has the last answer sets no timer per command."""
        if self.command_timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._reading_since = now = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(now + self.command_timeout, self._check_time)

    def _check_time(self) -> None:
        self._timer = None
        since, timeout = self._reading_since, self.command_timeout
        if since is None or timeout is None or self.lost:
            return  # a command is running (the next read sets the timer again), or the client left
        loop = asyncio.get_running_loop()
        if loop.time() < since + timeout:
            self._timer = loop.call_at(since + timeout, self._check_time)
            return
        self._timed_out = True
        self._data.set()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _read_command(self, message_limit: MessageLimit, max_string: int, max_strings: int,
                            continuation: Callable[[], None]) -> Frame:
        first = line = await self.read_line()
        parts: list[bytes] = []
        binary: set[int] = set()
        strings = 0
        while True:
            m = LITERAL_MARKER.search(line)
            if m is None:
                parts.append(line)
                return Frame(tuple(parts), frozenset(binary))
            size, synchronising = int(m.group(2)), not m.group(3)
            if size > MAX_LITERAL_NUMBER:
                raise LiteralTooLarge(first[:64], synchronising, valid=False)
            cap = message_limit(first, len(parts) // 2, line[: m.start()])
            if cap is None:
                strings += size
                too_large = size > max_string or strings > max_strings
            else:
                too_large = size > cap
            if too_large:
                raise LiteralTooLarge(first[:64], synchronising)
            parts.append(line[: m.start()])
            if m.group(1):
                binary.add(len(parts))
            if synchronising:
                continuation()
            parts.append(await self.read_exact(size))
            line = await self.read_line()

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes) -> None:
        """Queue bytes for the client: they reach the transport with `flush`, which runs once the
        session lets the event loop run, at OUTPUT_BATCH bytes, before a wait for the client's
        bytes and at `close`."""
        if self.lost:
            return
        if len(data) >= OUTPUT_BATCH:  # (a message's piece: not copied into a batch)
            self.flush()
            self._send(data)
            return
        self._out.append(data)
        self._out_size += len(data)
        if self._out_size >= OUTPUT_BATCH:
            self.flush()
        elif self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Hand what was written to the transport now (before the transport changes: STARTTLS,
        COMPRESS)."""
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        if not self._out:
            return
        data = self._out[0] if len(self._out) == 1 else b"".join(self._out)
        self._out.clear()
        self._out_size = 0
        if not self.lost:
            self._send(data)

    def _send(self, data: bytes) -> None:
        if self._deflate is not None:
            data = self._deflate.compress(data) + self._deflate.flush(zlib.Z_SYNC_FLUSH)
        self.transport.write(data)

    # ------------------------------------------------------------------ COMPRESS=DEFLATE (RFC 4978)

    def start_compression(self) -> None:
        """From now on both directions are raw DEFLATE. What the client sent after the COMPRESS
        command is already compressed: it is inflated with the rest."""
        self.flush()  # the answer to COMPRESS goes out uncompressed
        self._inflate = zlib.decompressobj(-15)
        self._deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
        self._deflated, self._buffer = bytes(self._buffer), bytearray()
        self._inflate_more()

    def _inflate_more(self, at_least: int = 0) -> None:
        """Inflate held compressed bytes, no more than the pipelining bound leaves room for (a
        small compressed input can stand for a very large one); the rest waits, and the socket
        is not read while it does."""
        assert self._inflate is not None
        room = max(self._wanted + self.max_pipelined + self.max_line - len(self._buffer), at_least, 1)
        try:
            plain = self._inflate.decompress(self._deflated, room)
        except zlib.error:
            self._deflated = b""
            self.eof = True  # the stream is broken: nothing after this can be read
            self._data.set()
            self.abort()
            return
        self._deflated = self._inflate.unconsumed_tail
        if plain:
            self._take(plain)
        if self._deflated and not self._reading_paused and not self.lost:
            self._reading_paused = True
            self.transport.pause_reading()

    async def drain(self) -> None:
        """Return once the transport takes more. Raises Closed when the client is gone, and
        ClientStalled after aborting the connection when it took nothing for write_timeout."""
        if self.lost:
            raise Closed("the client went away")
        if self._writable.is_set():  # (what waits in the batch is bounded by OUTPUT_BATCH)
            return
        try:
            await asyncio.wait_for(self._writable.wait(), self.write_timeout)
        except TimeoutError:
            self.transport.abort()
            raise ClientStalled(f"the client took no data for {self.write_timeout:g} s") from None
        if self.lost:
            raise Closed("the client went away")

    def reading_resumed(self) -> None:
        """The transport was replaced (STARTTLS) and reads: the old one's pause is gone with it."""
        self._reading_paused = False

    def close(self) -> None:
        """Close once what was written is sent."""
        self._stop_timer()
        if self.transport is not None and not self.lost:
            self.flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def drop_buffered(self, peer: str) -> int:
        """Throw away whatever was received and not read yet (STARTTLS: `auth.drop_clear_text`).
        Returns the bytes dropped."""
        dropped = auth.drop_clear_text(self._buffer, "imap", peer)
        self._consumed()
        return dropped


class ClientStalled(Closed):
    """The client took none of what was sent to it for the write timeout; the connection is aborted."""
