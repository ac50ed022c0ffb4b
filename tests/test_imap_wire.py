"""IMAP's data formats and the MIME parser on their own: no server, no store."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cassmail.imap import commands, mime, wire
from cassmail.imap.mailboxes import list_matches, pattern_matcher
from cassmail.model import MailboxInfo


def test_sequence_sets_parse_and_resolve_star() -> None:
    assert wire.parse_set(b"1,3:5,7:*") == [(1, 1), (3, 5), (7, None)]
    assert wire.resolve_set(wire.parse_set(b"*:4,2"), 10) == [(4, 10), (2, 2)]
    assert wire.resolve_set(wire.parse_set(b"*"), 0) == [(0, 0)]
    for bad in (b"", b"0", b"1:0", b"01", b"1:2:3", b"a", b"-1", b"4294967296", b"1,,2"):
        with pytest.raises(wire.ParseError):
            wire.parse_set(bad)
    with pytest.raises(wire.ParseError):
        wire.parse_set(b",".join(b"%d" % i for i in range(1, wire.MAX_SET_RANGES + 2)))


def test_strings_are_quoted_or_literal_as_their_bytes_need() -> None:
    assert wire.string(None) == b"NIL"
    assert wire.string("plain") == b'"plain"'
    assert wire.string('a "quote" and \\') == b'"a \\"quote\\" and \\\\"'
    assert wire.string(b"line\r\nbreak") == b"{11}\r\nline\r\nbreak"
    assert wire.string("caf\u00e9") == b"{5}\r\ncaf\xc3\xa9"
    assert wire.astring("INBOX") == b"INBOX" and wire.astring("with space") == b'"with space"'
    assert wire.astring("NIL") == b'"NIL"'
    assert wire.encode([1, None, "x", [wire.Atom("\\Seen")]]) == b'(1 NIL "x" (\\Seen))'


def test_dates() -> None:
    moment = datetime(2026, 7, 4, 3, 2, 1, tzinfo=timezone(timedelta(hours=-7)))
    assert wire.format_datetime(moment) == b'"04-Jul-2026 10:02:01 +0000"'
    assert wire.parse_datetime(b" 4-Jul-2026 03:02:01 -0700") == moment
    assert wire.parse_datetime(b"04-Jul-2026 10:02:01 +0000") == moment
    assert wire.parse_date(b"1-Feb-1994") == datetime(1994, 2, 1, tzinfo=timezone.utc)
    for bad in (b"31-Feb-2026 00:00:00 +0000", b"1-Foo-2026 00:00:00 +0000", b"yesterday"):
        with pytest.raises(wire.ParseError):
            wire.parse_datetime(bad)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30))
def test_modified_utf7_names_round_trip(name: str) -> None:
    assert wire.decode_mailbox(wire.encode_mailbox(name)) == name


def test_invalid_modified_utf7_is_refused() -> None:
    assert wire.decode_mailbox(b"Caf&AOk-") == "Caf\u00e9"
    assert wire.encode_mailbox("~peter/mail/\u53f0\u5317/\u65e5\u672c\u8a9e") == b"~peter/mail/&U,BTFw-/&ZeVnLIqe-"
    for bad in (b"&Jjo", b"caf\xc3\xa9", b"&AGEAYgBj-", b"&2D0-", b"&*-", b"&AOk"):
        # unterminated, 8-bit, needless shift of ASCII, a lone surrogate, not base64, unterminated
        with pytest.raises(wire.ParseError):
            wire.decode_mailbox(bad)


def test_uid_sets_are_compact() -> None:
    assert wire.compact_set([4, 5, 6, 9, 11, 12]) == "4:6,9,11:12"
    assert wire.compact_set([7]) == "7"


def _listed(boxes: list[MailboxInfo], *patterns: str, **options: object) -> dict[str, list[bytes]]:
    command = commands.ListCommand(b"", tuple(p.encode() for p in patterns), **options)  # type: ignore[arg-type]
    return {name: attrs for name, attrs, _ in list_matches(boxes, patterns, command)}


def test_list_patterns_levels_and_noselect_parents() -> None:
    boxes = [MailboxInfo("INBOX", 1), MailboxInfo("Sent", 2, "\\Sent"), MailboxInfo("Work/2026/Q1", 3),
             MailboxInfo("Lists", 4, subscribed=False)]
    assert set(_listed(boxes, "*")) == {"INBOX", "Sent", "Work", "Work/2026", "Work/2026/Q1", "Lists"}
    assert set(_listed(boxes, "%")) == {"INBOX", "Sent", "Work", "Lists"}
    assert _listed(boxes, "%")["Work"] == [b"\\Noselect", b"\\HasChildren"]
    assert _listed(boxes, "Work/%/%") == {"Work/2026/Q1": [b"\\HasNoChildren"]}
    assert _listed(boxes, "inbox") == {"INBOX": [b"\\HasNoChildren"]}
    assert _listed(boxes, "Sent")["Sent"] == [b"\\HasNoChildren", b"\\Sent"]
    assert _listed(boxes, "Sent", "Lists").keys() == {"Sent", "Lists"}  # LIST-EXTENDED: several patterns
    assert set(_listed(boxes, "*", select=frozenset({"SPECIAL-USE"}))) == {"Sent"}


def test_lsub_lists_subscribed_names_and_noselect_parents_a_percent_stopped_at() -> None:
    """RFC 3501 6.3.9: with "foo/bar" subscribed and "foo" not, LSUB "" "%" answers foo as
    \\Noselect; LSUB "" "*" answers only foo/bar; an unsubscribed mailbox is never listed."""
    boxes = [MailboxInfo("INBOX", 1), MailboxInfo("foo", 2, subscribed=False), MailboxInfo("foo/bar", 3),
             MailboxInfo("gone", 4, subscribed=False), MailboxInfo("x/y/z", 5)]
    lsub = {"lsub": True}
    assert _listed(boxes, "%", **lsub) == {"INBOX": [b"\\HasNoChildren"], "foo": [b"\\Noselect", b"\\HasChildren"],
                                         "x": [b"\\Noselect", b"\\HasChildren"]}
    assert set(_listed(boxes, "*", **lsub)) == {"INBOX", "foo/bar", "x/y/z"}
    assert set(_listed(boxes, "x/%", **lsub)) == {"x/y"}
    subscribed = _listed(boxes, "*", select=frozenset({"SUBSCRIBED"}), returns=frozenset({"SUBSCRIBED"}))
    assert set(subscribed) == {"INBOX", "foo/bar", "x/y/z"} and b"\\Subscribed" in subscribed["foo/bar"]
    recursive = list_matches(boxes, ["%"], commands.ListCommand(b"", (b"%",), select=frozenset({"SUBSCRIBED", "RECURSIVEMATCH"})))
    assert {n: extra for n, _, extra in recursive} == {
        "INBOX": b"", "foo": b' ("CHILDINFO" ("SUBSCRIBED"))', "x": b' ("CHILDINFO" ("SUBSCRIBED"))'}


def test_list_patterns_match_in_linear_time() -> None:
    """A pattern of many wildcards against a long name is answered at once (a regular
    expression built from them backtracks exponentially)."""
    name = "a" * 30
    for pattern in ("*" * 16 + "x", "%*" * 40 + "x", "*a" * 200 + "x", "%" * 5000 + "b"):
        assert not pattern_matcher(pattern)(name)
    assert pattern_matcher("*" * 16 + "a")(name) and pattern_matcher("a%a*")(name)
    assert pattern_matcher("%")("INBOX") and not pattern_matcher("%")("a/b") and pattern_matcher("%/%")("a/b")
    assert pattern_matcher("InBoX")("INBOX") and not pattern_matcher("inbox")("inboxes")


def test_header_fields_keep_folded_lines_and_bytes() -> None:
    header = b"Subject: a\r\n folded\r\nX-Other: 1\r\nsubject: second\r\nTo: \xe9\r\n\r\n"
    assert mime.header_fields(header, ["SUBJECT"], False) == b"Subject: a\r\n folded\r\nsubject: second\r\n\r\n"
    assert mime.header_fields(header, ["subject"], True) == b"X-Other: 1\r\nTo: \xe9\r\n\r\n"
    assert mime.header_fields(header, ["nothing"], False) == b"\r\n"


def test_mime_tree_of_nested_and_odd_messages() -> None:
    raw = (b"Content-Type: multipart/mixed; boundary=outer\r\n\r\npre\r\n--outer\r\n"
           b"Content-Type: multipart/alternative; boundary=\"in ner\"\r\n\r\n--in ner\r\n\r\nplain\r\n"
           b"--in ner\r\nContent-Type: text/html\r\n\r\n<p>\r\n--in ner--\r\n"
           b"--outer\r\nContent-Type: message/rfc822\r\n\r\nSubject: inner\r\n\r\nbody\r\n--outer--\r\nepilogue\r\n")
    entity = mime.parse(raw)
    assert [p.content_type for p in entity.parts] == [("multipart", "alternative"), ("message", "rfc822")]
    assert mime.part(entity, (1, 1)).body_bytes() == b"plain"
    assert mime.part(entity, (1, 2)).body_bytes() == b"<p>"
    assert mime.part(entity, (2,)).message.header_bytes() == b"Subject: inner\r\n\r\n"
    assert mime.section(entity, (2,), "HEADER") == b"Subject: inner\r\n\r\n"
    assert mime.part(entity, (2, 1)).body_bytes() == b"body"
    with pytest.raises(mime.NoSuchPart):
        mime.part(entity, (3,))
    structure = wire.encode(mime.bodystructure(entity))
    assert structure.startswith(b'((("text" "plain" ("charset" "us-ascii") NIL NIL "7BIT" 5 1')
    assert b'"alternative" ("boundary" "in ner")' in structure and b'"mixed" ("boundary" "outer")' in structure
    # no header, no body, bare LF, a multipart whose boundary never appears
    assert mime.parse(b"\r\njust a body").body_bytes() == b"just a body"
    assert mime.parse(b"Subject: only a header").body_bytes() == b""
    assert mime.parse(b"Subject: x\n\nbody\n").header_bytes() == b"Subject: x\n\n"
    lonely = mime.parse(b"Content-Type: multipart/mixed; boundary=zz\r\n\r\nno parts here\r\n")
    assert lonely.parts == [] and wire.encode(mime.bodystructure(lonely)).startswith(b'("text" "plain"')


def test_envelope_addresses() -> None:
    entity = mime.parse(b'From: "Ann, B." <ann@x.example>\r\nTo: bob@y.example, Carol <c@z.example>\r\n'
                        b"Subject: =?utf-8?q?h=C3=A9?=\r\nMessage-ID: <1@x>\r\n\r\n")
    env = mime.envelope(entity.headers)
    assert env[1] == b"=?utf-8?q?h=C3=A9?=" and env[9] == b"<1@x>"
    assert env[2] == [["Ann, B.", None, "ann", "x.example"]] and env[3] == env[2] and env[4] == env[2]
    assert env[5] == [[None, None, "bob", "y.example"], ["Carol", None, "c", "z.example"]]
    assert env[0] is None and env[6] is None


def test_a_message_whose_body_is_a_message_has_it_as_part_1() -> None:
    """RFC 3501 6.4.5: a message that is not multipart has one part, its body; when that body is a
    message/rfc822, BODY[1] is the message it holds and BODY[1.HEADER] that message's header."""
    inner = b"From: a@x.test\r\nSubject: inner\r\n\r\nHello world\r\n"
    entity = mime.parse(b"Content-Type: message/rfc822\r\nSubject: outer\r\n\r\n" + inner)
    assert mime.section(entity, (1,), None) == inner
    assert mime.section(entity, (1,), "HEADER") == b"From: a@x.test\r\nSubject: inner\r\n\r\n"
    assert mime.section(entity, (1,), "TEXT") == b"Hello world\r\n"
    assert mime.section(entity, (1, 1), None) == b"Hello world\r\n"
    assert mime.section(entity, (), "HEADER").endswith(b"Subject: outer\r\n\r\n")
    twice = mime.parse(b"Content-Type: message/rfc822\r\n\r\nContent-Type: message/rfc822\r\n\r\n" + inner)
    assert mime.section(twice, (1, 1), None) == inner and mime.section(twice, (1, 1), "HEADER").startswith(b"From:")
    structure = wire.encode(mime.bodystructure(twice))
    assert structure.startswith(b'("message" "rfc822" NIL NIL NIL "7BIT"') and structure.count(b'"rfc822"') == 2
    assert mime.section(mime.parse(b"Subject: x\r\n\r\nbody"), (2,), None) == b""  # no such part: empty


def test_a_folded_boundary_parameter_is_still_multipart() -> None:
    for header, delimiter in ((b'boundary="=_a\r\n b"', b"=_a b"), (b'boundary="=_a\r\n b"', b"=_ab"),
                              (b"\r\n\tboundary=\r\n =_ab", b"=_ab")):
        raw = (b"Content-Type: multipart/mixed; " + header + b"\r\n\r\n--" + delimiter
               + b"\r\n\r\none\r\n--" + delimiter + b"\r\n\r\ntwo\r\n--" + delimiter + b"--\r\n")
        entity = mime.parse(raw)
        assert [p.body_bytes() for p in entity.parts] == [b"one", b"two"], header
        assert b'"mixed"' in wire.encode(mime.bodystructure(entity))


def test_envelope_keeps_groups() -> None:
    entity = mime.parse(b"To: A Group: Ed <c@a.test>, joe@where.test;, x@y.test\r\n"
                        b"Cc: undisclosed-recipients:;\r\nBcc: <user (comment)@ (comment) domain.org>\r\n\r\n")
    env = mime.envelope(entity.headers)
    assert env[5] == [[None, None, "A Group", None], ["Ed", None, "c", "a.test"], [None, None, "joe", "where.test"],
                      [None, None, None, None], [None, None, "x", "y.test"]]
    assert env[6] == [[None, None, "undisclosed-recipients", None], [None, None, None, None]]
    assert env[7] == [[None, None, "user", "domain.org"]]
