"""The POP3 front end: Twisted's POP3 engine with cassmail's maildrop, login and streaming.

Twisted's `POP3` class keeps the command dispatch and CAPA/RSET/NOOP. It is extended
here where cassmail needs more than it does:

- lines are cut one at a time: what a client sent behind STLS in the same packet is
  dropped (RFC 2595 3.1, no command injection into the TLS session), and a line of
  any length is skipped to its end and answered `-ERR Line too long`;
- pipelining (RFC 2449): lines that arrive while a long operation (login, RETR,
  TOP, QUIT) runs wait in order, and each is then handled exactly like a line read
  from the socket, errors included (Twisted's own replay skips the error handling);
  once more than `max_pipelined_bytes` wait, the session stops reading from the
  socket (the client's sends back up in TCP) until they are answered, so a client
  that stops reading during a RETR and keeps sending cannot grow the queue;
- the maildrop (`Maildrop`) is read from the store at login, in pages of summaries,
  and stays fixed for the session (RFC 1939): numbers never shift;
- RETR and TOP stream the body from the store chunk by chunk, with flow control,
  dot-stuffing every line (after CRLF or a bare LF) and leaving the bytes alone
  otherwise (Twisted's own sender rewrites line endings); TOP asks the store for
  growing byte ranges (64 KiB first) and stops once it has the headers and the lines
  asked for, so `TOP n 0` of a 50 MB message reads 64 KiB;
- deletions reach the store on QUIT in one call; a dropped connection deletes nothing;
- USER/PASS and AUTH PLAIN (with or without an initial response) check the store's
  hashes, slow down repeated failures, close the session after `max_auth_failures`,
  and are refused before STLS unless plaintext is allowed by setting; APOP is not
  offered (it needs plaintext passwords);
- `anne@example.com|Sent` logs in to another mailbox of the same user (CassMail's
  multi-mailbox access);
- every error is a `-ERR` line (RFC 2449 response codes where they apply) and the
  session goes on: no traceback or exception name reaches a client, even for a bug
  (it is logged, and answered `-ERR [SYS/TEMP] Internal error`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.protocol import ServerFactory
from twisted.mail import pop3
from twisted.python.failure import Failure

from cassmail import auth
from cassmail.config import Pop3Settings
from cassmail.dots import stuff
from cassmail.logs import kv
from cassmail.model import INBOX, InvalidInput, MessageSummary, mailbox_name, uidl
from cassmail.sessions import Sessions
from cassmail.store.base import NoSuchMailbox, NoSuchMessage, Store, StoreError
from cassmail.twisted_asyncio import ClientStalled, WriteGate, deferred

log = logging.getLogger("cassmail.pop3")

#: Separates the address from a mailbox name at login: "anne@example.com|Sent".
MAILBOX_SEPARATOR = "|"
#: Bytes of headers TOP collects at most while looking for the blank line that ends them.
TOP_HEADER_LIMIT = 1024 * 1024
#: TOP's first store request is for this many bytes; each further one is TOP_READ_GROWTH
#: times larger (up to TOP_MAX_READ), so a short TOP costs one small read, a long one few reads.
TOP_FIRST_READ = 64 * 1024
TOP_READ_GROWTH = 4
TOP_MAX_READ = 4 * 1024 * 1024
#: The answer to a failure that is nobody's fault but ours (a bug): logged, never shown.
INTERNAL_ERROR = b"[SYS/TEMP] Internal error, try again later"


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

    #: Lines read while a long operation runs, in order; None stands for a line that was too long.
    blocked: deque[bytes | None] | None

    def __init__(self) -> None:
        self._opened_at: float | None = None
        self._secure = False
        self._user_given: str | None = None
        self._peer = "-"
        self._overlong = False  # skipping the rest of a line that is too long
        self._pending = bytearray()  # received, not yet cut into lines
        self._drop_rest = False  # STLS: the lines queued behind it came in clear text and are dropped
        self._answering = False  # from a RETR's or TOP's +OK to its end: an error cannot be -ERR then
        self._queued = 0  # bytes of the lines waiting (in `blocked` or on their way back to it)
        self._reading_paused = False  # the transport was told to stop reading (too much queued)

    # ------------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        settings = self.factory.settings
        self.timeOut = settings.timeout
        self.setTimeout(self.timeOut)
        self.mbox = None
        self.state = "COMMAND"
        self.blocked = None
        self._secure = settings.implicit_tls
        self._failures = self.factory.logins.failures()
        peer = self.transport.getPeer()
        self._peer = getattr(peer, "host", str(peer))
        admitted = self.factory.opened(self)
        self._opened_at = time.monotonic()
        if not admitted:
            self.sendLine(b"-ERR [SYS/TEMP] Too many connections, try again later")
            self.transport.loseConnection()
            return
        # No <timestamp> in the greeting: that would offer APOP (RFC 1939 7).
        self.successResponse(b"cassmail POP3 ready")

    def connectionLost(self, reason: Any = None) -> None:
        if self._opened_at is not None:
            self.factory.closed(self)
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

    def dataReceived(self, data: bytes) -> None:
        """Cut CRLF-ended lines one at a time. Twisted's LineOnlyReceiver splits a whole packet
        first, so STLS could not drop what follows it, and it closes the connection on a line
        over MAX_LENGTH; here at most `max_line_length` bytes are held, and a longer line is
        skipped up to its end and answered -ERR, in its turn among pipelined commands."""
        pending = self._pending
        pending += data
        limit = self.factory.settings.max_line_length
        while not self.transport.disconnecting:
            end = pending.find(b"\r\n")
            if end < 0:
                break
            line = bytes(pending[:end])
            del pending[: end + 2]  # cheap: a bytearray drops its front by moving its start
            too_long, self._overlong = self._overlong or len(line) > limit, False
            self.lineReceived(None if too_long else line)
            self._drop_rest = False  # STLS emptied `pending` itself
        if len(pending) - pending.endswith(b"\r") > limit:  # a CR alone may be half of the line end
            self._overlong = True
            del pending[:-1]  # it may be the CR of the line end

    def lineReceived(self, line: bytes | None) -> None:  # type: ignore[override]
        """One line (None: one that was too long): handled now, or queued behind a long operation."""
        self.resetTimeout()
        if self.blocked is not None:
            self.blocked.append(line)
            self._queued += self._queued_size(line)
            if self._queued > self.factory.settings.max_pipelined_bytes and not self._reading_paused:
                # Bytes already read are still cut into lines and queued (at most one read more);
                # nothing new is read until _unblock has answered enough of them.
                self._reading_paused = True
                self.transport.pauseProducing()
            return
        self._handle(line)

    def _queued_size(self, line: bytes | None) -> int:
        """What a waiting line counts against max_pipelined_bytes: the bytes the client sent for
        it (an over-long line, kept as None, counts as the longest line allowed)."""
        return (len(line) if line is not None else self.factory.settings.max_line_length) + 2

    def _handle(self, line: bytes | None) -> None:
        if line is None:
            self.state = "COMMAND"  # an over-long SASL response ends the exchange too
            self.failResponse(b"Line too long")
            return
        getattr(self, "state_" + self.state)(line)

    def state_COMMAND(self, line: bytes) -> None:
        """Run one command; whatever it raises becomes its -ERR line."""
        try:
            self.processCommand(*line.split())
        except _PopError as exc:
            self.failResponse(exc.text)
        except (ValueError, TypeError, UnicodeDecodeError):
            self.failResponse(b"Invalid command or arguments")
        except Exception:  # noqa: BLE001 - a bug: logged here, never shown to the client
            command = line.split(b" ", 1)[0][:20].decode("ascii", "replace")  # never a password
            log.exception(kv("pop3-error", peer=self._peer, user=self._user_given, command=command))
            self.failResponse(INTERNAL_ERROR)

    def _longOperation(self, d: Any) -> Any:
        """Run a Deferred while later lines wait in `blocked`, with the idle timer off.

        Replaces Twisted's, whose `_unblock` replays the waiting commands through
        `processCommand`: an error there escaped as an unhandled Deferred failure, the
        rest of the queue was lost and the idle timer stayed off."""
        self.setTimeout(None)
        self.blocked = deque()
        d.addErrback(self._unexpected)
        d.addCallback(self._unblock)
        return d

    def _unblock(self, _: object = None) -> None:
        """Handle the waiting lines in order until one starts another long operation; read from
        the socket again once what still waits is within max_pipelined_bytes."""
        lines, self.blocked = self.blocked or deque(), None
        while lines and self.blocked is None:
            if self._opened_at is None or self.transport.disconnecting:
                return
            line = lines.popleft()
            self._queued -= self._queued_size(line)
            self._handle(line)
            if self._drop_rest:  # STLS was among them: what followed it came in clear text
                self._drop_rest = False
                lines.clear()
                self._queued = 0
        if self.blocked is not None:
            self.blocked.extend(lines)  # they wait for the long operation just started
        elif self._opened_at is not None:
            self.setTimeout(self.timeOut)
        if (self._reading_paused and self._opened_at is not None and not self.transport.disconnecting
                and self._queued <= self.factory.settings.max_pipelined_bytes):
            self._reading_paused = False
            self.transport.resumeProducing()

    def _unexpected(self, failure: Failure) -> None:
        """Last resort for a long operation that failed (they answer their own errors): log it,
        answer -ERR, and let the waiting commands go on."""
        if self._opened_at is None or failure.check(asyncio.CancelledError, CancelledError):
            return  # the client left, or the worker is stopping
        log.error(kv("pop3-error", peer=self._peer, user=self._user_given, error=repr(failure.value)),
                  exc_info=(failure.type, failure.value, failure.getTracebackObject()))
        self.failResponse(INTERNAL_ERROR)

    def processCommand(self, command: bytes, *args: bytes) -> Any:
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

    def listCapabilities(self) -> list[bytes]:
        caps = [b"TOP", b"UIDL", b"PIPELINING", b"RESP-CODES", b"AUTH-RESP-CODE", b"IMPLEMENTATION cassmail"]
        if self.factory.logins.plaintext_ok(self._secure):
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
        auth.drop_clear_text(self._pending, "pop3", self._peer)
        self._drop_rest = True

    # ------------------------------------------------------------------ login

    def do_APOP(self, *args: bytes) -> None:
        raise _PopError(b"APOP is not supported: use USER/PASS or AUTH PLAIN over TLS")

    def do_RPOP(self, *args: bytes) -> None:
        raise _PopError(b"RPOP is not supported")

    def do_USER(self, user: bytes | None = None, *rest: bytes) -> None:
        if not self.factory.logins.plaintext_ok(self._secure):
            raise _PopError(b"[AUTH] Plaintext authentication is disallowed on a clear-text connection: use STLS")
        if user is None or rest:
            raise _PopError(b"Syntax: USER name")
        self._user_given = user.decode("utf-8", "replace")
        self.successResponse(b"Send PASS")

    def do_PASS(self, *words: bytes) -> Any:
        if not self.factory.logins.plaintext_ok(self._secure):
            raise _PopError(b"[AUTH] Plaintext authentication is disallowed on a clear-text connection: use STLS")
        if self._user_given is None:
            raise _PopError(b"USER first")
        login, self._user_given = self._user_given, None
        password = b" ".join(words).decode("utf-8", "replace")
        return self._longOperation(deferred(self._login(login, password)))

    def do_AUTH(self, mechanism: bytes | None = None, initial: bytes | None = None, *rest: bytes) -> Any:
        if not self.factory.logins.plaintext_ok(self._secure):
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
        if auth.cancelled(line):
            self.failResponse(b"Authentication cancelled")
            return
        self._sasl_plain(line.strip())

    def _sasl_plain(self, response: bytes) -> Any:
        decoded = auth.decode_plain(response)
        if decoded is None:
            self.failResponse(b"[AUTH] Malformed PLAIN response")
            return None
        return self._longOperation(deferred(self._login(*decoded)))

    async def _login(self, login: str, password: str) -> None:
        """Check the password, open the maildrop; answer either way (the session goes on,
        unless this was its `max_auth_failures`th failed login). `user+mailbox` logs in to that
        mailbox instead of INBOX."""
        address, _, box = login.rpartition(MAILBOX_SEPARATOR) if MAILBOX_SEPARATOR in login else (login, "", INBOX)
        store, user, result = self.factory.store, None, "tempfail"
        try:
            mailbox = mailbox_name(box or INBOX)
        except InvalidInput:
            mailbox = INBOX
        try:
            user = await self.factory.logins.check(store, self._peer, address, password,
                                                  gone=lambda: self._opened_at is None)
            if user is None:
                if self._failures.add():
                    self.failResponse(b"[AUTH] Authentication failed; too many failures, closing the connection")
                    self.transport.loseConnection()
                    return
                raise LoginFailed("[AUTH] Authentication failed")
            if self._opened_at is None:  # the client went away meanwhile: no need to list anything
                return
            try:
                messages = [s async for s in store.list_messages(user, mailbox, self.factory.settings.page_size)]
            except NoSuchMailbox:
                result = "no-mailbox"
                raise LoginFailed(f"No such mailbox: {mailbox}") from None
            self.mbox = Maildrop(store, user, mailbox, messages)
            self._user_given = user
            result = "ok"
            self.successResponse(f"{user} has {len(messages)} message(s) in {mailbox}".encode())
        except LoginFailed as exc:
            self.failResponse(str(exc).encode())
        except StoreError as exc:
            if user is not None:  # the password check's own failure is logged by it
                log.warning(kv("maildrop", listener="pop3", peer=self._peer, user=user, mailbox=mailbox,
                               result=result, error=exc))
            self.failResponse(b"[SYS/TEMP] Mail store unavailable, try again later")
        except Exception:  # noqa: BLE001 - a bug: logged here, never shown to the client
            log.exception(kv("pop3-error", peer=self._peer, user=user, command="login"))
            self.failResponse(INTERNAL_ERROR)

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
        """Stream a message (or its headers and `top_lines` body lines) from the store.

        Before the +OK every failure is an -ERR line; after it, part of the message went
        out and the only honest ending is to close the connection."""
        assert self.mbox is not None
        box = self.mbox
        summary = box.messages[index]
        store = self.factory.store
        if top_lines is None:
            chunks = store.read_chunks(box.user, box.mailbox, summary.id)
        else:
            chunks = _growing_reads(store, box.user, box.mailbox, summary.id, summary.size)
        try:
            await self._stream(box, summary, chunks, top_lines)
        except Exception:  # noqa: BLE001 - a bug: logged here, never shown to the client
            log.exception(kv("pop3-error", peer=self._peer, user=box.user, command="retr"))
            if self._answering:
                self.transport.loseConnection()
            else:
                self.failResponse(INTERNAL_ERROR)
        finally:
            self._answering = False
            await chunks.aclose()

    async def _stream(self, box: Maildrop, summary: MessageSummary, chunks: AsyncIterator[bytes],
                      top_lines: int | None) -> None:
        try:
            first = await anext(chunks, b"")
        except NoSuchMessage:
            self.failResponse(b"Message was deleted by another session")
            return
        except StoreError as exc:
            log.warning(kv("retr", listener="pop3", peer=self._peer, user=box.user, error=exc))
            self.failResponse(b"[SYS/TEMP] Mail store unavailable, try again later")
            return
        gate = WriteGate(self.transport, self.factory.settings.write_timeout)
        self.transport.registerProducer(gate, True)
        try:
            self.successResponse(f"{summary.size} octets" if top_lines is None else "Top of message follows")
            self._answering = True
            cutter = _TopCutter(top_lines) if top_lines is not None else None
            last = b"\n"
            chunk = first
            while True:
                if cutter is not None:
                    chunk, done = cutter.feed(chunk)
                else:
                    done = False
                if chunk:
                    stuffed = stuff(chunk, last == b"\n")
                    last = chunk[-1:]
                    self.transport.write(stuffed)
                    await gate.wait()
                if done:
                    break
                chunk = await anext(chunks, None)
                if chunk is None:
                    break
            self.transport.write(b".\r\n" if last == b"\n" else b"\r\n.\r\n")
            box.retrieved += 1
        except ClientStalled as exc:
            log.info(kv("retr", listener="pop3", peer=self._peer, user=box.user, result="stalled", error=exc))
        except ConnectionError:
            return  # the client went away in the middle: nobody to answer
        except StoreError as exc:
            # Part of the message went out: the only honest ending is to close the connection.
            log.warning(kv("retr", listener="pop3", peer=self._peer, user=box.user, result="cut", error=exc))
            self.transport.loseConnection()
        finally:
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
        except Exception as exc:  # noqa: BLE001 - a bug is logged with its traceback, never shown
            if isinstance(exc, StoreError):
                log.warning(kv("quit", listener="pop3", peer=self._peer, user=self.mbox.user, error=exc))
            else:
                log.exception(kv("pop3-error", peer=self._peer, user=self.mbox.user, command="quit"))
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
            end = _header_end(self.head, max(start - 2, 0))
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


#: The blank line that ends a header section (CRLF or bare LF), also as the very first line
#: of a message whose header section is empty.
_BLANK_LINE = re.compile(rb"(?:^|\n)\r?\n")


def _header_end(data: bytes | bytearray, pos: int = 0) -> int | None:
    """Offset just after the blank line ending the headers, or None when it is not in `data`.
    `pos`: where to start looking; a caller that appended to data already searched passes the
    old length minus 2 (a blank line the new bytes complete starts at most 2 bytes before them)."""
    found = _BLANK_LINE.search(data, pos)
    return found.end() if found else None


async def _growing_reads(store: Store, user: str, mailbox: str, message_id: Any, size: int) -> AsyncIterator[bytes]:
    """A body as successive byte ranges, the first TOP_FIRST_READ bytes long and each next one
    TOP_READ_GROWTH times longer: the store reads (and reads ahead) only within a range, so a
    reader that stops early, like TOP, costs what it used, not the whole message."""
    start, step = 0, TOP_FIRST_READ
    while True:
        end = min(start + step, size)
        async with aclosing(store.read_chunks(user, mailbox, message_id, start, end)) as chunks:
            async for chunk in chunks:
                yield chunk
        if end >= size:
            return
        start, step = end, min(step * TOP_READ_GROWTH, TOP_MAX_READ)


class Pop3Factory(ServerFactory, Sessions):
    """Builds sessions; holds what they share in one worker."""

    protocol = Pop3Session

    def __init__(self, store: Store, settings: Pop3Settings, tls: Any) -> None:
        self.store, self.settings, self.tls = store, settings, tls
        self.logins = auth.Logins("pop3", settings)
        Sessions.__init__(self, settings.max_connections)

    def buildProtocol(self, addr: Any) -> Pop3Session:
        session = Pop3Session()
        session.factory = self
        return session
