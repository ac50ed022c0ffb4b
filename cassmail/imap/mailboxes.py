"""Commands of the authenticated state on mailboxes: SELECT and EXAMINE, CREATE, DELETE,
RENAME, SUBSCRIBE, UNSUBSCRIBE, LIST (RFC 5258 LIST-EXTENDED, RFC 5819 LIST-STATUS, RFC 6154
SPECIAL-USE), LSUB, NAMESPACE, STATUS and APPEND."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap import condstore, wire
from cassmail.imap.errors import Bad, No
from cassmail.imap.view import MailboxView
from cassmail.logs import kv
from cassmail.model import HIERARCHY_DELIMITER, INBOX, MailboxInfo, flag_set
from cassmail.store.base import (
    MailboxExists,
    MailboxNotAllowed,
    MessageTooLarge,
    NoSuchMailbox,
    StoreUnavailable,
    Target,
)

if TYPE_CHECKING:
    from cassmail.imap.session import Session

log = logging.getLogger("cassmail.imap")


async def select(session: Session, args: c.Select) -> str:
    if args.qresync is not None and not session.qresync:
        raise Bad("SELECT (QRESYNC ...) needs ENABLE QRESYNC first")  # RFC 7162 3.2.5
    if session.view is not None:
        session.untagged(b"OK [CLOSED] Previous mailbox closed")  # RFC 7162 3.2.11
    session.close_view()  # a SELECT that fails leaves no mailbox selected (RFC 3501 6.3.1)
    if args.condstore:
        condstore.enable(session)  # with no mailbox selected: the SELECT tells its HIGHESTMODSEQ
    user = session.user
    assert user is not None
    name = session.mailbox(args.name)
    store, settings = session.store, session.settings
    info = await store.mailbox_info(user, name)
    view = MailboxView(store, user, name, info.uidvalidity, args.readonly, settings.page_size,
                       session.listener.recent_marks)
    view.condstore = session.condstore
    uid_next = await view.load(await session.listener.snapshots.get(user, name, info.uidvalidity))
    session.view, session.state = view, "selected"
    session.flags_response()
    session.untagged(b"%d EXISTS" % len(view))
    session.untagged(b"%d RECENT" % len(view.recent))
    unseen = view.first_unseen()
    if unseen is not None:
        session.untagged(b"OK [UNSEEN %d] First unseen" % unseen)
    session.untagged(b"OK [UIDVALIDITY %d] UIDs valid" % view.uidvalidity)
    session.untagged(b"OK [UIDNEXT %d] Predicted next UID" % uid_next)
    view.told = max(view.highest, 1)
    session.untagged(b"OK [HIGHESTMODSEQ %d] Highest" % view.told)  # RFC 7162 3.1.2.1: every SELECT
    if args.qresync is not None:
        await condstore.resync(session, args.qresync)
    return ("[READ-ONLY] EXAMINE" if args.readonly else "[READ-WRITE] SELECT") + " completed"


async def create(session: Session, args: c.Mailbox) -> str:
    name = session.mailbox(args.name)
    assert session.user is not None
    if name == INBOX:
        raise No("INBOX always exists", "ALREADYEXISTS")
    try:
        await session.store.create_mailbox(session.user, name)
    except MailboxExists:
        raise No("Mailbox already exists", "ALREADYEXISTS") from None
    return "CREATE completed"


async def delete(session: Session, args: c.Mailbox) -> str:
    name = session.mailbox(args.name)
    assert session.user is not None
    try:
        await session.store.delete_mailbox(session.user, name)
    except MailboxNotAllowed:
        raise No("This mailbox cannot be deleted", "CANNOT") from None
    if session.view is not None and session.view.name == name:
        session.untagged(b"BYE The selected mailbox was deleted")
        session.closing = True
    return "DELETE completed"


async def rename(session: Session, args: c.Rename) -> str:
    old, new = session.mailbox(args.old), session.mailbox(args.new)
    assert session.user is not None
    try:
        await session.store.rename_mailbox(session.user, old, new)
    except MailboxExists:
        raise No("Target mailbox exists", "ALREADYEXISTS") from None
    except MailboxNotAllowed:
        raise No("This mailbox cannot be renamed so", "CANNOT") from None
    return "RENAME completed"


async def subscribe(session: Session, args: c.Mailbox) -> str:
    assert session.user is not None
    await session.store.set_subscribed(session.user, session.mailbox(args.name), True)
    return "SUBSCRIBE completed"


async def unsubscribe(session: Session, args: c.Mailbox) -> str:
    assert session.user is not None
    await session.store.set_subscribed(session.user, session.mailbox(args.name), False)
    return "UNSUBSCRIBE completed"


async def namespace(session: Session, args: c.Simple) -> str:
    session.untagged(b'NAMESPACE (("" "/")) NIL NIL')
    return "NAMESPACE completed"


# --------------------------------------------------------------------------- LIST and LSUB


def pattern_matcher(pattern: str) -> Callable[[str], bool]:
    """A LIST pattern (`*` any, `%` any within one level) as a predicate, linear in the name
    and the pattern: the pattern is run as a set of positions over the name (no backtracking),
    so no pattern can make it slow. INBOX matches in any case (RFC 3501 5.1)."""
    if pattern[:5].upper() == INBOX and pattern[5:6] in ("", HIERARCHY_DELIMITER, "*", "%"):
        pattern = INBOX + pattern[5:]
    tokens: list[str] = []
    for ch in pattern:  # a run of wildcards is one: `*` if it has one, else `%`
        if ch in "*%" and tokens and tokens[-1] in ("*", "%"):
            if ch == "*":
                tokens[-1] = "*"
            continue
        tokens.append(ch)
    literals = sum(1 for t in tokens if t not in ("*", "%"))
    end = len(tokens)

    def closure(states: set[int]) -> set[int]:
        for s in sorted(states):  # a wildcard may match nothing: its successor is reachable too
            while s < end and tokens[s] in ("*", "%"):
                s += 1
                states.add(s)
        return states

    start = closure({0})

    def match(name: str) -> bool:
        if literals > len(name):
            return False
        states = start
        for ch in name:
            following: set[int] = set()
            for s in states:
                if s == end:
                    continue
                token = tokens[s]
                if token == "*" or (token == "%" and ch != HIERARCHY_DELIMITER):
                    following.add(s)
                elif token == ch:
                    following.add(s + 1)
            if not following:
                return False
            states = closure(following)
        return end in states

    return match


def _levels(name: str) -> list[str]:
    """The names of a mailbox's parents, outermost first."""
    levels = name.split(HIERARCHY_DELIMITER)
    return [HIERARCHY_DELIMITER.join(levels[:i]) for i in range(1, len(levels))]


def list_matches(mailboxes: list[MailboxInfo], patterns: Iterable[str], command: c.ListCommand
                 ) -> list[tuple[str, list[bytes], bytes]]:
    """(name, attributes, extended data) of each name LIST or LSUB answers, sorted.

    LIST: the mailboxes and the levels that exist only as parents of others (\\Noselect)
    matching any pattern; selection options SUBSCRIBED, SPECIAL-USE and RECURSIVEMATCH (RFC
    5258, 6154). LSUB: subscribed mailboxes, and a parent that is not subscribed but has
    subscribed children when a `%` stopped at it (\\Noselect, RFC 3501 6.3.9)."""
    boxes = {m.name: m for m in mailboxes}
    parents = {p for name in boxes for p in _levels(name)}
    subscribed = {n for n, m in boxes.items() if m.subscribed}
    matchers = [pattern_matcher(p) for p in patterns]

    def matches(name: str) -> bool:
        return any(m(name) for m in matchers)

    select, returns = command.select, command.returns
    out = []
    for name in sorted(set(boxes) | parents):
        if not matches(name):
            continue
        box = boxes.get(name)
        attrs: list[bytes] = []
        extended = b""
        if command.lsub:
            if name not in subscribed:
                if not any(s.startswith(name + HIERARCHY_DELIMITER) and not matches(s) for s in subscribed):
                    continue
                attrs.append(b"\\Noselect")  # a `%` stopped at it; its subscribed children are below
        elif "SUBSCRIBED" in select and name not in subscribed:
            if not ("RECURSIVEMATCH" in select and any(s.startswith(name + HIERARCHY_DELIMITER) for s in subscribed)):
                continue
            extended = b' ("CHILDINFO" ("SUBSCRIBED"))'
        if "SPECIAL-USE" in select and (box is None or not box.special_use):
            continue
        if box is None and not attrs:
            attrs.append(b"\\NonExistent" if "SUBSCRIBED" in select else b"\\Noselect")
        attrs.append(b"\\HasChildren" if name in parents else b"\\HasNoChildren")
        if "SUBSCRIBED" in returns and name in subscribed:
            attrs.append(b"\\Subscribed")
        if box is not None and box.special_use:
            attrs.append(box.special_use.encode())
        out.append((name, attrs, extended))
    return out


async def list_(session: Session, args: c.ListCommand) -> str:
    user = session.user
    assert user is not None
    verb = b"LSUB" if args.lsub else b"LIST"
    done = verb.decode() + " completed"
    try:
        reference = session.decode_name(args.reference)
        patterns = [reference + session.decode_name(p) for p in args.patterns]
    except wire.ParseError:
        raise No("Mailbox name is not valid " + ("UTF-8" if session.utf8 else "modified UTF-7"), "CANNOT") from None
    if patterns == [reference] and not reference:  # LIST "" "": the delimiter and the root
        if not args.lsub:
            session.untagged(b'LIST (\\Noselect) "/" ""')
        return done
    if "HIGHESTMODSEQ" in args.status:
        condstore.enable(session)  # LIST-STATUS is STATUS (RFC 7162 3.1)
    mailboxes = await session.store.list_mailboxes(user)
    for name, attrs, extended in list_matches(mailboxes, patterns, args):
        encoded = session.encode_name(name)
        session.untagged(verb + b" (" + b" ".join(attrs) + b') "/" ' + encoded + extended)
        if args.status and b"\\Noselect" not in attrs and b"\\NonExistent" not in attrs:
            try:
                await _status_response(session, name, args.status)
            except NoSuchMailbox:
                pass  # deleted meanwhile: no STATUS for it (RFC 5819 allows leaving it out)
    return done


# --------------------------------------------------------------------------- STATUS


async def _status_response(session: Session, name: str, items: tuple[str, ...]) -> None:
    user = session.user
    assert user is not None
    store = session.store
    known = session.listener.statuses.get((user, name))
    if known is not None and "RECENT" in items and "RECENT" not in known[1]:
        known = None  # (counted without \Recent)
    # RFC 7162 3.1.1 STATUS HIGHESTMODSEQ: read before the counts or with them
    token, highest, counts = await store.status_state(user, name, "RECENT" in items, "HIGHESTMODSEQ" in items,
                                                      known[0] if known is not None else None)
    if counts is None:
        assert known is not None
        values = known[1]  # nothing changed since it was counted (and \Recent was, if asked)
    else:
        info = await store.mailbox_info(user, name)
        values = {
            "MESSAGES": counts.messages,
            "SIZE": counts.size,  # STATUS=SIZE (RFC 8438)
            "UIDNEXT": counts.uid_next,
            "UIDVALIDITY": info.uidvalidity,
            "UNSEEN": counts.unseen,
            "DELETED": counts.deleted,  # RFC 9208 (and IMAP4rev2): what an EXPUNGE would remove
            # RFC 9208: what that EXPUNGE would free, in 1024-octet units like QUOTA's STORAGE
            "DELETED-STORAGE": -(-counts.deleted_size // 1024),
        }
        if counts.recent is not None:
            values["RECENT"] = counts.recent  # no session has claimed them yet
        if highest is not None:
            values["HIGHESTMODSEQ"] = highest
        if token is not None:
            session.listener.statuses.put((user, name), (token, values))
    if "HIGHESTMODSEQ" in items and "HIGHESTMODSEQ" not in values:  # counted for a STATUS without it
        values = {**values, "HIGHESTMODSEQ": highest}
    limit = store.max_message_size
    line = " ".join(f"{item} {limit or 'NIL'}" if item == "APPENDLIMIT" else f"{item} {values[item]}"
                    for item in items).encode()
    session.untagged(b"STATUS " + session.encode_name(name) + b" (" + line + b")")


async def status(session: Session, args: c.Status) -> str:
    if "HIGHESTMODSEQ" in args.items:
        condstore.enable(session)  # RFC 7162 3.1
    await _status_response(session, session.mailbox(args.name), args.items)
    return "STATUS completed"


# --------------------------------------------------------------------------- APPEND


async def append(session: Session, args: c.Append) -> str:
    user = session.user
    assert user is not None
    name = session.mailbox(args.name)
    store = session.store
    wanted = flag_set(f for f in args.flags if f.lower() != "\\recent")
    modseqs: dict[uuid.UUID, int] = {}
    view = session.view if session.view is not None and session.view.name == name else None
    recent = view.recent_claim() if view is not None else None
    try:
        appended = await store.append(args.message, Target(user, name, wanted), args.date, modseqs, recent)
    except NoSuchMailbox:
        raise No("No such mailbox", "TRYCREATE") from None
    except MessageTooLarge:
        raise No("Message too large", "TOOBIG") from None
    # The message is stored: from here on the answer is OK, with APPENDUID when the UID could be
    # had now (RFC 4315 lets a server leave it out; the store logs why it did not).
    code = ""
    try:
        if appended.uid:
            info = await store.mailbox_info(user, name)
            code = f"[APPENDUID {info.uidvalidity} {appended.uid}] "
        if view is not None and session.view is view:
            view.took(modseqs, numbered=True)
            changes = view.appended(appended, recent)
            if changes is None:
                await session.refresh(expunge=False)
            else:
                session.tell(changes, highest=False)
    except StoreUnavailable as exc:
        log.warning(kv("imap-append", user=user, mailbox=name, error=exc))
    return code + "APPEND completed"
