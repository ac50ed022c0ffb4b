"""The SMTP client side, on aiosmtplib: connections to a route's hosts, TLS by the route's
level, AUTH at a relayhost, one transaction per message with a reply per recipient, and a
pool that keeps connections open for more mail to the same destination within the
per-destination limit.

Anything a remote does wrong (garbage, silence, huge lines, a connection closed mid-DATA)
ends as a `Trouble` with a reason to log and a deferral, never an exception that escapes.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiosmtplib
import aiosmtplib.protocol

from cassmail.config import RelaySettings
from cassmail.delivery.routing import Route, ascii_domain
from cassmail.dots import stuff

#: Bytes per second a remote is expected to take at least while DATA is sent (the DATA
#: timeout grows by a second per this much of the message).
DATA_RATE = 64 * 1024


# aiosmtplib turns every message's bare CR and LF into CRLF and doubles the dots that start
# lines with two regular expressions over the whole message, which cost more CPU than the rest
# of a delivery. The same transformations are done here: a message of VECTOR_MIN bytes or more
# is looked at once with numpy (both questions in one look, about 0.4 ms a megabyte where
# bytes.count and bytes.replace took 3 ms, a quarter of a worker's event loop when relaying
# large mail); a smaller one with bytes operations. A message with bare CR or LF still takes
# aiosmtplib's own path. These stand in for two names of aiosmtplib.protocol, so the version is
# pinned in pyproject.toml and tests/test_outbound_client.py fails loudly if aiosmtplib stops
# using them.
_NORMALIZE = aiosmtplib.protocol.normalize_message_line_endings
_PERIOD_REGEX = aiosmtplib.protocol.PERIOD_REGEX
#: Messages from this size on are scanned with numpy (below it, importing and setting up costs
#: more than it saves).
VECTOR_MIN = 64 * 1024
#: The message normalize_line_endings last returned and whether a line of it starts with a dot:
#: aiosmtplib quotes the dots of that very message next, with nothing run in between.
_looked_at: tuple[bytes, bool] | None = None
_BLOCK = 1 << 20


def _look(message: bytes) -> tuple[bool, bool]:
    """(every CR and LF is part of a CRLF, a line starts with a dot), from one look at each
    pair of neighbouring bytes, a megabyte at a time (so a 25 MB message costs a few MB of
    temporary arrays, not a hundred). The second answer is only meant when the first is yes.
    Needs a message of 1 byte or more."""
    import numpy  # only in processes that send large mail

    octets = numpy.frombuffer(message, dtype=numpy.uint8)
    dotted = bool(octets[0] == 46)
    if octets[0] == 10 or octets[-1] == 13:
        return False, dotted
    for start in range(0, len(octets) - 1, _BLOCK):
        window = octets[start:start + _BLOCK + 1]
        before, after = window[:-1], window[1:]
        if not numpy.array_equal(before == 13, after == 10):
            return False, dotted
        dotted = dotted or bool(numpy.any((before == 10) & (after == 46)))
    return True, dotted


def normalize_line_endings(message: bytes) -> bytes:
    """aiosmtplib's normalize_message_line_endings: CRLF line ends, a final CRLF."""
    global _looked_at
    _looked_at = None
    dotted: bool | None = None  # not known: PeriodQuoting looks for itself
    if len(message) >= VECTOR_MIN:
        clean, dotted = _look(message)
    else:
        crlf = message.count(b"\r\n")
        clean = message.count(b"\n") == crlf and message.count(b"\r") == crlf
    if not clean:
        return _NORMALIZE(message)
    message = message if message.endswith(b"\r\n") else message + b"\r\n"
    if dotted is not None:
        _looked_at = (message, dotted)
    return message


class PeriodQuoting:
    """aiosmtplib's PERIOD_REGEX as its DATA command uses it, `sub(b"..", message)`: a dot that
    starts a line (RFC 5321 4.5.2) is doubled."""

    pattern = _PERIOD_REGEX.pattern

    def sub(self, replacement: bytes, message: bytes) -> bytes:
        global _looked_at
        looked, _looked_at = _looked_at, None
        if replacement != b"..":
            return _PERIOD_REGEX.sub(replacement, message)
        if looked is not None and looked[0] is message and not looked[1]:
            return message  # normalize_line_endings found no line that starts with a dot
        return stuff(message, True)


aiosmtplib.protocol.normalize_message_line_endings = normalize_line_endings
aiosmtplib.protocol.PERIOD_REGEX = PeriodQuoting()  # type: ignore[assignment]


class Trouble(Exception):
    """This attempt failed for every recipient it carried: connection, TLS, AUTH, a dead or
    mad remote. Temporary unless `permanent` (a remote that refuses the sender, the size,
    SMTPUTF8 it lacks); `remote` names who said it."""

    def __init__(self, reason: str, remote: str = "", permanent: bool = False, status: str = "4.4.2") -> None:
        super().__init__(reason)
        self.reason, self.remote, self.permanent, self.status = reason, remote, permanent, status


@dataclass(frozen=True)
class Reply:
    """What the remote answered for one recipient."""

    address: str
    code: int
    text: str
    remote: str

    @property
    def line(self) -> str:
        return f"{self.code} {' '.join(self.text.split())}"


@functools.lru_cache(maxsize=8)
def _tls_context(level: str, ca_file: str) -> ssl.SSLContext:
    """One context per level and CA file, made once (loading the system's CAs is not cheap)."""
    if level == "verify":
        context = ssl.create_default_context(cafile=ca_file or None)
    else:  # "may" and "encrypt": any certificate (RFC 7435 opportunistic security)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _why(exc: BaseException) -> str:
    """A remote's misbehaviour as one short line for logs and DSNs."""
    if isinstance(exc, aiosmtplib.SMTPTimeoutError) or isinstance(exc, TimeoutError):
        return "timed out waiting for the remote"
    if isinstance(exc, aiosmtplib.SMTPServerDisconnected):
        return f"connection lost: {exc}"
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        return f"bad reply: {exc.code} {' '.join(str(exc.message).split())[:200]}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


@dataclass
class Connection:
    client: aiosmtplib.SMTP
    remote: str
    tls: bool
    opened: float = field(default_factory=time.monotonic)
    messages: int = 0

    @property
    def alive(self) -> bool:
        return self.client.is_connected

    def supports(self, extension: str) -> bool:
        return self.client.supports_extension(extension)

    async def send(self, sender: str, recipients: Sequence[str], message: bytes, *, smtputf8: bool,
                   eight_bit: bool, timeout: float) -> list[Reply]:
        """One transaction: a reply per recipient (250 for each accepted when DATA succeeds).
        Raises Trouble when the transaction could not run (the remote failed or refused MAIL)."""
        client = self.client
        options: list[str] = []
        if self.supports("size"):
            limit = client.esmtp_extensions.get("size", "")
            if limit.isdigit() and 0 < int(limit) < len(message):
                raise Trouble(f"message of {len(message)} bytes exceeds {self.remote}'s limit of {limit}",
                              self.remote, permanent=True, status="5.3.4")
            options.append(f"SIZE={len(message)}")
        if eight_bit and self.supports("8bitmime"):
            options.append("BODY=8BITMIME")
        encoding = "ascii"
        if smtputf8:
            options.append("SMTPUTF8")
            encoding = "utf-8"
        else:
            sender = _ascii_address(sender)
            recipients = [_ascii_address(r) for r in recipients]
        self.messages += 1
        try:
            try:
                await client.mail(sender, options=options, encoding=encoding)
            except aiosmtplib.SMTPSenderRefused as refused:
                await self._reset()
                raise Trouble(f"{refused.code} {refused.message}", self.remote, permanent=refused.code >= 500,
                              status="5.7.1" if refused.code >= 500 else "4.7.1") from None
            accepted: list[str] = []
            replies: dict[str, Reply] = {}
            for rcpt in recipients:
                try:
                    answer = await client.rcpt(rcpt, encoding=encoding)
                    accepted.append(rcpt)
                    replies[rcpt] = Reply(rcpt, answer.code, answer.message, self.remote)
                except aiosmtplib.SMTPRecipientRefused as refused:
                    replies[rcpt] = Reply(rcpt, refused.code, refused.message, self.remote)
            if not accepted:
                await self._reset()
            else:
                try:
                    done = await client.data(message, timeout=timeout + len(message) / DATA_RATE)
                    for rcpt in accepted:
                        replies[rcpt] = Reply(rcpt, done.code, done.message, self.remote)
                except aiosmtplib.SMTPDataError as refused:
                    for rcpt in accepted:
                        replies[rcpt] = Reply(rcpt, refused.code, refused.message, self.remote)
            return [replies[r] for r in recipients]
        except Trouble:
            raise
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            self.client.close()
            raise Trouble(_why(exc), self.remote) from None

    async def _reset(self) -> None:
        try:
            await self.client.rset()
        except (aiosmtplib.SMTPException, OSError, TimeoutError):
            self.client.close()

    async def close(self) -> None:
        """QUIT politely (bounded by the client's timeout), then drop the connection."""
        if self.client.is_connected:
            try:
                await self.client.quit()
            except (aiosmtplib.SMTPException, OSError, TimeoutError):
                pass
        self.client.close()


def _ascii_address(address: str) -> str:
    local, _, domain = address.rpartition("@")
    return f"{local}@{ascii_domain(domain)}" if local else address


async def connect(route: Route, settings: RelaySettings, helo: str) -> Connection:
    """The first host of the route (in order, each of its addresses) that greets, says EHLO
    and does what the route's TLS level asks; Trouble with every host's reason otherwise."""
    reasons: list[str] = []
    remote = ""  # the last one tried: who the log line and the DSN name
    for hop in route.hops:
        for address in hop.addresses:
            remote = f"{hop.name}[{address}]"
            try:
                return await _open(route, settings, helo, hop.name, address, hop.port, remote)
            except Trouble as exc:
                reasons.append(f"{remote}: {exc.reason}")
                if exc.permanent:
                    raise Trouble("; ".join(reasons), remote, permanent=True, status=exc.status) from None
    raise Trouble("; ".join(reasons) or "no host to try", remote)


async def _open(route: Route, settings: RelaySettings, helo: str, name: str, address: str, port: int,
                remote: str) -> Connection:
    level = route.tls
    context = _tls_context(level, settings.tls_ca_file)
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (address, port)), settings.connect_timeout)
    except (OSError, TimeoutError) as exc:
        sock.close()
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise Trouble(f"cannot connect: {reason}", remote) from None
    # The socket is connected to the address DNS gave; the name is what TLS checks and presents.
    client = aiosmtplib.SMTP(
        hostname=name, sock=sock, local_hostname=helo, timeout=settings.timeout,
        use_tls=route.implicit_tls, start_tls=False, tls_context=context,
    )
    try:
        try:
            await client.connect(timeout=settings.connect_timeout)
        except aiosmtplib.SMTPConnectResponseError as refused:
            raise Trouble(f"greeting: {refused.code} {' '.join(refused.message.split())[:200]}") from None
        except (aiosmtplib.SMTPConnectError, aiosmtplib.SMTPConnectTimeoutError) as exc:
            raise Trouble(f"no greeting: {' '.join(str(exc).split())[:200]}") from None
        await _hello(client)
        secure = route.implicit_tls
        if not secure and level != "none":
            if client.supports_extension("starttls"):
                try:
                    await client.starttls(tls_context=context, server_hostname=name)
                except aiosmtplib.SMTPResponseException as refused:
                    raise Trouble(f"STARTTLS refused: {refused.code} {refused.message}") from None
                except (ssl.SSLError, aiosmtplib.SMTPException, OSError) as exc:
                    raise Trouble(f"TLS handshake failed: {' '.join(str(exc).split())[:200]}") from None
                await _hello(client)
                secure = True
            elif level in ("encrypt", "verify"):
                raise Trouble(f"TLS is required ({level}) but the remote does not offer STARTTLS")
        if route.username:
            if not secure:
                raise Trouble("AUTH at the relayhost needs TLS")
            try:
                await client.login(route.username, route.password)
            except aiosmtplib.SMTPAuthenticationError as refused:
                raise Trouble(f"AUTH failed: {refused.code} {refused.message}") from None
            except aiosmtplib.SMTPException as exc:
                raise Trouble(f"AUTH failed: {_why(exc)}") from None
        return Connection(client, remote, secure)
    except Trouble as exc:
        client.close()
        sock.close()
        exc.remote = remote
        raise
    except (aiosmtplib.SMTPException, OSError, TimeoutError, ssl.SSLError) as exc:
        client.close()
        sock.close()
        raise Trouble(_why(exc), remote) from None


async def _hello(client: aiosmtplib.SMTP) -> None:
    """EHLO, or HELO from a remote that refuses EHLO (it then gets no extension)."""
    try:
        await client.ehlo()
    except aiosmtplib.SMTPHeloError:
        try:
            await client.helo()
        except aiosmtplib.SMTPHeloError as refused:
            raise Trouble(f"HELO refused: {refused.code} {refused.message}") from None


@dataclass
class _Destination:
    open: int = 0
    idle: collections.deque[tuple[Connection, float]] = field(default_factory=collections.deque)
    waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)


class Pool:
    """Open connections per destination (a route's key): at most `limit` at once, idle ones
    kept `reuse_time` seconds for the next message, each used for `reuse_count` messages at most."""

    def __init__(self, limit: int, reuse_time: float, reuse_count: int) -> None:
        self.limit, self.reuse_time, self.reuse_count = limit, reuse_time, reuse_count
        self._destinations: dict[str, _Destination] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def busy(self, key: str) -> int:
        """Connections open to a destination (in use or idle)."""
        found = self._destinations.get(key)
        return found.open if found else 0

    async def acquire(self, key: str, opener: Callable[[], Awaitable[Connection]]) -> Connection:
        dest = self._destinations.setdefault(key, _Destination())
        while True:
            while dest.idle:
                conn, _ = dest.idle.popleft()
                if conn.alive:
                    return conn
                self._drop(dest, conn)
            if dest.open < self.limit:
                dest.open += 1
                try:
                    return await opener()
                except BaseException:
                    dest.open -= 1
                    self._wake(dest)
                    raise
            waiter = asyncio.get_running_loop().create_future()
            dest.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in dest.waiters:
                    dest.waiters.remove(waiter)

    def release(self, key: str, conn: Connection, reusable: bool) -> None:
        dest = self._destinations[key]
        if reusable and conn.alive and conn.messages < self.reuse_count and self.reuse_time > 0:
            stamp = time.monotonic()
            dest.idle.append((conn, stamp))
            asyncio.get_running_loop().call_later(self.reuse_time, self._expire, key, conn, stamp)
        else:
            self._drop(dest, conn)
        self._wake(dest)

    def _expire(self, key: str, conn: Connection, stamp: float) -> None:
        dest = self._destinations.get(key)
        if dest is not None and (conn, stamp) in dest.idle:
            dest.idle.remove((conn, stamp))
            self._drop(dest, conn)
            self._wake(dest)

    def _drop(self, dest: _Destination, conn: Connection) -> None:
        """Close a connection; it counts against the limit until it is closed."""
        task = asyncio.ensure_future(conn.close())
        self._closing.add(task)

        def closed(done: asyncio.Task[None]) -> None:
            self._closing.discard(done)
            dest.open -= 1
            self._wake(dest)

        task.add_done_callback(closed)

    @staticmethod
    def _wake(dest: _Destination) -> None:
        while dest.waiters:
            waiter = dest.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """QUIT every idle connection (those in use are their deliveries' to close)."""
        for dest in self._destinations.values():
            while dest.idle:
                conn, _ = dest.idle.popleft()
                self._drop(dest, conn)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=5)
