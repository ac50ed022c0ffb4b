"""aiosmtpd's SMTP and LMTP engines with the two parts cassmail needs done differently.

DATA: aiosmtpd reads the message line by line in Python, which tops out near
16 MB/s on one core. Here DATA is read in large blocks; the end-of-data marker
(CRLF . CRLF) is found and dot-stuffing undone with bytes operations in C, and
the body is never decoded: bare LF, 8-bit and long lines reach the store as
they came. Only CRLF . CRLF ends a message (a bare-LF dot does not), which is
what RFC 5321 says and what keeps SMTP smuggling out.

AUTH: aiosmtpd's PLAIN and LOGIN call a synchronous authenticator; checking a
password here means a store read and a slow hash, so the engine has its own
`auth_PLAIN` and `auth_LOGIN` (the documented way to provide a mechanism): the
exchange and its replies as aiosmtpd's, the decoding `cassmail.auth`'s, the check
awaited through the handler (`DeliveryHandler.authenticate`, `auth.Logins`).

Replies: aiosmtpd's own replies carry no enhanced status code (RFC 3463); each
gets a precise one from one table (`AIOSMTPD_CODES`).

Command length: aiosmtpd keeps its per-command limits in a dict shared by every
session of the process and adds the SIZE and SMTPUTF8 allowance to MAIL at every
EHLO, so the limit grows; its line reader stops at 1001 bytes. Here each engine
has its own fixed limits and a reader sized for them.

Rates: each command line the command loop reads takes a token from the
connection's bucket (`max_command_rate` per minute; DATA content and AUTH answers
are not commands), and each connection one from its peer address's bucket
(`max_connection_rate` per minute in this worker); an empty bucket is answered
421 4.7.0 and the connection closed. The count sits in the engine's stream
reader (`_CommandReader`), the one place every command line passes, valid or not.

Addresses: MAIL/RCPT/VRFY paths are split from their parameters by `split_path` (RFC 5321
4.1.2: a path in angle brackets, a source route dropped, quoted local parts kept whole), in
place of aiosmtpd's `_getaddr`, which used the standard library's email header parser: built
for message headers, it crashed on truncated paths (`<`, `<@a,@b:user@`, `a@[ `) with
IndexError, AttributeError or UnboundLocalError. A path that does not split is answered
553 5.1.3 (553 5.1.7 for MAIL's sender, 502 5.1.3 for VRFY); what is inside is checked by the
handler (`Address.parse`).

Everything else (the command loop, EHLO, MAIL/RCPT parameters, STARTTLS,
PIPELINING, the limit on repetitions) is aiosmtpd's.

Where aiosmtpd has no public way, the engine uses its private names, each listed in
`AIOSMTPD_PRIVATE` with the reason; pyproject.toml pins the aiosmtpd versions they were
tested with, and tests/test_hardening.py fails when one is gone or changed shape.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from base64 import b64encode
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, AnyStr, BinaryIO

from aiosmtpd.lmtp import LMTP
from aiosmtpd.smtp import MISSING, SMTP, AuthResult

from cassmail import auth
from cassmail.dots import END_OF_DATA, find_end_of_data, unstuff
from cassmail.logs import kv
from cassmail.sessions import quick_ack
from cassmail.smtp.spool import SpoolPolicy, Spooled

log = logging.getLogger("cassmail.smtp")

READ_SIZE = 256 * 1024
#: A 2xx/4xx/5xx reply line that has no enhanced status code (RFC 3463) yet.
_PLAIN_REPLY = re.compile(r"([245])\d\d[ -](?!\d\.\d{1,3}\.\d{1,3}(?:\s|$))")

#: The enhanced code (RFC 3463) of each reply aiosmtpd writes without one:
#: (basic code, how the text starts, enhanced code); the first match wins. A reply
#: not listed (none is known) gets the generic X.0.0 of its class.
AIOSMTPD_CODES: tuple[tuple[str, str, str], ...] = (
    ("250", "", "2.0.0"),  # NOOP, RSET, HELP
    ("221", "", "2.0.0"),  # QUIT
    ("220", "Ready to start TLS", "2.0.0"),  # STARTTLS (the greeting, also 220, has none)
    ("454", "TLS not available", "4.7.0"),
    ("500", "Command line too long", "5.5.2"),  # past max_command_length
    ("500", "Error: bad syntax", "5.5.2"),  # an empty line, a command word that is not ASCII
    ("500", "Error: strict ASCII mode", "5.5.2"),
    ("500", "Error: command ", "5.5.1"),  # not recognized (also HELO/EHLO on LMTP, AUTH after HELO)
    ("501", "", "5.5.4"),  # "Syntax: ...", bad BODY/SIZE/SMTPUTF8 values, AUTH without a mechanism
    ("502", "EXPN", "5.5.1"),  # not implemented
    ("502", "Could not VRFY", "5.1.3"),  # not an address
    ("503", "", "5.5.1"),  # out of sequence: HELO first, nested MAIL, need MAIL, already authenticated
    ("530", "Must issue a STARTTLS", "5.7.0"),
    ("552", "Error: message size exceeds", "5.3.4"),  # MAIL FROM:<..> SIZE= past the limit
    ("554", "Command refused due to lack of security", "5.7.0"),
    ("555", "", "5.5.4"),  # MAIL/RCPT parameters not recognized
)

#: A control character in a reply other than the CRLF between the lines of a multi-line one.
_REPLY_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")

#: aiosmtpd's reply to a MAIL or RCPT address it cannot parse; for MAIL it becomes MALFORMED_SENDER.
MALFORMED_ADDRESS = "553 5.1.3 Error: malformed address"
MALFORMED_SENDER = "553 5.1.7 Error: malformed sender address"

#: After EHLO, MAIL may be this much longer than other commands: SIZE=n (RFC 1870, 26 octets)
#: and SMTPUTF8 (RFC 6531, 10 octets), as aiosmtpd allows.
MAIL_EXTENSIONS_ALLOWANCE = 26 + 10

#: The SASL mechanisms the engine provides (its `auth_*` methods); the listeners that offer no
#: AUTH exclude them all (aiosmtpd's `auth_exclude_mechanism`).
SASL_MECHANISMS = ("LOGIN", "PLAIN")

#: The private names the engine uses where aiosmtpd has no public way: {name: (whose: aiosmtpd's
#: SMTP or asyncio's StreamReader, its shape: the parameters of a method the engine calls or
#: overrides, or the type of an attribute, why)}. pyproject.toml pins the aiosmtpd versions they
#: were tested with; tests/test_hardening.py fails on a private name used in cassmail/smtp/ that is
#: not listed here, and on one listed that the installed aiosmtpd no longer has in that shape.
AIOSMTPD_PRIVATE: dict[str, tuple[type, tuple[str, ...] | type, str]] = {
    "_handler_coroutine": (SMTP, asyncio.Task, "the session's command loop: cancelled before the greeting "
                           "to turn a connection away with 421 (no hook runs before aiosmtpd greets)"),
    "_reader": (SMTP, asyncio.StreamReader, "the session's stream reader: DATA read in blocks, an AUTH answer "
                "past the line limit drained (aiosmtpd reads both line by line)"),
    "_timeout_handle": (SMTP, asyncio.TimerHandle, "the idle timer, stopped while the store writes a message"),
    "_reset_timeout": (SMTP, ("self", "duration"), "the idle timer restarted as DATA blocks come in and after "
                       "the store's write"),
    "_timeout_cb": (SMTP, ("self",), "overridden: an idle session is told 421 4.4.2 before it is closed"),
    "_set_post_data_state": (SMTP, ("self",), "a new envelope after DATA, as aiosmtpd's own DATA ends"),
    "_getaddr": (SMTP, ("self", "arg"), "overridden: MAIL/RCPT/VRFY paths split by `split_path`"),
    "_buffer": (asyncio.StreamReader, bytearray, "the reader's buffer: bytes read past DATA's end go back "
                "for the command loop (a StreamReader cannot unread)"),
}

if TYPE_CHECKING:
    _Engine = SMTP
else:
    _Engine = object


class DataTooLarge(Exception):
    """The message went past the size limit; the rest of it was read and thrown away."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes of DATA")
        #: Bytes the client sent before the end-of-data marker.
        self.size = size


class SpoolFailed(Exception):
    """The spool file could not be written (or mapped); the rest of the message was read and
    thrown away."""

    def __init__(self, size: int, error: OSError) -> None:
        super().__init__(f"spool file: {error}")
        #: Bytes the client sent before the end-of-data marker.
        self.size = size


async def read_data(
    reader: asyncio.StreamReader,
    limit: int,
    progress: Callable[[], None] | None = None,
    spool: SpoolPolicy | None = None,
) -> bytearray | Spooled:
    """Read a DATA payload up to CRLF . CRLF; return it with dot-stuffing undone.

    The message is the buffer it was read into, cut in place: a large message costs its own
    size once (and once more only when a line starts with a dot), not a copy per step, and the
    caller may put the trace headers in front of it the same way. Past `spool.above` bytes the
    rest goes to a spool file and the message comes back as `Spooled` (cassmail.smtp.spool).

    Bytes after the marker (commands a client pipelined) go back to the reader.
    Raises DataTooLarge (after draining to the marker) past `limit` bytes, SpoolFailed (after
    draining too) when the spool file fails, and ConnectionResetError if the client goes away
    in the middle. `progress` is
    called for every block received (the idle timer counts from the last one,
    so a large message on a slow link is not cut off).
    """
    # A virtual CRLF in front makes "a line that starts with a dot" the same
    # pattern everywhere, including the first line and an empty message.
    buf = bytearray(b"\r\n")
    scanned = 0
    dropped = 0
    too_large = False
    file: BinaryIO | None = None
    spooled = 0  # bytes of `buf` already written to `file` (the virtual CRLF included)
    failure: OSError | None = None
    try:
        while True:
            chunk = await reader.read(READ_SIZE)
            if not chunk:
                raise ConnectionResetError("client closed the connection during DATA")
            if progress is not None:
                progress()
            buf += chunk
            end = find_end_of_data(buf, max(scanned - 4, 0))
            if end >= 0:
                rest = buf[end + len(END_OF_DATA) :]
                if rest:
                    _unread(reader, bytes(rest))
                # `end` is the size of the message as sent (its last CRLF included, the doubled
                # dots too): a message of `limit` octets is taken, one more is not.
                if failure is not None:
                    raise SpoolFailed(dropped + spooled + end, failure)
                if too_large or spooled + end > limit:
                    raise DataTooLarge(dropped + spooled + end)
                del buf[end + 2 :]
                if file is not None:
                    spool_file, file = file, None
                    try:
                        spool_file.write(buf)
                        return Spooled.finish(spool_file)
                    except OSError as exc:
                        spool_file.close()
                        raise SpoolFailed(spooled + end, exc) from None
                buf = unstuff(buf)  # RFC 5321 4.5.2: a line that starts with a dot loses that dot
                del buf[:2]
                return buf
            if failure is not None or spooled + len(buf) > limit + 2 + len(END_OF_DATA):
                # Keep reading to the marker, but only its possible beginning.
                too_large = failure is None
                if file is not None:
                    file.close()
                    file = None
                dropped += spooled + len(buf) - len(END_OF_DATA) - 2
                spooled = 0
                del buf[2 : len(buf) - len(END_OF_DATA)]
            elif not too_large and spool is not None and spool.above and spooled + len(buf) > spool.above \
                    and len(buf) > len(END_OF_DATA):
                # Into the file, all but the tail that may hold the marker's beginning.
                keep = len(END_OF_DATA) - 1
                try:
                    if file is None:
                        file = spool.open()
                    file.write(memoryview(buf)[:-keep])
                except OSError as exc:
                    failure = exc  # drained from the next block on, answered at the marker
                else:
                    spooled += len(buf) - keep
                    del buf[:-keep]
            scanned = len(buf)
    finally:
        if file is not None:
            file.close()


def _unread(reader: asyncio.StreamReader, data: bytes) -> None:
    """Put bytes back at the front of a StreamReader (it has no public way to)."""
    reader._buffer[0:0] = data  # type: ignore[attr-defined]


def split_path(arg: str) -> tuple[str, str] | None:
    """(the address, the rest: parameters) of a MAIL/RCPT/VRFY argument, or None when it is
    malformed: an unclosed bracket or quoted string, a bracket or space outside a quoted string
    in the path, a source route without its colon or with an empty hop. The address is
    "<>" for the null path; a source route (RFC 5321 4.1.2, obsolete) is dropped (Appendix C).
    A path without brackets (tolerated, as aiosmtpd does) ends at the first space."""
    text = arg.lstrip()
    bracketed = text.startswith("<")
    start = i = 1 if bracketed else 0
    quoted = False
    while i < len(text):
        char = text[i]
        if quoted:
            if char == "\\":
                i += 1  # a quoted pair: the next character is taken as it is
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == ">" and bracketed:
            break
        elif char in "<>" or (bracketed and char.isspace()):
            return None
        elif char.isspace():
            break
        i += 1
    if quoted or (bracketed and i >= len(text)):
        return None
    path, rest = text[start:i], text[i + 1 :] if bracketed else text[i:]
    if bracketed and not path:
        return "<>", rest
    if path.startswith("@"):
        route, colon, path = path.partition(":")
        if not colon or any(len(hop) < 2 or hop[0] != "@" for hop in route.split(",")):
            return None
    return (path, rest) if path else None


def with_enhanced_code(line: str) -> str:
    """Give a reply line that has no enhanced status code the one `AIOSMTPD_CODES` names for it,
    or the generic X.0.0 of its class. The greeting (220) is left as it is (RFC 2034)."""
    match = _PLAIN_REPLY.match(line)
    if match is None:
        return line
    code, text = line[:3], line[4:]
    for basic, start, enhanced in AIOSMTPD_CODES:
        if code == basic and text.startswith(start):
            return f"{line[:4]}{enhanced} {text}"
    if code == "220":
        return line
    return f"{line[:4]}{match.group(1)}.0.0 {text}"


def peer_in(peer: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    """Whether a client address is in one of `networks` (an address that is not IP, such as a
    Unix socket's, is local and so in)."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return True
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    return any(address in network for network in networks)


class TokenBucket:
    """`per_minute` events a minute on average, in bursts of up to a minute's worth.

    Starts full, so a client's first burst (a pipelined transaction, a batch of
    connections) is never refused; after that it refills at per_minute / 60 a second."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.tokens = self.capacity
        self.refill = per_minute / 60.0
        self.stamp = now

    def take(self, now: float) -> bool:
        """Take one token if there is one; False when the bucket is empty (nothing is taken)."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.refill)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def full(self, now: float) -> bool:
        """Whether the bucket has refilled completely (it is then the same as a new one)."""
        return self.tokens + (now - self.stamp) * self.refill >= self.capacity


class RateLimits:
    """One listener's rates in one worker process: commands a minute per connection, and
    connections a minute per peer IP address (0 = no limit), neither for `exempt` networks.

    Connection buckets that have refilled are forgotten (a new one is the same) once the
    table has doubled since the last sweep, so a scan from many addresses costs memory only
    while those addresses are actually over a minute's worth of connections."""

    def __init__(self, command_rate: int, connection_rate: int, exempt: Sequence[str] = ()) -> None:
        self.command_rate = command_rate
        self.connection_rate = connection_rate
        self.exempt_networks = tuple(ipaddress.ip_network(n, strict=False) for n in exempt)
        self.peers: dict[str, TokenBucket] = {}
        self._sweep_at = 1024

    def exempt(self, peer: str) -> bool:
        """Whether `peer` is in an exempt network."""
        return peer_in(peer, self.exempt_networks)

    def admit(self, peer: str) -> bool:
        """Count a new connection from `peer` (not exempt); False when it is over the rate."""
        if not self.connection_rate:
            return True
        now = time.monotonic()
        bucket = self.peers.get(peer)
        if bucket is None:
            bucket = self.peers[peer] = TokenBucket(self.connection_rate, now)
        admitted = bucket.take(now)
        if len(self.peers) >= self._sweep_at:
            self.peers = {ip: b for ip, b in self.peers.items() if not b.full(now)}
            self._sweep_at = max(1024, 2 * len(self.peers))
        return admitted

    def commands(self, now: float) -> TokenBucket | None:
        """A new connection's command budget (None: no limit)."""
        return TokenBucket(self.command_rate, now) if self.command_rate else None


class _CommandReader(asyncio.StreamReader):
    """The engine's stream reader: every line aiosmtpd's command loop reads counts as a command.

    The loop calls `readuntil()` without a separator (also to drain a line that is too long,
    which so counts once); DATA is read with `read` and AUTH answers with an explicit
    separator, and neither is a command."""

    def __init__(self, engine: _CassmailEngine, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self._engine = engine

    async def readuntil(self, separator: bytes | None = None) -> bytes:  # type: ignore[override]
        if separator is not None:
            return await super().readuntil(separator)
        line = await super().readuntil(b"\n")
        await self._engine.command_read()
        return line


class _CountingReaderProtocol(asyncio.StreamReaderProtocol):
    """Sits after aiosmtpd's SMTP in the engines' MRO, so the reader aiosmtpd builds in its
    __init__ is replaced by a `_CommandReader` with the same limit before anything uses it."""

    def __init__(self, stream_reader: asyncio.StreamReader, *args: Any, **kwargs: Any) -> None:
        engine: Any = self
        reader = _CommandReader(engine, engine.line_length_limit, engine.loop)
        super().__init__(reader, *args, **kwargs)


class _CommandLimits(dict):  # type: ignore[type-arg]
    """The longest line of each command after EHLO: `limit`, MAIL `MAIL_EXTENSIONS_ALLOWANCE` more.

    Stands in for aiosmtpd's class-wide `command_size_limits`, whose EHLO adds the allowance to
    MAIL again at every EHLO of every session of the process; here the limits are per engine and
    fixed, so that adding is ignored.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __missing__(self, command: str) -> int:
        return self.limit + (MAIL_EXTENSIONS_ALLOWANCE if command == "MAIL" else 0)

    def __setitem__(self, command: str, value: int) -> None:
        pass


class _CassmailEngine(_Engine):
    """Shared by the SMTP and LMTP engines; mixed in before aiosmtpd's class."""

    event_handler: Any
    envelope: Any
    session: Any
    transport: Any
    _reader: asyncio.StreamReader
    #: Set by the HELO and EHLO hooks: replies to HELO/EHLO/LHLO carry no enhanced codes (RFC 2034).
    in_ehlo_reply = False
    #: Messages stored in this connection (for the session log line).
    deliveries = 0
    #: How the session ended, for the session log line: quit, timeout, limit (closed by the
    #: server after a 421, e.g. over the command rate, or too many unknown commands), busy
    #: (turned away: max_connections), throttled (turned away: its address went past
    #: max_connection_rate) or dropped (the client went away without QUIT).
    result = "dropped"
    _opened_at: float | None = None
    _tls_from_start = False
    #: This connection's command budget (None: no limit).
    _commands: TokenBucket | None = None

    def __init__(
        self,
        handler: Any,
        *,
        command_length: int = 512,
        rates: RateLimits | None = None,
        spool: SpoolPolicy | None = None,
        **options: Any,
    ) -> None:
        """`command_length`: the longest command line, CRLF not counted, after HELO and after EHLO
        alike (MAIL after EHLO may be MAIL_EXTENSIONS_ALLOWANCE longer). Lines past it get 500 5.5.2.
        `rates`: the listener's command and connection rates in this worker (shared by its
        sessions; None = no limits). `spool`: where large DATA goes (None: kept in memory)."""
        self.rates = rates
        self.spool = spool
        self.command_size_limit = command_length
        self.command_size_limits = _CommandLimits(command_length)
        # aiosmtpd builds its line reader with this limit; a line past it is drained and refused
        # like one past the command limits (+1: the CR before the LF is not counted).
        self.line_length_limit = command_length + MAIL_EXTENSIONS_ALLOWANCE + 1
        super().__init__(handler, **options)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        new_connection = getattr(self, "transport", None) is None  # not the TLS layer after STARTTLS
        super().connection_made(transport)
        if not new_connection:
            return
        self._opened_at = time.monotonic()
        # TLS from the first byte (an implicit-TLS listener): aiosmtpd only notes STARTTLS's.
        self._tls_from_start = transport.get_extra_info("ssl_object") is not None
        handler = self.event_handler
        admitted = handler.opened(self)
        peer = peer_ip(self.session.peer)
        trusted = handler.trusted_networks
        # A trusted client of a submission listener (Postfix's mynetworks) may send without AUTH.
        self.session.trusted = bool(trusted) and peer_in(peer, trusted)
        rates = self.rates if self.rates is not None and not self.rates.exempt(peer) else None
        if rates is not None:
            self._commands = rates.commands(self._opened_at)
        # Turned away before the greeting, as RFC 5321 3.1 allows.
        if rates is not None and not rates.admit(peer):
            self._refuse("throttled", b"421 4.7.0 Too many connections from your address, try again later\r\n")
        elif not admitted:
            self._refuse("busy", b"421 4.7.0 Too many connections, try again later\r\n")

    def _refuse(self, result: str, reply: bytes) -> None:
        """Close a new connection with `reply` instead of the greeting."""
        self.result = result
        self._handler_coroutine.cancel()
        self.transport.write(reply)
        self.transport.close()

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        """(address, parameters) of a MAIL/RCPT/VRFY argument for aiosmtpd's command methods:
        ("", "") for none, (None, None) for one that is malformed (see `split_path`)."""
        if not arg:
            return "", ""
        split = split_path(arg)
        if split is None:
            return None, None
        addr, rest = split
        local_part = addr.rpartition("@")[0]
        if self.local_part_limit and len(local_part) > self.local_part_limit:
            return None, None
        return addr, rest

    async def check_auth_needed(self, caller_method: str) -> bool:
        """aiosmtpd's check, except for a trusted client of a submission listener."""
        if getattr(self.session, "trusted", False):
            return False
        return await super().check_auth_needed(caller_method)

    async def command_read(self) -> None:
        """Called by the reader for each command line: take a token, or answer 421 4.7.0 and close.

        Past the limit this never returns: the command loop must not go on to the lines the
        client pipelined behind (nothing may follow the 421), and closing the transport ends
        the session, which cancels the loop waiting here."""
        if self._commands is None or self._commands.take(time.monotonic()):
            return
        log.warning(kv("command-rate", listener=self.event_handler.role.name, peer=peer_ip(self.session.peer),
                       limit=int(self._commands.capacity)))
        await self.push("421 4.7.0 Too many commands, slow down")
        if self.transport is not None:
            self.transport.close()
        await asyncio.get_running_loop().create_future()

    def connection_lost(self, error: Exception | None) -> None:
        if self._opened_at is not None:
            handler, session = self.event_handler, self.session
            handler.closed(self)
            log.info(
                kv(
                    "session", listener=handler.role.name, peer=peer_ip(session.peer), helo=session.host_name,
                    user=session.auth_data, tls=bool(session.ssl) or self._tls_from_start, deliveries=self.deliveries,
                    result=self.result, ms=int((time.monotonic() - self._opened_at) * 1000),
                )
            )
            self._opened_at = None
        super().connection_lost(error)

    def _timeout_cb(self) -> None:
        """An idle session is closed with 421 4.4.2 (RFC 5321 4.5.3.2), not silently as aiosmtpd does."""
        if self.transport is None:  # already closed
            return
        if not self.transport.is_closing():
            self.result = "timeout"
            self.transport.write(f"421 4.4.2 {self.hostname} Error: timeout exceeded\r\n".encode())
        super()._timeout_cb()

    async def push(self, status: AnyStr) -> None:
        """Every reply but the greeting and HELO's/EHLO's carries an enhanced status code, since
        ENHANCEDSTATUSCODES is advertised; aiosmtpd's own replies get theirs from AIOSMTPD_CODES."""
        if isinstance(status, str):
            if self.in_ehlo_reply:
                self.in_ehlo_reply = not status.startswith("250 ")
            else:
                status = "\r\n".join(with_enhanced_code(line) for line in status.split("\r\n"))
            if _REPLY_CONTROL.search(status):
                # A reply that quotes the client (500 Error: command "X" not recognized) must not
                # carry its control characters: a bare CR or LF would end the reply line early.
                status = _REPLY_CONTROL.sub("?", status)
            if not status.isascii():
                # A reply that quotes the client (502 Could not VRFY ...) may hold the lone
                # surrogates its non-UTF-8 bytes were decoded to, which cannot be sent as UTF-8.
                status = status.encode("utf-8", "backslashreplace").decode("utf-8")
            if self._in_mail and status == MALFORMED_ADDRESS:
                status = MALFORMED_SENDER
            if status.startswith("421") or status.startswith("502 5.5.1 Too many"):
                self.result = "limit"  # the server closes the session after these
        await super().push(status)

    #: Set while MAIL is handled: aiosmtpd answers a sender and a recipient it cannot parse alike.
    _in_mail = False

    async def smtp_MAIL(self, arg: str | None) -> None:
        self._in_mail = True
        try:
            await super().smtp_MAIL(arg)
        finally:
            self._in_mail = False

    async def smtp_QUIT(self, arg: str) -> None:
        if not arg:
            self.result = "quit"
        await super().smtp_QUIT(arg)

    async def smtp_DATA(self, arg: str) -> None:
        if await self.check_helo_needed():
            return
        if await self.check_auth_needed("DATA"):
            return
        if not self.envelope.rcpt_tos:
            await self.push("503 5.5.1 Error: need RCPT command")
            return
        if arg:
            await self.push("501 5.5.4 Syntax: DATA")
            return
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        quick_ack(self.transport)
        started = time.monotonic()
        try:
            content = await read_data(self._reader, self.data_size_limit or (1 << 62), self._reset_timeout,
                                      self.spool)
        except (DataTooLarge, SpoolFailed) as refused:
            ms = int((time.monotonic() - started) * 1000)
            failed = isinstance(refused, SpoolFailed)
            self.event_handler.log_unkept(self, refused.size, ms, "tempfail" if failed else "too-large",
                                          refused if failed else None)
            self._set_post_data_state()
            await self.push("451 4.3.0 Mail system temporarily unavailable, try again later" if failed
                            else "552 5.3.4 Message too big for system")
            return
        except ConnectionResetError:
            if self.transport is not None:
                self.transport.close()
            return
        self.envelope.content = self.envelope.original_content = content
        # While the store writes, the client waits for us: that is not idleness.
        self._timeout_handle.cancel()
        try:
            status = await self.event_handler.handle_DATA(self, self.session, self.envelope)
        except Exception as error:
            if not self.event_handler.role.lmtp:
                raise  # aiosmtpd answers with handle_exception's 451
            # LMTP owes one reply per recipient, also for handle_exception's 451
            status = self.event_handler.per_recipient(self.envelope, await self.handle_exception(error))
        finally:
            # Also when the hook failed (aiosmtpd then answers with handle_exception's 451): the
            # transaction is over either way, and the next MAIL starts a new one.
            self._set_post_data_state()
            if self.transport is not None:  # not after connection_lost: nothing left to time out
                self._reset_timeout()
        await self.push(status)

    # ---------------------------------------------------------------- AUTH
    # The exchanges and replies of aiosmtpd's auth_PLAIN and auth_LOGIN; the check is awaited.

    async def challenge_auth(
        self, challenge: str | bytes, encode_to_b64: bool = True, log_client_response: bool = False
    ) -> Any:
        """aiosmtpd's challenge_auth, but an answer longer than the line reader's limit is drained
        to its end and refused with 500 5.5.6 (RFC 4954 6) instead of failing inside the reader."""
        raw = challenge.encode() if isinstance(challenge, str) else challenge
        await self.push(b"334 " + (b64encode(raw) if encode_to_b64 else raw))
        try:
            line = await self._reader.readuntil(b"\n")
        except asyncio.LimitOverrunError as overrun:
            await _drain_line(self._reader, overrun.consumed)
            await self.push("500 5.5.6 Authentication Exchange line is too long")
            return MISSING
        except asyncio.IncompleteReadError as eof:  # as readline: the client is gone, the session ends
            line = eof.partial
        if auth.cancelled(line):
            await self.push("501 5.7.0 Auth aborted")
            return MISSING
        decoded = auth.decode_base64(line.strip())
        if decoded is None:
            await self.push("501 5.5.2 Can't decode base64")
            return MISSING
        return decoded

    async def _initial_response(self, args: list[str]) -> bytes | None:
        """The decoded initial response of `AUTH <mechanism> <response>`, or None (answered)."""
        decoded = auth.decode_base64(args[1].encode("utf-8", "replace"))
        if decoded is None:
            await self.push("501 5.5.2 Can't decode base64")
        return decoded

    async def auth_PLAIN(self, _: Any, args: list[str]) -> AuthResult:
        message = await self.challenge_auth("") if len(args) == 1 else await self._initial_response(args)
        if message is MISSING:
            return AuthResult(success=False)
        if message is None:
            return AuthResult(success=False, handled=True)
        credentials = auth.split_plain(message)
        if credentials is None:
            await self.push("501 5.5.2 Can't split auth value")
            return AuthResult(success=False, handled=True)
        result: AuthResult = await self.event_handler.authenticate(self, *credentials)
        return result

    async def auth_LOGIN(self, _: Any, args: list[str]) -> AuthResult:
        login = (await self.challenge_auth(self.AuthLoginUsernameChallenge) if len(args) == 1
                 else await self._initial_response(args))
        if login is MISSING:
            return AuthResult(success=False)
        if login is None:
            return AuthResult(success=False, handled=True)
        password = await self.challenge_auth(self.AuthLoginPasswordChallenge)
        if password is MISSING:
            return AuthResult(success=False)
        result: AuthResult = await self.event_handler.authenticate(self, login, password)
        return result


async def _drain_line(reader: asyncio.StreamReader, consumed: int) -> None:
    """Throw away the rest of an over-long line (whose first `consumed` bytes are buffered)."""
    await reader.read(consumed)
    while True:
        try:
            await reader.readuntil(b"\n")
            return
        except asyncio.LimitOverrunError as more:
            await reader.read(more.consumed)


def peer_ip(peer: Any) -> str:
    """The client's address from a peername (a (host, port, ...) tuple, or a path for Unix sockets)."""
    return peer[0] if isinstance(peer, tuple) else str(peer)


class CassmailSMTP(_CassmailEngine, SMTP, _CountingReaderProtocol):
    """SMTP for the MX and submission listeners."""


class CassmailLMTP(_CassmailEngine, LMTP, _CountingReaderProtocol):
    """LMTP (RFC 2033): LHLO instead of EHLO, and one reply per recipient after DATA."""
