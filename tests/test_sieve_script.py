"""The Sieve parser and interpreter on their own: the grammar, what compile_script refuses, what each
test and action decides, and the limits that bound a script's work."""

from __future__ import annotations

import email
import email.policy
from datetime import datetime, timezone

import pytest

from cassmail.sieve.parse import SieveSyntaxError, parse
from cassmail.sieve.script import (
    EXTENSIONS,
    Discard,
    Envelope,
    FileInto,
    Keep,
    Limits,
    Message,
    Redirect,
    Reject,
    SieveError,
    SieveRuntimeError,
    Vacation,
    check,
    compile_script,
    run,
)

ALL = "require [" + ", ".join(f'"{e}"' for e in EXTENSIONS) + "];\n"
MESSAGE = (
    b"Return-Path: <alice+news@example.org>\r\n"
    b"From: Alice <alice+news@example.org>\r\n"
    b"To: Bob <bob@example.com>, carol@example.com\r\n"
    b"Cc: dave@example.net\r\n"
    b"Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?= [dev] weekly report\r\n"
    b"Date: Tue, 24 Nov 2026 22:30:00 -0500\r\n"
    b"Received: from a by b; Tue, 24 Nov 2026 10:00:00 +0000\r\n"
    b"Received: from c by d; Mon, 23 Nov 2026 09:00:00 +0000\r\n"
    b"X-Spam-Score: 12\r\n"
    b"MIME-Version: 1.0\r\n"
    b"Content-Type: multipart/alternative; boundary=b\r\n"
    b"\r\n"
    b"--b\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nPlease find the URGENT figures.\r\n"
    b"--b\r\nContent-Type: text/html\r\n\r\n<p>hidden html words</p>\r\n--b--\r\n"
)


def decide(text: str, message: bytes = MESSAGE, sender: str = "alice+news@example.org",
           rcpt: str = "bob+work@example.com", mailboxes: tuple[str, ...] = ("INBOX", "Junk"),
           limits: Limits = Limits()) -> list:
    return run(compile_script(ALL + text, limits), Message(message, limits.max_body_bytes), Envelope(sender, rcpt),
               mailboxes, limits, now=datetime(2026, 11, 25, 12, 0, tzinfo=timezone.utc))


def test_grammar_strings_lists_numbers_comments_and_multiline() -> None:
    [empty] = parse('vacation text:\r\n.\r\n;')
    assert empty.arguments[0].values == ("",)
    [command] = parse('# c\r\nvacation /* inline */ :days 2K text: # note\r\nline\r\n..dot\r\n.\r\n;')
    assert command.name == "vacation"
    assert [getattr(a, "value", getattr(a, "name", None)) for a in command.arguments[:2]] == [":days", 2048]
    assert command.arguments[2].values == ("line\r\n.dot\r\n",)
    [command] = parse('keep :flags ["a\\"b", "c\\\\d"];')
    assert command.arguments[1].values == ('a"b', "c\\d")
    for bad in ('keep', 'if true { keep;', 'fileinto "x" "y" ]', '/* open', 'keep :flags [;', 'x "\x01',
                'vacation text:\r\nno end', "if " * 40 + "true"):
        with pytest.raises(SieveSyntaxError):
            parse(bad)


@pytest.mark.parametrize("text, why", [
    ('fileinto "x";', 'needs require "fileinto"'),
    ('require "fileinto"; keep; require "copy";', "require must come before"),
    ('require "nope";', "unsupported extension"),
    ('frobnicate;', "unknown command"),
    ('if frob { keep; }', "unknown test"),
    ('require "fileinto"; fileinto :copy "x";', 'needs require "copy"'),
    ('if header :regex "subject" "x" { keep; }', 'needs require "regex"'),
    ('if header :is :contains "subject" "x" { keep; }', "conflicts"),
    ('if size 10 { keep; }', "needs :over or :under"),
    ('if header :comparator "i;unknown" "a" "b" { keep; }', "unknown comparator"),
    ('require "relational"; if header :count "gx" "a" "1" { keep; }', "needs one of"),
    ('require "regex"; if header :regex "a" "(" { keep; }', "bad regular expression"),
    ('elsif true { keep; }', "without if"),
    ('keep { }', "takes no block"),
    ('require "fileinto"; fileinto ["a", "b"];', "one string"),
    ('require "date"; if date "date" "century" "x" { keep; }', "unknown date part"),
])
def test_scripts_that_cannot_run_are_refused_with_a_reason(text: str, why: str) -> None:
    error = check(text)
    assert error is not None and why in error


def test_size_and_regex_length_limits_are_checked_when_stored() -> None:
    assert "larger than" in (check("#" * 100, Limits(max_script_size=64)) or "")
    assert "longer than" in (check('require "regex"; if header :regex "a" "' + "x" * 50 + '" { keep; }',
                                   Limits(max_regex_length=10)) or "")


def test_implicit_keep_and_its_cancellation() -> None:
    assert decide("") == [Keep(frozenset())]
    assert decide("discard;") == [Discard()]
    assert decide('fileinto "Junk";') == [FileInto("Junk", frozenset(), False)]
    assert decide('fileinto :copy "Junk";') == [FileInto("Junk", frozenset(), False), Keep(frozenset())]
    assert decide('redirect "x@y.example"; keep;') == [Redirect("x@y.example"), Keep(frozenset())]
    assert decide('keep; stop; discard;') == [Keep(frozenset())]


def test_header_address_envelope_and_subaddress() -> None:
    assert decide('if header :contains "subject" "grüße" { discard; }') == [Discard()]  # RFC 2047 decoded
    assert decide('if address :domain :is "to" "example.com" { discard; }') == [Discard()]
    assert decide('if address :localpart "from" "alice+news" { discard; }') == [Discard()]
    assert decide('if address :user "from" "alice" { discard; }') == [Discard()]
    assert decide('if address :detail "from" "news" { discard; }') == [Discard()]
    assert decide('if envelope :detail "to" "work" { discard; }') == [Discard()]
    assert decide('if envelope :user "to" "bob" { discard; }') == [Discard()]
    assert decide('if address :detail "cc" "" { discard; }') == [Keep(frozenset())]  # no detail: no match
    assert decide('if envelope :all :is "from" "" { discard; }', sender="") == [Discard()]
    assert decide('if exists ["x-spam-score", "subject"] { discard; }') == [Discard()]
    assert decide('if not exists "x-nope" { discard; }') == [Discard()]
    assert decide('if header :is "Subject" "x" { discard; } elsif true { fileinto "Junk"; } else { keep; }') == [
        FileInto("Junk", frozenset(), False)]


def test_match_types_comparators_and_relational() -> None:
    assert decide('if header :matches "subject" "*[dev]*" { discard; }') == [Discard()]
    assert decide('if header :matches "subject" "grüße*" { discard; }') == [Discard()]
    assert decide('if header :matches :comparator "i;octet" "subject" "grüße*" { discard; }') == [Keep(frozenset())]
    assert decide('if header :regex "subject" "\\\\[[a-z]+\\\\] weekly" { discard; }') == [Discard()]
    assert decide('if header :value "gt" :comparator "i;ascii-numeric" "x-spam-score" "9" { discard; }') == [Discard()]
    assert decide('if header :value "gt" "x-spam-score" "9" { discard; }') == [Keep(frozenset())]  # "12" < "9" as text
    assert decide('if address :count "ge" :comparator "i;ascii-numeric" ["to", "cc"] "3" { discard; }') == [Discard()]
    assert decide('if header :count "eq" :comparator "i;ascii-numeric" "received" "2" { discard; }') == [Discard()]
    assert decide('if size :over 100 { discard; }') == [Discard()]
    assert decide('if size :under 100 { discard; }') == [Keep(frozenset())]
    assert decide('if size :under 1K { discard; }') == [Discard()]
    assert decide('if anyof (false, allof (true, not false)) { discard; }') == [Discard()]


def test_index_date_and_currentdate() -> None:
    assert decide('if header :index 2 :contains "received" "from c" { discard; }') == [Discard()]
    assert decide('if header :index 1 :last :contains "received" "from c" { discard; }') == [Discard()]
    assert decide('if date :is "date" "date" "2026-11-25" { discard; }') == [Discard()]  # in UTC
    assert decide('if date :originalzone :is "date" "hour" "22" { discard; }') == [Discard()]
    assert decide('if date :zone "+0100" :is "date" "time" "04:30:00" { discard; }') == [Discard()]
    assert decide('if date :index 2 :is "received" "weekday" "1" { discard; }') == [Discard()]  # a Monday
    assert decide('if currentdate :value "ge" "iso8601" "2026-11-25" { discard; }') == [Discard()]
    assert decide('if currentdate :is "julian" "61369" { discard; }') == [Discard()]


def test_body_text_content_and_raw() -> None:
    assert decide('if body :contains "urgent" { discard; }') == [Discard()]
    assert decide('if body :text :contains "hidden html" { discard; }') == [Discard()]  # text/* includes html
    assert decide('if body :content "text/plain" :contains "hidden" { discard; }') == [Keep(frozenset())]
    assert decide('if body :raw :contains "Content-Type: text/html" { discard; }') == [Discard()]
    assert decide('if body :contains "hidden", { discard; }'.replace(",", "")) == [Discard()]


def test_variables_and_match_variables() -> None:
    actions = decide('''
        if header :matches "from" "* <*@*>" { set "who" "${2}"; set :upper "site" "${3}"; }
        set :length "n" "${who}";
        if string :is "${n}" "10" { fileinto :copy "${site}/${who}"; }
        if header :regex "subject" "\\\\[([a-z]+)\\\\]" { addflag "list-${1}"; }
    ''')
    assert actions == [FileInto("EXAMPLE.ORG/alice+news", frozenset(), False), Keep(frozenset({"list-dev"}))]
    assert decide('set "x" "${unknown}-${env.x}"; if string :is "${x}" "-" { discard; }') == [Discard()]


def test_imap4flags_internal_and_variable_flags() -> None:
    actions = decide('''
        setflag "\\\\Seen"; addflag ["$a", "$b"]; removeflag "$a";
        fileinto "Junk";
        addflag "flagvar" "\\\\Flagged";
        if hasflag :is "flagvar" "\\\\Flagged" { fileinto :flags "${flagvar}" "INBOX"; }
        if hasflag :contains "$b" { keep :flags "$only"; }
    ''')
    assert actions == [
        FileInto("Junk", frozenset({"\\Seen", "$b"}), False),
        FileInto("INBOX", frozenset({"\\Flagged"}), False),
        Keep(frozenset({"$only"})),
    ]


def test_reject_vacation_and_their_conflicts() -> None:
    assert decide('reject "no";') == [Reject("no", False)]
    assert decide('ereject "no";') == [Reject("no", True)]
    with pytest.raises(SieveRuntimeError, match="reject cannot be combined"):
        decide('reject "no"; fileinto "Junk";')
    [vacation, keep] = decide('vacation :days 3 :subject "Away ${x}" :from "me@example.com" :addresses ["b@x"] '
                              ':handle "h1" "text";')
    assert vacation == Vacation("text", "Away ", "me@example.com", ("b@x",), 3 * 86400, False, "h1")
    assert keep == Keep(frozenset())
    assert decide('vacation :seconds 30 :mime "Content-Type: text/plain\r\n\r\nx";')[0].seconds == 30
    with pytest.raises(SieveRuntimeError, match="twice"):
        decide('vacation "a"; vacation "b";')


def test_limits_bound_the_work_of_a_script() -> None:
    with pytest.raises(SieveRuntimeError, match="actions"):
        decide("".join(f'fileinto :copy "f{i}";' for i in range(5)), limits=Limits(max_actions=4))
    with pytest.raises(SieveRuntimeError, match="redirects"):
        decide('redirect :copy "a@x.example"; redirect :copy "b@x.example";', limits=Limits(max_redirects=1))
    doubling = 'set "a" "xxxxxxxxxxxxxxxx";' + 'set "a" "${a}${a}";' * 40 + 'if string :count "eq" :comparator "i;ascii-numeric" "${a}" "1" { discard; }'
    assert decide(doubling, limits=Limits(max_variable_length=1000)) == [Discard()]  # capped, not 2**44 bytes
    catastrophic = 'if header :regex "x-long" "(a|aa)+$" { discard; }'
    message = b"X-Long: " + b"a" * 60 + b"b\r\n\r\nbody\r\n"
    with pytest.raises(SieveRuntimeError, match="took longer"):
        decide(catastrophic, message=message, limits=Limits(regex_timeout=0.05))


def test_an_undecodable_or_odd_message_does_not_break_a_script() -> None:
    odd = b"Subject: =?bogus?x?zz?=\r\nFrom: <<<>>>\r\nDate: yesterday\r\nContent-Type: text/plain; charset=nope\r\n\r\n\xff\xfe"
    actions = decide('if anyof (address :all "from" "x", date :is "date" "year" "2026", body :contains "x",'
                     ' header :contains "subject" "bogus") { discard; }', message=odd)
    assert actions == [Discard()]
    with pytest.raises(SieveError):
        compile_script("\x00")


def test_vacation_answers_whom_and_in_whose_name() -> None:
    from cassmail.config import SieveSettings
    from cassmail.sieve.delivery import SieveFilter

    step = SieveFilter(None, SieveSettings(), "mx.example")  # type: ignore[arg-type] - no store needed here
    user, rcpt = "bob@example.com", "bob+work@example.com"
    parsed = Message(MESSAGE, 1 << 20)
    away = Vacation("Back soon", None, "Bob B <bob@example.com>", (), None, False, "h")
    assert step.answer_refused(user, rcpt, away, parsed, "alice@example.org") is None
    for sender, why in (("", "null sender"), ("bob@example.com", "own address"), ("owner-dev@lists.example", "list"),
                        ("MAILER-DAEMON@x.example", "list or system"), ("dev-request@x.example", "list or system")):
        assert why in (step.answer_refused(user, rcpt, away, parsed, sender) or ""), sender
    listed = Message(MESSAGE.replace(b"Cc:", b"List-Id: <dev.example>\r\nCc:"), 1 << 20)
    assert step.answer_refused(user, rcpt, away, listed, "alice@example.org") == "mailing list"
    auto = Message(MESSAGE.replace(b"Cc:", b"Auto-Submitted: auto-generated\r\nCc:"), 1 << 20)
    assert step.answer_refused(user, rcpt, away, auto, "alice@example.org") == "auto-submitted"
    assert step.answer_refused("zed@example.com", "zed@example.com", away, parsed, "a@example.org") == \
        "not addressed to the user"
    reply = step.vacation_message(user, away, parsed, "alice@example.org", rcpt)
    parsed_reply = email.message_from_bytes(reply, policy=email.policy.default)
    assert parsed_reply["From"] == "Bob B <bob@example.com>" and parsed_reply["To"] == "alice@example.org"
    assert parsed_reply["Subject"] == "Auto: Grüße [dev] weekly report"
    assert b"Auto-Submitted: auto-replied" in reply and b"In-Reply-To:" not in reply  # the original had no Message-ID
    forged = Vacation("x", "Hi", "ceo@example.com\r\nBcc: everyone@example.com", (), None, False, "h")
    reply = step.vacation_message(user, forged, parsed, "alice@example.org", rcpt)
    assert b"From: bob@example.com\r\n" in reply and b"Bcc" not in reply and b"ceo@" not in reply
    assert step.period(Vacation("x", None, None, (), 60, False, "h")) == 86400.0  # clamped to the least period
