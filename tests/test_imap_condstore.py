"""CONDSTORE and QRESYNC (RFC 7162) over real sockets, every store: MODSEQs in SELECT, STATUS,
FETCH, SEARCH and unsolicited FETCH responses, conditional STORE between two sessions, VANISHED
instead of EXPUNGE, a session that comes back and resynchronises with SELECT (QRESYNC ...) after
another one changed and expunged mail (also over a store that forgot its expunges, and with
imapclient as the client library)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from cassmail.store.base import Store, Target
from tests.test_imap import Raw, logged_in, message, plain_node  # noqa: F401 - plain_node is a fixture
from tests.test_imap_faults import faulty_listener, new_user

pytestmark = pytest.mark.cassandra


async def numbered(store: Store, user: str, count: int, mailbox: str = "INBOX") -> list[uuid.UUID]:
    """`count` messages delivered and given UIDs 1..count (and MODSEQs) before any session looks,
    \\Recent for none of them (so FLAGS answers are the same in every session)."""
    ids = [(await store.deliver(message(i), [Target(user, mailbox)]))[0] for i in range(1, count + 1)]
    await store.assign_uids(user, mailbox, ids)
    await store.claim_recent(user, mailbox, count + 1)
    return ids


def ok(raw: Raw, lines: list[bytes]) -> list[bytes]:
    assert lines[-1].startswith(b"t%d OK" % raw.n), lines
    return lines


def highest(lines: list[bytes]) -> int:
    [value] = [int(m.group(1)) for line in lines if (m := re.match(rb"\* OK \[HIGHESTMODSEQ (\d+)\]", line))]
    return value


def fetched(lines: list[bytes]) -> dict[int, bytes]:
    """Sequence number -> the inside of its FETCH response, for each untagged FETCH."""
    return {int(m.group(1)): m.group(2) for line in lines if (m := re.match(rb"\* (\d+) FETCH \((.*)\)\r\n", line))}


def modseqs(lines: list[bytes]) -> dict[int, int]:
    """UID -> MODSEQ of each FETCH response that has both."""
    out = {}
    for inside in fetched(lines).values():
        uid, modseq = re.search(rb"UID (\d+)", inside), re.search(rb"MODSEQ \((\d+)\)", inside)
        if uid and modseq:
            out[int(uid.group(1))] = int(modseq.group(1))
    return out


def untagged(lines: list[bytes]) -> list[bytes]:
    """The untagged lines but FETCH, FLAGS and the usual ones of a SELECT."""
    return [line for line in lines if line.startswith(b"* ") and not re.match(
        rb"\* (\d+ (FETCH|EXISTS|RECENT)|FLAGS|OK \[(PERMANENTFLAGS|UIDVALIDITY|UIDNEXT|UNSEEN) )", line)]


def uidvalidity(lines: list[bytes]) -> int:
    return int(re.search(rb"\[UIDVALIDITY (\d+)\]", b"".join(lines)).group(1))


# ----------------------------------------------------------------------------- CONDSTORE


async def test_select_status_list_and_enable_tell_the_highestmodseq(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["anne"]
    await numbered(store, user, 3)
    raw = logged_in(plain_node, user, "anne")
    caps = raw.cmd("CAPABILITY")[0]
    assert b" CONDSTORE" in caps and b" QRESYNC" in caps
    assert ok(raw, raw.cmd("ENABLE CONDSTORE X-NOTHING"))[0] == b"* ENABLED CONDSTORE\r\n"  # nothing selected: no code
    first = highest(ok(raw, raw.cmd("SELECT INBOX")))
    assert first == await store.highest_modseq(user, "INBOX") > 1
    assert ok(raw, raw.cmd("ENABLE QRESYNC"))[0] == b"* ENABLED QRESYNC\r\n"  # CONDSTORE was on: no new code
    raw.cmd("STORE 1 +FLAGS.SILENT (\\Seen)")
    second = await store.highest_modseq(user, "INBOX")
    assert second > first
    assert ok(raw, raw.cmd("STATUS Drafts (HIGHESTMODSEQ MESSAGES)"))[0] == b"* STATUS Drafts (HIGHESTMODSEQ 1 MESSAGES 0)\r\n"
    assert raw.cmd("STATUS INBOX (HIGHESTMODSEQ)")[0] == b"* STATUS INBOX (HIGHESTMODSEQ %d)\r\n" % second
    listed = ok(raw, raw.cmd('LIST "" "INBOX" RETURN (STATUS (UIDNEXT HIGHESTMODSEQ))'))
    assert listed[1] == b"* STATUS INBOX (UIDNEXT 4 HIGHESTMODSEQ %d)\r\n" % second

    # Every SELECT says it; the first CONDSTORE enabling command with a mailbox selected says it.
    plain = logged_in(plain_node, user, "anne")
    assert highest(ok(plain, plain.cmd("EXAMINE INBOX"))) == second
    assert ok(plain, plain.cmd("FETCH 1 (FLAGS)"))[0] == b"* 1 FETCH (FLAGS (\\Seen))\r\n"  # not enabled: no MODSEQ
    out = ok(plain, plain.cmd("ENABLE CONDSTORE"))
    assert out[:2] == [b"* OK [HIGHESTMODSEQ %d] Highest\r\n" % second, b"* ENABLED CONDSTORE\r\n"]
    assert untagged(ok(plain, plain.cmd("STATUS INBOX (HIGHESTMODSEQ)"))) == [
        b"* STATUS INBOX (HIGHESTMODSEQ %d)\r\n" % second]
    # SELECT (CONDSTORE) enables it: a STORE's answer carries the UID and the new MODSEQ
    other = logged_in(plain_node, user, "anne")
    assert highest(ok(other, other.cmd("SELECT INBOX (CONDSTORE)"))) == second
    out = ok(other, other.cmd("STORE 2 +FLAGS (\\Flagged)"))
    assert out[0] == b"* 2 FETCH (UID 2 MODSEQ (%d) FLAGS (\\Flagged))\r\n" % await store.highest_modseq(user, "INBOX")


async def test_fetch_modseq_changedsince_and_unsolicited_flag_changes(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["bob"]
    await numbered(store, user, 4, "Archive")
    raw = logged_in(plain_node, user, "bob", "Archive")
    plain = logged_in(plain_node, user, "bob", "Archive")  # never enables CONDSTORE
    out = ok(raw, raw.cmd("FETCH 1:4 (UID MODSEQ)"))
    start = highest(out)  # FETCH MODSEQ enabled CONDSTORE: the HIGHESTMODSEQ comes first
    first = modseqs(out)
    assert out[0] == b"* OK [HIGHESTMODSEQ %d] Highest\r\n" % start
    assert list(first) == [1, 2, 3, 4] and max(first.values()) == start and min(first.values()) > 1
    assert fetched(out)[1] == b"UID 1 MODSEQ (%d)" % first[1]

    out = ok(raw, raw.cmd("STORE 2 +FLAGS (\\Seen)"))
    stored = modseqs(out)[2]
    assert out[0] == b"* 2 FETCH (UID 2 MODSEQ (%d) FLAGS (\\Seen))\r\n" % stored and stored > start
    out = ok(raw, raw.cmd(f"FETCH 1:* (FLAGS) (CHANGEDSINCE {start})"))
    assert fetched(out) == {2: b"FLAGS (\\Seen) MODSEQ (%d)" % stored}
    out = ok(raw, raw.cmd(f"UID FETCH 1:* (FLAGS) (CHANGEDSINCE {start})"))
    assert fetched(out) == {2: b"FLAGS (\\Seen) UID 2 MODSEQ (%d)" % stored}
    # a FETCH that sets \Seen tells it with the UID and the new MODSEQ
    out = ok(raw, raw.cmd("FETCH 3 (BODY[TEXT])"))
    told = re.search(rb"\* 3 FETCH \(BODY\[TEXT\] \{11\}\r\nbody of 3\r\n FLAGS \(\\Seen\) UID 3 MODSEQ \((\d+)\)\)\r\n",
                     b"".join(out))
    assert told, out
    seen = int(told.group(1))
    assert seen > stored
    assert fetched(ok(raw, raw.cmd(f"FETCH 1:4 (FLAGS) (CHANGEDSINCE {seen})"))) == {}

    # another session's change is told with its MODSEQ here, as before (without it) to the other session
    other = logged_in(plain_node, user, "bob", "Archive")
    other.cmd("STORE 4 +FLAGS.SILENT (\\Flagged $Work)")
    now = await store.highest_modseq(user, "Archive")
    assert b"* 4 FETCH (FLAGS ($Work \\Flagged) UID 4 MODSEQ (%d))\r\n" % now in ok(raw, raw.cmd("NOOP"))
    assert b"* 4 FETCH (FLAGS ($Work \\Flagged) UID 4)\r\n" in ok(plain, plain.cmd("NOOP"))
    assert ok(raw, raw.cmd("FETCH 4 (MODSEQ)"))[0] == b"* 4 FETCH (MODSEQ (%d))\r\n" % now


async def test_a_sessions_own_changes_are_not_read_back_and_anothers_are(plain_node, store: Store, users) -> None:  # noqa: F811
    """A session's STORE, APPEND and EXPUNGE are in its view as it makes them. Where the store
    tells the MODSEQ each one took (Cassandra), the next NOOP reads none of them back
    (Store.changes_since is not asked), yet the view is the store's: every flag and MODSEQ,
    and the HIGHESTMODSEQ told. Another session's change in between is read and told."""
    from tests.test_metrics import scrape, value

    user = users["carol"]
    await store.create_mailbox(user, "Own")
    await numbered(store, user, 4, "Own")
    raw = logged_in(plain_node, user, "carol")
    ok(raw, raw.cmd("ENABLE QRESYNC"))
    ok(raw, raw.cmd("SELECT Own"))
    tells = store.arrivals_mark(()) is not None and type(store).__name__ == "CassandraStore"

    def reads() -> float:
        return value(scrape(plain_node), "cassmail_store_seconds_count", op="changes_since") or 0

    async def in_step(noop: list[bytes]) -> None:
        """The session's view is the store's: flags and MODSEQs, and the HIGHESTMODSEQ its NOOP told."""
        told = highest(noop) if any(b"HIGHESTMODSEQ" in x for x in noop) else None
        out = ok(raw, raw.cmd("UID FETCH 1:* (FLAGS MODSEQ)"))
        listed = {s.uid: s async for s in store.list_messages(user, "Own")}
        assert modseqs(out) == {uid: s.modseq for uid, s in listed.items()}, (out, listed)
        flags = {int(re.search(rb"UID (\d+)", x).group(1)): set(re.search(rb"FLAGS \(([^)]*)\)", x).group(1).split())
                 for x in fetched(out).values()}
        assert flags == {uid: {f.encode() for f in s.flags} | ({b"\\Recent"} if b"\\Recent" in flags[uid] else set())
                         for uid, s in listed.items()}
        assert told is None or told == max(s.modseq for s in listed.values())

    before = reads()
    ok(raw, raw.cmd("UID STORE 1 +FLAGS (\\Flagged $Own)"))
    ok(raw, raw.cmd("UID STORE 2,3 +FLAGS.SILENT (\\Seen)"))
    await in_step(ok(raw, raw.cmd("NOOP")))
    body = message(9)
    appended = ok(raw, raw.cmd(b"APPEND Own {%d+}\r\n" % len(body) + body))
    assert b"* 5 EXISTS\r\n" in appended
    ok(raw, raw.cmd("UID STORE 2,5 +FLAGS.SILENT (\\Deleted)"))
    expunged = ok(raw, raw.cmd("UID EXPUNGE 2,5"))
    assert b"* VANISHED 2,5\r\n" in expunged
    await in_step(ok(raw, raw.cmd("NOOP")))
    if tells:
        assert reads() == before  # nothing but its own changes: none read back

    other = logged_in(plain_node, user, "carol", "Own")
    ok(other, other.cmd("UID STORE 4 +FLAGS.SILENT (\\Answered)"))
    ok(raw, raw.cmd("UID STORE 1 -FLAGS.SILENT ($Own)"))  # its own change, after the other's
    now = await store.highest_modseq(user, "Own")
    out = ok(raw, raw.cmd("NOOP"))
    assert b"* 3 FETCH (FLAGS (\\Answered) UID 4 MODSEQ (%d))\r\n" % (now - 1) in out, out
    assert highest(out) == now
    await in_step(out)
    if tells:
        assert reads() > before  # the other session's change was read


async def test_idle_tells_flag_changes_with_their_modseq(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["carol"]
    await numbered(store, user, 2, "Junk")
    raw = logged_in(plain_node, user, "carol")
    raw.cmd("SELECT Junk (CONDSTORE)")
    other = logged_in(plain_node, user, "carol", "Junk")
    raw.n += 1
    raw.send(b"t%d IDLE\r\n" % raw.n)
    assert raw.file.readline().startswith(b"+ ")
    other.cmd("STORE 2 +FLAGS.SILENT (\\Seen)")
    now = await store.highest_modseq(user, "Junk")
    assert raw.file.readline() == b"* 2 FETCH (FLAGS (\\Seen) UID 2 MODSEQ (%d))\r\n" % now
    raw.send(b"DONE\r\n")
    assert raw.until(b"t%d" % raw.n)[-1] == b"t%d OK IDLE terminated\r\n" % raw.n


async def test_conditional_store_between_two_sessions(plain_node, store: Store, users) -> None:  # noqa: F811
    """Two sessions read MODSEQs, one changes a message first: the other's STORE (UNCHANGEDSINCE)
    leaves that message alone and names it in [MODIFIED], by sequence number or by UID."""
    user = users["carol"]
    await numbered(store, user, 4)
    alice, bob = (logged_in(plain_node, user, "carol", "INBOX") for _ in range(2))
    mine = modseqs(ok(alice, alice.cmd("FETCH 1:4 (UID MODSEQ)")))
    theirs = modseqs(ok(bob, bob.cmd("FETCH 1:4 (UID MODSEQ)")))
    assert mine == theirs
    out = ok(bob, bob.cmd(f"STORE 2 (UNCHANGEDSINCE {theirs[2]}) +FLAGS ($Bob)"))
    assert out[-1] == b"t%d OK STORE completed\r\n" % bob.n and b"* 2 FETCH (UID 2 MODSEQ (" in b"".join(out)
    out = ok(alice, alice.cmd(f"STORE 1:3 (UNCHANGEDSINCE {max(mine.values())}) +FLAGS (\\Seen)"))
    assert out[-1] == b"t%d OK [MODIFIED 2] STORE completed\r\n" % alice.n
    assert fetched(out).keys() == {1, 3} and all(b"FLAGS (\\Seen)" in v for v in fetched(out).values())
    flags = {s.uid: s.flags async for s in store.list_messages(user, "INBOX")}
    assert flags[2] == {"$Bob"} and flags[1] == flags[3] == {"\\Seen"} and flags[4] == set()
    # UID STORE names UIDs; .SILENT still answers each message it changed, with its MODSEQ only
    out = ok(alice, alice.cmd(f"UID STORE 2:4 (UNCHANGEDSINCE {mine[4]}) +FLAGS.SILENT (\\Answered)"))
    assert out[-1] == b"t%d OK [MODIFIED 2:3] UID STORE completed\r\n" % alice.n
    assert fetched(out) == {4: b"UID 4 MODSEQ (%d)" % await store.highest_modseq(user, "INBOX")}
    # UNCHANGEDSINCE 0 fails for every message (RFC 7162 3.1.3); in EXAMINE it is NO [READ-ONLY]
    assert ok(alice, alice.cmd("STORE 1:* (UNCHANGEDSINCE 0) +FLAGS (\\Draft)"))[-1] == \
        b"t%d OK [MODIFIED 1:4] STORE completed\r\n" % alice.n
    reader = logged_in(plain_node, user, "carol")
    reader.cmd("EXAMINE INBOX")
    assert reader.cmd("STORE 1 (UNCHANGEDSINCE 99) +FLAGS (\\Seen)")[-1].startswith(b"t%d NO [READ-ONLY]" % reader.n)
    # bob hears of alice's changes with their MODSEQs, and his conditional STORE goes by them
    told = modseqs(ok(bob, bob.cmd("NOOP")))
    assert sorted(told) == [1, 3, 4]
    assert ok(bob, bob.cmd(f"STORE 4 (UNCHANGEDSINCE {theirs[4]}) -FLAGS (\\Answered)"))[-1] == \
        b"t%d OK [MODIFIED 4] STORE completed\r\n" % bob.n
    assert ok(bob, bob.cmd(f"STORE 4 (UNCHANGEDSINCE {told[4]}) -FLAGS (\\Answered)"))[-1] == \
        b"t%d OK STORE completed\r\n" % bob.n


async def test_search_modseq_with_and_without_entry_names(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["anne"]
    await numbered(store, user, 5, "Sent")
    raw = logged_in(plain_node, user, "anne")
    start = highest(ok(raw, raw.cmd("SELECT Sent")))
    raw.cmd("STORE 2,4 +FLAGS.SILENT (\\Flagged)")
    raw.cmd("STORE 5 +FLAGS.SILENT (\\Seen)")
    last = await store.highest_modseq(user, "Sent")
    out = ok(raw, raw.cmd(f"SEARCH MODSEQ {start + 1}"))  # enables CONDSTORE: its HIGHESTMODSEQ first
    assert out[:2] == [b"* OK [HIGHESTMODSEQ %d] Highest\r\n" % start, b"* SEARCH 2 4 5 (MODSEQ %d)\r\n" % last]
    out = ok(raw, raw.cmd(f'UID SEARCH FLAGGED MODSEQ "/flags/\\\\Flagged" all {start}'))
    flagged = modseqs(raw.cmd("FETCH 2,4 (UID MODSEQ)"))
    assert out[0] == b"* SEARCH 2 4 (MODSEQ %d)\r\n" % max(flagged.values())
    assert ok(raw, raw.cmd(f'SEARCH MODSEQ "/flags/$x" priv {last + 1}'))[0] == b"* SEARCH\r\n"
    assert ok(raw, raw.cmd("SEARCH NOT MODSEQ 1"))[0] == b"* SEARCH\r\n"
    tag = b"t%d" % (raw.n + 1)
    assert raw.cmd(f"SEARCH RETURN (COUNT) MODSEQ {start + 1}")[0] == \
        b'* ESEARCH (TAG "%s") COUNT 3 MODSEQ %d\r\n' % (tag, last)
    tag = b"t%d" % (raw.n + 1)
    assert raw.cmd(f"SEARCH RETURN (MIN) MODSEQ {start + 1}")[0] == \
        b'* ESEARCH (TAG "%s") MIN 2 MODSEQ %d\r\n' % (tag, flagged[2])
    assert ok(raw, raw.cmd(f"SORT (REVERSE ARRIVAL) UTF-8 MODSEQ {start + 1}"))[0] == \
        b"* SORT 5 4 2 (MODSEQ %d)\r\n" % last
    for bad in ("SEARCH MODSEQ", "SEARCH MODSEQ -1", 'SEARCH MODSEQ "/flags/x" mine 5', 'SEARCH MODSEQ "flags" all 5'):
        assert raw.cmd(bad)[-1].startswith(b"t%d BAD Syntax error: " % raw.n), bad


async def test_malformed_modifiers_are_bad_and_vanished_needs_qresync(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["bob"]
    await numbered(store, user, 2)
    raw = logged_in(plain_node, user, "bob", "INBOX")
    for bad in ("FETCH 1 (FLAGS) (CHANGEDSINCE 0)", "FETCH 1 (FLAGS) (CHANGEDSINCE 5 VANISHED)",
                "UID FETCH 1 (FLAGS) (VANISHED)", "FETCH 1 FLAGS (CHANGEDSINCE x)", "FETCH 1 FLAGS (CHANGEDSINCE 1",
                "STORE 1 (UNCHANGEDSINCE) +FLAGS x", "STORE 1 (UNCHANGEDSINCE 99999999999999999999) +FLAGS x",
                "STORE 1 (UNCHANGED 1) +FLAGS x", "STATUS INBOX (HIGHESTMODSEQ BOGUS)"):
        answer = raw.cmd(bad)[-1]
        assert answer.startswith(b"t%d BAD Syntax error: " % raw.n), (bad, answer)
    # well-formed, but QRESYNC was not enabled (RFC 7162 3.2.5, 3.2.6)
    assert raw.cmd("UID FETCH 1:* (FLAGS) (CHANGEDSINCE 1 VANISHED)")[-1] == \
        b"t%d BAD VANISHED needs ENABLE QRESYNC first\r\n" % raw.n
    assert raw.cmd("NOOP")[-1] == b"t%d OK NOOP completed\r\n" % raw.n  # still selected
    assert raw.cmd("SELECT INBOX (QRESYNC (1 1))")[-1] == b"t%d BAD SELECT (QRESYNC ...) needs ENABLE QRESYNC first\r\n" % raw.n
    for bad in ("SELECT INBOX (QRESYNC (1 2 3:*))", "SELECT INBOX (CONDSTORE CONDSTORE)", "EXAMINE INBOX (FOO)",
                "SELECT INBOX (QRESYNC (1 2 1:5 (1:3 4)))", "SELECT INBOX (QRESYNC (0 2))"):
        answer = raw.cmd(bad)[-1]
        assert answer.startswith(b"t%d BAD Syntax error: " % raw.n), (bad, answer)


# ----------------------------------------------------------------------------- QRESYNC


async def test_a_session_resynchronises_after_another_changed_and_expunged(plain_node, store: Store, users) -> None:  # noqa: F811
    """The client syncs and leaves; another session flags, expunges and adds mail; the client
    comes back with SELECT (QRESYNC (uidvalidity modseq ...)) and is told exactly what changed."""
    user = users["carol"]
    await numbered(store, user, 6, "Archive")
    client = logged_in(plain_node, user, "carol")
    client.cmd("ENABLE QRESYNC")
    out = ok(client, client.cmd("SELECT Archive"))
    validity, synced = uidvalidity(out), highest(out)
    client.cmd("LOGOUT")

    other = logged_in(plain_node, user, "carol", "Archive")
    other.cmd("STORE 2 +FLAGS.SILENT (\\Answered)")
    other.cmd("STORE 3,5 +FLAGS.SILENT (\\Deleted)")
    assert ok(other, other.cmd("EXPUNGE"))[:2] == [b"* 5 EXPUNGE\r\n", b"* 3 EXPUNGE\r\n"]
    await store.deliver(message(7), [Target(user, "Archive")])
    assert b"* 5 EXISTS\r\n" in ok(other, other.cmd("NOOP"))  # numbered it: UID 7
    now = await store.highest_modseq(user, "Archive")
    modseq = {s.uid: s.modseq async for s in store.list_messages(user, "Archive")}

    back = logged_in(plain_node, user, "carol")
    assert ok(back, back.cmd("ENABLE QRESYNC"))[0] == b"* ENABLED QRESYNC\r\n"
    out = ok(back, back.cmd(f"SELECT Archive (QRESYNC ({validity} {synced}))"))
    assert highest(out) == now
    assert untagged(out) == [b"* OK [HIGHESTMODSEQ %d] Highest\r\n" % now, b"* VANISHED (EARLIER) 3,5\r\n"]
    assert fetched(out) == {2: b"UID 2 FLAGS (\\Answered) MODSEQ (%d)" % modseq[2],
                            5: b"UID 7 FLAGS () MODSEQ (%d)" % modseq[7]}
    assert out.index(b"* VANISHED (EARLIER) 3,5\r\n") < out.index(b"* 2 FETCH (UID 2 FLAGS (\\Answered) MODSEQ (%d))\r\n"
                                                                  % modseq[2])
    # known UIDs narrow both; a mailbox selected before is CLOSED first
    out = ok(back, back.cmd(f"EXAMINE Archive (QRESYNC ({validity} {synced} 1:4))"))
    assert untagged(out)[0] == b"* OK [CLOSED] Previous mailbox closed\r\n"
    assert b"* VANISHED (EARLIER) 3\r\n" in out and fetched(out).keys() == {2}
    # up to date: nothing to tell; another UIDVALIDITY: the rest of the parameters is ignored
    out = ok(back, back.cmd(f"SELECT Archive (QRESYNC ({validity} {now} 1:7 (1:2 1:2)))"))
    assert untagged(out) == [b"* OK [CLOSED] Previous mailbox closed\r\n", b"* OK [HIGHESTMODSEQ %d] Highest\r\n" % now]
    assert not fetched(out)
    out = ok(back, back.cmd(f"SELECT Archive (QRESYNC ({validity + 1} {synced}))"))
    assert len(untagged(out)) == 2 and not fetched(out)

    # UID FETCH (CHANGEDSINCE ... VANISHED): the same from a session that stayed selected
    out = ok(back, back.cmd(f"UID FETCH 1:* (FLAGS) (CHANGEDSINCE {synced} VANISHED)"))
    assert out[0] == b"* VANISHED (EARLIER) 3,5\r\n"
    assert fetched(out) == {2: b"FLAGS (\\Answered) UID 2 MODSEQ (%d)" % modseq[2],
                            5: b"FLAGS () UID 7 MODSEQ (%d)" % modseq[7]}
    out = ok(back, back.cmd(f"UID FETCH 4:6 (FLAGS) (CHANGEDSINCE {synced} VANISHED)"))
    assert out == [b"* VANISHED (EARLIER) 5\r\n", b"t%d OK UID FETCH completed\r\n" % back.n]


async def test_expunges_are_vanished_once_qresync_is_on(plain_node, store: Store, users) -> None:  # noqa: F811
    user = users["anne"]
    await numbered(store, user, 7, "Archive")
    raw = logged_in(plain_node, user, "anne")
    raw.cmd("ENABLE QRESYNC")
    raw.cmd("SELECT Archive")
    other = logged_in(plain_node, user, "anne", "Archive")
    other.cmd("UID STORE 2 +FLAGS.SILENT (\\Deleted)")
    other.cmd("UID EXPUNGE 2")
    # NOOP: another session's expunge, the EXISTS after it, the new HIGHESTMODSEQ
    out = ok(raw, raw.cmd("NOOP"))
    now = await store.highest_modseq(user, "Archive")
    assert b"* VANISHED 2\r\n" in out and b"* 6 EXISTS\r\n" in out and not any(b"EXPUNGE" in line for line in out)
    assert out[-2] == b"* OK [HIGHESTMODSEQ %d] Highest\r\n" % now
    # its own EXPUNGE and UID EXPUNGE: VANISHED, and the HIGHESTMODSEQ after them in the answer
    raw.cmd("UID STORE 1,4 +FLAGS.SILENT (\\Deleted)")
    out = ok(raw, raw.cmd("EXPUNGE"))
    assert out[0] == b"* VANISHED 1,4\r\n"
    assert out[-1] == b"t%d OK [HIGHESTMODSEQ %d] EXPUNGE completed\r\n" % (raw.n, await store.highest_modseq(user, "Archive"))
    raw.cmd("UID STORE 5:6 +FLAGS.SILENT (\\Deleted)")
    out = ok(raw, raw.cmd("UID EXPUNGE 6"))
    assert out[0] == b"* VANISHED 6\r\n" and out[-1].startswith(b"t%d OK [HIGHESTMODSEQ " % raw.n)
    # MOVE: VANISHED after the COPYUID
    out = ok(raw, raw.cmd("UID MOVE 3 Trash"))
    assert out[0].startswith(b"* OK [COPYUID ") and out[1] == b"* VANISHED 3\r\n"
    # IDLE: another session's expunge comes as VANISHED
    raw.n += 1
    raw.send(b"t%d IDLE\r\n" % raw.n)
    assert raw.file.readline().startswith(b"+ ")
    other.cmd("NOOP")
    other.cmd("UID EXPUNGE 5")
    started, lines = time.monotonic(), []
    while b"* VANISHED 5\r\n" not in lines:
        lines.append(raw.file.readline())
        assert time.monotonic() - started < 10, lines
    raw.send(b"DONE\r\n")
    assert raw.until(b"t%d" % raw.n)[-1] == b"t%d OK IDLE terminated\r\n" % raw.n
    assert ok(raw, raw.cmd("UID SEARCH ALL"))[0] == b"* SEARCH 7\r\n"
    # the resync of a client that knew UIDs 1 to 7 at the start
    assert ok(raw, raw.cmd("UID FETCH 1:7 (FLAGS) (CHANGEDSINCE 1 VANISHED)"))[0] == b"* VANISHED (EARLIER) 1:6\r\n"


class Forgetful:
    """The store, but one that no longer remembers expunges (`vanished_since` is None), as after
    `vanished_keep`: QRESYNC falls back on the UIDs the client says it knows."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def vanished_since(self, user: str, mailbox: str, modseq: int) -> None:
        return None


async def cmd(raw: Raw, line: str) -> list[bytes]:
    return await asyncio.to_thread(raw.cmd, line)


async def test_resync_when_the_store_forgot_its_expunges(backend_settings, store: Store) -> None:
    """RFC 7162 3.2.5.2: without the expunge history, VANISHED (EARLIER) names every UID the
    client knows that the mailbox lacks; its sequence match data lets the server leave out the
    UIDs below the last pair that still matches."""
    user = await new_user(store)
    ids = await numbered(store, user, 8)
    await store.delete_messages(user, "INBOX", [ids[1], ids[5]])  # UIDs 2 and 6
    async with faulty_listener(backend_settings, Forgetful(store)) as (_, port):  # type: ignore[arg-type]
        raw = await asyncio.to_thread(Raw, port)
        await asyncio.to_thread(raw.login, user, "anne")
        await cmd(raw, "ENABLE QRESYNC")
        validity = uidvalidity(await cmd(raw, "EXAMINE INBOX"))

        async def vanished(params: str) -> list[bytes]:
            return [line for line in await cmd(raw, f"EXAMINE INBOX (QRESYNC ({validity} 1{params}))")
                    if line.startswith(b"* VANISHED")]

        assert await vanished("") == [b"* VANISHED (EARLIER) 2,6\r\n"]  # known: everything below UIDNEXT
        assert await vanished(" 1:4,7:9") == [b"* VANISHED (EARLIER) 2\r\n"]
        # the client had 1..8 at 1..8: the pair (1, 1) still matches, (3, 3) no longer (UID 3 is at 2)
        assert await vanished(" 1:8 (1,3,8 1,3,8)") == [b"* VANISHED (EARLIER) 2,6\r\n"]
        # (5, 7)... a client that knew of the first expunge had 1,3,4,5,7 at 1..5: all match up to UID 5
        assert await vanished(" 1,3:8 (1:4 3:5,7)") == [b"* VANISHED (EARLIER) 6\r\n"]
        assert await vanished(" 1,3:5 (1:4 1,3:5)") == []
        out = await cmd(raw, "UID FETCH 1:* (FLAGS) (CHANGEDSINCE 1 VANISHED)")
        assert out[0] == b"* VANISHED (EARLIER) 2,6\r\n" and len(fetched(out)) == 6


# ----------------------------------------------------------------------------- a client library


def test_imapclient_resynchronises_with_changedsince_and_vanished(plain_node, users) -> None:  # noqa: F811
    """imapclient (a CONDSTORE/QRESYNC-aware client library) keeps a cache: HIGHESTMODSEQ and UIDs
    from SELECT, then asks for what changed and what vanished since."""
    from imapclient import IMAPClient

    user = users["bob"]
    client = IMAPClient("127.0.0.1", port=plain_node.port("imap"), ssl=False, timeout=30)
    client.login(user, "bob")
    assert client.has_capability("CONDSTORE") and client.has_capability("QRESYNC")
    for i in range(1, 6):
        assert client.append("Drafts", message(i))
    assert client.enable("QRESYNC") == [b"QRESYNC"]
    selected = client.select_folder("Drafts")
    cached_modseq = selected[b"HIGHESTMODSEQ"]
    cache = {uid: data[b"FLAGS"] for uid, data in client.fetch(client.search(), ["FLAGS"]).items()}
    assert sorted(cache) == [1, 2, 3, 4, 5]
    client.logout()

    other = logged_in(plain_node, user, "bob", "Drafts")
    other.cmd("UID STORE 3 +FLAGS.SILENT (\\Flagged)")
    other.cmd("UID STORE 1,4 +FLAGS.SILENT (\\Deleted)")
    other.cmd("EXPUNGE")

    client = IMAPClient("127.0.0.1", port=plain_node.port("imap"), ssl=False, timeout=30)
    client.login(user, "bob")
    client.enable("QRESYNC")
    selected = client.select_folder("Drafts")
    assert selected[b"HIGHESTMODSEQ"] > cached_modseq and selected[b"EXISTS"] == 3
    changed = client.fetch(sorted(cache), ["FLAGS"], modifiers=[f"CHANGEDSINCE {cached_modseq}", "VANISHED"])
    vanished: Sequence[bytes] = client._imap.untagged_responses.pop("VANISHED", [])
    assert list(vanished) == [b"(EARLIER) 1,4"]
    assert {uid: (data[b"FLAGS"], data[b"MODSEQ"][0] > cached_modseq) for uid, data in changed.items()} == \
        {3: ((b"\\Flagged",), True)}
    found = client.search(["MODSEQ", str(cached_modseq + 1)])
    assert found == [3] and found.modseq == changed[3][b"MODSEQ"][0]
    client.logout()
