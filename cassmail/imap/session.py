"""One IMAP session: the state machine (RFC 3501 section 3) that reads typed commands and runs
them one at a time.

The loop reads a command (`connection.Connection`), parses it (`parse`), checks that its
state allows it, and awaits its handler from the command-family modules (`login`,
`mailboxes`, `selected`, `fetch`, `search`, `idle`). A handler returns the text of the
tagged OK or raises `No` / `Bad`; the store's errors become NO with their response codes here,
in one place, and no exception text ever reaches a client. Commands never overlap, so
responses never interleave: pipelined commands wait in the connection's buffer.

The selected mailbox is a `MailboxView`, brought up to date at SELECT, NOOP, CHECK, EXPUNGE,
IDLE and after APPEND, COPY or MOVE into it, never in the middle of FETCH, STORE or SEARCH
(RFC 3501 7.4.1: no EXPUNGE during those).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cassmail.config import ImapSettings
from cassmail.imap import commands as c
from cassmail.imap import condstore, parse, wire
from cassmail.imap.connection import ClientStalled, Closed, Connection, Frame, LineTooLong, LiteralTooLarge
from cassmail.imap.errors import Bad, No
from cassmail.imap.view import Changes, Listing, MailboxView, keywords_of
from cassmail.logs import kv
from cassmail.model import HIERARCHY_DELIMITER, InvalidInput, mailbox_name
from cassmail.sessions import quick_ack
from cassmail.store.base import NoSuchMailbox, QuotaExceeded, Store, StoreError, StoreUnavailable

if TYPE_CHECKING:
    from cassmail.imap.listener import Listener

log = logging.getLogger("cassmail.imap")

SYSTEM_FLAGS = ("\\Answered", "\\Flagged", "\\Deleted", "\\Seen", "\\Draft")

Handler = Callable[["Session", Any], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Entry:
    """Where a command may run and what runs it."""

    states: frozenset[str]
    run: Handler


UNAUTH = frozenset({"unauth"})
AUTH = frozenset({"auth", "selected"})
SELECTED = frozenset({"selected"})
ANY = UNAUTH | AUTH


class Session:
    """One connection's state: who is logged in, the selected mailbox, and the command loop."""

    def __init__(self, listener: Listener, conn: Connection, peer: str, secure: bool) -> None:
        self.listener = listener
        self.conn = conn
        self.store: Store = listener.store
        self.settings: ImapSettings = listener.settings
        self.peer = peer
        self.secure = secure
        self.state = "unauth"
        self.user: str | None = None
        self.view: MailboxView | None = None
        self.failures = listener.logins.failures()
        self.commands = 0
        #: The tag of the command running (ESEARCH names it in its response).
        self.tag = b""
        self.compressed = False
        #: ENABLE UTF8=ACCEPT (RFC 6855): mailbox names in UTF-8 both ways, not modified UTF-7.
        self.utf8 = False
        #: RFC 7162: a CONDSTORE enabling command was run (MODSEQ in every FETCH response from
        #: then on), ENABLE QRESYNC (VANISHED instead of EXPUNGE). See `condstore`.
        self.condstore = False
        self.qresync = False
        self.closing = False
        #: Run after the tagged answer is written (STARTTLS starts TLS then).
        self.then: Callable[[], Awaitable[None]] | None = None
        self.opened_at = time.monotonic()

    @property
    def transport(self) -> Any:
        """For a stopping worker that cuts the sessions its grace period did not end."""
        return self.conn.transport

    # ------------------------------------------------------------------ output

    def untagged(self, data: bytes) -> None:
        self.conn.write(b"* " + data + b"\r\n")

    def tagged(self, tag: bytes | None, status: bytes, text: bytes) -> None:
        self.conn.write((tag or b"*") + b" " + status + b" " + text + b"\r\n")

    def continuation(self, text: bytes = b"") -> None:
        self.conn.write(b"+ " + text + b"\r\n")

    # ------------------------------------------------------------------ the loop

    async def run(self, admitted: bool = True) -> None:
        conn = self.conn
        try:
            if not admitted:
                self.untagged(b"BYE [UNAVAILABLE] Too many connections, try again later")
                return
            self.untagged(b"OK [CAPABILITY " + b" ".join(self.capabilities()) + b"] cassmail IMAP4rev1 ready")
            conn.command_timeout = self.settings.timeout
            while not self.closing:
                try:
                    frame = await self._read_command()
                except TimeoutError:
                    self.untagged(b"BYE Autologout; idle for too long")
                    break
                except LineTooLong as exc:
                    self.tagged(_tag_of(exc.start), b"BAD", b"Line too long")
                    continue
                except LiteralTooLarge as exc:
                    if not exc.synchronising:  # its bytes are coming and cannot be told from commands
                        self.untagged(b"BYE [TOOBIG] Literal too large")
                        break
                    if exc.valid:
                        self.tagged(_tag_of(exc.start), b"NO", b"[TOOBIG] Literal too large")
                    else:
                        self.tagged(_tag_of(exc.start), b"BAD", b"Syntax error: literal size out of range")
                    continue
                await self.execute(frame)
                await conn.drain()
        except ClientStalled as exc:
            log.info(kv("imap-closed", peer=self.peer, user=self.user, reason=exc))
        except Closed:
            pass  # the client left: nobody to answer
        finally:
            self.close_view()
            conn.close()

    def _read_command(self) -> Awaitable[Frame]:
        return self.conn.read_command(self.listener.message_limit, self.settings.max_string_literal,
                                      self.settings.max_line_length, self._literal_wanted)

    def _literal_wanted(self) -> None:
        """The continuation a synchronising literal waits for; its bytes are acknowledged at once."""
        self.continuation(b"Ready for literal data")
        self.conn.flush()
        quick_ack(self.conn.transport)

    async def execute(self, frame: Frame) -> None:
        """Parse, check the state, run, answer."""
        tag, name, cursor = parse.parse_tag(frame)
        if tag is None:
            self.untagged(b"BAD Missing or invalid tag")
            return
        if not name:
            self.tagged(tag, b"BAD", b"Missing command")
            return
        self.commands += 1
        self.tag = tag
        key = name.decode("ascii", "replace")
        entry = COMMANDS.get(key)
        if entry is None:
            self.tagged(tag, b"BAD", b"Unknown command")
            return
        if self.state not in entry.states:
            self.tagged(tag, b"BAD", b"Command not allowed now")
            return
        try:
            command = parse.parse_command(tag, name, cursor)
        except parse.LimitExceeded as exc:
            text = str(exc)
            self.tagged(tag, b"NO", b"[LIMIT] " + (text[:1].upper() + text[1:]).encode())
            return
        except InvalidInput as exc:
            self.tagged(tag, b"BAD", _syntax_error(exc))
            return
        if command.name != key:  # UID FETCH and friends: the command itself decides
            entry = COMMANDS[command.name]
        status, text = await self._run(entry, command)
        if self.conn.lost:
            return
        self.tagged(tag, status, text)
        then, self.then = self.then, None
        if then is not None:
            self.conn.flush()  # the answer goes out before the transport changes (STARTTLS, COMPRESS)
            await then()

    async def _run(self, entry: Entry, command: c.Command) -> tuple[bytes, bytes]:
        try:
            text = await entry.run(self, command.args)
        except No as exc:
            return b"NO", exc.text.encode()
        except (Bad, InvalidInput) as exc:
            return b"BAD", _syntax_error(exc)
        except NoSuchMailbox:
            return b"NO", b"[NONEXISTENT] No such mailbox"
        except QuotaExceeded:  # APPEND, COPY, MOVE: refused before anything was stored (RFC 9208)
            return b"NO", b"[OVERQUOTA] Quota exceeded, nothing was stored"
        except StoreUnavailable as exc:
            log.warning(kv("imap-store", peer=self.peer, user=self.user, error=exc))
            return b"NO", b"[UNAVAILABLE] Mail store unavailable, try again later"
        except StoreError as exc:  # its text may name files or keys: logged, not shown
            log.warning(kv("imap-store", peer=self.peer, user=self.user, error=repr(exc)))
            return b"NO", b"[SERVERBUG] Mail store error"
        except Closed:
            raise
        except ConnectionError as exc:  # the connection had to be closed: nobody to answer
            log.info(kv("imap-closed", peer=self.peer, user=self.user, reason=exc))
            self.conn.abort()
            raise Closed(str(exc)) from exc
        except Exception:  # noqa: BLE001 - logged here, never shown to the client
            if self.conn.lost:
                raise Closed("the client went away") from None
            log.exception(kv("imap-error", peer=self.peer, user=self.user, command=command.name))
            return b"NO", b"[SERVERBUG] Internal error"
        return b"OK", text.encode("utf-8", "replace")

    # ------------------------------------------------------------------ shared by the commands

    def capabilities(self) -> list[bytes]:
        caps = [b"IMAP4rev1", b"LITERAL+", b"SASL-IR", b"ID", b"ENABLE", b"IDLE", b"NAMESPACE", b"UIDPLUS",
                b"MOVE", b"SPECIAL-USE", b"UNSELECT", b"CHILDREN", b"LIST-EXTENDED", b"LIST-STATUS", b"ESEARCH",
                b"STATUS=SIZE", b"COMPRESS=DEFLATE", b"SORT", b"SORT=DISPLAY", b"THREAD=ORDEREDSUBJECT",
                b"THREAD=REFERENCES", b"BINARY", b"UTF8=ACCEPT", b"CONDSTORE", b"QRESYNC", b"QUOTA",
                b"QUOTA=RES-STORAGE"]
        if self.store.max_message_size:
            caps.append(b"APPENDLIMIT=%d" % self.store.max_message_size)
        if self.user is None:
            if self.listener.tls is not None and not self.secure:
                caps.append(b"STARTTLS")
            caps.append(b"AUTH=PLAIN" if self.listener.logins.plaintext_ok(self.secure) else b"LOGINDISABLED")
        return caps

    def decode_name(self, raw: bytes) -> str:
        """A mailbox name (or LIST pattern) from the wire: modified UTF-7, or UTF-8 once the
        client enabled UTF8=ACCEPT. Raises wire.ParseError."""
        if not self.utf8:
            return wire.decode_mailbox(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise wire.ParseError("mailbox name is not valid UTF-8") from None

    def encode_name(self, name: str) -> bytes:
        """A mailbox name for a response, as the client reads them (see decode_name)."""
        return wire.astring(name, utf8=True) if self.utf8 else wire.astring(wire.encode_mailbox(name))

    def mailbox(self, raw: bytes) -> str:
        """A mailbox name from the wire, canonical; a name that is not valid modified UTF-7 or
        not a valid name is NO [CANNOT] (the name is the trouble, not the command's syntax)."""
        try:
            name = self.decode_name(raw)
        except wire.ParseError as exc:
            text = str(exc)
            raise No(text[:1].upper() + text[1:], "CANNOT") from None
        if name.endswith(HIERARCHY_DELIMITER) and len(name) > 1:
            name = name.rstrip(HIERARCHY_DELIMITER)
        try:
            return mailbox_name(name)
        except InvalidInput:
            raise No("Invalid mailbox name", "CANNOT") from None

    def selected(self) -> MailboxView:
        assert self.view is not None
        return self.view

    def close_view(self) -> None:
        view = self.view
        if view is not None and (snapshot := view.snapshot()) is not None:
            self.listener.snapshots.put(view.user, view.name, snapshot)
        self.view = None
        if self.state == "selected":
            self.state = "auth"

    async def refresh(self, expunge: bool, listing: Listing | None = None, highest: bool = True) -> Changes:
        """Bring the view up to date and tell the client what changed (with QRESYNC, and
        `highest`, a new HIGHESTMODSEQ too)."""
        changes = await self.selected().refresh(expunge, listing)
        self.tell(changes, highest)
        return changes

    def tell(self, changes: Changes, highest: bool = True) -> None:
        view = self.view
        if view is None:
            return
        condstore.tell_expunged(self, changes.expunged, changes.vanished)
        shown = [u for u in changes.flags if u in view.messages]
        self.announce_flags(shown)
        if self.condstore:  # a MODSEQ that changed alone is news to a CONDSTORE client
            shown = sorted(shown + [u for u in changes.modseqs if u in view.messages])
        for uid in shown:
            self.untagged(condstore.flags_fetch(self, uid))
        if changes.exists is not None:
            self.untagged(b"%d EXISTS" % changes.exists)
        if changes.recent is not None:
            self.untagged(b"%d RECENT" % changes.recent)
        if highest:
            condstore.tell_highest(self)

    def expunged(self, uids: list[int]) -> None:
        """Take messages this session expunged (EXPUNGE, MOVE) out of the view and say so."""
        view = self.selected()
        present = [u for u in uids if u in view.messages]
        condstore.tell_expunged(self, view.remove(present), sorted(present))

    def flags_response(self) -> None:
        """FLAGS and PERMANENTFLAGS with every keyword the client has been told of."""
        view = self.selected()
        keywords = tuple(sorted(view.keywords))
        self.untagged(b"FLAGS " + wire.flag_list(SYSTEM_FLAGS + keywords))
        permanent = b"()" if view.readonly else wire.flag_list(SYSTEM_FLAGS + keywords)[:-1] + b" \\*)"
        self.untagged(b"OK [PERMANENTFLAGS " + permanent + b"] Limited")

    def announce_flags(self, uids: list[int]) -> None:
        """Before a FETCH shows a keyword the client was not told of, a new FLAGS (RFC 3501 7.2.6)."""
        view = self.selected()
        messages = view.messages
        new = keywords_of(messages[u] for u in uids if u in messages) - view.keywords
        if new:
            view.keywords |= new
            self.flags_response()

    def uids(self, messages: c.SequenceSet, uid: bool) -> list[int]:
        """The UIDs a sequence set names. Sequence numbers beyond the view are BAD (RFC 3501 9:
        a number must be valid); UIDs beyond it name nothing."""
        view = self.selected()
        resolved = wire.resolve_set(list(messages), view.largest(uid))
        if uid:
            return view.by_uid(resolved)
        if any(hi > len(view) for _, hi in resolved):
            raise Bad("Message sequence number out of range")
        return view.by_seq(resolved)


def _tag_of(start: bytes) -> bytes | None:
    tag, _, _ = parse.parse_tag(Frame((start,)))
    return tag


def _syntax_error(exc: BaseException) -> bytes:
    """The text of a BAD answer. Only cassmail's own syntax errors (`wire.ParseError`, `Bad`),
    whose texts are fixed descriptions of the rule that was broken, say which; anything else
    (the model's checks) may carry reprs of the input, so it is answered with a fixed text."""
    if isinstance(exc, (wire.ParseError, Bad)) and str(exc):
        text = str(exc).splitlines()[0].encode("ascii", "replace")[:200]
        return b"Syntax error: " + text if isinstance(exc, wire.ParseError) else text
    return b"Invalid argument" if isinstance(exc, InvalidInput) else b"Syntax error"


def _commands() -> dict[str, Entry]:
    from cassmail.imap import fetch, idle, login, mailboxes, quota, search, selected, sort

    table: dict[str, tuple[frozenset[str], Handler]] = {
        "CAPABILITY": (ANY, login.capability),
        "NOOP": (ANY, selected.noop),
        "LOGOUT": (ANY, login.logout),
        "ID": (ANY, login.id_),
        "STARTTLS": (UNAUTH, login.starttls),
        "LOGIN": (UNAUTH, login.login),
        "AUTHENTICATE": (UNAUTH, login.authenticate),
        "ENABLE": (AUTH, login.enable),
        "COMPRESS": (AUTH, login.compress),
        "NAMESPACE": (AUTH, mailboxes.namespace),
        "SELECT": (AUTH, mailboxes.select),
        "EXAMINE": (AUTH, mailboxes.select),
        "CREATE": (AUTH, mailboxes.create),
        "DELETE": (AUTH, mailboxes.delete),
        "RENAME": (AUTH, mailboxes.rename),
        "SUBSCRIBE": (AUTH, mailboxes.subscribe),
        "UNSUBSCRIBE": (AUTH, mailboxes.unsubscribe),
        "LIST": (AUTH, mailboxes.list_),
        "LSUB": (AUTH, mailboxes.list_),
        "STATUS": (AUTH, mailboxes.status),
        "APPEND": (AUTH, mailboxes.append),
        "IDLE": (AUTH, idle.idle),
        "CHECK": (SELECTED, selected.check),
        "CLOSE": (SELECTED, selected.close),
        "UNSELECT": (SELECTED, selected.unselect),
        "EXPUNGE": (SELECTED, selected.expunge),
        "STORE": (SELECTED, selected.store),
        "COPY": (SELECTED, selected.copy),
        "MOVE": (SELECTED, selected.copy),
        "SEARCH": (SELECTED, search.search),
        "SORT": (SELECTED, sort.sort),
        "THREAD": (SELECTED, sort.thread),
        "FETCH": (SELECTED, fetch.fetch),
        "UID": (SELECTED, selected.noop),  # never run: parse_command names the command after UID
        "GETQUOTA": (AUTH, quota.getquota),
        "GETQUOTAROOT": (AUTH, quota.getquotaroot),
        "SETQUOTA": (AUTH, quota.setquota),
    }
    assert set(table) == parse.KNOWN, "every command the parser knows has a handler"
    return {name: Entry(states, run) for name, (states, run) in table.items()}


COMMANDS: dict[str, Entry] = {}


def load_commands() -> None:
    """Fill COMMANDS (the command modules import this one, so the table is built once they are)."""
    if not COMMANDS:
        COMMANDS.update(_commands())
