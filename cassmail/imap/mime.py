"""The MIME structure of a stored message, over its raw bytes, for FETCH.

IMAP hands out parts byte-exact (BODY[1.2], BODY[2.MIME]) and describes them
(BODYSTRUCTURE, ENVELOPE), so the parser here records where every entity's
header and body lie in the original bytes instead of re-encoding anything.
Header values are read with the standard library's `email` package (quoting,
RFC 2231 parameters, folded lines). Malformed MIME never raises: a multipart
without a boundary or without any delimiter line is described as a single
part, the way mail clients show it.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass, field
from email import utils as email_utils
from email.message import Message
from email.parser import BytesHeaderParser
from email.policy import compat32
from typing import Any

from cassmail.imap.wire import NIL, Run

#: Nesting deeper than this (multipart in message/rfc822 in multipart ...) is shown as opaque data.
MAX_DEPTH = 32

_LINE_END = re.compile(rb"\r?\n")
_BLANK_LINE = re.compile(rb"\n(\r?\n)")
_header_parser = BytesHeaderParser(policy=compat32)


@dataclass
class Entity:
    """One MIME entity: raw[start:body] is its header block, raw[body:end] its body."""

    raw: bytes
    start: int
    body: int
    end: int
    headers: Message
    parts: list[Entity] = field(default_factory=list)
    message: Entity | None = None  # the encapsulated message of a message/rfc822 part
    #: Values derived from the header once and kept with the entity while the worker keeps it
    #: (SEARCH's decoded field texts, by a key of the deriver's).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def content_type(self) -> tuple[str, str]:
        maintype, _, subtype = _content_type(self.headers).partition("/")
        return maintype, subtype

    def header_bytes(self) -> bytes:
        return self.raw[self.start : self.body]

    def body_bytes(self) -> bytes:
        return self.raw[self.body : self.end]


def _content_type(headers: Message) -> str:
    value = headers.get("content-type")
    if value is None:
        return headers.get_default_type()
    ctype = str(value).split(";", 1)[0].strip().lower()
    if ctype.count("/") != 1 or not all(ctype.split("/")):
        return "text/plain"  # RFC 2045 5.2: an invalid Content-Type means text/plain
    return ctype


def parse(raw: bytes) -> Entity:
    """The entity tree of a whole message."""
    return _entity(raw, 0, len(raw), "text/plain", 0)


def _entity(raw: bytes, start: int, end: int, default_type: str, depth: int) -> Entity:
    header_end, body = _header_end(raw, start, end)
    headers = _header_parser.parsebytes(raw[start:header_end] + b"\r\n")
    if default_type != "text/plain" and headers.get("content-type") is None:
        headers.set_default_type(default_type)
    entity = Entity(raw, start, body, end, headers)
    if depth >= MAX_DEPTH:
        return entity
    maintype, subtype = entity.content_type
    if maintype == "multipart":
        boundary = headers.get_param("boundary", header="content-type")
        if isinstance(boundary, tuple):
            boundary = email_utils.collapse_rfc2231_value(boundary)
        if boundary:
            child_type = "message/rfc822" if subtype == "digest" else "text/plain"
            entity.parts = [_entity(raw, s, e, child_type, depth + 1) for s, e in _parts(raw, body, end, str(boundary))]
    elif (maintype, subtype) == ("message", "rfc822") and _encoding(headers) in ("7bit", "8bit", "binary"):
        entity.message = _entity(raw, body, end, "text/plain", depth + 1)
    return entity


def _header_end(raw: bytes, start: int, end: int) -> tuple[int, int]:
    """Where the header fields end and where the body starts (after the blank line)."""
    for blank in (b"\r\n", b"\n"):
        if raw.startswith(blank, start, end):
            return start, start + len(blank)  # no header fields at all
    m = _BLANK_LINE.search(raw, start, end)
    if m is None:
        return end, end  # all header, no body
    return m.start(1), m.end()


def _parts(raw: bytes, start: int, end: int, boundary: str) -> list[tuple[int, int]]:
    """The body parts of a multipart. A boundary parameter folded over lines is unfolded
    (RFC 5322 2.2.3: the line break goes, the white space after it stays); where the body's
    delimiter lines were written without that white space, they are found that way."""
    unfolded = _FOLD.sub("", boundary)
    for candidate in dict.fromkeys((unfolded, _FOLD_WSP.sub("", boundary))):
        parts = _split(raw, start, end, candidate.encode("utf-8", "surrogateescape"))
        if parts:
            return parts
    return []


_FOLD = re.compile(r"\r?\n")
_FOLD_WSP = re.compile(r"\r?\n[ \t]*")


def _split(raw: bytes, start: int, end: int, boundary: bytes) -> list[tuple[int, int]]:
    """(start, end) of each body part between the delimiter lines of `boundary` (RFC 2046 5.1.1)."""
    delimiter = re.compile(rb"(?:\A|(?<=\n))--" + re.escape(boundary) + rb"(--)?[ \t]*(?:\r?\n|\Z)")
    parts: list[tuple[int, int]] = []
    part_start: int | None = None
    pos = start
    while True:
        m = delimiter.search(raw, pos, end)
        if m is None:
            break
        if part_start is not None:
            # the line end before a delimiter belongs to the delimiter
            stop = m.start()
            if raw[stop - 2 : stop] == b"\r\n" and stop - 2 >= part_start:
                stop -= 2
            elif raw[stop - 1 : stop] == b"\n" and stop - 1 >= part_start:
                stop -= 1
            parts.append((part_start, stop))
        if m.group(1):  # the close delimiter: what follows is the epilogue
            part_start = None
            break
        part_start = m.end()
        pos = m.end()
    if part_start is not None:  # no close delimiter: the last part runs to the end
        parts.append((part_start, end))
    return parts


def _encoding(headers: Message) -> str:
    return str(headers.get("content-transfer-encoding", "7bit")).strip().lower() or "7bit"


# --------------------------------------------------------------------------- sections


class NoSuchPart(LookupError):
    """A section number the message does not have: the FETCH item is sent empty."""


def part(top: Entity, path: tuple[int, ...]) -> Entity:
    """The entity a section's part numbers name (RFC 3501 6.4.5), seen as a body part.

    A message's parts are its multipart's parts, or, when it is not multipart, just one: its
    own body (so part 1 of a message/rfc822 message is the message it encapsulates). Going
    below a message/rfc822 part goes into the message it holds."""
    node, in_message = top, True
    for number in path:
        if not in_message and node.message is not None:
            node, in_message = node.message, True
        if node.parts:
            if not 1 <= number <= len(node.parts):
                raise NoSuchPart(number)
            node = node.parts[number - 1]
        elif not in_message or number != 1:
            raise NoSuchPart(number)
        in_message = False
    return node


class UnknownEncoding(ValueError):
    """A part's Content-Transfer-Encoding that BINARY cannot decode."""


def binary(top: Entity, path: tuple[int, ...]) -> bytes:
    """BINARY[path] (RFC 3516): a leaf part's content with its Content-Transfer-Encoding
    undone; a whole message, a multipart or a message/rfc822 part (never encoded) as stored;
    empty for a part the message lacks. Raises UnknownEncoding."""
    if not path:
        return top.raw[top.start : top.end]
    try:
        node = part(top, path)
    except NoSuchPart:
        return b""
    body = node.body_bytes()
    if node.parts or node.message is not None:
        return body
    encoding = str(node.headers.get("Content-Transfer-Encoding", "")).strip().lower()
    if encoding in ("", "7bit", "8bit", "binary"):
        return body
    if encoding == "base64":  # leniently, as mail readers do: stray bytes and padding ignored
        letters = re.sub(rb"[^A-Za-z0-9+/]", b"", body)
        letters = letters[:-1] if len(letters) % 4 == 1 else letters + b"=" * (-len(letters) % 4)
        return binascii.a2b_base64(letters)
    if encoding == "quoted-printable":
        return binascii.a2b_qp(body)
    raise UnknownEncoding(encoding)


def section(top: Entity, path: tuple[int, ...], text: str | None, fields: tuple[str, ...] = ()) -> bytes:
    """The bytes of BODY[path.text] exactly as stored; empty for a part the message lacks.
    HEADER and TEXT of a part are those of the message a message/rfc822 part holds."""
    if not path:
        message: Entity | None = top
    else:
        try:
            node = part(top, path)
        except NoSuchPart:
            return b""
        if text is None:
            return node.body_bytes()
        if text == "MIME":
            return node.header_bytes()
        message = node.message
    if message is None:
        return b""
    if text is None:
        return message.raw[message.start : message.end]
    if text == "TEXT":
        return message.body_bytes()
    header = message.header_bytes()
    if text == "HEADER":
        return header
    return header_fields(header, list(fields), text == "HEADER.FIELDS.NOT")


def header_fields(header: bytes, names: list[str], negate: bool) -> bytes:
    """HEADER.FIELDS / HEADER.FIELDS.NOT: the matching fields exactly as stored, then a blank line."""
    wanted = {n.lower() for n in names}
    out: list[bytes] = []
    keep = False
    for line in header.splitlines(keepends=True):
        if line in (b"\r\n", b"\n"):
            break
        if line[:1] in (b" ", b"\t"):
            if keep:
                out.append(line)
            continue
        name = line.split(b":", 1)[0].strip().decode("ascii", "replace").lower()
        keep = (name in wanted) != negate
        if keep:
            out.append(line)
    data = b"".join(out)
    if data and not data.endswith(b"\n"):
        data += b"\r\n"
    return data + b"\r\n"


# --------------------------------------------------------------------------- ENVELOPE and BODYSTRUCTURE


def _value(headers: Message, name: str) -> bytes | None:
    value = headers.get(name)
    if value is None:
        return None
    text = " ".join(str(value).split("\r\n")).replace("\n", " ").strip()
    return text.encode("utf-8", "surrogateescape")


def _addresses(headers: Message, name: str) -> Any:
    """An address list as ENVELOPE gives it: (name adl mailbox host) per address, and RFC 3501's
    group markers, (NIL NIL "group" NIL) before a group's members and (NIL NIL NIL NIL) after."""
    values = headers.get_all(name)
    if not values:
        return None
    out: list[Any] = []
    for value in values:
        for kind, text in _address_items(" ".join(str(value).splitlines())):
            if kind == "start":
                out.append([None, None, text.strip() or None, None])
            elif kind == "end":
                out.append([None, None, None, None])
            else:
                out.extend(_mailboxes(text))
    return Run(out) if out else None


def _mailboxes(text: str) -> list[list[Any]]:
    out = []
    for display, addr in email_utils.getaddresses([text]):
        if not addr and not display:
            continue
        display = display.strip()
        if display.startswith("(") or not display:  # only comments, no display name
            display = ""
        mailbox, _, host = addr.rpartition("@") if "@" in addr else (addr, "", "")
        out.append([display or None, None, mailbox or None, host or None])
    return out


def _address_items(value: str) -> list[tuple[str, str]]:
    """An address-list cut at its top level (outside quotes, comments and angle brackets):
    ("start", group name), ("end", ""), ("mailbox", text) in order."""
    items: list[tuple[str, str]] = []
    current: list[str] = []
    depth, quoted, angle, escaped = 0, False, False, False
    in_group = False
    for ch in value:
        if escaped:
            escaped = False
        elif ch == "\\" and (quoted or depth):
            escaped = True
        elif quoted:
            quoted = ch != '"'
        elif ch == '"' and not depth:
            quoted = True
        elif ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif depth:
            pass
        elif ch == "<":
            angle = True
        elif ch == ">":
            angle = False
        elif not angle and ch == ":" and not in_group:
            items.append(("start", "".join(current)))
            current, in_group = [], True
            continue
        elif not angle and ch == ";" and in_group:
            items.append(("mailbox", "".join(current)))
            items.append(("end", ""))
            current, in_group = [], False
            continue
        elif not angle and ch == ",":
            items.append(("mailbox", "".join(current)))
            current = []
            continue
        current.append(ch)
    items.append(("mailbox", "".join(current)))
    if in_group:  # a group never closed: closed here, so the markers pair up
        items.append(("end", ""))
    return [(kind, text) for kind, text in items if kind != "mailbox" or text.strip()]


def envelope(headers: Message) -> list[Any]:
    """ENVELOPE (RFC 3501 7.4.2): strings as in the header, encoded words left encoded."""
    sender_from = _addresses(headers, "from")
    return [
        _value(headers, "date"),
        _value(headers, "subject"),
        sender_from,
        _addresses(headers, "sender") or sender_from,
        _addresses(headers, "reply-to") or sender_from,
        _addresses(headers, "to"),
        _addresses(headers, "cc"),
        _addresses(headers, "bcc"),
        _value(headers, "in-reply-to"),
        _value(headers, "message-id"),
    ]


def _params(headers: Message, name: str) -> Any:
    if headers.get(name) is None:
        return None
    try:
        params = headers.get_params(header=name) or []
    except Exception:  # noqa: BLE001 - the email package raises many things on broken headers
        return None
    out: list[Any] = []
    for key, value in params[1:]:
        if isinstance(value, tuple):
            value = email_utils.collapse_rfc2231_value(value)
        out += [key, email_utils.unquote(str(value))]
    return out or None


def _disposition(headers: Message) -> Any:
    value = headers.get("content-disposition")
    if value is None:
        return None
    kind = str(value).split(";", 1)[0].strip()
    return [kind, _params(headers, "content-disposition")] if kind else None


def _lines(data: bytes) -> int:
    return len(_LINE_END.findall(data)) + (1 if data and not data.endswith(b"\n") else 0)


def bodystructure(entity: Entity, extended: bool = True) -> list[Any]:
    """BODYSTRUCTURE (or BODY without `extended`) of an entity, as a value for wire.encode."""
    headers = entity.headers
    maintype, subtype = entity.content_type
    if entity.parts:
        out: list[Any] = [Run([bodystructure(p, extended) for p in entity.parts], parens=False)]
        out.append(subtype)
        if extended:
            out += [_params(headers, "content-type"), _disposition(headers),
                    _value(headers, "content-language"), _value(headers, "content-location")]
        return out
    if maintype == "multipart":  # no boundary or no delimiter: shown as what it is, a text
        maintype, subtype = "text", "plain"
    params = _params(headers, "content-type")
    if params is None and maintype == "text":
        params = ["charset", "us-ascii"]
    body = entity.body_bytes()
    out = [
        maintype, subtype, params, _value(headers, "content-id"), _value(headers, "content-description"),
        _value(headers, "content-transfer-encoding") or "7BIT", len(body),
    ]
    if entity.message is not None:
        out += [envelope(entity.message.headers), bodystructure(entity.message, extended), _lines(body)]
    elif maintype == "text":
        out.append(_lines(body))
    if extended:
        out += [_value(headers, "content-md5"), _disposition(headers),
                _value(headers, "content-language"), _value(headers, "content-location")]
    return out


__all__ = ["NIL", "Entity", "NoSuchPart", "bodystructure", "envelope", "header_fields", "parse", "part", "section"]
