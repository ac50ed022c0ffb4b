"""The rspamd client: one message to rspamd's normal worker over its HTTP protocol (`POST
/checkv2`), its action turned into what the MX does.

rspamd's actions and ours: "no action" accepts; "add header" and "rewrite subject" mark the
message as spam (`X-Spam-Flag: YES`; "rewrite subject" also puts rspamd's new Subject in place),
and the caller files it into Junk or only marks it (`inbound.rspamd_file_junk`); "greylist" and
"soft reject" answer 451 (the sender retries later); "reject" answers 550. Every checked message
gets X-Spam-Status, X-Spam-Score and X-Spam-Action. One connection per message (`Connection:
close`): rspamd's answer is small and the connection costs little on a local network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from cassmail.inbound.authcheck import header_fields, split_header

log = logging.getLogger("cassmail.inbound")

#: Largest answer read from rspamd (its JSON with every symbol is a few KB).
MAX_REPLY = 1 << 20
#: Headers a sender could forge to look filtered: removed from incoming mail when rspamd is on.
SPAM_HEADERS = (b"x-spam-status", b"x-spam-score", b"x-spam-action", b"x-spam-flag")
#: Most bytes the X-Spam-* fields take (scores are clamped, the action name cut): the SIZE
#: advertised leaves room for them.
SPAM_FIELDS_MAX = 512
#: Most bytes a rewritten Subject may add to the message; rspamd's subject is not used when it
#: would add more (or make a line longer than RFC 5322 allows), and the message keeps its own.
SUBJECT_GROWTH_MAX = 512
#: Scores written into the fields are clamped to +-SCORE_MAX.
SCORE_MAX = 99999.0
#: RFC 5322's limit on a line, CRLF not counted.
LINE_MAX = 998


class SpamFilterUnavailable(Exception):
    """rspamd did not answer, or answered something that is not a verdict."""


@dataclass
class SpamResult:
    action: str
    score: float
    required: float
    symbols: list[str]
    #: The Subject rspamd wants for "rewrite subject" (already MIME-encoded by rspamd), or None.
    subject: str | None = None

    def verdict(self) -> tuple[str, str]:
        """(verdict, SMTP reply) as the handler wants it: reject, tempfail, junk or accept."""
        if self.action == "reject":
            return "reject", "550 5.7.1 Message rejected as spam"
        if self.action in ("soft reject", "greylist"):
            return "tempfail", "451 4.7.1 Message deferred by the spam filter, try again later"
        if self.action in ("add header", "rewrite subject"):
            return "junk", ""
        return "accept", ""

    def headers(self) -> bytes:
        """The X-Spam-* fields, at most SPAM_FIELDS_MAX bytes."""
        spam = self.action in ("add header", "rewrite subject", "reject", "soft reject")
        score, required = _clamp(self.score), _clamp(self.required)
        lines = [
            f"X-Spam-Status: {'Yes' if spam else 'No'}, score={score:.2f} required={required:.2f}",
            f"X-Spam-Score: {score:.2f}",
            f"X-Spam-Action: {_clean(self.action)[:64]}",
        ]
        if spam:
            lines.append("X-Spam-Flag: YES")
        return ("\r\n".join(lines) + "\r\n").encode("ascii", "replace")


class Rspamd:
    """rspamd's normal worker at `url` (http://host:port)."""

    def __init__(self, url: str, password: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        self.host, self.port = parts.hostname, parts.port or 11333
        self.path = (parts.path.rstrip("/") or "") + "/checkv2"
        self.password, self.timeout = password, timeout

    async def check(self, message: bytes, ip: str, helo: str, sender: str, recipients: list[str],
                    queue_id: str) -> SpamResult:
        """rspamd's verdict on a message, or SpamFilterUnavailable."""
        try:
            return await asyncio.wait_for(self._ask(message, ip, helo, sender, recipients, queue_id), self.timeout)
        except TimeoutError:
            raise SpamFilterUnavailable(f"no answer from rspamd in {self.timeout:.0f} s") from None
        except OSError as exc:
            raise SpamFilterUnavailable(f"rspamd at {self.host}:{self.port}: {exc}") from None

    async def _ask(self, message: bytes, ip: str, helo: str, sender: str, recipients: list[str],
                   queue_id: str) -> SpamResult:
        fields = [("Host", f"{self.host}:{self.port}"), ("Content-Length", str(len(message))),
                  ("Connection", "close"), ("IP", ip), ("Queue-Id", queue_id), ("From", sender or "<>")]
        if helo:
            fields.append(("Helo", helo))
        fields.extend(("Rcpt", rcpt) for rcpt in recipients)
        if self.password:
            fields.append(("Password", self.password))
        return _parse(await post(self.host, self.port, self.path, fields, message))


async def post(host: str, port: int, path: str, fields: list[tuple[str, str]], body: bytes | bytearray) -> bytes:
    """One HTTP/1.1 POST to rspamd (`fields` are the request's headers) and its whole answer,
    status line and headers included. Raises SpamFilterUnavailable and OSError."""
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {_clean(v)}\r\n" for k, v in fields) + "\r\n"
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head.encode("utf-8"))
        writer.write(body)
        await writer.drain()
        try:
            reply_head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise SpamFilterUnavailable(f"rspamd's answer has no header end: {exc}") from None
        length = _content_length(reply_head)
        if length is not None and length <= MAX_REPLY:
            reply_body = await reader.readexactly(length)
        else:
            reply_body = await reader.read(MAX_REPLY)
    except asyncio.IncompleteReadError as exc:
        raise SpamFilterUnavailable(f"rspamd's answer was cut short: {exc}") from None
    finally:
        writer.close()
    return reply_head + reply_body


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return None


def _parse(reply: bytes) -> SpamResult:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or not status[0].startswith(b"HTTP/") or status[1] != b"200":
        raise SpamFilterUnavailable(f"rspamd answered {head[:100]!r}")
    length = _content_length(head)
    if length is not None:
        body = body[:length]
    try:
        data = json.loads(body)
        action = str(data["action"])
        score = float(data.get("score", 0.0))
        required = float(data.get("required_score", 0.0))
        symbols = sorted(data.get("symbols", {}))
        subject = data.get("subject")
    except (ValueError, KeyError, TypeError) as exc:
        raise SpamFilterUnavailable(f"rspamd's answer is not a verdict: {exc}") from None
    return SpamResult(action, score, required, symbols, subject if isinstance(subject, str) else None)


def _clamp(score: float) -> float:
    """A score as the fields write it: finite and at most SCORE_MAX either way."""
    return max(-SCORE_MAX, min(SCORE_MAX, score)) if math.isfinite(score) else 0.0


def rewrite_subject(message: bytes, subject: str) -> bytes | None:
    """The message with its Subject replaced by rspamd's (one is added at the top when it has
    none), or None when that would add more than SUBJECT_GROWTH_MAX bytes or make a line
    longer than LINE_MAX: the message then keeps its Subject."""
    value = "".join(c for c in subject if c.isprintable()).strip()
    field = b"Subject: " + value.encode("utf-8", "ignore") + b"\r\n"
    if len(field) - 2 > LINE_MAX:
        return None
    block, rest = split_header(message)
    fields = header_fields(block)
    for n, raw in enumerate(fields):
        name, colon, _ = raw.partition(b":")
        if colon and name.strip().lower() == b"subject":
            if len(field) - len(raw) > SUBJECT_GROWTH_MAX:
                return None
            return b"".join(fields[:n]) + field + b"".join(fields[n + 1:]) + rest
    return field + message if len(field) <= SUBJECT_GROWTH_MAX else None


def _clean(value: str) -> str:
    """A value safe in an HTTP header line (no line breaks, bounded)."""
    return "".join(c for c in value if c.isprintable())[:512]
