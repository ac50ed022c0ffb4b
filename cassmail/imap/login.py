"""Commands about the session and its connection: CAPABILITY, LOGOUT, ID, STARTTLS, LOGIN,
AUTHENTICATE (PLAIN, with SASL-IR), COMPRESS and ENABLE."""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING

from cassmail import auth
from cassmail.imap import commands as c
from cassmail.imap import condstore
from cassmail.imap.connection import Closed, LineTooLong
from cassmail.imap.errors import Bad, No

if TYPE_CHECKING:
    from cassmail.imap.session import Session


async def capability(session: Session, args: c.Simple) -> str:
    session.untagged(b"CAPABILITY " + b" ".join(session.capabilities()))
    return "CAPABILITY completed"


async def logout(session: Session, args: c.Simple) -> str:
    session.untagged(b"BYE cassmail logging out")
    session.closing = True
    return "LOGOUT completed"


async def id_(session: Session, args: c.Id) -> str:
    session.untagged(b'ID ("name" "cassmail" "vendor" "cassmail")')
    return "ID completed"


async def starttls(session: Session, args: c.Simple) -> str:
    if session.listener.tls is None:
        raise No("TLS is not available")
    if session.secure:
        raise No("TLS already active")
    # What came behind STARTTLS in clear text is dropped; the session starts afresh once TLS is up.
    session.conn.drop_buffered(session.peer)

    async def handshake() -> None:
        conn = session.conn
        try:
            conn.transport = await asyncio.get_running_loop().start_tls(
                conn.transport, conn, session.listener.tls, server_side=True)
        except (OSError, ssl.SSLError, ConnectionError) as exc:
            raise Closed(f"TLS handshake failed: {exc}") from None
        conn.reading_resumed()
        session.secure = True

    session.then = handshake
    return "Begin TLS negotiation now"


async def login(session: Session, args: c.Login) -> str:
    if not session.listener.logins.plaintext_ok(session.secure):
        raise No("LOGIN is disabled on a clear-text connection: use STARTTLS", "PRIVACYREQUIRED")
    return await _login(session, args.user.decode("utf-8", "replace"), args.password.decode("utf-8", "replace"))


async def authenticate(session: Session, args: c.Authenticate) -> str:
    if args.mechanism != "PLAIN":
        raise No("Unsupported authentication mechanism")
    if not session.listener.logins.plaintext_ok(session.secure):
        raise No("Authentication is disabled on a clear-text connection", "PRIVACYREQUIRED")
    response = args.initial
    if response is None:
        session.continuation()
        try:
            response = await session.conn.read_line()
        except LineTooLong:
            raise Bad("Line too long") from None
    if auth.cancelled(response):
        raise Bad("Authentication cancelled")
    decoded = auth.decode_plain(b"" if response == b"=" else response)
    if decoded is None:
        raise Bad("Malformed PLAIN response")
    return await _login(session, *decoded)


async def _login(session: Session, login_name: str, password: str) -> str:
    user = await session.listener.logins.check(session.store, session.peer, login_name, password,
                                               gone=lambda: session.conn.lost)
    if user is None:
        if session.failures.add():
            session.untagged(b"BYE Too many authentication failures")
            session.closing = True
        raise No("Authentication failed", "AUTHENTICATIONFAILED")
    session.user, session.state = user, "auth"
    return "[CAPABILITY " + " ".join(cap.decode() for cap in session.capabilities()) + "] Logged in"


async def compress(session: Session, args: c.Compress) -> str:
    """COMPRESS=DEFLATE (RFC 4978): both directions deflated from the byte after this answer."""
    if args.mechanism != "DEFLATE":
        raise No("Unsupported compression mechanism")
    if session.compressed:
        raise No("Compression is already active", "COMPRESSIONACTIVE")

    async def start() -> None:
        session.conn.start_compression()
        session.compressed = True

    session.then = start
    return "DEFLATE active"


async def enable(session: Session, args: c.Enable) -> str:
    """ENABLE (RFC 5161) of UTF8=ACCEPT, CONDSTORE and QRESYNC (which implies CONDSTORE, RFC 7162);
    the others asked for are left out of the ENABLED answer."""
    enabled = [name for name in dict.fromkeys(args.capabilities) if name in ("UTF8=ACCEPT", "CONDSTORE", "QRESYNC")]
    if "UTF8=ACCEPT" in enabled:
        session.utf8 = True
    if "CONDSTORE" in enabled or "QRESYNC" in enabled:
        condstore.enable(session, qresync="QRESYNC" in enabled)
    session.untagged(b"ENABLED" + b"".join(b" " + name.encode() for name in enabled))
    return "ENABLE completed"
