"""Commands of the selected state that change or refresh the view: NOOP and CHECK, CLOSE,
UNSELECT, EXPUNGE and UID EXPUNGE, STORE, COPY and MOVE (RFC 6851). FETCH and SEARCH have
modules of their own."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap import condstore, wire
from cassmail.imap.errors import No
from cassmail.inbound.learn import JUNK_FLAGS, NOT_JUNK_FLAGS
from cassmail.logs import kv
from cassmail.model import flag_set
from cassmail.store.base import NoSuchMailbox, NoSuchMessage, StoreUnavailable

if TYPE_CHECKING:
    from cassmail.imap.session import Session

log = logging.getLogger("cassmail.imap")

#: The most messages a UID EXPUNGE names for the store to decide on without the view taking in
#: the mailbox first (see `expunge`).
FEW_TO_EXPUNGE = 100


async def noop(session: Session, args: c.Simple) -> str:
    """NOOP (and CHECK): the moments a client is told what changed meanwhile."""
    if session.view is not None:
        await session.refresh(expunge=True)
    return "NOOP completed"


async def check(session: Session, args: c.Simple) -> str:
    await session.refresh(expunge=True)
    return "CHECK completed"


async def close(session: Session, args: c.Simple) -> str:
    view = session.selected()
    if not view.readonly:
        await view.refresh(expunge=False)
        doomed = [u for u in view.uids if "\\Deleted" in view.messages[u].flags]
        if doomed:
            await session.store.delete_messages(view.user, view.name, [view.messages[u].id for u in doomed],
                                                only_deleted=True)
    session.close_view()
    return "CLOSE completed"


async def unselect(session: Session, args: c.Simple) -> str:
    session.close_view()
    return "UNSELECT completed"


async def expunge(session: Session, args: c.Expunge) -> str:
    """EXPUNGE takes in the mailbox first, and asks the store to delete what the view then holds
    \\Deleted. A UID EXPUNGE of at most FEW_TO_EXPUNGE messages (a client removing what it just
    flagged) does not: it hands the store all of them, which deletes those whose stored flags
    hold \\Deleted (`only_deleted`, decided on the state it deletes from), and the view hears
    of other changes at the next command. Either way a \\Deleted another session took away
    just before keeps the message (RFC 4315 3)."""
    view = session.selected()
    if view.readonly:
        raise No("Mailbox is read-only", "READ-ONLY")
    candidates = session.uids(args.uids, True) if args.uids is not None else None
    if candidates is None or len(candidates) > FEW_TO_EXPUNGE:
        await session.refresh(expunge=True, highest=False)  # with QRESYNC the answer says it
        candidates = session.uids(args.uids, True) if args.uids is not None else list(view.uids)
        candidates = [u for u in candidates if "\\Deleted" in view.messages[u].flags]
    doomed: list[int] = []
    if candidates:
        modseqs: dict[uuid.UUID, int] = {}
        deleted = await session.store.delete_messages(
            view.user, view.name, [view.messages[u].id for u in candidates], modseqs, only_deleted=True)
        doomed = [u for u in candidates if view.messages[u].id in deleted]
        session.expunged(doomed)
        view.took(modseqs)
    done = ("UID " if args.uids is not None else "") + "EXPUNGE completed"
    if session.qresync:
        # RFC 7162 3.2.7: the answer carries the HIGHESTMODSEQ, which must cover these expunges:
        # the view takes in the mailbox again, the store's HIGHESTMODSEQ read first.
        if doomed:
            await session.refresh(expunge=True, highest=False)
        view.told = max(view.told, view.highest)
        return f"[HIGHESTMODSEQ {max(view.highest, 1)}] {done}"
    return done


async def store(session: Session, args: c.Store) -> str:
    view = session.selected()
    if args.unchangedsince is not None:
        condstore.enable(session)  # RFC 7162 3.1: STORE UNCHANGEDSINCE
    if view.readonly:
        raise No("Mailbox is read-only", "READ-ONLY")
    flags = flag_set(f for f in args.flags if f.lower() != "\\recent")
    uids = session.uids(args.messages, args.uid)
    modified: set[uuid.UUID] = set()
    modseqs: dict[uuid.UUID, int] = {}
    if uids:
        modified = await session.store.store_flags(view.user, view.name, [view.messages[u].id for u in uids], flags,
                                                   args.mode, unchanged_since=args.unchangedsince, modseqs=modseqs,
                                                   known=view.known(uids))
    # RFC 7162 3.1.3: what failed UNCHANGEDSINCE is left as it was and named in [MODIFIED ...]
    failed = [u for u in uids if view.messages[u].id in modified]
    uids = [u for u in uids if view.messages[u].id not in modified]
    expected = {}
    for u in uids:
        old = view.messages[u].flags
        new = flags if args.mode == "set" else (old | flags if args.mode == "add" else old - flags)
        view.set_flags(u, frozenset(new))
        expected[u] = frozenset(new)
    view.took(modseqs, flagged={view.messages[u].id: u for u in uids})
    _learn_from_flags(session, uids, flags, args.mode)
    if session.condstore:
        await condstore.store_responses(session, uids, expected, args.silent)
    elif not args.silent:
        session.announce_flags(uids)
        for u in uids:
            session.untagged(b"%d FETCH (FLAGS %s%s)" % (
                view.seq(u), view.flag_list(u), b" UID %d" % u if args.uid else b""))
    code = ""
    if failed:
        code = f"[MODIFIED {wire.compact_set(failed if args.uid else [view.seq(u) for u in failed])}] "
    return code + ("UID " if args.uid else "") + "STORE completed"


async def copy(session: Session, args: c.Copy) -> str:
    """COPY, and MOVE: the copies stored first, then the originals deleted and expunged."""
    view = session.selected()
    if args.move and view.readonly:
        raise No("Mailbox is read-only", "READ-ONLY")
    dest = session.mailbox(args.name)
    uids = session.uids(args.messages, args.uid)
    verb = ("UID " if args.uid else "") + ("MOVE" if args.move else "COPY")
    store = session.store
    try:
        info = await store.mailbox_info(view.user, dest)
    except NoSuchMailbox:
        raise No("No such mailbox", "TRYCREATE") from None
    if not uids:
        return f"{verb} completed"
    ids = [view.messages[u].id for u in uids]
    try:
        new_ids = await store.copy_messages(view.user, view.name, ids, dest)
    except NoSuchMessage:
        raise No("Some messages were expunged meanwhile", "EXPUNGEISSUED") from None
    await _learn_from_copy(session, dest, info.special_use, new_ids)
    # The copies are stored: from here on the answer is OK, with COPYUID when the UIDs of all the
    # copies can be had now. RFC 4315 lets a server leave it out, and its two sets must pair one
    # to one: a copy another session expunged before it was numbered leaves it out too.
    code = ""
    numbered: dict[uuid.UUID, int] = {}
    try:
        new_uids = await store.assign_uids(view.user, dest, new_ids, modseqs=numbered)
        if all(i in new_uids for i in new_ids):
            code = "[COPYUID %d %s %s]" % (
                info.uidvalidity, wire.compact_set(uids), wire.compact_set([new_uids[i] for i in new_ids]))
        else:
            log.info(kv("imap-uids", user=view.user, mailbox=dest, copied=len(new_ids),
                        gone=len(set(new_ids) - set(new_uids))))
    except StoreUnavailable as exc:
        log.warning(kv("imap-uids", user=view.user, mailbox=dest, waiting=len(new_ids), error=exc))
    if args.move:
        moved: dict[uuid.UUID, int] = {}
        await store.delete_messages(view.user, view.name, ids, moved)
        session.untagged(b"OK " + (code + " Moved").strip().encode())
        session.expunged(uids)
        view.took(moved)
        code = ""
    if dest == view.name:
        view.took(numbered, numbered=True)
        await session.refresh(expunge=False)
    return f"{code} {verb} completed".strip()


def _learn_from_flags(session: Session, uids: list[int], flags: frozenset[str], mode: str) -> None:
    """\\Junk or $Junk set: spam; $NotJunk set, or a junk flag taken off: ham (inbound.rspamd_learn)."""
    learner = session.listener.learner
    if learner is None or not uids:
        return
    named = {f.lower() for f in flags}
    if mode != "remove" and named & JUNK_FLAGS:
        spam = True
    elif (mode != "remove" and named & NOT_JUNK_FLAGS) or (mode == "remove" and named & JUNK_FLAGS):
        spam = False
    else:
        return
    view = session.selected()
    learner.judged(session.store, view.user, view.name, [view.messages[u].id for u in uids], spam)


async def _learn_from_copy(session: Session, dest: str, dest_use: str | None, copies: list[uuid.UUID]) -> None:
    """Copied or moved into Junk: spam; out of Junk, not to Trash: ham (inbound.rspamd_learn)."""
    learner = session.listener.learner
    if learner is None or not copies:
        return
    view = session.selected()
    if learner.is_junk(dest, dest_use):
        if not learner.is_junk(view.name, None):
            learner.judged(session.store, view.user, dest, copies, True)
        return
    if dest_use == "\\Trash":
        return
    try:
        source = await session.store.mailbox_info(view.user, view.name)
    except (NoSuchMailbox, StoreUnavailable):
        return
    if learner.is_junk(view.name, source.special_use):
        learner.judged(session.store, view.user, dest, copies, False)
