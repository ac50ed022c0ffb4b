"""The IMAP command parser on its own: framed bytes in, typed commands (or precise errors) out."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cassmail.imap import commands as c
from cassmail.imap import parse
from cassmail.imap.connection import Frame
from cassmail.imap.wire import ParseError


def command(*parts: bytes) -> c.Command:
    tag, name, cursor = parse.parse_tag(Frame(parts))
    assert tag is not None
    return parse.parse_command(tag, name, cursor)


def test_login_takes_atoms_quoted_strings_and_literals() -> None:
    assert command(b'a LOGIN anne@x.test "se cr\\"et"').args == c.Login(b"anne@x.test", b'se cr"et')
    assert command(b"a LOGIN ", b"anne@x.test", b" ", b"p\r\nw", b"").args == c.Login(b"anne@x.test", b"p\r\nw")
    for bad in (b"a LOGIN anne", b'a LOGIN anne "open', b"a LOGIN anne pw extra", b'a LOGIN anne "bad\\x"'):
        with pytest.raises(ParseError):
            command(bad)


def test_append_flags_date_and_the_message_literal() -> None:
    cmd = command(b'a APPEND Sent (\\Seen $Label) "04-Jul-2026 10:02:01 +0000" ', b"Subject: x\r\n\r\nhi", b"")
    assert cmd.args == c.Append(b"Sent", ("\\Seen", "$Label"), datetime(2026, 7, 4, 10, 2, 1, tzinfo=timezone.utc),
                                b"Subject: x\r\n\r\nhi")
    assert command(b"a APPEND ", b"Entw&APw-rfe", b" ", b"m", b"").args.name == b"Entw&APw-rfe"
    for bad in ((b"a APPEND INBOX",), (b"a APPEND INBOX (\\Seen) text",), (b'a APPEND INBOX "31-Feb-2026 00:00:00 +0000" ', b"m", b"")):
        with pytest.raises(ParseError):
            command(*bad)


def test_uid_commands_and_sequence_sets() -> None:
    cmd = command(b"t UID FETCH 1:*,7 (FLAGS BODY.PEEK[HEADER.FIELDS (Subject From)]<0.100>)")
    assert cmd.name == "FETCH" and cmd.args.uid and cmd.args.messages == ((1, None), (7, 7))
    flags, body, uid = cmd.args.atts
    assert flags.name == "FLAGS" and uid.name == "UID"  # UID FETCH always answers the UID
    assert body.response_name() == b"BODY[HEADER.FIELDS (Subject From)]<0>" and body.peek and not body.sets_seen
    assert command(b"t UID EXPUNGE 3:5").args == c.Expunge(((3, 5),))
    with pytest.raises(ParseError, match="UID goes with"):
        command(b"t UID FROB 1")


@pytest.mark.parametrize("atts, names", [
    (b"ALL", [b"FLAGS", b"INTERNALDATE", b"RFC822.SIZE", b"ENVELOPE"]),
    (b"FULL", [b"FLAGS", b"INTERNALDATE", b"RFC822.SIZE", b"ENVELOPE", b"BODY"]),
    (b"BODY[]", [b"BODY[]"]),
    (b"(RFC822 RFC822.TEXT RFC822.HEADER BODYSTRUCTURE BODY)",
     [b"RFC822", b"RFC822.TEXT", b"RFC822.HEADER", b"BODYSTRUCTURE", b"BODY"]),
    (b"(BODY[1.2.MIME] BODY.PEEK[2.HEADER] BODY[3.TEXT]<5.6> BODY[1])",
     [b"BODY[1.2.MIME]", b"BODY[2.HEADER]", b"BODY[3.TEXT]<5>", b"BODY[1]"]),
])
def test_fetch_items_and_macros(atts: bytes, names: list[bytes]) -> None:
    assert [a.response_name() for a in command(b"t FETCH 1 " + atts).args.atts] == names


@pytest.mark.parametrize("atts", [b"(FLAGS", b"BODY[1.x]", b"BODY[MIME]", b"BODY[HEADER.FIELDS]", b"BODY[]<1>",
                                  b"BODY[0]", b"FOO", b"()", b"BODY[]<0.0>", b"(FLAGS) extra"])
def test_bad_fetch_items(atts: bytes) -> None:
    with pytest.raises(ParseError):
        command(b"t FETCH 1 " + atts)


def test_store_forms() -> None:
    assert command(b"t STORE 1:2 +FLAGS.SILENT (\\Deleted foo)").args == c.Store(((1, 2),), "add", True, ("\\Deleted", "foo"))
    assert command(b"t STORE 1 -FLAGS \\Seen \\Flagged").args.flags == ("\\Seen", "\\Flagged")
    for bad in (b"t STORE 1 FLAGZ (\\Seen)", b"t STORE 1 FLAGS (\\*)", b"t STORE 1 FLAGS"):
        with pytest.raises(ParseError):
            command(bad)


def test_search_programs() -> None:
    cmd = command(b'u SEARCH CHARSET UTF-8 OR (FROM "a b" UNSEEN) NOT SINCE 1-Feb-2026 SUBJECT ',
                  "r\u00e9".encode(), b" 2:*")
    assert cmd.args.charset == "UTF-8"
    assert cmd.args.program == c.And((
        c.Or(c.And((c.Key("FROM", (b"a b",)), c.Key("UNSEEN"))),
             c.Not(c.Key("SINCE", (datetime(2026, 2, 1, tzinfo=timezone.utc),)))),
        c.Key("SUBJECT", ("r\u00e9".encode(),)),
        c.Key("SET", (((2, None),),)),
    ))
    assert command(b"u SEARCH TEXT ", "r\u00e9".encode(), b"").args.program == c.And((c.Key("TEXT", ("r\u00e9".encode(),)),))
    for bad in (b"u SEARCH", b"u SEARCH (SEEN", b"u SEARCH SEEN)", b"u SEARCH SINCE (x)", b"u SEARCH SINCE 31-Feb-2026",
                b"u SEARCH LARGER many", b"u SEARCH FROB", b'u SEARCH SUBJECT "open'):
        with pytest.raises(ParseError):
            command(bad)


@pytest.mark.parametrize("program", [b"(" * 2000 + b"ALL" + b")" * 2000, b"NOT " * 5000 + b"ALL",
                                     b"OR " * 3000 + b"ALL " * 3001, b"ALL " * 1500])
def test_search_programs_past_the_limits_are_refused_as_limits(program: bytes) -> None:
    with pytest.raises(parse.LimitExceeded):
        command(b"u SEARCH " + program)


def test_list_extended_and_status_items() -> None:
    cmd = command(b'l LIST (SUBSCRIBED RECURSIVEMATCH) "" ("%" "Work/*") RETURN (CHILDREN STATUS (MESSAGES UNSEEN))')
    assert cmd.args == c.ListCommand(b"", (b"%", b"Work/*"), frozenset({"SUBSCRIBED", "RECURSIVEMATCH"}),
                                     frozenset({"CHILDREN", "STATUS", "SUBSCRIBED"}), ("MESSAGES", "UNSEEN"))
    assert command(b'l LIST (SPECIAL-USE) "" "*"').args.returns == frozenset({"SPECIAL-USE"})
    assert command(b"l LSUB \"\" %").args.lsub
    for bad in (b'l LIST (RECURSIVEMATCH) "" "*"', b'l LIST (BOGUS) "" "*"', b'l LIST "" "*" RETURN (BOGUS)',
                b"l STATUS INBOX MESSAGES", b"l STATUS INBOX (MESSAGES BOGUS)",
                b'l LIST "" "*" RETURN (STATUS (MES))'):
        with pytest.raises(ParseError):
            command(bad)


# ----------------------------------------------------------------------------- RFC 7162


def test_condstore_and_qresync_select_parameters() -> None:
    assert command(b"s SELECT INBOX (CONDSTORE)").args == c.Select(b"INBOX", False, condstore=True)
    assert command(b"s EXAMINE INBOX (qresync (67890007 20050715194045000))").args == \
        c.Select(b"INBOX", True, qresync=c.QResync(67890007, 20050715194045000))
    # RFC 7162 3.2.5.2's example: known UIDs, then sequence numbers paired with the UIDs at them;
    # each UID range gives its two ends (never expanded), with the sequence numbers at their places
    cmd = command(b"s SELECT INBOX (QRESYNC (67890007 90060115194045000 41:211,214:541 "
                  b"(1:5,10 41:44,101,211)) CONDSTORE)")
    assert cmd.args.condstore and cmd.args.qresync == c.QResync(
        67890007, 90060115194045000, ((41, 211), (214, 541)), ((1, 41), (4, 44), (5, 101), (10, 211)))
    assert command(b"s SELECT INBOX (QRESYNC (1 2 (3:4 7:8)))").args.qresync == \
        c.QResync(1, 2, None, ((3, 7), (4, 8)))


@pytest.mark.parametrize("params", [
    b"()", b"(CONDSTORE", b"(CONDSTORE CONDSTORE)", b"(FOO)", b"CONDSTORE", b"(QRESYNC)", b"(QRESYNC ())",
    b"(QRESYNC (1))", b"(QRESYNC (0 5))", b"(QRESYNC (4294967296 5))", b"(QRESYNC (1 0))", b"(QRESYNC (1 -5))",
    b"(QRESYNC (1 9223372036854775808))", b"(QRESYNC (x 5))", b"(QRESYNC (1 5 1:*))", b"(QRESYNC (1 5 *))",
    b"(QRESYNC (1 5 1:5 (1:2 3)))", b"(QRESYNC (1 5 1:5 (1:2)))", b"(QRESYNC (1 5 1:5 (1:* 1:2)))",
    b"(QRESYNC (1 5 1:5 (1:2 3:4) 7))", b"(QRESYNC (1 5 1:5 1:6))", b"(QRESYNC (1 5)", b"(QRESYNC (1 5) QRESYNC (1 5))",
])
def test_malformed_select_parameters_are_syntax_errors(params: bytes) -> None:
    with pytest.raises(ParseError):
        command(b"s SELECT INBOX " + params)


def test_fetch_modseq_and_its_modifiers() -> None:
    cmd = command(b"f FETCH 1:* (FLAGS) (CHANGEDSINCE 12345)")
    assert cmd.args.changedsince == 12345 and not cmd.args.vanished
    assert [a.name for a in cmd.args.atts] == ["FLAGS", "MODSEQ"]  # CHANGEDSINCE answers the MODSEQ
    cmd = command(b"f UID FETCH 300:500 FLAGS (vanished changedsince 9223372036854775807)")
    assert (cmd.args.changedsince, cmd.args.vanished) == ((1 << 63) - 1, True)
    assert [a.name for a in cmd.args.atts] == ["FLAGS", "UID", "MODSEQ"]
    assert [a.name for a in command(b"f FETCH 1 (MODSEQ UID)").args.atts] == ["MODSEQ", "UID"]
    assert command(b"f FETCH 1 FAST (CHANGEDSINCE 1)").args.changedsince == 1


@pytest.mark.parametrize("modifiers", [
    b"()", b"(CHANGEDSINCE)", b"(CHANGEDSINCE 0)", b"(CHANGEDSINCE -1)", b"(CHANGEDSINCE 1.5)", b"(CHANGEDSINCE x)",
    b"(CHANGEDSINCE 9223372036854775808)", b"(CHANGEDSINCE 99999999999999999999999)", b"(CHANGEDSINCE 5",
    b"(CHANGEDSINCE 5 CHANGEDSINCE 6)", b"(VANISHED)", b"(CHANGEDSINCE 5 VANISHED VANISHED)", b"(UNCHANGEDSINCE 5)",
    b"CHANGEDSINCE 5", b"(CHANGEDSINCE 5) x",
])
def test_malformed_fetch_modifiers_are_syntax_errors(modifiers: bytes) -> None:
    for uid in (b"", b"UID "):
        with pytest.raises(ParseError):
            command(b"f " + uid + b"FETCH 1:* (FLAGS) " + modifiers)
    with pytest.raises(ParseError, match="VANISHED goes with UID FETCH"):
        command(b"f FETCH 1 (FLAGS) (CHANGEDSINCE 5 VANISHED)")  # QRESYNC's modifier is for UID FETCH only


def test_store_unchangedsince() -> None:
    assert command(b"s STORE 7,5,9 (UNCHANGEDSINCE 320162338) +FLAGS.SILENT (\\Deleted)").args == \
        c.Store(((7, 7), (5, 5), (9, 9)), "add", True, ("\\Deleted",), unchangedsince=320162338)
    assert command(b"s UID STORE 1 (unchangedsince 0) FLAGS ()").args.unchangedsince == 0  # always fails, but valid
    for bad in (b"s STORE 1 (UNCHANGEDSINCE) FLAGS ()", b"s STORE 1 (UNCHANGEDSINCE -1) FLAGS ()",
                b"s STORE 1 (UNCHANGEDSINCE 9223372036854775808) FLAGS ()", b"s STORE 1 (UNCHANGEDSINCE 5 FLAGS ()",
                b"s STORE 1 (CHANGEDSINCE 5) FLAGS ()", b"s STORE 1 () FLAGS ()", b"s STORE 1 (UNCHANGEDSINCE 5)",
                b"s STORE 1 (UNCHANGEDSINCE 5)(UNCHANGEDSINCE 5) FLAGS ()", b"s STORE 1 FLAGS () (UNCHANGEDSINCE 5)"):
        with pytest.raises(ParseError):
            command(bad)


def test_search_modseq_and_status_highestmodseq() -> None:
    assert command(b"s SEARCH MODSEQ 620162338").args.program == c.And((c.Key("MODSEQ", (620162338,)),))
    assert command(b's SEARCH OR NOT MODSEQ "/flags/\\\\draft" all 0 modseq "/flags/$Work" PRIV 5').args.program == \
        c.And((c.Or(c.Not(c.Key("MODSEQ", (0,))), c.Key("MODSEQ", (5,))),))
    for bad in (b"s SEARCH MODSEQ", b"s SEARCH MODSEQ -1", b"s SEARCH MODSEQ 9223372036854775808",
                b's SEARCH MODSEQ "/flags/\\\\draft" 5', b's SEARCH MODSEQ "/flags/\\\\draft" mine 5',
                b's SEARCH MODSEQ "/flags/" all 5', b's SEARCH MODSEQ "flags" all 5', b's SEARCH MODSEQ "/flags/x" all'):
        with pytest.raises(ParseError):
            command(bad)
    assert command(b"s STATUS INBOX (HIGHESTMODSEQ UIDNEXT)").args.items == ("HIGHESTMODSEQ", "UIDNEXT")


def test_tags_and_names() -> None:
    for frame in (b"", b" NOOP", b"a+b NOOP", b"(x NOOP", b"\xff\xfe NOOP"):
        assert parse.parse_tag(Frame((frame,)))[0] is None
    assert parse.parse_tag(Frame((b"a1",)))[1] == b""
    with pytest.raises(KeyError):
        command(b"a FROBNICATE")
    with pytest.raises(ParseError, match="unexpected arguments"):
        command(b"a NOOP extra")


def test_the_append_literal_is_the_message_and_every_other_a_string() -> None:
    limit = parse.message_limit(1000)
    assert limit(b"a APPEND INBOX {5}", 0, b"a APPEND INBOX ") == 1000
    assert limit(b"a APPEND {5}", 0, b"a APPEND ") is None and limit(b"a APPEND {5}", 1, b" (\\Seen) ") == 1000
    assert limit(b"a LOGIN {5}", 0, b"a LOGIN ") is None


_TOKENS = st.sampled_from([b"a", b"FETCH", b"UID", b"SEARCH", b"LIST", b"APPEND", b"STORE", b"1:*", b"*", b"(", b")",
                           b"[", b"]", b"<", b">", b"BODY", b"BODY.PEEK[", b"HEADER.FIELDS", b'"', b"\\", b" ", b" ",
                           b"NOT", b"OR", b"FLAGS", b"+FLAGS", b"%", b"{", b"}", b"0", b"4294967296", b".", b"\x00",
                           b"\xff", b"INBOX", b"RETURN", b"CHARSET", b"SINCE", b"1-Feb-2026", b"SELECT",
                           b"CONDSTORE", b"QRESYNC", b"CHANGEDSINCE", b"UNCHANGEDSINCE", b"VANISHED", b"MODSEQ",
                           b"9223372036854775808"])


@settings(max_examples=3000, deadline=None)
@given(st.lists(_TOKENS, max_size=30), st.lists(st.binary(max_size=8), max_size=3))
def test_no_input_escapes_as_anything_but_a_parse_error(tokens: list[bytes], literals: list[bytes]) -> None:
    """Any command the parser is given ends in one of its documented outcomes: a typed command
    with the tag and the name (UID's own command for UID), a ParseError (BAD; LimitExceeded is
    one) whose text is a short line of printable ASCII that the BAD can carry, or, for a name
    the parser does not know (the session answers those before parsing), KeyError. Anything
    else raised fails the test."""
    parts: list[bytes] = [b"t " + b"".join(tokens)]
    for literal in literals:
        parts += [literal, b" x"]
    tag, name, cursor = parse.parse_tag(Frame(tuple(parts)))
    if tag is None:
        assert name == b""
        return
    known = name.decode("ascii", "replace") in parse.KNOWN
    if not known:
        with pytest.raises(KeyError):
            parse.parse_command(tag, name, cursor)
        return
    try:
        cmd = parse.parse_command(tag, name, cursor)
    except ParseError as exc:
        text = str(exc)
        assert text and len(text) <= 200 and text.isascii() and text.isprintable(), text
        return
    assert cmd.tag == tag and cmd.name in parse.KNOWN
    if name == b"UID":
        assert cmd.name != "UID" and cmd.args.uid
    else:
        assert cmd.name == name.decode("ascii")
