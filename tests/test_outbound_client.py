"""The parts of outbound delivery that are pure functions (over bytes, over limits), and the two aiosmtplib
internals the SMTP client replaces (a change in aiosmtplib must fail here, loudly)."""

from __future__ import annotations

import inspect
import random

import aiosmtplib.protocol
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cassmail.delivery import client, dsn, message
from cassmail.delivery.routing import split_hop
from cassmail.delivery.worker import share

#: Lines made of the bytes that matter to line ends and dot-stuffing.
LINES = st.binary(max_size=300).map(lambda b: bytes(random.Random(b).choice(b".\r\nab \x00\xff") for _ in b))


def test_aiosmtplib_still_transforms_data_through_the_two_names_cassmail_replaces() -> None:
    source = inspect.getsource(aiosmtplib.protocol.SMTPProtocol.execute_data_command)
    assert "normalize_message_line_endings(message)" in source and 'PERIOD_REGEX.sub(b"..", message)' in source
    assert aiosmtplib.protocol.normalize_message_line_endings is client.normalize_line_endings
    assert isinstance(aiosmtplib.protocol.PERIOD_REGEX, client.PeriodQuoting)


def _as_aiosmtplib_does(data: bytes) -> None:
    """Both replaced steps on their own and in the order DATA runs them, against aiosmtplib's."""
    assert client.normalize_line_endings(data) == client._NORMALIZE(data)
    normalized = client._NORMALIZE(data)
    assert client.PeriodQuoting().sub(b"..", normalized) == client._PERIOD_REGEX.sub(b"..", normalized)
    assert client.PeriodQuoting().sub(b"..", data) == client._PERIOD_REGEX.sub(b"..", data)
    expected = client._PERIOD_REGEX.sub(b"..", client._NORMALIZE(data))
    assert client.PeriodQuoting().sub(b"..", client.normalize_line_endings(data)) == expected


@given(LINES)
def test_the_fast_data_transformations_equal_aiosmtplibs(data: bytes) -> None:
    _as_aiosmtplib_does(data)


@settings(deadline=None)  # the first example imports numpy, which is slow on a busy machine
@given(LINES)
def test_the_vector_look_equals_aiosmtplibs_across_its_blocks(data: bytes) -> None:
    """The numpy look of large messages, made to run on every input and in blocks of 7 bytes,
    so that line ends and dots fall on each side of a block's edge."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client, "VECTOR_MIN", 1)
        patch.setattr(client, "_BLOCK", 7)
        _as_aiosmtplib_does(data)


def test_a_large_clean_message_is_sent_as_it_is_unless_a_line_starts_with_a_dot() -> None:
    body = b"".join(b"%06d abcdefghijklmnopqrstuvwxyz. ABCDEFGHIJKLMNOPQRSTUVWXYZ\r\n" % i for i in range(40_000))
    assert len(body) > 2 * client._BLOCK and len(body) >= client.VECTOR_MIN
    assert client.PeriodQuoting().sub(b"..", client.normalize_line_endings(body)) is body
    dotted = body[:client._BLOCK - 1] + b"\r\n.x" + body[client._BLOCK - 1:]  # a dot just past the first block
    assert client.PeriodQuoting().sub(b"..", client.normalize_line_endings(dotted)).count(b"\n..x") == 1
    bare = body[:client._BLOCK] + b"\n" + body[client._BLOCK:]  # a bare LF at the edge of a block
    assert client.normalize_line_endings(bare) == client._NORMALIZE(bare) != bare


def test_8bit_body_parts_are_downgraded_and_the_rest_kept() -> None:
    original = (b"Subject: x\r\nMIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary=b\r\n\r\n"
                b"--b\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
                b"Gr\xc3\xbc\xc3\x9fe\r\n--b\r\nContent-Type: application/octet-stream\r\n\r\n\x00\xff\xfe\r\n"
                b"--b\r\nContent-Type: text/plain\r\n\r\nplain ascii\r\n--b--\r\n")
    out = message.downgrade_8bit(original)
    assert out.isascii() and b"Content-Transfer-Encoding: quoted-printable" in out
    assert b"Gr=C3=BC=C3=9Fe" in out and b"Content-Transfer-Encoding: base64" in out and b"plain ascii" in out


def test_headers_are_read_for_loops_and_dkim() -> None:
    head = (b"Received: from a\r\n\tby b\r\nReceived: from c\r\nDelivered-To: Bob@Example.org\r\n"
            b"From: \"Anne\" <anne@Here.Example>\r\n\r\nReceived: not a header\r\n")
    assert message.hop_count(message.header_section(head)) == 2
    assert message.delivered_to(message.header_section(head)) == {"bob@example.org"}
    assert message.from_domain(message.header_section(head)) == "here.example"
    assert message.needs_smtputf8(b"Subject: caf\xc3\xa9\r\n\r\nx", ["a@b.example"])
    assert not message.needs_smtputf8(b"Subject: x\r\n\r\ncaf\xc3\xa9", ["a@b\u00fc.example"])
    assert message.needs_smtputf8(b"Subject: x\r\n\r\nx", ["j\u00fcrgen@b.example"])


def test_status_codes_and_next_hops_are_read_as_mtas_write_them() -> None:
    assert dsn.status_of("550 5.1.1 No such user", "4.0.0") == "5.1.1"
    assert dsn.status_of("451 try later", "4.0.0") == "4.0.0"
    assert dsn.status_of("554 Transaction failed", "4.0.0") == "5.0.0"
    assert split_hop("[10.0.0.1]:2525", 25) == ("10.0.0.1", 2525, False)
    assert split_hop("[mx.example]", 25) == ("mx.example", 25, False)
    assert split_hop("relay.example:587", 25) == ("relay.example", 587, True)
    assert split_hop("relay.example", 25) == ("relay.example", 25, True)


@given(st.integers(1, 10_000), st.integers(1, 256))
def test_a_node_limit_is_shared_out_so_that_its_processes_stay_within_it(limit: int, processes: int) -> None:
    part = share(limit, processes)
    assert part >= 1
    if limit >= processes:
        assert processes * part <= limit < processes * (part + 1)
    else:
        assert part == 1  # every process can still deliver
    assert (share(20, 1), share(20, 2), share(20, 3), share(2, 4)) == (20, 10, 6, 1)
