"""The POP3 front end: Twisted's POP3 engine with cassmail's maildrop, login and streaming.

Twisted's `POP3` class keeps the command loop, pipelining (commands wait while
a long operation runs) and STAT/LIST/UIDL/RSET/NOOP. It is extended here where
cassmail needs more than it does:

- the maildrop (`Maildrop`) is read from the store at login, in pages of summaries,
  and stays fixed for the session (RFC 1939): numbers never shift;
- RETR and TOP stream the body from the store chunk by chunk, with flow control,
  dot-stuffing every line (after CRLF or a bare LF) and leaving the bytes alone
  otherwise (Twisted's own sender rewrites line endings); TOP stops reading once it
  has the headers and the lines asked for;
- deletions reach the store on QUIT in one call; a dropped connection deletes nothing;
- USER/PASS and AUTH PLAIN (with or without an initial response) check the store's
  hashes, slow down repeated failures, and are refused before STLS unless
  plaintext is allowed by setting; APOP is not offered (it needs plaintext passwords);
- `anne@example.com|Sent` logs in to another mailbox of the same user (CassMail's
  multi-mailbox access);
- every error is a `-ERR` line (RFC 2449 response codes where they apply) and the
  session goes on: no traceback or exception name reaches a client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any

from twisted.internet.protocol import ServerFactory
from twisted.mail import pop3

from cassmail import auth
from cassmail.config import Pop3Settings
from cassmail.logs import kv
from cassmail.model import INBOX, Address, InvalidInput, MessageSummary, mailbox_name, uidl
from cassmail.store.base import NoSuchMailbox, NoSuchMessage, Store, StoreError
from cassmail.twisted_asyncio import WriteGate, deferred

log = logging.getLogger("cassmail.pop3")

#: Separates the address from a mailbox name at login: "anne@example.com|Sent".
MAILBOX_SEPARATOR = "|"
#: Bytes of headers TOP collects at most while looking for the blank line that ends them.
TOP_HEADER_LIMIT = 1024 * 1024


class LoginFailed(Exception):
    """Credentials refused; the text is the -ERR line."""


class Maildrop:
    """A session's fixed view of one mailbox: its summaries at login, and the DELE marks."""

    def __init__(self, store: Store, user: str, mailbox: str, messages: list[MessageSummary]) -> None:
        self.store, self.user, self.mailbox = store, user, mailbox
        self.messages = messages
        self.deleted: set[int] = set()
        self.retrieved = 0

    def check(self, index: int) -> MessageSummary:
        """The summary of a live message, or ValueError saying why not."""
        if not 0 <= index < len(self.messages):
            raise ValueError("no such message")
        if index in self.deleted:
            raise ValueError("message deleted")
        return self.messages[index]

    def live(self) -> list[tuple[int, MessageSummary]]:
        """(1-based number, summary) of every message not marked deleted."""
        return [(i + 1, m) for i, m in enumerate(self.messages) if i not in self.deleted]

    def deleteMessage(self, index: int) -> None:
        self.check(index)
        self.deleted.add(index)

    def undeleteMessages(self) -> None:  # Twisted's RSET calls it
        self.deleted.clear()

    async def commit(self) -> int:
        """Delete the marked messages in one store call; how many."""
        ids = [self.messages[i].id for i in sorted(self.deleted)]
        if ids:
            await self.store.delete_messages(self.user, self.mailbox, ids)
        return len(ids)


class Pop3Session(pop3.POP3):
    """One POP3 connection. `factory` is a Pop3Factory (store, settings, throttle, counters)."""

    factory: Pop3Factory
    mbox: Maildrop | None

    def __init__(self) -> None:
        self._opened_at: float | None = None
        self._secure = False
        self._user_given: str | None = None
        self._peer = "-"

    # ------------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        settings = self.factory.settings
        self.MAX_LENGTH = 65536  # our own, smaller limit is checked per line
        self.timeOut = settings.timeout
        self.setTimeout(self.timeOut)
        self.mbox = None
        self.state = "COMMAND"
        self.blocked = None
        self._secure = settings.implicit_tls
        peer = self.transport.getPeer()
        self._peer = getattr(peer, "host", str(peer))
        self.factory.sessions += 1
        self._opened_at = time.monotonic()
        if self.factory.sessions > settings.max_connections:
            self.sendLine(b"-ERR [SYS/TEMP] Too many connections, try again later")
            self.transport.loseConnection()
            return
        # No <timestamp> in the greeting: that would offer APOP (RFC 1939 7).
        self.successResponse(b"cassmail POP3 ready")

    def connectionLost(self, reason: Any = None) -> None:
        if self._opened_at is not None:
            self.factory.sessions -= 1
            box = self.mbox
            log.info(
                kv(
                    "session", listener="pop3", peer=self._peer, user=box.user if box else self._user_given,
                    mailbox=box.mailbox if box else None, tls=self._secure, messages=len(box.messages) if box else None,
                    retrieved=box.retrieved if box else None, ms=int((time.monotonic() - self._opened_at) * 1000),
                )
            )
            self._opened_at = None
        self.mbox = None  # a dropped connection deletes nothing
        super().connectionLost(reason)

    def lineLengthExceeded(self, line: bytes) -> None:
        """Beyond even the buffer limit with no line end in sight: answer and close."""
        self.sendLine(b"-ERR Line too long")
        self.transport.loseConnection()

    def lineReceived(self, line: bytes) -> None:
        if len(line) > self.factory.settings.max_line_length:
            self.resetTimeout()
            if self.blocked is not None:
                self.blocked.append((b"\x00TOOLONG", ()))
            else:
                self.failResponse(b"Line too long")
            return
        super().lineReceived(line)

    def state_COMMAND(self, line: bytes) -> None:
        try:
            self.processCommand(*line.split())
        except _PopError as exc:
            self.failResponse(exc.text)
        except (ValueError, TypeError, UnicodeDecodeError):
            self.failResponse(b"Invalid command or arguments")

    def processCommand(self, command: bytes, *args: bytes) -> Any:
        if self.blocked is not None:
            self.blocked.append((command, args))
            return None
        if command == b"\x00TOOLONG":
            self.failResponse(b"Line too long")
            return None
        name = command.upper()
        try:
            text = name.decode("ascii")
        except UnicodeDecodeError:
            raise _PopError(b"Unknown command") from None
        if not text.isalpha() or not hasattr(self, "do_" + text):
            raise _PopError(b"Unknown command")
        if self.mbox is None and name not in self.AUTH_CMDS + [b"STLS", b"NOOP"]:
            raise _PopError(b"Not authenticated yet: log in with USER/PASS or AUTH first")
        if self.mbox is not None and name in (b"USER", b"PASS", b"APOP", b"AUTH", b"STLS"):
            raise _PopError(b"Already authenticated")
        return getattr(self, "do_" + text)(*args)

    # ------------------------------------------------------------------ capabilities and TLS

    def _plaintext_ok(self) -> bool:
        return self._secure or self.factory.settings.allow_plaintext_auth

    def listCapabilities(self) -> list[bytes]:
        caps = [b"TOP", b"UIDL", b"PIPELINING", b"RESP-CODES", b"AUTH-RESP-CODE", b"IMPLEMENTATION cassmail"]
        if self._plaintext_ok():
            caps += [b"USER", b"SASL PLAIN"]
        if self.factory.tls is not None and not self._secure:
            caps.append(b"STLS")
        return caps

    def do_STLS(self) -> None:
        if self.factory.tls is None:
            raise _PopError(b"STLS is not available on this server")
        if self._secure:
            raise _PopError(b"Already using TLS")
        self.successResponse(b"Begin TLS negotiation")
        self.transport.startTLS(self.factory.tls)
        self._secure = True
        self._user_given = None

    # ------------------------------------------------------------------ login

    def do_APOP(self, *args: bytes) -> None:
        raise _PopError(b"APOP is not supported: use USER/PASS or AUTH PLAIN over TLS")

    def do_RPOP(self, *args: bytes) -> None:
        raise _PopError(b"RPOP is not supported")

    def do_USER(self, user: bytes | None = None, *rest: bytes) -> None:
        if not self._plaintext_ok():
            raise _PopError(b"[AUTH] Plaintext authentication is disallowed on a clear-text connection: use STLS")
        if user is None or rest:
            raise _PopError(b"Syntax: USER name")
        self._user_given = user.decode("utf-8", "replace")
        self.successResponse(b"Send PASS")

    def do_PASS(self, *words: bytes) -> Any:
        if not self._plaintext_ok():
            raise _PopError(b"[AUTH] Plaintext authentication is disallowed on a clear-text connection: use STLS")
        if self._user_given is None:
            raise _PopError(b"USER first")
        login, self._user_given = self._user_given, None
        password = b" ".join(words).decode("utf-8", "replace")
        return self._longOperation(deferred(self._login(login, password)))

    def do_AUTH(self, mechanism: bytes | None = None, initial: bytes | None = None, *rest: bytes) -> Any:
        if not self._plaintext_ok():
            raise _PopError(b"[AUTH] Authentication is disallowed on a clear-text connection: use STLS")
        if mechanism is None:
            self.successResponse(b"Supported mechanisms:")
            self.sendLine(b"PLAIN")
            self.sendLine(b".")
            return None
        if mechanism.upper() != b"PLAIN" or rest:
            raise _PopError(b"Unsupported SASL mechanism")
        if initial is None:
            self.sendLine(b"+ ")
            self.state = "AUTH_PLAIN"
            return None
        return self._sasl_plain(initial)

    def state_AUTH_PLAIN(self, line: bytes) -> None:
        self.state = "COMMAND"
        if line.strip() == b"*":
            self.failResponse(b"Authentication cancelled")
            return
        self._sasl_plain(line.strip())

    def _sasl_plain(self, response: bytes) -> Any:
        try:
            _authz, login, password = base64.b64decode(response, validate=True).split(b"\0")
        except (binascii.Error, ValueError):
            self.failResponse(b"[AUTH] Malformed PLAIN response")
            return None
        return self._longOperation(
            deferred(self._login(login.decode("utf-8", "replace"), password.decode("utf-8", "replace")))
        )

    async def _login(self, login: str, password: str) -> None:
        """Check the password, open the maildrop; answer either way (the session goes on)."""
        started = time.monotonic()
        address, _, box = login.rpartition(MAILBOX_SEPARATOR) if MAILBOX_SEPARATOR in login else (login, "", INBOX)
        throttle, store = self.factory.throttle, self.factory.store
        try:
            user = Address.parse(address).key
            mailbox = mailbox_name(box or INBOX)
        except InvalidInput:
            user, mailbox = None, INBOX
        delay = throttle.penalty(self._peer, user)
        result = "fail"
        try:
            if delay:
                await asyncio.sleep(delay)
            if not await auth.check_password(store, user, password):
                throttle.failed(self._peer, user)
                raise LoginFailed("[AUTH] Authentication failed")
            throttle.succeeded(user)
            if self._opened_at is None:  # the client went away meanwhile: no need to list anything
                return
            try:
                messages = [s async for s in store.list_messages(user, mailbox, self.factory.settings.page_size)]
            except NoSuchMailbox:
                raise LoginFailed(f"No such mailbox: {mailbox}") from None
            self.mbox = Maildrop(store, user, mailbox, messages)
            self._user_given = user
            result = "ok"
            self.successResponse(f"{user} has {len(messages)} message(s) in {mailbox}".encode())
        except LoginFailed as exc:
            self.failResponse(str(exc).encode())
        except StoreError as exc:
            result = "tempfail"
            log.warning(kv("auth", listener="pop3", peer=self._peer, user=user, error=exc))
            self.failResponse(b"[SYS/TEMP] Mail store unavailable, try again later")
        finally:
            log.info(kv("auth", listener="pop3", peer=self._peer, user=user, mailbox=mailbox, result=result,
                        ms=int((time.monotonic() - started) * 1000)))

    # ------------------------------------------------------------------ transaction

    def _index(self, number: bytes) -> int:
        try:
            index = int(number) - 1
        except ValueError:
            raise _PopError(b"Bad message number") from None
        assert self.mbox is not None
        try:
            self.mbox.check(index)
        except ValueError as exc:
            raise _PopError(f"{exc}".capitalize().encode()) from None
        return index

    def do_STAT(self, *rest: bytes) -> None:
        if rest:
            raise _PopError(b"Syntax: STAT")
        assert self.mbox is not None
        live = self.mbox.live()
        self.successResponse(f"{len(live)} {sum(m.size for _, m in live)}".encode())

    def _listing(self, number: bytes | None, rest: tuple[bytes, ...], field: Any, what: bytes) -> None:
        """LIST and UIDL: one message, or all live ones as a multi-line answer."""
        if rest:
            raise _PopError(b"Syntax: " + what + b" [msg]")
        assert self.mbox is not None
        if number is not None:
            index = self._index(number)
            self.successResponse(b"%d %s" % (index + 1, field(self.mbox.messages[index])))
            return
        live = self.mbox.live()
        lines = [b"+OK %d messages\r\n" % len(live)]
        lines += [b"%d %s\r\n" % (n, field(m)) for n, m in live]
        lines.append(b".\r\n")
        self.transport.writeSequence(lines)

    def do_LIST(self, number: bytes | None = None, *rest: bytes) -> None:
        self._listing(number, rest, lambda m: b"%d" % m.size, b"LIST")

    def do_UIDL(self, number: bytes | None = None, *rest: bytes) -> None:
        self._listing(number, rest, lambda m: uidl(m.id).encode("ascii"), b"UIDL")

    def do_DELE(self, number: bytes | None = None, *rest: bytes) -> None:
        if number is None or rest:
            raise _PopError(b"Syntax: DELE msg")
        index = self._index(number)
        assert self.mbox is not None
        self.mbox.deleteMessage(index)
        self.successResponse(b"Message " + number + b" deleted")

    def do_RETR(self, number: bytes | None = None, *rest: bytes) -> Any:
        if number is None or rest:
            raise _PopError(b"Syntax: RETR msg")
        index = self._index(number)
        return self._longOperation(deferred(self._send(index, None)))

    def do_TOP(self, number: bytes | None = None, lines: bytes | None = None, *rest: bytes) -> Any:
        if number is None or lines is None or rest:
            raise _PopError(b"Syntax: TOP msg n")
        index = self._index(number)
        try:
            count = int(lines)
            if count < 0:
                raise ValueError
        except ValueError:
            raise _PopError(b"Bad line count") from None
        return self._longOperation(deferred(self._send(index, count)))

    def do_LAST(self, *args: bytes) -> None:
        raise _PopError(b"LAST is obsolete (RFC 1725)")

    async def _send(self, index: int, top_lines: int | None) -> None:
        """Stream a message (or its headers and `top_lines` body lines) from the store."""
        assert self.mbox is not None
        box = self.mbox
        summary = box.messages[index]
        chunks = self.factory.store.read_chunks(box.user, box.mailbox, summary.id)
        try:
            first = await anext(chunks, b"")
        except NoSuchMessage:
            self.failResponse(b"Message was deleted by another session")
            return
        except StoreError as exc:
            log.warning(kv("retr", listener="pop3", peer=self._peer, user=box.user, error=exc))
            self.failResponse(b"[SYS/TEMP] Mail store unavailable, try again later")
            return
        gate = WriteGate()
        self.transport.registerProducer(gate, True)
        try:
            self.successResponse(f"{summary.size} octets" if top_lines is None else "Top of message follows")
            cutter = _TopCutter(top_lines) if top_lines is not None else None
            last = b"\n"
            chunk = first
            while True:
                if cutter is not None:
                    chunk, done = cutter.feed(chunk)
                else:
                    done = False
                if chunk:
                    stuffed = chunk.replace(b"\n.", b"\n..")
                    if last == b"\n" and chunk[:1] == b".":
                        stuffed = b"." + stuffed
                    last = chunk[-1:]
                    self.transport.write(stuffed)
                    if not gate.open.is_set():
                        await gate.open.wait()
                    if gate.stopped:
                        return
                if done:
                    break
                chunk = await anext(chunks, None)
                if chunk is None:
                    break
            self.transport.write(b".\r\n" if last == b"\n" else b"\r\n.\r\n")
            box.retrieved += 1
        except StoreError as exc:
            # Part of the message went out: the only honest ending is to close the connection.
            log.warning(kv("retr", listener="pop3", peer=self._peer, user=box.user, result="cut", error=exc))
            self.transport.loseConnection()
        finally:
            await chunks.aclose()
            if self._opened_at is not None:  # once the connection is lost, TLS has no producer to drop
                self.transport.unregisterProducer()

    def do_QUIT(self, *args: bytes) -> Any:
        if self.mbox is None:
            self.successResponse(b"Bye")
            self.transport.loseConnection()
            return None
        return self._longOperation(deferred(self._quit()))

    async def _quit(self) -> None:
        """The UPDATE state (RFC 1939 6): remove the marked messages, then close."""
        assert self.mbox is not None
        try:
            removed = await self.mbox.commit()
        except StoreError as exc:
            log.warning(kv("quit", listener="pop3", peer=self._peer, user=self.mbox.user, error=exc))
            self.failResponse(b"[SYS/TEMP] Marked messages were not removed, try again later")
        else:
            self.successResponse(f"Bye, {removed} message(s) removed".encode())
        self.transport.loseConnection()


class _PopError(Exception):
    def __init__(self, text: bytes) -> None:
        super().__init__(text)
        self.text = text


class _TopCutter:
    """Passes on a message's headers, the blank line and the first `lines` body lines, then stops."""

    def __init__(self, lines: int) -> None:
        self.lines = lines
        self.head = bytearray()
        self.in_body = False

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """(what of this chunk to send, whether the cut is complete)."""
        if not self.in_body:
            start = len(self.head)
            self.head += chunk
            end = _header_end(self.head)
            if end is None:
                if len(self.head) > TOP_HEADER_LIMIT:  # no blank line: all of it counts as headers
                    self.in_body = True
                    return chunk, self.lines == 0
                return chunk, False
            self.in_body = True
            body = bytes(self.head[end:])
            head_part = chunk[: max(end - start, 0)]
            self.head = bytearray()
            sent_body, done = self._body(body)
            return head_part + sent_body, done
        return self._body(chunk)

    def _body(self, data: bytes) -> tuple[bytes, bool]:
        if self.lines == 0:
            return b"", True
        pos = 0
        while self.lines > 0:
            found = data.find(b"\n", pos)
            if found < 0:
                return data, False
            pos = found + 1
            self.lines -= 1
        return data[:pos], True


def _header_end(data: bytearray) -> int | None:
    """Offset just after the blank line ending the headers (CRLF or bare LF), or None."""
    ends = [i for i in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if i >= 0]
    if not ends:
        return None
    first = min(ends)
    return first + (4 if data[first : first + 4] == b"\r\n\r\n" else 2)


class Pop3Factory(ServerFactory):
    """Builds sessions; holds what they share in one worker."""

    protocol = Pop3Session

    def __init__(self, store: Store, settings: Pop3Settings, tls: Any) -> None:
        self.store, self.settings, self.tls = store, settings, tls
        self.throttle = auth.FailureThrottle(settings.auth_failure_delay)
        self.sessions = 0

    def buildProtocol(self, addr: Any) -> Pop3Session:
        session = Pop3Session()
        session.factory = self
        return session
