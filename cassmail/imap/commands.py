"""IMAP commands as typed values: what `parse` builds from a client's bytes and the command
modules act on. Names and strings stay bytes until a command decides what they mean (a mailbox
name is modified UTF-7, a password is UTF-8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Union

#: A sequence set as ranges, None standing for `*` (resolved against the view when run).
SequenceSet = tuple[tuple[int | None, int | None], ...]


@dataclass(frozen=True, slots=True)
class Simple:
    """A command without arguments: CAPABILITY, NOOP, LOGOUT, STARTTLS, NAMESPACE, IDLE, CHECK,
    CLOSE, UNSELECT, EXPUNGE."""


@dataclass(frozen=True, slots=True)
class Id:
    params: tuple[tuple[bytes, bytes | None], ...] | None


@dataclass(frozen=True, slots=True)
class Login:
    user: bytes
    password: bytes


@dataclass(frozen=True, slots=True)
class Authenticate:
    mechanism: str
    initial: bytes | None  # SASL-IR (RFC 4959): the first response on the command line


@dataclass(frozen=True, slots=True)
class Compress:
    mechanism: str


@dataclass(frozen=True, slots=True)
class Enable:
    capabilities: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Mailbox:
    """CREATE, DELETE, SUBSCRIBE, UNSUBSCRIBE: one mailbox name."""

    name: bytes


@dataclass(frozen=True, slots=True)
class QResync:
    """SELECT's QRESYNC parameter (RFC 7162 3.2.5): what the client knew of the mailbox, its
    UIDs when it says (None: all up to its last), and its sequence match data (sequence numbers
    and the UIDs it had at them, paired in order)."""

    uidvalidity: int
    modseq: int
    known_uids: SequenceSet | None = None
    seq_match: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class Select:
    name: bytes
    readonly: bool
    #: RFC 7162 SELECT parameters: (CONDSTORE) and (QRESYNC (...)).
    condstore: bool = False
    qresync: QResync | None = None


@dataclass(frozen=True, slots=True)
class Rename:
    old: bytes
    new: bytes


@dataclass(frozen=True, slots=True)
class ListCommand:
    """LIST (with RFC 5258 LIST-EXTENDED options) and LSUB."""

    reference: bytes
    patterns: tuple[bytes, ...]
    select: frozenset[str] = frozenset()
    returns: frozenset[str] = frozenset()
    status: tuple[str, ...] = ()
    lsub: bool = False


@dataclass(frozen=True, slots=True)
class Status:
    name: bytes
    items: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Append:
    name: bytes
    flags: tuple[str, ...]
    date: datetime | None
    message: bytes


@dataclass(frozen=True, slots=True)
class Expunge:
    """EXPUNGE, or UID EXPUNGE with its set."""

    uids: SequenceSet | None = None


@dataclass(frozen=True, slots=True)
class Section:
    """A BODY[...] section (RFC 3501 6.4.5): part numbers, then HEADER, HEADER.FIELDS,
    HEADER.FIELDS.NOT, TEXT or MIME (or nothing), and the header field names."""

    part: tuple[int, ...] = ()
    text: str | None = None
    fields: tuple[str, ...] = ()

    def spec(self) -> bytes:
        """The section as a response names it: `1.2.HEADER.FIELDS (FROM TO)`."""
        out = ".".join(str(n) for n in self.part)
        if self.text:
            out += ("." if out else "") + self.text
        if self.text in ("HEADER.FIELDS", "HEADER.FIELDS.NOT"):
            out += " (" + " ".join(self.fields) + ")"
        return out.encode("ascii", "replace")


@dataclass(frozen=True, slots=True)
class FetchAtt:
    """One FETCH item. `name` is the item as answered: FLAGS, UID, INTERNALDATE, RFC822.SIZE,
    ENVELOPE, BODYSTRUCTURE, BODY (the structure), RFC822, RFC822.HEADER, RFC822.TEXT, or BODY
    with a `section` (peek: BODY.PEEK); BINARY and BINARY.SIZE with a section of part numbers
    (RFC 3516; peek: BINARY.PEEK); MODSEQ (RFC 7162)."""

    name: str
    section: Section | None = None
    partial: tuple[int, int] | None = None
    peek: bool = False

    def response_name(self) -> bytes:
        if self.section is None:
            return self.name.encode("ascii")
        out = b"%s[%s]" % (self.name.encode("ascii"), self.section.spec())
        if self.partial is not None:
            out += b"<%d>" % self.partial[0]
        return out

    @property
    def sets_seen(self) -> bool:
        """Reading the content marks the message \\Seen (RFC 3501 6.4.5), unless it is a PEEK."""
        return (self.section is not None and not self.peek and self.name != "BINARY.SIZE") or \
            self.name in ("RFC822", "RFC822.TEXT")


@dataclass(frozen=True, slots=True)
class Fetch:
    messages: SequenceSet
    atts: tuple[FetchAtt, ...]
    uid: bool = False
    #: RFC 7162 modifiers: (CHANGEDSINCE n) and, with UID FETCH, VANISHED.
    changedsince: int | None = None
    vanished: bool = False


@dataclass(frozen=True, slots=True)
class Store:
    messages: SequenceSet
    mode: str  # set, add, remove
    silent: bool
    flags: tuple[str, ...]
    uid: bool = False
    #: RFC 7162 (UNCHANGEDSINCE n): only messages whose MODSEQ is at most n are changed.
    unchangedsince: int | None = None


@dataclass(frozen=True, slots=True)
class Copy:
    """COPY and MOVE."""

    messages: SequenceSet
    name: bytes
    move: bool
    uid: bool = False


# --------------------------------------------------------------------------- SEARCH


@dataclass(frozen=True, slots=True)
class Key:
    """A search key with its arguments: `("FROM", "anne")`, `("SEEN",)`, `("LARGER", 100)`,
    `("UID", set)`, `("SET", set)` for a bare sequence set, `("SINCE", date)`, `("MODSEQ", n)`
    (RFC 7162; an entry name and type given with it are read and left aside)."""

    name: str
    args: tuple[object, ...] = ()


@dataclass(frozen=True, slots=True)
class And:
    keys: tuple[SearchKey, ...]


@dataclass(frozen=True, slots=True)
class Or:
    left: SearchKey
    right: SearchKey


@dataclass(frozen=True, slots=True)
class Not:
    key: SearchKey


SearchKey = Union[Key, And, Or, Not]


@dataclass(frozen=True, slots=True)
class Search:
    charset: str | None
    program: And
    uid: bool = False
    #: ESEARCH's RETURN options (MIN, MAX, COUNT, ALL); None for a plain SEARCH.
    returns: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Sort:
    """SORT (RFC 5256, with RFC 5957's DISPLAYFROM and DISPLAYTO): (criterion, reversed) pairs."""

    criteria: tuple[tuple[str, bool], ...]
    charset: str
    program: And
    uid: bool = False


@dataclass(frozen=True, slots=True)
class Thread:
    algorithm: str  # ORDEREDSUBJECT or REFERENCES
    charset: str
    program: And
    uid: bool = False


@dataclass(frozen=True, slots=True)
class GetQuota:
    """GETQUOTA (RFC 9208): a quota root's name. (GETQUOTAROOT takes a `Mailbox`.)"""

    root: bytes


@dataclass(frozen=True, slots=True)
class SetQuota:
    """SETQUOTA (RFC 9208): a quota root and (resource name, limit) pairs."""

    root: bytes
    limits: tuple[tuple[str, int], ...]


Args = Union[Simple, Id, Login, Authenticate, Compress, Enable, Mailbox, Select, Rename, ListCommand, Status, Append,
             Expunge, Fetch, Store, Copy, Search, Sort, Thread, GetQuota, SetQuota]


@dataclass(frozen=True, slots=True)
class Command:
    """A parsed command: its tag, its name (upper case, `UID FETCH` as FETCH with uid set in
    the arguments) and its typed arguments."""

    tag: bytes
    name: str
    args: Args = field(default_factory=Simple)
