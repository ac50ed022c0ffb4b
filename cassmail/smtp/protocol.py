"""aiosmtpd's SMTP and LMTP engines with the two parts cassmail needs done differently.

DATA: aiosmtpd reads the message line by line in Python, which tops out near
16 MB/s on one core. Here DATA is read in large blocks; the end-of-data marker
(CRLF . CRLF) is found and dot-stuffing undone with bytes operations in C, and
the body is never decoded: bare LF, 8-bit and long lines reach the store as
they came. Only CRLF . CRLF ends a message (a bare-LF dot does not), which is
what RFC 5321 says and what keeps SMTP smuggling out.

AUTH: aiosmtpd parses PLAIN and LOGIN and calls a synchronous authenticator;
checking a password here means a store read and a slow hash, so the check is
awaited instead (the parsing stays aiosmtpd's).

Everything else (the command loop, EHLO, MAIL/RCPT parameters, STARTTLS,
PIPELINING, limits on command length and repetitions) is aiosmtpd's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, AnyStr

from aiosmtpd.lmtp import LMTP
from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword

from cassmail.logs import kv

log = logging.getLogger("cassmail.smtp")

END_OF_DATA = b"\r\n.\r\n"
READ_SIZE = 256 * 1024
#: A 2xx/4xx/5xx reply line that has no enhanced status code (RFC 3463) yet.
_PLAIN_REPLY = re.compile(r"([245])\d\d[ -](?!\d\.\d{1,3}\.\d{1,3}(?:\s|$))")


class DataTooLarge(Exception):
    """The message went past the size limit; the rest of it was read and thrown away."""


async def read_data(reader: asyncio.StreamReader, limit: int) -> bytes:
    """Read a DATA payload up to CRLF . CRLF; return it with dot-stuffing undone.

    Bytes after the marker (commands a client pipelined) go back to the reader.
    Raises DataTooLarge (after draining to the marker) past `limit` bytes, and
    ConnectionResetError if the client goes away in the middle.
    """
    # A virtual CRLF in front makes "a line that starts with a dot" the same
    # pattern everywhere, including the first line and an empty message.
    buf = bytearray(b"\r\n")
    scanned = 0
    too_large = False
    while True:
        chunk = await reader.read(READ_SIZE)
        if not chunk:
            raise ConnectionResetError("client closed the connection during DATA")
        buf += chunk
        end = buf.find(END_OF_DATA, max(scanned - 4, 0))
        if end >= 0:
            rest = buf[end + len(END_OF_DATA) :]
            if rest:
                _unread(reader, bytes(rest))
            if too_large or end > limit + 2:
                raise DataTooLarge
            # RFC 5321 4.5.2: a line that starts with a dot loses that dot.
            return bytes(buf[: end + 2]).replace(b"\r\n.", b"\r\n")[2:]
        if len(buf) > limit + 2 + len(END_OF_DATA):
            # Keep reading to the marker, but only its possible beginning.
            too_large = True
            del buf[2 : len(buf) - len(END_OF_DATA)]
        scanned = len(buf)


def _unread(reader: asyncio.StreamReader, data: bytes) -> None:
    """Put bytes back at the front of a StreamReader (it has no public way to)."""
    reader._buffer[0:0] = data  # type: ignore[attr-defined]


def with_enhanced_code(line: str) -> str:
    """Give a reply line the generic enhanced code of its class (X.0.0) if it has none."""
    match = _PLAIN_REPLY.match(line)
    if match is None or line.startswith("220"):
        return line
    return f"{line[:4]}{match.group(1)}.0.0 {line[4:]}"


class _CassmailEngine:
    """Shared by the SMTP and LMTP engines; mixed in before aiosmtpd's class."""

    event_handler: Any
    envelope: Any
    session: Any
    data_size_limit: int | None
    _reader: asyncio.StreamReader
    #: Set by the EHLO hook: EHLO/LHLO reply lines carry no enhanced codes (RFC 2034).
    in_ehlo_reply = False
    #: Messages stored in this connection (for the session log line).
    deliveries = 0
    _opened_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        new_connection = getattr(self, "transport", None) is None  # not the TLS layer after STARTTLS
        super().connection_made(transport)  # type: ignore[misc]
        if not new_connection:
            return
        self._opened_at = time.monotonic()
        handler = self.event_handler
        handler.sessions += 1
        if handler.sessions > handler.settings.max_connections:
            # Turned away before the greeting, as RFC 5321 3.1 allows.
            self._handler_coroutine.cancel()  # type: ignore[attr-defined]
            transport.write(b"421 4.7.0 Too many connections, try again later\r\n")  # type: ignore[attr-defined]
            transport.close()

    def connection_lost(self, error: Exception | None) -> None:
        if self._opened_at is not None:
            handler, session = self.event_handler, self.session
            handler.sessions -= 1
            log.info(
                kv(
                    "session", listener=handler.role.name, peer=peer_ip(session.peer), helo=session.host_name,
                    user=session.auth_data, tls=bool(session.ssl), deliveries=self.deliveries,
                    ms=int((time.monotonic() - self._opened_at) * 1000),
                )
            )
            self._opened_at = None
        super().connection_lost(error)  # type: ignore[misc]

    async def push(self, status: AnyStr) -> None:
        """Every reply but the greeting and EHLO's carries an enhanced status code, since
        ENHANCEDSTATUSCODES is advertised; aiosmtpd's own replies get the generic X.0.0."""
        if isinstance(status, str):
            if self.in_ehlo_reply:
                self.in_ehlo_reply = not status.startswith("250 ")
            else:
                status = "\r\n".join(with_enhanced_code(line) for line in status.split("\r\n"))
        await super().push(status)  # type: ignore[misc]

    async def smtp_DATA(self, arg: str) -> None:
        if await self.check_helo_needed():  # type: ignore[attr-defined]
            return
        if await self.check_auth_needed("DATA"):  # type: ignore[attr-defined]
            return
        if not self.envelope.rcpt_tos:
            await self.push("503 5.5.1 Error: need RCPT command")  # type: ignore[attr-defined]
            return
        if arg:
            await self.push("501 5.5.4 Syntax: DATA")  # type: ignore[attr-defined]
            return
        await self.push("354 End data with <CR><LF>.<CR><LF>")  # type: ignore[attr-defined]
        try:
            content = await read_data(self._reader, self.data_size_limit or (1 << 62))
        except DataTooLarge:
            self._set_post_data_state()  # type: ignore[attr-defined]
            await self.push("552 5.3.4 Message too big for system")  # type: ignore[attr-defined]
            return
        except ConnectionResetError:
            self._writer.close()  # type: ignore[attr-defined]
            return
        self.envelope.content = self.envelope.original_content = content
        status = await self._call_handler_hook("DATA")  # type: ignore[attr-defined]
        self._set_post_data_state()  # type: ignore[attr-defined]
        await self.push(status)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- AUTH
    # aiosmtpd's auth_PLAIN/auth_LOGIN parse the exchange and then call
    # _authenticate synchronously; it only records the credentials here, and
    # the overrides await the real check.

    _credentials: LoginPassword | None = None

    def _authenticate(self, mechanism: str, auth_data: Any) -> AuthResult:
        self._credentials = auth_data
        return AuthResult(success=False, handled=False)

    async def _checked(self, result: AuthResult) -> AuthResult:
        credentials, self._credentials = self._credentials, None
        if credentials is None:  # aiosmtpd already answered (bad base64, client aborted)
            return result
        return await self.event_handler.authenticate(self, credentials.login, credentials.password)

    async def auth_PLAIN(self, _: Any, args: list[str]) -> AuthResult:
        return await self._checked(await super().auth_PLAIN(_, args))  # type: ignore[misc]

    async def auth_LOGIN(self, _: Any, args: list[str]) -> AuthResult:
        return await self._checked(await super().auth_LOGIN(_, args))  # type: ignore[misc]


def peer_ip(peer: Any) -> str:
    """The client's address from a peername (a (host, port, ...) tuple, or a path for Unix sockets)."""
    return peer[0] if isinstance(peer, tuple) else str(peer)


class CassmailSMTP(_CassmailEngine, SMTP):
    """SMTP for the MX and submission listeners."""


class CassmailLMTP(_CassmailEngine, LMTP):
    """LMTP (RFC 2033): LHLO instead of EHLO, and one reply per recipient after DATA."""
