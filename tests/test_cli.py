"""The `cassmail` command as an operator runs it: a real process against a real Cassandra."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cassmail import auth
from cassmail.config import CassandraSettings
from cassmail.store import cassandra_schema
from cassmail.store.cassandra import CassandraStore

pytestmark = pytest.mark.cassandra

CASSMAIL = str(Path(sys.executable).parent / "cassmail")


@pytest.fixture
def run(cassandra_settings: CassandraSettings):
    env = {
        **os.environ,
        "CASSMAIL_STORE_BACKEND": "cassandra",
        "CASSMAIL_STORE_CASSANDRA_CONTACT_POINTS": ",".join(cassandra_settings.contact_points),
        "CASSMAIL_STORE_CASSANDRA_PORT": str(cassandra_settings.port),
        "CASSMAIL_STORE_CASSANDRA_KEYSPACE": cassandra_settings.keyspace,
        "CASSMAIL_STORE_CASSANDRA_READ_CONSISTENCY": "ONE",
        "CASSMAIL_STORE_CASSANDRA_WRITE_CONSISTENCY": "ONE",
        "CASSMAIL_AUTH_SCRYPT_N": "1024",
    }
    env.pop("CASSMAIL_CONFIG", None)

    def invoke(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CASSMAIL, *args], input=stdin, capture_output=True, text=True, env=env, timeout=300,
            stdin=None if stdin is not None else subprocess.DEVNULL,
        )

    return invoke


@pytest.fixture
def domain(run) -> str:
    name = f"cli{uuid.uuid4().hex[:8]}.example"
    assert run("domain", "add", name).returncode == 0
    return name


def stored_hash(settings: CassandraSettings, address: str) -> str:
    async def read() -> str:
        async with CassandraStore(settings) as store:
            return await store.get_password_hash(address)

    return asyncio.run(read())


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def fails(result: subprocess.CompletedProcess[str], text: str) -> None:
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith("cassmail: error: ") and text in result.stderr
    assert "Traceback" not in result.stderr


def test_a_cassmail_process_imports_the_driver_without_twisteds_default_reactor() -> None:
    """The driver's Twisted connection class (and with it Twisted's default reactor, a third of
    a command's time) is not imported by a process that imports cassmail; the driver then has
    no `TwistedConnection`, as it allows. Fails when a driver release renames the module."""
    script = ("import sys, cassmail.store.cassandra, cassandra.cluster; "
              "print(cassandra.cluster.TwistedConnection, 'twisted.internet.reactor' in sys.modules, "
              "cassandra.cluster.DefaultConnection.__name__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["None", "False", "LibevConnection"], out.stdout + out.stderr
    without = subprocess.run([sys.executable, "-c", "import sys, cassandra.cluster; "
                              "print('twisted.internet.reactor' in sys.modules)"],
                             capture_output=True, text=True, timeout=60, check=True)
    assert without.stdout.strip() == "True", "the driver no longer imports Twisted's reactor: drop the guard"


def test_schema_apply_creates_a_keyspace_then_reports_it_up_to_date(run, cassandra_settings) -> None:
    keyspace = f"cmcli_{uuid.uuid4().hex[:8]}"
    try:
        out = ok(run("--set", f"store.cassandra.keyspace={keyspace}", "schema", "apply"))
        assert f"created keyspace {keyspace}" in out and "applied schema 001_initial" in out
        assert "up to date" in ok(run("-o", f"store.cassandra.keyspace={keyspace}", "schema", "apply"))
    finally:
        cassandra_schema.drop(dataclasses.replace(cassandra_settings, keyspace=keyspace))


def test_domains_are_added_listed_and_deleted(run) -> None:
    name = f"CLI{uuid.uuid4().hex[:8]}.Example"
    assert ok(run("domain", "add", name)) == f"added {name.lower()}\n"
    assert name.lower() in ok(run("domain", "list")).split()
    ok(run("domain", "del", name))
    assert name.lower() not in ok(run("domain", "list")).split()
    fails(run("domain", "del", name), "not a local domain")


def test_user_lifecycle_add_list_passwd_mailboxes_del(run, domain, cassandra_settings) -> None:
    address = f"anne@{domain}"
    assert ok(run("user", "add", address, "--password-stdin", stdin="first secret\n")) == f"created {address}\n"
    fails(run("user", "add", address, "--password-stdin", stdin="again\n"), "already exists")
    assert ok(run("user", "list", "--domain", domain)) == f"{address}\n"
    ok(run("user", "passwd", address.upper(), "--password-stdin", stdin="second secret\n"))

    stored = stored_hash(cassandra_settings, address)
    assert auth.verify_password("second secret", stored) and not auth.verify_password("first secret", stored)

    table = ok(run("mailbox", "list", address)).splitlines()
    assert table[0].split() == ["MAILBOX", "SPECIAL-USE", "UIDVALIDITY", "MESSAGES", "BYTES"]
    assert [line.split()[0] for line in table[1:]] == ["INBOX", "Archive", "Drafts", "Junk", "Sent", "Trash"]
    assert table[5].split()[1] == "\\Sent" and table[1].split()[-2:] == ["0", "0"]

    fails(run("domain", "del", domain), "still has 1 user")
    ok(run("user", "del", address))
    assert ok(run("user", "list", "--domain", domain)) == ""
    fails(run("mailbox", "list", address), "no such user")


def test_user_commands_refuse_bad_input_with_one_line(run, domain) -> None:
    fails(run("user", "add", "not-an-address", "--password-stdin", stdin="pw\n"), "not an address")
    fails(run("user", "add", f"x@elsewhere-{uuid.uuid4().hex[:6]}.example", "--password-stdin", stdin="pw\n"), "not a local domain")
    fails(run("user", "add", f"bob@{domain}"), "no terminal to prompt for a password")
    fails(run("user", "add", f"bob@{domain}", "--password-stdin", stdin="\n"), "empty password")
    fails(run("user", "passwd", f"ghost@{domain}", "--password-stdin", stdin="pw\n"), "no such user")
    fails(run("user", "del", f"ghost@{domain}"), "no such user")
    fails(run("-o", "store.backend=sqlite", "user", "list"), "store.backend: must be")


def test_an_unreachable_cassandra_is_one_line_not_a_traceback(run) -> None:
    fails(run("-o", "store.cassandra.port=1", "-o", "store.cassandra.connect_timeout=2", "user", "list"), "cannot reach Cassandra")


def test_usage_errors_exit_2(run) -> None:
    assert run().returncode == 2
    assert run("user", "frobnicate").returncode == 2


def test_bulk_import_of_thousands_of_users_in_one_process(run, domain, tmp_path, cassandra_settings) -> None:
    lines = [f"user{i}@{domain} password-{i} with spaces" for i in range(2000)]
    lines[10:10] = ["# a comment", "", "broken-line-without-password", f"bad address@{domain} pw"]
    path = tmp_path / "users.txt"
    path.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    result = run("user", "import", str(path))
    elapsed = time.monotonic() - started
    assert result.returncode == 1  # two bad lines are reported, the rest imported
    assert "imported 2000 user(s)" in result.stdout and "2 error(s)" in result.stdout
    assert "line 13: expected 'address password'" in result.stderr and "line 14: not an address" in result.stderr
    assert elapsed < 120
    users = ok(run("user", "list", "--domain", domain)).split()
    assert len(users) == 2000
    # the password is the rest of the line, spaces included, and it was hashed
    assert auth.verify_password("password-7 with spaces", stored_hash(cassandra_settings, f"user7@{domain}"))


def test_import_from_stdin_and_of_existing_hashes(run, domain) -> None:
    hashed = auth.hash_password("from-elsewhere", auth.HashParams(log2_n=10))
    out = ok(run("user", "import", "-", "--hashed", stdin=f"a@{domain} {hashed}\nb@{domain} {hashed}\n"))
    assert "imported 2 user(s)" in out
    result = run("user", "import", "-", "--hashed", stdin=f"c@{domain} plaintext\na@{domain} {hashed}\n")
    assert result.returncode == 1
    assert "line 1: not a $scrypt$ hash" in result.stderr and "line 2: a@" in result.stderr and "already exists" in result.stderr


def test_cassandra_dying_during_schema_apply_is_one_line(cassandra_settings, monkeypatch, capsys) -> None:
    """Fault injection in-process: NoHostAvailable (not a DriverException) after the connection."""
    from cassandra.cluster import NoHostAvailable, Session
    from cassandra.connection import ConnectionShutdown

    from cassmail import cli

    keyspace = f"cmdie_{uuid.uuid4().hex[:8]}"
    real_execute = Session.execute

    def dies(self: Session, query: object, *args: object, **kwargs: object) -> object:
        if "schema_migrations" in str(query):
            raise NoHostAvailable("Unable to complete the operation against any hosts", {"x": ConnectionShutdown("gone")})
        return real_execute(self, query, *args, **kwargs)

    monkeypatch.delenv("CASSMAIL_CONFIG", raising=False)
    monkeypatch.setattr(Session, "execute", dies)
    host = cassandra_settings.contact_points[0]
    try:
        status = cli.main(["-o", f"store.cassandra.contact_points={host}", "-o", f"store.cassandra.port={cassandra_settings.port}",
                           "-o", f"store.cassandra.keyspace={keyspace}", "schema", "apply"])
        err = capsys.readouterr().err
        assert status == 1
        assert err.startswith("cassmail: error: schema apply failed: ") and err.count("\n") == 1
    finally:
        monkeypatch.undo()
        cassandra_schema.drop(dataclasses.replace(cassandra_settings, keyspace=keyspace))


def test_schema_apply_against_a_port_where_nothing_listens_is_one_line(run) -> None:
    fails(run("-o", "store.cassandra.port=1", "-o", "store.cassandra.connect_timeout=2", "schema", "apply"),
          "cannot reach Cassandra at ")


def test_aliases_are_added_replaced_listed_and_deleted(run, domain) -> None:
    for name in ("anne", "bob"):
        ok(run("user", "add", f"{name}@{domain}", "--password-stdin", stdin=f"{name}\n"))
    anne, bob = f"anne@{domain}", f"bob@{domain}"
    assert ok(run("alias", "add", f"Team@{domain}", bob.upper(), anne)) == f"alias team@{domain} -> {anne}, {bob}\n"
    assert ok(run("alias", "add", f"info@{domain}", anne)) == f"alias info@{domain} -> {anne}\n"
    assert ok(run("alias", "list", "--domain", domain)) == f"info@{domain} -> {anne}\nteam@{domain} -> {anne}, {bob}\n"
    ok(run("alias", "add", f"team@{domain}", bob))  # replaces the users
    assert f"team@{domain} -> {bob}\n" in ok(run("alias", "list"))
    fails(run("domain", "del", domain), "still has 2 user(s) and 2 alias(es)")
    # deleting a user takes them out of every alias; an alias left empty goes
    ok(run("user", "del", anne))
    assert ok(run("alias", "list", "--domain", domain)) == f"team@{domain} -> {bob}\n"
    assert ok(run("alias", "del", f"TEAM@{domain}")) == f"deleted alias team@{domain}\n"
    assert ok(run("alias", "list", "--domain", domain)) == ""
    ok(run("user", "del", bob))
    ok(run("domain", "del", domain))


def test_alias_commands_refuse_bad_input_with_one_line(run, domain) -> None:
    anne = f"anne@{domain}"
    ok(run("user", "add", anne, "--password-stdin", stdin="anne\n"))
    fails(run("alias", "add", f"team@elsewhere-{uuid.uuid4().hex[:6]}.example", anne), "not a local domain")
    fails(run("alias", "add", anne, anne), f"user already exists: {anne}; an alias cannot have a user's address")
    fails(run("alias", "add", f"team@{domain}", anne, f"ghost@{domain}"), f"no such user: ghost@{domain}")
    fails(run("alias", "add", "not-an-address", anne), "not an address")
    fails(run("alias", "del", f"team@{domain}"), f"no such alias: team@{domain}")
    ok(run("alias", "add", f"team@{domain}", anne))
    fails(run("user", "add", f"team@{domain}", "--password-stdin", stdin="pw\n"), f"team@{domain} is an alias")
    assert run("alias", "add", f"team@{domain}").returncode == 2  # no user: a usage error


def test_schema_apply_on_a_keyspace_of_an_older_version_adds_only_what_is_new(run, cassandra_settings, tmp_path) -> None:
    keyspace = f"cmold_{uuid.uuid4().hex[:8]}"
    older = tmp_path / "schema"
    older.mkdir()
    for path in sorted(cassandra_schema.SCHEMA_DIR.glob("00[12]_*.cql")):
        (older / path.name).write_text(path.read_text())
    old_settings = dataclasses.replace(cassandra_settings, keyspace=keyspace)
    try:
        assert cassandra_schema.apply(old_settings, older)[-1] == "applied schema 002_low_water_due"
        # until the new version is applied, commands (and nodes) stop with one line saying what to run
        fails(run("-o", f"store.cassandra.keyspace={keyspace}", "user", "list"), "has `cassmail schema apply` run?")
        out = ok(run("-o", f"store.cassandra.keyspace={keyspace}", "schema", "apply"))
        assert out == ("applied schema 003_aliases\napplied schema 004_recent\napplied schema 005_changes\napplied schema 006_outbound\n"
                       "applied schema 007_sieve\napplied schema 008_modseq\napplied schema 009_events\napplied schema 010_quota\n"
                       "applied schema 011_counts\napplied schema 012_plain_bodies\napplied schema 013_body_compaction\n"
                       "applied schema 014_view_snapshots\napplied schema 015_modseq_runs\napplied schema 016_sieve_mark\n")
        domain = f"old{uuid.uuid4().hex[:6]}.example"
        ok(run("-o", f"store.cassandra.keyspace={keyspace}", "domain", "add", domain))
        ok(run("-o", f"store.cassandra.keyspace={keyspace}", "user", "add", f"a@{domain}", "--password-stdin", stdin="pw\n"))
        ok(run("-o", f"store.cassandra.keyspace={keyspace}", "alias", "add", f"b@{domain}", f"a@{domain}"))
    finally:
        cassandra_schema.drop(old_settings)
