"""SEARCH (RFC 3501 6.4.4): the parsed keys (`commands.SearchKey`) compiled once into a
predicate over a session's view, then run.

Flags, sizes, dates and sets are answered from the summaries; header keys read the message's
header only; BODY and TEXT read the message. Strings match as case-insensitive substrings (of
the decoded header value, or of the raw body); FROM, TO, CC and BCC also match the addresses
as parsed, so `user@domain` is found in `<user (comment)@ (comment) domain>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from email.header import decode_header, make_header
from email.utils import getaddresses, parsedate_to_datetime
from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap import condstore, mime, wire
from cassmail.imap.errors import No
from cassmail.imap.fetch import Heads, kept_header
from cassmail.imap.view import MailboxView
from cassmail.model import MessageSummary
from cassmail.store.base import NoSuchMessage

if TYPE_CHECKING:
    from cassmail.imap.session import Session

Predicate = Callable[[int, "mime.Entity | None"], bool]

_FLAG_KEYS = {
    "ANSWERED": ("\\Answered", True), "UNANSWERED": ("\\Answered", False),
    "DELETED": ("\\Deleted", True), "UNDELETED": ("\\Deleted", False),
    "DRAFT": ("\\Draft", True), "UNDRAFT": ("\\Draft", False),
    "FLAGGED": ("\\Flagged", True), "UNFLAGGED": ("\\Flagged", False),
    "SEEN": ("\\Seen", True), "UNSEEN": ("\\Seen", False),
}
_ADDRESS_KEYS = {"BCC", "CC", "FROM", "TO"}


@dataclass
class Program:
    match: Predicate
    needs_headers: bool
    needs_body: bool


def compile_program(program: c.And, view: MailboxView) -> Program:
    """The keys as one predicate, and what of each message it needs."""
    needs = {"headers": False, "body": False}
    return Program(_compile(program, view, needs), needs["headers"], needs["body"])


def check_charset(charset: str | None) -> None:
    if charset is not None and charset not in ("US-ASCII", "UTF-8"):
        raise No("Unsupported charset", "BADCHARSET (US-ASCII UTF-8)")


async def matching(session: Session, keys: c.And, headers: bool = False) -> list[tuple[int, MessageSummary, mime.Entity | None]]:
    """(uid, summary, entity) of each message of the selected mailbox the keys match, in
    mailbox order; the entity is the parsed header (or the whole message, when the keys read the
    body) when the keys or the caller (`headers`) need it, else None."""
    view = session.selected()
    program = compile_program(keys, view)
    messages, match = view.messages, program.match
    if not (program.needs_body or program.needs_headers or headers):  # the view alone: one pass
        return [(uid, messages[uid], None) for uid in view.uids if uid in messages and match(uid, None)]
    out = []
    uids = list(view.uids)
    heads = Heads(session, uids)
    for uid in uids:
        summary = messages.get(uid)
        if summary is None:
            continue
        if program.needs_body:
            try:
                entity = mime.parse(await session.store.read_message(view.user, view.name, summary.id))
            except NoSuchMessage:
                continue
        else:
            entity = kept_header(session, summary) or await heads.get(summary)
            if entity is None:
                continue
        if match(uid, entity):
            out.append((uid, summary, entity))
    return out


async def search(session: Session, args: c.Search) -> str:
    check_charset(args.charset)
    view = session.selected()
    modseq = await condstore_search(session, args.program)
    found = [uid for uid, _, _ in await matching(session, args.program)]
    if args.uid:
        hits = found
    else:  # the sequence numbers in one pass over the view (found is in its order)
        wanted = set(found)
        hits = [n for n, uid in enumerate(view.uids, 1) if uid in wanted]
    if args.returns is None:
        highest = condstore.modseq_of(view, found) if modseq else None
        session.untagged(b"SEARCH" + b"".join(b" %d" % n for n in hits) +
                         (b" (MODSEQ %d)" % highest if highest is not None else b""))
    else:
        # RFC 7162 3.1.5 with RFC 4731: the MODSEQ of what is returned (only MIN or MAX: that message)
        returned = found
        if found and not args.returns & {"ALL", "COUNT"}:
            returned = [found[0]] * ("MIN" in args.returns) + [found[-1]] * ("MAX" in args.returns)
        highest = condstore.modseq_of(view, returned) if modseq else None
        session.untagged(esearch(session.tag, args.uid, args.returns, hits, highest))
    return ("UID " if args.uid else "") + "SEARCH completed"


async def condstore_search(session: Session, program: c.And) -> bool:
    """Whether the program has the MODSEQ key; if so CONDSTORE is on (RFC 7162 3.1) and the
    view knows every message's MODSEQ before it is compared."""
    if not condstore.uses_modseq(program):
        return False
    condstore.enable(session)
    await condstore.fill(session, session.selected().uids)
    return True


def esearch(tag: bytes, uid: bool, returns: frozenset[str], hits: list[int], modseq: int | None = None) -> bytes:
    """An ESEARCH response (RFC 4731): MIN, MAX and ALL only when something matched, COUNT always;
    RFC 7162's MODSEQ last when the search had the MODSEQ key and something matched."""
    out = b'ESEARCH (TAG "' + tag + b'")' + (b" UID" if uid else b"")
    if hits:
        if "MIN" in returns:
            out += b" MIN %d" % hits[0]
        if "MAX" in returns:
            out += b" MAX %d" % hits[-1]
        if "ALL" in returns:
            out += b" ALL " + wire.compact_set(hits).encode()
    if "COUNT" in returns:
        out += b" COUNT %d" % len(hits)
    if modseq is not None:
        out += b" MODSEQ %d" % modseq
    return out


def _decoded(value: str) -> str:
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # noqa: BLE001 - a broken encoded word is matched as written
        return value


def _text_key(name: str) -> str:
    """Where `_field_texts` keeps a field's texts in `Entity.derived`."""
    return "text " + name.lower()


def _field_texts(entity: mime.Entity, name: str, key: str | None = None) -> tuple[str, ...]:
    """The field's values, encoded words decoded, lowercased: worked out once per parsed header
    (the worker keeps parsed headers, so a SEARCH repeated over a mailbox decodes nothing again).
    `key` is `_text_key(name)`, made once by a caller that asks for many messages."""
    key = key or _text_key(name)
    texts = entity.derived.get(key)
    if texts is None:
        texts = entity.derived[key] = tuple(_decoded(str(v)).lower() for v in entity.headers.get_all(name) or [])
    return texts


def _header_has(entity: mime.Entity | None, name: str, needle: str, key: str | None = None) -> bool:
    """Whether a value of the field holds `needle` (lowercased by the caller), or, for an empty
    needle, whether the field is there."""
    if entity is None:
        return False
    texts = _field_texts(entity, name, key)
    if not needle:
        return bool(texts)
    for text in texts:
        if needle in text:
            return True
    return False


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


def _compile(key: c.SearchKey, view: MailboxView, needs: dict[str, bool]) -> Predicate:
    if isinstance(key, c.And):
        preds = [_compile(k, view, needs) for k in key.keys]
        if len(preds) == 1:
            return preds[0]
        return lambda u, e: all(p(u, e) for p in preds)
    if isinstance(key, c.Not):
        inner = _compile(key.key, view, needs)
        return lambda u, e: not inner(u, e)
    if isinstance(key, c.Or):
        left, right = _compile(key.left, view, needs), _compile(key.right, view, needs)
        return lambda u, e: left(u, e) or right(u, e)
    name, args = key.name, key.args
    messages = view.messages
    if name == "ALL":
        return lambda u, e: True
    if name in _FLAG_KEYS:
        flag, present = _FLAG_KEYS[name]
        return lambda u, e: (flag in messages[u].flags) == present
    if name == "RECENT":
        return lambda u, e: u in view.recent
    if name == "OLD":
        return lambda u, e: u not in view.recent
    if name == "NEW":
        return lambda u, e: u in view.recent and "\\Seen" not in messages[u].flags
    if name in ("KEYWORD", "UNKEYWORD"):
        word, present = str(args[0]), name == "KEYWORD"
        return lambda u, e: (word in messages[u].flags) == present
    if name == "LARGER":
        larger = int(args[0])  # type: ignore[call-overload]
        return lambda u, e: messages[u].size > larger
    if name == "SMALLER":
        smaller = int(args[0])  # type: ignore[call-overload]
        return lambda u, e: messages[u].size < smaller
    if name in ("BEFORE", "ON", "SINCE", "SENTBEFORE", "SENTON", "SENTSINCE"):
        when = args[0].date()  # type: ignore[attr-defined]
        if name.startswith("SENT"):
            needs["headers"] = True
            return lambda u, e: _compare_date(name, _sent_date(e), when)
        return lambda u, e: _compare_date(name, messages[u].internal_date.date(), when)
    if name in _ADDRESS_KEYS:
        needle = _text(args[0]).lower()
        needs["headers"] = True
        return lambda u, e: _address_has(e, name.lower(), needle)
    if name == "SUBJECT":
        needle = _text(args[0]).lower()
        needs["headers"] = True
        key = _text_key("subject")
        return lambda u, e: _header_has(e, "subject", needle, key)
    if name == "HEADER":
        field, needle = _text(args[0]), _text(args[1]).lower()
        needs["headers"] = True
        key = _text_key(field)
        return lambda u, e: _header_has(e, field, needle, key)
    if name in ("BODY", "TEXT"):
        raw = _text(args[0]).lower().encode("utf-8")
        needs["body"] = True
        if name == "BODY":
            return lambda u, e: e is not None and raw in e.body_bytes().lower()
        return lambda u, e: e is not None and raw in e.raw.lower()
    if name == "MODSEQ":  # RFC 7162 3.1.5: changed at or after it
        least = int(args[0])  # type: ignore[call-overload]
        return lambda u, e: view.modseq(u) >= least or view.messages[u].modseq is None
    if name == "UID":
        ranges = wire.resolve_set(list(args[0]), view.largest(True))  # type: ignore[call-overload]
        wanted = set(view.by_uid(ranges))
        return lambda u, e: u in wanted
    if name == "SET":
        ranges = wire.resolve_set(list(args[0]), view.largest(False))  # type: ignore[call-overload]
        wanted = set(view.by_seq(ranges))
        return lambda u, e: u in wanted
    raise wire.ParseError("unknown search key")


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _address_has(entity: mime.Entity | None, name: str, needle: str) -> bool:
    """The header as written (decoded), or any of its addresses as parsed (comments gone)."""
    if _header_has(entity, name, needle):
        return True
    if entity is None or not needle:
        return False
    key = "addresses " + name
    forms = entity.derived.get(key)
    if forms is None:
        values = [str(v) for v in entity.headers.get_all(name) or []]
        forms = entity.derived[key] = tuple(f"{_decoded(display)} <{addr}>".lower() for display, addr in getaddresses(values))
    return any(needle in form for form in forms)
