"""Delivery status notifications (RFC 3464): what the sender gets when mail could not be
delivered (Action: failed) or is still waiting (Action: delayed), as a multipart/report with
a human-readable part, the machine-readable delivery-status and the original headers
(text/rfc822-headers). Sent from the null sender `<>`, so a DSN never makes another."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from email.utils import format_datetime, formatdate
from datetime import datetime, timezone

from cassmail.delivery.message import header_section


@dataclass(frozen=True)
class Failure:
    """One recipient the report is about: its address, the enhanced status code, the reply
    that decided it (or cassmail's own reason) and the remote that gave it."""

    address: str
    status: str
    reply: str
    remote: str = ""


def status_of(reply: str, default: str) -> str:
    """The enhanced status code in a reply ("550 5.1.1 ..."), else one derived from its basic
    code, else `default`."""
    parts = reply.split()
    if len(parts) > 1 and parts[1].count(".") == 2 and parts[1][0] in "245":
        return parts[1]
    if parts and parts[0][:1] in "45" and parts[0].isdigit():
        return f"{parts[0][0]}.0.0"
    return default


def build(
    reporting_mta: str, sender: str, original: bytes, failures: Sequence[Failure], *, delayed: bool,
    arrival: float, retry_until: float | None = None,
) -> bytes:
    """The DSN message for `sender` about `failures` of `original`."""
    boundary = f"=_dsn_{uuid.uuid4().hex}"
    now = datetime.now(timezone.utc)
    message_id = f"<{uuid.uuid4().hex}@{reporting_mta}>"
    if delayed:
        subject = "Delayed Mail (still being retried)"
        intro = ("This is the mail system at host {mta}.\r\n\r\nYour message could not be delivered yet to the "
                 "recipients below. The mail system will keep trying until {until}; you do not need to send it "
                 "again.\r\n").format(mta=reporting_mta, until=formatdate(retry_until or time.time(), usegmt=True))
    else:
        subject = "Undelivered Mail Returned to Sender"
        intro = (f"This is the mail system at host {reporting_mta}.\r\n\r\nYour message could not be delivered to "
                 "one or more recipients. It is attached below (its header only).\r\n")
    human = intro + "\r\n" + "".join(f"<{f.address}>: {f.reply or f.status}\r\n" for f in failures)
    per_message = [f"Reporting-MTA: dns; {reporting_mta}",
                   f"Arrival-Date: {formatdate(arrival, usegmt=True)}"]
    blocks = ["\r\n".join(per_message)]
    for f in failures:
        lines = [f"Final-Recipient: rfc822; {f.address}", f"Action: {'delayed' if delayed else 'failed'}",
                 f"Status: {f.status}"]
        if f.remote:
            lines.append(f"Remote-MTA: dns; {f.remote.split('[')[0]}")
        if f.reply:
            lines.append(f"Diagnostic-Code: smtp; {_one_line(f.reply)}")
        lines.append(f"Last-Attempt-Date: {format_datetime(now)}")
        if delayed and retry_until:
            lines.append(f"Will-Retry-Until: {formatdate(retry_until, usegmt=True)}")
        blocks.append("\r\n".join(lines))
    status = "\r\n\r\n".join(blocks) + "\r\n"
    head = [
        f"From: Mail Delivery System <MAILER-DAEMON@{reporting_mta}>",
        f"To: <{sender}>",
        f"Subject: {subject}",
        f"Date: {format_datetime(now)}",
        f"Message-ID: {message_id}",
        "Auto-Submitted: auto-replied",
        "MIME-Version: 1.0",
        f'Content-Type: multipart/report; report-type=delivery-status; boundary="{boundary}"',
    ]
    headers = header_section(original).rstrip(b"\r\n") + b"\r\n"
    parts = [
        ("\r\n".join(head) + "\r\n\r\nThis is a MIME-encapsulated message.\r\n\r\n").encode(),
        f"--{boundary}\r\nContent-Description: Notification\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Transfer-Encoding: 8bit\r\n\r\n{human}\r\n".encode(),
        f"--{boundary}\r\nContent-Description: Delivery report\r\nContent-Type: message/delivery-status\r\n\r\n"
        f"{status}\r\n".encode(),
        f"--{boundary}\r\nContent-Description: Undelivered Message Headers\r\nContent-Type: text/rfc822-headers\r\n"
        f"Content-Transfer-Encoding: 8bit\r\n\r\n".encode() + headers + b"\r\n",
        f"--{boundary}--\r\n".encode(),
    ]
    return b"".join(parts)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:900]
