"""What happens to a message between DATA and the store on the MX: sender authentication
(`authcheck`) and the spam filter (`spam`), each a step that may refuse the message, ask for a
retry, file it into Junk or only add header lines.

The SMTP handler calls `Inbound.check` before storing and `deliver` to store: it knows nothing
of the checks, and the checks know no backend.
"""

from __future__ import annotations

import asyncio
import uuid
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import dns.resolver

from cassmail.config import InboundSettings, RelaySettings
from cassmail.inbound.authcheck import (
    RESULTS_MAX, AuthPolicy, SenderAuth, decide, header_fields, split_header, strip_forged_results,
)
from cassmail.inbound.spam import (
    SPAM_FIELDS_MAX, SPAM_HEADERS, SUBJECT_GROWTH_MAX, Rspamd, SpamFilterUnavailable, rewrite_subject,
)
from cassmail.logs import Timer, kv
from cassmail.model import DEFAULT_MAILBOXES, INBOX
from cassmail.store.base import MailboxExists, NoSuchMailbox, Store, Target

log = logging.getLogger("cassmail.inbound")

#: DNS answers kept by the MX's checks (per worker process).
DNS_CACHE_ENTRIES = 10_000

#: Most bytes the checks add to a message: the Authentication-Results field, the X-Spam-*
#: fields and a rewritten Subject, each bounded on its own (forged fields they remove only make
#: it smaller). The SMTP handler keeps this much of the store's limit out of the SIZE it
#: advertises, so a message within SIZE is stored whatever the checks add.
ADDED_MAX = RESULTS_MAX + SPAM_FIELDS_MAX + SUBJECT_GROWTH_MAX

#: How bad a verdict is: the worst of the steps wins.
_RANK = {"accept": 0, "junk": 1, "tempfail": 2, "reject": 3}


@dataclass
class Verdict:
    """What the steps decided: `action` (accept, junk, tempfail, reject), the SMTP reply of a
    refusal, the message as it is to be stored (forged headers removed) and the header lines to
    put above it."""

    message: bytes
    action: str = "accept"
    reply: str = ""
    headers: bytes = b""
    facts: dict[str, object] = field(default_factory=dict)

    def worse(self, action: str, reply: str) -> None:
        if _RANK[action] > _RANK[self.action]:
            self.action, self.reply = action, reply

    def file(self, targets: Sequence[Target], junk: str) -> list[Target]:
        """The targets, moved from INBOX to the Junk mailbox when the verdict is junk."""
        if self.action != "junk":
            return list(targets)
        return [replace(t, mailbox=junk) if t.mailbox == INBOX else t for t in targets]


class Inbound:
    """The MX's checks, from [inbound]; DNS through the [relay] resolver settings."""

    def __init__(self, settings: InboundSettings, relay: RelaySettings, node_name: str) -> None:
        from cassmail.delivery.routing import make_resolver

        self.settings = settings
        self.authserv_id = settings.authserv_id or node_name
        resolver = make_resolver(relay)
        # Mail from one sender comes in runs: its SPF, DKIM key and DMARC records are asked again
        # and again. Answers are kept for their TTL, as a local caching resolver would.
        resolver.cache = dns.resolver.LRUCache(DNS_CACHE_ENTRIES)
        self.auth = SenderAuth(resolver, relay.dns_timeout) if settings.authentication else None
        self.policy = AuthPolicy(settings.dmarc_reject, settings.dmarc_quarantine, settings.spf_reject_fail)
        self.rspamd = Rspamd(settings.rspamd_url, settings.rspamd_password, settings.rspamd_timeout) \
            if settings.rspamd_url else None

    def without_forged_results(self, message: bytes) -> bytes:
        """With the checks off the MX still removes Authentication-Results fields that claim this
        host's authserv-id (RFC 8601 5), so no forged verdict reaches a user's client in its name."""
        stripped, forged = strip_forged_results(message, self.authserv_id)
        if forged:
            log.info(kv("inbound", forged_ar=forged))
        return stripped

    @property
    def enabled(self) -> bool:
        return self.auth is not None or self.rspamd is not None

    async def check(self, message: bytes, ip: str, helo: str, sender: str, recipients: list[str],
                    queue_id: str) -> Verdict:
        """The verdict on a message as the client sent it (before this host's trace headers)."""
        verdict = Verdict(message)
        timer = Timer()
        verdict.message, forged = strip_forged_results(verdict.message, self.authserv_id)
        if forged:
            verdict.facts["forged_ar"] = forged
        if self.auth is not None:
            await self._authenticate(verdict, ip, helo, sender)
        if self.rspamd is not None and verdict.action not in ("reject", "tempfail"):
            await self._filter(verdict, ip, helo, sender, recipients, queue_id)
        log.info(kv("inbound", id=queue_id, verdict=verdict.action, ms=timer.ms, **verdict.facts))
        return verdict

    async def _authenticate(self, verdict: Verdict, ip: str, helo: str, sender: str) -> None:
        assert self.auth is not None
        try:
            outcome = await asyncio.wait_for(self.auth.check(verdict.message, ip, helo, sender), self.settings.timeout)
        except TimeoutError:
            verdict.facts["auth"] = "timeout"
            verdict.worse("tempfail", "451 4.7.0 Sender authentication timed out, try again later")
            return
        verdict.headers += outcome.header(self.authserv_id)
        action, reply = decide(outcome, self.policy)
        verdict.worse(action, reply)
        verdict.facts.update(spf=outcome.spf_mfrom, dkim=",".join(d.result for d in outcome.dkim) or "none",
                             dmarc=outcome.dmarc, arc=outcome.arc, auth=action)

    async def _filter(self, verdict: Verdict, ip: str, helo: str, sender: str, recipients: list[str],
                      queue_id: str) -> None:
        assert self.rspamd is not None
        verdict.message = _strip_fields(verdict.message, SPAM_HEADERS)
        if len(verdict.message) > self.settings.rspamd_max_size:
            verdict.facts["spam"] = "too-large"
            return
        try:
            result = await self.rspamd.check(verdict.headers + verdict.message, ip, helo, sender, recipients, queue_id)
        except SpamFilterUnavailable as exc:
            verdict.facts["spam"] = "unavailable"
            verdict.facts["spam_error"] = str(exc)
            if self.settings.rspamd_failure == "tempfail":
                verdict.worse("tempfail", "451 4.7.1 Spam filter unavailable, try again later")
            return
        verdict.headers += result.headers()
        action, reply = result.verdict()
        if result.action == "rewrite subject" and result.subject is not None:
            rewritten = rewrite_subject(verdict.message, result.subject)
            if rewritten is None:
                verdict.facts["subject"] = "kept"
            else:
                verdict.message = rewritten
        # With rspamd_file_junk off, spam is only marked (X-Spam-Flag: YES) and stays in INBOX
        # for the users' Sieve scripts or mail clients to file.
        if action != "junk" or self.settings.rspamd_file_junk:
            verdict.worse(action, reply)
        verdict.facts.update(spam=action, spam_action=result.action.replace(" ", "-"), score=round(result.score, 2))


def _strip_fields(message: bytes, names: Collection[bytes]) -> bytes:
    """The message without the header fields of those (lowercase) names."""
    block, rest = split_header(message)
    fields = header_fields(block)
    kept = [raw for raw in fields if raw.partition(b":")[0].strip().lower() not in names]
    return message if len(kept) == len(fields) else b"".join(kept) + rest


async def deliver(store: Store, message: bytes, targets: Sequence[Target], creatable: Collection[str] = ()) -> list[uuid.UUID]:
    """`store.deliver`, making a missing mailbox named in `creatable` first (a user who deleted
    their Junk folder still gets junk filed there, as IMAP servers do)."""
    try:
        return await store.deliver(message, targets)
    except NoSuchMailbox as exc:
        if exc.mailbox == INBOX or exc.mailbox not in creatable:
            raise
        try:
            await store.create_mailbox(exc.user, exc.mailbox, DEFAULT_MAILBOXES.get(exc.mailbox))
        except MailboxExists:
            pass
        return await store.deliver(message, targets)
