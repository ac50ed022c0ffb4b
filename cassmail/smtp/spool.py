"""Large DATA payloads kept in a file instead of the worker's memory.

`read_data` (cassmail.smtp.protocol) keeps a message in a bytearray until it passes the
listener's `spool_above`; from there on what arrives is written to an unlinked temporary file
in `spool_dir`, and at the end-of-data marker the file is mapped (mmap) and dot-stuffing is
undone in place. The message then reaches the store as a memoryview of that mapping: its pages
are the kernel's page cache of a file on disk, which the kernel may write out and drop under
memory pressure, not the worker's heap. Ten concurrent 25 MB messages no longer cost a worker
250 MB of its own memory (docs/hardening.md).

The file starts with `ROOM` bytes left free, so the trace headers go in front of the message
without moving it (`Spooled.put_in_front`). The mapping and its file are released when the last
view of the message goes away (the file has no name: nothing is left behind, even by a crash).
"""

from __future__ import annotations

import mmap
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

from cassmail.dots import line_dots

#: Bytes left free at the start of a spool file for the headers put in front of the message
#: (the trace and what the MX's checks add: smtp.handler.HEADER_RESERVE, 8 KiB, with room to spare).
ROOM = 16 * 1024


@dataclass(frozen=True)
class SpoolPolicy:
    """A listener's spooling: DATA past `above` bytes goes to a file in `directory` ("" = the
    system's temporary directory); `above` = 0 keeps every message in memory."""

    above: int = 0
    directory: str = ""

    def open(self) -> BinaryIO:
        """A new unlinked file, positioned after the free room."""
        file = tempfile.TemporaryFile(dir=self.directory or None, prefix="cassmail-data-")
        file.seek(ROOM)
        return file


class Spooled:
    """A message received into a spool file: `len()` is its size, `view()` its bytes."""

    def __init__(self, mapping: mmap.mmap, start: int, end: int) -> None:
        self._map = mapping
        self.start = start
        self.end = end

    @classmethod
    def finish(cls, file: BinaryIO) -> Spooled:
        """Map a spool file written to its end (the virtual CRLF at ROOM, then the message as
        sent up to its last CRLF) and undo dot-stuffing in place (RFC 5321 4.5.2)."""
        size = file.tell()
        file.flush()
        mapping = mmap.mmap(file.fileno(), size)
        file.close()  # the mapping holds the file open for as long as it lives
        end = _unstuff(mapping, ROOM, size)
        return cls(mapping, ROOM + 2, end)

    def __len__(self) -> int:
        return self.end - self.start

    def view(self) -> memoryview:
        return memoryview(self._map)[self.start : self.end]

    def __bytes__(self) -> bytes:
        """A copy in memory, for what must read the whole message there (the MX's checks)."""
        return bytes(self.view())

    def put_in_front(self, data: bytes) -> memoryview:
        """The message with `data` in front of it, written into the free room (no copy of the
        message); a copy in memory only if `data` does not fit there."""
        if len(data) > self.start:
            return memoryview(data + self.view())
        self._map[self.start - len(data) : self.start] = data
        self.start -= len(data)
        return self.view()


def _unstuff(mapping: mmap.mmap, begin: int, end: int) -> int:
    """Drop the dot after every CRLF in mapping[begin:end], moving what follows down: one pass,
    each byte moved at most once. Returns the new end."""
    write = read = begin
    for dot in line_dots(mapping, b"\r\n", start=begin, end=end):
        if write != read:
            mapping.move(write, read, dot - read)
        write += dot - read
        read = dot + 1
    if write != read:
        mapping.move(write, read, end - read)
    return write + end - read
