"""The Store contract: everything a protocol front end may ask of a mail store.

Every backend (Cassandra, mbox, WheelFS) implements this one interface and
passes one shared test suite (tests/contract). Nothing here knows a protocol;
nothing in a protocol knows a backend.

Users are named by address and stored under `model.address_key`; mailboxes
by their canonical name (`model.mailbox_name`). Methods raise the precise
exceptions below; any failure of the underlying storage (down, timeout) is a
`StoreUnavailable`, which protocols turn into a temporary error (SMTP 4xx,
POP3/IMAP -ERR/NO) so that nothing acknowledged is ever lost.
"""

from __future__ import annotations

import abc
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from cassmail.logs import kv
from cassmail.model import (
    HIERARCHY_DELIMITER,
    Address,
    INBOX,
    InvalidInput,
    MailboxInfo,
    MessageSummary,
    Page,
    address_key,
    flag_set,
    mailbox_name,
    normalize_domain,
)

log = logging.getLogger("cassmail.store")

# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Base of every error a store raises on purpose."""


class NoSuchUser(StoreError):
    def __init__(self, user: str) -> None:
        super().__init__(f"no such user: {user}")
        self.user = user


class UserExists(StoreError):
    """The address is taken by a user: creating a user there, or an alias at a user's address
    (`reason` then says so)."""

    def __init__(self, user: str, reason: str = "") -> None:
        super().__init__(f"user already exists: {user}" + (f"; {reason}" if reason else ""))
        self.user = user


class NoSuchAlias(StoreError):
    def __init__(self, alias: str) -> None:
        super().__init__(f"no such alias: {alias}")
        self.alias = alias


class AliasExists(StoreError):
    """A user cannot be created at an alias's address: mail to it would have two meanings."""

    def __init__(self, alias: str) -> None:
        super().__init__(f"{alias} is an alias; delete the alias before creating a user at its address")
        self.alias = alias


class NoSuchDomain(StoreError):
    def __init__(self, domain: str) -> None:
        super().__init__(f"not a local domain: {domain}")
        self.domain = domain


class DomainInUse(StoreError):
    """A domain still has users or aliases: removing it would leave them unreachable."""

    def __init__(self, domain: str, users: int, aliases: int = 0) -> None:
        held = [f"{users} user(s)"] if users else []
        held += [f"{aliases} alias(es)"] if aliases else []
        super().__init__(f"domain {domain} still has {' and '.join(held) or 'users'}; delete them first")
        self.domain, self.users, self.aliases = domain, users, aliases


class NoSuchMailbox(StoreError):
    def __init__(self, user: str, mailbox: str) -> None:
        super().__init__(f"no such mailbox: {mailbox!r} of {user}")
        self.user, self.mailbox = user, mailbox


class MailboxExists(StoreError):
    def __init__(self, user: str, mailbox: str) -> None:
        super().__init__(f"mailbox already exists: {mailbox!r} of {user}")
        self.user, self.mailbox = user, mailbox


class MailboxNotAllowed(StoreError):
    """An operation the mailbox's role forbids, e.g. deleting or renaming away INBOX's identity."""


class NoSuchMessage(StoreError):
    def __init__(self, mailbox: str, message_id: uuid.UUID) -> None:
        super().__init__(f"no such message {message_id} in {mailbox!r}")
        self.mailbox, self.message_id = mailbox, message_id


class MessageTooLarge(StoreError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the limit of {limit} bytes")
        self.size, self.limit = size, limit


class QuotaExceeded(StoreError):
    """Storing would take users past their storage limit (Store.set_quota): nothing was written.
    `users` names every user of the call that is over (sorted), so a caller delivering to several
    can leave them out and deliver to the others."""

    def __init__(self, users: Iterable[str]) -> None:
        self.users = tuple(sorted(set(users)))
        super().__init__(f"over quota: {', '.join(self.users)}")


class NoSuchQueueEntry(StoreError):
    def __init__(self, entry_id: uuid.UUID) -> None:
        super().__init__(f"no such queue entry: {entry_id}")
        self.entry_id = entry_id


class NoSuchSieveScript(StoreError):
    def __init__(self, user: str, name: str) -> None:
        super().__init__(f"no such Sieve script: {name!r} of {user}")
        self.user, self.name = user, name


class SieveScriptExists(StoreError):
    def __init__(self, user: str, name: str) -> None:
        super().__init__(f"Sieve script already exists: {name!r} of {user}")
        self.user, self.name = user, name


class SieveScriptActive(StoreError):
    """The active script cannot be deleted (RFC 5804 2.10): deactivate it first."""

    def __init__(self, user: str, name: str) -> None:
        super().__init__(f"Sieve script {name!r} of {user} is active; deactivate it first")
        self.user, self.name = user, name


class StoreUnavailable(StoreError):
    """The storage could not do it now (down, timed out, too few replicas); retrying later may work.

    When raised by `deliver`, no listing will ever show a partly written message.
    """


# --------------------------------------------------------------------------- contract types

#: Seconds between reports of a watched mailbox whose store gives no changes token (see
#: Store.changed_mailboxes): such a mailbox is refreshed this often.
UNTOKENED_REPORT = 2.0

#: Summaries per request when mailbox_status reads a listing.
STATUS_PAGE = 1000

FlagMode = Literal["set", "add", "remove"]
Body = bytes | bytearray | memoryview

#: Store.read_heads: a message's head is read this much at a time, and at most HEAD_LIMIT of it.
HEAD_WINDOW = 16 * 1024
HEAD_LIMIT = 1024 * 1024


def head_end(data: bytes | bytearray) -> int | None:
    """Where the blank line that ends the header of a message starting with `data` ends (the
    message may start with it: no header fields); None when `data` does not hold it."""
    for blank in (b"\r\n", b"\n"):
        if data.startswith(blank):
            return len(blank)
    ends = [at + len(blank) for blank in (b"\n\r\n", b"\n\n") if (at := data.find(blank)) >= 0]
    return min(ends) if ends else None


@dataclass(frozen=True, slots=True)
class Target:
    """Where one copy of a delivered message goes, with the flags it starts with."""

    user: str
    mailbox: str = "INBOX"
    flags: frozenset[str] = frozenset()


@dataclass(slots=True)
class RecentClaim:
    """IMAP \\Recent for a message an APPEND numbers (Store.append): `known` is the recent mark
    the appending session knows (Store.claim_recent's). A store that can claim the new UID in
    the numbering's own write, when the mark is just below it, sets `won`: the message is then
    \\Recent to that session, and the mark is the UID + 1."""

    known: int
    won: bool = False


@dataclass(frozen=True, slots=True)
class MailboxStatus:
    """What IMAP STATUS tells of a mailbox (Store.mailbox_status): its messages, those without
    \\Seen, their sizes in bytes, those with \\Deleted and their bytes, UIDNEXT (counting the
    messages that have no UID yet: each will get one) and, when asked, \\Recent's count (None
    when not asked)."""

    messages: int
    unseen: int
    size: int
    deleted: int
    deleted_size: int
    uid_next: int
    recent: int | None = None


@dataclass(frozen=True, slots=True)
class Quota:
    """A user's storage limit and usage: `limit` in bytes (None: no limit), `used` the bytes and
    `messages` the number of messages over all their mailboxes, each copy counted at its size
    (IMAP's RFC822.SIZE; a delivery to two of one user's mailboxes counts twice)."""

    limit: int | None
    used: int
    messages: int

    def allows(self, more: int) -> bool:
        """Whether `more` bytes still fit: used + more at most the limit."""
        return self.limit is None or self.used + more <= self.limit


@dataclass(frozen=True, slots=True)
class Alias:
    """An address of a local domain that delivers to local users: `address` and every user are
    user keys (model.address_key); `users` is sorted, without repeats, never empty."""

    address: str
    users: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DkimKey:
    """A domain's DKIM signing key: the selector (the DNS name `<selector>._domainkey.<domain>`)
    and the private key in PEM."""

    domain: str
    selector: str
    private_key_pem: str


@dataclass(frozen=True, slots=True)
class SieveScriptInfo:
    """A user's Sieve script as ManageSieve's LISTSCRIPTS shows it."""

    name: str
    active: bool


@dataclass(frozen=True, slots=True)
class MessageRef:
    """A message as a protocol names it: user, mailbox and id."""

    user: str
    mailbox: str
    id: uuid.UUID


#: A queued recipient's state: still to be delivered, accepted by the remote (250), or given up
#: (a 5xx, the lifetime passed) with its DSN already sent.
RecipientState = Literal["pending", "sent", "failed"]
RECIPIENT_STATES: tuple[str, ...] = ("pending", "sent", "failed")


@dataclass(frozen=True, slots=True)
class QueuedRecipient:
    """One recipient of a queued message and what became of it so far: the last reply (code and
    text, as the remote or cassmail said it) and the host that gave it."""

    address: str
    state: RecipientState = "pending"
    reply: str = ""
    remote: str = ""


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A message waiting for delivery to other domains: the envelope, each recipient's state and
    the schedule. Times are seconds since 1970 (UTC). `sender` is "" for the null sender `<>`
    (bounces), whose failures make no DSN. `lease_owner`/`lease_until` say which worker holds
    the entry and until when; a lease that ran out is free for any worker to take."""

    id: uuid.UUID
    sender: str
    recipients: tuple[QueuedRecipient, ...]
    size: int
    created: float
    due: float
    attempts: int = 0
    held: bool = False
    warned: bool = False
    last_error: str = ""
    lease_owner: str = ""
    lease_until: float = 0.0
    #: The message needs SMTPUTF8 (its envelope or header has UTF-8 beyond ASCII).
    smtputf8: bool = False

    @property
    def pending(self) -> tuple[QueuedRecipient, ...]:
        return tuple(r for r in self.recipients if r.state == "pending")


class Store(abc.ABC):
    """The one interface all backends implement. All I/O methods are coroutines.

    A store object is opened once per process and shared by every session;
    implementations must be safe for concurrent use on one event loop.
    """

    #: Largest message a store accepts (bytes); 0 means no limit. Set from settings.
    max_message_size: int = 0
    #: Seconds an expunge is remembered at least, for `vanished_since`. Set from settings.
    vanished_keep: float = 30 * 86400.0
    #: True when concurrent deliveries and copies never take a user past their limit (the check
    #: and the write are under one lock); False when those in flight at once may each pass the
    #: check and overshoot the limit by at most their sizes together (see `set_quota`).
    quota_exact: bool = False
    #: Whether the store keeps IMAP view snapshots (`keep_view_snapshot`).
    keeps_view_snapshots: bool = False

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect and prepare; called once before any other method."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the object is unusable afterwards."""

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- domains
    @abc.abstractmethod
    async def add_domain(self, domain: str) -> None:
        """Make a domain local (idempotent)."""

    @abc.abstractmethod
    async def remove_domain(self, domain: str) -> None:
        """Stop accepting mail for a domain. Raises NoSuchDomain, DomainInUse while it has users
        or aliases."""

    @abc.abstractmethod
    async def list_domains(self) -> list[str]:
        """Local domains, sorted."""

    async def is_local_domain(self, domain: str) -> bool:
        return normalize_domain(domain) in await self.list_domains()

    # ----------------------------------------------------------------- users
    @abc.abstractmethod
    async def create_user(self, user: str, password_hash: str) -> None:
        """Create a user with the default mailboxes (model.DEFAULT_MAILBOXES).

        Raises UserExists, AliasExists when an alias has the address, NoSuchDomain when the
        domain is not local, InvalidAddress.
        """

    @abc.abstractmethod
    async def delete_user(self, user: str) -> None:
        """Remove a user, their mailboxes and their mail, and take them out of every alias (an
        alias left without users goes too). Raises NoSuchUser."""

    @abc.abstractmethod
    async def get_password_hash(self, user: str) -> str:
        """The stored hash (see cassmail.auth). Raises NoSuchUser."""

    @abc.abstractmethod
    async def set_password_hash(self, user: str, password_hash: str) -> None:
        """Replace a user's password hash. Raises NoSuchUser."""

    @abc.abstractmethod
    async def list_users(self, domain: str | None = None) -> list[str]:
        """User keys, sorted, optionally of one domain."""

    async def user_exists(self, user: str) -> bool:
        try:
            await self.get_password_hash(user)
        except NoSuchUser:
            return False
        return True

    # ----------------------------------------------------------------- aliases
    # An alias is an address of a local domain that delivers to one or more local users: SMTP
    # accepts it as a recipient (the user lookup missed, then one read of the alias) and a user
    # it lists may send as it. Addresses are user keys (model.address_key), like users'.

    @abc.abstractmethod
    async def set_alias(self, alias: str, users: Iterable[str]) -> None:
        """Create an alias or replace its users.

        Raises NoSuchDomain when the alias's domain is not local, UserExists when a user has
        the address, NoSuchUser naming the first target that is not a user (an alias is not a
        user: aliases do not nest), InvalidInput for no users or a bad address. Nothing is
        written unless every check passed."""

    @abc.abstractmethod
    async def delete_alias(self, alias: str) -> None:
        """Remove an alias (its users stay). Raises NoSuchAlias."""

    @abc.abstractmethod
    async def get_alias(self, alias: str) -> list[str] | None:
        """The users an alias delivers to, sorted; None when the address is no alias. One
        small read: it is on the path of every RCPT TO that is not a user."""

    @abc.abstractmethod
    async def list_aliases(self, domain: str | None = None) -> list[Alias]:
        """Aliases sorted by address, optionally of one domain."""

    # ----------------------------------------------------------------- mailboxes
    @abc.abstractmethod
    async def list_mailboxes(self, user: str) -> list[MailboxInfo]:
        """The user's mailboxes sorted by name. Raises NoSuchUser."""

    @abc.abstractmethod
    async def create_mailbox(self, user: str, name: str, special_use: str | None = None) -> MailboxInfo:
        """Create an empty mailbox with a fresh UIDVALIDITY. Raises MailboxExists, NoSuchUser."""

    @abc.abstractmethod
    async def rename_mailbox(self, user: str, old: str, new: str) -> None:
        """Rename keeping the messages and their UIDs (RFC 3501: renaming INBOX moves its mail
        to the new name and leaves INBOX empty). Raises NoSuchMailbox, MailboxExists."""

    @abc.abstractmethod
    async def delete_mailbox(self, user: str, name: str) -> None:
        """Delete a mailbox and its messages. INBOX cannot be deleted (MailboxNotAllowed)."""

    @abc.abstractmethod
    async def mailbox_info(self, user: str, name: str) -> MailboxInfo:
        """Raises NoSuchMailbox."""

    @abc.abstractmethod
    async def set_subscribed(self, user: str, name: str, subscribed: bool) -> None:
        """IMAP SUBSCRIBE / UNSUBSCRIBE of an existing mailbox (MailboxInfo.subscribed).
        Raises NoSuchMailbox."""

    # ----------------------------------------------------------------- messages
    @abc.abstractmethod
    async def deliver(
        self,
        body: Body,
        targets: Sequence[Target],
        internal_date: datetime | None = None,
    ) -> list[uuid.UUID]:
        """Store one message in every target mailbox in one call; return each copy's id.

        Returns only when every copy is stored at the configured durability
        (for Cassandra: the write consistency level). Raises MessageTooLarge,
        NoSuchUser / NoSuchMailbox (before anything is written), QuotaExceeded naming
        every target user with a limit that the copies they get (the size once per distinct
        mailbox of theirs) would pass (before anything is written, for any target: the
        caller delivers again without them), StoreUnavailable (nothing is visible to a
        listing).
        """

    async def append(
        self, body: Body, target: Target, internal_date: datetime | None = None,
        modseqs: dict[uuid.UUID, int] | None = None, recent: RecentClaim | None = None,
    ) -> MessageSummary:
        """IMAP APPEND: `deliver` to one mailbox (raising what it raises); the message as a
        listing gives it (`appended_date`), with its UID, None when it cannot be had now
        (StoreUnavailable while numbering, logged: the message is stored either way, and the
        next listing numbers it), and the MODSEQ the numbering took when `modseqs` tells it. A
        store that can give the UID in the delivery's own write does (mbox: one index append
        and one sync fewer). `modseqs` as in `assign_uids`; `recent`, see RecentClaim (a store
        may leave it unclaimed)."""
        when = appended_date(internal_date)
        [message_id] = await self.deliver(body, [target], when)
        delivered = MessageSummary(message_id, body_view(body).nbytes, flag_set(target.flags), when)
        try:
            uids = await self._number_appended(target, delivered, modseqs, recent)
        except StoreUnavailable as exc:
            log.warning(kv("imap-uids", user=target.user, mailbox=target.mailbox, waiting=1, error=exc))
            return delivered
        return numbered_summary(delivered, uids.get(message_id), modseqs)

    async def _number_appended(self, target: Target, message: MessageSummary, modseqs: dict[uuid.UUID, int] | None,
                               recent: RecentClaim | None) -> dict[uuid.UUID, int]:
        """`append`'s numbering of the message it delivered (`message`: as delivered, without a
        UID): `assign_uids`, claiming nothing."""
        return await self.assign_uids(target.user, target.mailbox, [message.id], modseqs=modseqs)

    @abc.abstractmethod
    async def list_page(
        self, user: str, mailbox: str, after: uuid.UUID | None = None, limit: int = 500
    ) -> Page:
        """Summaries in arrival order, starting after the cursor; never reads bodies."""

    async def list_messages(self, user: str, mailbox: str, page_size: int = 500) -> AsyncIterator[MessageSummary]:
        """Every summary of a mailbox, fetched `page_size` at a time."""
        cursor: uuid.UUID | None = None
        while True:
            page = await self.list_page(user, mailbox, after=cursor, limit=page_size)
            for item in page.items:
                yield item
            if page.cursor is None:
                return
            cursor = page.cursor

    async def get_summaries(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, MessageSummary]:
        """Summaries of the given ids that exist (others are left out)."""
        wanted = set(ids)
        return {s.id: s async for s in self.list_messages(user, mailbox) if s.id in wanted}

    @abc.abstractmethod
    def read_chunks(
        self, user: str, mailbox: str, message_id: uuid.UUID, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """Stream bytes [start, end) of a body in the backend's chunk size. Raises NoSuchMessage.

        A message deleted by another session while it is streamed (RFC 2180: a FETCH racing an
        EXPUNGE) either streams to its end from what the store still holds or stops with
        NoSuchMessage after the chunks already given, never with StoreUnavailable: the message is
        gone, not the store. StoreUnavailable mid-stream means a live message could not be read."""

    async def read_message(self, user: str, mailbox: str, message_id: uuid.UUID) -> bytes:
        """The whole body; prefer read_chunks for anything that may be large."""
        return b"".join([chunk async for chunk in self.read_chunks(user, mailbox, message_id)])

    async def read_heads(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, bytes]:
        """The first bytes of each message still there, by id (those gone are left out): through
        the blank line that ends its header, or all of the message when it has none, at most
        HEAD_LIMIT bytes. What IMAP reads for ENVELOPE, header fields and SEARCH on them. A store
        that can read the heads of many messages at once does (Cassandra: the first chunks of
        many bodies in one request); this one reads them one by one."""
        out: dict[uuid.UUID, bytes] = {}
        for message_id in dict.fromkeys(ids):
            try:
                out[message_id] = await self._read_head(user, mailbox, message_id)
            except NoSuchMessage:
                pass
        return out

    async def _read_head(self, user: str, mailbox: str, message_id: uuid.UUID) -> bytes:
        """One message's head (see read_heads), HEAD_WINDOW bytes at a time, so a store that reads
        ahead does not fetch the whole body. Raises NoSuchMessage."""
        data = bytearray()
        while len(data) < HEAD_LIMIT:
            asked = min(HEAD_WINDOW, HEAD_LIMIT - len(data))
            before = len(data)
            async for chunk in self.read_chunks(user, mailbox, message_id, before, before + asked):
                data += chunk
            end = head_end(data)
            if end is not None:
                return bytes(data[:end])
            if len(data) - before < asked:
                break
        return bytes(data)

    @abc.abstractmethod
    async def store_flags(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], flags: Iterable[str], mode: FlagMode = "set",
        unchanged_since: int | None = None, modseqs: dict[uuid.UUID, int] | None = None,
        known: tuple[Mapping[uuid.UUID, MessageSummary], int] | None = None,
    ) -> set[uuid.UUID]:
        """Set, add or remove flags on messages; concurrent adds/removes of different flags both hold.

        Each numbered message whose flags this changes gets a new MODSEQ (one for the whole call);
        one whose flags stay as they were keeps its MODSEQ. With `unchanged_since` (RFC 7162
        UNCHANGEDSINCE) a message whose MODSEQ is above it is left alone, decided atomically with
        the change against concurrent callers on any node; the ids left alone are returned (the
        MODIFIED set; always empty without `unchanged_since`). Ids that do not exist are ignored.
        `modseqs`, when given, gets the MODSEQ of each message this call changed, as in
        `assign_uids`. `known`: the caller's summaries of (some of) these messages by id, and the
        HIGHESTMODSEQ at which they are the store's (an IMAP view's, with its session's own
        changes), which a store may decide the change on instead of reading them, if it can
        make the change conditional on its HIGHESTMODSEQ being still that one (Cassandra)."""

    @abc.abstractmethod
    async def delete_messages(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], modseqs: dict[uuid.UUID, int] | None = None,
        *, only_deleted: bool = False,
    ) -> set[uuid.UUID]:
        """Delete messages in one call and return the ids deleted; ids already gone are ignored.
        The UID of each numbered message deleted is remembered with a new MODSEQ (see
        `vanished_since`); `modseqs`, when given, gets it, as in `assign_uids`. With
        `only_deleted` (IMAP's EXPUNGE), only the messages whose flags hold \\Deleted as the
        deletion finds them: one whose \\Deleted another session took away a moment before stays
        (decided on the same state the deletion applies to, where the store can: Cassandra's
        conditional batch, the mbox index under its lock)."""

    async def copy_messages(self, user: str, source: str, ids: Sequence[uuid.UUID], dest: str) -> list[uuid.UUID]:
        """Copy messages to another mailbox of the same user keeping flags and internal date;
        returns the new ids in the order of `ids`. All or nothing for the quota: QuotaExceeded
        when the copies together would pass the user's limit, with no copy left behind; and
        NoSuchMessage, with none left behind either, when a message is gone (also one deleted
        while the copies are made). Backends may do better than read+deliver (`_copy_one`)."""
        summaries = await self.get_summaries(user, source, ids)
        for message_id in ids:
            if message_id not in summaries:
                raise NoSuchMessage(source, message_id)
        if await self._copies_allowed(user, dest, sum(summaries[i].size for i in ids)) is False:
            raise QuotaExceeded([user])
        new_ids: list[uuid.UUID] = []
        try:
            for message_id in ids:
                new_ids.append(await self._copy_one(user, source, summaries[message_id], dest))
        except (QuotaExceeded, NoSuchMessage):
            # Another delivery took the room meanwhile, or a message went: the copies made so far
            # go again, so the call changes nothing (IMAP's NO [OVERQUOTA] and [EXPUNGEISSUED]).
            if new_ids:
                await self.delete_messages(user, dest, new_ids)
            raise
        return new_ids

    async def _copies_allowed(self, user: str, dest: str, size: int) -> bool | None:
        """`copy_messages`'s check of the quota before it copies `size` bytes into `dest`:
        `quota_allows` (a backend may answer from what it knows of `dest`)."""
        return await self.quota_allows(user, size)

    async def _copy_one(self, user: str, source: str, summary: MessageSummary, dest: str) -> uuid.UUID:
        """One copy for `copy_messages`: the body read and delivered again (raising what they raise)."""
        body = await self.read_message(user, source, summary.id)
        [new_id] = await self.deliver(body, [Target(user, dest, summary.flags)], summary.internal_date)
        return new_id

    # ----------------------------------------------------------------- storage quotas
    # A user may have a storage limit in bytes (None, the default: no limit), set by the
    # administrator (`cassmail user quota`). Usage is the size of every message in every mailbox
    # of the user. `deliver` and `copy_messages` refuse what would pass the limit with
    # QuotaExceeded before writing; deletions free room at once. How exact the usage is, and how
    # far concurrent deliveries may overshoot, is each backend's (`quota_exact`; docs/data-model.md).

    @abc.abstractmethod
    async def set_quota(self, user: str, limit: int | None) -> None:
        """Set (bytes, 0 or more) or clear (None) a user's storage limit. Mail already stored
        stays, also above a lowered limit; only new deliveries and copies are refused. Raises
        NoSuchUser, InvalidInput (a limit that is not a whole number of bytes >= 0)."""

    @abc.abstractmethod
    async def get_quota(self, user: str) -> Quota:
        """The user's limit and usage. Raises NoSuchUser."""

    async def quota_limit(self, user: str) -> int | None:
        """The user's limit alone (None: no limit), without counting the usage: what IMAP's
        GETQUOTAROOT asks first, on every login of some clients. Raises NoSuchUser."""
        return (await self.get_quota(user)).limit

    async def quota_allows(self, user: str, size: int) -> bool | None:
        """Whether `size` more bytes fit under the user's limit, as far as the store can tell
        cheaply (an SMTP RCPT asks it): True or False, or None when telling would cost a walk of
        the user's mail (the delivery itself then decides). Raises NoSuchUser."""
        return (await self.get_quota(user)).allows(size)

    async def recount_quota(self, user: str) -> Quota:
        """Count the user's usage again from their mailboxes and repair what the store keeps of
        it (a counter that drifted); returns the limit and the usage as counted. Raises
        NoSuchUser."""
        return await self.get_quota(user)

    async def count_usage(self, user: str) -> tuple[int, int]:
        """(bytes, messages) of the user's mailboxes as their listings show them now: a walk of
        every listing, for backends that keep no counter and for recounts. Raises NoSuchUser."""
        used = messages = 0
        for info in await self.list_mailboxes(user):
            try:
                async for summary in self.list_messages(user, info.name, 1000):
                    used += summary.size
                    messages += 1
            except NoSuchMailbox:
                continue  # deleted meanwhile: its mail is gone with it
        return used, messages

    # ----------------------------------------------------------------- IMAP UIDs
    @abc.abstractmethod
    async def assign_uids(
        self,
        user: str,
        mailbox: str,
        ids: Sequence[uuid.UUID],
        renumber: Mapping[uuid.UUID, int] | None = None,
        modseqs: dict[uuid.UUID, int] | None = None,
        listed_at: int | None = None,
    ) -> dict[uuid.UUID, int]:
        """Give a new UID, one above every UID ever handed out in this mailbox and in the order
        of `ids`, to every id that has none yet and to every id of `renumber` whose UID is still
        the value given there; return the UID of every id (old or new) that still exists. Each
        message given a UID here gets a new MODSEQ with it, and the UID a renumbered message
        gives up is remembered as expunged (see `vanished_since`). `modseqs`, when given, gets
        the MODSEQ of each message this call numbered, where the store can tell (Cassandra; the
        mbox and WheelFS stores leave it as it is). Each MODSEQ a store puts there was taken by
        this call's change alone, decided on the mailbox as it stood at the MODSEQ below: a
        caller that had taken in every change up to that one, and takes in this change, is up to
        date to it without reading the change back (`imap.view.MailboxView.took`).

        `listed_at`: the HIGHESTMODSEQ read before the listing in which `ids` had no UID, with
        `modseqs` holding the MODSEQs that earlier calls for that listing took. A store may then
        skip reading again what the listing told, when it finds that nothing else changed the
        mailbox since (Cassandra: `CassandraStore._assign`).

        Renumbering exists for IMAP: a session that has shown UID 6 must never show UID 5
        afterwards, yet a read at a weak consistency level may have hidden an older message
        that already had UID 5. The session renumbers it, so it joins at the end of the view
        with a UID no client has seen. A renumber whose value is no longer the message's UID
        (someone renumbered it already) changes nothing, so two sessions renumbering the same
        message at once give it exactly one new UID. Keys of `renumber` missing from `ids` are
        treated as if appended to it.

        Safe against concurrent callers on any node: no UID is given twice, the counter only
        grows, and a UID a message gave up is never handed out again."""

    @abc.abstractmethod
    async def uid_next(self, user: str, mailbox: str) -> int:
        """The UID the next assignment would hand out (IMAP UIDNEXT)."""

    async def mailbox_status(self, user: str, mailbox: str, recent: bool = False) -> MailboxStatus:
        """The counts of IMAP STATUS, with `recent` \\Recent's too (messages no session has
        claimed: see `claim_recent`). This default reads the whole listing; a store that keeps
        counts overrides it. Raises NoSuchMailbox."""
        mark = await self.recent_mark(user, mailbox) if recent else None
        listed = [(s.flags, s.size, s.uid) async for s in self.list_messages(user, mailbox, STATUS_PAGE)]
        return count_status(listed, await self.uid_next(user, mailbox), mark)

    async def status_state(
        self, user: str, mailbox: str, recent: bool, modseq: bool, known: Hashable | None
    ) -> tuple[Hashable | None, int | None, MailboxStatus | None]:
        """What IMAP STATUS reads: `changes_state` (with `modseq`, HIGHESTMODSEQ even where that
        read does not give it), then `mailbox_status` unless the token is `known` (not None), in
        which case nothing changed since the counts that went with it: (token, HIGHESTMODSEQ or
        None, the counts or None). The token and HIGHESTMODSEQ are read before the counts or with
        them, never after. One request where the store keeps the token with the counts. Raises
        NoSuchMailbox."""
        token, highest = await self.changes_state(user, mailbox)
        if highest is None and modseq:
            highest = await self.highest_modseq(user, mailbox)
        if token is not None and token == known:
            return token, highest, None
        return token, highest, await self.mailbox_status(user, mailbox, recent)

    async def changes_token(self, user: str, mailbox: str) -> Hashable | None:
        """A value that is different after any change to the mailbox's messages (a delivery, a
        flag change, a deletion, a UID or \\Recent assignment), or None when the store cannot
        tell that cheaply. Equal tokens mean nothing changed, so a session may skip reading the
        listing; read it before the listing it goes with. Raises NoSuchMailbox."""
        return None

    async def changes_state(self, user: str, mailbox: str) -> tuple[Hashable | None, int | None]:
        """`changes_token` and, where the same read gives it, `highest_modseq` (else None): what
        an IMAP refresh reads first, and from one request where the store keeps both together.
        Raises NoSuchMailbox."""
        return await self.changes_token(user, mailbox), None

    # ----------------------------------------------------------------- MODSEQs (RFC 7162)
    # Every change an IMAP client can see gets a MODSEQ from a per-mailbox counter that only
    # grows: a message's numbering (its first MODSEQ comes with its UID, also when renumbered),
    # a flag change, an expunge. All changes made by one call may share one MODSEQ; two calls
    # never share one, on any number of nodes. A message's `MessageSummary.modseq` is that of
    # its last change. Messages numbered before the store kept MODSEQs have MODSEQ 1, and a
    # mailbox where nothing was numbered yet has HIGHESTMODSEQ 1, so no change is ever given 1.
    # Deliveries are not changes yet: a delivered message is unnumbered (uid and modseq None)
    # until `assign_uids` numbers it, so delivery needs nothing but its own writes.

    @abc.abstractmethod
    async def highest_modseq(self, user: str, mailbox: str) -> int:
        """HIGHESTMODSEQ: the largest MODSEQ handed out in the mailbox (1 if none), at or above
        every message's and every remembered expunge's. Raises NoSuchMailbox."""

    async def changed_since(self, user: str, mailbox: str, modseq: int) -> list[MessageSummary]:
        """Numbered messages whose MODSEQ is above `modseq`, in arrival order. Backends that keep
        an index by MODSEQ answer without reading the whole listing. Raises NoSuchMailbox."""
        return [s async for s in self.list_messages(user, mailbox) if s.modseq is not None and s.modseq > modseq]

    @abc.abstractmethod
    async def vanished_since(self, user: str, mailbox: str, modseq: int) -> list[int] | None:
        """UIDs expunged (or given up by renumbering) with a MODSEQ above `modseq`, ascending
        (RFC 7162 VANISHED); None when the store may have forgotten some of them: expunges are
        remembered for at least `vanished_keep` seconds (a store setting), and a client that
        last synchronised before that has to resynchronise in full. Raises NoSuchMailbox."""

    async def changes_since(self, user: str, mailbox: str, modseq: int) -> tuple[list[MessageSummary], list[int] | None]:
        """`changed_since` and `vanished_since` together, as a refresh wants them: (changed,
        vanished), with ([], None) when the expunges since `modseq` may have been forgotten. A
        store may answer both from one read. Raises NoSuchMailbox."""
        vanished = await self.vanished_since(user, mailbox, modseq)
        if vanished is None:
            return [], None
        return await self.changed_since(user, mailbox, modseq), vanished

    # ----------------------------------------------------------------- new arrivals (IMAP refresh)
    # With MODSEQs a session learns flag changes, numberings and expunges from changed_since and
    # vanished_since; what these cannot tell is mail delivered since (unnumbered, no MODSEQ).
    # A store that can list recent deliveries without the whole mailbox says so with a mark.

    def arrivals_mark(self, summaries: Iterable[MessageSummary], started: float | None = None) -> Hashable | None:
        """A mark for `arrivals`, from every summary of a mailbox as a listing just gave them,
        and when (`time.time()`) that listing began, if known; None (this default) when the
        store has no cheaper way to find new mail than listing."""
        return None

    async def arrivals(self, user: str, mailbox: str, mark: Hashable) -> tuple[list[MessageSummary], Hashable]:
        """At least every message delivered since the listing or call that gave `mark` (more is
        allowed), and the mark for the next call. This default lists the whole mailbox.
        Raises NoSuchMailbox."""
        return [s async for s in self.list_messages(user, mailbox)], mark

    async def arrivals_state(
        self, user: str, mailbox: str, mark: Hashable
    ) -> tuple[list[MessageSummary], Hashable, Hashable | None, int | None]:
        """`arrivals` with `changes_state` as read with them or before them: (arrived, the next
        mark, token, HIGHESTMODSEQ or None). What an IMAP refresh reads when the token it last
        saw could not be trusted yet, so that it will most likely read the arrivals anyway: one
        request where the store keeps both in one place. Raises NoSuchMailbox."""
        token, highest = await self.changes_state(user, mailbox)
        arrived, mark = await self.arrivals(user, mailbox, mark)
        return arrived, mark, token, highest

    # ----------------------------------------------------------------- view snapshots (IMAP SELECT)
    # A session that closes its view of a large mailbox may leave the view's state here (bytes
    # only the IMAP server reads: cassmail.imap.snapshots), so that a SELECT of the mailbox on
    # any worker or node starts from it and reads only what changed since, instead of listing
    # every message. What is kept is a cache: it may be lost, and an old one only makes the next
    # SELECT read more changes. A store whose listing is cheap keeps none (these defaults).

    async def view_snapshot(self, user: str, mailbox: str) -> bytes | None:
        """The newest snapshot kept of the mailbox (this incarnation of it: one deleted and made
        again has none), or None. Raises NoSuchMailbox."""
        return None

    async def keep_view_snapshot(self, user: str, mailbox: str, data: bytes) -> None:  # noqa: B027 - optional
        """Keep `data` as the mailbox's newest snapshot, in place of the one before. Raises
        NoSuchMailbox."""

    # ----------------------------------------------------------------- change notification (IMAP IDLE)

    async def changed_mailboxes(
        self, watched: Collection[tuple[str, str]], since: Any
    ) -> tuple[set[tuple[str, str]], Any]:
        """Which of the `watched` (user, mailbox) pairs changed since `since` (a value this method
        returned before; None: from now, nothing to report yet), and the value to pass next time.

        One poller per process calls it a few times a second for every mailbox its IDLE sessions
        watch, so that a change made by any process on any node reaches them within about a
        second. A pair may be reported when nothing changed (it costs the caller a refresh); a
        change is never missed. This default asks `changes_token` of each watched mailbox, so
        its cost grows with their number, and reports a mailbox whose store gives no token every
        UNTOKENED_REPORT seconds; backends with a cheaper way (a feed of change events,
        file-system notifications) override it. A mailbox that is gone is reported as changed."""
        now = time.monotonic()
        previous: dict[tuple[str, str], tuple[Hashable | None, float]] = since or {}
        state: dict[tuple[str, str], tuple[Hashable | None, float]] = {}
        changed: set[tuple[str, str]] = set()
        for pair in watched:
            try:
                token = await self.changes_token(*pair)
            except NoSuchMailbox:
                token = None
            old_token, reported = previous.get(pair, (token, now))
            if since is not None and (token != old_token or (token is None and now - reported >= UNTOKENED_REPORT)):
                changed.add(pair)
                reported = now
            state[pair] = (token, reported)
        return changed, state

    # ----------------------------------------------------------------- IMAP \Recent
    # RFC 3501 gives \Recent to exactly one session: the first read-write session told of the
    # message. Front ends keep no state, so the store arbitrates with a per-mailbox mark that
    # only grows: a session claims [mark, below) and owns \Recent for those UIDs alone. The
    # mark is independent of the UID counter (COPY numbers messages that a SELECT claims later);
    # a mailbox never claimed, including one kept from before the mark existed, has mark 1.

    @abc.abstractmethod
    async def recent_mark(self, user: str, mailbox: str) -> int:
        """The lowest UID no session has claimed as \\Recent yet (1 for a mailbox never claimed).
        Every message with a UID at or above it, or with no UID yet, is still recent for the next
        claimer. Raises NoSuchMailbox."""

    @abc.abstractmethod
    async def claim_recent(self, user: str, mailbox: str, below: int, known: int | None = None) -> int:
        """Raise the mark to `below` (if it is lower) and return the mark as it was just before
        this call raised it. The caller's session owns \\Recent for the UIDs in [returned, below);
        when the returned value is >= below, other sessions claimed them first, the caller owns
        none, and nothing was written. Safe against concurrent callers on any node: of several
        claims over the same UIDs, exactly one gets each UID. Raises NoSuchMailbox, InvalidInput
        unless 1 <= below <= 2**32 (one above the largest UID). `known`: the mark as the caller
        last learnt it, a hint a store may start from instead of reading it (Cassandra)."""

    # ----------------------------------------------------------------- the outbound queue
    # Mail for other domains waits here, in the store, never only on a node's disk: any worker
    # of any node takes due entries under a lease, and a worker that dies loses nothing (its
    # lease runs out and another takes the entry). Delivery is at least once: a duplicate needs
    # a worker to die between the remote's 250 and `record_results`.

    @abc.abstractmethod
    async def enqueue(
        self, body: Body, sender: str, recipients: Sequence[str], *, smtputf8: bool = False, due: float | None = None,
        lease: tuple[str, float] | None = None,
    ) -> uuid.UUID:
        """Queue one message for `recipients` (each pending), due at `due` (now when None).

        With `lease` (owner, seconds) the new entry starts leased to that owner: the worker of
        the process that accepted it delivers it at once, with no look at the queue and no
        lightweight transaction (nobody else can hold a new entry); if it does not finish, the
        lease runs out and any worker takes the entry.

        Returns only once the entry is stored at the configured durability, so SMTP may then
        say 250; the accept path takes no lock and no lightweight transaction. Raises
        MessageTooLarge, InvalidInput (no recipients, a bad address), StoreUnavailable (the
        sender must retry; a write that failed half way may still be delivered, so the retry
        can duplicate it, never lose it)."""

    @abc.abstractmethod
    async def take_due(self, owner: str, limit: int, lease: float) -> list[QueueEntry]:
        """Up to `limit` entries that are due, not held and not leased (or whose lease ran out),
        each now leased to `owner` for `lease` seconds. Two workers never both get an entry
        while its lease runs."""

    @abc.abstractmethod
    async def renew_lease(self, entry_id: uuid.UUID, owner: str, lease: float) -> bool:
        """Extend `owner`'s lease to `lease` seconds from now; False when it is no longer theirs."""

    @abc.abstractmethod
    async def read_queued(self, entry_id: uuid.UUID) -> bytes:
        """The queued message's bytes. Raises NoSuchQueueEntry."""

    @abc.abstractmethod
    async def record_results(self, entry_id: uuid.UUID, owner: str, results: Sequence[QueuedRecipient]) -> bool:
        """Store what became of some recipients (sent or failed, or still pending with the
        last reply) while `owner` holds the lease; False (nothing written) when it does not."""

    @abc.abstractmethod
    async def reschedule(
        self, entry_id: uuid.UUID, owner: str, due: float, error: str, *, warned: bool = False,
        results: Sequence[QueuedRecipient] = (),
    ) -> bool:
        """End `owner`'s attempt without finishing: store `results`, count the attempt, note the
        error, make the entry due at `due` and free the lease; `warned` records that the delay
        warning was sent. False (nothing written) when the lease is no longer theirs."""

    @abc.abstractmethod
    async def finish(self, entry_id: uuid.UUID) -> None:
        """Remove an entry whose every recipient is sent or failed (idempotent)."""

    @abc.abstractmethod
    async def list_queue(self, domain: str | None = None) -> list[QueueEntry]:
        """Every entry (optionally only those with a recipient in `domain`), oldest first."""

    @abc.abstractmethod
    async def get_queued(self, entry_id: uuid.UUID) -> QueueEntry:
        """Raises NoSuchQueueEntry."""

    @abc.abstractmethod
    async def retry_queued(self, entry_id: uuid.UUID | None = None) -> int:
        """Make an entry (every entry when None) due now, held ones excepted; returns how many."""

    @abc.abstractmethod
    async def hold_queued(self, entry_id: uuid.UUID, held: bool) -> None:
        """Hold an entry (no worker takes it) or release it (due now). Raises NoSuchQueueEntry."""

    @abc.abstractmethod
    async def delete_queued(self, entry_id: uuid.UUID) -> None:
        """Remove an entry without delivering it (no DSN). Raises NoSuchQueueEntry."""

    # ----------------------------------------------------------------- DKIM keys
    # Kept in the store so that every node signs with the same key.

    @abc.abstractmethod
    async def set_dkim_key(self, domain: str, selector: str, private_key_pem: str) -> None:
        """Set (or replace) a domain's signing key. Raises NoSuchDomain for a domain that is not local."""

    @abc.abstractmethod
    async def get_dkim_key(self, domain: str) -> DkimKey | None:
        """The domain's key, None when its mail is not signed."""

    @abc.abstractmethod
    async def delete_dkim_key(self, domain: str) -> None:
        """Stop signing a domain's mail (idempotent)."""

    @abc.abstractmethod
    async def list_dkim_keys(self) -> list[DkimKey]:
        """Every key, sorted by domain."""

    # ----------------------------------------------------------------- Sieve scripts
    # A user's scripts (RFC 5228), at most one of them active, kept in the store so that every
    # node filters with the same rules; ManageSieve (RFC 5804) and `cassmail sieve` edit them.
    # Names are checked by `check_sieve_name`; the text is not parsed here (cassmail.sieve does).

    @abc.abstractmethod
    async def put_sieve_script(self, user: str, name: str, content: str) -> None:
        """Create or replace a script (an active one stays active). Raises NoSuchUser,
        InvalidInput for a bad name or text larger than MAX_SIEVE_SCRIPT_BYTES."""

    @abc.abstractmethod
    async def get_sieve_script(self, user: str, name: str) -> str:
        """Raises NoSuchSieveScript, NoSuchUser."""

    @abc.abstractmethod
    async def list_sieve_scripts(self, user: str) -> list[SieveScriptInfo]:
        """The user's scripts sorted by name. Raises NoSuchUser."""

    @abc.abstractmethod
    async def set_active_sieve_script(self, user: str, name: str | None) -> None:
        """Make a script the active one (None: no script runs). Raises NoSuchSieveScript, NoSuchUser."""

    @abc.abstractmethod
    async def delete_sieve_script(self, user: str, name: str) -> None:
        """Raises NoSuchSieveScript, SieveScriptActive for the active script, NoSuchUser."""

    @abc.abstractmethod
    async def rename_sieve_script(self, user: str, old: str, new: str) -> None:
        """Rename keeping the text and, if it was, the active mark. Raises NoSuchSieveScript,
        SieveScriptExists, NoSuchUser."""

    @abc.abstractmethod
    async def active_sieve_script(self, user: str) -> tuple[str, str] | None:
        """(name, text) of the active script, None when none is: read on every delivery to the
        user, so one or two small reads. A user that does not exist has none."""

    @abc.abstractmethod
    async def note_vacation(self, user: str, key: str, seconds: float) -> bool:
        """Record that a vacation reply `key` (check_vacation_key: a digest of the sender and
        the reply) is sent now, unless one was within the last `seconds`: True when the caller
        should send it. Records expire after their period. Raises NoSuchUser (file stores),
        InvalidInput."""


#: Largest Sieve script any store keeps; the [sieve] max_script_size setting is below it.
MAX_SIEVE_SCRIPT_BYTES = 1 << 20
#: Longest script name in characters (RFC 5804 1.6 sets no bound; file names need one).
MAX_SIEVE_NAME = 128
_VACATION_KEY = re.compile(r"[0-9a-f]{16,128}\Z")


def check_sieve_name(name: str) -> str:
    """A script name as stores keep it, or InvalidInput: 1..128 characters of Unicode text,
    with no control characters (RFC 5804 1.6)."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_SIEVE_NAME:
        raise InvalidInput(f"a Sieve script name has 1..{MAX_SIEVE_NAME} characters")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in name):
        raise InvalidInput("a Sieve script name has no control characters")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput("a Sieve script name is UTF-8 text") from None
    return name


def check_sieve_content(content: str) -> str:
    if not isinstance(content, str):
        raise InvalidInput("a Sieve script is text")
    try:
        size = len(content.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidInput("a Sieve script is UTF-8 text") from None
    if size > MAX_SIEVE_SCRIPT_BYTES:
        raise InvalidInput(f"a Sieve script has at most {MAX_SIEVE_SCRIPT_BYTES} bytes")
    return content


def check_vacation_key(key: str, seconds: float) -> tuple[str, float]:
    if not isinstance(key, str) or not _VACATION_KEY.match(key):
        raise InvalidInput("a vacation key is 16..128 lower-case hex digits")
    if not isinstance(seconds, (int, float)) or not 0 < seconds <= 10 * 365 * 86400:
        raise InvalidInput("a vacation period is 0..10 years")
    return key, float(seconds)


async def local_recipients(store: Store, address: str, delimiter: str = "") -> list[str]:
    """The users mail to a local address reaches: the user, or an alias's users; [] when the
    address is neither. The user lookup comes first, so the common case is one read, and the
    alias is read only on a miss. (A function over the contract, so a wrapped store sees both calls.)
    With a `delimiter` ("+"), `anne+lists@x` that is neither reaches what `anne@x` reaches
    (RFC 5233 subaddresses, which Sieve scripts test with :detail)."""
    key = address_key(address)
    if await store.user_exists(key):
        return [key]
    found = await store.get_alias(key) or []
    if not found and delimiter:
        local, _, domain = key.rpartition("@")
        base, sep, _detail = local.partition(delimiter)
        if sep and base:
            return await local_recipients(store, f"{base}@{domain}")
    return found


# --------------------------------------------------------------------------- helpers for backends


def count_status(messages: Iterable[tuple[frozenset[str], int, int | None]], uid_next: int,
                 recent_mark: int | None = None) -> MailboxStatus:
    """STATUS counts of a mailbox's messages given as (flags, size, UID or None), with its UID
    counter: the messages not numbered yet each take a UID to come, and with `recent_mark` (see
    `claim_recent`) those at or above it or not numbered are counted \\Recent."""
    mark = recent_mark or 0
    count = unseen = unnumbered = recents = size = deleted = deleted_size = 0
    for flags, nbytes, uid in messages:
        count += 1
        unseen += "\\Seen" not in flags
        unnumbered += uid is None
        recents += uid is None or uid >= mark
        size += nbytes
        if "\\Deleted" in flags:
            deleted += 1
            deleted_size += nbytes
    return MailboxStatus(count, unseen, size, deleted, deleted_size, uid_next + unnumbered,
                         recents if recent_mark is not None else None)


def uid_work(ids: Sequence[uuid.UUID], renumber: Mapping[uuid.UUID, int] | None) -> list[uuid.UUID]:
    """The ids an `assign_uids` call is about, once each: `ids` in order, then any key of
    `renumber` they do not name."""
    wanted = dict.fromkeys(ids)
    if renumber:
        wanted.update(dict.fromkeys(renumber))
    return list(wanted)


def needs_uid(current: int | None, message_id: uuid.UUID, renumber: Mapping[uuid.UUID, int] | None) -> bool:
    """True when an existing message gets a new UID in `assign_uids`: it has none, or the caller
    asks to renumber it and its UID is still the one the caller saw."""
    if not current:
        return True
    return renumber is not None and renumber.get(message_id) == current


#: The largest IMAP UID (RFC 3501: a 32-bit unsigned number).
MAX_UID = 2**32 - 1


def check_recent_below(below: int) -> int:
    """`below` of a claim_recent call, or InvalidInput: an int from 1 to one above the largest UID."""
    if isinstance(below, bool) or not isinstance(below, int) or not 1 <= below <= MAX_UID + 1:
        raise InvalidInput(f"a \\Recent claim ends at 1..{MAX_UID + 1}, not {below!r}")
    return below


def check_alias(alias: str, users: Iterable[str]) -> tuple[str, tuple[str, ...]]:
    """The alias key and its canonical users (sorted, once each), or InvalidInput; backends call
    this before any check against the store."""
    if isinstance(users, str):
        raise InvalidInput("an alias's users must be a list of addresses, not one string")
    key = address_key(alias)
    targets = tuple(sorted({address_key(u) for u in users}))
    if not targets:
        raise InvalidInput(f"alias {key} needs at least one user")
    return key, targets


def check_quota_limit(limit: int | None) -> int | None:
    """A storage limit as stores keep it, or InvalidInput: None (no limit) or whole bytes >= 0."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < 2**63:
        raise InvalidInput(f"a storage limit is a whole number of bytes from 0, or none; not {limit!r}")
    return limit


def stored_quota_limit(value: object, where: str) -> int:
    """A limit read back from a file store's quota file, or OSError naming the file: what is
    there was not written by set_quota (a damaged or hand-edited file)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OSError(f"{where}: not a storage limit: {value!r}")
    return value


def quota_needs(unique: Iterable[tuple[str, str]], size: int) -> dict[str, int]:
    """Bytes a delivery of `size` bytes to these distinct (user, mailbox) targets adds to each
    user's usage: one copy per mailbox."""
    needs: dict[str, int] = {}
    for user, _ in unique:
        needs[user] = needs.get(user, 0) + size
    return needs


def check_targets(targets: Sequence[Target]) -> list[Target]:
    """Canonical targets, or InvalidInput; backends call this before writing anything."""
    if not targets:
        raise InvalidInput("deliver needs at least one target")
    return [Target(address_key(t.user), mailbox_name(t.mailbox), flag_set(t.flags)) for t in targets]


def prepare_delivery(
    body: Body, targets: Sequence[Target], max_message_size: int
) -> tuple[memoryview, list[Target], dict[tuple[str, str], Target]]:
    """The body as bytes, the canonical targets and the distinct target mailboxes (a mailbox
    named twice gets one copy), or MessageTooLarge / InvalidInput before anything is written."""
    view = body_view(body)
    if max_message_size and view.nbytes > max_message_size:
        raise MessageTooLarge(view.nbytes, max_message_size)
    canonical = check_targets(targets)
    unique: dict[tuple[str, str], Target] = {}
    for t in canonical:
        unique.setdefault((t.user, t.mailbox), t)
    return view, canonical, unique


def check_enqueue(
    body: Body, sender: str, recipients: Sequence[str], max_message_size: int
) -> tuple[memoryview, str, list[str]]:
    """The body as bytes, the sender ("" for <>) and the recipients once each, as addresses, or
    MessageTooLarge / InvalidInput before anything is written."""
    view = body_view(body)
    if max_message_size and view.nbytes > max_message_size:
        raise MessageTooLarge(view.nbytes, max_message_size)
    if isinstance(recipients, str):
        raise InvalidInput("recipients must be a list of addresses, not one string")
    rcpts = list(dict.fromkeys(str(Address.parse(r)) for r in recipients))
    if not rcpts:
        raise InvalidInput("a queued message needs at least one recipient")
    sender = "" if sender in ("", "<>") else str(Address.parse(sender))
    return view, sender, rcpts


def check_dkim_key(domain: str, selector: str, private_key_pem: str) -> tuple[str, str, str]:
    """Canonical (domain, selector, key), or InvalidInput."""
    if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9_-]{0,62}))*", selector or ""):
        raise InvalidInput(f"invalid DKIM selector {selector!r}")
    if not isinstance(private_key_pem, str) or "PRIVATE KEY-----" not in private_key_pem:
        raise InvalidInput("a DKIM key must be a private key in PEM")
    return normalize_domain(domain), selector, private_key_pem


def check_rename(user_key: str, old: str, new: str) -> tuple[str, str]:
    """Canonical (old, new) of a mailbox rename, or the error every store gives: renaming to
    itself is MailboxExists; to INBOX or under itself, MailboxNotAllowed."""
    old, new = mailbox_name(old), mailbox_name(new)
    if old == new:
        raise MailboxExists(user_key, new)
    if new == INBOX or new.startswith(old + HIERARCHY_DELIMITER):
        raise MailboxNotAllowed(f"cannot rename {old!r} to {new!r}")
    return old, new


def check_flag_mode(mode: str) -> FlagMode:
    if mode not in ("set", "add", "remove"):
        raise InvalidInput(f"flag mode must be set, add or remove, not {mode!r}")
    return mode  # type: ignore[return-value]


def changed_flags(current: frozenset[str], values: frozenset[str], mode: FlagMode) -> frozenset[str]:
    """A message's flags after a `store_flags` change of `values` in `mode`."""
    if mode == "set":
        return values
    return current | values if mode == "add" else current - values


def expunge_floor(mark: int | None, mark_at: float | None, floor: int | None, highest: int, now: float,
                  keep: float) -> tuple[int | None, int, float] | None:
    """The trim of remembered expunges that an expunge at `now` makes, given the last trim (the
    counter `mark` then, at `mark_at`) and the `floor` (expunges at or below it may be
    forgotten): None for no trim; else the new (floor, mark, mark_at). A trim older than `keep`
    seconds raises the floor to its mark, so every expunge is remembered at least `keep`
    seconds and at most about twice that; `highest` is the counter before this expunge."""
    if mark_at is None or mark is None:
        return floor, highest, now
    if now - mark_at < keep:
        return None
    return max(mark, floor or 0), highest, now


def body_view(body: Body) -> memoryview:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"message body must be bytes, got {type(body).__name__}")
    return memoryview(body).cast("B")



_ESCAPED = re.compile(r"%(25|2F|2E)")


def encode_name(name: str) -> str:
    """A mailbox name or user key as one file name, reversibly, for the file-based backends:
    `%` becomes `%25`, `/` (the hierarchy delimiter) `%2F` and a leading `.` `%2E`, so no name
    is a hidden file, a WheelFS cue or a path; everything else, Unicode included, is kept."""
    text = name.replace("%", "%25").replace("/", "%2F")
    return "%2E" + text[1:] if text.startswith(".") else text


def decode_name(text: str) -> str:
    """Inverse of `encode_name`."""
    return _ESCAPED.sub(lambda m: {"25": "%", "2F": "/", "2E": "."}[m.group(1)], text)


def checked_password_hash(password_hash: str) -> str:
    """A password hash as a store keeps it: any non-empty string (cassmail.auth checks its form)."""
    if not isinstance(password_hash, str) or not password_hash:
        raise InvalidInput("password hash must be a non-empty string")
    return password_hash


def internal_date(when: datetime | None) -> datetime:
    """An internal date in UTC (now when None); a date without zone is refused."""
    if when is None:
        return datetime.now(timezone.utc)
    if when.tzinfo is None:
        raise InvalidInput("internal date must carry a time zone")
    return when.astimezone(timezone.utc)


def appended_date(when: datetime | None) -> datetime:
    """The internal date an APPEND stores (`internal_date`), to the millisecond: what every
    store lists again exactly (Cassandra keeps milliseconds), so the summary `Store.append`
    returns is the one a listing gives."""
    when = internal_date(when)
    return when.replace(microsecond=when.microsecond - when.microsecond % 1000)


def numbered_summary(delivered: MessageSummary, uid: int | None,
                     modseqs: Mapping[uuid.UUID, int] | None) -> MessageSummary:
    """`Store.append`'s answer: the delivered message with the UID it got (if any) and the
    MODSEQ that numbering took (when `modseqs` has it)."""
    if uid is None:
        return delivered
    modseq = modseqs.get(delivered.id) if modseqs is not None else None
    return MessageSummary(delivered.id, delivered.size, delivered.flags, delivered.internal_date, uid, modseq)


def internal_date_micros(when: datetime | None) -> int:
    """An internal date as microseconds since 1970 (now when None); a date without zone is refused."""
    if when is None:
        return int(time.time() * 1_000_000)
    delta = internal_date(when) - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
