"""SORT and THREAD (RFC 5256; DISPLAYFROM/DISPLAYTO of RFC 5957): the messages SEARCH keys
match, ordered by header fields, or grouped into conversations.

Both read only the header of each matching message (cached by the listener like FETCH's).
Strings compare by i;unicode-casemap (case-folded); messages that compare equal keep their
mailbox order, as the RFC asks. The sent date is the Date: field in UTC, or the internal date
when the field is missing or unreadable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.header import decode_header, make_header
from email.utils import getaddresses, parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from cassmail.imap import commands as c
from cassmail.imap import condstore, mime
from cassmail.imap.search import check_charset, condstore_search, matching
from cassmail.model import MessageSummary

if TYPE_CHECKING:
    from cassmail.imap.session import Session


# ----------------------------------------------------------------------------- field values


def _header(entity: mime.Entity | None, name: str) -> str:
    if entity is None:
        return ""
    value = entity.headers.get(name)
    if value is None:
        return ""
    try:
        return str(make_header(decode_header(str(value))))
    except Exception:  # noqa: BLE001 - a broken encoded word is compared as written
        return str(value)


def _first_address(entity: mime.Entity | None, name: str) -> tuple[str, str]:
    """(display name, addr-spec) of the first address of a field; empty strings when none."""
    text = _header(entity, name)
    for display, address in getaddresses([text]):
        if address or display:
            return display, address
    return "", ""


def _mailbox_part(entity: mime.Entity | None, name: str) -> str:
    """RFC 5256's FROM/TO/CC key: the local part (addr-mailbox) of the first address."""
    address = _first_address(entity, name)[1]
    return (address.rpartition("@")[0] or address).casefold()


def _display(entity: mime.Entity | None, name: str) -> str:
    """RFC 5957's DISPLAYFROM/DISPLAYTO: the display name, else the address."""
    display, address = _first_address(entity, name)
    return (display or address).casefold()


def sent_date(entity: mime.Entity | None, summary: MessageSummary) -> datetime:
    value = _header(entity, "Date")
    if value:
        try:
            when = parsedate_to_datetime(value)
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            return when.astimezone(timezone.utc)
        except (TypeError, ValueError, IndexError, OverflowError):
            pass
    internal = summary.internal_date
    return internal if internal.tzinfo else internal.replace(tzinfo=timezone.utc)


_WSP = re.compile(r"[ \t\r\n]+")
_TRAILER = re.compile(r"(?:\s*\(fwd\))+\s*$|\s+$", re.IGNORECASE)
_BLOB = r"\[[^\[\]]*\]\s*"
_LEADER = re.compile(rf"^\s*(?:(?:{_BLOB})*(?:re|fwd?)\s*(?:{_BLOB})?:\s*)+", re.IGNORECASE)
_LEADING_BLOB = re.compile(rf"^\s*{_BLOB}")
_FWD = re.compile(r"^\[fwd:(.*)\]$", re.IGNORECASE | re.DOTALL)


def base_subject(subject: str) -> tuple[str, bool]:
    """RFC 5256 2.1: the subject without Re:, Fwd:, [list] tags and (fwd) trailers, case-folded;
    and whether anything of a reply or forward was taken off (THREAD=REFERENCES needs it)."""
    text = _WSP.sub(" ", subject)
    reply = False
    while True:
        stripped = _TRAILER.sub("", text)  # (2)
        reply |= stripped.lower() != text.rstrip().lower()
        text = stripped
        while True:  # (3), (4)
            before = text
            match = _LEADER.match(text)
            if match:
                text, reply = text[match.end():], True
            blob = _LEADING_BLOB.match(text)
            if blob and text[blob.end():].strip():
                text = text[blob.end():]
            if text == before:
                break
        forwarded = _FWD.match(text.strip())  # (6)
        if not forwarded:
            break
        text, reply = forwarded.group(1), True
    return text.strip().casefold(), reply


# ----------------------------------------------------------------------------- SORT


def _key(criterion: str, summary: MessageSummary, entity: mime.Entity | None) -> Any:
    if criterion == "ARRIVAL":
        return summary.internal_date.timestamp()
    if criterion == "DATE":
        return sent_date(entity, summary).timestamp()
    if criterion == "SIZE":
        return summary.size
    if criterion == "SUBJECT":
        return base_subject(_header(entity, "Subject"))[0]
    if criterion in ("FROM", "TO", "CC"):
        return _mailbox_part(entity, criterion.title())
    return _display(entity, "From" if criterion == "DISPLAYFROM" else "To")


async def sort(session: Session, args: c.Sort) -> str:
    check_charset(args.charset)
    view = session.selected()
    modseq = await condstore_search(session, args.program)
    found = await matching(session, args.program, headers=True)
    rows = list(enumerate(found))  # (mailbox position, (uid, summary, header))
    # Stable sorts from the last criterion to the first (Python's keeps equal keys in order
    # also when reversed): ties keep mailbox (sequence) order.
    for criterion, reverse in reversed(args.criteria):
        rows.sort(key=lambda row: _key(criterion, row[1][1], row[1][2]), reverse=reverse)
    numbers = [uid if args.uid else view.seq(uid) for _, (uid, _, _) in rows]
    highest = condstore.modseq_of(view, [uid for uid, _, _ in found]) if modseq else None
    session.untagged(b"SORT" + b"".join(b" %d" % n for n in numbers) +
                     (b" (MODSEQ %d)" % highest if highest is not None else b""))
    return ("UID " if args.uid else "") + "SORT completed"


# ----------------------------------------------------------------------------- THREAD


@dataclass(eq=False)
class Node:
    """A container of the threading algorithms: a message (its number) or a dummy (None)."""

    number: int | None = None
    date: datetime | None = None
    seq: int = 0
    subject: str = ""
    reply: bool = False
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)

    def adopt(self, child: Node) -> None:
        if child.parent is not None:
            child.parent.children.remove(child)
        child.parent = self
        self.children.append(child)

    def orphan(self) -> None:
        if self.parent is not None:
            self.parent.children.remove(self)
            self.parent = None

    def ancestor_of(self, other: Node) -> bool:
        node: Node | None = other
        while node is not None:
            if node is self:
                return True
            node = node.parent
        return False

    def first(self) -> Node:
        """The node whose message stands for this one: itself, or its first child's."""
        return self if self.number is not None or not self.children else self.children[0].first()

    def order(self) -> tuple[datetime, int]:
        leader = self.first()
        return (leader.date or datetime.min.replace(tzinfo=timezone.utc), leader.seq)


_MSG_ID = re.compile(r"<[^<>\s]+>")


def _ids(value: str) -> list[str]:
    return [m.lower() for m in _MSG_ID.findall(value or "")]


def _sort_levels(nodes: list[Node]) -> None:
    for node in nodes:
        _sort_levels(node.children)
    nodes.sort(key=Node.order)


def ordered_subject(messages: list[Node]) -> list[Node]:
    """THREAD=ORDEREDSUBJECT: one thread per base subject, its messages children of the first."""
    roots: list[Node] = []
    by_subject: dict[str, Node] = {}
    for node in sorted(messages, key=lambda n: (n.subject, n.order())):
        head = by_subject.get(node.subject)
        if head is None:
            by_subject[node.subject] = node
            roots.append(node)
        else:
            head.adopt(node)
    roots.sort(key=Node.order)
    return roots


def references(messages: list[Node], links: dict[int, tuple[str | None, list[str]]]) -> list[Node]:
    """THREAD=REFERENCES (RFC 5256 4): parents from References (or In-Reply-To), dummies for
    messages not here, then threads of one base subject merged."""
    table: dict[str, Node] = {}
    placed: list[Node] = []  # each message's own container
    for node in messages:  # (1)
        message_id, refs = links[node.seq]
        if message_id is not None and message_id in table and table[message_id].number is None:
            own = table[message_id]  # (A) a dummy made for it by an earlier reference
            own.number, own.date, own.seq = node.number, node.date, node.seq
            own.subject, own.reply = node.subject, node.reply
            node_ref = own
        else:
            node_ref = node
            if message_id is not None and message_id not in table:
                table[message_id] = node
        placed.append(node_ref)
        chain = [table.setdefault(ref, Node()) for ref in refs]
        for parent, child in zip(chain, chain[1:]):  # (B)
            if child.parent is None and parent is not child and not child.ancestor_of(parent):
                parent.adopt(child)
        last = chain[-1] if chain else None  # (C)
        if node_ref.parent is not None:
            node_ref.orphan()
        if last is not None and last is not node_ref and not node_ref.ancestor_of(last):
            last.adopt(node_ref)
    everyone = list(dict.fromkeys([*table.values(), *placed]))
    roots = [n for n in everyone if n.parent is None and (n.number is not None or n.children)]  # (2)
    roots = _prune(roots, root=True)  # (4)
    _sort_levels(roots)  # (5)
    return _group_by_subject(roots)  # (6)


def _prune(nodes: Iterable[Node], root: bool) -> list[Node]:
    out: list[Node] = []
    for node in list(nodes):
        node.children = _prune(node.children, root=False)
        for child in node.children:
            child.parent = node
        if node.number is None:
            if not node.children:
                continue
            if not root or len(node.children) == 1:
                for child in node.children:
                    child.parent = node.parent
                out.extend(node.children)
                continue
        out.append(node)
    return out


def _group_by_subject(roots: list[Node]) -> list[Node]:
    table: dict[str, Node] = {}
    for node in roots:  # (A)
        leader = node.first()
        if not leader.subject:
            continue
        old = table.get(leader.subject)
        if old is None or (node.number is None and old.number is not None) or \
                (old.first().reply and not leader.reply and old.number is not None and node.number is not None):
            table[leader.subject] = node
    out: list[Node] = []
    for node in roots:  # (B)
        leader = node.first()
        keeper = table.get(leader.subject) if leader.subject else None
        if keeper is None or keeper is node:
            out.append(node)
            continue
        if keeper.number is None and node.number is None:
            for child in list(node.children):
                keeper.adopt(child)
        elif keeper.number is None:
            keeper.adopt(node)
        elif node.number is None:  # keep the dummy, under the keeper's subject
            dummy = Node(children=[])
            _replace(out, keeper, dummy)
            table[leader.subject] = dummy
            dummy.adopt(keeper)
            for child in list(node.children):
                dummy.adopt(child)
        elif leader.reply and not keeper.first().reply:
            keeper.adopt(node)
        else:
            dummy = Node(children=[])
            _replace(out, keeper, dummy)
            table[leader.subject] = dummy
            dummy.adopt(keeper)
            dummy.adopt(node)
    _sort_levels(out)
    return out


def _replace(nodes: list[Node], old: Node, new: Node) -> None:
    for i, node in enumerate(nodes):
        if node is old:
            nodes[i] = new
            return
    nodes.append(new)  # the keeper comes later in the root list: it takes its place then


def render(node: Node) -> str:
    """A thread member and what hangs below it, as THREAD answers (RFC 5256 5)."""
    parts = [str(node.number)] if node.number is not None else []
    if len(node.children) == 1 and node.number is not None:
        parts.append(render(node.children[0]))
    elif node.children:
        parts.append("".join(f"({render(child)})" for child in node.children))
    return " ".join(parts)


async def thread(session: Session, args: c.Thread) -> str:
    check_charset(args.charset)
    view = session.selected()
    await condstore_search(session, args.program)
    nodes: list[Node] = []
    links: dict[int, tuple[str | None, list[str]]] = {}
    for uid, summary, entity in await matching(session, args.program, headers=True):
        seq = view.seq(uid)
        subject, reply = base_subject(_header(entity, "Subject"))
        node = Node(uid if args.uid else seq, sent_date(entity, summary), seq, subject, reply)
        nodes.append(node)
        own = _ids(_header(entity, "Message-ID"))
        refs = _ids(_header(entity, "References")) or _ids(_header(entity, "In-Reply-To"))[:1]
        links[seq] = (own[0] if own else None, refs)
    roots = ordered_subject(nodes) if args.algorithm == "ORDEREDSUBJECT" else references(nodes, links)
    session.untagged(b"THREAD " + "".join(f"({render(root)})" for root in roots).encode() if roots else b"THREAD")
    return ("UID " if args.uid else "") + "THREAD completed"
