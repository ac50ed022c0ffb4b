"""The shared nouns: address syntax (RFC 5321/5322/6531), mailbox names, time-ordered ids, flags."""

from __future__ import annotations

import time
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cassmail.model import (
    Address,
    InvalidAddress,
    InvalidInput,
    InvalidMailboxName,
    address_key,
    flag_set,
    mailbox_name,
    message_id_time,
    new_message_id,
    parse_sortable_id,
    sortable_id,
    uidl,
    uuid_from_bytes,
)


@pytest.mark.parametrize(
    "text, key",
    [
        ("Anne@Example.COM", "anne@example.com"),
        ("<anne@example.com>", "anne@example.com"),
        ('"john doe"@example.com', '"john doe"@example.com'),
        ('"plain"@example.com', "plain@example.com"),  # quoting that is not needed goes
        ('"a\\"b"@example.com', '"a\\"b"@example.com'),
        ("first.last+tag@sub.example.org", "first.last+tag@sub.example.org"),
        ("用户@例子.广告", "用户@例子.广告"),
        ("anne@xn--bcher-kva.example", "anne@bücher.example"),
        ("o'brien@example.com", "o'brien@example.com"),
        ("anne@example.com.", "anne@example.com"),
    ],
)
def test_valid_addresses_have_one_canonical_key(text: str, key: str) -> None:
    assert address_key(text) == key


@pytest.mark.parametrize(
    "text",
    [
        "", "anne", "@example.com", "anne@", "an ne@example.com", "anne..x@example.com", ".anne@example.com",
        "anne.@example.com", "anne@exa mple.com", "anne@-example.com", "anne@example-.com", "anne@[127.0.0.1]",
        "a\r\nb@example.com", "anne@ex\x00ample.com", '"unterminated@example.com', "x" * 65 + "@example.com",
        "a@" + ("d" * 63 + ".") * 4 + "com", "anne@xn--zz.example",
    ],
)
def test_invalid_addresses_are_refused_with_a_reason(text: str) -> None:
    with pytest.raises(InvalidAddress) as err:
        Address.parse(text)
    assert str(err.value)


atom = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-/=?^_`{|}~é", min_size=1, max_size=10)
label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)


@given(st.lists(atom, min_size=1, max_size=3), st.lists(label, min_size=1, max_size=3))
def test_an_address_survives_printing_and_parsing(atoms: list[str], labels: list[str]) -> None:
    address = Address.parse(".".join(atoms) + "@" + ".".join(labels))
    assert Address.parse(str(address)) == address
    assert Address.parse(address.key).key == address.key


@given(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=20))
def test_any_printable_quoted_local_part_round_trips(local: str) -> None:
    escaped = local.replace("\\", "\\\\").replace('"', '\\"')
    address = Address.parse(f'"{escaped}"@example.com')
    assert address.local == local
    assert Address.parse(str(address)) == address


@pytest.mark.parametrize("text, canonical", [("inbox", "INBOX"), ("InBox/Sub", "INBOX/Sub"), ("A/b/C", "A/b/C"), ("Ünï", "Ünï")])
def test_mailbox_names_are_canonical(text: str, canonical: str) -> None:
    assert mailbox_name(text) == canonical


@pytest.mark.parametrize("text", ["", "a//b", "/a", "a/", "a\tb", "\x85", "x*", "x%", " a", "a ", "é" * 200])
def test_bad_mailbox_names_are_refused(text: str) -> None:
    with pytest.raises(InvalidMailboxName):
        mailbox_name(text)


def test_message_ids_are_version_1_unique_and_time_ordered() -> None:
    ids = [new_message_id() for _ in range(10_000)]
    assert all(i.version == 1 for i in ids)
    assert len(set(ids)) == len(ids)
    assert [i.time for i in ids] == sorted(i.time for i in ids)
    assert len({i.time for i in ids}) == len(ids)  # strictly increasing timestamps within a process
    assert abs(message_id_time(ids[0]).timestamp() - time.time()) < 5


@given(st.floats(min_value=0, max_value=4e9))
def test_sortable_ids_sort_by_time_and_convert_back(at: float) -> None:
    a, b = new_message_id(at), new_message_id(at + 0.001)
    assert parse_sortable_id(sortable_id(a)) == a
    assert sortable_id(a) < sortable_id(b)


def test_a_sortable_id_must_be_version_6() -> None:
    with pytest.raises(InvalidInput):
        parse_sortable_id(str(uuid.uuid4()))


@given(st.binary(min_size=16, max_size=16))
def test_the_quick_uuid_constructor_makes_what_uuid_makes(data: bytes) -> None:
    """uuid_from_bytes sets uuid.UUID's slots itself (QUICK_UUIDS: this fails loudly when a
    Python keeps them otherwise); what it makes is equal, hashed, ordered, printed and pickled
    as uuid.UUID(bytes=...)'s, from bytes, a bytearray or a memoryview."""
    import pickle

    from cassmail.model import QUICK_UUIDS

    assert QUICK_UUIDS, "uuid.UUID no longer keeps its value in the slots int and is_safe"
    made, reference = uuid_from_bytes(data), uuid.UUID(bytes=data)
    assert type(made) is uuid.UUID and made == reference and hash(made) == hash(reference)
    assert (str(made), repr(made), made.bytes, made.version, made.is_safe) == \
        (str(reference), repr(reference), reference.bytes, reference.version, reference.is_safe)
    assert pickle.loads(pickle.dumps(made)) == reference
    assert not made < reference and not made > reference
    assert uuid_from_bytes(bytearray(data)) == uuid_from_bytes(memoryview(data)) == reference
    with pytest.raises(ValueError):
        uuid_from_bytes(data[:15])


def test_uidl_is_printable_short_and_stable() -> None:
    message_id = new_message_id()
    assert uidl(message_id) == uidl(uuid.UUID(str(message_id)))
    assert 1 <= len(uidl(message_id)) <= 70 and all(0x21 <= ord(c) <= 0x7E for c in uidl(message_id))


def test_flags_canonicalise_system_flags_and_check_keywords() -> None:
    assert flag_set(["\\SEEN", "\\answered", "$Junk", "NonJunk"]) == {"\\Seen", "\\Answered", "$Junk", "NonJunk"}
    for bad in (["\\Recent"], ["a b"], ["x]"], ["ü"], [""]):
        with pytest.raises(InvalidInput):
            flag_set(bad)
