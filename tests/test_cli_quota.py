"""`cassmail user quota` as an operator runs it: a real process against a real Cassandra."""

from __future__ import annotations

import asyncio

import pytest

from cassmail.checkout import CommandError
from cassmail.cli import parse_size
from cassmail.config import CassandraSettings
from cassmail.store.base import Target
from cassmail.store.cassandra import CassandraStore
from tests import test_cli
from tests.test_cli import fails, ok

#: The CLI tests' fixtures: `cassmail` against the test keyspace, a fresh local domain.
run, domain = test_cli.run, test_cli.domain

pytestmark = pytest.mark.cassandra


def deliver(settings: CassandraSettings, user: str, body: bytes) -> None:
    async def go() -> None:
        async with CassandraStore(settings) as store:
            await store.deliver(body, [Target(user)])

    asyncio.run(go())


def test_a_limit_is_shown_set_in_units_recounted_and_removed(run, domain, cassandra_settings) -> None:
    user = f"anne@{domain}"
    ok(run("user", "add", user, "--password-stdin", stdin="pw\n"))
    assert ok(run("user", "quota", user)) == f"user      {user}\nlimit     none\nused      0 bytes (0 bytes)\nmessages  0\n"
    deliver(cassandra_settings, user, b"x" * 3000)
    out = ok(run("user", "quota", user.upper(), "500M"))
    assert "limit     500.0 MiB (524288000 bytes)" in out
    assert "used      2.9 KiB (3000 bytes), 0.0% of the limit" in out and "messages  1" in out
    assert "limit     1.5 GiB (1610612736 bytes)" in ok(run("user", "quota", user, "1.5G"))
    out = ok(run("user", "quota", user, "2K"))
    assert "limit     2.0 KiB (2048 bytes)" in out and "146.5% of the limit" in out
    assert "over quota: new mail is refused until some is deleted" in out
    assert "used      2.9 KiB (3000 bytes)" in ok(run("user", "quota", user, "--recount"))
    assert "limit     none" in ok(run("user", "quota", user, "none"))


def test_quota_refuses_bad_sizes_and_unknown_users_with_one_line(run, domain) -> None:
    user = f"bob@{domain}"
    ok(run("user", "add", user, "--password-stdin", stdin="pw\n"))
    for bad in ("5X", "1e9"):  # (parse_size refuses before connecting: the rest is a unit test's)
        fails(run("user", "quota", user, bad), "not a size")
    fails(run("user", "quota", f"ghost@{domain}", "1G"), "no such user")


@pytest.mark.parametrize("text", ["5X", "-1", "1e9", "M", "10 GB extra", "", "1.5.5G"])
def test_sizes_that_are_not_sizes_are_refused(text: str) -> None:
    with pytest.raises(CommandError, match="not a size"):
        parse_size(text)


def test_sizes_in_powers_of_1024() -> None:
    assert [parse_size(t) for t in ("1024", "500M", "2G", "1.5G", "10KiB", "3 MB", "1t", "none", "None")] == \
        [1024, 500 << 20, 2 << 30, 3 << 29, 10240, 3 << 20, 1 << 40, None, None]
