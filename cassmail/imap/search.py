"""SEARCH (RFC 3501 6.4.4): the keys compiled once into a predicate over a session's view.

Flags, sizes, dates and sets are answered from the summaries; header keys read
the message's header only; BODY and TEXT read the message. Strings match as
case-insensitive substrings (of the decoded header value, or of the raw body).
Strings may come as atoms, quoted strings or literals (`{n}`, how clients send
non-ASCII text): `parse_keys` reads the command's lines with the literals between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from email.header import decode_header, make_header
from email.utils import parsedate_to_datetime
from typing import Any

from cassmail.imap import mime, wire
from cassmail.imap.view import MailboxView

Predicate = Callable[[int, "mime.Entity | None"], bool]

_FLAG_KEYS = {
    "ANSWERED": ("\\Answered", True), "UNANSWERED": ("\\Answered", False),
    "DELETED": ("\\Deleted", True), "UNDELETED": ("\\Deleted", False),
    "DRAFT": ("\\Draft", True), "UNDRAFT": ("\\Draft", False),
    "FLAGGED": ("\\Flagged", True), "UNFLAGGED": ("\\Flagged", False),
    "SEEN": ("\\Seen", True), "UNSEEN": ("\\Seen", False),
}
_HEADER_KEYS = {"BCC", "CC", "FROM", "SUBJECT", "TO"}
_DATE_KEYS = {"BEFORE", "ON", "SINCE", "SENTBEFORE", "SENTON", "SENTSINCE"}


@dataclass
class Program:
    match: Predicate
    needs_headers: bool
    needs_body: bool


def parse_keys(pieces: list[bytes]) -> list[Any]:
    """The search keys as nested lists of bytes tokens, from the command's text: `pieces`
    alternates text and literal data (text, literal, text, ...), the `{n}` markers already taken
    out of the text. Quoted strings lose their quotes and escapes; a literal is one string
    whatever its bytes. Raises wire.ParseError on unbalanced parentheses or quotes."""
    stack: list[list[Any]] = [[]]
    for n, piece in enumerate(pieces):
        if n % 2:
            stack[-1].append(bytes(piece))
            continue
        i, end = 0, len(piece)
        while i < end:
            c = piece[i : i + 1]
            if c in (b" ", b"\t"):
                i += 1
            elif c == b"(":
                stack.append([])
                i += 1
            elif c == b")":
                if len(stack) == 1:
                    raise wire.ParseError("unbalanced parentheses")
                done = stack.pop()
                stack[-1].append(done)
                i += 1
            elif c == b'"':
                out = bytearray()
                i += 1
                while True:
                    if i >= end:
                        raise wire.ParseError("unterminated quoted string")
                    c = piece[i : i + 1]
                    if c == b"\\" and piece[i + 1 : i + 2] in (b"\\", b'"'):
                        out += piece[i + 1 : i + 2]
                        i += 2
                    elif c == b'"':
                        i += 1
                        break
                    else:
                        out += c
                        i += 1
                stack[-1].append(bytes(out))
            else:
                start = i
                while i < end and piece[i : i + 1] not in (b" ", b"\t", b"(", b")", b'"'):
                    i += 1
                stack[-1].append(piece[start:i])
    if len(stack) != 1:
        raise wire.ParseError("unbalanced parentheses")
    return stack[0]


def compile_query(query: list[Any], view: MailboxView, uid_mode: bool) -> Program:
    """Raises wire.ParseError on a key it does not know or a missing argument."""
    state = {"headers": False, "body": False}
    tokens = list(query)
    if not tokens:
        raise wire.ParseError("SEARCH needs at least one key")
    preds = []
    while tokens:
        preds.append(_key(tokens, view, state))
    return Program(lambda u, e: all(p(u, e) for p in preds), state["headers"], state["body"])


def _text(token: Any) -> str:
    if not isinstance(token, bytes):
        raise wire.ParseError("expected a string")
    return token.decode("utf-8", "replace")


def _next(tokens: list[Any], what: str) -> Any:
    if not tokens:
        raise wire.ParseError(f"{what} needs an argument")
    return tokens.pop(0)


def _decoded(value: str) -> str:
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # noqa: BLE001 - a broken encoded word is matched as written
        return value


def _header_has(entity: mime.Entity | None, name: str, needle: str) -> bool:
    if entity is None:
        return False
    values = entity.headers.get_all(name) or []
    if not needle:
        return bool(values)
    return any(needle.lower() in _decoded(str(v)).lower() for v in values)


def _sent_date(entity: mime.Entity | None) -> date | None:
    if entity is None or entity.headers.get("date") is None:
        return None
    try:
        return parsedate_to_datetime(str(entity.headers["date"])).date()
    except (TypeError, ValueError):
        return None


def _compare_date(kind: str, value: date | None, when: date) -> bool:
    if value is None:
        return False
    if kind.endswith("BEFORE"):
        return value < when
    if kind.endswith("ON"):
        return value == when
    return value >= when


def _key(tokens: list[Any], view: MailboxView, state: dict[str, bool]) -> Predicate:
    token = tokens.pop(0)
    if isinstance(token, list):
        inner = list(token)
        preds = []
        while inner:
            preds.append(_key(inner, view, state))
        return lambda u, e: all(p(u, e) for p in preds)
    if not isinstance(token, bytes):
        raise wire.ParseError("bad search key")
    key = token.decode("ascii", "replace").upper()
    messages = view.messages
    if key == "ALL":
        return lambda u, e: True
    if key in _FLAG_KEYS:
        flag, present = _FLAG_KEYS[key]
        return lambda u, e: (flag in messages[u].flags) == present
    if key in ("RECENT", "NEW", "OLD"):
        if key == "RECENT":
            return lambda u, e: u in view.recent
        if key == "OLD":
            return lambda u, e: u not in view.recent
        return lambda u, e: u in view.recent and "\\Seen" not in messages[u].flags
    if key in ("KEYWORD", "UNKEYWORD"):
        word = _text(_next(tokens, key))
        present = key == "KEYWORD"
        return lambda u, e: (word in messages[u].flags) == present
    if key in ("LARGER", "SMALLER"):
        arg = _next(tokens, key)
        if not isinstance(arg, bytes) or not arg.isdigit():
            raise wire.ParseError(f"{key} needs a number")
        n = int(arg)
        return (lambda u, e: messages[u].size > n) if key == "LARGER" else (lambda u, e: messages[u].size < n)
    if key in _DATE_KEYS:
        when = wire.parse_date(_next(tokens, key)).date()
        if key.startswith("SENT"):
            state["headers"] = True
            return lambda u, e: _compare_date(key, _sent_date(e), when)
        return lambda u, e: _compare_date(key, messages[u].internal_date.date(), when)
    if key in _HEADER_KEYS:
        needle = _text(_next(tokens, key))
        state["headers"] = True
        return lambda u, e: _header_has(e, key.lower(), needle)
    if key == "HEADER":
        name = _text(_next(tokens, key))
        needle = _text(_next(tokens, key))
        state["headers"] = True
        return lambda u, e: _header_has(e, name, needle)
    if key in ("BODY", "TEXT"):
        needle = _text(_next(tokens, key)).lower().encode("utf-8")
        state["body"] = True
        if key == "BODY":
            return lambda u, e: e is not None and needle in e.body_bytes().lower()
        return lambda u, e: e is not None and needle in e.raw.lower()
    if key == "NOT":
        inner = _key(tokens, view, state)
        return lambda u, e: not inner(u, e)
    if key == "OR":
        left = _key(tokens, view, state)
        right = _key(tokens, view, state)
        return lambda u, e: left(u, e) or right(u, e)
    if key == "UID":
        ranges = wire.resolve_set(wire.parse_set(_next(tokens, key)), view.largest(True))
        wanted = set(view.by_uid(ranges))
        return lambda u, e: u in wanted
    # a bare sequence set
    ranges = wire.resolve_set(wire.parse_set(token), view.largest(False))
    wanted = set(view.by_seq(ranges))
    return lambda u, e: u in wanted
