"""Real mail clients for the cluster's fault tests: each call is one whole session, reduced to an outcome.

A fault test sends and reads many times while nodes die, so what it needs from a
session is what the user saw: a reply code, the messages fetched, or the
protocol's error. Every outcome keeps the server's own words for the report.
"""

from __future__ import annotations

import imaplib
import poplib
import re
import smtplib
from dataclasses import dataclass, field

SENDER = "load@sender.test"


@dataclass
class Outcome:
    """What one session gave: 'ok', 'temp' (4xx / -ERR / NO: the protocol's own refusal),
    'perm' (5xx), or 'dropped' (the connection was lost)."""

    kind: str
    text: str = ""
    code: int = 0
    messages: list[bytes] = field(default_factory=list)
    #: With imap_uids: the UID of each of `messages`, in the same order.
    uids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def smtp_send(host: str, port: int, rcpt: str, message: bytes, timeout: float = 60,
              login: tuple[str, str] | None = None) -> Outcome:
    """One SMTP transaction; 'ok' only for 250 after DATA. With `login` (user, password) it is a
    submission: AUTH first (in clear text: the cluster's listeners allow it on loopback), and the
    user is the sender."""
    try:
        with smtplib.SMTP(host, port, timeout=timeout) as client:
            client.ehlo("load.test")
            if login is not None:
                client.login(*login)
            code, text = client.mail(login[0] if login else SENDER)
            if code == 250:
                code, text = client.rcpt(rcpt)
            if code in (250, 251):
                code, text = client.data(message)
    except smtplib.SMTPResponseException as exc:
        code, text = exc.smtp_code, exc.smtp_error
    except (smtplib.SMTPException, OSError) as exc:
        return Outcome("dropped", repr(exc))
    words = text.decode("utf-8", "replace")
    kind = "ok" if code == 250 else "temp" if 400 <= code < 500 else "perm"
    return Outcome(kind, f"{code} {words}", code)


def pop3_read(host: str, port: int, user: str, password: str, timeout: float = 60,
              delete: bool = False) -> Outcome:
    """Log in, STAT, RETR every message (and DELE it, with `delete`: the deletions happen at
    QUIT), QUIT. The messages are those retrieved, also when the session failed later: the user
    has seen them."""
    try:
        client = poplib.POP3(host, port, timeout=timeout)
    except OSError as exc:
        return Outcome("dropped", repr(exc))
    messages: list[bytes] = []
    try:
        client.user(user)
        client.pass_(password)
        count, _ = client.stat()
        for i in range(1, count + 1):
            messages.append(b"\r\n".join(client.retr(i)[1]))
            if delete:
                client.dele(i)
        client.quit()
        return Outcome("ok", f"{count} message(s)", messages=messages)
    except poplib.error_proto as exc:
        text = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        return Outcome("temp", text, messages=messages)
    except OSError as exc:
        return Outcome("dropped", repr(exc), messages=messages)
    finally:
        client.close()


def imap_read(host: str, port: int, user: str, password: str, timeout: float = 60,
              items: str = "(BODY.PEEK[])") -> Outcome:
    """LOGIN, SELECT INBOX, UID FETCH `items` (the whole body) of every message, LOGOUT."""
    try:
        client = imaplib.IMAP4(host, port, timeout=timeout)
    except OSError as exc:
        return Outcome("dropped", repr(exc))
    try:
        client.login(user, password)
        kind, data = client.select("INBOX")
        if kind != "OK":
            return Outcome("temp", f"SELECT {kind} {data!r}")
        kind, data = client.uid("FETCH", "1:*", items)
        if kind != "OK":
            return Outcome("temp", f"FETCH {kind} {data!r}")
        messages, uids = [], []
        for k, item in enumerate(data):
            if isinstance(item, tuple):
                # The UID may come before the literal or after it (in the next, plain element).
                after = data[k + 1] if k + 1 < len(data) and isinstance(data[k + 1], bytes) else b""
                found = re.search(rb"UID (\d+)", item[0]) or re.search(rb"UID (\d+)", after)
                messages.append(item[1])
                uids.append(int(found.group(1)) if found else 0)
        client.logout()
        return Outcome("ok", f"{len(messages)} message(s)", messages=messages, uids=uids)
    except imaplib.IMAP4.abort as exc:
        return Outcome("dropped", str(exc))
    except imaplib.IMAP4.error as exc:
        return Outcome("temp", str(exc))
    except OSError as exc:
        return Outcome("dropped", repr(exc))
    finally:
        try:
            client.shutdown()
        except OSError:
            pass


def imap_uids(host: str, port: int, user: str, password: str, timeout: float = 60) -> Outcome:
    """Each message's UID and Subject header only: what every UID names, cheaply."""
    return imap_read(host, port, user, password, timeout, items="(BODY.PEEK[HEADER.FIELDS (SUBJECT)])")


def subject_of(message: bytes) -> str:
    """The Subject header's value (the load's messages carry their unique name there)."""
    for line in message.split(b"\r\n"):
        if not line:
            break
        if line.lower().startswith(b"subject:"):
            return line.split(b":", 1)[1].strip().decode()
    return ""


def make_message(subject: str, size: int = 2000) -> bytes:
    filler = (b"0123456789abcdef" * (size // 16 + 1))[:size]
    return (f"From: {SENDER}\r\nSubject: {subject}\r\nMessage-ID: <{subject}@load.test>\r\n\r\n".encode()
            + b"\r\n".join(filler[i : i + 64] for i in range(0, len(filler), 64)) + b"\r\n")

