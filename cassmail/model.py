"""The nouns every layer shares: addresses, mailbox names, message ids, summaries, flags.

This module is a leaf: it imports nothing from the rest of cassmail, so the
protocols and the store backends can both depend on it.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

import uuid6


class InvalidInput(ValueError):
    """Input that no store or protocol can accept; the message says what and why."""


class InvalidAddress(InvalidInput):
    pass


class InvalidMailboxName(InvalidInput):
    pass


# --------------------------------------------------------------------------- addresses

# RFC 5322 atext plus any non-ASCII character (RFC 6531 lets UTF-8 into atoms).
_ATEXT = r"A-Za-z0-9!#$%&'*+\-/=?^_`{|}~\u0080-\U0010ffff"
_DOT_STRING = re.compile(rf"[{_ATEXT}]+(?:\.[{_ATEXT}]+)*\Z")
# Quoted-string content: printable ASCII except \ and ", or non-ASCII, or a quoted pair.
_QUOTED = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e\u0080-\U0010ffff]|\\[\x20-\x7e])*)"\Z')
_LABEL = re.compile(r"(?!-)[a-z0-9\-\u0080-\U0010ffff]{1,63}(?<!-)\Z")

#: A lone surrogate: what surrogateescape makes of bytes that are not UTF-8. No address holds one.
_SURROGATE = re.compile("[\ud800-\udfff]")

MAX_LOCAL_OCTETS = 64  # RFC 5321 4.5.3.1.1
MAX_DOMAIN_OCTETS = 255  # RFC 5321 4.5.3.1.2
MAX_PATH_OCTETS = 254  # RFC 5321 4.5.3.1.3 path (256) less the angle brackets


def normalize_domain(text: str) -> str:
    """Lower-case a domain and bring IDNA A-labels to their Unicode form.

    One spelling per domain is what lets `xn--bcher-kva.example` and
    `bücher.example` reach the same user.
    """
    domain = text.strip().rstrip(".").lower()
    if _SURROGATE.search(domain):
        raise InvalidAddress(f"invalid UTF-8 in domain {text!r}")
    if not domain:
        raise InvalidAddress("empty domain")
    if domain.startswith("["):
        raise InvalidAddress(f"address literals are not local domains: {text!r}")
    if len(domain.encode("utf-8")) > MAX_DOMAIN_OCTETS:
        raise InvalidAddress(f"domain longer than {MAX_DOMAIN_OCTETS} octets")
    labels = []
    for label in domain.split("."):
        if label.startswith("xn--"):
            try:
                label = label.encode("ascii").decode("idna")
            except UnicodeError as exc:
                raise InvalidAddress(f"invalid IDNA label {label!r} in {text!r}") from exc
        if not _LABEL.match(label):
            raise InvalidAddress(f"invalid domain {text!r}: bad label {label!r}")
        labels.append(label)
    return ".".join(labels)


@dataclass(frozen=True, slots=True)
class Address:
    """A mailbox address, parsed per RFC 5321/5322 with RFC 6531 (UTF-8) extensions.

    `key` is the one spelling stores index users by: local part and domain
    lower-cased, quoting removed where it was not needed.
    """

    local: str
    domain: str

    @classmethod
    def parse(cls, text: str) -> Address:
        if not isinstance(text, str):
            raise InvalidAddress(f"address must be text, got {type(text).__name__}")
        raw = text.strip()
        if raw.startswith("<") and raw.endswith(">"):
            raw = raw[1:-1]
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in raw):
            raise InvalidAddress(f"control character in address {text!r}")
        if _SURROGATE.search(raw):  # bytes that were not UTF-8, decoded with surrogateescape
            raise InvalidAddress(f"invalid UTF-8 in address {text!r}")
        at = raw.rfind("@")
        if at <= 0 or at == len(raw) - 1:
            raise InvalidAddress(f"not an address (need local@domain): {text!r}")
        local, domain = raw[:at], raw[at + 1 :]
        quoted = _QUOTED.match(local)
        if quoted:
            local = re.sub(r"\\(.)", r"\1", quoted.group(1))
            if not local:
                raise InvalidAddress(f"empty quoted local part in {text!r}")
        elif not _DOT_STRING.match(local):
            raise InvalidAddress(f"invalid local part {local!r} in {text!r}")
        if len(local.encode("utf-8")) > MAX_LOCAL_OCTETS:
            raise InvalidAddress(f"local part longer than {MAX_LOCAL_OCTETS} octets in {text!r}")
        address = cls(local, normalize_domain(domain))
        if len(str(address).encode("utf-8")) > MAX_PATH_OCTETS:
            raise InvalidAddress(f"address longer than {MAX_PATH_OCTETS} octets")
        return address

    @property
    def key(self) -> str:
        return f"{_quote_local(self.local.lower())}@{self.domain}"

    def __str__(self) -> str:
        return f"{_quote_local(self.local)}@{self.domain}"


def _quote_local(local: str) -> str:
    if _DOT_STRING.match(local):
        return local
    escaped = local.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def address_key(address: str | Address) -> str:
    """The canonical user key for an address given as text or parsed."""
    if isinstance(address, str):
        return _key_of(address)
    return (address if isinstance(address, Address) else Address.parse(address)).key


@functools.lru_cache(maxsize=4096)
def _key_of(text: str) -> str:
    """(Every store call names its user as text: the keys of those seen lately are kept; a
    text that is no address raises each time, as nothing is kept for it.)"""
    return Address.parse(text).key


# --------------------------------------------------------------------------- mailbox names

HIERARCHY_DELIMITER = "/"
INBOX = "INBOX"
MAX_MAILBOX_NAME_OCTETS = 255

#: The mailboxes every new user starts with, with their RFC 6154 special-use attribute.
DEFAULT_MAILBOXES: dict[str, str | None] = {
    INBOX: None,
    "Sent": "\\Sent",
    "Drafts": "\\Drafts",
    "Trash": "\\Trash",
    "Junk": "\\Junk",
    "Archive": "\\Archive",
}


def mailbox_name(text: str) -> str:
    """Validate a mailbox name and return its canonical form.

    Names are Unicode (the IMAP layer decodes modified UTF-7 before calling
    the store); `/` separates levels of hierarchy. INBOX is case-insensitive
    (RFC 3501 5.1), so every spelling of it becomes `INBOX`.
    """
    if not isinstance(text, str):
        raise InvalidMailboxName(f"mailbox name must be text, got {type(text).__name__}")
    if not text:
        raise InvalidMailboxName("empty mailbox name")
    bad = next((c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0), None)
    if bad is not None:
        raise InvalidMailboxName(f"control character {ord(bad):#04x} in mailbox name {text!r}")
    for wildcard in "*%":
        if wildcard in text:
            raise InvalidMailboxName(f"{wildcard!r} is a LIST wildcard, not allowed in mailbox name {text!r}")
    if len(text.encode("utf-8")) > MAX_MAILBOX_NAME_OCTETS:
        raise InvalidMailboxName(f"mailbox name longer than {MAX_MAILBOX_NAME_OCTETS} octets")
    parts = text.split(HIERARCHY_DELIMITER)
    if any(not p for p in parts):
        raise InvalidMailboxName(
            f"mailbox name {text!r} has an empty level (leading, trailing or doubled {HIERARCHY_DELIMITER!r})"
        )
    if any(p != p.strip() for p in parts):
        raise InvalidMailboxName(f"mailbox name {text!r} has a level that starts or ends with a space")
    if parts[0].upper() == INBOX:
        parts[0] = INBOX
    return HIERARCHY_DELIMITER.join(parts)


# --------------------------------------------------------------------------- message ids

_EPOCH_OFFSET_100NS = 0x01B21DD213814000  # 1582-10-15 to 1970-01-01 in 100 ns units
_id_lock = threading.Lock()
_last_timestamp = 0


def timeuuid_seconds(value: uuid.UUID) -> float:
    """The time of a version-1 UUID (new_message_id's), in seconds since 1970."""
    return (value.time - _EPOCH_OFFSET_100NS) / 10_000_000


def new_message_id(at: float | None = None) -> uuid.UUID:
    """A fresh version-1 (time-based) UUID, Cassandra's `timeuuid`.

    The 62 bits of clock sequence and node are random for every id, so ids
    made in the same 100 ns tick by any number of processes or hosts do not
    collide, and timestamps never go backwards inside one process.
    """
    global _last_timestamp
    now = int((time.time() if at is None else at) * 10_000_000) + _EPOCH_OFFSET_100NS
    with _id_lock:
        if at is None:
            now = max(now, _last_timestamp + 1)
            _last_timestamp = now
    rand = int.from_bytes(os.urandom(8), "big")
    clock_seq = ((rand >> 48) & 0x3FFF) | 0x8000  # with the RFC 4122 variant
    node = (rand & 0xFFFFFFFFFFFF) | 0x010000000000  # multicast bit: not a real MAC
    # (the fields of uuid.UUID(fields=...) laid out at once: time low, mid, high with version 1)
    return uuid_from_int(
        (now & 0xFFFFFFFF) << 96 | ((now >> 32) & 0xFFFF) << 80 | (((now >> 48) & 0x0FFF) | 0x1000) << 64
        | clock_seq << 48 | node
    )


def uuid_from_bytes(data: bytes, _protocol_version: int = 0) -> uuid.UUID:
    """`uuid.UUID(bytes=data)` in under half the time: its two slots set directly, without its
    checks of keywords nobody passes here. For the places that make many ids from their 16
    bytes: every uuid and timeuuid the Cassandra driver decodes (cassandra_cql makes this the
    CQL types' `deserialize`, which also passes a protocol version), a snapshot of a mailbox
    (imap.snapshots), the mbox store's index. Another length raises uuid.UUID's ValueError."""
    if len(data) != 16 or not QUICK_UUIDS:
        return uuid.UUID(bytes=bytes(data))
    value = _new_object(_UUID)
    _set_int(value, _int_from_bytes(data))
    _set_is_safe(value, _UNKNOWN_SAFETY)
    return value


def uuid_from_int(number: int) -> uuid.UUID:
    """`uuid.UUID(int=number)` for a number known to fit in 128 bits, as `uuid_from_bytes` makes it."""
    if not QUICK_UUIDS:
        return uuid.UUID(int=number)
    value = _new_object(_UUID)
    _set_int(value, number)
    _set_is_safe(value, _UNKNOWN_SAFETY)
    return value


_UUID = uuid.UUID
_UNKNOWN_SAFETY = uuid.SafeUUID.unknown
_new_object = object.__new__
_int_from_bytes = int.from_bytes
#: uuid.UUID keeps its value in two slots (its __setattr__ refuses every change); where that is
#: not so (another Python), uuid_from_bytes is uuid.UUID(bytes=...).
QUICK_UUIDS = all(type(uuid.UUID.__dict__.get(n)).__name__ == "member_descriptor" for n in ("int", "is_safe"))
if QUICK_UUIDS:
    _set_int = uuid.UUID.__dict__["int"].__set__
    _set_is_safe = uuid.UUID.__dict__["is_safe"].__set__


def message_id_time(message_id: uuid.UUID) -> datetime:
    """When a version-1 id was made (UTC)."""
    return datetime.fromtimestamp((message_id.time - _EPOCH_OFFSET_100NS) / 10_000_000, tz=timezone.utc)


def sortable_id(message_id: uuid.UUID) -> str:
    """A text rendering that sorts in arrival order (UUIDv6 of the same instant).

    Backends that name files or keys by id use it so a plain sort of the
    names is the order of arrival.
    """
    return str(uuid6.uuid1_to_uuid6(message_id))


def parse_sortable_id(text: str) -> uuid.UUID:
    """Inverse of `sortable_id`."""
    six = uuid.UUID(text)
    if six.version != 6:
        raise InvalidInput(f"not a sortable message id: {text!r}")
    h = six.int
    # v6 layout: time_high(32) time_mid(16) ver(4) time_low(12) | var+clock_seq+node(64)
    timestamp = ((h >> 96) << 28) | (((h >> 80) & 0xFFFF) << 12) | ((h >> 64) & 0x0FFF)
    low64 = h & ((1 << 64) - 1)
    v1 = (
        ((timestamp & 0xFFFFFFFF) << 96)
        | (((timestamp >> 32) & 0xFFFF) << 80)
        | (0x1 << 76)
        | (((timestamp >> 48) & 0x0FFF) << 64)
        | low64
    )
    return uuid.UUID(int=v1)


def uidl(message_id: uuid.UUID) -> str:
    """The POP3 UIDL of a message: 32 hex digits of its id, stable forever (RFC 1939: 1-70 chars 0x21-0x7E)."""
    return message_id.hex


# --------------------------------------------------------------------------- flags and summaries

SYSTEM_FLAGS = frozenset({"\\Seen", "\\Answered", "\\Flagged", "\\Deleted", "\\Draft"})
_KEYWORD = re.compile(r"[\x21-\x7e]+\Z")
_KEYWORD_SPECIALS = set('(){%*"\\]')


def flag_set(flags: object) -> frozenset[str]:
    """Validate flags: the RFC 3501 system flags (any case) and keywords (atoms)."""
    if isinstance(flags, str):
        raise InvalidInput("flags must be a collection of strings, not one string")
    out = set()
    for flag in flags:  # type: ignore[attr-defined]
        if not isinstance(flag, str) or not flag:
            raise InvalidInput(f"invalid flag {flag!r}")
        if flag.startswith("\\"):
            canon = next((s for s in SYSTEM_FLAGS if s.lower() == flag.lower()), None)
            if canon is None:
                raise InvalidInput(f"unknown system flag {flag!r}")
            out.add(canon)
        elif _KEYWORD.match(flag) and not _KEYWORD_SPECIALS.intersection(flag):
            out.add(flag)
        else:
            raise InvalidInput(f"invalid keyword {flag!r}")
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class MessageSummary:
    """What a listing returns: enough for STAT, LIST, UIDL and IMAP SELECT, never the body."""

    id: uuid.UUID
    size: int
    flags: frozenset[str]
    internal_date: datetime
    uid: int | None = None
    #: RFC 7162 MODSEQ of the message's last change (see Store.highest_modseq); None while it has
    #: no UID, since a message gets its first MODSEQ with its UID.
    modseq: int | None = None


@dataclass(frozen=True, slots=True)
class MailboxInfo:
    name: str
    uidvalidity: int
    special_use: str | None = None
    subscribed: bool = True


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a listing; `cursor` is passed back to get the next page, None at the end."""

    items: list[MessageSummary] = field(default_factory=list)
    cursor: uuid.UUID | None = None
