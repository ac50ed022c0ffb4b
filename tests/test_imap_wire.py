"""IMAP's data formats and the MIME parser on their own: no server, no store."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cassmail.imap import mime, wire
from cassmail.imap.session import _uid_set, list_matches
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
    for bad in (b"&Jjo", b"caf\xc3\xa9", b"&AGEAYgBj-"):  # unterminated, 8-bit, needless shift of ASCII
        with pytest.raises(wire.ParseError):
            wire.decode_mailbox(bad)


def test_uid_sets_are_compact() -> None:
    assert _uid_set([4, 5, 6, 9, 11, 12]) == "4:6,9,11:12"
    assert _uid_set([7]) == "7"


def test_list_patterns_levels_and_noselect_parents() -> None:
    boxes = [MailboxInfo("INBOX", 1), MailboxInfo("Sent", 2, "\\Sent"), MailboxInfo("Work/2026/Q1", 3),
             MailboxInfo("Lists", 4, subscribed=False)]
    names = lambda pattern, sub=False: {n: a for n, a in list_matches(boxes, pattern, sub)}  # noqa: E731
    assert set(names("*")) == {"INBOX", "Sent", "Work", "Work/2026", "Work/2026/Q1", "Lists"}
    assert set(names("%")) == {"INBOX", "Sent", "Work", "Lists"}
    assert names("%")["Work"] == [b"\\Noselect", b"\\HasChildren"]
    assert names("Work/%/%") == {"Work/2026/Q1": [b"\\HasNoChildren"]}
    assert names("inbox") == {"INBOX": [b"\\HasNoChildren"]}
    assert names("Sent")["Sent"] == [b"\\HasNoChildren", b"\\Sent"]
    assert "Lists" not in names("*", True) and "Sent" in names("*", True)


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
    assert mime.subpart(entity, (1, 1)).body_bytes() == b"plain"
    assert mime.subpart(entity, (1, 2)).body_bytes() == b"<p>"
    assert mime.subpart(entity, (2,)).message.header_bytes() == b"Subject: inner\r\n\r\n"
    assert mime.subpart(entity, (2, 1)).body_bytes() == b"body"
    with pytest.raises(mime.NoSuchPart):
        mime.subpart(entity, (3,))
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


def test_search_keys_parse_across_literals() -> None:
    from cassmail.imap import search

    # text and literals alternate; a literal is one string whatever its bytes (spaces, quotes, parens)
    assert search.parse_keys([b'OR (SUBJECT "a \\"b" FROM ', "r\u00e9 (x)".encode(), b") NOT 1:3"]) == [
        b"OR", [b"SUBJECT", b'a "b', b"FROM", "r\u00e9 (x)".encode()], b"NOT", b"1:3"]
    assert search.parse_keys([b"HEADER ", b"Subject", b" ", b"", b""]) == [b"HEADER", b"Subject", b""]
    for bad in ([b"(SEEN"], [b"SEEN)"], [b'SUBJECT "open'], [b"(SUBJECT ", b"x", b""]):
        with pytest.raises(wire.ParseError):
            search.parse_keys(bad)
