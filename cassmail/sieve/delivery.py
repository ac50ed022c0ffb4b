"""The Sieve step of local delivery: each recipient's active script turns their copy of a message
into the copies, forwards and answers it decides.

The SMTP/LMTP handler calls `SieveFilter.plan` on the message as it will be stored, just before
`Store.deliver`, and carries out the plan in three parts: the targets it stores, `forward` (the
redirects to other domains, queued; a failure there makes the sender retry, like any queued
part of a message) and `follow_up` once the message is safely stored (vacation answers and
notices of rejection, best effort: they are not the message). Every failure of a script (it
does not compile, it passes a limit, it names a mailbox that does not exist) keeps the
message in the recipient's mailbox as if there were no script, and is logged.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.policy import SMTP
from email.utils import formatdate, getaddresses, make_msgid
from typing import Any

from cassmail.config import SieveSettings
from cassmail.logs import kv
from cassmail.model import Address, InvalidInput, mailbox_name
from cassmail.sieve.script import (
    Discard,
    Envelope,
    FileInto,
    Keep,
    Limits,
    Message,
    Redirect,
    Reject,
    Script,
    SieveError,
    SieveRuntimeError,
    Vacation,
    compile_script,
    run,
)
from cassmail.store.base import MailboxExists, Store, Target, local_recipients

log = logging.getLogger("cassmail.sieve")

#: Local parts that never get a vacation answer (RFC 5230 4.5, RFC 3834 2).
_NO_ANSWER_LOCAL = re.compile(r"(?:owner-.*|.*-request|.*-owner|mailer-daemon|listserv|majordomo|postmaster|"
                              r"no-?reply|bounces?(?:[+-].*)?)\Z", re.IGNORECASE)
_LIST_HEADERS = ("list-id", "list-help", "list-subscribe", "list-unsubscribe", "list-post", "list-owner",
                 "list-archive")


def limits_of(settings: SieveSettings) -> Limits:
    return Limits(
        max_script_size=settings.max_script_size, max_actions=settings.max_actions,
        max_redirects=settings.max_redirects, max_regex_length=settings.max_regex_length,
        regex_timeout=settings.regex_timeout, max_body_bytes=settings.max_body_bytes,
    )


@dataclass
class Plan:
    """What the scripts decided for one message."""

    targets: list[Target]
    #: (user, addresses): copies to queue for other domains, from that user's redirects.
    forwards: list[tuple[str, list[str]]] = field(default_factory=list)
    #: (user, the address the sender wrote, reason) of each recipient whose script rejected it.
    rejections: list[tuple[str, str, str]] = field(default_factory=list)
    #: (user, the address the sender wrote, vacation action).
    vacations: list[tuple[str, str, Vacation]] = field(default_factory=list)
    #: True when every recipient that had a copy rejected the message and nothing else is
    #: stored: the SMTP answer can then be the refusal itself.
    all_rejected: bool = False

    @property
    def refusal(self) -> str:
        reason = _one_line(self.rejections[0][2]) if self.rejections else ""
        return f"550 5.7.1 {reason or 'Message rejected by the recipient'}"


class SieveFilter:
    """The Sieve step of one listener in one worker."""

    def __init__(self, store: Store, settings: SieveSettings, node_name: str, outbound: Any = None,
                 recipient_delimiter: str = "+") -> None:
        self.store, self.settings, self.node_name, self.outbound = store, settings, node_name, outbound
        self.delimiter = recipient_delimiter
        self.limits = limits_of(settings)
        self._cache: OrderedDict[str, Script | SieveError] = OrderedDict()

    def compiled(self, text: str) -> Script:
        """The compiled script of a text, from the cache when it was seen before."""
        found = self._cache.get(text)
        if found is None:
            try:
                found = compile_script(text, self.limits)
            except SieveError as exc:
                found = exc
            if self.settings.cache_size:
                self._cache[text] = found
                while len(self._cache) > self.settings.cache_size:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        if isinstance(found, SieveError):
            raise found
        return found

    async def plan(self, message: bytes, sender: str, addressed: Mapping[str, str], targets: Sequence[Target],
                   skip: Target | None = None) -> Plan:
        """The targets and actions for `message`: each target of a user in `addressed` (user ->
        the address the sender wrote) goes through that user's active script; `skip` (the
        sender's own copy in Sent) and other targets stay as they are. StoreError propagates:
        the sender retries."""
        plan = Plan([])
        parsed: Message | None = None
        filtered = rejected = 0
        for target in targets:
            if target is skip or target.user not in addressed or not self.settings.enabled:
                plan.targets.append(target)
                continue
            active = await self.store.active_sieve_script(target.user)
            if active is None:
                plan.targets.append(target)
                continue
            name, text = active
            filtered += 1
            rcpt = addressed[target.user]
            try:
                script = self.compiled(text)
                if parsed is None:
                    parsed = Message(message, self.limits.max_body_bytes)
                # The mailbox list is read only when the script can look at it (mailboxexists) or
                # files into a mailbox: most scripts on most messages keep.
                mailboxes = await self._mailboxes(target.user) if "mailboxexists" in text else None
                actions = run(script, parsed, Envelope(sender, rcpt), mailboxes or (), self.limits)
                if mailboxes is None and any(isinstance(a, FileInto) for a in actions):
                    mailboxes = await self._mailboxes(target.user)
                outcome = await self._carry_out(target, rcpt, actions, mailboxes or [], parsed, plan)
            except (SieveError, SieveRuntimeError, InvalidInput) as exc:
                log.warning(kv("sieve", user=target.user, script=name, result="error", error=exc))
                plan.targets.append(target)
                continue
            rejected += outcome == "rejected"
            log.info(kv("sieve", user=target.user, script=name, result=outcome,
                        actions=",".join(type(a).__name__.lower() for a in actions)))
        plan.all_rejected = bool(rejected) and rejected == filtered and not plan.targets and not plan.forwards
        return plan

    async def _mailboxes(self, user: str) -> list[str]:
        return [m.name for m in await self.store.list_mailboxes(user)]

    async def _carry_out(self, target: Target, rcpt: str, actions: list[Any], mailboxes: list[str],
                         parsed: Message, plan: Plan) -> str:
        """Add one user's actions to the plan; the outcome word for the log."""
        user = target.user
        stored: list[Target] = []
        forwards: list[str] = []
        rejections: list[tuple[str, str, str]] = []
        vacations: list[tuple[str, str, Vacation]] = []
        existing = set(mailboxes)
        outcome = "kept"
        for action in actions:
            if isinstance(action, Keep):
                stored.append(Target(user, target.mailbox, target.flags | action.flags))
            elif isinstance(action, FileInto):
                name = mailbox_name(action.mailbox)
                if name not in existing:
                    if not action.create:
                        raise SieveRuntimeError(f"fileinto {name!r}: no such mailbox (use :create)")
                    try:
                        await self.store.create_mailbox(user, name)
                    except MailboxExists:
                        pass
                    existing.add(name)
                stored.append(Target(user, name, target.flags | action.flags))
                outcome = "filed"
            elif isinstance(action, Redirect):
                address = str(Address.parse(action.address))
                if any(_same(v, user) for v in parsed.headers("delivered-to")):
                    raise SieveRuntimeError(f"redirect to {address}: the message was redirected by {user} before (a loop)")
                local = await self.store.is_local_domain(address.rpartition("@")[2])
                if local:
                    users = await local_recipients(self.store, address, self.delimiter)
                    if not users:
                        raise SieveRuntimeError(f"redirect to {address}: no such local user")
                    stored.extend(Target(u) for u in users)
                else:
                    forwards.append(address)
                outcome = "redirected"
            elif isinstance(action, Reject):
                rejections.append((user, rcpt, action.reason))
                outcome = "rejected"
            elif isinstance(action, Vacation):
                vacations.append((user, rcpt, action))
            elif isinstance(action, Discard):
                outcome = "discarded"
        # Only now, when every action of the script could be carried out, does any of them count.
        plan.targets.extend(stored)
        plan.rejections.extend(rejections)
        plan.vacations.extend(vacations)
        if forwards:
            plan.forwards.append((user, forwards))
        return outcome

    async def forward(self, plan: Plan, message: bytes, sender: str, smtputf8: bool) -> None:
        """Queue the redirected copies. The envelope sender is the redirecting user (their own
        domain, so SPF passes and bounces reach them), or <> for a bounce; a Delivered-To
        header names the user so that a copy that comes back is not redirected again."""
        for user, addresses in plan.forwards:
            copy = f"Delivered-To: {user}\r\n".encode() + message
            await self.store.enqueue(copy, "" if not sender else user, addresses, smtputf8=smtputf8)
        if plan.forwards and self.outbound is not None:
            self.outbound.notify()

    async def follow_up(self, plan: Plan, message: bytes, sender: str) -> None:
        """Vacation answers and notices of rejection, once the message is stored; a failure is
        logged (the message itself is safe)."""
        from cassmail.store.base import StoreError

        for user, rcpt, vacation in plan.vacations:
            try:
                await self._vacation(user, rcpt, vacation, message, sender)
            except (StoreError, ValueError) as exc:  # ValueError: InvalidInput, a header email refuses
                log.warning(kv("vacation", user=user, to=sender, result="fail", error=exc))
        if not plan.all_rejected:
            for user, rcpt, reason in plan.rejections:
                try:
                    await self._reject_notice(rcpt, reason, message, sender)
                except (StoreError, ValueError) as exc:
                    log.warning(kv("sieve-reject", user=user, to=sender, result="fail", error=exc))

    # ----------------------------------------------------------------- answers

    def answer_refused(self, user: str, rcpt: str, vacation: Vacation, parsed: Message, sender: str) -> str | None:
        """Why no vacation answer goes to this sender (RFC 5230 4.5), or None when one may."""
        if not sender:
            return "null sender"
        if _same(sender, user) or _same(sender, rcpt):
            return "own address"
        if _NO_ANSWER_LOCAL.match(sender.rpartition("@")[0]):
            return "list or system sender"
        auto = [v.strip().lower() for v in parsed.headers("auto-submitted")]
        if any(v and not v.startswith("no") for v in auto):
            return "auto-submitted"
        if any(parsed.raw_headers(h) for h in _LIST_HEADERS):
            return "mailing list"
        if any(v.strip().lower() in ("bulk", "list", "junk") for v in parsed.headers("precedence")):
            return "bulk"
        mine = {user.lower(), rcpt.lower(), *(a.lower() for a in vacation.addresses)}
        named = {a.lower() for _, a in getaddresses([v for h in ("to", "cc", "bcc", "resent-to", "resent-cc")
                                                    for v in parsed.headers(h)]) if a}
        if not mine & named and not any(_same(a, m) for a in named for m in mine):
            return "not addressed to the user"
        return None

    def period(self, vacation: Vacation) -> float:
        seconds = self.settings.vacation_default_period if vacation.seconds is None else float(vacation.seconds)
        return min(max(seconds, self.settings.vacation_min_period), self.settings.vacation_max_period)

    async def _vacation(self, user: str, rcpt: str, vacation: Vacation, message: bytes, sender: str) -> None:
        parsed = Message(message, self.limits.max_body_bytes)
        why_not = self.answer_refused(user, rcpt, vacation, parsed, sender)
        if why_not is not None:
            log.info(kv("vacation", user=user, to=sender or "<>", result="skipped", reason=why_not))
            return
        key = hashlib.sha256("\0".join([user, vacation.handle, sender.lower()]).encode()).hexdigest()[:40]
        if not await self.store.note_vacation(user, key, self.period(vacation)):
            log.info(kv("vacation", user=user, to=sender, result="skipped", reason="answered in this period"))
            return
        reply = self.vacation_message(user, vacation, parsed, sender, rcpt)
        await self.send(reply, "", sender)
        log.info(kv("vacation", user=user, to=sender, result="sent"))

    def vacation_message(self, user: str, vacation: Vacation, parsed: Message, sender: str, rcpt: str = "") -> bytes:
        """The answer (RFC 5230 5, RFC 3834): In-Reply-To and References of the original,
        Auto-Submitted: auto-replied, and the script's text (a MIME part itself with :mime).
        `:from` is used when it is the user's own address or the one the mail came to (a script
        may not answer in someone else's name); else the answer is from the user."""
        origin = user
        if vacation.sender:
            found = [a for _, a in getaddresses([_one_line(vacation.sender)]) if a]
            if found and (_same(found[0], user) or (rcpt and _same(found[0], rcpt))):
                origin = _one_line(vacation.sender)
        subject = _one_line(vacation.subject) if vacation.subject is not None else None
        if subject is None:
            original = _one_line((parsed.headers("subject") or [""])[0])
            subject = f"Auto: {original}" if original else "Automated reply"
        message_ids = [_one_line(v) for v in parsed.raw_headers("message-id")][:1]
        references = " ".join([_one_line(v) for v in parsed.raw_headers("references")][:1] + message_ids).strip()
        head = [
            ("From", origin), ("To", sender), ("Subject", subject),
            ("Date", formatdate(time.time(), localtime=False, usegmt=True)),
            ("Message-ID", make_msgid(domain=self.node_name)), ("Auto-Submitted", "auto-replied (vacation)"),
        ]
        if message_ids:
            head.append(("In-Reply-To", message_ids[0]))
        if references:
            head.append(("References", references[:900]))
        if vacation.mime:
            lines = [f"{k}: {v}" for k, v in head] + ["MIME-Version: 1.0"]
            entity = vacation.reason.replace("\r\n", "\n").replace("\n", "\r\n").lstrip("\r\n")
            return ("\r\n".join(lines) + "\r\n").encode("utf-8") + entity.encode("utf-8")
        reply = EmailMessage(policy=SMTP)
        for key, value in head:
            reply[key] = value
        reply.set_content(vacation.reason)
        return reply.as_bytes()

    async def _reject_notice(self, rcpt: str, reason: str, message: bytes, sender: str) -> None:
        """A delivery status notification (RFC 3464) to the sender of a message a script
        rejected while other recipients took it (RFC 5429 2.1); none to <>."""
        from cassmail.delivery import dsn

        if not sender:
            return
        text = f"550 5.7.1 {_one_line(reason) or 'Message rejected by the recipient'}"
        report = dsn.build(self.node_name, sender, message, [dsn.Failure(rcpt, "5.7.1", text)], delayed=False,
                           arrival=time.time())
        await self.send(report, "", sender)

    async def send(self, message: bytes, envelope_sender: str, to: str) -> None:
        """A message this step makes: into the INBOX of a local recipient (their script is not
        run on it), through the outbound queue to anyone else."""
        address = str(Address.parse(to))
        if await self.store.is_local_domain(address.rpartition("@")[2]):
            users = await local_recipients(self.store, address, self.delimiter)
            if users:
                await self.store.deliver(message, [Target(u) for u in users])
            return
        await self.store.enqueue(message, envelope_sender, [address], smtputf8=not address.isascii())
        if self.outbound is not None:
            self.outbound.notify()


def _same(a: str, b: str) -> bool:
    try:
        return Address.parse(a).key == Address.parse(b).key
    except InvalidInput:
        return a.strip().lower() == b.strip().lower()


def _one_line(text: str) -> str:
    """Text made safe for one header line or SMTP reply: printable, no line breaks, bounded."""
    return "".join(c if c.isprintable() else " " for c in text.replace("\r", " ").replace("\n", " ")).strip()[:200]


__all__ = ["Plan", "SieveFilter", "limits_of"]
