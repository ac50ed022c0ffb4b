"""The SMTP front end: MX receive, authenticated submission (STARTTLS on 587, implicit TLS on
465, each its own listener) and LMTP, on aiosmtpd.

`listeners(settings, store)` gives the servers a node runs; nothing here knows a backend.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from cassmail.config import Settings, SmtpSettings, host_port
from cassmail.inbound import Inbound
from cassmail.sieve.delivery import SieveFilter
from cassmail.smtp.handler import (
    LMTP_ROLE, MX, SUBMISSION, SUBMISSIONS, DeliveryHandler, QueueHandoff, Role, advertised_size,
)
from cassmail.smtp.protocol import SASL_MECHANISMS, CassmailLMTP, CassmailSMTP, RateLimits
from cassmail.smtp.spool import SpoolPolicy
from cassmail.store.base import Store
from cassmail.tls import server_context


def _factory(
    settings: Settings, listener: SmtpSettings, role: Role, store: Store, outbound: QueueHandoff | None
) -> tuple[Callable[[], asyncio.Protocol], DeliveryHandler]:
    checks = Inbound(settings.inbound, settings.relay, settings.node.name) if role is MX else None
    sieve = SieveFilter(store, settings.sieve, settings.node.name, outbound, listener.recipient_delimiter
                        ) if settings.sieve.enabled else None
    handler = DeliveryHandler(store, listener, role, settings.node.name, outbound, checks, sieve)
    tls = server_context(listener)
    engine = CassmailLMTP if role.lmtp else CassmailSMTP
    starttls = tls if (tls is not None and not listener.implicit_tls) else None
    # The SIZE advertised (and DATA's limit) leaves room for the trace headers added before the
    # store checks its own limit, so a message within SIZE is never refused after DATA.
    limit = advertised_size(settings.store.max_message_size)
    # One table of peer addresses per listener and worker, shared by its sessions.
    rates = RateLimits(listener.max_command_rate, listener.max_connection_rate, listener.rate_limit_exempt)
    spool = SpoolPolicy(listener.spool_above, listener.spool_dir)

    # aiosmtpd asks for TLS before AUTH (auth_require_tls) only where STARTTLS is to come; an
    # implicit-TLS session is secure from its first byte.
    plaintext_ok = handler.logins.plaintext_ok(secure=listener.implicit_tls)
    # Only submission offers AUTH: MX and LMTP peers are other servers.
    excluded = () if role.submission else SASL_MECHANISMS

    def make() -> asyncio.Protocol:
        return engine(
            handler,
            data_size_limit=limit,
            enable_SMTPUTF8=True,
            decode_data=False,
            hostname=settings.node.name,
            ident="cassmail",
            tls_context=starttls,
            timeout=listener.timeout,
            auth_required=role.submission,
            auth_require_tls=not plaintext_ok,
            auth_exclude_mechanism=excluded,
            command_call_limit=listener.max_commands,
            command_length=listener.max_command_length,
            rates=rates,
            spool=spool,
        )

    return make, handler


LISTENERS: tuple[tuple[str, Role], ...] = (
    ("smtp", MX), ("submission", SUBMISSION), ("submissions", SUBMISSIONS), ("lmtp", LMTP_ROLE),
)


async def start(
    settings: Settings, store: Store, sockets: dict[str, socket.socket] | None = None,
    outbound: QueueHandoff | None = None,
) -> list[tuple[asyncio.Server, DeliveryHandler]]:
    """Start every enabled SMTP-family listener; `sockets` are pre-bound ones. Each server comes
    with its handler, which counts the sessions in progress (`sessions`). `outbound` is this
    process's delivery worker, which takes the messages queued for other domains."""
    loop = asyncio.get_running_loop()
    servers = []
    for name, role in LISTENERS:
        listener: SmtpSettings = getattr(settings, name)
        if not listener.enabled:
            continue
        factory, handler = _factory(settings, listener, role, store, outbound)
        ssl = server_context(listener) if listener.implicit_tls else None
        if sockets and name in sockets:
            server = await loop.create_server(factory, sock=sockets[name], ssl=ssl)
        else:
            host, port = host_port(listener.listen)
            server = await loop.create_server(factory, host, port, ssl=ssl, reuse_port=True, backlog=1024)
        servers.append((server, handler))
    return servers


__all__ = ["start", "LISTENERS"]
