"""Where the WheelFS store keeps each thing, and the file names that carry its data.

Cues go where the paper's Wheemail put them, between a shared directory and the
per-user directories (`/wfs/mail/.EventualConsistency/.Site=X/.KeepTogether/
.RepSites=2/user/Mail/`): each user's directory is created with them, so each
user's files are kept together while users spread over the servers::

    <root>/cassmail-wheelfs.json                      the cue prefixes the store was created with
    <root>/cassmail/domains/<strong cues>/<domain>    one empty file per local domain
    <root>/cassmail/aliases/<strong cues>/<alias>     an alias: its address and users (JSON)
    <root>/cassmail/users/<strong cues>/<user>/       never .EventualConsistency:
        account                                       address and password hash (JSON)
        aliases/<alias>                               empty: an alias that may list this user
        boxes/<mailbox>                               mailbox id, UIDVALIDITY, special-use (JSON)
        validity/<n>                                  UIDVALIDITY values ever handed out
        uids/<mailbox id>/<uid>                       UID claims: the message id and the MODSEQ of
                                                      its numbering (exclusive create)
        modseqs/<mailbox id>/<n>                      MODSEQ claims from 2 on: the change n sequences
                                                      (a numbering, flag change or expunge; ditto)
        checkpoints/<mailbox id>                      both claim chains summed up to a point (JSON),
                                                      so a process that starts reads few claims
        recent/<mailbox id>/<mark>                    \\Recent claimed from <mark>: the next mark (ditto)
        sieve/...                                     Sieve scripts and vacation records (file_sieve)
    <root>/cassmail/queue/<strong cues>/              the outbound queue (see file_queue)
    <root>/cassmail/dkim/<strong cues>/<domain>       a domain's DKIM key (JSON)
    <root>/cassmail/mail/<mail cues>/<user>/<mailbox id>/
        body/<sid>                                    the message bytes, written once
        msg/<sid>.<size>.<date>.<flags>               empty commit marker: the message is listed
        dead/<sid>                                    tombstone: the message stays deleted
        flags/<sid>.<change sid>                      keywords a message was delivered with (JSON),
                                                      written once; stores before MODSEQs wrote every
                                                      flag change here

`<sid>` is the message id as a version-6 UUID, so a sorted listing is arrival
order; `<date>` the internal date in microseconds since 1970 and `<flags>` the
system flags it was delivered with, one letter each. A marker name carries
everything a listing needs, so STAT, LIST and SELECT read directories only.
Names may be found with a suffix (a replica merge may rename an entry): only
their leading part is read.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from cassmail.model import parse_sortable_id, sortable_id
from cassmail.store.base import encode_name

LAYOUT_FILE = "cassmail-wheelfs.json"
#: Longest file name most file systems take.
MAX_FILE_NAME = 255
MAILBOX_PARTS = ("body", "msg", "dead", "flags")

_FLAG_LETTERS = {"\\Answered": "A", "\\Deleted": "T", "\\Draft": "D", "\\Flagged": "F", "\\Seen": "S"}
_LETTER_FLAGS = {v: k for k, v in _FLAG_LETTERS.items()}
_SID = r"[0-9a-f]{8}-[0-9a-f]{4}-6[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"
_MARKER = re.compile(rf"({_SID})\.(\d+)\.(-?\d+)\.([ADFST]*)")
_LEADING_SID = re.compile(_SID)
_FLAG_RECORD = re.compile(rf"({_SID})\.({_SID})")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True, slots=True)
class Marker:
    sid: str
    size: int
    date_us: int
    flags: frozenset[str]

    @property
    def id(self) -> uuid.UUID:
        return parse_sortable_id(self.sid)

    @property
    def internal_date(self) -> datetime:
        return _EPOCH + timedelta(microseconds=self.date_us)

    def name(self) -> str:
        letters = "".join(sorted(_FLAG_LETTERS[f] for f in self.flags if f in _FLAG_LETTERS))
        return f"{self.sid}.{self.size}.{self.date_us}.{letters}"


def parse_marker(name: str) -> Marker | None:
    """The marker a listed name spells (its leading part), or None for anything else."""
    m = _MARKER.match(name)
    if m is None:
        return None
    flags = frozenset(_LETTER_FLAGS[c] for c in m.group(4))
    return Marker(m.group(1), int(m.group(2)), int(m.group(3)), flags)


def leading_sid(name: str) -> str | None:
    m = _LEADING_SID.match(name)
    return m.group(0) if m else None


def parse_flag_record_name(name: str) -> tuple[str, str] | None:
    """(message sid, change sid) of a flag change file."""
    m = _FLAG_RECORD.match(name)
    return (m.group(1), m.group(2)) if m else None


def flag_record(mode: str, flags: frozenset[str]) -> bytes:
    return json.dumps({"mode": mode, "flags": sorted(flags)}).encode() + b"\n"


def parse_flag_record(data: bytes) -> tuple[str, frozenset[str]] | None:
    """(mode, flags), or None while the record is not completely written yet."""
    if not data.endswith(b"\n"):
        return None
    try:
        record = json.loads(data)
        mode, flags = record["mode"], record["flags"]
    except (ValueError, KeyError, TypeError):
        return None
    if mode not in ("set", "add", "remove") or not isinstance(flags, list):
        return None
    return mode, frozenset(str(f) for f in flags)


def uid_claim(message_id: uuid.UUID | None, modseq: int | None = None) -> bytes:
    """A UID claim's content: the message id and the MODSEQ claim that sequences its numbering
    (just the id: a claim of a store before MODSEQs), or `-` for a claim given up (the UID is burnt)."""
    if message_id is None:
        return b"-\n"
    return f"{message_id.hex}\n".encode() if modseq is None else f"{message_id.hex} {modseq}\n".encode()


def parse_uid_claim(data: bytes) -> tuple[uuid.UUID, int] | None | bool:
    """(claimed id, MODSEQ of the numbering); None for a burnt claim; False while it is not
    completely written. A claim made before the store kept MODSEQs holds the id alone: MODSEQ 1."""
    if data == b"-\n":
        return None
    if not data.endswith(b"\n"):
        return False
    text, space, modseq = data[:-1].partition(b" ")
    if len(text) != 32 or space and not (modseq.isdigit() and len(modseq) <= 20):
        return False
    try:
        return uuid.UUID(hex=text.decode("ascii")), max(int(modseq or 1), 1)
    except ValueError:
        return False


def modseq_claim(change: dict[str, object] | None) -> bytes:
    """A MODSEQ claim's content: the change it sequences as one JSON line, or `-` for a claim
    given up (the MODSEQ is burnt: it sequences nothing)."""
    return json.dumps(change, separators=(",", ":")).encode() + b"\n" if change is not None else b"-\n"


def parse_modseq_claim(data: bytes) -> dict[str, Any] | None | bool:
    """The change; None for a claim given up; False while it is not completely written."""
    if data == b"-\n":
        return None
    if not data.endswith(b"\n"):
        return False
    try:
        change = json.loads(data)
    except ValueError:
        return False
    return change if isinstance(change, dict) and isinstance(change.get("k"), str) else False


def recent_claim(mark: int | None) -> bytes:
    """A \\Recent claim's content: the mark it raises the chain to, or `-` for a claim given up
    (nobody owns \\Recent for the one UID its name is: the chain goes on at the next)."""
    return (str(mark) if mark else "-").encode() + b"\n"


def parse_recent_claim(data: bytes) -> int | None | bool:
    """The mark a claim raises to; None for a claim given up; False while it is not completely written."""
    if data == b"-\n":
        return None
    text = data[:-1]
    if not data.endswith(b"\n") or not text.isdigit() or len(text) > 20:
        return False
    return int(text)


def file_name(text: str) -> str:
    """encode_name, refusing what no file system would take."""
    name = encode_name(text)
    if len(name.encode()) > MAX_FILE_NAME:
        raise ValueError(name)
    return name


class Layout:
    """Paths of the store (strings: the file-system layer takes str paths)."""

    def __init__(self, root: str, strong: list[str], mail: list[str]) -> None:
        self.root = root
        self.strong_components, self.mail_components = strong, mail
        base = os.path.join(root, "cassmail")
        self.domains = os.path.join(base, "domains", *strong)
        self.aliases = os.path.join(base, "aliases", *strong)
        self.users = os.path.join(base, "users", *strong)
        self.queue = os.path.join(base, "queue", *strong)
        self.dkim = os.path.join(base, "dkim", *strong)
        self.mail_root = os.path.join(base, "mail", *mail)

    def record(self) -> bytes:
        return json.dumps({"format": 1, "strong": self.strong_components, "mail": self.mail_components}).encode() + b"\n"

    def user(self, user_file: str) -> str:
        return os.path.join(self.users, user_file)

    def alias(self, alias_file: str) -> str:
        return os.path.join(self.aliases, alias_file)

    def aliases_of(self, user_file: str) -> str:
        """Where a user's reverse index of aliases lives (removed with the user)."""
        return os.path.join(self.users, user_file, "aliases")

    def user_mail(self, user_file: str) -> str:
        return os.path.join(self.mail_root, user_file)

    def mailbox(self, user_file: str, mailbox_id: str) -> str:
        return os.path.join(self.mail_root, user_file, mailbox_id)

    def uids(self, user_file: str, mailbox_id: str) -> str:
        return os.path.join(self.users, user_file, "uids", mailbox_id)

    def recent(self, user_file: str, mailbox_id: str) -> str:
        return os.path.join(self.users, user_file, "recent", mailbox_id)

    def modseqs(self, user_file: str, mailbox_id: str) -> str:
        return os.path.join(self.users, user_file, "modseqs", mailbox_id)

    def checkpoint(self, user_file: str, mailbox_id: str) -> str:
        return os.path.join(self.users, user_file, "checkpoints", mailbox_id)


def sid_of(message_id: uuid.UUID) -> str:
    return sortable_id(message_id)


__all__ = [
    "LAYOUT_FILE", "MAILBOX_PARTS", "Layout", "Marker", "file_name", "flag_record", "leading_sid", "modseq_claim",
    "parse_flag_record", "parse_flag_record_name", "parse_marker", "parse_modseq_claim", "parse_recent_claim",
    "parse_uid_claim", "recent_claim", "sid_of", "uid_claim",
]
