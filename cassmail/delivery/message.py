"""What the delivery side reads from a queued message: its header section (hop count,
Delivered-To, the From domain), whether it needs SMTPUTF8 or 8BITMIME, and the 7-bit
downgrade for a remote that lacks 8BITMIME."""

from __future__ import annotations

import email
import email.encoders
import email.policy
import re
from email.message import Message
from email.utils import getaddresses

_HEADER_END = re.compile(rb"\r?\n\r?\n")
_FIELD = re.compile(rb"^([!-9;-~]+)[ \t]*:", re.M)


def header_section(message: bytes | bytearray | memoryview) -> bytes:
    """The header section (up to the first empty line), or the whole message when it has none,
    as bytes (of a message in a spool file's mapping too: only the header is copied)."""
    match = _HEADER_END.search(message)
    return bytes(message[: match.start() + 1] if match else message)


def fields(headers: bytes, name: str) -> list[str]:
    """The values of every header field called `name` (unfolded, decoded leniently)."""
    wanted = name.lower().encode()
    out = []
    lines = headers.replace(b"\r\n", b"\n").split(b"\n")
    current: list[bytes] | None = None
    for line in lines + [b""]:
        if line[:1] in (b" ", b"\t") and current is not None:
            current.append(line.strip())
            continue
        if current is not None:
            out.append(b" ".join(current).decode("utf-8", "replace"))
            current = None
        match = _FIELD.match(line)
        if match and match.group(1).lower() == wanted:
            current = [line[match.end() :].strip()]
    return out


def hop_count(headers: bytes) -> int:
    """Received: fields: each MTA the message passed adds one (RFC 5321 6.3 loop detection)."""
    return len(fields(headers, "Received"))


def delivered_to(headers: bytes) -> set[str]:
    """Addresses in Delivered-To: fields, lower-cased: a message that was delivered to one of
    its recipients before is coming round again."""
    return {addr.lower() for _, addr in getaddresses(fields(headers, "Delivered-To")) if addr}


def from_domain(headers: bytes) -> str | None:
    """The domain of the first From: address (what DKIM's d= should align with)."""
    found = getaddresses(fields(headers, "From"))
    for _, addr in found:
        if "@" in addr:
            return addr.rpartition("@")[2].strip().rstrip(".").lower() or None
    return None


def has_8bit(data: bytes) -> bool:
    return not data.isascii()


def needs_smtputf8(message: bytes, addresses: list[str]) -> bool:
    """UTF-8 in an address's local part or in the header section: only SMTPUTF8 carries that
    (a UTF-8 domain can be sent as IDNA A-labels instead)."""
    if has_8bit(header_section(message)):
        return True
    return any(not addr.rpartition("@")[0].isascii() for addr in addresses if addr)


def downgrade_8bit(message: bytes) -> bytes:
    """The message with every 8-bit body part re-encoded (quoted-printable for text, base64
    otherwise), for a remote without 8BITMIME (RFC 6152 3). The header section must be ASCII."""
    parsed: Message = email.message_from_bytes(message, policy=email.policy.compat32)
    for part in parsed.walk():
        if part.is_multipart():
            continue
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes) or payload.isascii():
            continue
        del part["Content-Transfer-Encoding"]
        part.set_payload(payload)
        if part.get_content_maintype() == "text":
            email.encoders.encode_quopri(part)
        else:
            email.encoders.encode_base64(part)
    if parsed.get("MIME-Version") is None:
        parsed["MIME-Version"] = "1.0"
    return parsed.as_bytes(policy=email.policy.compat32.clone(linesep="\r\n"))
