"""A session's view of its selected mailbox: sequence numbers, UIDs, flags, and what changed.

RFC 3501 lets a session's message numbers change only when the server says so
(EXISTS, EXPUNGE), so each session keeps its own view and brings it up to date
from a listing of the store at the moments it may tell the client. Messages the
store lists without a UID get theirs here, by `assign_uids` in the listing's order: the
store guarantees they land above every UID handed out before, so new messages always
go at the end of the view and numbers never shift under the client.

A message can also be listed late with a UID the session may no longer show: it
was numbered on another node while this node's read (at a weak consistency level)
missed it, and the session has since shown a higher UID; or a stale read hid a
message the view had shown, the view announced its EXPUNGE, and it came back.
Showing it under that UID would put it below UIDs a syncing client already has (the
client would never fetch it) or bring an expunged UID back to life. Such a message
is renumbered (`assign_uids(renumber=...)`): it gets a UID above all others and
joins the view at the end as a new message.

The view also keeps each message's RFC 7162 MODSEQ (from the listing) and the HIGHESTMODSEQ it
has taken in (`highest`): every change with a MODSEQ at or below it is in the view (the store's
HIGHESTMODSEQ is read before the listing that brings the view up to date), so it is what a
client may be told it is in step with. A message numbered by this view's own listing has the
MODSEQ the numbering gave it where the store tells it (Cassandra), else none yet (the listing
was read before the numbering); `condstore.fill` learns a missing one when a
client needs it. What CONDSTORE and QRESYNC tell the client is in `condstore.py`.

The session's own changes (STORE, EXPUNGE, APPEND, COPY and MOVE) are in the view as soon as it
makes them. Where the store tells the MODSEQ each one took (Cassandra), the view keeps it
(`took`), and a refresh that finds nothing but those above its HIGHESTMODSEQ reads none of
them back (`_changes`): a client that changes a flag and then polls costs one read, not three.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import time
import uuid
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from cassmail.imap import wire
from cassmail.imap.cache import Lru
from cassmail.logs import kv
from cassmail.model import MessageSummary
from cassmail.store.base import RecentClaim, Store, StoreUnavailable

log = logging.getLogger("cassmail.imap")

#: Seconds a changes token is trusted: past them a refresh reads the listing whatever the token
#: says. On Cassandra the token is written last-write-wins with each change, so a change whose
#: write of it lost to a concurrent one's (clock skew between nodes) is seen within this long.
TOKEN_TRUST = 10.0

#: Seconds between full listings of a view kept up to date incrementally (changes since its
#: HIGHESTMODSEQ, expunges, new arrivals): what only a full listing sees (a message stamped by a
#: node whose clock is behind by more than the store's arrival window, a flag change made
#: without a MODSEQ) shows by then, as a change whose token write lost does (TOKEN_TRUST).
FULL_LISTING = TOKEN_TRUST

#: Seconds added to that period per message of the view. A full listing costs about 20 us of CPU
#: per message (the store's and the worker's, on Cassandra), so one every 10 s would keep a fifth
#: of a core busy for each session on a 100,000-message mailbox; at 1 ms per message a session's
#: full listings cost about 2% of a core whatever the size, and what only they see shows within
#: 100 s on such a mailbox.
FULL_LISTING_PER_MESSAGE = 0.001


def full_listing_period(messages: int) -> float:
    """Seconds a view of `messages` messages goes on from changes and arrivals between two full listings."""
    return max(FULL_LISTING, messages * FULL_LISTING_PER_MESSAGE)


def lists_arrivals(store: Store) -> bool:
    """Whether the store lists new arrivals without the whole mailbox (Store.arrivals_mark), so
    that a view can follow the changes instead of listing the mailbox again."""
    return store.arrivals_mark(()) is not None


#: MODSEQs of the session's own changes a view keeps (`took`) until a refresh takes them in;
#: past them it forgets them, and reads the changes back as it would another session's.
OWN_KEPT = 256

#: Renumbering asks the store at most this many times per refresh: a message renumbered by
#: another session meanwhile comes back with that session's UID, which may still be one this
#: view has shown, and is renumbered again. What is left waits for the next refresh.
RENUMBER_ROUNDS = 3


@dataclass
class Listing:
    """A mailbox's summaries, and the UIDs that the read that made it has just handed out.
    One listing may be handed to several sessions (the IDLE watcher shares its reads)."""

    summaries: list[MessageSummary]
    assigned: dict[uuid.UUID, int]
    #: The store's HIGHESTMODSEQ read before the listing (None: not read): every change up to it
    #: is in the listing.
    highest: int | None = None
    #: When (time.time()) the listing began, for Store.arrivals_mark (None: not known).
    started: float | None = None
    #: None for a whole listing; for one of only what changed since the view's HIGHESTMODSEQ and
    #: what arrived (MailboxView._changes), the UIDs expunged since.
    vanished: set[int] | None = None
    #: The MODSEQ of each message the read numbered, where the store told it.
    modseqs: dict[uuid.UUID, int] = field(default_factory=dict)

    def uid_next(self) -> int | None:
        """UIDNEXT as the assignment left it (the counter after the UIDs it handed out), when
        this read assigned any; None when only the store's counter can tell."""
        return max(self.assigned.values()) + 1 if self.assigned else None


async def read_listing(store: Store, user: str, name: str, page_size: int, highest: bool = False) -> Listing:
    """Every summary of a mailbox, with UIDs given to those that had none (`Numbering`: while
    the listing reads on, once it has found many); with `highest`, the store's HIGHESTMODSEQ
    read first."""
    modseq = await store.highest_modseq(user, name) if highest else None
    started = time.time()
    summaries: list[MessageSummary] = []
    numbering = Numbering(store, user, name, modseq)
    try:
        async for summary in store.list_messages(user, name, page_size):
            summaries.append(summary)
            if summary.uid is None:
                numbering.found(summary.id)
        assigned = await numbering.done()
    finally:
        numbering.cancel()
    highest = _numbered_highest(modseq, numbering.modseqs)
    return Listing(summaries, assigned, highest, started, modseqs=numbering.modseqs)


#: Unnumbered messages a listing finds before it starts numbering them while it reads on.
NUMBER_WHILE_LISTING = 4096


class Numbering:
    """The numbering of the unnumbered mail a listing finds, in the listing's order, one
    `assign_uids` call at a time: the first as soon as NUMBER_WHILE_LISTING are found, the next
    with what was found meanwhile once it is done, the last with the rest when the listing ends.
    A first SELECT of 100,000 messages never numbered (on Cassandra about a hundred conditional
    batches) so numbers while the pages are read and decoded. A call the store cannot serve
    (StoreUnavailable) ends the numbering: the rest waits for a later listing (see `number`)."""

    def __init__(self, store: Store, user: str, name: str, listed_at: int | None) -> None:
        self.store, self.user, self.name, self.listed_at = store, user, name, listed_at
        self.assigned: dict[uuid.UUID, int] = {}
        self.modseqs: dict[uuid.UUID, int] = {}
        self._found: list[uuid.UUID] = []
        self._running: asyncio.Task[None] | None = None
        self._failed = False

    def found(self, message_id: uuid.UUID) -> None:
        self._found.append(message_id)
        if len(self._found) >= NUMBER_WHILE_LISTING and (self._running is None or self._running.done()):
            self._start()

    async def done(self) -> dict[uuid.UUID, int]:
        """Number what is left once the listing ended; every UID handed out."""
        if self._running is not None:
            await self._running
        if self._found:
            self._start()
            assert self._running is not None
            await self._running
        return self.assigned

    def cancel(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()

    def _start(self) -> None:
        if self._running is not None:
            self._running.result()  # (done: an error of the call before is raised here)
        ids, self._found = self._found, []
        self._running = asyncio.ensure_future(self._assign(ids))

    async def _assign(self, ids: list[uuid.UUID]) -> None:
        if self._failed:
            return
        got = await _assign(self.store, self.user, self.name, ids, self.modseqs, self.listed_at)
        if got is None:
            self._failed = True
        else:
            self.assigned.update(got)


def _numbered_highest(highest: int | None, modseqs: dict[uuid.UUID, int]) -> int | None:
    """The HIGHESTMODSEQ for a listing read at `highest` whose numbering gave out `modseqs`: the
    highest of those when they are every MODSEQ above `highest` up to it (each was decided on
    the one below: Store.assign_uids), so that the next look at changes does not read the
    numbering back (for a first SELECT of 100,000 messages, 100,000 rows); else `highest`."""
    if highest is None or not modseqs:
        return highest
    taken = set(modseqs.values())
    return max(taken) if taken == set(range(highest + 1, max(taken) + 1)) else highest


async def number(store: Store, user: str, name: str, summaries: list[MessageSummary],
                 modseqs: dict[uuid.UUID, int] | None = None) -> dict[uuid.UUID, int]:
    """UIDs for the summaries that have none, in one `assign_uids` call (their MODSEQs into
    `modseqs`, where the store tells them); none when the store cannot number now."""
    return await _assign(store, user, name, [s.id for s in summaries if s.uid is None], modseqs) or {}


async def _assign(store: Store, user: str, name: str, ids: list[uuid.UUID],
                  modseqs: dict[uuid.UUID, int] | None, listed_at: int | None = None) -> dict[uuid.UUID, int] | None:
    """`assign_uids` of `ids`; None when the store cannot number now."""
    if not ids:
        return {}
    try:
        return await store.assign_uids(user, name, ids, modseqs=modseqs, listed_at=listed_at)
    except StoreUnavailable as exc:
        # Numbering needs more of the store than reading (on Cassandra a Paxos quorum): the
        # session goes on with the numbered mail, and the rest joins, above it, once it can.
        log.warning(kv("imap-uids", user=user, mailbox=name, waiting=len(ids), error=exc))
        return None


#: Flag lists made by `MailboxView.flag_list`, by (flags, recent), at most this many.
FLAG_LISTS_KEPT = 4096
_FLAG_LISTS: dict[tuple[frozenset[str], bool], bytes] = {}


def keywords_of(summaries: Iterable[MessageSummary]) -> set[str]:
    """The keywords (flags not starting with a backslash) the summaries carry."""
    return {f for s in summaries for f in s.flags if not f.startswith("\\")}


@dataclass
class Snapshot:
    """A closed view's state, kept by its worker (`Listener.snapshots`) so that the next SELECT of
    the mailbox there starts from it and reads only what changed since (`MailboxView.restore`),
    instead of the whole listing. Everything in it is the store's, as of the view's last
    refresh; nothing a session told its client (\\Recent, keywords announced) is kept."""

    uidvalidity: int
    uids: list[int]
    messages: dict[int, MessageSummary]
    #: The keywords of its messages (a superset: those its session announced).
    keywords: frozenset[str]
    highest: int
    uid_next: int
    token: Hashable | None
    listed_at: float
    mark: Hashable | None
    full_at: float


@dataclass
class Changes:
    """What a refresh found, in the order it must be told: expunged sequence numbers
    (descending, RFC 3501 7.4.1) and their UIDs (ascending, for QRESYNC's VANISHED), then flag
    changes (uid list) and MODSEQ changes with the same flags (told to CONDSTORE clients), then
    the new EXISTS/RECENT."""

    expunged: list[int] = field(default_factory=list)
    vanished: list[int] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    modseqs: list[int] = field(default_factory=list)
    exists: int | None = None
    recent: int | None = None


@dataclass
class OwnChange:
    """A change of the session's own, at the MODSEQ it took (`MailboxView.took`). An expunge
    needs nothing here: the session took its messages out of the view already."""

    #: UID -> id of the messages in the view whose flags it set (their flags are the view's).
    flagged: dict[int, uuid.UUID] = field(default_factory=dict)
    #: Messages it numbered that are not in the view yet: the refresh's arrivals bring them.
    numbered: set[uuid.UUID] = field(default_factory=set)


class MailboxView:
    """UIDs in ascending order (sequence number = index + 1) and the summary of each."""

    def __init__(self, store: Store, user: str, name: str, uidvalidity: int, readonly: bool, page_size: int,
                 recent_marks: Lru[int] | None = None) -> None:
        self.store, self.user, self.name = store, user, name
        #: The highest recent mark any session of this worker learnt, by (user, mailbox,
        #: UIDVALIDITY): a claim below it would win nothing, so it is not asked of the store.
        self.recent_marks = recent_marks
        self.uidvalidity, self.readonly, self.page_size = uidvalidity, readonly, page_size
        self.uids: list[int] = []
        self.messages: dict[int, MessageSummary] = {}
        #: RFC 3501 \\Recent: UIDs this session was the first to be told of (see `_claim_recent`).
        self.recent: set[int] = set()
        #: The store's recent mark as this session knows it: UIDs below it are nobody's news.
        self.recent_mark: int | None = None
        #: UIDs this session's APPEND claimed before the view lists them (`appended`).
        self.recent_ahead: set[int] = set()
        #: Keywords the client was told of in FLAGS (a new one is announced before it is shown).
        self.keywords: set[str] = set()
        #: The store's changes token read before the last listing (Store.changes_token), and when.
        self.token: Hashable | None = None
        self.listed_at = 0.0
        #: The highest UID this session has ever shown (expunged ones included): a listed UID at
        #: or below it that is not in the view may not be shown again, only renumbered.
        self.shown = 0
        self.uid_next = 1
        #: RFC 7162 HIGHESTMODSEQ of the view (see the module's docstring); `told` is the one the
        #: client was last given. With `condstore` (the session enabled it) every refresh that
        #: reads a listing reads the store's HIGHESTMODSEQ first, so `highest` follows it.
        self.highest = 0
        self.told = 0
        self.condstore = False
        #: Whether the store can list new arrivals without the whole mailbox (Store.arrivals_mark),
        #: the mark of the last listing for it, and when the view was last listed in full.
        self.incremental = lists_arrivals(store)
        self.mark: Hashable | None = None
        self.full_at = 0.0
        #: Set while a SELECT takes in what changed since its snapshot: a full listing that is
        #: due waits for the next refresh (see `restore`).
        self.defer_full = False
        #: Whether the last refresh took in every expunge it found (see `refresh`): only then is
        #: the view what the store held, for a snapshot.
        self.clean = True
        #: The session's own changes above `highest`, by the MODSEQ each took (see `took`).
        self.own: dict[int, OwnChange] = {}

    def snapshot(self) -> Snapshot | None:
        """The state of a view being closed (it is not used after: the snapshot takes its lists)
        for a later SELECT of its mailbox in this worker; None when the view is not the store's
        state (messages gone from the store still shown) or holds nothing."""
        if not self.clean or not self.uids:
            return None
        return Snapshot(self.uidvalidity, self.uids, self.messages, frozenset(self.keywords),
                        self.highest, self.uid_next, self.token, self.listed_at, self.mark, self.full_at)

    def restore(self, snapshot: Snapshot) -> None:
        """Start from a snapshot of a view of this mailbox (same UIDVALIDITY): the next refresh
        reads what changed since it, or nothing if its changes token still holds. A full listing
        that is due (`full_listing_period`) waits for the refresh after the SELECT's, as in a view
        that had stayed open: the SELECT shows the snapshot with every change and arrival since,
        and what only a full listing sees may be told at any later refresh. The UIDs in it count
        as shown: a message listed below them later is renumbered, as any view of them would."""
        self.uids, self.messages = list(snapshot.uids), dict(snapshot.messages)
        self.highest, self.uid_next = snapshot.highest, snapshot.uid_next
        self.token, self.listed_at = snapshot.token, snapshot.listed_at
        self.mark, self.full_at = snapshot.mark, snapshot.full_at
        self.shown = self.uids[-1] if self.uids else 0
        self.defer_full = True

    async def load(self, snapshot: Snapshot | None) -> int:
        """Fill a new view for SELECT and return UIDNEXT: from `snapshot` when one is given (see
        `restore`), else from the whole listing, with the store's HIGHESTMODSEQ (every SELECT
        tells it) and its changes token read first (the next refresh may need no listing)."""
        if snapshot is not None:
            self.restore(snapshot)
            last = self.uids[-1] if self.uids else 0
            changes = await self.refresh(expunge=True)
            self.defer_full = False
            await self._claim_recent()  # (a refresh that found nothing changed claimed nothing)
            told = changes.flags + changes.modseqs + self.uids[bisect.bisect_right(self.uids, last):]
            self.keywords = set(snapshot.keywords) | keywords_of(self.messages[u] for u in told)
            return await self.select_uid_next(None)
        token = await self.store.changes_token(self.user, self.name)
        listing = await read_listing(self.store, self.user, self.name, self.page_size, highest=True)
        await self.refresh(expunge=True, listing=listing)
        self.token, self.listed_at = token, time.monotonic()
        self.keywords = keywords_of(self.messages.values())
        return await self.select_uid_next(listing.uid_next())

    # ------------------------------------------------------------------ numbers

    def __len__(self) -> int:
        return len(self.uids)

    def seq(self, uid: int) -> int:
        return bisect.bisect_left(self.uids, uid) + 1

    def by_seq(self, ranges: list[tuple[int, int]]) -> list[int]:
        """UIDs of the messages whose sequence numbers fall in the ranges, ascending, once each."""
        picked: set[int] = set()
        for lo, hi in ranges:
            picked.update(self.uids[max(lo, 1) - 1 : min(hi, len(self.uids))])
        return sorted(picked)

    def by_uid(self, ranges: list[tuple[int, int]]) -> list[int]:
        picked: set[int] = set()
        for lo, hi in ranges:
            picked.update(self.uids[bisect.bisect_left(self.uids, lo) : bisect.bisect_right(self.uids, hi)])
        return sorted(picked)

    def largest(self, uid: bool) -> int:
        """What `*` stands for: the largest UID or sequence number (RFC 3501 6.4.8)."""
        if not self.uids:
            return 0 if not uid else max(self.uid_next - 1, 0)
        return self.uids[-1] if uid else len(self.uids)

    def first_unseen(self) -> int | None:
        for n, uid in enumerate(self.uids, 1):
            if "\\Seen" not in self.messages[uid].flags:
                return n
        return None

    def flags(self, uid: int) -> set[str]:
        flags = set(self.messages[uid].flags)
        if uid in self.recent:
            flags.add("\\Recent")
        return flags

    def flag_list(self, uid: int) -> bytes:
        """`wire.flag_list(self.flags(uid))`, made once per distinct set of flags (a mailbox has
        few: a FETCH of many messages' flags sorts and encodes each set once)."""
        key = (self.messages[uid].flags, uid in self.recent)
        made = _FLAG_LISTS.get(key)
        if made is None:
            if len(_FLAG_LISTS) >= FLAG_LISTS_KEPT:
                _FLAG_LISTS.clear()
            made = _FLAG_LISTS[key] = wire.flag_list(self.flags(uid))
        return made

    def set_flags(self, uid: int, flags: frozenset[str]) -> None:
        """Flags this session stored: the change has a MODSEQ the view does not know yet."""
        if flags != self.messages[uid].flags:
            self.messages[uid] = dataclasses.replace(self.messages[uid], flags=flags, modseq=None)

    def modseq(self, uid: int) -> int:
        """The message's MODSEQ; one not learnt yet is answered with the view's HIGHESTMODSEQ,
        which is below it (a lower MODSEQ only makes a client ask again or an UNCHANGEDSINCE
        fail; a higher one could let a conflicting STORE through)."""
        return self.messages[uid].modseq or max(self.highest, 1)

    def changed_since(self, uid: int, modseq: int) -> bool:
        """Whether the message changed after `modseq` (one whose MODSEQ is not known did)."""
        known = self.messages[uid].modseq
        return known is None or known > modseq

    def took(self, modseqs: dict[uuid.UUID, int], flagged: dict[uuid.UUID, int] | None = None,
             numbered: bool = False) -> None:
        """Keep the MODSEQs a change of this session took, as the store told them (the `modseqs`
        of Store.store_flags, with `flagged` the UID in the view of each message; of
        Store.delete_messages, once `Session.expunged` took the messages out of the view; of
        Store.append or assign_uids, `numbered`). Each was taken by that change alone, decided
        on the mailbox as of the MODSEQ below (Store.assign_uids), so a refresh that finds
        only these above the view's HIGHESTMODSEQ is up to date without reading them back."""
        for message_id, modseq in modseqs.items():
            if modseq <= self.highest:
                continue
            if modseq not in self.own and len(self.own) >= OWN_KEPT:
                self.own.clear()  # (a session that changes and never looks: it reads the changes)
            change = self.own.setdefault(modseq, OwnChange())
            if flagged is not None and message_id in flagged:
                change.flagged[flagged[message_id]] = message_id
            elif numbered:
                change.numbered.add(message_id)

    def known(self, uids: Iterable[int]) -> tuple[dict[uuid.UUID, MessageSummary], int] | None:
        """These messages as the store holds them at the MODSEQ given, for Store.store_flags's
        `known`: the view's HIGHESTMODSEQ, or above it as far as every MODSEQ up from it was a
        change of this session's own (`took`), whose flags and MODSEQs the view has. None
        before the view has a HIGHESTMODSEQ."""
        through = self.highest
        if not through:
            return None
        flagged: dict[int, int] = {}
        while through + 1 in self.own:
            through += 1
            flagged.update(dict.fromkeys(self.own[through].flagged, through))
        out: dict[uuid.UUID, MessageSummary] = {}
        for uid in uids:
            summary = self.messages[uid]
            modseq = flagged.get(uid)
            if modseq is not None and (summary.modseq or 0) < modseq:
                summary = dataclasses.replace(summary, modseq=modseq)
            out[summary.id] = summary
        return out, through

    def recent_claim(self) -> RecentClaim | None:
        """What an APPEND to this mailbox asks the store to claim \\Recent on (Store.append):
        the mark this session knows; None for a read-only session, which claims nothing."""
        if self.readonly or self.recent_mark is None:
            return None
        return RecentClaim(max(self.recent_mark, self._worker_mark() or 0))

    def appended(self, message: MessageSummary, recent: RecentClaim | None) -> Changes | None:
        """An APPEND of this session numbered `message` (Store.append's summary) and, if `recent`
        won, claimed it: \\Recent here, and the mark is past it. The view takes it in at once,
        and the new EXISTS and RECENT are returned, when nothing can lie between it and what
        the view has shown: its UID is the next one after the highest shown, its MODSEQ is
        known, and the view tells no HIGHESTMODSEQ (CONDSTORE off; the next refresh takes the
        step in, see `took`). Otherwise None: the message joins at the next refresh, which
        the caller makes."""
        uid = message.uid
        if uid is None or recent is None or not recent.won:
            return None
        self._raise_mark(uid + 1)
        if self.condstore or message.modseq is None or uid != self.shown + 1:
            self.recent_ahead.add(uid)
            return None
        self.uids.append(uid)
        self.messages[uid] = message
        self.recent.add(uid)
        self.shown = uid
        self.uid_next = max(self.uid_next, uid + 1)
        return Changes(exists=len(self.uids), recent=len(self.recent))

    def _worker_mark(self) -> int | None:
        """The highest mark any session of this worker learnt of this mailbox."""
        if self.recent_marks is None:
            return None
        return self.recent_marks.get((self.user, self.name, self.uidvalidity))

    def _raise_mark(self, mark: int) -> None:
        self.recent_mark = max(self.recent_mark or 1, mark)
        if self.recent_marks is not None:
            key = (self.user, self.name, self.uidvalidity)
            self.recent_marks.put(key, max(self.recent_mark, self.recent_marks.get(key) or 0))

    def _own_only(self, highest: int) -> dict[int, OwnChange] | None:
        """The own changes that are every MODSEQ from the view's HIGHESTMODSEQ up to `highest`,
        or None when some change between is another's (or one this view forgot)."""
        if highest - self.highest > len(self.own):
            return None
        steps = {m: self.own[m] for m in range(self.highest + 1, highest + 1) if m in self.own}
        return steps if len(steps) == highest - self.highest else None

    def _take_own(self, steps: dict[int, OwnChange]) -> None:
        """The MODSEQs of the messages those changes set the flags of (the flags are the view's)."""
        for modseq in sorted(steps):
            for uid, message_id in steps[modseq].flagged.items():
                summary = self.messages.get(uid)
                if summary is not None and summary.id == message_id and (summary.modseq or 0) < modseq:
                    self.messages[uid] = dataclasses.replace(summary, modseq=modseq)

    def remove(self, uids: list[int]) -> list[int]:
        """Take messages out of the view; their sequence numbers, descending, as EXPUNGE wants them."""
        if not uids:
            return []
        seqs = sorted((self.seq(u) for u in uids if u in self.messages), reverse=True)
        gone = set(uids)
        self.uids = [u for u in self.uids if u not in gone]
        for u in gone:
            self.messages.pop(u, None)
            self.recent.discard(u)
        return seqs

    # ------------------------------------------------------------------ the store

    async def select_uid_next(self, listing_uid_next: int | None) -> int:
        """UIDNEXT for SELECT: the store's counter, which stays above every UID ever handed out
        (expunged ones too), never merely the newest UID listed plus one. The load's own
        assignment knows the counter (`listing_uid_next`); otherwise the store is asked."""
        if listing_uid_next is None:
            try:
                listing_uid_next = await self.store.uid_next(self.user, self.name)
            except StoreUnavailable as exc:
                log.warning(kv("imap-uidnext", user=self.user, mailbox=self.name, error=exc))
        if listing_uid_next is not None:
            self.uid_next = max(self.uid_next, listing_uid_next)
        return self.uid_next

    async def refresh(self, expunge: bool, listing: Listing | None = None) -> Changes:
        """Bring the view up to date, from `listing` when one is given (see `read_listing`).
        Without `expunge` messages gone from the store stay in the view until a later refresh
        may announce them."""
        if listing is None:
            arrived: tuple[list[MessageSummary], Hashable] | None = None
            incremental = self._incremental_due()
            if self.token is None and incremental:
                # The last token was too young to trust (a change moments before), as it will
                # most likely be again: the arrivals, read anyway then, with the token.
                found, mark, token, highest = await self.store.arrivals_state(self.user, self.name, self.mark)
                arrived = found, mark
            else:
                token, highest = await self.store.changes_state(self.user, self.name)
            fresh = time.monotonic() - self.listed_at < TOKEN_TRUST
            if token is not None and token == self.token and fresh:
                return Changes()  # nothing changed since the last listing: no need to read it
            listing = await self._changes(highest, arrived) if incremental else None
            if listing is None:
                listing = await read_listing(self.store, self.user, self.name, self.page_size,
                                             self.condstore or self.incremental)
                self._listed_in_full(listing)
            self.token, self.listed_at = token, time.monotonic()
        else:
            self.token = None  # a listing read by someone else: the next refresh reads its own
            self._listed_in_full(listing)
        current: dict[int, MessageSummary] = {}
        for s in listing.summaries:
            uid = s.uid if s.uid is not None else listing.assigned.get(s.id)
            if uid is not None:
                if s.uid != uid:  # (made whole: dataclasses.replace takes twice as long, for each
                    # of 100,000 messages numbered by a first SELECT)
                    s = MessageSummary(s.id, s.size, s.flags, s.internal_date, uid, listing.modseqs.get(s.id))
                current[uid] = s
        changes = Changes()
        before = (len(self.uids), len(self.recent))
        if listing.vanished is None:
            gone = [u for u in self.uids if u not in current]
        else:  # only what changed: the work follows the changes, not the mailbox
            gone = sorted(u for u in listing.vanished if u in self.messages)
        if expunge:
            changes.expunged = self.remove(gone)
            changes.vanished = gone
        elif gone:
            # Kept in the view for now: the token must not say this listing was taken in, or the
            # next refresh that may expunge would find it unchanged and keep them for ever.
            self.token = None
        for uid in self.uids if listing.vanished is None else sorted(current):
            now, old = current.get(uid), self.messages.get(uid)
            if now is None or old is None:
                continue  # gone, or new (taken in below)
            if now.modseq is not None and old.modseq is not None and now.modseq < old.modseq:
                continue  # an older state than the view's (a stale read): nothing to take from it
            if now.flags != old.flags:
                self.messages[uid] = now
                changes.flags.append(uid)
            elif now.modseq is not None and now.modseq != old.modseq:
                self.messages[uid] = now
                changes.modseqs.append(uid)
        await self._renumber_late(current)
        newest = self.uids[-1] if self.uids else 0
        fresh = sorted(u for u in current if u > max(newest, self.shown))
        for uid in fresh:
            self.uids.append(uid)
            self.messages[uid] = current[uid]
        if self.uids:
            self.shown = max(self.shown, self.uids[-1])
        if self.recent_ahead:  # (one expunged before this view listed it is nobody's)
            self.recent.update(self.recent_ahead.intersection(fresh))
            self.recent_ahead = {u for u in self.recent_ahead if u > self.shown}
        await self._claim_recent()
        if current:
            self.uid_next = max(self.uid_next, max(current) + 1)
        if listing.assigned:
            self.uid_next = max(self.uid_next, max(listing.assigned.values()) + 1)
        if listing.highest is not None and (expunge or not gone):
            self.highest = max(self.highest, listing.highest)  # everything up to it is taken in
        if (len(self.uids), len(self.recent)) != before or changes.expunged:
            changes.exists, changes.recent = len(self.uids), len(self.recent)
        self.clean = expunge or not gone
        if self.own:
            self.own = {m: change for m, change in self.own.items() if m > self.highest}
        return changes

    def _listed_in_full(self, listing: Listing) -> None:
        if self.incremental and listing.highest is not None:
            self.mark = self.store.arrivals_mark(listing.summaries, listing.started)
            self.full_at = time.monotonic()
        else:
            self.mark = None

    def _incremental_due(self) -> bool:
        """Whether the next refresh may read only the changes (`_changes`), not a full listing:
        the store lists arrivals, the view was listed in full once, not too long ago."""
        if not self.incremental or self.mark is None or not self.highest:
            return False
        return time.monotonic() - self.full_at <= full_listing_period(len(self.uids)) or self.defer_full

    async def _changes(self, highest: int | None,
                       arrived: tuple[list[MessageSummary], Hashable] | None = None) -> Listing | None:
        """A listing of only what changed since the view's HIGHESTMODSEQ (Store.changes_since:
        the messages, and the UIDs expunged) and what arrived since its last listing
        (Store.arrivals): a few small reads instead of the whole mailbox. None when a full
        listing is due after all: expunges the store forgot. `highest`: the store's
        HIGHESTMODSEQ if it came with the changes token (else it is read); `arrived`: the
        arrivals and their next mark if they came with it too."""
        store, user, name = self.store, self.user, self.name
        if highest is None:
            highest = await store.highest_modseq(user, name)
        vanished: set[int] = set()
        changed: list[MessageSummary] = []
        own = self._own_only(highest) if highest > self.highest else None
        if own is not None and any(change.numbered for change in own.values()):
            if arrived is None:
                arrived = await store.arrivals(user, name, self.mark)
            arrivals = {s.id for s in arrived[0]}
            if not all(i in arrivals for change in own.values() for i in change.numbered):
                own = None  # (a message numbered here that the arrivals missed: read the changes)
        if own is not None:
            self._take_own(own)
        elif highest > self.highest:
            changed, gone = await store.changes_since(user, name, self.highest)
            if gone is None:
                return None
            vanished = set(gone)
        found, mark = arrived if arrived is not None else await store.arrivals(user, name, self.mark)
        latest: dict[uuid.UUID, MessageSummary] = {}
        for s in [*changed, *found]:
            known = latest.get(s.id)
            if known is None or s.uid != known.uid or (s.modseq or 0) >= (known.modseq or 0):
                latest[s.id] = s
        summaries = [s for s in latest.values() if s.uid is None or s.uid not in vanished]
        modseqs: dict[uuid.UUID, int] = {}
        assigned = await number(store, user, name, summaries, modseqs)
        self.mark = mark
        highest = _numbered_highest(highest, modseqs)
        return Listing(summaries, assigned, highest, vanished=vanished, modseqs=modseqs)

    async def _claim_recent(self) -> None:
        """RFC 3501: a message is \\Recent in exactly one session, the first read-write one told
        of it, on any node. The store keeps a mark below which every UID has been claimed; a
        session claims the UIDs it shows from the mark up (one conditional write, and only when
        it shows UIDs at or above the mark) and owns \\Recent for those its claim won. A
        read-only session claims nothing: what lies above the mark at its SELECT is recent to it."""
        if not self.uids:
            return
        top = self.uids[-1] + 1
        try:
            if self.recent_mark is None:
                self.recent_mark = await self.store.recent_mark(self.user, self.name)
            if self.readonly:
                self.recent.update(self.uids[bisect.bisect_left(self.uids, self.recent_mark):])
                return
            known = self._worker_mark()
            if known is not None and known > self.recent_mark:
                self.recent_mark = known  # (the store's mark only grows)
            if top <= self.recent_mark:
                return
            before = await self.store.claim_recent(self.user, self.name, top, known=self.recent_mark)
        except StoreUnavailable as exc:  # \\Recent waits for the next refresh; the session goes on
            log.warning(kv("imap-recent", user=self.user, mailbox=self.name, error=exc))
            return
        self.recent.update(self.uids[bisect.bisect_left(self.uids, before):])  # (all below `top`)
        self._raise_mark(max(top, before))

    async def _renumber_late(self, current: dict[int, MessageSummary]) -> None:
        """Give a new UID to every listed message whose UID this session may no longer show (at
        or below the highest it has shown, yet not in the view), in `current` in place: the old
        UID goes, the new one (above every UID handed out) comes in and joins as a new message."""
        late = {s.id: s for uid, s in current.items() if uid <= self.shown and uid not in self.messages}
        if late:  # (a UID in the view names its message; else the message may be there under another)
            in_view = {s.id for s in self.messages.values()}
            late = {i: s for i, s in late.items() if i not in in_view}
        if not late:
            return
        for summary in late.values():
            del current[summary.uid]
        pending = {message_id: s.uid for message_id, s in late.items()}
        for _ in range(RENUMBER_ROUNDS):
            try:
                got = await self.store.assign_uids(self.user, self.name, [], renumber=pending)
            except StoreUnavailable as exc:
                log.warning(kv("imap-renumber", user=self.user, mailbox=self.name, waiting=len(pending), error=exc))
                return
            pending = {}
            for message_id, uid in got.items():
                old = late[message_id]
                if uid > self.shown:
                    log.info(kv("imap-renumber", user=self.user, mailbox=self.name, old=old.uid, new=uid))
                    current[uid] = MessageSummary(old.id, old.size, old.flags, old.internal_date, uid)
                elif uid not in self.messages:  # renumbered elsewhere, to a UID shown here too: again
                    pending[message_id] = uid
            if not pending:
                return
