"""The bytes of one message in a cassmail mbox file (mboxrd), and how to read them back.

A record, as it sits in the file::

    From MAILER-DAEMON Sat Nov 22 04:50:00 2025\\n          the From_ line (sender, UTC date)
    [X-Cassmail-Pad: ........\\n ......\\n]                  only after compaction, see mbox_index
    X-Cassmail: 1 <id hex> <date us> <raw len> <stored len> <crc>\\n
    Status: RO\\n                                            \\Seen            (fixed width)
    X-Status: ADFT \\n                                       \\Answered \\Deleted \\Flagged \\Draft, E = expunged
    X-Keywords: $Label1 k2            \\n                    keywords, padded to a reserved width
    <the message, mboxrd-quoted>
    [\\n]                                                    if the message does not end with a newline
    \\n                                                      the blank line before the next From_ line

Why these headers. The index is the authority, but it must be rebuildable from the mbox
alone, so the mbox carries every fact the index holds except UIDs (a rebuild starts a
new UIDVALIDITY instead, see mbox_index). `Status`/`X-Status`/`X-Keywords` are where mutt,
Python's `mailbox` and Dovecot look for flags, so other tools see our flags; they have
fixed widths so a flag change is one small overwrite in place, never a move. The
`X-Cassmail` line carries what no standard header holds exactly: the message id, the
internal date to the microsecond, the message's exact length (so a missing final newline
is restored) and its stored length (so a rebuild jumps from record to record instead of
scanning bodies), with a CRC so a rebuild never mistakes garbage for a record.

These lines are ours, not the message's: the store returns only the bytes after them,
unquoted, so every client reads back exactly the bytes that were delivered. Other mbox
tools show them as ordinary headers.

mboxrd quoting: every line of the message that matches `>*From ` gets one more `>` on
write, and every `>+From ` line loses one on read, which is reversible byte for byte
(unlike mboxo, where ">From " and "From " both read back as ">From ").
"""

from __future__ import annotations

import re
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from mmap import mmap

FROM = b"From "
META_TAG = b"X-Cassmail: "
PAD_TAG = b"X-Cassmail-Pad:"
STATUS_TAG = b"Status: "
XSTATUS_TAG = b"X-Status: "
KEYWORDS_TAG = b"X-Keywords: "
FORMAT_VERSION = b"1"
#: Smallest pad header: "X-Cassmail-Pad: ." and a newline.
PAD_MIN = len(PAD_TAG) + 3
#: Bytes of the fixed part of the flag slot (Status and X-Status lines, the X-Keywords tag and newline).
SLOT_FIXED = len(STATUS_TAG) + 3 + len(XSTATUS_TAG) + 6 + len(KEYWORDS_TAG) + 1
#: Longest From_ line we read when parsing (RFC 5321 paths are at most 256 octets).
MAX_FROM_LINE = 1024

_TO_QUOTE = re.compile(rb"(?m)^(>*From )")
_QUOTED = re.compile(rb"(?m)^>(>*From )")
_MAYBE_QUOTED = re.compile(rb">+(?:F(?:r(?:o(?:m)?)?)?)?")
_RETURN_PATH = re.compile(rb"(?im)^Return-Path:[ \t]*<([^<>\s]*)>")
_SAFE_SENDER = re.compile(rb"[^\x21-\x7e]")

#: What `scan` reads: the file mapped in memory (a rebuild never copies the mbox) or bytes.
Buffer = bytes | mmap


# --------------------------------------------------------------------------- quoting


def quote(raw: bytes | memoryview) -> bytes | memoryview:
    """mboxrd-quote a message: one more `>` before every line that reads `>*From `. A message
    with no such line (nearly all) is returned as it is, not copied."""
    if _TO_QUOTE.search(raw) is None:
        return raw
    return _TO_QUOTE.sub(rb">\1", bytes(raw))


def unquote(stored: bytes) -> bytes:
    """Inverse of `quote` for a whole message."""
    return _QUOTED.sub(rb"\1", stored)


class Unquoter:
    """`unquote` over a stream of chunks cut anywhere, holding back at most the few bytes
    at a chunk's end that might still turn out to be the start of a quoted From_ line."""

    def __init__(self) -> None:
        self._pending = b""
        self._at_line_start = True

    def feed(self, data: bytes) -> bytes:
        data = self._pending + data
        self._pending = b""
        out = []
        if not self._at_line_start:
            nl = data.find(b"\n")
            if nl < 0:
                return data
            out.append(data[: nl + 1])
            data = data[nl + 1 :]
            self._at_line_start = True
        if not data:
            return b"".join(out)
        tail_start = data.rfind(b"\n") + 1
        if _MAYBE_QUOTED.fullmatch(data, tail_start):
            self._pending = data[tail_start:]
            data = data[:tail_start]
        else:
            self._at_line_start = data.endswith(b"\n")
        out.append(_QUOTED.sub(rb"\1", data))
        return b"".join(out)

    def finish(self) -> bytes:
        """What is held back at the end of the message (it never became a From_ line)."""
        rest, self._pending = self._pending, b""
        return rest


# --------------------------------------------------------------------------- flags

_XSTATUS_FLAGS = (("A", "\\Answered"), ("D", "\\Deleted"), ("F", "\\Flagged"), ("T", "\\Draft"))


def slot_length(capacity: int) -> int:
    """Bytes of the flag slot for a keyword capacity (-1: a record without a slot)."""
    return 0 if capacity < 0 else SLOT_FIXED + capacity


def keywords_text(flags: frozenset[str]) -> bytes:
    return b" ".join(sorted(f.encode("ascii") for f in flags if not f.startswith("\\")))


def encode_slot(flags: frozenset[str], expunged: bool, capacity: int) -> bytes:
    """The Status / X-Status / X-Keywords lines, exactly `slot_length(capacity)` bytes."""
    status = b"RO" if "\\Seen" in flags else b"  "
    x = "".join(c for c, name in _XSTATUS_FLAGS if name in flags or (expunged and c == "D"))
    x += "E" if expunged else ""
    keywords = keywords_text(flags)
    if len(keywords) > capacity:
        raise ValueError("keywords do not fit the slot")
    return (
        STATUS_TAG + status + b"\n"
        + XSTATUS_TAG + x.encode().ljust(5) + b"\n"
        + KEYWORDS_TAG + keywords.ljust(capacity) + b"\n"
    )


def decode_flags(status: bytes, xstatus: bytes, keywords: bytes) -> tuple[frozenset[str], bool]:
    """Flags and the expunged mark from header values (ours or another tool's)."""
    flags = set()
    if b"R" in status:
        flags.add("\\Seen")
    expunged = b"E" in xstatus
    for c, name in _XSTATUS_FLAGS:
        if c.encode() in xstatus and not (expunged and c == "D"):
            flags.add(name)
    for word in re.split(rb"[\s,]+", keywords.strip()):
        if word and re.fullmatch(rb"[\x21-\x7e]+", word) and not set(word.decode()) & set('(){%*"\\]'):
            flags.add(word.decode("ascii"))
    return frozenset(flags), expunged


def keyword_capacity(flags: frozenset[str], reserve: int) -> int:
    """Room for keywords in a new record: the reserve, or the keywords and half the reserve."""
    return max(reserve, len(keywords_text(flags)) + reserve // 2)


# --------------------------------------------------------------------------- records


def from_line(raw: bytes | memoryview, when_us: int) -> bytes:
    """`From <sender> <asctime UTC>`: the sender from Return-Path when the message has one
    (the store is not told the envelope sender), else MAILER-DAEMON, as mbox writers do."""
    head = bytes(raw[:65536])
    end = head.find(b"\n\n")
    end2 = head.find(b"\r\n\r\n")
    cut = min(e for e in (end, end2, len(head)) if e >= 0)
    match = _RETURN_PATH.search(head, 0, cut)
    sender = _SAFE_SENDER.sub(b"", match.group(1))[:256] if match else b""
    stamp = time.asctime(time.gmtime(when_us // 1_000_000)).encode()
    return FROM + (sender or b"MAILER-DAEMON") + b" " + stamp + b"\n"


def meta_line(message_id: uuid.UUID, when_us: int, raw_len: int, stored_len: int) -> bytes:
    fields = b"%s %s %d %d %d" % (FORMAT_VERSION, message_id.hex.encode(), when_us, raw_len, stored_len)
    return META_TAG + fields + b" %08x\n" % zlib.crc32(fields)


def record_head(
    first_line: bytes, message_id: uuid.UUID, when_us: int, raw_len: int, stored_len: int,
    flags: frozenset[str], capacity: int,
) -> bytes:
    """Everything of a record before the stored message: From_ line, X-Cassmail line, flag slot."""
    return first_line + meta_line(message_id, when_us, raw_len, stored_len) + encode_slot(flags, False, capacity)


def trailer_length(raw: bytes | memoryview) -> int:
    """Newlines after the stored message: the blank line, plus one when the message lacks its own."""
    return 1 if len(raw) == 0 or raw[-1:] == b"\n" else 2


def pad(length: int) -> bytes:
    """A header of exactly `length` bytes that readers skip: `X-Cassmail-Pad:` folded over lines
    of at most 78 characters (no line is blank, so the header section goes on after it)."""
    if length < PAD_MIN:
        raise ValueError(f"a pad needs at least {PAD_MIN} bytes, not {length}")
    out = bytearray(PAD_TAG + b" ")
    remaining = length - len(out) - 1
    column = len(out)
    while remaining > 0:
        if column >= 77 and remaining >= 3:
            out += b"\n "
            remaining -= 2
            column = 1
        out += b"."
        remaining -= 1
        column += 1
    out += b"\n"
    return bytes(out)


@dataclass
class Record:
    """One record found by `scan` (a rebuild), with everything the index keeps about it."""

    offset: int
    length: int
    id: uuid.UUID | None = None  # None: garbage (bytes to reclaim)
    ours: bool = False
    head: int = 0  # From_ line and pad
    from_len: int = 0
    meta: int = 0  # the X-Cassmail line
    capacity: int = -1  # keyword capacity of the flag slot, -1 without one
    stored: int = 0
    raw: int = 0
    date_us: int = 0
    flags: frozenset[str] = field(default_factory=frozenset)
    expunged: bool = False


def parse_meta(line: bytes) -> tuple[uuid.UUID, int, int, int] | None:
    """(id, date us, raw length, stored length) from an X-Cassmail line, or None if it is not one."""
    if not line.startswith(META_TAG) or not line.endswith(b"\n"):
        return None
    parts = line[len(META_TAG) : -1].split(b" ")
    if len(parts) != 6 or parts[0] != FORMAT_VERSION:
        return None
    try:
        if int(parts[5], 16) != zlib.crc32(b" ".join(parts[:5])):
            return None
        return uuid.UUID(hex=parts[1].decode()), int(parts[2]), int(parts[3]), int(parts[4])
    except ValueError:
        return None


def scan(data: Buffer, mtime_us: int) -> Iterator[Record]:
    """Every record of an mbox image (bytes or an mmap), in file order, covering it without gaps:
    cassmail records (validated by their X-Cassmail line and lengths; found by jumping from
    record to record, not by reading bodies), records other mbox tools wrote (adopted with a
    stable id derived from their bytes), and garbage (bytes between records that are neither,
    e.g. a write torn by a crash), which the index keeps as dead space to reclaim."""
    size = len(data)
    pos = 0
    while pos < size:
        starts_record = data[pos : pos + len(FROM)] == FROM
        record = _ours(data, pos, size) if starts_record else None
        if record is not None:
            yield record
            pos += record.length
            continue
        nxt = _next_from(data, pos + 1, size)
        head = _foreign_head(data, pos, nxt) if starts_record else None
        yield _foreign(data, pos, nxt, head, mtime_us) if head is not None else Record(pos, nxt - pos)
        pos = nxt


def _next_from(data: Buffer, start: int, size: int) -> int:
    """Offset of the next From_ line that follows a newline, or the end."""
    found = data.find(b"\n" + FROM, max(start - 1, 0))
    return size if found < 0 else found + 1


def _line(data: Buffer, pos: int, limit: int) -> bytes | None:
    nl = data.find(b"\n", pos, min(pos + limit, len(data)))
    return None if nl < 0 else data[pos : nl + 1]


def _skip_pad(data: Buffer, cursor: int) -> int | None:
    """Where the headers after a pad begin (`cursor` itself when there is no pad); None if cut short."""
    if data[cursor : cursor + len(PAD_TAG)] != PAD_TAG:
        return cursor
    while True:
        line = _line(data, cursor, 1 << 20)
        if line is None:
            return None
        cursor += len(line)
        if data[cursor : cursor + 1] != b" ":
            return cursor


def _foreign_head(data: Buffer, pos: int, end: int) -> int | None:
    """Bytes of the From_ line (and pad) of a record another tool wrote, or None when the record
    is one of ours cut short by a crash (its From_ line is followed by the start of an
    X-Cassmail line, or by nothing): such bytes are garbage, never a message."""
    first = _line(data, pos, MAX_FROM_LINE)
    if first is None or pos + len(first) > end:
        return None
    cursor = _skip_pad(data, pos + len(first))
    if cursor is None or cursor > end:
        return None
    if META_TAG.startswith(data[cursor : min(cursor + len(META_TAG), end)]):
        return None
    return cursor - pos


def _ours(data: Buffer, pos: int, size: int) -> Record | None:
    first = _line(data, pos, MAX_FROM_LINE)
    if first is None:
        return None
    cursor = _skip_pad(data, pos + len(first))
    if cursor is None:
        return None
    meta = _line(data, cursor, 256)
    parsed = parse_meta(meta) if meta else None
    if parsed is None or meta is None:
        return None
    message_id, date_us, raw_len, stored_len = parsed
    values = []
    at = cursor + len(meta)
    for tag in (STATUS_TAG, XSTATUS_TAG, KEYWORDS_TAG):
        line = _line(data, at, 1 << 16)
        if line is None or not line.startswith(tag):
            return None
        values.append(line[len(tag) : -1])
        at += len(line)
    if len(values[0]) != 2 or len(values[1]) != 5:
        return None
    end_of_content = at + stored_len
    trail = 1 if raw_len == 0 or data[end_of_content - 1 : end_of_content] == b"\n" else 2
    end = end_of_content + trail
    if end > size or data[end_of_content:end] != b"\n" * trail:
        return None
    if end < size and data[end : end + len(FROM)] != FROM:
        return None
    flags, expunged = decode_flags(values[0], values[1], values[2])
    return Record(
        offset=pos,
        length=end - pos,
        id=message_id,
        ours=True,
        head=cursor - pos,
        from_len=len(first),
        meta=len(meta),
        capacity=len(values[2]),
        stored=stored_len,
        raw=raw_len,
        date_us=date_us,
        flags=flags,
        expunged=expunged,
    )


def _foreign(data: Buffer, pos: int, end: int, head: int, mtime_us: int) -> Record:
    """A record another mbox tool wrote: its content runs from after its From_ line (and a pad,
    if a compaction gave it one) to the blank line before the next From_ line. Its
    Status/X-Status/X-Keywords give its flags."""
    first = _line(data, pos, MAX_FROM_LINE) or b""
    content_start = pos + head
    content_end = end - 1 if end - content_start >= 2 and data[end - 2 : end] == b"\n\n" else end
    stored = data[content_start:content_end]
    blank = stored.find(b"\n\n")
    headers = stored[: blank if blank >= 0 else len(stored)]
    flags, _ = decode_flags(_header(headers, b"Status"), _header(headers, b"X-Status").replace(b"E", b""),
                            _header(headers, b"X-Keywords"))
    date_us = _from_line_date(first) or mtime_us
    sample = data[pos : min(end, pos + 65536)]
    return Record(
        offset=pos,
        length=end - pos,
        id=foreign_id(date_us, zlib.crc32(sample) << 32 | zlib.adler32(sample), end - pos),
        head=head,
        from_len=len(first),
        stored=content_end - content_start,
        raw=len(unquote(stored)),
        date_us=date_us,
        flags=flags,
    )


def _header(headers: bytes, name: bytes) -> bytes:
    match = re.search(rb"(?im)^" + re.escape(name) + rb":[ \t]*([^\r\n]*)", headers)
    return match.group(1) if match else b""


def _from_line_date(line: bytes) -> int | None:
    words = line.decode("latin-1").split()
    for n in (5, 6):
        try:
            when = time.strptime(" ".join(words[-n:][:5]), "%a %b %d %H:%M:%S %Y")
        except ValueError:
            continue
        return int(datetime(*when[:6], tzinfo=timezone.utc).timestamp()) * 1_000_000
    return None


_EPOCH_OFFSET_100NS = 0x01B21DD213814000


def foreign_id(date_us: int, digest: int, length: int) -> uuid.UUID:
    """A version-1 id for a message another tool appended: its date, and bits of its content in
    place of clock sequence and node, so rebuilding the index twice gives the same id."""
    t = date_us * 10 + _EPOCH_OFFSET_100NS
    low = (digest ^ (length << 20)) & ((1 << 62) - 1)
    clock_seq = (low >> 48) & 0x3FFF
    node = (low & 0xFFFFFFFFFFFF) | 0x010000000000
    return uuid.UUID(
        fields=(
            t & 0xFFFFFFFF,
            (t >> 32) & 0xFFFF,
            ((t >> 48) & 0x0FFF) | 0x1000,
            ((clock_seq >> 8) & 0x3F) | 0x80,
            clock_seq & 0xFF,
            node,
        )
    )
