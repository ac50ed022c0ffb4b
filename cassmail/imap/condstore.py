"""CONDSTORE and QRESYNC (RFC 7162): what the command modules call to speak of MODSEQs.

A session turns CONDSTORE on with its first CONDSTORE enabling command (RFC 7162 3.1: ENABLE
CONDSTORE or QRESYNC, SELECT/EXAMINE (CONDSTORE), FETCH of MODSEQ or with CHANGEDSINCE, SEARCH
MODSEQ, STORE UNCHANGEDSINCE, STATUS HIGHESTMODSEQ; `enable`). From then on every FETCH response
the server sends on its own or for STORE carries the UID and the MODSEQ (`flags_fetch`,
`store_responses`). ENABLE QRESYNC also makes expunges `VANISHED uid-set` instead of EXPUNGE
(`tell_expunged`), lets SELECT/EXAMINE resynchronise (`resync`) and UID FETCH report VANISHED
(EARLIER) (`vanished_earlier`), and tells the client each new HIGHESTMODSEQ its view reaches
(`tell_highest`).

Where the MODSEQs come from: the session's view (`view.MailboxView`) keeps each message's MODSEQ
from the listings and the HIGHESTMODSEQ everything in it is up to (`view.highest`); a message
this session numbered or changed has a MODSEQ the listing could not have, and `learn` asks the
store for it (`Store.get_summaries` of those messages, one call), taking the store's flags with
it only where the client is told them in the same response. A MODSEQ still not known
is answered low (`MailboxView.modseq`): a low value at worst makes a client ask again or a
conditional STORE fail; a high one could let a conflicting change through. Expunges since a
client's MODSEQ come from `Store.vanished_since`; when the store no longer remembers that far
back, from the UIDs the client says it knows (RFC 7162 3.2.5.2).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap import wire
from cassmail.imap.view import MailboxView

if TYPE_CHECKING:
    from cassmail.imap.session import Session

def enable(session: Session, qresync: bool = False) -> None:
    """A CONDSTORE enabling command ran (ENABLE QRESYNC with `qresync`). The first one with a
    mailbox selected tells its HIGHESTMODSEQ (RFC 7162 3.1), since the client may not have
    taken it from SELECT."""
    first = not session.condstore
    session.condstore = True
    session.qresync = session.qresync or qresync
    view = session.view
    if view is not None:
        view.condstore = True
        if first:
            session.untagged(b"OK [HIGHESTMODSEQ %d] Highest" % max(view.highest, 1))
            view.told = max(view.told, view.highest)


def uses_modseq(key: c.SearchKey) -> bool:
    """Whether a search program has the MODSEQ key (a CONDSTORE enabling SEARCH)."""
    if isinstance(key, c.And):
        return any(uses_modseq(k) for k in key.keys)
    if isinstance(key, c.Or):
        return uses_modseq(key.left) or uses_modseq(key.right)
    if isinstance(key, c.Not):
        return uses_modseq(key.key)
    return key.name == "MODSEQ"


# --------------------------------------------------------------------------- MODSEQs from the store


async def learn(session: Session, uids: Iterable[int], flags: bool = False) -> None:
    """The store's MODSEQ of each of `uids` (after its own STORE, or a numbering the listing could
    not show), in one `get_summaries` call. The message's flags come with it when `flags` (the
    caller shows them in the same response); otherwise a MODSEQ whose flags differ from the
    view's is left for the next refresh, since a client must never hold a MODSEQ newer than the
    flags it was told."""
    view = session.selected()
    wanted = [u for u in dict.fromkeys(uids) if u in view.messages]
    if not wanted:
        return
    found = await session.store.get_summaries(view.user, view.name, [view.messages[u].id for u in wanted])
    for uid in wanted:
        old = view.messages[uid]
        summary = found.get(old.id)
        if summary is None or summary.uid != uid or summary.modseq is None:
            continue  # expunged or renumbered meanwhile: the next refresh tells
        if old.modseq is not None and summary.modseq < old.modseq:
            continue  # an older state than the view's
        if flags or summary.flags == old.flags:
            view.messages[uid] = summary


async def fill(session: Session, uids: Iterable[int]) -> None:
    """Learn the MODSEQs the view lacks among `uids` (messages it numbered itself) before they
    are shown or compared; no store call when none is missing."""
    view = session.selected()
    await learn(session, [u for u in uids if u in view.messages and view.messages[u].modseq is None])


# --------------------------------------------------------------------------- responses


def flags_fetch(session: Session, uid: int) -> bytes:
    """The untagged FETCH telling a flag change made elsewhere (with CONDSTORE, its MODSEQ too)."""
    view = session.selected()
    line = b"%d FETCH (FLAGS %s UID %d" % (view.seq(uid), view.flag_list(uid), uid)
    if session.condstore:
        line += b" MODSEQ (%d)" % view.modseq(uid)
    return line + b")"


def tell_expunged(session: Session, seqs: list[int], uids: list[int]) -> None:
    """Messages gone from the view: EXPUNGE of each sequence number (descending), or with
    QRESYNC one `VANISHED uid-set` (RFC 7162 3.2.10)."""
    if session.qresync:
        if uids:
            session.untagged(b"VANISHED " + wire.compact_set(sorted(uids)).encode())
        return
    for seq in seqs:
        session.untagged(b"%d EXPUNGE" % seq)


def tell_highest(session: Session) -> None:
    """With QRESYNC, the view's new HIGHESTMODSEQ once a refresh raised it (the client keeps it
    for its next SELECT ... (QRESYNC ...))."""
    view = session.view
    if session.qresync and view is not None and view.highest > view.told:
        session.untagged(b"OK [HIGHESTMODSEQ %d] Highest" % view.highest)
        view.told = view.highest


async def store_responses(session: Session, uids: list[int], expected: dict[int, frozenset[str]], silent: bool) -> None:
    """The FETCH responses of a STORE once CONDSTORE is on (RFC 7162 3.1.3): one for every message
    the STORE was applied to, with its UID and new MODSEQ, even with .SILENT; FLAGS when not
    silent, or when the store's flags are not the ones the client expects (another session
    changed them too)."""
    view = session.selected()
    await learn(session, uids, flags=True)
    shown = [u for u in uids if not silent or view.messages[u].flags != expected.get(u)]
    session.announce_flags(shown)
    shown_set = set(shown)
    for uid in uids:
        line = b"%d FETCH (UID %d MODSEQ (%d)" % (view.seq(uid), uid, view.modseq(uid))
        if uid in shown_set:
            line += b" FLAGS " + view.flag_list(uid)
        session.untagged(line + b")")


def modseq_of(view: MailboxView, uids: list[int]) -> int | None:
    """What SEARCH and SORT append as `(MODSEQ n)`: the highest MODSEQ of the messages they
    return; None when they return none."""
    return max((view.modseq(u) for u in uids), default=None)


# --------------------------------------------------------------------------- QRESYNC


async def resync(session: Session, params: c.QResync) -> None:
    """SELECT/EXAMINE (QRESYNC ...) (RFC 7162 3.2.5), after the usual SELECT responses: VANISHED
    (EARLIER) of what the client knew and was expunged since its MODSEQ, then a FETCH (UID FLAGS
    MODSEQ) of every message changed since. Another UIDVALIDITY means the client's cache is of
    another mailbox: nothing more is said (the client sees the new UIDVALIDITY)."""
    view = session.selected()
    if params.uidvalidity != view.uidvalidity:
        return
    known = _merge([(lo, hi) for lo, hi in params.known_uids]) if params.known_uids else None  # type: ignore[misc]
    vanished = await session.store.vanished_since(view.user, view.name, params.modseq)
    if vanished is not None:
        gone = _ranges([u for u in vanished if u not in view.messages and (known is None or _within(known, u))])
    else:  # the store forgot some: every UID the client knows that the view lacks
        gone = _missing(known or [(1, wire.MAX_NUMBER)], view.uids, _matched(view, params.seq_match), view.uid_next)
    if gone:
        session.untagged(b"VANISHED (EARLIER) " + _format(gone))
    # One pass over the view for what is newer or not known (a large mailbox makes it the cost).
    modseq, messages = params.modseq, view.messages
    newer, unknown = [], []
    for uid, summary in messages.items():
        if summary.modseq is None:
            unknown.append(uid)
        elif summary.modseq > modseq:
            newer.append(uid)
    if unknown:
        await learn(session, unknown)
        newer += [u for u in unknown if u in messages and view.changed_since(u, modseq)]
    changed = [u for u in sorted(newer) if known is None or _within(known, u)]
    session.announce_flags(changed)
    for uid in changed:
        session.untagged(b"%d FETCH (UID %d FLAGS %s MODSEQ (%d))" % (
            view.seq(uid), uid, view.flag_list(uid), view.modseq(uid)))


async def vanished_earlier(session: Session, messages: c.SequenceSet, modseq: int) -> None:
    """`UID FETCH set (CHANGEDSINCE n VANISHED)` (RFC 7162 3.2.6): VANISHED (EARLIER) of the UIDs
    of `set` expunged after `n` that the view does not show, before the FETCH responses. `*`
    stands for the last UID handed out (an expunged UID above every one left is still news);
    when the store no longer remembers back to `n`, every UID of the set the view lacks."""
    view = session.selected()
    requested = _merge(wire.resolve_set(list(messages), max(view.largest(True), view.uid_next - 1)))
    vanished = await session.store.vanished_since(view.user, view.name, modseq)
    if vanished is not None:
        gone = _ranges([u for u in vanished if u not in view.messages and _within(requested, u)])
    else:
        gone = _missing(requested, view.uids, 0, view.uid_next)
    if gone:
        session.untagged(b"VANISHED (EARLIER) " + _format(gone))


def _matched(view: MailboxView, pairs: tuple[tuple[int, int], ...] | None) -> int:
    """The highest UID below which nothing the client knew was expunged, by its sequence match
    data (RFC 7162 3.2.5.2): each (sequence number, UID) pair, in order, that the view still has
    at that number says no message below that UID went (it would have moved the UID down); the
    first pair that does not match ends the search."""
    bound = 0
    for seq, uid in sorted(pairs or ()):
        if seq > len(view.uids) or view.uids[seq - 1] != uid:
            break
        bound = uid
    return bound


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges sorted, overlapping and adjoining ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted((min(a, b), max(a, b)) for a, b in ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _within(ranges: list[tuple[int, int]], number: int) -> bool:
    index = bisect.bisect_right(ranges, (number, wire.MAX_NUMBER + 1)) - 1
    return index >= 0 and ranges[index][0] <= number <= ranges[index][1]


def _missing(ranges: list[tuple[int, int]], present: list[int], above: int, below: int) -> list[tuple[int, int]]:
    """The numbers of the (merged) ranges above `above` and below `below` that are not in
    `present` (ascending), as ranges: walked once, never expanded (1:4294967295 is cheap)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        lo, hi = max(lo, above + 1), min(hi, below - 1)
        if lo > hi:
            continue
        at = lo
        for uid in present[bisect.bisect_left(present, lo) : bisect.bisect_right(present, hi)]:
            if uid > at:
                out.append((at, uid - 1))
            at = uid + 1
        if at <= hi:
            out.append((at, hi))
    return out


def _ranges(numbers: list[int]) -> list[tuple[int, int]]:
    return _merge((n, n) for n in numbers)


def _format(ranges: list[tuple[int, int]]) -> bytes:
    return ",".join(f"{lo}:{hi}" if hi > lo else str(lo) for lo, hi in ranges).encode()
