"""Password hashing: salted scrypt, self-describing, constant-time checks, safe on malformed input;
the session-auth path every protocol shares: throttling, SASL decoding, the clear-text policy, the
failure count, the STARTTLS drop."""

from __future__ import annotations

import asyncio
import base64
import os

from cassmail import auth
from cassmail.auth import HashParams
from cassmail.config import AuthSettings, ImapSettings, Pop3Settings

FAST = HashParams(log2_n=10)


def test_a_hash_verifies_its_password_only() -> None:
    stored = auth.hash_password("correct horse", FAST)
    assert stored.startswith("$scrypt$ln=10,r=8,p=1$")
    assert auth.verify_password("correct horse", stored)
    assert not auth.verify_password("correct horsE", stored)
    assert not auth.verify_password("", stored)


def test_the_same_password_gets_a_new_salt_every_time() -> None:
    assert auth.hash_password("pw", FAST) != auth.hash_password("pw", FAST)


def test_unicode_passwords_work() -> None:
    stored = auth.hash_password("pässwörd-密码", FAST)
    assert auth.verify_password("pässwörd-密码", stored)


def test_malformed_stored_hashes_and_inputs_never_raise() -> None:
    good = auth.hash_password("pw", FAST)
    for stored in ("", "plaintext", "$scrypt$ln=99,r=8,p=1$AAAA$AAAA", "$scrypt$ln=10,r=8,p=1$!!$!!", good[:-5] + "$$$"):
        assert not auth.verify_password("pw", stored)
    assert not auth.verify_password("x" * 5000, good)
    assert not auth.verify_password(None, good)  # type: ignore[arg-type]


def test_the_cost_comes_from_settings_and_old_hashes_still_verify() -> None:
    params = HashParams.from_settings(AuthSettings(scrypt_n=2**11, scrypt_r=4, scrypt_p=2))
    assert params == HashParams(11, 4, 2)
    old = auth.hash_password("pw", FAST)
    assert auth.needs_rehash(old, params)
    assert auth.verify_password("pw", old)
    assert not auth.needs_rehash(auth.hash_password("pw", params), params)


def test_default_cost_is_the_interactive_login_setting() -> None:
    assert HashParams.from_settings(AuthSettings()) == HashParams(14, 8, 1)


def test_bulk_hashing_and_async_checks() -> None:
    hashes = auth.hash_many([f"pw{i}" for i in range(20)], FAST)
    assert len(set(hashes)) == 20
    assert asyncio.run(auth.verify_async("pw7", hashes[7]))
    assert not asyncio.run(auth.verify_async("pw7", hashes[8]))


def test_the_throttle_counts_each_attempt_when_it_starts_and_doubles_the_wait() -> None:
    throttle = auth.FailureThrottle(delay=1.0, window=60, free=2, max_delay=5)
    # Three attempts at once: the third already sees the two before it, though none has failed yet.
    assert [throttle.attempt("10.0.0.1", "anne@x.example", now=0) for _ in range(3)] == [0, 0, 1.0]
    assert throttle.penalty("10.0.0.9", "anne@x.example", now=1) == 2.0  # per user, from anywhere
    assert throttle.penalty("10.0.0.1", "bob@x.example", now=1) == 2.0  # per peer, for anyone
    assert throttle.penalty("10.0.0.9", "bob@x.example", now=1) == 0
    for t in range(2, 9):
        throttle.attempt("10.0.0.1", "anne@x.example", now=t)
    assert throttle.penalty("10.0.0.1", "anne@x.example", now=10) == 5  # capped
    assert throttle.penalty("10.0.0.1", "anne@x.example", now=100) == 0  # the window passed


def test_a_success_clears_its_peer_and_user_and_an_unchecked_attempt_is_taken_back() -> None:
    throttle = auth.FailureThrottle(delay=1.0)
    for _ in range(3):
        throttle.attempt("10.0.0.1", "anne@x.example")
        throttle.attempt("10.0.0.2", "carol@x.example")
    throttle.attempt("10.0.0.1", "anne@x.example")
    throttle.succeeded("10.0.0.1", "anne@x.example")
    assert throttle.penalty("10.0.0.1", "anne@x.example") == 0
    assert throttle.penalty("10.0.0.1", "carol@x.example") > 0  # carol's own count stays
    throttle.attempt("10.0.0.3", "bob@x.example")
    throttle.taken_back("10.0.0.3", "bob@x.example")  # the store could not check it
    assert throttle.table.count("peer:10.0.0.3", throttle.window) == 0


def test_the_attempt_table_has_a_fixed_size_and_forgets_the_oldest_first() -> None:
    table = auth.FailureTable(capacity=64)
    size = len(table._map)
    for i in range(5000):
        table.add([f"peer:10.0.{i // 256}.{i % 256}"], 1, window=1e9, now=float(i))
    assert len(table._map) == size == 64 * auth.FailureTable.SLOT.size
    assert table.count("peer:10.0.19.135", 1e9, now=5000.0) == 1  # the last one is kept
    assert table.count("peer:10.0.0.0", 1e9, now=5000.0) == 0  # the first long forgotten
    off = auth.FailureThrottle(delay=0)
    for _ in range(10):
        off.attempt("10.0.0.1", None)
    assert off.penalty("10.0.0.1", None) == 0


def test_worker_processes_forked_from_one_node_count_in_one_table() -> None:
    table = auth.FailureTable(capacity=256)
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for _ in range(250):
                    table.add(["peer:192.0.2.1", "user:anne@x.example"], 1, window=60)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    assert all(os.waitpid(pid, 0)[1] == 0 for pid in children)
    assert table.count("peer:192.0.2.1", 60) == table.count("user:anne@x.example", 60) == 1000  # none lost


def test_sasl_responses_decode_strictly_in_one_place() -> None:
    plain = base64.b64encode(b"admin\0anne@example.com\0s3cr\xc3\xa9t")
    assert auth.decode_base64(plain) == b"admin\0anne@example.com\0s3cr\xc3\xa9t"
    assert auth.decode_base64(b"YW5u ZQ==") is None and auth.decode_base64(b"YW5uZQ") is None
    assert auth.decode_base64(b"") == b""
    assert auth.split_plain(b"\0anne\0pw") == (b"anne", b"pw")
    assert auth.split_plain(b"anne\0pw") is None and auth.split_plain(b"a\0b\0c\0d") is None
    assert auth.decode_plain(b" " + plain + b"\r\n") == ("anne@example.com", "s3crét")
    assert auth.decode_plain(base64.b64encode(b"anne\0pw")) is None
    assert auth.decode_plain(b"not base64!") is None
    assert auth.cancelled(b"*\r\n") and auth.cancelled(b" * ")
    assert not auth.cancelled(b"**") and not auth.cancelled(plain)


def test_the_clear_text_policy_and_the_failure_count_come_from_the_listeners_settings() -> None:
    strict = auth.Logins("imap", ImapSettings(max_auth_failures=2))
    lenient = auth.Logins("pop3", Pop3Settings(allow_plaintext_auth=True))
    assert strict.plaintext_ok(secure=True) and not strict.plaintext_ok(secure=False)
    assert lenient.plaintext_ok(secure=True) and lenient.plaintext_ok(secure=False)
    first, second = strict.failures(), strict.failures()
    assert first.add() is False and first.add() is True  # the second wrong password closes it
    assert second.count == 0  # each session counts its own
    assert [lenient.failures().limit, strict.failures().limit] == [Pop3Settings().max_auth_failures, 2]


def test_what_came_behind_starttls_in_clear_text_is_dropped_and_logged(caplog) -> None:
    pending = bytearray(b"a1 LOGIN anne secret\r\na2 SEL")
    with caplog.at_level("WARNING", logger="cassmail.auth"):
        assert auth.drop_clear_text(pending, "imap", "192.0.2.7") == 28
        assert auth.drop_clear_text(pending, "imap", "192.0.2.7") == 0
    assert pending == b""
    assert [r.getMessage() for r in caplog.records] == ["event=imap-starttls peer=192.0.2.7 dropped_bytes=28"]
