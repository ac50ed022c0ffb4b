"""The IMAP front end: Twisted's IMAP4 engine with cassmail's commands, views and streaming.

Twisted's `IMAP4Server` keeps the line and literal framing, the argument
parsers, the FETCH attribute parser, the state machine (`unauth_X`, `auth_X`,
`select_X` command tables) and STARTTLS. Everything that touches mail is
done here, as coroutines over the Store contract:

- one command runs at a time; lines that arrive meanwhile wait (pipelining is
  allowed, answers never interleave);
- the selected mailbox is a `MailboxView` (UIDs, sequence numbers, flags),
  brought up to date at SELECT, NOOP, CHECK, EXPUNGE, IDLE and after APPEND,
  COPY or MOVE into it, never in the middle of FETCH, STORE or SEARCH;
- FETCH writes its own responses: byte-exact sections from `mime`, BODY[] and
  partial bodies streamed from the store with flow control, \\Seen set once
  per command for all the messages it read;
- extensions: IDLE, UIDPLUS, MOVE, NAMESPACE, LITERAL+, ENABLE, SPECIAL-USE,
  ID, UNSELECT, CHILDREN; STARTTLS and LOGINDISABLED as settings say;
- errors are tagged NO or BAD with a response code where one applies, and the
  session goes on: no traceback or exception text reaches a client.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import re
import time
from collections.abc import Coroutine
from typing import Any

from twisted.internet.protocol import ServerFactory
from twisted.mail import imap4

from cassmail import auth
from cassmail.config import ImapSettings
from cassmail.imap import mime, search, wire
from cassmail.imap.view import Changes, Listing, MailboxView, read_listing
from cassmail.logs import kv
from cassmail.model import (
    HIERARCHY_DELIMITER,
    INBOX,
    Address,
    InvalidInput,
    MailboxInfo,
    flag_set,
    mailbox_name,
)
from cassmail.store.base import (
    MailboxExists,
    MailboxNotAllowed,
    MessageTooLarge,
    NoSuchMailbox,
    NoSuchMessage,
    Store,
    StoreError,
    StoreUnavailable,
    Target,
)
from cassmail.twisted_asyncio import WriteGate, deferred

log = logging.getLogger("cassmail.imap")

PERMANENT_FLAGS = b"(\\Answered \\Flagged \\Deleted \\Seen \\Draft \\*)"
SYSTEM_FLAGS = b"(\\Answered \\Flagged \\Deleted \\Seen \\Draft)"
_TAG = re.compile(rb"[\x21-\x7e]+\Z")
_BAD_TAG_CHARS = re.compile(rb'[(){%*"\\+]')
_LITERAL = re.compile(rb"\{(\d{1,10})(\+?)\}\Z")
_LITERAL_AT_END = re.compile(rb"\{\d+\+?\}\Z")
#: Header-only items (ENVELOPE, BODY[HEADER.FIELDS ...]) read this much of a message at a time,
#: and at most HEADER_LIMIT in all, looking for the blank line that ends the header.
HEADER_WINDOW = 16 * 1024
HEADER_LIMIT = 1024 * 1024


class No(Exception):
    """A tagged NO; `code` goes in brackets (RFC 5530)."""

    def __init__(self, text: str, code: str | None = None) -> None:
        super().__init__(text)
        self.text = f"[{code}] {text}" if code else text


class Bad(Exception):
    """A tagged BAD: the client's syntax or protocol was wrong."""


def _ok(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


class ImapSession(imap4.IMAP4Server):
    """One IMAP connection; `factory` is an ImapFactory (store, settings, throttle, counters)."""

    factory: ImapFactory

    def __init__(self, factory: ImapFactory) -> None:
        super().__init__(chal={}, contextFactory=factory.tls)
        self.factory = factory
        self.settings: ImapSettings = factory.settings
        self.store: Store = factory.store
        self.user: str | None = None
        self.view: MailboxView | None = None
        self._secure = self.settings.implicit_tls
        self._busy_tag: bytes | None = None
        self._queue: list[bytes] = []
        self._idle: asyncio.Task[None] | None = None
        self._idle_tag: bytes | None = None
        self._auth_tag: bytes | None = None
        self._opened_at: float | None = None
        self._peer = "-"
        self._failures = 0
        self._commands = 0
        self.timeOut = int(self.settings.timeout)
        self.POSTAUTH_TIMEOUT = int(self.settings.timeout)
        self._literalStringLimit = self.settings.max_string_literal
        self.MAX_LENGTH = self.settings.max_line_length * 4  # beyond: BYE, the line is never buffered

    # ------------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        self.tags = {}
        self.canStartTLS = self.factory.tls is not None
        peer = self.transport.getPeer()
        self._peer = getattr(peer, "host", str(peer))
        self.factory.sessions += 1
        self.factory.open.add(self)
        self._opened_at = time.monotonic()
        if self.factory.sessions > self.settings.max_connections:
            self.sendLine(b"* BYE [UNAVAILABLE] Too many connections, try again later")
            self.transport.loseConnection()
            return
        self.setTimeout(self.timeOut)
        self.sendLine(b"* OK [CAPABILITY " + b" ".join(self.listCapabilities()) + b"] cassmail IMAP4rev1 ready")

    def connectionLost(self, reason: Any = None) -> None:
        self._stop_idle()
        if self._opened_at is not None:
            self.factory.sessions -= 1
            self.factory.open.discard(self)
            log.info(kv("session", listener="imap", peer=self._peer, user=self.user, tls=self._secure,
                        commands=self._commands, ms=int((time.monotonic() - self._opened_at) * 1000)))
            self._opened_at = None
        # The view stays: a command still running finishes against it and finds the connection gone.
        self.state = "logout"
        self.setTimeout(None)

    def timeoutConnection(self) -> None:
        self.sendLine(b"* BYE Autologout; idle for too long")
        self.transport.loseConnection()

    def lineLengthExceeded(self, line: bytes) -> None:
        self.sendLine(b"* BYE Line too long")
        self.transport.loseConnection()

    # ------------------------------------------------------------------ one command at a time

    def lineReceived(self, line: bytes) -> None:
        if self.parseState == "command" and self._busy_tag is not None:
            self._queue.append(line)
            return
        self.resetTimeout()
        if len(line) > self.settings.max_line_length:
            if self.parseState == "command":
                tag = line.split(b" ", 1)[0][:64]
                self.sendBadResponse(tag if _TAG.match(tag) and not _BAD_TAG_CHARS.search(tag) else None,
                                     b"Line too long")
            else:
                self._end_continuation(b"Line too long")
            return
        try:
            getattr(self, "parse_" + self.parseState)(line)
        except Exception as exc:  # noqa: BLE001 - nothing a client sends may escape as a traceback
            log.warning(kv("imap-error", peer=self._peer, error=repr(exc)))
            self.parseState = "command"
            self.sendBadResponse(self._busy_tag, b"Syntax error")  # ends the command: the queue moves on

    def _end_continuation(self, message: bytes) -> None:
        tag = self._busy_tag or self._auth_tag or self._idle_tag
        self.parseState = "command"
        self._stop_idle()
        self._auth_tag = self._idle_tag = None
        self.sendBadResponse(tag, message)

    def parse_command(self, line: bytes) -> None:
        parts = line.split(b" ", 2)
        tag = parts[0]
        if not tag or not _TAG.match(tag) or _BAD_TAG_CHARS.search(tag):
            self.sendBadResponse(None, b"Missing or invalid tag")
            return
        if len(parts) < 2 or not parts[1]:
            self.sendBadResponse(tag, b"Missing command")
            return
        self._commands += 1
        self._busy_tag = tag
        cmd = parts[1].upper()
        rest = parts[2] if len(parts) > 2 else None
        try:
            self.dispatchCommand(tag, cmd, rest)
        except (imap4.IllegalClientResponse, InvalidInput) as exc:
            self.sendBadResponse(tag, _syntax_error(exc))
        except No as exc:
            self.sendNegativeResponse(tag, exc.text.encode())
        except (imap4.IllegalOperation, imap4.IllegalMailboxEncoding):
            self.sendNegativeResponse(tag, b"Command not allowed")

    def dispatchCommand(self, tag: bytes, cmd: bytes, rest: bytes | None, uid: Any = None) -> None:
        if not cmd.isalpha():
            raise wire.ParseError("unknown command")
        if self.lookupCommand(cmd) is None:
            known = any(hasattr(self, f"{s}_{cmd.decode('ascii')}") for s in ("unauth", "auth", "select"))
            self.sendBadResponse(tag, b"Command not allowed now" if known else b"Unknown command")
            return
        super().dispatchCommand(tag, cmd, rest, uid)

    def _respond(self, state: bytes, tag: bytes | None, message: bytes) -> None:
        super()._respond(state, tag, message)
        if tag is not None and tag == self._busy_tag:
            self._busy_tag = None
            if self._queue:
                from twisted.internet import reactor

                reactor.callLater(0, self._drain)

    def _drain(self) -> None:
        while self._queue and self._busy_tag is None and self.parseState == "command":
            self.lineReceived(self._queue.pop(0))

    # Twisted's own errback would show the exception's text; this one does not.
    def _IMAP4Server__ebDispatch(self, failure: Any, tag: bytes) -> None:  # noqa: N802
        if failure.check(imap4.IllegalClientResponse, InvalidInput):
            self.sendBadResponse(tag, _syntax_error(failure.value))
        elif failure.check(No):
            self.sendNegativeResponse(tag, failure.value.text.encode())
        else:
            log.warning(kv("imap-error", peer=self._peer, error=repr(failure.value)))
            self.sendBadResponse(tag, b"Syntax error")

    def _spawn(self, tag: bytes, work: Coroutine[Any, Any, bytes | str]) -> None:
        """Run a command's coroutine; it returns the tagged OK text, or raises No/Bad."""

        async def run() -> None:
            try:
                text = await work
            except No as exc:
                self.sendNegativeResponse(tag, exc.text.encode())
            except (Bad, InvalidInput) as exc:
                self.sendBadResponse(tag, _syntax_error(exc))
            except NoSuchMailbox:
                self.sendNegativeResponse(tag, b"[NONEXISTENT] No such mailbox")
            except StoreUnavailable as exc:
                log.warning(kv("imap-store", peer=self._peer, user=self.user, error=exc))
                self.sendNegativeResponse(tag, b"[UNAVAILABLE] Mail store unavailable, try again later")
            except StoreError as exc:  # its text may name files or keys: logged, not shown
                log.warning(kv("imap-store", peer=self._peer, user=self.user, error=repr(exc)))
                self.sendNegativeResponse(tag, b"[SERVERBUG] Mail store error")
            except ConnectionError as exc:  # the connection is gone or had to be closed: nobody to answer
                log.info(kv("imap-closed", peer=self._peer, user=self.user, reason=exc))
                self.transport.loseConnection()
            except Exception as exc:  # noqa: BLE001 - logged here, never shown to the client
                if self._opened_at is None:  # the client left first; what failed after is moot
                    log.info(kv("imap-closed", peer=self._peer, user=self.user, reason=repr(exc)))
                    return
                log.exception("imap command failed")
                self.sendNegativeResponse(tag, b"[SERVERBUG] Internal error")
            else:
                if self.transport is not None and self._opened_at is not None:
                    self.sendPositiveResponse(tag, _ok(text))

        deferred(run())

    # ------------------------------------------------------------------ literals (with LITERAL+)

    def _literal_size(self, line: bytes, limit: int) -> tuple[int, bool]:
        m = _LITERAL.match(line)
        if not m:
            raise wire.ParseError("Malformed literal")
        size, nonsync = int(m.group(1)), bool(m.group(2))
        if size > limit:
            if nonsync:  # its bytes are on their way and cannot be told apart from commands
                self.sendLine(b"* BYE [TOOBIG] Literal too large")
                self.transport.loseConnection()
            raise No("Literal too large", "TOOBIG")
        return size, nonsync

    def _read_literal(self, holder: Any, size: int, nonsync: bool) -> Any:
        from twisted.internet import defer

        d = defer.Deferred()
        self.parseState = "pending"
        self._pendingLiteral = holder(size, d)
        if not nonsync:
            self.sendContinuationRequest(b"Ready for literal data")
        self.setRawMode()
        # what follows the literal on its last line starts with the space before the next argument
        return d.addCallback(lambda got: (got[0], got[1][1:] if got[1][:1] == b" " else got[1]))

    def arg_astring(self, line: bytes, final: bool = False) -> Any:
        line = line.lstrip(b" ")
        if not line:
            raise wire.ParseError("Missing argument")
        if line[:1] == b'"':
            out = bytearray()
            i = 1
            while i < len(line):
                c = line[i : i + 1]
                if c == b"\\":
                    i += 1
                    if line[i : i + 1] not in (b"\\", b'"'):
                        raise wire.ParseError("Bad escape in quoted string")
                    out += line[i : i + 1]
                elif c == b'"':
                    return bytes(out), line[i + 2 :] if line[i + 1 : i + 2] == b" " else line[i + 1 :]
                else:
                    out += c
                i += 1
            raise wire.ParseError("Unmatched quotes")
        if line[:1] == b"{":
            size, nonsync = self._literal_size(line, self._literalStringLimit)
            if final and not size:
                return b"", b""
            return self._read_literal(imap4.LiteralString, size, nonsync)
        arg, _, rest = line.partition(b" ")
        return arg, rest

    def arg_finalastring(self, line: bytes) -> Any:
        return self.arg_astring(line, final=True)

    def arg_literal(self, line: bytes) -> Any:
        limit = self.store.max_message_size or (1 << 31)
        size, nonsync = self._literal_size(line.strip(), limit)
        return self._read_literal(imap4.LiteralFile, size, nonsync)

    def arg_seqset(self, line: bytes) -> Any:
        arg, _, rest = line.partition(b" ")
        return wire.parse_set(arg), rest

    def arg_fetchatt(self, line: bytes) -> Any:
        parser = imap4._FetchParser()
        try:
            parser.parseString(line)
        except Exception as exc:  # noqa: BLE001 - Twisted's parser raises anything on bad input
            log.info(kv("imap-syntax", peer=self._peer, error=repr(exc)))
            raise wire.ParseError("bad FETCH attributes") from None
        if not parser.result:
            raise wire.ParseError("no FETCH attributes")
        return parser.result, b""

    def arg_searchkeys(self, line: bytes, pieces: tuple[bytes, ...] = ()) -> Any:
        """The search keys, across literals: a line ending in `{n}` (or `{n+}`) is followed by n
        bytes of string and the rest of the command on the next line (clients send non-ASCII
        strings so). `pieces` are the text and literals read so far."""
        m = _LITERAL_AT_END.search(line)
        if m is None:
            return search.parse_keys([*pieces, line]), b""
        size, nonsync = self._literal_size(line[m.start() :], self._literalStringLimit)
        text = line[: m.start()]
        d = self._read_literal(imap4.LiteralString, size, nonsync)
        return d.addCallback(lambda got: self.arg_searchkeys(got[1], (*pieces, text, got[0])))

    # ------------------------------------------------------------------ any state

    def _plaintext_ok(self) -> bool:
        return self._secure or self.settings.allow_plaintext_auth

    def listCapabilities(self) -> list[bytes]:
        caps = [b"IMAP4rev1", b"LITERAL+", b"ID", b"ENABLE", b"IDLE", b"NAMESPACE", b"UIDPLUS", b"MOVE",
                b"SPECIAL-USE", b"UNSELECT", b"CHILDREN"]
        if self.user is None:
            if self.factory.tls is not None and not self._secure:
                caps.append(b"STARTTLS")
            caps.append(b"AUTH=PLAIN" if self._plaintext_ok() else b"LOGINDISABLED")
        return caps

    def do_CAPABILITY(self, tag: bytes) -> None:
        self.sendUntaggedResponse(b"CAPABILITY " + b" ".join(self.listCapabilities()))
        self.sendPositiveResponse(tag, b"CAPABILITY completed")

    unauth_CAPABILITY = auth_CAPABILITY = select_CAPABILITY = (do_CAPABILITY,)

    def do_NOOP(self, tag: bytes) -> None:
        if self.view is None:
            self.sendPositiveResponse(tag, b"NOOP completed")
            return
        self._spawn(tag, self._refreshed("NOOP completed"))

    async def _refreshed(self, text: str) -> str:
        await self._refresh(expunge=True)
        return text

    unauth_NOOP = auth_NOOP = select_NOOP = (do_NOOP,)

    def do_LOGOUT(self, tag: bytes) -> None:
        self.sendUntaggedResponse(b"BYE cassmail logging out")
        self.sendPositiveResponse(tag, b"LOGOUT completed")
        self.transport.loseConnection()

    unauth_LOGOUT = auth_LOGOUT = select_LOGOUT = (do_LOGOUT,)

    def do_ID(self, tag: bytes, params: bytes) -> None:
        self.sendUntaggedResponse(b'ID ("name" "cassmail" "vendor" "cassmail")')
        self.sendPositiveResponse(tag, b"ID completed")

    unauth_ID = auth_ID = select_ID = (do_ID, imap4.IMAP4Server.arg_line)

    # ------------------------------------------------------------------ not authenticated

    def do_STARTTLS(self, tag: bytes) -> None:
        if self.factory.tls is None or self._secure:
            self.sendNegativeResponse(tag, b"TLS is not available" if self.factory.tls is None else b"TLS already active")
            return
        # Whatever the client sent after STARTTLS before the handshake came in clear text, where
        # anyone on the path could have put it (a LOGIN, say): it must not run as if it came over
        # TLS (the command injection of CVE-2011-0411). Drop the rest of the line buffer and any
        # line waiting its turn: the session starts afresh once TLS is up.
        dropped = len(self._buffer) + sum(len(line) for line in self._queue)
        self._buffer = b""
        self._queue.clear()
        if dropped:
            log.warning(kv("imap-starttls", peer=self._peer, dropped_bytes=dropped))
        self.sendPositiveResponse(tag, b"Begin TLS negotiation now")
        self.transport.startTLS(self.factory.tls)
        self._secure = True
        self.startedTLS = True

    unauth_STARTTLS = (do_STARTTLS,)

    def do_LOGIN(self, tag: bytes, user: bytes, password: bytes) -> None:
        if not self._plaintext_ok():
            self.sendNegativeResponse(tag, b"[PRIVACYREQUIRED] LOGIN is disabled on a clear-text connection: use STARTTLS")
            return
        self._spawn(tag, self._login(user.decode("utf-8", "replace"), password.decode("utf-8", "replace")))

    unauth_LOGIN = (do_LOGIN, arg_astring, arg_finalastring)

    def do_AUTHENTICATE(self, tag: bytes, mechanism: bytes) -> None:
        if mechanism.upper() != b"PLAIN":
            self.sendNegativeResponse(tag, b"Unsupported authentication mechanism")
            return
        if not self._plaintext_ok():
            self.sendNegativeResponse(tag, b"[PRIVACYREQUIRED] Authentication is disabled on a clear-text connection")
            return
        self._auth_tag = tag
        self.parseState = "authplain"
        self.sendContinuationRequest(None)

    unauth_AUTHENTICATE = (do_AUTHENTICATE, imap4.IMAP4Server.arg_atom)

    def parse_authplain(self, line: bytes) -> None:
        tag, self._auth_tag = self._auth_tag, None
        self.parseState = "command"
        assert tag is not None
        if line.strip() == b"*":
            self.sendBadResponse(tag, b"Authentication cancelled")
            return
        try:
            _authz, login, password = base64.b64decode(line.strip(), validate=True).split(b"\0")
        except (binascii.Error, ValueError):
            self.sendBadResponse(tag, b"Malformed PLAIN response")
            return
        self._spawn(tag, self._login(login.decode("utf-8", "replace"), password.decode("utf-8", "replace")))

    async def _login(self, login: str, password: str) -> str:
        started = time.monotonic()
        throttle = self.factory.throttle
        try:
            user: str | None = Address.parse(login).key
        except InvalidInput:
            user = None
        result = "fail"
        try:
            delay = throttle.penalty(self._peer, user)
            if delay:
                await asyncio.sleep(delay)
            if not await auth.check_password(self.store, user, password):
                throttle.failed(self._peer, user)
                self._failures += 1
                if self._failures >= self.settings.max_auth_failures:
                    self.sendUntaggedResponse(b"BYE Too many authentication failures")
                    self.transport.loseConnection()
                raise No("Authentication failed", "AUTHENTICATIONFAILED")
            throttle.succeeded(user or "")
            self.user, self.state = user, "auth"
            self.setTimeout(self.POSTAUTH_TIMEOUT)
            result = "ok"
            return "[CAPABILITY " + " ".join(c.decode() for c in self.listCapabilities()) + "] Logged in"
        except StoreUnavailable:
            result = "tempfail"
            raise
        finally:
            log.info(kv("auth", listener="imap", peer=self._peer, user=user, result=result,
                        ms=int((time.monotonic() - started) * 1000)))

    # ------------------------------------------------------------------ authenticated

    def do_ENABLE(self, tag: bytes, what: bytes) -> None:
        if not what.strip():
            raise wire.ParseError("ENABLE needs at least one capability")
        self.sendUntaggedResponse(b"ENABLED")  # none of the extensions ENABLE can turn on is offered
        self.sendPositiveResponse(tag, b"ENABLE completed")

    auth_ENABLE = select_ENABLE = (do_ENABLE, imap4.IMAP4Server.arg_line)

    def do_NAMESPACE(self, tag: bytes) -> None:
        self.sendUntaggedResponse(b'NAMESPACE (("" "/")) NIL NIL')
        self.sendPositiveResponse(tag, b"NAMESPACE completed")

    auth_NAMESPACE = select_NAMESPACE = (do_NAMESPACE,)

    def _name(self, raw: bytes) -> str:
        name = wire.decode_mailbox(raw)
        if name.endswith(HIERARCHY_DELIMITER) and len(name) > 1:
            name = name.rstrip(HIERARCHY_DELIMITER)
        try:
            return mailbox_name(name)
        except InvalidInput:
            raise No("Invalid mailbox name", "CANNOT") from None

    def _select_work(self, tag: bytes, name: bytes, readonly: bool = False) -> None:
        self._close_view()
        self._spawn(tag, self._select(self._name(name), readonly))

    def do_SELECT(self, tag: bytes, name: bytes) -> None:
        self._select_work(tag, name)

    def do_EXAMINE(self, tag: bytes, name: bytes) -> None:
        self._select_work(tag, name, readonly=True)

    auth_SELECT = select_SELECT = (do_SELECT, arg_finalastring)
    auth_EXAMINE = select_EXAMINE = (do_EXAMINE, arg_finalastring)

    def _close_view(self) -> None:
        self._stop_idle()
        self.view = None
        if self.state == "select":
            self.state = "auth"

    async def _select(self, name: str, readonly: bool) -> str:
        assert self.user is not None
        info = await self.store.mailbox_info(self.user, name)
        view = MailboxView(self.store, self.user, name, info.uidvalidity, readonly, self.settings.page_size)
        listing = await read_listing(self.store, self.user, name, self.settings.page_size)
        await view.refresh(expunge=True, listing=listing)
        uid_next = await view.select_uid_next(listing.uid_next())
        self.sendUntaggedResponse(b"FLAGS " + SYSTEM_FLAGS)
        self.sendPositiveResponse(None, b"[PERMANENTFLAGS " + (b"()" if readonly else PERMANENT_FLAGS) + b"] Limited")
        self.sendUntaggedResponse(b"%d EXISTS" % len(view))
        self.sendUntaggedResponse(b"%d RECENT" % len(view.recent))
        unseen = view.first_unseen()
        if unseen is not None:
            self.sendPositiveResponse(None, b"[UNSEEN %d] First unseen" % unseen)
        self.sendPositiveResponse(None, b"[UIDVALIDITY %d] UIDs valid" % view.uidvalidity)
        self.sendPositiveResponse(None, b"[UIDNEXT %d] Predicted next UID" % uid_next)
        self.view, self.state = view, "select"
        return ("[READ-ONLY] EXAMINE" if readonly else "[READ-WRITE] SELECT") + " completed"

    def do_CREATE(self, tag: bytes, name: bytes) -> None:
        self._spawn(tag, self._create(self._name(name)))

    async def _create(self, name: str) -> str:
        assert self.user is not None
        if name == INBOX:
            raise No("INBOX always exists", "ALREADYEXISTS")
        try:
            await self.store.create_mailbox(self.user, name)
        except MailboxExists:
            raise No("Mailbox already exists", "ALREADYEXISTS") from None
        return "CREATE completed"

    auth_CREATE = select_CREATE = (do_CREATE, arg_finalastring)

    def do_DELETE(self, tag: bytes, name: bytes) -> None:
        self._spawn(tag, self._delete(self._name(name)))

    async def _delete(self, name: str) -> str:
        assert self.user is not None
        try:
            await self.store.delete_mailbox(self.user, name)
        except MailboxNotAllowed:
            raise No("This mailbox cannot be deleted", "CANNOT") from None
        if self.view is not None and self.view.name == name:
            self.sendUntaggedResponse(b"BYE The selected mailbox was deleted")
            self.transport.loseConnection()
        return "DELETE completed"

    auth_DELETE = select_DELETE = (do_DELETE, arg_finalastring)

    def do_RENAME(self, tag: bytes, old: bytes, new: bytes) -> None:
        self._spawn(tag, self._rename(self._name(old), self._name(new)))

    async def _rename(self, old: str, new: str) -> str:
        assert self.user is not None
        try:
            await self.store.rename_mailbox(self.user, old, new)
        except MailboxExists:
            raise No("Target mailbox exists", "ALREADYEXISTS") from None
        except MailboxNotAllowed:
            raise No("This mailbox cannot be renamed so", "CANNOT") from None
        return "RENAME completed"

    auth_RENAME = select_RENAME = (do_RENAME, arg_astring, arg_finalastring)

    def _subscribe_work(self, tag: bytes, name: bytes, subscribed: bool) -> None:
        self._spawn(tag, self._subscribe(self._name(name), subscribed))

    async def _subscribe(self, name: str, subscribed: bool) -> str:
        assert self.user is not None
        await self.store.set_subscribed(self.user, name, subscribed)
        return ("SUBSCRIBE" if subscribed else "UNSUBSCRIBE") + " completed"

    def do_SUBSCRIBE(self, tag: bytes, name: bytes) -> None:
        self._subscribe_work(tag, name, True)

    def do_UNSUBSCRIBE(self, tag: bytes, name: bytes) -> None:
        self._subscribe_work(tag, name, False)

    auth_SUBSCRIBE = select_SUBSCRIBE = (do_SUBSCRIBE, arg_finalastring)
    auth_UNSUBSCRIBE = select_UNSUBSCRIBE = (do_UNSUBSCRIBE, arg_finalastring)

    def do_LIST(self, tag: bytes, ref: bytes, pattern: bytes) -> None:
        self._spawn(tag, self._list(wire.decode_mailbox(ref), wire.decode_mailbox(pattern), b"LIST"))

    def do_LSUB(self, tag: bytes, ref: bytes, pattern: bytes) -> None:
        self._spawn(tag, self._list(wire.decode_mailbox(ref), wire.decode_mailbox(pattern), b"LSUB"))

    auth_LIST = select_LIST = (do_LIST, arg_astring, arg_finalastring)
    auth_LSUB = select_LSUB = (do_LSUB, arg_astring, arg_finalastring)

    async def _list(self, ref: str, pattern: str, command: bytes) -> str:
        assert self.user is not None
        if not pattern:
            if command == b"LIST":
                self.sendUntaggedResponse(b'LIST (\\Noselect) "/" ""')
            return f"{command.decode()} completed"
        mailboxes = await self.store.list_mailboxes(self.user)
        for name, attrs in list_matches(mailboxes, ref + pattern, subscribed_only=command == b"LSUB"):
            self.sendUntaggedResponse(
                command + b" (" + b" ".join(attrs) + b') "/" ' + wire.astring(wire.encode_mailbox(name))
            )
        return f"{command.decode()} completed"

    def do_STATUS(self, tag: bytes, name: bytes, items: list[bytes]) -> None:
        self._spawn(tag, self._status(self._name(name), items))

    auth_STATUS = select_STATUS = (do_STATUS, arg_astring, imap4.IMAP4Server.arg_plist)

    async def _status(self, name: str, items: list[Any]) -> str:
        assert self.user is not None
        wanted = [i.upper() if isinstance(i, bytes) else b"" for i in items]
        unknown = [w for w in wanted if w not in (b"MESSAGES", b"RECENT", b"UIDNEXT", b"UIDVALIDITY", b"UNSEEN")]
        if unknown or not wanted:
            raise Bad("STATUS items are MESSAGES, RECENT, UIDNEXT, UIDVALIDITY and UNSEEN")
        info = await self.store.mailbox_info(self.user, name)
        messages = unseen = unnumbered = 0
        async for s in self.store.list_messages(self.user, name, self.settings.page_size):
            messages += 1
            unseen += "\\Seen" not in s.flags
            unnumbered += s.uid is None
        values = {
            b"MESSAGES": messages,
            b"RECENT": unnumbered,  # nobody has seen them in a session yet
            b"UIDNEXT": (await self.store.uid_next(self.user, name)) + unnumbered,
            b"UIDVALIDITY": info.uidvalidity,
            b"UNSEEN": unseen,
        }
        line = b" ".join(b"%s %d" % (w, values[w]) for w in wanted)
        self.sendUntaggedResponse(b"STATUS " + wire.astring(wire.encode_mailbox(name)) + b" (" + line + b")")
        return "STATUS completed"

    def do_APPEND(self, tag: bytes, name: bytes, flags: Any, date: Any, message: Any) -> None:
        self._spawn(tag, self._append(name, flags or [], date, message))

    auth_APPEND = select_APPEND = (
        do_APPEND, arg_astring, imap4.IMAP4Server.opt_plist, imap4.IMAP4Server.opt_datetime, arg_literal,
    )

    async def _append(self, raw_name: bytes, flags: list[Any], date: bytes | None, message: Any) -> str:
        assert self.user is not None
        name = self._name(raw_name)
        body = message.read()
        if not all(isinstance(f, bytes) for f in flags):
            raise Bad("flags must be atoms")
        wanted = flag_set(f.decode("ascii", "replace") for f in flags if f.lower() != b"\\recent")
        when = wire.parse_datetime(b'"' + date + b'"') if date is not None else None
        try:
            [message_id] = await self.store.deliver(body, [Target(self.user, name, wanted)], when)
        except NoSuchMailbox:
            raise No("No such mailbox", "TRYCREATE") from None
        except MessageTooLarge:
            raise No("Message too large", "TOOBIG") from None
        # The message is stored: from here on the answer is OK, with APPENDUID when it can be had.
        code = ""
        with contextlib.suppress(StoreUnavailable):
            uids = await self.store.assign_uids(self.user, name, [message_id])
            info = await self.store.mailbox_info(self.user, name)
            if uids.get(message_id):
                code = f"[APPENDUID {info.uidvalidity} {uids[message_id]}] "
            if self.view is not None and self.view.name == name:
                await self._refresh(expunge=False)
        return code + "APPEND completed"

    # ------------------------------------------------------------------ selected

    async def _refresh(self, expunge: bool, listing: Listing | None = None) -> Changes:
        assert self.view is not None
        changes = await self.view.refresh(expunge, listing)
        self._tell(changes)
        return changes

    def _tell(self, changes: Changes) -> None:
        view = self.view
        if view is None:
            return
        for seq in changes.expunged:
            self.sendUntaggedResponse(b"%d EXPUNGE" % seq)
        for uid in changes.flags:
            if uid in view.messages:
                self.sendUntaggedResponse(b"%d FETCH (FLAGS %s UID %d)" % (view.seq(uid), wire.flag_list(view.flags(uid)), uid))
        if changes.exists is not None:
            self.sendUntaggedResponse(b"%d EXISTS" % changes.exists)
            self.sendUntaggedResponse(b"%d RECENT" % (changes.recent or 0))

    def _uids(self, ranges: list[tuple[int | None, int | None]], uid: bool) -> list[int]:
        assert self.view is not None
        resolved = wire.resolve_set(ranges, self.view.largest(uid))
        return self.view.by_uid(resolved) if uid else self._check_seqs(resolved)

    def _check_seqs(self, resolved: list[tuple[int, int]]) -> list[int]:
        assert self.view is not None
        if any(hi > len(self.view) for _, hi in resolved):
            raise Bad("Message sequence number out of range")
        return self.view.by_seq(resolved)

    def do_CHECK(self, tag: bytes) -> None:
        self._spawn(tag, self._refreshed("CHECK completed"))

    select_CHECK = (do_CHECK,)

    def do_CLOSE(self, tag: bytes) -> None:
        self._spawn(tag, self._close())

    select_CLOSE = (do_CLOSE,)

    async def _close(self) -> str:
        view = self.view
        assert view is not None
        if not view.readonly:
            await view.refresh(expunge=False)
            doomed = [u for u in view.uids if "\\Deleted" in view.messages[u].flags]
            if doomed:
                await self.store.delete_messages(view.user, view.name, [view.messages[u].id for u in doomed])
        self._close_view()
        return "CLOSE completed"

    def do_UNSELECT(self, tag: bytes) -> None:
        self._close_view()
        self.sendPositiveResponse(tag, b"UNSELECT completed")

    select_UNSELECT = (do_UNSELECT,)

    def do_EXPUNGE(self, tag: bytes, ranges: Any = None, uid: int = 0) -> None:
        self._spawn(tag, self._expunge(ranges if uid else None))

    select_EXPUNGE = (do_EXPUNGE,)

    async def _expunge(self, ranges: Any) -> str:
        view = self.view
        assert view is not None
        if view.readonly:
            raise No("Mailbox is read-only", "READ-ONLY")
        await self._refresh(expunge=True)
        candidates = self._uids(ranges, True) if ranges is not None else view.uids
        doomed = [u for u in candidates if "\\Deleted" in view.messages[u].flags]
        if doomed:
            await self.store.delete_messages(view.user, view.name, [view.messages[u].id for u in doomed])
            for seq in view.remove(doomed):
                self.sendUntaggedResponse(b"%d EXPUNGE" % seq)
        return "EXPUNGE completed"

    def do_UID(self, tag: bytes, command: bytes, line: bytes) -> None:
        command = command.upper()
        if command not in (b"COPY", b"MOVE", b"FETCH", b"STORE", b"SEARCH", b"EXPUNGE"):
            raise wire.ParseError("UID goes with COPY, MOVE, FETCH, STORE, SEARCH or EXPUNGE")
        if command == b"EXPUNGE":
            ranges, rest = self.arg_seqset(line)
            if rest:
                raise wire.ParseError("UID EXPUNGE takes one sequence set")
            self.do_EXPUNGE(tag, ranges, uid=1)
            return
        self.dispatchCommand(tag, command, line, uid=1)

    select_UID = (do_UID, imap4.IMAP4Server.arg_atom, imap4.IMAP4Server.arg_line)

    # ---- SEARCH

    def do_SEARCH(self, tag: bytes, charset: Any, query: list[Any], uid: int = 0) -> None:
        if charset is not None and charset.upper() not in (b"US-ASCII", b"UTF-8"):
            self.sendNegativeResponse(tag, b"[BADCHARSET (US-ASCII UTF-8)] Unsupported charset")
            return
        self._spawn(tag, self._search(query, bool(uid)))

    select_SEARCH = (do_SEARCH, imap4.IMAP4Server.opt_charset, arg_searchkeys)

    async def _search(self, query: list[Any], uid: bool) -> str:
        view = self.view
        assert view is not None
        program = search.compile_query(query, view, uid)
        hits = []
        for message_uid in list(view.uids):
            entity = None
            if program.needs_body:
                try:
                    entity = mime.parse(await self.store.read_message(view.user, view.name, view.messages[message_uid].id))
                except NoSuchMessage:
                    continue
            elif program.needs_headers:
                entity = await self._headers_only(message_uid)
                if entity is None:
                    continue
            if program.match(message_uid, entity):
                hits.append(message_uid if uid else view.seq(message_uid))
        self.sendUntaggedResponse(b"SEARCH" + b"".join(b" %d" % n for n in hits))
        return "SEARCH completed"

    async def _headers_only(self, message_uid: int) -> mime.Entity | None:
        view = self.view
        assert view is not None
        summary = view.messages[message_uid]
        data = bytearray()
        try:
            # a window at a time, so a store that reads ahead does not fetch the whole body
            while len(data) < min(summary.size, HEADER_LIMIT):
                end = min(summary.size, len(data) + HEADER_WINDOW)
                async for chunk in self.store.read_chunks(view.user, view.name, summary.id, len(data), end):
                    data += chunk
                if b"\n\r\n" in data or b"\n\n" in data:
                    break
        except NoSuchMessage:
            return None
        return mime.parse(bytes(data))

    # ---- FETCH

    def do_FETCH(self, tag: bytes, ranges: Any, query: list[Any], uid: int = 0) -> None:
        self._spawn(tag, self._fetch(ranges, query, bool(uid)))

    select_FETCH = (do_FETCH, arg_seqset, arg_fetchatt)

    async def _fetch(self, ranges: Any, query: list[Any], uid: bool) -> str:
        view = self.view
        assert view is not None
        uids = self._uids(ranges, uid)
        if uid and not any(p.type == "uid" for p in query):
            query = list(query) + [imap4._FetchParser.UID()]
        sets_seen = not view.readonly and any(
            (p.type == "body" and not p.peek and not _body_structure(p)) or p.type in ("rfc822", "rfc822text")
            for p in query
        )
        if sets_seen:
            unseen = [u for u in uids if "\\Seen" not in view.messages[u].flags]
            if unseen:
                await self.store.store_flags(view.user, view.name, [view.messages[u].id for u in unseen], ["\\Seen"], "add")
                for u in unseen:
                    view.set_flags(u, view.messages[u].flags | {"\\Seen"})
                if not any(p.type == "flags" for p in query):
                    query = list(query) + [imap4._FetchParser.Flags()]
        missing = 0
        gate = WriteGate(self.transport, self.factory.settings.write_timeout)
        self.transport.registerProducer(gate, True)
        try:
            for message_uid in uids:
                if self._opened_at is None:
                    raise ConnectionError("client went away")
                if view.messages.get(message_uid) is None:
                    continue
                try:
                    await self._fetch_one(message_uid, query, gate)
                except NoSuchMessage:
                    missing += 1
        finally:
            if self.transport is not None:
                self.transport.unregisterProducer()
        if missing:
            raise No("Some messages were expunged meanwhile", "EXPUNGEISSUED")
        return ("UID " if uid else "") + "FETCH completed"

    async def _fetch_one(self, message_uid: int, query: list[Any], gate: WriteGate) -> None:
        view = self.view
        assert view is not None
        summary = view.messages[message_uid]
        streamed = [p for p in query if _streamable(p)]
        parsed = [p for p in query if p.type in ("envelope", "bodystructure", "rfc822header", "rfc822text", "rfc822")
                  or (p.type == "body" and p not in streamed)]
        entity = None
        if parsed and all(_header_only(p) for p in parsed):
            # what mail clients ask for when they list a mailbox: the header is enough
            entity = await self._headers_only(message_uid)
            if entity is None:
                raise NoSuchMessage(view.name, summary.id)
        elif parsed:
            entity = mime.parse(await self.store.read_message(view.user, view.name, summary.id))
        # Every store read that can fail comes before the first byte of this response: a failure
        # then is a clean NO. Once a literal is announced, a failure can only end the connection.
        # A stalled or vanished client leaves streams unread: their files and reads are given back.
        async with contextlib.AsyncExitStack() as unread:
            streams = {}
            for p in streamed:
                streams[id(p)] = stream = await self._open_stream(summary, p)
                if stream[3] is not None:
                    unread.push_async_callback(stream[3].aclose)
            out: list[bytes] = []
            write = self.transport.write
            head = b"* %d FETCH (" % view.seq(message_uid)
            for n, part in enumerate(query):
                if part in streamed:
                    write(head + b" ".join(out) + (b" " if out else b""))
                    head, out = b"", []
                    await self._send_stream(streams[id(part)], gate)
                    if n + 1 < len(query):
                        write(b" ")
                    continue
                out.append(self._item(message_uid, part, entity))
            write(head + b" ".join(out) + b")\r\n")
            await gate.wait()

    def _item(self, message_uid: int, part: Any, entity: mime.Entity | None) -> bytes:
        view = self.view
        assert view is not None
        summary = view.messages[message_uid]
        kind = part.type
        if kind == "flags":
            return b"FLAGS " + wire.flag_list(view.flags(message_uid))
        if kind == "uid":
            return b"UID %d" % message_uid
        if kind == "internaldate":
            return b"INTERNALDATE " + wire.format_datetime(summary.internal_date)
        if kind == "rfc822size":
            return b"RFC822.SIZE %d" % summary.size
        assert entity is not None
        if kind == "envelope":
            return b"ENVELOPE " + wire.encode(mime.envelope(entity.headers))
        if kind == "bodystructure":
            return b"BODYSTRUCTURE " + wire.encode(mime.bodystructure(entity, True))
        if kind == "rfc822header":
            return b"RFC822.HEADER " + wire.literal(entity.header_bytes())
        if kind == "rfc822text":
            return b"RFC822.TEXT " + wire.literal(entity.body_bytes())
        if kind == "rfc822":
            return b"RFC822 " + wire.literal(entity.raw)
        # BODY[...] and BODY
        if _body_structure(part):
            return b"BODY " + wire.encode(mime.bodystructure(entity, False))
        data = _section(entity, part)
        name = _section_name(part)
        if part.partialBegin is not None:
            data = data[part.partialBegin : part.partialBegin + part.partialLength]
            name += b"<%d>" % part.partialBegin
        return name + b" " + wire.literal(data)

    async def _open_stream(self, summary: Any, part: Any) -> tuple[bytes, int, bytes, Any]:
        """BODY[] / BODY[]<a.b> / RFC822, to be streamed: (item name, length, first piece, the rest)."""
        view = self.view
        assert view is not None
        start, end = 0, summary.size
        name = b"RFC822" if part.type == "rfc822" else _section_name(part)
        if part.type == "body" and part.partialBegin is not None:
            start = min(part.partialBegin, summary.size)
            end = min(start + part.partialLength, summary.size)
            name += b"<%d>" % part.partialBegin
        if end <= start:
            return name, 0, b"", None
        rest = self.store.read_chunks(view.user, view.name, summary.id, start, end).__aiter__()
        try:
            first = await rest.__anext__()
        except StopAsyncIteration:
            first, rest = b"", None
        return name, end - start, first, rest

    async def _send_stream(self, stream: tuple[bytes, int, bytes, Any], gate: WriteGate) -> None:
        """The item straight from the store to the socket, a piece at a time, with flow control."""
        name, length, first, rest = stream
        write = self.transport.write
        write(name + b" {%d}\r\n" % length)
        write(first)
        sent = len(first)
        try:
            if rest is not None:
                async for chunk in rest:
                    await gate.wait()
                    write(chunk)
                    sent += len(chunk)
        except StoreError as exc:
            self.transport.loseConnection()
            raise ConnectionError(f"store failed in the middle of a literal: {exc}") from exc
        if sent != length:  # the store changed under us: the literal's length cannot be kept
            self.transport.loseConnection()
            raise ConnectionError("message changed while it was sent")

    # ---- STORE

    def do_STORE(self, tag: bytes, ranges: Any, mode: bytes, flags: list[bytes], uid: int = 0) -> None:
        self._spawn(tag, self._store_flags(ranges, mode, flags, bool(uid)))

    select_STORE = (do_STORE, arg_seqset, imap4.IMAP4Server.arg_atom, imap4.IMAP4Server.arg_flaglist)

    async def _store_flags(self, ranges: Any, mode: bytes, raw_flags: list[bytes], uid: bool) -> str:
        view = self.view
        assert view is not None
        item = mode.upper()
        silent = item.endswith(b".SILENT")
        base = item[: -len(b".SILENT")] if silent else item
        how = {b"FLAGS": "set", b"+FLAGS": "add", b"-FLAGS": "remove"}.get(base)
        if how is None:
            raise Bad("STORE takes FLAGS, +FLAGS or -FLAGS (optionally .SILENT)")
        if view.readonly:
            raise No("Mailbox is read-only", "READ-ONLY")
        flags = flag_set(f.decode("ascii", "replace") for f in raw_flags if f.lower() != b"\\recent")
        uids = self._uids(ranges, uid)
        if uids:
            await self.store.store_flags(view.user, view.name, [view.messages[u].id for u in uids], flags, how)
        for u in uids:
            old = view.messages[u].flags
            new = flags if how == "set" else (old | flags if how == "add" else old - flags)
            view.set_flags(u, frozenset(new))
            if not silent:
                self.sendUntaggedResponse(
                    b"%d FETCH (FLAGS %s%s)" % (view.seq(u), wire.flag_list(view.flags(u)), b" UID %d" % u if uid else b"")
                )
        return ("UID " if uid else "") + "STORE completed"

    # ---- COPY and MOVE

    def do_COPY(self, tag: bytes, ranges: Any, name: bytes, uid: int = 0) -> None:
        self._spawn(tag, self._copy(ranges, self._name(name), bool(uid), move=False))

    def do_MOVE(self, tag: bytes, ranges: Any, name: bytes, uid: int = 0) -> None:
        self._spawn(tag, self._copy(ranges, self._name(name), bool(uid), move=True))

    select_COPY = (do_COPY, arg_seqset, arg_finalastring)
    select_MOVE = (do_MOVE, arg_seqset, arg_finalastring)

    async def _copy(self, ranges: Any, dest: str, uid: bool, move: bool) -> str:
        view = self.view
        assert view is not None
        if move and view.readonly:
            raise No("Mailbox is read-only", "READ-ONLY")
        uids = self._uids(ranges, uid)
        verb = ("UID " if uid else "") + ("MOVE" if move else "COPY")
        try:
            info = await self.store.mailbox_info(view.user, dest)
        except NoSuchMailbox:
            raise No("No such mailbox", "TRYCREATE") from None
        if not uids:
            return f"{verb} completed"
        ids = [view.messages[u].id for u in uids]
        try:
            new_ids = await self.store.copy_messages(view.user, view.name, ids, dest)
        except NoSuchMessage:
            raise No("Some messages were expunged meanwhile", "EXPUNGEISSUED") from None
        # The copies are stored: from here on the answer is OK, with COPYUID when it can be had.
        code = ""
        with contextlib.suppress(StoreUnavailable):
            new_uids = await self.store.assign_uids(view.user, dest, new_ids)
            code = "[COPYUID %d %s %s]" % (
                info.uidvalidity, _uid_set(uids), _uid_set([new_uids[i] for i in new_ids if i in new_uids])
            )
        if move:
            await self.store.delete_messages(view.user, view.name, ids)
            self.sendPositiveResponse(None, (code + " Moved").strip().encode())
            for seq in view.remove(uids):
                self.sendUntaggedResponse(b"%d EXPUNGE" % seq)
            code = ""
        if dest == view.name:
            await self._refresh(expunge=False)
        return f"{code} {verb} completed".strip()

    # ---- IDLE

    def do_IDLE(self, tag: bytes) -> None:
        self._idle_tag = tag
        self.parseState = "idle"
        self.sendContinuationRequest(b"idling")
        if self.view is not None:
            self._idle = asyncio.ensure_future(self._idle_loop())

    auth_IDLE = select_IDLE = (do_IDLE,)

    async def _idle_loop(self) -> None:
        watcher = self.factory.watcher(self.view)
        try:
            while self.view is not None:
                listing = await watcher.next()
                if self.view is None or self.parseState != "idle":
                    return
                await self._refresh(True, listing)
        except asyncio.CancelledError:
            pass
        finally:
            watcher.release()

    def parse_idle(self, line: bytes) -> None:
        tag, self._idle_tag = self._idle_tag, None
        self.parseState = "command"
        self._stop_idle()
        if line.strip().upper() == b"DONE":
            self.sendPositiveResponse(tag, b"IDLE terminated")
        else:
            self.sendBadResponse(tag, b"Expected DONE")

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None


# --------------------------------------------------------------------------- helpers


def _syntax_error(exc: BaseException) -> bytes:
    """The text of a BAD answer. Only cassmail's own syntax errors (`wire.ParseError`, `Bad`),
    whose texts are fixed descriptions of the rule that was broken, say which; anything else
    (Twisted's parsers, the model's checks) may carry Python reprs of the input or of an
    exception, so it is answered with the fixed text alone."""
    if isinstance(exc, (wire.ParseError, Bad)) and str(exc):
        text = str(exc).splitlines()[0].encode("ascii", "replace")[:200]
        return b"Syntax error: " + text if isinstance(exc, wire.ParseError) else text
    return b"Invalid argument" if isinstance(exc, InvalidInput) else b"Syntax error"


def _body_structure(part: Any) -> bool:
    """BODY without a section: the structure (BODYSTRUCTURE without extension data), which reads
    no content and so sets no \\Seen."""
    return (part.type == "body" and not part.empty and part.header is None and part.text is None
            and part.mime is None and not part.part)


def _streamable(part: Any) -> bool:
    """BODY[] (maybe partial) and RFC822 need no parsing: they are streamed."""
    if part.type == "rfc822":
        return True
    return (part.type == "body" and part.empty and not part.part and part.header is None
            and part.text is None and part.mime is None)


def _header_only(part: Any) -> bool:
    """Items answered from the top-level header alone (ENVELOPE, BODY[HEADER...], RFC822.HEADER)."""
    if part.type in ("envelope", "rfc822header"):
        return True
    return part.type == "body" and not part.part and part.header is not None


def _section_name(part: Any) -> bytes:
    name = part.getBytes()
    return name.split(b"<", 1)[0]


def _section(entity: mime.Entity, part: Any) -> bytes:
    path = tuple(p + 1 for p in part.part)
    try:
        target = mime.subpart(entity, path) if path else entity
    except mime.NoSuchPart:
        return b""
    if part.mime is not None:
        return target.header_bytes() if path else b""
    message = target.message if (path and target.message is not None) else (target if not path else None)
    if part.header is not None:
        if message is None:
            return b""
        header = message.header_bytes()
        if part.header.fields:
            names = [f.decode("ascii", "replace") if isinstance(f, bytes) else str(f) for f in part.header.fields]
            return mime.header_fields(header, names, bool(part.header.negate))
        return header
    if part.text is not None:
        return message.body_bytes() if message is not None else b""
    return target.body_bytes() if path else entity.raw


def _uid_set(uids: list[int]) -> str:
    """A compact uid-set: 4,5,6,9 -> 4:6,9."""
    out: list[str] = []
    run: list[int] = []
    for u in uids:
        if run and u == run[-1] + 1:
            run.append(u)
            continue
        if run:
            out.append(f"{run[0]}:{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [u]
    if run:
        out.append(f"{run[0]}:{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def list_matches(mailboxes: list[MailboxInfo], pattern: str, subscribed_only: bool) -> list[tuple[str, list[bytes]]]:
    """LIST/LSUB: the names matching a pattern (`*` any, `%` within a level) with their attributes;
    levels that exist only as parents of others are listed \\Noselect."""
    names = {m.name: m for m in mailboxes}
    parents: set[str] = set()
    for name in names:
        levels = name.split(HIERARCHY_DELIMITER)
        parents.update(HIERARCHY_DELIMITER.join(levels[:i]) for i in range(1, len(levels)))
    expr = "".join(".*" if c == "*" else "[^/]*" if c == "%" else re.escape(c) for c in pattern) + r"\Z"
    regex = re.compile(expr, re.DOTALL)
    inbox = re.compile(expr, re.DOTALL | re.IGNORECASE)  # INBOX matches in any case (RFC 3501 5.1)
    out = []
    for name in sorted(set(names) | parents):
        if not (inbox if name == INBOX else regex).match(name):
            continue
        box = names.get(name)
        if subscribed_only and (box is None or not box.subscribed):
            continue
        attrs = [b"\\HasChildren" if name in parents else b"\\HasNoChildren"]
        if box is None:
            attrs.insert(0, b"\\Noselect")
        elif box.special_use:
            attrs.append(box.special_use.encode())
        out.append((name, attrs))
    return out


class ImapFactory(ServerFactory):
    """Shared by every session of one listener in one worker: store, settings, the login
    throttle, the session count, and the mailbox watchers IDLE sessions share."""

    def __init__(self, store: Store, settings: ImapSettings, tls: Any) -> None:
        self.store, self.settings, self.tls = store, settings, tls
        self.throttle = auth.FailureThrottle(settings.auth_failure_delay)
        self.sessions = 0
        #: The sessions themselves, for a stopping worker to cut those its grace period did not end.
        self.open: set[ImapSession] = set()
        self._watchers: dict[tuple[str, str], Watcher] = {}

    def buildProtocol(self, addr: Any) -> ImapSession:
        return ImapSession(self)

    def watcher(self, view: MailboxView | None) -> Watcher:
        assert view is not None
        key = (view.user, view.name)
        found = self._watchers.get(key)
        if found is None:
            found = self._watchers[key] = Watcher(self, key)
        found.users += 1
        return found


class Watcher:
    """One reader per watched mailbox and worker: every `idle_poll` seconds it lists the mailbox
    (giving UIDs to new messages) and hands the same listing to every IDLE session on it, so the
    store is asked once per interval however many sessions idle on the mailbox."""

    def __init__(self, factory: ImapFactory, key: tuple[str, str]) -> None:
        self.factory, self.key = factory, key
        self.users = 0
        self._next: asyncio.Future[Listing] = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        settings, store = self.factory.settings, self.factory.store
        while True:
            await asyncio.sleep(settings.idle_poll)
            try:
                listing = await read_listing(store, self.key[0], self.key[1], settings.page_size)
            except StoreError as exc:
                log.warning(kv("imap-idle", user=self.key[0], mailbox=self.key[1], error=exc))
                continue
            done, self._next = self._next, asyncio.get_running_loop().create_future()
            done.set_result(listing)

    async def next(self) -> Listing:
        """The next listing (waits for the next tick)."""
        return await asyncio.shield(self._next)

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self._task.cancel()
            self.factory._watchers.pop(self.key, None)
