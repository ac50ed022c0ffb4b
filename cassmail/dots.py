"""Dots that start a line: doubled on the wire by SMTP (RFC 5321 4.5.2) and POP3 (RFC 1939 3),
single in the store, and the end-of-data marker `CRLF . CRLF`.

Looking for them as `b"\\n."` with `bytes.find`, `count` or `replace` is slow on mail: the search
stops at every line end, and text has one every few dozen bytes (bytes.replace took 2-3.5 ms a
megabyte here, more than a POP3 worker's every other step of a RETR). Here the dots are found
first, with numpy, and only then is the byte before them looked at: dots that start a line are
rare (no base64 line has one), so a megabyte costs about 0.4 ms. Data under VECTOR_MIN bytes
takes the plain bytes operations, whose set-up costs less there.

Every function takes bytes, a bytearray or a mmap (a buffer with `find`). The numpy views made
here are gone when a function returns, so a bytearray may grow again afterwards.
"""

from __future__ import annotations

from typing import Any

#: From this many bytes on, dots are looked for with numpy.
VECTOR_MIN = 16 * 1024
#: SMTP's end of DATA.
END_OF_DATA = b"\r\n.\r\n"

Buffer = Any  # bytes, bytearray, mmap


def line_dots(data: Buffer, before: bytes = b"\n", after: bytes = b"", start: int = 0, end: int | None = None) -> list[int]:
    """Offsets p in [start, end) of the dots with `before` right in front of them (it may lie
    before `start`) and `after` right behind them, in ascending order."""
    size = len(data)
    end = size if end is None else min(end, size)
    lo, hi = max(start, len(before)), end - len(after)
    if hi <= lo:
        return []
    if hi - lo < VECTOR_MIN:
        return _found(data, before + b"." + after, len(before), lo - len(before), hi + len(after))
    import numpy  # only once large mail comes by

    octets = numpy.frombuffer(data, dtype=numpy.uint8)
    at = numpy.flatnonzero(octets[lo:hi] == 46) + lo
    for k, byte in enumerate(reversed(before), 1):
        at = at[octets[at - k] == byte]
    for k, byte in enumerate(after, 1):
        at = at[octets[at + k] == byte]
    return at.tolist()


def _found(data: Buffer, pattern: bytes, dot: int, start: int, end: int) -> list[int]:
    out = []
    at = data.find(pattern, start, end)
    while at >= 0:
        out.append(at + dot)
        at = data.find(pattern, at + 1, end)
    return out


def find_end_of_data(data: Buffer, start: int = 0) -> int:
    """Where the first CRLF . CRLF at or after `start` begins; -1 if none."""
    if len(data) - start < VECTOR_MIN:
        return data.find(END_OF_DATA, start)
    dots = line_dots(data, b"\r\n", b"\r\n", start + 2)
    return dots[0] - 2 if dots else -1


def stuff(data: bytes, at_line_start: bool) -> bytes:
    """`data` with every dot that starts a line doubled; its first byte starts a line when
    `at_line_start` (the data before it ended with LF, or there was none)."""
    cuts = line_dots(data)
    if at_line_start and data[:1] == b".":
        cuts.insert(0, 0)
    if not cuts:
        return data
    view = memoryview(data)
    return b".".join([view[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])])


def unstuff(data: bytearray) -> bytearray:
    """`data` without the dot that follows each CRLF: itself when there is none, else a copy."""
    cuts = line_dots(data, b"\r\n")
    if not cuts:
        return data
    with memoryview(data) as view:
        return bytearray().join([view[a:b] for a, b in zip([0, *(c + 1 for c in cuts)], [*cuts, len(data)])])
