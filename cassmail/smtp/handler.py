"""What cassmail does at each SMTP step: who may send, who may receive, and storing the message.

One handler object serves every session of one listener (aiosmtpd calls its
`handle_*` hooks). It knows the store only through the Store contract.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from dataclasses import dataclass
from email.utils import format_datetime
from datetime import datetime, timezone
from typing import Any, Protocol

from aiosmtpd.smtp import AuthResult, Envelope, Session

from cassmail import auth
from cassmail.config import SmtpSettings
from cassmail.inbound import ADDED_MAX, Inbound, deliver as deliver_to
from cassmail.logs import Timer, kv
from cassmail.model import Address, InvalidInput
from cassmail.sessions import Sessions
from cassmail.store.base import (
    Body,
    MessageTooLarge,
    NoSuchMailbox,
    NoSuchUser,
    QuotaExceeded,
    Store,
    StoreError,
    StoreUnavailable,
    Target,
    local_recipients,
)
from cassmail.sieve.delivery import SieveFilter
from cassmail.smtp.protocol import peer_ip
from cassmail.smtp.spool import Spooled
from cassmail.tls import describe

log = logging.getLogger("cassmail.smtp")

TEMPORARY = "451 4.3.0 Mail system temporarily unavailable, try again later"

#: Bytes of the store's message size limit kept for the trace headers (Return-Path, Received):
#: every part of them is bounded (the HELO name to 128 characters, addresses to 256 octets),
#: and together they stay well under this.
TRACE_RESERVE = 2048
#: Bytes kept for the Delivered-To field a Sieve redirect puts on the copy it queues (an address).
REDIRECT_RESERVE = 1024
#: Everything written on top of the message as received before the store checks its limit:
#: the trace, what the MX's checks add (inbound.ADDED_MAX: Authentication-Results, X-Spam-*, a
#: rewritten Subject) and a redirect's Delivered-To. 8 KiB.
HEADER_RESERVE = TRACE_RESERVE + ADDED_MAX + REDIRECT_RESERVE


def advertised_size(store_limit: int) -> int:
    """The SIZE (RFC 1870) to advertise, and DATA's limit, for a store that takes messages of up
    to `store_limit` bytes: what is left after HEADER_RESERVE, on every listener (half, for a
    limit so small that the reserve would not fit twice)."""
    return max(store_limit - HEADER_RESERVE, store_limit // 2)


@dataclass
class Role:
    """How a listener behaves: MX (anyone, local recipients only), submission (authenticated
    users, copy to Sent) or LMTP (a trusted MTA hands over mail, one reply per recipient)."""

    name: str
    submission: bool = False
    lmtp: bool = False


MX = Role("smtp")
SUBMISSION = Role("submission", submission=True)
SUBMISSIONS = Role("submissions", submission=True)
LMTP_ROLE = Role("lmtp", lmtp=True)


class QueueHandoff(Protocol):
    """The delivery worker of this process, as the SMTP side sees it: a message queued here is
    leased to it from the start and handed over at once when it has room (`reserve`), else it
    is only told to look at the queue (`notify`)."""

    #: Seconds of the lease a handed-over entry starts with.
    lease: float

    def reserve(self) -> str | None:
        """A slot for a message about to be queued: the owner its lease is written for, or None."""

    def unreserve(self) -> None:
        """The reserved message was not queued after all."""

    def hand_over(self, entry_id: uuid.UUID, sender: str, recipients: list[str], message: bytes, smtputf8: bool,
                  queued_at: float) -> None:
        """Deliver a message just queued with the reserved lease (the bytes are those queued)."""

    def notify(self) -> None:
        """A message was queued without a lease: look at the queue now."""


class LocalDomains:
    """The store's local domains, cached briefly for the common case (mail to a local domain).

    On the MX only hits are trusted from the cache: a domain not in it is asked of the store,
    so a domain added a moment ago is accepted at once (refusing it would bounce its mail); a
    removed one is refused within `ttl`. Submission, where most recipients are in other
    domains, trusts misses too (`trust_miss`) except for the sender's own domain: mail to
    another domain added less than `ttl` ago goes out through its MX, which is this service,
    rather than costing a store read per remote recipient.
    """

    def __init__(self, store: Store, ttl: float) -> None:
        self.store, self.ttl = store, ttl
        self._domains: frozenset[str] = frozenset()
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def contains(self, domain: str, trust_miss: bool = False) -> bool:
        if self.ttl > 0 and time.monotonic() >= self._expires:
            async with self._lock:
                if time.monotonic() >= self._expires:
                    self._domains = frozenset(await self.store.list_domains())
                    self._expires = time.monotonic() + self.ttl
        if domain in self._domains:
            return True
        if trust_miss and self.ttl > 0:
            return False
        return await self.store.is_local_domain(domain)


class DeliveryHandler(Sessions):
    def __init__(self, store: Store, settings: SmtpSettings, role: Role, node_name: str,
                 outbound: QueueHandoff | None = None, inbound: Inbound | None = None,
                 sieve: SieveFilter | None = None) -> None:
        self.store = store
        #: The MX's checks between DATA and the store (sender authentication, spam filter), if any.
        self.inbound = inbound if inbound is not None and inbound.enabled else None
        #: With the checks off, the MX's Inbound only removes forged Authentication-Results.
        self.results_guard = inbound if inbound is not None and not inbound.enabled else None
        #: Users' Sieve scripts, run on each local copy before it is stored (None: not run).
        self.sieve = sieve
        #: This process's delivery worker, which takes what is queued here (None: no worker here).
        self.outbound = outbound
        self.settings = settings
        self.role = role
        self.node_name = node_name
        self.domains = LocalDomains(store, settings.domain_cache_seconds)
        #: Networks whose clients may submit without AUTH (submission only: the MX never relays).
        self.trusted_networks = tuple(ipaddress.ip_network(n, strict=False) for n in settings.trusted_networks
                                      ) if role.submission else ()
        self.logins = auth.Logins(role.name, settings)
        Sessions.__init__(self, settings.max_connections)
        #: Mailboxes a delivery makes when the user has none of that name (the Junk mailbox).
        self.creatable: frozenset[str] = frozenset({self.inbound.settings.junk_mailbox} if self.inbound else ())

    # ------------------------------------------------------------------ session

    async def handle_HELO(self, server: Any, session: Session, envelope: Envelope, hostname: str) -> str:
        session.host_name = hostname
        server.in_ehlo_reply = True  # RFC 2034: no enhanced code in the reply to HELO
        return f"250 {server.hostname}"

    async def handle_EHLO(
        self, server: Any, session: Session, envelope: Envelope, hostname: str, responses: list[str]
    ) -> list[str]:
        """aiosmtpd's EHLO keywords plus PIPELINING and ENHANCEDSTATUSCODES; AUTH only where offered."""
        session.host_name = hostname
        server.in_ehlo_reply = True
        lines = [r for r in responses[:-1] if not (r.startswith("250-AUTH") and r.strip() == "250-AUTH")]
        return [*lines, "250-PIPELINING", "250-ENHANCEDSTATUSCODES", responses[-1]]

    # ------------------------------------------------------------------ AUTH

    async def authenticate(self, server: Any, login: bytes, password: bytes) -> AuthResult:
        """Check a login against the store; count failures and close the session after too many."""
        session: Session = server.session
        try:
            user = await self.logins.check(self.store, _peer(session), login.decode("utf-8", "replace"),
                                           password.decode("utf-8", "replace"),
                                           gone=lambda: server.transport is None or server.transport.is_closing())
        except StoreError:
            return AuthResult(success=False, handled=False, message="454 4.7.0 Temporary authentication failure")
        if user is not None:
            return AuthResult(success=True, auth_data=user)
        # On aiosmtpd's session, which STARTTLS renews (RFC 3207 4.2): the count starts again there.
        failures = getattr(session, "auth_failures", None)
        if failures is None:
            failures = session.auth_failures = self.logins.failures()  # type: ignore[attr-defined]
        if failures.add():
            await server.push("421 4.7.0 Too many failed authentications, closing connection")
            server.transport.close()
            return AuthResult(success=False, handled=True)
        return AuthResult(success=False, handled=False)

    # ------------------------------------------------------------------ envelope

    async def handle_MAIL(
        self, server: Any, session: Session, envelope: Envelope, address: str, mail_options: list[str]
    ) -> str:
        null = address in ("", "<>")  # the null reverse-path of bounces; aiosmtpd keeps it as "<>"
        if not null:
            sender = _path(address, envelope, "553 5.1.7 Bad sender address syntax")
            if isinstance(sender, str):
                return sender
        elif self.role.submission:
            return "553 5.7.1 The null sender is not allowed for submission"
        if self.role.submission and not null and sender.key != session.auth_data and session.authenticated:
            # Not their own address: one read, whether it is an alias that lists them.
            try:
                owners = await self.store.get_alias(sender.key)
            except StoreError as exc:
                log.warning(kv("mail", listener=self.role.name, peer=_peer(session), sender=sender.key,
                               result="tempfail", error=exc))
                return TEMPORARY
            if session.auth_data not in (owners or ()):
                return f"553 5.7.1 Sender address <{address}> is not owned by the authenticated user {session.auth_data}"
        envelope.mail_from = "<>" if null else address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 Sender OK"

    async def handle_RCPT(
        self, server: Any, session: Session, envelope: Envelope, address: str, rcpt_options: list[str]
    ) -> str:
        if len(envelope.rcpt_tos) >= self.settings.max_recipients:
            return f"452 4.5.3 Too many recipients (at most {self.settings.max_recipients} per message)"
        rcpt = _path(address, envelope, "501 5.1.3 Bad recipient address syntax")
        if isinstance(rcpt, str):
            return rcpt
        try:
            own = (session.auth_data or envelope.mail_from or "").rpartition("@")[2].lower()
            local = await self.domains.contains(rcpt.domain, trust_miss=self.role.submission and rcpt.domain != own)
            if not local:
                if self.role.submission and (session.authenticated or getattr(session, "trusted", False)):
                    # An authenticated user may send anywhere: the message is queued for it.
                    envelope.rcpt_tos.append(str(rcpt))
                    _remote(envelope).append(str(rcpt))
                    envelope.rcpt_options.extend(rcpt_options)
                    return "250 2.1.5 Recipient OK"
                return "550 5.7.1 Relaying denied"
            users = await local_recipients(self.store, rcpt.key, self.settings.recipient_delimiter)
            if not users:
                return f"550 5.1.1 <{address}>: Recipient address rejected: no such user here"
            # Over quota, when the store can tell cheaply (else the delivery after DATA decides);
            # the size is what MAIL's SIZE= declared, else a message of one byte.
            size = _declared_size(envelope)
            full = [u for u in users if await self.store.quota_allows(u, size) is False]
        except StoreError as exc:
            log.warning(kv("rcpt", listener=self.role.name, peer=_peer(session), rcpt=rcpt.key, result="tempfail", error=exc))
            return TEMPORARY
        if full and len(full) == len(users):  # an alias's users that are full get a DSN after DATA
            log.info(kv("rcpt", listener=self.role.name, peer=_peer(session), rcpt=rcpt.key, result="over-quota"))
            return self.quota_reply(address)
        # The envelope keeps the address as given (one LMTP reply per RCPT, `for <...>` in the
        # trace); the users it reaches are kept beside it for DATA.
        envelope.rcpt_tos.append(rcpt.key)
        _expansions(envelope)[rcpt.key] = users
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 Recipient OK"

    async def handle_VRFY(self, server: Any, session: Session, envelope: Envelope, address: str) -> str:
        # Answering yes or no would let anyone harvest the user list (RFC 5321 3.5.3).
        return "252 2.5.2 Cannot VRFY user, but will accept message and attempt delivery"

    # ------------------------------------------------------------------ DATA

    async def handle_DATA(self, server: Any, session: Session, envelope: Envelope) -> str:
        timer = Timer()
        queue_id = uuid.uuid4().hex[:16]
        body = envelope.original_content
        assert isinstance(body, (bytes, bytearray, Spooled))
        size = len(body)
        targets = [Target(user) for user in _recipients(envelope)]
        sent_copy = None
        if self.role.submission and session.auth_data:
            sent_copy = Target(session.auth_data, "Sent", frozenset({"\\Seen"}))
            targets.append(sent_copy)
        remote = list(dict.fromkeys(_remote(envelope)))
        sender = "" if envelope.mail_from == "<>" else envelope.mail_from
        fields = self._delivery_fields(session, envelope, size, queue_id)
        added = b""
        if self.inbound is not None:
            # The checks read the message in memory (DKIM hashes the whole body), a spooled one too.
            verdict = await self.inbound.check(bytes(body), _peer(session), session.host_name or "", sender,
                                               _recipients(envelope), queue_id)
            if verdict.reply:
                result = "tempfail" if verdict.reply.startswith("4") else "rejected"
                log.info(kv("delivery", **fields, result=result, why=verdict.action, ms=timer.ms))
                return self.per_recipient(envelope, verdict.reply)
            body, added = verdict.message, verdict.headers
            targets = verdict.file(targets, self.inbound.settings.junk_mailbox)
        elif self.results_guard is not None:
            seen = body.view() if isinstance(body, Spooled) else body
            stripped = self.results_guard.without_forged_results(seen)
            if stripped is not seen:  # a forged field went: the message is a new one
                body = stripped
        trace = self.trace_headers(server, session, envelope, queue_id) + added
        message: Body
        if isinstance(body, Spooled):
            # In the room left at the spool file's start: the message stays where it is.
            message = body.put_in_front(trace)
        elif isinstance(body, bytearray):
            # DATA's own buffer (read_data): the headers go in front of it in place, so a large
            # message is not copied once more.
            body[0:0] = trace
            message = body
        else:
            message = trace + body
        # The worker of this process takes a message queued here at once, when it has room.
        owner = self.outbound.reserve() if remote and self.outbound is not None else None
        entry_id: uuid.UUID | None = None
        queued_at = time.time()
        plan = None
        try:
            if self.sieve is not None:  # last before storing: users' scripts see the message as stored
                plan = await self.sieve.plan(message, sender, _addressed(envelope), targets, skip=sent_copy)
                if plan.all_rejected and not remote:
                    if owner is not None and self.outbound is not None:
                        self.outbound.unreserve()
                    log.info(kv("delivery", **fields, result="rejected", ms=timer.ms))
                    return self.per_recipient(envelope, plan.refusal)
                targets = plan.targets
            targets, ids, full = await self._deliver_local(message, targets)
            quota = _QuotaOutcome.of(envelope, full, sent_copy, self.role.lmtp)
            if quota.refused and len(quota.refused) == len(envelope.rcpt_tos) \
                    and not remote and not (plan is not None and plan.forwards):
                # Every recipient is full: the reply to DATA says so (and the sender's Sent copy
                # goes again, the message having gone nowhere).
                await self._undo(targets, ids)
                log.info(kv("delivery", **fields, result="over-quota", ms=timer.ms))
                if self.role.lmtp:
                    return "\r\n".join(self.quota_reply(r) for r in envelope.rcpt_tos)
                return self.quota_reply()
            if remote or (plan is not None and plan.forwards) or quota.notify:
                try:
                    if remote:
                        lease = (owner, self.outbound.lease) if owner is not None and self.outbound is not None else None
                        entry_id = await self.store.enqueue(message, sender, remote, smtputf8=envelope.smtp_utf8,
                                                            lease=lease)
                    if plan is not None and self.sieve is not None:
                        await self.sieve.forward(plan, message, sender, envelope.smtp_utf8)
                    if quota.notify:  # stored before the 250, or the sender is told to retry
                        await self._quota_notice(quota.notify, message, sender)
                except BaseException:
                    await self._undo(targets, ids)
                    raise
        except BaseException as exc:
            if owner is not None and self.outbound is not None:
                self.outbound.unreserve()
            if isinstance(exc, MessageTooLarge):
                log.info(kv("delivery", **fields, result="too-large", ms=timer.ms))
                return self.per_recipient(envelope, "552 5.3.4 Message too big for system")
            if isinstance(exc, (StoreUnavailable, NoSuchUser, NoSuchMailbox)):
                log.warning(kv("delivery", **fields, result="tempfail", ms=timer.ms, error=exc))
                return self.per_recipient(envelope, TEMPORARY)
            if isinstance(exc, StoreError):
                log.error(kv("delivery", **fields, result="tempfail", ms=timer.ms, error=exc))
                return self.per_recipient(envelope, TEMPORARY)
            raise
        server.deliveries += 1
        log.info(kv("delivery", **fields, result="ok", ms=timer.ms, over_quota=len(full) or None,
                    sent_copy="over-quota" if quota.sent_lost else None))
        if entry_id is not None and self.outbound is not None:
            if owner is not None:
                self.outbound.hand_over(entry_id, sender, remote, bytes(message), envelope.smtp_utf8, queued_at)
            else:
                self.outbound.notify()
        if plan is not None and self.sieve is not None:  # vacation answers, notices of rejection
            plan.vacations = [v for v in plan.vacations if v[0] not in full]  # they did not get it
            await self.sieve.follow_up(plan, message, sender)
        ok = f"250 2.0.0 OK id={queue_id}"
        if self.role.lmtp and quota.refused:  # one reply per RCPT line (RFC 2033 4.2)
            return "\r\n".join(self.quota_reply(r) if r in quota.refused else ok for r in envelope.rcpt_tos)
        return self.per_recipient(envelope, ok)

    async def _deliver_local(self, message: Body, targets: list[Target]
                             ) -> tuple[list[Target], list[uuid.UUID], set[str]]:
        """Store the local copies, leaving out the users the store finds over quota (it refuses
        the whole call, naming them, before writing anything): (targets stored, their ids, the
        users left out)."""
        full: set[str] = set()
        while targets:
            try:
                return targets, await deliver_to(self.store, message, targets, self.creatable), full
            except QuotaExceeded as exc:
                named = set(exc.users) & {t.user for t in targets}
                if not named:
                    raise
                full |= named
                targets = [t for t in targets if t.user not in named]
        return targets, [], full

    def quota_reply(self, address: str | None = None) -> str:
        """The answer for a recipient over quota: 552 5.2.2, or 452 4.2.2 with quota_full_tempfail."""
        who = f"<{address}>: " if address else ""
        if self.settings.quota_full_tempfail:
            return f"452 4.2.2 {who}Mailbox full, try again later"
        return f"552 5.2.2 {who}Mailbox full"

    async def _quota_notice(self, users: list[str], message: Body, sender: str) -> None:
        """A DSN (RFC 3464) to the sender naming the recipients over quota that the reply to DATA
        could not refuse (other recipients took the message); none to <>. Into the sender's
        mailbox when local (dropped, logged, when they are full too), queued otherwise. A store
        failure propagates: the message is then refused with 451 and sent again."""
        from cassmail.delivery import dsn

        if not sender:
            return
        reply = "552 5.2.2 Mailbox full"
        report = dsn.build(self.node_name, sender, bytes(message), [dsn.Failure(u, "5.2.2", reply) for u in users],
                           delayed=False, arrival=time.time())
        if await self.domains.contains(sender.rpartition("@")[2].lower()):
            owners = await local_recipients(self.store, sender, self.settings.recipient_delimiter)
            try:
                if owners:
                    await self.store.deliver(report, [Target(u) for u in owners])
            except QuotaExceeded:
                log.info(kv("dsn", to=sender, kind="over-quota", result="dropped", error="the sender is over quota too"))
            return
        await self.store.enqueue(report, "", [sender], smtputf8=not sender.isascii())
        if self.outbound is not None:
            self.outbound.notify()

    async def _undo(self, targets: list[Target], ids: list[uuid.UUID]) -> None:
        """The local copies of a message whose queued part could not be stored: the sender is
        told to retry, and the retry must not leave them twice (best effort)."""
        for target, message_id in zip(targets, ids):
            try:
                await self.store.delete_messages(target.user, target.mailbox, [message_id])
            except StoreError as exc:
                log.warning(kv("delivery-undo", user=target.user, mailbox=target.mailbox, result="fail", error=exc))

    def log_unkept(self, server: Any, size: int, ms: int, result: str, error: Exception | None = None) -> None:
        """The delivery line of a message refused while DATA was read (past max_message_size:
        too-large; its spool file failed: tempfail): nothing reached the store, but the attempt
        is logged like any other delivery."""
        fields = self._delivery_fields(server.session, server.envelope, size, None)
        if error is None:
            log.info(kv("delivery", **fields, result=result, ms=ms))
        else:
            log.error(kv("delivery", **fields, result=result, ms=ms, error=error))

    def _delivery_fields(self, session: Session, envelope: Envelope, size: int, queue_id: str | None) -> dict[str, Any]:
        expansions = _expansions(envelope)
        aliased = any(expansions.get(r, [r]) != [r] for r in envelope.rcpt_tos)
        expanded = len(_recipients(envelope)) if aliased else None  # users reached, logged when an alias was named
        return dict(
            listener=self.role.name, peer=_peer(session), helo=session.host_name, user=session.auth_data,
            sender=envelope.mail_from, rcpts=len(envelope.rcpt_tos), users=expanded, queued=len(_remote(envelope)) or None,
            size=size, id=queue_id,
        )

    def per_recipient(self, envelope: Envelope, status: str) -> str:
        """LMTP answers DATA once per accepted recipient (RFC 2033 4.2); SMTP once."""
        return "\r\n".join([status] * len(envelope.rcpt_tos)) if self.role.lmtp else status

    def trace_headers(self, server: Any, session: Session, envelope: Envelope, queue_id: str) -> bytes:
        """Return-Path and a Received header (RFC 5321 4.4) with the TLS and auth facts (RFC 3848)."""
        tls = describe(server.transport.get_extra_info("ssl_object")) if server.transport else None
        if self.role.lmtp:
            protocol = "LMTP"
        else:
            protocol = "ESMTP" if session.extended_smtp else "SMTP"
        if envelope.smtp_utf8:
            protocol = "UTF8" + protocol.replace("ESMTP", "SMTP")
        protocol += ("S" if tls else "") + ("A" if session.authenticated else "")
        ip = _peer(session)
        helo = _clean(session.host_name or "unknown")
        lines = [
            f"Return-Path: <{'' if envelope.mail_from == '<>' else envelope.mail_from}>",
            f"Received: from {helo} ([{ip}])",
            f"\tby {self.node_name} (cassmail) with {protocol} id {queue_id}",
        ]
        if tls:
            lines.append(f"\t(using {tls})")
        if session.authenticated and session.auth_data:
            lines.append(f"\t(authenticated as {session.auth_data})")
        when = format_datetime(datetime.now(timezone.utc))
        if len(envelope.rcpt_tos) == 1:
            lines.append(f"\tfor <{envelope.rcpt_tos[0]}>; {when}")
        else:
            lines[-1] += f"; {when}"
        return ("\r\n".join(lines) + "\r\n").encode("utf-8")

    async def handle_exception(self, error: Exception) -> str:
        """A bug must not reach the client as a traceback; a temporary error makes it retry."""
        log.error(kv("session-error", error=type(error).__name__), exc_info=error)
        return "451 4.3.0 Internal error, try again later"


@dataclass
class _QuotaOutcome:
    """What the users a delivery left out for their quota mean for the replies: the RCPT
    addresses whose every user is full (refused, where a reply can say so), the full users
    reached by an address that is not refused (a DSN names them), whether the sender's own copy
    in Sent was left out."""

    refused: set[str]
    notify: list[str]
    sent_lost: bool

    @classmethod
    def of(cls, envelope: Envelope, full: set[str], sent_copy: Target | None, lmtp: bool) -> _QuotaOutcome:
        """LMTP replies per RCPT, so only the full users of an alias that others of it took need
        a DSN; SMTP's one reply is a 250 for everyone once anyone took the message."""
        if not full:
            return cls(set(), [], False)
        expansions = _expansions(envelope)
        refused = {r for r in envelope.rcpt_tos if r in expansions and all(u in full for u in expansions[r])}
        answered = refused if lmtp else set()
        notify = [u for u in _recipients(envelope) if u in full
                  and any(u in expansions[r] for r in envelope.rcpt_tos if r in expansions and r not in answered)]
        sent_lost = sent_copy is not None and sent_copy.user in full
        return cls(refused, notify, sent_lost)


def _declared_size(envelope: Envelope) -> int:
    """The message size MAIL's SIZE= parameter declared (RFC 1870), at least 1; 1 without one."""
    for option in envelope.mail_options:
        name, _, value = str(option).partition("=")
        if name.upper() == "SIZE" and value.isdigit():
            return max(int(value), 1)
    return 1


def _expansions(envelope: Envelope) -> dict[str, list[str]]:
    """Recipient key -> the users it delivers to (itself, or an alias's users), kept on the
    envelope so that a new transaction (a new Envelope) starts without any."""
    found: dict[str, list[str]] | None = getattr(envelope, "cassmail_expansions", None)
    if found is None:
        found = {}
        envelope.cassmail_expansions = found  # type: ignore[attr-defined]
    return found


def _addressed(envelope: Envelope) -> dict[str, str]:
    """Each local user -> the recipient address that reached them, as the sender wrote it (a
    `+detail` kept): what a Sieve script's envelope "to" is."""
    expansions = _expansions(envelope)
    found: dict[str, str] = {}
    for rcpt in envelope.rcpt_tos:
        for user in expansions.get(rcpt, ()):
            found.setdefault(user, rcpt)
    return found


def _remote(envelope: Envelope) -> list[str]:
    """The recipients in other domains (submission only), queued for delivery, as given."""
    found: list[str] | None = getattr(envelope, "cassmail_remote", None)
    if found is None:
        found = []
        envelope.cassmail_remote = found  # type: ignore[attr-defined]
    return found


def _recipients(envelope: Envelope) -> list[str]:
    """The local users a message goes to, each once in the order first named: a user named
    directly and through an alias, or by two aliases, gets one copy."""
    expansions = _expansions(envelope)
    return list(dict.fromkeys(user for rcpt in envelope.rcpt_tos if rcpt in expansions for user in expansions[rcpt]))


def _path(address: str, envelope: Envelope, syntax_error: str) -> Address | str:
    """A MAIL or RCPT address parsed, or the reply refusing it (bad syntax; UTF-8 without SMTPUTF8)."""
    try:
        parsed = Address.parse(address)
    except InvalidInput as exc:
        return f"{syntax_error}: {exc}"
    # What the client wrote decides: an ASCII domain in A-labels (xn--...) is parsed to its
    # Unicode form, but it was sent as plain ASCII.
    if not envelope.smtp_utf8 and not address.isascii():
        return "553 5.6.7 Non-ASCII address needs the SMTPUTF8 parameter"
    return parsed


def _peer(session: Session) -> str:
    return peer_ip(session.peer)


def _clean(text: str) -> str:
    """A client-chosen name made safe for a header: printable, no parentheses, bounded."""
    return "".join(c for c in text if c.isprintable() and c not in "()\\;")[:128] or "unknown"
