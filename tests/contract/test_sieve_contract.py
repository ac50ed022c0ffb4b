"""The Sieve part of the Store contract (scripts, the active mark, vacation records), on every backend."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cassmail.model import InvalidInput
from cassmail.store.base import (
    NoSuchSieveScript,
    NoSuchUser,
    SieveScriptActive,
    SieveScriptExists,
    SieveScriptInfo,
    Store,
)
from tests.conftest import FAST_HASH, hash_password

pytestmark = pytest.mark.cassandra

SCRIPT = 'require "fileinto";\r\nif header :contains "subject" "x" { fileinto "Junk"; }\r\n'


async def test_scripts_are_kept_listed_and_replaced(store: Store, user: str) -> None:
    assert await store.list_sieve_scripts(user) == []
    assert await store.active_sieve_script(user) is None
    await store.put_sieve_script(user, "main", SCRIPT)
    await store.put_sieve_script(user, "Entwürfe/日本", "keep;")
    assert await store.get_sieve_script(user, "main") == SCRIPT
    assert await store.get_sieve_script(user.upper(), "Entwürfe/日本") == "keep;"
    assert await store.list_sieve_scripts(user) == [SieveScriptInfo("Entwürfe/日本", False), SieveScriptInfo("main", False)]
    await store.put_sieve_script(user, "main", "discard;")
    assert await store.get_sieve_script(user, "main") == "discard;"
    with pytest.raises(NoSuchSieveScript):
        await store.get_sieve_script(user, "nothing")


async def test_names_of_128_characters_of_any_kind_are_kept(store: Store, user: str) -> None:
    """RFC 5804 1.6: 128 Unicode characters, which as UTF-8 (or escaped for a file name) can be far
    longer than a file system allows in one name."""
    long_names = ["é" * 128, "/" * 128, "日" * 127 + "x", "%" * 128]
    for n, name in enumerate(long_names):
        await store.put_sieve_script(user, name, f"# {n}\r\nkeep;")
    assert [s.name for s in await store.list_sieve_scripts(user)] == sorted(long_names)
    assert await store.get_sieve_script(user, "é" * 128) == "# 0\r\nkeep;"
    await store.set_active_sieve_script(user, "/" * 128)
    assert await store.active_sieve_script(user) == ("/" * 128, "# 1\r\nkeep;")
    await store.rename_sieve_script(user, "/" * 128, "short")
    await store.rename_sieve_script(user, "short", "ü" * 128)
    assert await store.active_sieve_script(user) == ("ü" * 128, "# 1\r\nkeep;")
    with pytest.raises(SieveScriptExists):
        await store.rename_sieve_script(user, "é" * 128, "ü" * 128)
    await store.delete_sieve_script(user, "é" * 128)
    with pytest.raises(NoSuchSieveScript):
        await store.get_sieve_script(user, "é" * 128)
    assert [s.name for s in await store.list_sieve_scripts(user)] == sorted(["ü" * 128, "日" * 127 + "x", "%" * 128])


async def test_one_script_is_active_and_runs_until_deactivated(store: Store, user: str) -> None:
    await store.put_sieve_script(user, "a", "keep;")
    await store.put_sieve_script(user, "b", "discard;")
    await store.set_active_sieve_script(user, "a")
    assert await store.active_sieve_script(user) == ("a", "keep;")
    await store.set_active_sieve_script(user, "b")
    assert await store.active_sieve_script(user) == ("b", "discard;")
    assert [s.active for s in await store.list_sieve_scripts(user)] == [False, True]
    await store.put_sieve_script(user, "b", "stop;")  # replacing keeps it active
    assert await store.active_sieve_script(user) == ("b", "stop;")
    with pytest.raises(NoSuchSieveScript):
        await store.set_active_sieve_script(user, "c")
    assert await store.active_sieve_script(user) == ("b", "stop;")
    with pytest.raises(SieveScriptActive):
        await store.delete_sieve_script(user, "b")
    await store.set_active_sieve_script(user, None)
    assert await store.active_sieve_script(user) is None
    await store.delete_sieve_script(user, "b")
    with pytest.raises(NoSuchSieveScript):
        await store.delete_sieve_script(user, "b")
    assert [s.name for s in await store.list_sieve_scripts(user)] == ["a"]


async def test_rename_keeps_the_text_and_the_active_mark(store: Store, user: str) -> None:
    await store.put_sieve_script(user, "old", SCRIPT)
    await store.put_sieve_script(user, "other", "keep;")
    await store.set_active_sieve_script(user, "old")
    with pytest.raises(SieveScriptExists):
        await store.rename_sieve_script(user, "old", "other")
    await store.rename_sieve_script(user, "old", "new")
    assert await store.active_sieve_script(user) == ("new", SCRIPT)
    assert await store.list_sieve_scripts(user) == [SieveScriptInfo("new", True), SieveScriptInfo("other", False)]
    with pytest.raises(NoSuchSieveScript):
        await store.rename_sieve_script(user, "old", "again")


async def test_bad_names_and_unknown_users_are_refused(store: Store, user: str, domain: str) -> None:
    for name in ("", "a\nb", "x" * 129, "tab\there"):
        with pytest.raises(InvalidInput):
            await store.put_sieve_script(user, name, "keep;")
    with pytest.raises(InvalidInput):
        await store.put_sieve_script(user, "big", "#" * ((1 << 20) + 1))
    with pytest.raises(NoSuchUser):
        await store.put_sieve_script(f"nobody@{domain}", "a", "keep;")
    with pytest.raises(NoSuchUser):
        await store.list_sieve_scripts(f"nobody@{domain}")
    assert await store.active_sieve_script(f"nobody@{domain}") is None


async def test_a_deleted_user_takes_its_scripts_along(store: Store, domain: str) -> None:
    address = f"gone@{domain}"
    await store.create_user(address, hash_password("pw", FAST_HASH))
    await store.put_sieve_script(address, "main", "discard;")
    await store.set_active_sieve_script(address, "main")
    assert await store.note_vacation(address, "ab" * 16, 3600)
    await store.delete_user(address)
    await store.create_user(address, hash_password("pw", FAST_HASH))
    assert await store.list_sieve_scripts(address) == []
    assert await store.active_sieve_script(address) is None
    assert await store.note_vacation(address, "ab" * 16, 3600)


async def test_a_vacation_reply_is_noted_once_per_period(store: Store, user: str) -> None:
    key = uuid.uuid4().hex
    assert await store.note_vacation(user, key, 3600) is True
    assert await store.note_vacation(user, key, 3600) is False
    assert await store.note_vacation(user, uuid.uuid4().hex, 3600) is True
    short = uuid.uuid4().hex
    assert await store.note_vacation(user, short, 1) is True
    await asyncio.sleep(1.5)  # past the period, also in whole seconds (Cassandra's TTL)
    assert await store.note_vacation(user, short, 1) is True
    with pytest.raises(InvalidInput):
        await store.note_vacation(user, "../x", 10)


async def test_concurrent_notes_of_one_reply_let_one_through(store: Store, user: str) -> None:
    key = uuid.uuid4().hex
    results = await asyncio.gather(*(store.note_vacation(user, key, 3600) for _ in range(5)))
    assert results.count(True) == 1
