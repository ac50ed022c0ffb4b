"""IMAP's data formats (RFC 3501 section 4 and 9): strings, lists, sequence sets, dates, names.

Pure functions, no I/O: what the session writes and parses, kept apart so it is tested alone.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from cassmail.model import InvalidInput

#: A sequence set is refused when it has more ranges than this (a client sending 100,000
#: single numbers is answered BAD instead of being walked).
MAX_SET_RANGES = 10_000
#: Numbers in sequence sets are 32-bit (RFC 3501 nz-number).
MAX_NUMBER = 0xFFFFFFFF

_SAFE_QUOTED = re.compile(rb'[\x20-\x7e]*\Z')
_SAFE_QUOTED_UTF8 = re.compile(rb'[\x20-\x7e\x80-\xff]*\Z')
_ATOM_SPECIALS = re.compile(rb'[(){ %*"\\\]\x00-\x1f\x7f-\xff]')


class ParseError(InvalidInput):
    """Syntax the client got wrong: answered BAD with "Syntax error: " and this text, so the text
    is always a fixed description of the rule that was broken (never the client's input, a
    Python repr or another exception's message)."""


class Nil:
    """NIL in a response."""


NIL = Nil()


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


def string(value: str | bytes | None, utf8: bool = False) -> bytes:
    """An nstring: NIL, a quoted string when that can carry it (UTF-8 too, for a client that
    enabled UTF8=ACCEPT), else a literal."""
    if value is None:
        return b"NIL"
    data = _bytes(value)
    if len(data) < 1024 and (_SAFE_QUOTED if not utf8 else _SAFE_QUOTED_UTF8).match(data):
        return b'"' + data.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'
    return b"{%d}\r\n" % len(data) + data


def literal(value: bytes) -> bytes:
    """Message data: always a literal, whatever its bytes (what clients expect for BODY[...])."""
    return b"{%d}\r\n" % len(value) + value


def astring(value: str | bytes, utf8: bool = False) -> bytes:
    """An atom when the value is one, else a string (mailbox names in LIST, STATUS)."""
    data = _bytes(value)
    if data and not _ATOM_SPECIALS.search(data) and data.upper() != b"NIL":
        return data
    return string(data, utf8)


def encode(value: Any) -> bytes:
    """A response value: lists become parenthesised lists, None is NIL, ints are numbers."""
    if value is None or value is NIL:
        return b"NIL"
    if isinstance(value, bool):
        raise TypeError("no booleans in IMAP")
    if isinstance(value, int):
        return b"%d" % value
    if isinstance(value, Atom):
        return value.data
    if isinstance(value, Run):
        inner = b"".join(encode(v) for v in value.items)
        return b"(" + inner + b")" if value.parens else inner
    if isinstance(value, (list, tuple)):
        return b"(" + b" ".join(encode(v) for v in value) + b")"
    return string(value)


class Run:
    """A parenthesised run of values with nothing between them: RFC 3501's `1*address` and a
    multipart's `1*body`."""

    __slots__ = ("items", "parens")

    def __init__(self, items: list[Any], parens: bool = True) -> None:
        self.items, self.parens = items, parens

    def __eq__(self, other: object) -> bool:
        return self.items == (other.items if isinstance(other, Run) else other)

    def __repr__(self) -> str:
        return f"Run({self.items!r})"


class Atom:
    """A value written as it is (flags, keywords like BODYSTRUCTURE)."""

    __slots__ = ("data",)

    def __init__(self, data: str | bytes) -> None:
        self.data = _bytes(data)

    def __repr__(self) -> str:
        return f"Atom({self.data!r})"


def flag_list(flags: Iterable[str]) -> bytes:
    return b"(" + b" ".join(f.encode("ascii") for f in sorted(flags)) + b")"


# --------------------------------------------------------------------------- sequence sets


def parse_set(text: bytes) -> list[tuple[int | None, int | None]]:
    """`1,3:5,7:*` as ranges; None stands for `*`. Raises ParseError."""
    ranges: list[tuple[int | None, int | None]] = []
    if not text:
        raise ParseError("empty sequence set")
    parts = text.split(b",")
    if len(parts) > MAX_SET_RANGES:
        raise ParseError(f"sequence set with more than {MAX_SET_RANGES} ranges")
    for part in parts:
        ends = part.split(b":")
        if len(ends) > 2:
            raise ParseError("bad sequence range")
        nums = [_set_number(e) for e in ends]
        ranges.append((nums[0], nums[-1]))
    return ranges


def _set_number(text: bytes) -> int | None:
    if text == b"*":
        return None
    if not text.isdigit() or text.startswith(b"0"):
        raise ParseError("bad message number")
    value = int(text)
    if value > MAX_NUMBER:
        raise ParseError("message number out of range")
    return value


def resolve_set(ranges: list[tuple[int | None, int | None]], largest: int) -> list[tuple[int, int]]:
    """Ranges as (low, high) with `*` replaced by the largest number in use (RFC 3501 6.4.8)."""
    out = []
    for lo, hi in ranges:
        a = largest if lo is None else lo
        b = largest if hi is None else hi
        out.append((min(a, b), max(a, b)))
    return out


def compact_set(numbers: list[int]) -> str:
    """Numbers as a compact sequence set, in the order given (COPYUID pairs its two sets by
    position): each run of consecutive ascending ones as a range, 4,5,6,9 -> 4:6,9."""
    out: list[str] = []
    run: list[int] = []
    for n in numbers:
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}:{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}:{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


# --------------------------------------------------------------------------- dates

_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DATE_TIME = re.compile(
    rb'\A"?\s?(\d{1,2})-([A-Za-z]{3})-(\d{4}) (\d\d):(\d\d):(\d\d) ([+-])(\d\d)(\d\d)"?\Z'
)
_DATE = re.compile(rb'\A"?(\d{1,2})-([A-Za-z]{3})-(\d{4})"?\Z')


def format_datetime(moment: datetime) -> bytes:
    """INTERNALDATE: "17-Jul-1996 02:44:25 -0700" (in UTC here)."""
    moment = moment.astimezone(timezone.utc)
    return b'"%02d-%s-%04d %02d:%02d:%02d +0000"' % (
        moment.day, _MONTHS[moment.month - 1].capitalize().encode(), moment.year,
        moment.hour, moment.minute, moment.second,
    )


def parse_datetime(text: bytes) -> datetime:
    """An APPEND date-time. Raises ParseError."""
    m = _DATE_TIME.match(text)
    if not m:
        raise ParseError("bad date-time")
    day, mon, year, hh, mm, ss, sign, zh, zm = m.groups()
    try:
        month = _MONTHS.index(mon.decode().lower()) + 1
        offset = timedelta(hours=int(zh), minutes=int(zm)) * (1 if sign == b"+" else -1)
        return datetime(int(year), month, int(day), int(hh), int(mm), int(ss), tzinfo=timezone(offset))
    except ValueError:
        raise ParseError("bad date-time") from None


def parse_date(text: bytes) -> datetime:
    """A SEARCH date ("1-Feb-1994"), as midnight UTC. Raises ParseError."""
    m = _DATE.match(text)
    if not m:
        raise ParseError("bad date")
    day, mon, year = m.groups()
    try:
        return datetime(int(year), _MONTHS.index(mon.decode().lower()) + 1, int(day), tzinfo=timezone.utc)
    except ValueError:
        raise ParseError("bad date") from None


# --------------------------------------------------------------------------- mailbox names


def decode_mailbox(name: bytes) -> str:
    """A mailbox name from the wire (modified UTF-7, RFC 3501 5.1.3). Raises ParseError."""
    text = _decode_utf7(name)
    if encode_mailbox(text) != name:
        # the same name can be spelt only one way (RFC 3501: no needless shifts, no 8-bit)
        raise ParseError("mailbox name is not in canonical modified UTF-7")
    return text


def encode_mailbox(name: str) -> bytes:
    """Modified UTF-7: printable ASCII as itself (`&` as `&-`), anything else as `&` base64 of
    UTF-16BE with `,` for `/` and no padding, closed by `-`."""
    out = bytearray()
    pending: list[str] = []

    def flush() -> None:
        if pending:
            data = "".join(pending).encode("utf-16-be", "surrogatepass")
            out.extend(b"&" + base64.b64encode(data).rstrip(b"=").replace(b"/", b",") + b"-")
            pending.clear()

    for ch in name:
        if 0x20 <= ord(ch) <= 0x7E:
            flush()
            out.extend(b"&-" if ch == "&" else ch.encode("ascii"))
        else:
            pending.append(ch)
    flush()
    return bytes(out)


def _decode_utf7(name: bytes) -> str:
    out: list[str] = []
    i = 0
    while i < len(name):
        ch = name[i]
        if ch == 0x26:  # &
            end = name.find(b"-", i + 1)
            if end < 0:
                raise ParseError("mailbox name is not valid modified UTF-7")
            shifted = name[i + 1 : end]
            if not shifted:
                out.append("&")
            else:
                if not _BASE64.fullmatch(shifted):
                    raise ParseError("mailbox name is not valid modified UTF-7")
                try:
                    data = base64.b64decode(shifted.replace(b",", b"/") + b"=" * (-len(shifted) % 4), validate=True)
                    out.append(data.decode("utf-16-be"))
                except (binascii.Error, UnicodeDecodeError, ValueError):
                    raise ParseError("mailbox name is not valid modified UTF-7") from None
            i = end + 1
        elif 0x20 <= ch <= 0x7E:
            out.append(chr(ch))
            i += 1
        else:
            raise ParseError("mailbox name is not valid modified UTF-7")
    return "".join(out)


_BASE64 = re.compile(rb"[A-Za-z0-9+,]+")
