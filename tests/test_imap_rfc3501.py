"""RFC 3501 behaviour over real sockets, every store: \\Recent in exactly one session, new
keywords announced before they are shown, sections of encapsulated messages, ENVELOPE groups,
SEARCH on addresses with comments, LSUB and LIST-EXTENDED, FETCH of messages another session
expunged (RFC 2180)."""

from __future__ import annotations

import re

import pytest

from cassmail.store.base import Store, Target
from tests.test_imap import Raw, deliver, logged_in, message, plain_node  # noqa: F401 - plain_node is a fixture

pytestmark = pytest.mark.cassandra


_session = logged_in


def _number(lines: list[bytes], pattern: bytes) -> int:
    for line in lines:
        m = re.match(rb"\* (\d+) " + pattern + rb"\r\n", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"no {pattern!r} in {lines}")


#: The store calls that read a mailbox's listing or changes (counted on the store's metrics).
LISTING_READS = ("arrivals", "arrivals_state", "changes_state", "changes_since", "list_page")


def _store_calls(node, *ops: str) -> float:
    """How many times the node's store ran these operations so far."""
    from tests.test_metrics import scrape, value
    metrics = scrape(node)
    return sum(value(metrics, "cassmail_store_seconds_count", op=op) or 0 for op in ops)


def _search(raw: Raw, keys: str) -> list[int]:
    lines = raw.cmd(f"SEARCH {keys}")
    return [int(n) for n in lines[0].split()[2:]]


async def test_recent_belongs_to_one_session_and_copies_are_recent(plain_node, store: Store, users) -> None:
    user = users["anne"]
    await deliver(store, user, [message(1), message(2)], "Archive")
    first = _session(plain_node, user, "anne", "Archive")
    assert _search(first, "RECENT") == [1, 2] and _search(first, "NEW") == [1, 2] and _search(first, "OLD") == []
    second = _session(plain_node, user, "anne")
    assert _number(second.cmd("SELECT Archive"), b"RECENT") == 0  # the first session has them
    assert _search(second, "RECENT") == [] and _search(second, "OLD") == [1, 2]
    # STATUS counts what no session has claimed; a COPY's copies are recent in their mailbox
    source = _session(plain_node, user, "anne", "Archive")
    assert b"RECENT 0" in source.cmd("STATUS Drafts (RECENT MESSAGES)")[0]
    assert b"COPYUID" in source.cmd("COPY 1:2 Drafts")[-1]
    assert source.cmd("STATUS Drafts (RECENT MESSAGES)")[0].endswith(b"(RECENT 2 MESSAGES 2)\r\n")
    drafts = _session(plain_node, user, "anne")
    lines = drafts.cmd("SELECT Drafts")
    assert _number(lines, b"RECENT") == 2 and _number(lines, b"EXISTS") == 2
    assert b"\\Recent" in b"".join(drafts.cmd("FETCH 1 FLAGS"))
    assert source.cmd("STATUS Drafts (RECENT)")[0].endswith(b"(RECENT 0)\r\n")
    # an APPEND and a MOVE into a selected mailbox are recent there, in that session only
    assert b"APPENDUID" in source.cmd(b"APPEND Drafts {%d+}\r\n%s" % (len(message(3)), message(3)))[-1]
    assert source.cmd("MOVE 2 Drafts")[-1].endswith(b"OK MOVE completed\r\n")
    lines = drafts.cmd("NOOP")
    assert _number(lines, b"EXISTS") == 4 and _number(lines, b"RECENT") == 4
    assert _search(drafts, "NEW") == [1, 2, 3, 4]
    other = _session(plain_node, user, "anne")
    assert _number(other.cmd("EXAMINE Drafts"), b"RECENT") == 0


async def test_an_append_to_the_selected_mailbox_is_recent_in_the_appending_session(
    plain_node, store: Store, users
) -> None:
    """The appending session has the mailbox selected: the message is \\Recent there (on
    Cassandra claimed by the numbering's own round: no claim of its own), and in no other. On
    Cassandra the session takes it into its view as the store answered the APPEND, reading
    nothing back, and shows it as every other session does."""
    user = users["carol"]
    await deliver(store, user, [message(1)], "Trash")
    appender = _session(plain_node, user, "carol", "Trash")
    watcher = _session(plain_node, user, "carol", "Trash")
    assert _search(appender, "RECENT") == [1] and _search(watcher, "RECENT") == []
    before, read_before = _store_calls(plain_node, "claim_recent"), _store_calls(plain_node, *LISTING_READS)
    for n in (2, 3):
        lines = appender.cmd(b"APPEND Trash {%d+}\r\n%s" % (len(message(n)), message(n)))
        assert _number(lines, b"EXISTS") == n and _number(lines, b"RECENT") == n, lines
        assert b"APPENDUID" in lines[-1]
    if type(store).__name__ == "CassandraStore":
        assert _store_calls(plain_node, *LISTING_READS) == read_before  # taken in as appended: nothing read back
    assert _search(appender, "RECENT") == [1, 2, 3] and _search(appender, "NEW") == [1, 2, 3]
    assert b"\\Recent" in b"".join(appender.cmd("FETCH 3 FLAGS"))
    if type(store).__name__ == "CassandraStore":
        assert _store_calls(plain_node, "claim_recent") == before  # each claimed in its numbering's round
    else:
        assert _store_calls(plain_node, "claim_recent") >= before + 2
    lines = watcher.cmd("NOOP")
    assert _number(lines, b"EXISTS") == 3 and _search(watcher, "RECENT") == []
    later = _session(plain_node, user, "carol")
    assert _number(later.cmd("SELECT Trash"), b"RECENT") == 0
    # the appender's view of the new messages is what a session listing them anew shows
    seen = "UID FETCH 1:* (FLAGS INTERNALDATE RFC822.SIZE)"
    mine = [line.replace(b"\\Recent", b"").replace(b"( ", b"(").replace(b" )", b")")
            for line in appender.cmd(seen) if line.startswith(b"* ")]
    assert len(mine) == 3 and mine == [line for line in later.cmd(seen) if line.startswith(b"* ")]


async def test_a_uid_expunge_goes_by_the_flags_the_store_holds(plain_node, store: Store, users) -> None:
    """A UID EXPUNGE of a few messages, decided by the store on the flags it holds without the
    session taking in the mailbox first: a \\Deleted another session took away keeps its
    message, one it set goes and is said to go (RFC 4315 3). On Cassandra nothing is listed
    for it."""
    user = users["anne"]
    await deliver(store, user, [message(n) for n in (1, 2, 3, 4)], "Drafts")
    mine = _session(plain_node, user, "anne", "Drafts")
    other = _session(plain_node, user, "anne", "Drafts")
    mine.cmd("UID STORE 1:2 +FLAGS.SILENT (\\Deleted)")
    other.cmd("UID STORE 1 -FLAGS.SILENT (\\Deleted)")
    other.cmd("UID STORE 3 +FLAGS.SILENT (\\Deleted)")
    before = _store_calls(plain_node, *LISTING_READS)
    lines = mine.cmd("UID EXPUNGE 1:3")
    assert lines[-1].endswith(b"OK UID EXPUNGE completed\r\n")
    assert lines[:-1] == [b"* 3 EXPUNGE\r\n", b"* 2 EXPUNGE\r\n"], lines
    if type(store).__name__ == "CassandraStore":
        assert _store_calls(plain_node, *LISTING_READS) == before
    assert mine.cmd("UID EXPUNGE 1")[:-1] == []  # still there, and no longer \\Deleted
    mine.cmd("NOOP")
    listed = [line for line in mine.cmd("UID FETCH 1:* FLAGS") if line.startswith(b"* ")]
    assert len(listed) == 2 and listed[0].endswith(b"UID 1)\r\n") and listed[1].endswith(b"UID 4)\r\n"), listed
    assert b"\\Deleted" not in listed[0]
    assert sum(line.endswith(b" EXPUNGE\r\n") for line in other.cmd("NOOP")) == 2


async def test_a_new_keyword_is_announced_in_flags_before_it_is_shown(plain_node, store: Store, users) -> None:
    user = users["bob"]
    await deliver(store, user, [message(1)], "Junk")
    watcher = _session(plain_node, user, "bob", "Junk")
    setter = _session(plain_node, user, "bob", "Junk")
    lines = setter.cmd("STORE 1 +FLAGS ($Important)")
    flags_at = next(i for i, line in enumerate(lines) if line.startswith(b"* FLAGS "))
    fetch_at = next(i for i, line in enumerate(lines) if b"FETCH" in line)
    assert flags_at < fetch_at and b"$Important" in lines[flags_at]
    assert lines[flags_at + 1].startswith(b"* OK [PERMANENTFLAGS (") and b"$Important" in lines[flags_at + 1]
    lines = watcher.cmd("NOOP")
    assert [line[:9] for line in lines[:3]] == [b"* FLAGS (", b"* OK [PER", b"* 1 FETCH"], lines
    assert b"$Important" in lines[0] and b"$Important" in lines[2]
    assert not [line for line in watcher.cmd("FETCH 1 FLAGS") if line.startswith(b"* FLAGS")]  # once is enough
    later = _session(plain_node, user, "bob")
    assert b"$Important" in next(line for line in later.cmd("SELECT Junk") if line.startswith(b"* FLAGS"))


async def test_sections_of_encapsulated_messages_over_the_wire(plain_node, store: Store, users) -> None:
    user = users["carol"]
    inner = b"From: a@x.test\r\nSubject: inner\r\n\r\nHello world\r\n"
    folded = (b'Subject: folded\r\nContent-Type: multipart/mixed; boundary="=_a\r\n b"\r\n\r\n--=_a b\r\n\r\none\r\n'
              b"--=_a b\r\nContent-Type: message/rfc822\r\n\r\n" + inner + b"--=_a b--\r\n")
    await deliver(store, user, [b"Content-Type: message/rfc822\r\nSubject: outer\r\n\r\n" + inner, folded], "Trash")
    raw = _session(plain_node, user, "carol", "Trash")
    out = b"".join(raw.cmd("FETCH 1 (BODY.PEEK[1] BODY.PEEK[1.HEADER] BODY.PEEK[1.TEXT] BODY.PEEK[1.1])"))
    assert b"BODY[1] {%d}\r\n%s" % (len(inner), inner) in out
    assert b"BODY[1.HEADER] {34}\r\nFrom: a@x.test\r\nSubject: inner\r\n\r\n" in out
    assert b"BODY[1.TEXT] {13}\r\nHello world\r\n" in out and b"BODY[1.1] {13}\r\nHello world\r\n" in out
    structure = b"".join(raw.cmd("FETCH 2 (BODYSTRUCTURE BODY.PEEK[1] BODY.PEEK[2.HEADER])"))
    assert b'"mixed" ("boundary" "=_a\r\n b")' in structure or b'"mixed" ("boundary"' in structure
    assert b"BODY[1] {3}\r\none" in structure and b"BODY[2.HEADER] {34}\r\nFrom: a@x.test" in structure
    assert b'(("text" "plain"' in structure and b'"message" "rfc822"' in structure


async def test_envelope_groups_and_search_on_addresses_with_comments(plain_node, store: Store, users) -> None:
    user = users["anne"]
    await deliver(store, user, [
        b"From: <user-from (comment)@ (comment) domain.org>\r\nTo: Team: Ed <ed@a.test>, joe@b.test;\r\n"
        b"Cc: undisclosed-recipients:;\r\nSubject: groups\r\n\r\nbody\r\n",
        message(2)], "Sent")
    raw = _session(plain_node, user, "anne", "Sent")
    envelope = raw.cmd("FETCH 1 ENVELOPE")[0]
    assert b'((NIL NIL "Team" NIL)("Ed" NIL "ed" "a.test")(NIL NIL "joe" "b.test")(NIL NIL NIL NIL))' in envelope
    assert b'((NIL NIL "undisclosed-recipients" NIL)(NIL NIL NIL NIL))' in envelope
    assert b'((NIL NIL "user-from" "domain.org"))' in envelope
    assert _search(raw, "FROM user-from@domain.org") == [1]
    assert _search(raw, "FROM domain.org") == [1] and _search(raw, "TO joe@b.test") == [1]
    assert _search(raw, "FROM sender2@remote.test") == [2]


def test_lsub_and_list_extended(plain_node, users) -> None:
    raw = _session(plain_node, users["bob"], "bob")
    for command in ("CREATE Work", "CREATE Work/Done", "UNSUBSCRIBE Work", "SUBSCRIBE Work/Done", "CREATE Old", "UNSUBSCRIBE Old"):
        assert raw.cmd(command)[-1].startswith(b"t%d OK" % raw.n), command
    lsub = raw.cmd('LSUB "" "%"')
    assert b'* LSUB (\\Noselect \\HasChildren) "/" Work\r\n' in lsub  # a `%` stopped at it
    assert not [line for line in lsub if b"Old" in line]  # not subscribed: not listed
    assert not [line for line in raw.cmd('LSUB "" "*"') if line.endswith(b" Work\r\n")]
    special = raw.cmd('LIST (SPECIAL-USE) "" "*"')
    names = {line.rsplit(b" ", 1)[1].strip() for line in special[:-1]}
    assert names == {b"Archive", b"Drafts", b"Junk", b"Sent", b"Trash"} and special[-1].endswith(b"OK LIST completed\r\n")
    subscribed = raw.cmd('LIST (SUBSCRIBED RECURSIVEMATCH) "" "%" RETURN (CHILDREN)')
    assert b'* LIST (\\HasChildren) "/" Work ("CHILDINFO" ("SUBSCRIBED"))\r\n' in subscribed
    status = raw.cmd('LIST "" "Junk" RETURN (STATUS (MESSAGES UIDVALIDITY))')
    assert status[0].startswith(b"* LIST (") and re.match(rb"\* STATUS Junk \(MESSAGES \d+ UIDVALIDITY \d+\)\r\n", status[1])


async def test_fetch_of_a_message_another_session_expunged(plain_node, store: Store, users) -> None:
    """RFC 2180 4.1: the messages that are still there are sent; those another session expunged
    get a NO [EXPUNGEISSUED] (or their data), never a store failure."""
    user = users["carol"]
    big = b"Subject: big\r\n\r\n" + b"y" * 300_000 + b"\r\n"
    await deliver(store, user, [message(1), big, message(3)], "Archive")
    reader = _session(plain_node, user, "carol", "Archive")
    expunger = _session(plain_node, user, "carol", "Archive")
    assert expunger.cmd("STORE 2 +FLAGS.SILENT (\\Deleted)")[-1].endswith(b"OK STORE completed\r\n")
    assert b"* 2 EXPUNGE\r\n" in expunger.cmd("EXPUNGE")
    lines = reader.cmd("FETCH 1:3 (UID BODY.PEEK[])")
    assert lines[-1].endswith((b"NO [EXPUNGEISSUED] Some messages were expunged meanwhile\r\n", b"OK FETCH completed\r\n"))
    fetched = b"".join(lines)
    assert b"Subject: message 1" in fetched and b"Subject: message 3" in fetched
    assert b"UNAVAILABLE" not in fetched and b"SERVERBUG" not in fetched
    noop = reader.cmd("NOOP")
    assert b"* 2 EXPUNGE\r\n" in noop and noop[-1].endswith(b"OK NOOP completed\r\n")


async def test_an_expunge_learned_during_an_append_is_still_announced_at_the_next_noop(plain_node, store: Store,
                                                                                     users) -> None:
    """APPEND into the selected mailbox reads the listing without expunging (RFC 3501 7.4.1: no
    EXPUNGE then); the NOOP after it must still tell of a message another session expunged, even on
    a store whose changes token says nothing changed since that listing (mbox). The appender has
    the mailbox read-only, so nothing it writes after that listing (a \\Recent claim) moves the
    token: as when another session claimed first."""
    user = users["bob"]
    await deliver(store, user, [message(1), message(2)], "Drafts")
    appender = _session(plain_node, user, "bob")
    assert b"[READ-ONLY]" in appender.cmd("EXAMINE Drafts")[-1]
    expunger = _session(plain_node, user, "bob", "Drafts")
    assert expunger.cmd("STORE 1 +FLAGS.SILENT (\\Deleted)")[-1].endswith(b"OK STORE completed\r\n")
    assert b"* 1 EXPUNGE\r\n" in expunger.cmd("EXPUNGE")
    appended = appender.cmd(b"APPEND Drafts {%d+}\r\n%s" % (len(message(3)), message(3)))
    assert b"EXPUNGE" not in b"".join(appended) and b"APPENDUID" in appended[-1]
    noop = appender.cmd("NOOP")
    assert b"* 1 EXPUNGE\r\n" in noop and noop[-1].endswith(b"OK NOOP completed\r\n")
    assert appender.cmd("FETCH 1:* (UID)")[-1].endswith(b"OK FETCH completed\r\n")
    assert len([line for line in appender.cmd("FETCH 1:* (UID)") if b"FETCH (UID" in line]) == 2
