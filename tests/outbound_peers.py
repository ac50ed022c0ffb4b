"""The rest of the world for outbound tests, on loopback: a DNS server of our own (dnslib's),
remote MXs (aiosmtpd with STARTTLS, recording what they receive), and remotes that misbehave;
and an LMTP server (aiosmtpd's) that keeps what a client delivers to it.

Each runs in a thread of the test process, on its own address (127.0.0.x) and one shared
port, the way MX hosts on many machines listen on port 25.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dns.message
import dns.query
import dnslib
from aiosmtpd.controller import Controller
from aiosmtpd.lmtp import LMTP
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from tests.nodes import take_port


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def ipv6_loopback() -> bool:
    """Whether this machine's loopback takes IPv6 (::1): a container may have it off."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port_on(*hosts: str) -> int:
    """A TCP port free on every one of `hosts` (IPv4 or IPv6 addresses), never one that this or
    tests.nodes.free_port handed out before in this process."""
    while True:
        with socket.socket(_family(hosts[0])) as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        free = True
        for host in hosts[1:]:
            with socket.socket(_family(host)) as other:
                try:
                    other.bind((host, port))
                except OSError:
                    free = False
                    break
        if free and take_port(port):
            return port


# ----------------------------------------------------------------------------- DNS


class Zone(BaseResolver):
    """Answers from `records`: (name, type) -> list of zone-file rdata texts. A name with no
    record of any type is NXDOMAIN; a name with others is an empty answer (NOERROR); a name in
    `failing` is SERVFAIL (a broken zone, for DNS failure tests)."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.failing: set[str] = set()
        self.lock = threading.Lock()

    def add(self, name: str, rtype: str, *values: str) -> None:
        with self.lock:
            self.records.setdefault((name.rstrip(".").lower(), rtype), []).extend(values)

    def resolve(self, request: dnslib.DNSRecord, handler: Any) -> dnslib.DNSRecord:
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".").lower()
        qtype = dnslib.QTYPE[request.q.qtype]
        with self.lock:
            if qname in self.failing:
                reply.header.rcode = dnslib.RCODE.SERVFAIL
                return reply
            found = self.records.get((qname, qtype), [])
            known = any(name == qname for name, _ in self.records)
        for value in found:
            zone_line = f"{qname}. 60 IN {qtype} {value}"
            for rr in dnslib.RR.fromZone(zone_line):
                reply.add_answer(rr)
        if not found and not known:
            reply.header.rcode = dnslib.RCODE.NXDOMAIN
        return reply


class Dns:
    """A DNS server on 127.0.0.1 (UDP and TCP on one free port) serving a `Zone`."""

    def __init__(self) -> None:
        self.zone = Zone()
        self.port = free_port_on("127.0.0.1")
        quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)
        self.udp = DNSServer(self.zone, address="127.0.0.1", port=self.port, logger=quiet)
        self.tcp = DNSServer(self.zone, address="127.0.0.1", port=self.port, tcp=True, logger=quiet)

    def start(self) -> Dns:
        self.udp.start_thread()
        self.tcp.start_thread()
        return self

    def stop(self) -> None:
        self.udp.stop()
        self.tcp.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def txt(self, name: str) -> bytes | None:
        """A TXT record as dkimpy's `dnsfunc` wants it, asked of this server over the network."""
        query = dns.message.make_query(name, "TXT")
        answer = dns.query.udp(query, "127.0.0.1", port=self.port, timeout=5)
        for rrset in answer.answer:
            for rdata in rrset:
                return b"".join(rdata.strings)
        return None


# ----------------------------------------------------------------------------- a remote MX


@dataclass
class Received:
    """One message a remote MX accepted."""

    sender: str
    recipients: list[str]
    content: bytes
    options: list[str]
    tls: bool
    peer: str
    #: Who authenticated (AUTH) in the session that sent it; "" when nobody did.
    login: str = ""
    at: float = field(default_factory=time.monotonic)


class _CountingSMTP(SMTP):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        fresh = getattr(self, "transport", None) is None
        super().connection_made(transport)
        if fresh:
            self.event_handler.connected(+1)

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_counted_out", False) is False:
            self._counted_out = True
            self.event_handler.connected(-1)
        super().connection_lost(exc)


class MxHandler:
    """What the remote does, decided by the recipient's local part:
    `tempfail-N*`: 451 to RCPT the first N times it is named, then 250;
    `reject*`: 550 5.1.1; `slow*`: DATA answered after `slow_seconds`; anything else 250."""

    def __init__(self) -> None:
        self.messages: list[Received] = []
        self.lock = threading.Lock()
        self.rcpt_seen: dict[str, int] = {}
        self.slow_seconds = 3.0
        self.open = 0
        self.most_open = 0
        self.sessions = 0
        #: When each DATA arrived whole (before a slow answer): a copy the sender may not have seen taken.
        self.data_started: list[float] = []

    def connected(self, delta: int) -> None:
        with self.lock:
            self.open += delta
            self.most_open = max(self.most_open, self.open)
            if delta > 0:
                self.sessions += 1

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          rcpt_options: list[str]) -> str:
        local = address.rpartition("@")[0].lower()
        with self.lock:
            seen = self.rcpt_seen[address] = self.rcpt_seen.get(address, 0) + 1
        if local.startswith("tempfail-"):
            times = int(local.split("-")[1])
            if seen <= times:
                return "451 4.2.0 Mailbox busy, try again later"
        if local.startswith("reject"):
            return "550 5.1.1 No such user here"
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        with self.lock:
            self.data_started.append(time.monotonic())
        if any(r.rpartition("@")[0].lower().startswith("slow") for r in envelope.rcpt_tos):
            await asyncio.sleep(self.slow_seconds)
        login = session.auth_data.login.decode() if session.authenticated and session.auth_data else ""
        with self.lock:
            self.messages.append(Received(
                envelope.mail_from, list(envelope.rcpt_tos), bytes(envelope.original_content or b""),
                list(envelope.mail_options), session.ssl is not None, str(session.peer[0]), login,
            ))
        return "250 2.0.0 Message accepted"

    def for_recipient(self, address: str) -> list[Received]:
        with self.lock:
            return [m for m in self.messages if address in m.recipients]


class RemoteMx(Controller):
    """aiosmtpd on host:port (IPv4 or IPv6) with SMTPUTF8, and STARTTLS when given `tls_files`.
    With `login` (user, password) it is a provider's smarthost: AUTH is offered only after
    STARTTLS, and no MAIL is taken before a successful AUTH."""

    def __init__(self, host: str, port: int, tls_files: dict[str, str] | None, handler: MxHandler | None = None,
                 login: tuple[str, str] | None = None) -> None:
        self.mx = handler or MxHandler()
        context = None
        if tls_files:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls_files["tls_cert"], tls_files["tls_key"])
        auth: dict[str, Any] = {}
        if login is not None:
            auth = {"auth_required": True, "auth_require_tls": True, "authenticator": _Password(*login)}
        super().__init__(self.mx, hostname=host, port=port, tls_context=context, enable_SMTPUTF8=True,
                         decode_data=False, data_size_limit=64 * 1024 * 1024, ready_timeout=10,
                         server_hostname=f"mx.{host}", **auth)

    def factory(self) -> SMTP:
        return _CountingSMTP(self.handler, **self.SMTP_kwargs)


class LmtpServer(Controller):
    """aiosmtpd's LMTP on 127.0.0.1: a local delivery agent that keeps each message (`mx.messages`)."""

    def __init__(self) -> None:
        self.mx = MxHandler()
        super().__init__(self.mx, hostname="127.0.0.1", port=free_port_on("127.0.0.1"), decode_data=False,
                         ready_timeout=10)

    def factory(self) -> SMTP:
        return LMTP(self.handler, **self.SMTP_kwargs)


class _Password:
    """aiosmtpd's authenticator for PLAIN and LOGIN: one user and password."""

    def __init__(self, user: str, password: str) -> None:
        self.user, self.password = user.encode(), password.encode()

    def __call__(self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any) -> AuthResult:
        good = isinstance(data, LoginPassword) and (data.login, data.password) == (self.user, self.password)
        return AuthResult(success=True, auth_data=data) if good else AuthResult(success=False, handled=False)  # 535


# ----------------------------------------------------------------------------- remotes that misbehave


class BadRemote:
    """A raw TCP server on host:port that does one wrong thing: `garbage` (greets with binary
    noise), `silent` (never says anything), `huge` (a 1 MB greeting line), `close-mid-data`
    (a fine SMTP server that hangs up once DATA has started); or `plain`, an SMTP server of
    RFC 5321 alone (no 8BITMIME, no SMTPUTF8, no STARTTLS) that keeps what it receives."""

    def __init__(self, host: str, port: int, mode: str) -> None:
        self.host, self.port, self.mode = host, port, mode
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.base_events.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.received: list[tuple[bytes, bytes]] = []  # (envelope commands, message) of `plain`

    def start(self) -> BadRemote:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, self.host, self.port), self.loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self.server is not None
            self.server.close()
            for writer in self.writers:
                writer.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            if self.mode == "garbage":
                writer.write(b"\x00\xff\xfe garbage \x01\x02\r\n\x7f\x80 more\r\n")
                await writer.drain()
                await reader.read(1024)
            elif self.mode == "silent":
                await reader.read(1 << 20)
            elif self.mode == "huge":
                writer.write(b"220-" + b"x" * (1 << 20) + b"\r\n220 hi\r\n")
                await writer.drain()
                await reader.read(1024)
            elif self.mode in ("close-mid-data", "plain"):
                await self._smtp(reader, writer, plain=self.mode == "plain")
            else:
                raise ValueError(self.mode)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _smtp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, plain: bool) -> None:
        """`plain`: RFC 5321 only, every message kept; else 8BITMIME offered and a hang-up once DATA began."""
        writer.write(b"220 plain.test SMTP\r\n" if plain else b"220 mid.test ESMTP\r\n")
        commands = b""
        while True:
            line = await reader.readline()
            if not line:
                return
            verb = line[:4].upper()
            if verb == b"EHLO":
                writer.write(b"250 plain.test\r\n" if plain else b"250-mid.test\r\n250 8BITMIME\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                await writer.drain()
                if not plain:
                    await reader.read(10)  # some of the message, then hang up
                    return
                data = await reader.readuntil(b"\r\n.\r\n")
                self.received.append((commands, data[:-3].replace(b"\r\n..", b"\r\n.")))
                commands = b""
                writer.write(b"250 OK\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 bye\r\n")
                return
            else:
                if verb in (b"MAIL", b"RCPT"):
                    commands += line
                writer.write(b"250 OK\r\n")
            await writer.drain()


def wait_until(check: Callable[[], Any], timeout: float = 30, interval: float = 0.1) -> Any:
    """The first truthy value of `check()`, polling; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {check}")
        time.sleep(interval)
