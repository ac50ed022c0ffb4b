"""From a framed command (text and literals, see `connection.Frame`) to a typed `Command`.

A small recursive-descent parser over RFC 3501's grammar (section 9) and the extensions
cassmail offers. Pure functions: no I/O, no state, so each rule is tested and fuzzed alone.
Every error is a `wire.ParseError` whose text names the rule that was broken (never the
client's bytes), or `LimitExceeded` for input that is valid but larger than cassmail serves.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from cassmail.imap import commands as c
from cassmail.imap.connection import Frame
from cassmail.imap.wire import MAX_NUMBER, ParseError, parse_date, parse_datetime, parse_set

T = TypeVar("T")

#: Nesting of parentheses, NOT and OR in one SEARCH; deeper programs are refused with NO [LIMIT].
MAX_SEARCH_DEPTH = 64
#: Search keys in one SEARCH; each is tried against every message.
MAX_SEARCH_KEYS = 1000
#: Items in one FETCH, fields in one HEADER.FIELDS list, ID parameters.
MAX_LIST_ITEMS = 1000
#: RFC 7162 mod-sequence values are positive 63-bit numbers.
MAX_MODSEQ = (1 << 63) - 1

_TAG = re.compile(rb'[\x21-\x7e]+\Z')
_TAG_SPECIALS = re.compile(rb'[(){%*"\\+]')
#: ATOM-CHAR excluded: atom-specials `( ) { SP CTL % * " \ ]`; bytes >= 0x80 are let through so a
#: non-ASCII name meets the name check (NO) rather than a syntax error.
_ATOM_STOP = frozenset(b'(){ %*"\\]') | frozenset(range(0x20)) | {0x7F}
_ASTRING_STOP = _ATOM_STOP - {ord("]")}
_LIST_STOP = _ASTRING_STOP - {ord("%"), ord("*")}
#: A search key argument that is a sequence set or an atom: stops at a space or a parenthesis.
_SET_STOP = frozenset(b" ()")
_SPACE = frozenset(b" ")
_SECTION_STOP = frozenset(b" ]")
_PARTIAL_STOP = frozenset(b">")


#: `Cursor.take`'s matchers, by stop set (the parser's few constant sets).
_TAKERS: dict[frozenset[int], Callable[[bytes, int], re.Match[bytes]]] = {}


def _taker(stop: frozenset[int]) -> Callable[[bytes, int], re.Match[bytes]]:
    """A matcher of the bytes up to the first one in `stop`: a regular expression runs the scan
    in C, where a loop over the bytes ran it in Python (a tenth of parsing a command)."""
    found = _TAKERS.get(stop)
    if found is None:
        found = _TAKERS[stop] = re.compile(b"[^" + b"".join(re.escape(bytes([b])) for b in sorted(stop)) + b"]*"
                                           if stop else b".*", re.DOTALL).match  # type: ignore[assignment]
    return found  # type: ignore[return-value]


class LimitExceeded(ParseError):
    """Valid syntax beyond what cassmail serves (a SEARCH nested too deep): NO [LIMIT]."""


class Cursor:
    """A position in a framed command: in the text of `parts[index]` at `pos`, with the literal
    `parts[index + 1]` (if any) after that text."""

    def __init__(self, frame: Frame) -> None:
        self.parts = frame.parts
        #: Indexes in `parts` of the literals sent as literal8 (`~{n}`, RFC 3516).
        self.binary = frame.binary
        self.index = 0
        self.pos = 0

    @property
    def text(self) -> bytes:
        return self.parts[self.index]

    def peek(self) -> int | None:
        """The next byte of text, or None at the end of a text (before a literal or at the end)."""
        text = self.text
        return text[self.pos] if self.pos < len(text) else None

    def literal_next(self) -> bool:
        return self.pos >= len(self.text) and self.index + 1 < len(self.parts)

    def at_end(self) -> bool:
        return self.pos >= len(self.text) and self.index + 1 >= len(self.parts)

    def take_literal(self, binary: bool = False) -> bytes:
        """The literal next; a literal8 only where `binary` data may come (an APPEND message)."""
        if self.index + 1 in self.binary and not binary:
            raise ParseError("a literal8 (~{n}) is only allowed for an APPEND message")
        data = self.parts[self.index + 1]
        self.index += 2
        self.pos = 0
        return data

    def take(self, stop: frozenset[int]) -> bytes:
        """Bytes up to the first one in `stop` (or the end of the text)."""
        text, start = self.text, self.pos
        self.pos = end = _taker(stop)(text, start).end()
        return text[start:end]

    def expect(self, char: bytes, what: str) -> None:
        if self.peek() != char[0]:
            raise ParseError(what)
        self.pos += 1

    def accept(self, char: bytes) -> bool:
        if self.peek() == char[0]:
            self.pos += 1
            return True
        return False

    def sp(self) -> None:
        """One space (more are tolerated)."""
        if self.peek() != 0x20:
            raise ParseError("expected a space")
        while self.peek() == 0x20:
            self.pos += 1

    def end(self) -> None:
        while self.peek() == 0x20:  # trailing spaces are harmless
            self.pos += 1
        if not self.at_end():
            raise ParseError("unexpected arguments")

    # ------------------------------------------------------------------ RFC 3501 section 9

    def atom(self, what: str = "expected an atom") -> bytes:
        out = self.take(_ATOM_STOP)
        if not out:
            raise ParseError(what)
        return out

    def number(self, what: str = "expected a number") -> int:
        digits = self.take(_ATOM_STOP)
        if not digits.isdigit() or len(digits) > 20:
            raise ParseError(what)
        return int(digits)

    def modseq(self, what: str, zero: bool = False) -> int:
        """An RFC 7162 mod-sequence-value (1 to 2^63-1), or mod-sequence-valzer with `zero`."""
        digits = self.take(_ATOM_STOP)
        if not digits.isdigit() or len(digits) > 19 or int(digits) > MAX_MODSEQ or (int(digits) == 0 and not zero):
            raise ParseError(what)
        return int(digits)

    def quoted(self) -> bytes:
        self.expect(b'"', "expected a quoted string")
        text, out, i = self.text, bytearray(), self.pos
        while i < len(text):
            ch = text[i]
            if ch == 0x5C:  # backslash: only \\ and \" are quoted-specials
                if i + 1 >= len(text) or text[i + 1] not in (0x5C, 0x22):
                    raise ParseError("bad escape in quoted string")
                out.append(text[i + 1])
                i += 2
            elif ch == 0x22:
                self.pos = i + 1
                return bytes(out)
            elif ch == 0:
                raise ParseError("NUL in quoted string")
            else:
                out.append(ch)
                i += 1
        raise ParseError("unterminated quoted string")

    def string(self) -> bytes:
        if self.literal_next():
            return self.take_literal()
        return self.quoted()

    def astring(self, what: str = "expected a string") -> bytes:
        if self.literal_next():
            return self.take_literal()
        if self.peek() == 0x22:
            return self.quoted()
        out = self.take(_ASTRING_STOP)
        if not out:
            raise ParseError(what)
        return out

    def nstring(self) -> bytes | None:
        if self.peek() in (0x4E, 0x6E) and self.text[self.pos : self.pos + 3].upper() == b"NIL":
            self.pos += 3
            return None
        return self.string()

    def list_mailbox(self) -> bytes:
        """A LIST pattern: an astring whose atom form may hold the wildcards % and *."""
        if self.literal_next():
            return self.take_literal()
        if self.peek() == 0x22:
            return self.quoted()
        out = self.take(_LIST_STOP)
        if not out:
            raise ParseError("expected a mailbox pattern")
        return out

    def parenthesised(self, item: Callable[[Cursor], T], what: str, empty: bool = True) -> list[T]:
        """`(item SP item ...)`."""
        self.expect(b"(", what)
        out: list[T] = []
        if self.accept(b")"):
            if not empty:
                raise ParseError(what)
            return out
        while True:
            out.append(item(self))
            if len(out) > MAX_LIST_ITEMS:
                raise LimitExceeded("too many items in a list")
            if self.accept(b")"):
                return out
            self.sp()

    def flag(self) -> str:
        start = self.pos
        if self.accept(b"\\"):
            if self.accept(b"*"):
                raise ParseError("\\* is not a flag")
            name = b"\\" + self.atom("bad flag")
        else:
            name = self.atom("bad flag")
        if any(ch >= 0x80 for ch in name):
            self.pos = start
            raise ParseError("bad flag")
        return name.decode("ascii")

    def flag_list(self) -> tuple[str, ...]:
        return tuple(self.parenthesised(Cursor.flag, "bad flag list"))

    def sequence_set(self) -> c.SequenceSet:
        text = self.take(_SET_STOP)
        return tuple(parse_set(text))

    def known_set(self, what: str) -> c.SequenceSet:
        """A sequence set without `*` (RFC 7162's known-uids and seq-match-data)."""
        ranges = self.sequence_set()
        if any(lo is None or hi is None for lo, hi in ranges):
            raise ParseError(what)
        return ranges

    def date(self) -> datetime:
        if self.peek() == 0x22:
            return parse_date(b'"' + self.quoted() + b'"')
        return parse_date(self.take(_SET_STOP))

    def date_time(self) -> datetime:
        return parse_datetime(b'"' + self.quoted() + b'"')


# --------------------------------------------------------------------------- commands


def parse_tag(frame: Frame) -> tuple[bytes | None, bytes, Cursor]:
    """(tag or None when there is no valid one, the command name upper-cased, the cursor after it)."""
    cursor = Cursor(frame)
    tag = cursor.take(_SPACE)
    if not tag or not _TAG.match(tag) or _TAG_SPECIALS.search(tag):
        return None, b"", cursor
    if not cursor.accept(b" "):
        return tag, b"", cursor
    name = cursor.take(_SPACE)
    return tag, name.upper(), cursor


def parse_command(tag: bytes, name: bytes, cursor: Cursor) -> c.Command:
    """The typed command; raises ParseError (BAD), LimitExceeded (NO [LIMIT]) and KeyError for a
    command cassmail does not know."""
    uid = False
    if name == b"UID":
        cursor.sp()
        name = cursor.atom("UID goes with COPY, MOVE, FETCH, STORE, SEARCH or EXPUNGE").upper()
        if name not in _UID_COMMANDS:
            raise ParseError("UID goes with COPY, MOVE, FETCH, STORE, SEARCH or EXPUNGE")
        uid = True
    rule = _RULES[name]  # KeyError: unknown
    args = rule(cursor, uid) if rule is not None else c.Simple()
    cursor.end()
    return c.Command(tag, name.decode("ascii"), args)


def _sp_then(rule: Callable[[Cursor], T]) -> Callable[[Cursor], T]:
    def parse(cursor: Cursor) -> T:
        cursor.sp()
        return rule(cursor)

    return parse


def _mailbox(cursor: Cursor) -> bytes:
    cursor.sp()
    return cursor.astring("expected a mailbox name")


def _id(cursor: Cursor, uid: bool) -> c.Id:
    cursor.sp()
    if cursor.peek() != 0x28:
        if cursor.atom("ID takes NIL or a list of names and values").upper() != b"NIL":
            raise ParseError("ID takes NIL or a list of names and values")
        return c.Id(None)
    values = cursor.parenthesised(Cursor.nstring, "ID takes NIL or a list of names and values")
    if len(values) % 2:
        raise ParseError("ID takes pairs of names and values")
    pairs = tuple((values[i] or b"", values[i + 1]) for i in range(0, len(values), 2))
    return c.Id(pairs)


def _login(cursor: Cursor, uid: bool) -> c.Login:
    cursor.sp()
    user = cursor.astring("LOGIN takes a user name and a password")
    cursor.sp()
    return c.Login(user, cursor.astring("LOGIN takes a user name and a password"))


def _authenticate(cursor: Cursor, uid: bool) -> c.Authenticate:
    cursor.sp()
    mechanism = cursor.atom("AUTHENTICATE takes a mechanism").upper().decode("ascii", "replace")
    initial = None
    if cursor.peek() == 0x20:
        cursor.sp()
        initial = cursor.atom("bad initial response")
    return c.Authenticate(mechanism, initial)


def _compress(cursor: Cursor, uid: bool) -> c.Compress:
    cursor.sp()
    return c.Compress(cursor.atom("COMPRESS takes a mechanism").upper().decode("ascii", "replace"))


def _enable(cursor: Cursor, uid: bool) -> c.Enable:
    names = []
    while not cursor.at_end():
        cursor.sp()
        if cursor.at_end():
            break
        names.append(cursor.atom("bad capability name").upper().decode("ascii", "replace"))
    if not names:
        raise ParseError("ENABLE needs at least one capability")
    return c.Enable(tuple(names))


def _one_mailbox(cursor: Cursor, uid: bool) -> c.Mailbox:
    return c.Mailbox(_mailbox(cursor))


def _select(readonly: bool) -> Callable[[Cursor, bool], c.Select]:
    def parse(cursor: Cursor, uid: bool) -> c.Select:
        name = _mailbox(cursor)
        condstore, qresync = False, None
        if cursor.peek() == 0x20 and not cursor.at_end():
            cursor.sp()
            if not cursor.at_end():  # RFC 7162 select-params
                cursor.expect(b"(", "SELECT parameters are CONDSTORE and QRESYNC, in parentheses")
                seen: set[bytes] = set()
                while True:
                    param = cursor.atom("SELECT parameters are CONDSTORE and QRESYNC, in parentheses").upper()
                    if param in seen or param not in (b"CONDSTORE", b"QRESYNC"):
                        raise ParseError("SELECT parameters are CONDSTORE and QRESYNC, once each")
                    seen.add(param)
                    if param == b"CONDSTORE":
                        condstore = True
                    else:
                        cursor.sp()
                        qresync = _qresync(cursor)
                    if cursor.accept(b")"):
                        break
                    cursor.sp()
        return c.Select(name, readonly, condstore, qresync)

    return parse


_QRESYNC = "QRESYNC takes (uidvalidity modseq [known-uids] [(known-sequences known-uids)])"


def _qresync(cursor: Cursor) -> c.QResync:
    """`(uidvalidity mod-sequence-value [SP known-uids] [SP seq-match-data])` (RFC 7162 7)."""
    cursor.expect(b"(", _QRESYNC)
    uidvalidity = cursor.number(_QRESYNC)
    if not 0 < uidvalidity <= MAX_NUMBER:
        raise ParseError(_QRESYNC)
    cursor.sp()
    modseq = cursor.modseq(_QRESYNC)
    known = match = None
    if cursor.peek() == 0x20:
        cursor.sp()
        if cursor.peek() != 0x28:
            known = cursor.known_set("QRESYNC known UIDs are a sequence set without *")
            if cursor.peek() == 0x20:
                cursor.sp()
                if cursor.peek() != 0x28:
                    raise ParseError(_QRESYNC)
        if cursor.peek() == 0x28:
            match = _seq_match(cursor)
    cursor.expect(b")", _QRESYNC)
    return c.QResync(uidvalidity, modseq, known, match)


def _seq_match(cursor: Cursor) -> tuple[tuple[int, int], ...]:
    """seq-match-data, `(known-sequence-set known-uid-set)`, as (sequence number, UID) pairs: the
    first and last UID of each range of the UID set with the sequence numbers at the same places
    of the sequence set (the two must hold as many numbers). Ranges are not expanded."""
    what = "QRESYNC sequence match data is (sequence-set uid-set), as many of each, without *"
    cursor.expect(b"(", what)
    seqs = [(min(a, b), max(a, b)) for a, b in cursor.known_set(what)]  # type: ignore[type-var]
    cursor.sp()
    uids = [(min(a, b), max(a, b)) for a, b in cursor.known_set(what)]  # type: ignore[type-var]
    cursor.expect(b")", what)
    if sum(hi - lo + 1 for lo, hi in seqs) != sum(hi - lo + 1 for lo, hi in uids):
        raise ParseError(what)
    starts, total = [], 0  # position of each sequence range's first number
    for lo, hi in seqs:
        starts.append(total)
        total += hi - lo + 1

    def seq_at(position: int) -> int:
        index = bisect.bisect_right(starts, position) - 1
        return seqs[index][0] + position - starts[index]

    pairs: list[tuple[int, int]] = []
    position = 0
    for lo, hi in uids:
        pairs.append((seq_at(position), lo))
        if hi > lo:
            pairs.append((seq_at(position + hi - lo), hi))
        position += hi - lo + 1
    return tuple(pairs)


def _rename(cursor: Cursor, uid: bool) -> c.Rename:
    old = _mailbox(cursor)
    return c.Rename(old, _mailbox(cursor))


_LIST_SELECT = frozenset({"SUBSCRIBED", "REMOTE", "RECURSIVEMATCH", "SPECIAL-USE"})
_LIST_RETURN = frozenset({"SUBSCRIBED", "CHILDREN", "SPECIAL-USE", "STATUS"})


def _option(cursor: Cursor) -> str:
    return cursor.atom("bad option").upper().decode("ascii", "replace")


def _list(cursor: Cursor, uid: bool) -> c.ListCommand:
    cursor.sp()
    select: set[str] = set()
    if cursor.peek() == 0x28:  # LIST-EXTENDED selection options (RFC 5258)
        select = set(cursor.parenthesised(_option, "bad LIST selection options"))
        if not select <= _LIST_SELECT:
            raise ParseError("unknown LIST selection option")
        if select == {"RECURSIVEMATCH"} or select == {"RECURSIVEMATCH", "REMOTE"}:
            raise ParseError("RECURSIVEMATCH needs another selection option")
        cursor.sp()
    reference = cursor.astring("LIST takes a reference and a pattern")
    cursor.sp()
    if cursor.peek() == 0x28:
        patterns = tuple(cursor.parenthesised(Cursor.list_mailbox, "bad pattern list", empty=False))
    else:
        patterns = (cursor.list_mailbox(),)
    returns: set[str] = set()
    status: tuple[str, ...] = ()
    if cursor.peek() == 0x20:
        cursor.sp()
        if not cursor.at_end():
            if cursor.atom("bad LIST return options").upper() != b"RETURN":
                raise ParseError("bad LIST return options")
            cursor.sp()
            cursor.expect(b"(", "bad LIST return options")
            while not cursor.accept(b")"):
                option = _option(cursor)
                if option not in _LIST_RETURN:
                    raise ParseError("unknown LIST return option")
                returns.add(option)
                if option == "STATUS":
                    cursor.sp()
                    status = _status_items(cursor)
                if cursor.peek() != 0x29:
                    cursor.sp()
    if "SPECIAL-USE" in select:
        returns.add("SPECIAL-USE")
    if "SUBSCRIBED" in select:
        returns.add("SUBSCRIBED")
    return c.ListCommand(reference, patterns, frozenset(select), frozenset(returns), status)


def _lsub(cursor: Cursor, uid: bool) -> c.ListCommand:
    cursor.sp()
    reference = cursor.astring("LSUB takes a reference and a pattern")
    cursor.sp()
    return c.ListCommand(reference, (cursor.list_mailbox(),), lsub=True)


STATUS_ITEMS = ("MESSAGES", "RECENT", "UIDNEXT", "UIDVALIDITY", "UNSEEN", "SIZE", "APPENDLIMIT", "HIGHESTMODSEQ",
                "DELETED", "DELETED-STORAGE")


def _status_items(cursor: Cursor) -> tuple[str, ...]:
    items = tuple(cursor.parenthesised(_option, "STATUS takes a list of items", empty=False))
    if not set(items) <= set(STATUS_ITEMS):
        raise ParseError("STATUS items are MESSAGES, RECENT, UIDNEXT, UIDVALIDITY, UNSEEN, SIZE, APPENDLIMIT, "
                         "HIGHESTMODSEQ, DELETED and DELETED-STORAGE")
    return items


def _status(cursor: Cursor, uid: bool) -> c.Status:
    name = _mailbox(cursor)
    cursor.sp()
    return c.Status(name, _status_items(cursor))


def _append(cursor: Cursor, uid: bool) -> c.Append:
    name = _mailbox(cursor)
    cursor.sp()
    flags: tuple[str, ...] = ()
    date = None
    if cursor.peek() == 0x28:
        flags = cursor.flag_list()
        cursor.sp()
    if cursor.peek() == 0x22:
        date = cursor.date_time()
        cursor.sp()
    if cursor.text[cursor.pos : cursor.pos + 6].upper() == b"UTF8 (":  # RFC 6855: UTF8 (literal8)
        cursor.pos += 6
        if not cursor.literal_next() or cursor.index + 1 not in cursor.binary:
            raise ParseError("APPEND UTF8 needs the message as a literal8 in parentheses")
        message = cursor.take_literal(binary=True)
        cursor.expect(b")", "APPEND UTF8 needs the message as a literal8 in parentheses")
        return c.Append(name, flags, date, message)
    if not cursor.literal_next():
        raise ParseError("APPEND needs the message as a literal")
    return c.Append(name, flags, date, cursor.take_literal(binary=True))


def _expunge(cursor: Cursor, uid: bool) -> c.Expunge:
    if not uid:
        return c.Expunge()
    cursor.sp()
    return c.Expunge(cursor.sequence_set())


def _copy(move: bool) -> Callable[[Cursor, bool], c.Copy]:
    def parse(cursor: Cursor, uid: bool) -> c.Copy:
        cursor.sp()
        messages = cursor.sequence_set()
        return c.Copy(messages, _mailbox(cursor), move, uid)

    return parse


def _store(cursor: Cursor, uid: bool) -> c.Store:
    cursor.sp()
    messages = cursor.sequence_set()
    cursor.sp()
    unchangedsince = None
    if cursor.peek() == 0x28:  # RFC 7162 store-modifiers: (UNCHANGEDSINCE n)
        what = "the STORE modifier is (UNCHANGEDSINCE modseq)"
        cursor.expect(b"(", what)
        if cursor.atom(what).upper() != b"UNCHANGEDSINCE":
            raise ParseError(what)
        cursor.sp()
        unchangedsince = cursor.modseq(what, zero=True)
        cursor.expect(b")", what)
        cursor.sp()
    item = cursor.atom("STORE takes FLAGS, +FLAGS or -FLAGS").upper()
    silent = item.endswith(b".SILENT")
    base = item[: -len(b".SILENT")] if silent else item
    mode = {b"FLAGS": "set", b"+FLAGS": "add", b"-FLAGS": "remove"}.get(base)
    if mode is None:
        raise ParseError("STORE takes FLAGS, +FLAGS or -FLAGS (optionally .SILENT)")
    cursor.sp()
    if cursor.peek() == 0x28:
        flags = cursor.flag_list()
    else:
        flags_list = [cursor.flag()]
        while cursor.peek() == 0x20:
            cursor.sp()
            if cursor.at_end():
                break
            flags_list.append(cursor.flag())
        flags = tuple(flags_list)
    return c.Store(messages, mode, silent, flags, uid, unchangedsince)


# ---- FETCH

_MACROS = {
    b"ALL": ("FLAGS", "INTERNALDATE", "RFC822.SIZE", "ENVELOPE"),
    b"FAST": ("FLAGS", "INTERNALDATE", "RFC822.SIZE"),
    b"FULL": ("FLAGS", "INTERNALDATE", "RFC822.SIZE", "ENVELOPE", "BODY"),
}
_PLAIN_ATTS = frozenset({"FLAGS", "UID", "INTERNALDATE", "RFC822.SIZE", "ENVELOPE", "BODYSTRUCTURE",
                         "RFC822", "RFC822.HEADER", "RFC822.TEXT", "BODY", "MODSEQ"})
_ATT_STOP = frozenset(b" ()[<")


def _fetch_att(cursor: Cursor) -> c.FetchAtt:
    name = cursor.take(_ATT_STOP).upper().decode("ascii", "replace")
    if name in ("BODY", "BODY.PEEK") and cursor.peek() == 0x5B:
        section = _section(cursor)
        partial = _partial(cursor)
        return c.FetchAtt("BODY", section, partial, peek=name == "BODY.PEEK")
    if name in ("BINARY", "BINARY.PEEK", "BINARY.SIZE") and cursor.peek() == 0x5B:  # RFC 3516
        section = _section(cursor)
        if section.text is not None:
            raise ParseError("BINARY sections are part numbers only")
        if name == "BINARY.SIZE":
            return c.FetchAtt(name, section)
        return c.FetchAtt("BINARY", section, _partial(cursor), peek=name == "BINARY.PEEK")
    if name in _PLAIN_ATTS:
        return c.FetchAtt(name)
    raise ParseError("bad FETCH attributes")


def _section(cursor: Cursor) -> c.Section:
    cursor.expect(b"[", "bad FETCH attributes")
    part: list[int] = []
    text: str | None = None
    fields: tuple[str, ...] = ()
    spec = cursor.take(_SECTION_STOP)
    words = spec.split(b".") if spec else []
    while words and words[0].isdigit():
        number = words.pop(0)
        if number.startswith(b"0") or len(number) > 9:
            raise ParseError("bad FETCH attributes")
        part.append(int(number))
        if len(part) > 64:
            raise ParseError("bad FETCH attributes")
    if words:
        text = b".".join(words).upper().decode("ascii", "replace")
        allowed = ("HEADER", "HEADER.FIELDS", "HEADER.FIELDS.NOT", "TEXT") + (("MIME",) if part else ())
        if text not in allowed:
            raise ParseError("bad FETCH attributes")
        if text.startswith("HEADER.FIELDS"):
            cursor.sp()
            names = cursor.parenthesised(_header_name, "bad FETCH attributes", empty=False)
            fields = tuple(names)
    elif spec and not part:
        raise ParseError("bad FETCH attributes")
    cursor.expect(b"]", "bad FETCH attributes")
    return c.Section(tuple(part), text, fields)


def _header_name(cursor: Cursor) -> str:
    name = cursor.astring("bad FETCH attributes")
    if not name or any(ch <= 0x20 or ch >= 0x7F or ch == 0x3A for ch in name):
        raise ParseError("bad FETCH attributes")
    return name.decode("ascii")


def _partial(cursor: Cursor) -> tuple[int, int] | None:
    if not cursor.accept(b"<"):
        return None
    text = cursor.take(_PARTIAL_STOP)
    cursor.expect(b">", "bad FETCH attributes")
    start, dot, length = text.partition(b".")
    if not (start.isdigit() and dot and length.isdigit()) or len(start) > 10 or len(length) > 10:
        raise ParseError("bad FETCH attributes")
    if int(start) > MAX_NUMBER or not 0 < int(length) <= MAX_NUMBER:
        raise ParseError("bad FETCH attributes")
    return int(start), int(length)


def _fetch(cursor: Cursor, uid: bool) -> c.Fetch:
    cursor.sp()
    messages = cursor.sequence_set()
    cursor.sp()
    if cursor.peek() == 0x28:
        atts = cursor.parenthesised(_fetch_att, "bad FETCH attributes", empty=False)
    else:
        start = cursor.pos
        macro = _MACROS.get(cursor.take(_ATT_STOP).upper())
        if macro is not None and cursor.peek() in (None, 0x20):
            atts = [c.FetchAtt(n) for n in macro]
        else:
            cursor.pos = start
            atts = [_fetch_att(cursor)]
    changedsince, vanished = None, False
    if cursor.peek() == 0x20:
        cursor.sp()
        if not cursor.at_end():
            changedsince, vanished = _fetch_modifiers(cursor, uid)
    if uid and not any(a.name == "UID" for a in atts):
        atts.append(c.FetchAtt("UID"))  # RFC 3501 6.4.8: UID FETCH always answers the UID
    if changedsince is not None and not any(a.name == "MODSEQ" for a in atts):
        atts.append(c.FetchAtt("MODSEQ"))  # RFC 7162 3.1.4.1: CHANGEDSINCE answers the MODSEQ
    return c.Fetch(messages, tuple(atts), uid, changedsince, vanished)


def _fetch_modifiers(cursor: Cursor, uid: bool) -> tuple[int | None, bool]:
    """RFC 7162 fetch-modifiers: `(CHANGEDSINCE n)`, with UID FETCH `(CHANGEDSINCE n VANISHED)`."""
    what = "FETCH modifiers are (CHANGEDSINCE modseq) and VANISHED, once each"
    changedsince, vanished = None, False
    cursor.expect(b"(", what)
    while True:
        name = cursor.atom(what).upper()
        if name == b"CHANGEDSINCE" and changedsince is None:
            cursor.sp()
            changedsince = cursor.modseq(what)
        elif name == b"VANISHED" and not vanished:
            vanished = True
        else:
            raise ParseError(what)
        if cursor.accept(b")"):
            break
        cursor.sp()
    if vanished and (not uid or changedsince is None):
        raise ParseError("VANISHED goes with UID FETCH and CHANGEDSINCE")
    return changedsince, vanished


# ---- SEARCH

_NO_ARG = frozenset({"ALL", "ANSWERED", "DELETED", "DRAFT", "FLAGGED", "NEW", "OLD", "RECENT", "SEEN",
                     "UNANSWERED", "UNDELETED", "UNDRAFT", "UNFLAGGED", "UNSEEN"})
_STRING_ARG = frozenset({"BCC", "BODY", "CC", "FROM", "SUBJECT", "TEXT", "TO"})
_DATE_ARG = frozenset({"BEFORE", "ON", "SINCE", "SENTBEFORE", "SENTON", "SENTSINCE"})
_NUMBER_ARG = frozenset({"LARGER", "SMALLER"})


class _SearchParser:
    def __init__(self, cursor: Cursor) -> None:
        self.cursor = cursor
        self.keys = 0

    def program(self) -> c.And:
        keys = [self.key(0)]
        while not self.cursor.at_end():
            self.cursor.sp()
            if self.cursor.at_end():
                break
            keys.append(self.key(0))
        return c.And(tuple(keys))

    def key(self, depth: int) -> c.SearchKey:
        cursor = self.cursor
        if depth > MAX_SEARCH_DEPTH:
            raise LimitExceeded("search program nested too deeply")
        self.keys += 1
        if self.keys > MAX_SEARCH_KEYS:
            raise LimitExceeded("too many search keys")
        if cursor.accept(b"("):
            keys = [self.key(depth + 1)]
            while not cursor.accept(b")"):
                cursor.sp()
                if cursor.accept(b")"):
                    break
                keys.append(self.key(depth + 1))
            return c.And(tuple(keys))
        if cursor.literal_next():
            raise ParseError("bad search key")
        word = cursor.take(_SET_STOP)
        if not word:
            raise ParseError("bad search key")
        name = word.upper().decode("ascii", "replace")
        if name in _NO_ARG:
            return c.Key(name)
        if name == "NOT":
            cursor.sp()
            return c.Not(self.key(depth + 1))
        if name == "OR":
            cursor.sp()
            left = self.key(depth + 1)
            cursor.sp()
            return c.Or(left, self.key(depth + 1))
        if name in _STRING_ARG:
            cursor.sp()
            return c.Key(name, (cursor.astring(f"{name} needs a string"),))
        if name == "HEADER":
            cursor.sp()
            field = cursor.astring("HEADER needs a field name")
            cursor.sp()
            return c.Key(name, (field, cursor.astring("HEADER needs a string")))
        if name in _DATE_ARG:
            cursor.sp()
            return c.Key(name, (cursor.date(),))
        if name in _NUMBER_ARG:
            cursor.sp()
            return c.Key(name, (cursor.number(f"{name} needs a number"),))
        if name in ("KEYWORD", "UNKEYWORD"):
            cursor.sp()
            return c.Key(name, (cursor.flag(),))
        if name == "UID":
            cursor.sp()
            return c.Key(name, (cursor.sequence_set(),))
        if name == "MODSEQ":
            cursor.sp()
            return c.Key(name, (_search_modseq(cursor),))
        if word[:1].isdigit() or word[:1] == b"*":
            return c.Key("SET", (tuple(parse_set(word)),))
        raise ParseError("unknown search key")


def _search_modseq(cursor: Cursor) -> int:
    """`[entry-name SP entry-type-req SP] mod-sequence-valzer` (RFC 7162 3.1.5): cassmail keeps one
    MODSEQ per message, not one per flag, so the entry is checked for its syntax and left aside,
    as the RFC lets a server do."""
    what = 'MODSEQ takes ["/flags/<flag>" priv|shared|all] and a modseq'
    if cursor.peek() == 0x22:
        entry = cursor.quoted()
        if not entry.lower().startswith(b"/flags/") or len(entry) == 7 or any(ch <= 0x20 for ch in entry):
            raise ParseError(what)
        cursor.sp()
        if cursor.atom(what).lower() not in (b"priv", b"shared", b"all"):
            raise ParseError(what)
        cursor.sp()
    return cursor.modseq(what, zero=True)


_SEARCH_RETURN = frozenset({"MIN", "MAX", "COUNT", "ALL"})


def _search(cursor: Cursor, uid: bool) -> c.Search:
    cursor.sp()
    returns: frozenset[str] | None = None
    if cursor.text[cursor.pos : cursor.pos + 7].upper() == b"RETURN ":  # ESEARCH (RFC 4731)
        cursor.pos += 6
        cursor.sp()
        options = frozenset(cursor.parenthesised(_option, "bad SEARCH return options"))
        if not options <= _SEARCH_RETURN:
            raise ParseError("SEARCH RETURN takes MIN, MAX, COUNT and ALL")
        returns = options or frozenset({"ALL"})
        cursor.sp()
    charset = None
    if cursor.text[cursor.pos : cursor.pos + 8].upper() == b"CHARSET ":
        cursor.pos += 7
        cursor.sp()
        charset = cursor.astring("CHARSET needs a name").decode("ascii", "replace").upper()
        cursor.sp()
    return c.Search(charset, _SearchParser(cursor).program(), uid, returns)


#: SORT criteria (RFC 5256 and RFC 5957) and THREAD algorithms (RFC 5256).
SORT_KEYS = frozenset({"ARRIVAL", "CC", "DATE", "FROM", "SIZE", "SUBJECT", "TO", "DISPLAYFROM", "DISPLAYTO"})
THREAD_ALGORITHMS = ("ORDEREDSUBJECT", "REFERENCES")


def _charset(cursor: Cursor) -> str:
    cursor.sp()
    charset = cursor.astring("expected a charset").decode("ascii", "replace").upper()
    cursor.sp()
    return charset


def _sort(cursor: Cursor, uid: bool) -> c.Sort:
    cursor.sp()
    criteria: list[tuple[str, bool]] = []
    reverse = False
    for word in cursor.parenthesised(_option, "SORT needs its criteria in parentheses", empty=False):
        if word == "REVERSE" and not reverse:
            reverse = True
        elif word in SORT_KEYS:
            criteria.append((word, reverse))
            reverse = False
        else:
            raise ParseError(f"bad sort criterion {word}")
    if reverse:
        raise ParseError("REVERSE must come before a sort criterion")
    charset = _charset(cursor)
    return c.Sort(tuple(criteria), charset, _SearchParser(cursor).program(), uid)


def _thread(cursor: Cursor, uid: bool) -> c.Thread:
    cursor.sp()
    algorithm = _option(cursor)
    if algorithm not in THREAD_ALGORITHMS:
        raise ParseError(f"unknown threading algorithm {algorithm}")
    charset = _charset(cursor)
    return c.Thread(algorithm, charset, _SearchParser(cursor).program(), uid)


def _getquota(cursor: Cursor, uid: bool) -> c.GetQuota:
    cursor.sp()
    return c.GetQuota(cursor.astring("GETQUOTA takes a quota root name"))


def _setquota(cursor: Cursor, uid: bool) -> c.SetQuota:
    """RFC 9208 4.1.3: a quota root and a list of resource names and limits (possibly empty)."""
    cursor.sp()
    root = cursor.astring("SETQUOTA takes a quota root name and a list of resources and limits")
    cursor.sp()
    words = cursor.parenthesised(lambda cur: cur.atom("SETQUOTA takes resource names and limits"),
                                 "SETQUOTA takes a list of resources and limits")
    if len(words) % 2:
        raise ParseError("SETQUOTA takes pairs of a resource name and a limit")
    limits = []
    for name, value in zip(words[::2], words[1::2]):
        if not value.isdigit() or len(value) > 19 or int(value) > MAX_MODSEQ:
            raise ParseError("a SETQUOTA limit is a number below 2^63")
        if not name or not re.fullmatch(rb"[A-Za-z0-9.\-_]+", name):
            raise ParseError("a SETQUOTA resource name is an atom")
        limits.append((name.decode("ascii").upper(), int(value)))
    return c.SetQuota(root, tuple(limits))


Rule = Callable[[Cursor, bool], c.Args]

_RULES: dict[bytes, Rule | None] = {
    b"CAPABILITY": None, b"NOOP": None, b"LOGOUT": None, b"STARTTLS": None, b"NAMESPACE": None,
    b"IDLE": None, b"CHECK": None, b"CLOSE": None, b"UNSELECT": None,
    b"ID": _id, b"LOGIN": _login, b"AUTHENTICATE": _authenticate, b"ENABLE": _enable, b"COMPRESS": _compress,
    b"SELECT": _select(False), b"EXAMINE": _select(True),
    b"CREATE": _one_mailbox, b"DELETE": _one_mailbox, b"SUBSCRIBE": _one_mailbox, b"UNSUBSCRIBE": _one_mailbox,
    b"RENAME": _rename, b"LIST": _list, b"LSUB": _lsub, b"STATUS": _status, b"APPEND": _append,
    b"EXPUNGE": _expunge, b"SEARCH": _search, b"FETCH": _fetch, b"STORE": _store,
    b"COPY": _copy(False), b"MOVE": _copy(True), b"SORT": _sort, b"THREAD": _thread,
    b"GETQUOTA": _getquota, b"GETQUOTAROOT": _one_mailbox, b"SETQUOTA": _setquota,
}
_UID_COMMANDS = frozenset({b"COPY", b"MOVE", b"FETCH", b"STORE", b"SEARCH", b"EXPUNGE", b"SORT", b"THREAD"})

#: Every command cassmail knows (CAPABILITY lists the extensions that bring some of them).
KNOWN = frozenset(name.decode("ascii") for name in _RULES) | {"UID"}


def message_limit(max_message: int) -> Callable[[bytes, int, bytes], int | None]:
    """For `Connection.read_command`: an APPEND's literal after its mailbox name is the message
    (up to `max_message` bytes); every other literal is a string."""

    def limit(first: bytes, index: int, before: bytes) -> int | None:
        words = first.split(b" ")
        if len(words) < 3 or words[1].upper() != b"APPEND":
            return None
        name_is_literal = len(words) == 3 and words[2][:1] == b"{"
        return max_message if index == int(name_is_literal) else None

    return limit
