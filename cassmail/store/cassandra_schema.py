"""Applying schema/*.cql to a Cassandra cluster: `cassmail schema apply`.

The keyspace, its replication strategy and factors come from settings; the
tables come from the numbered CQL files in schema/. Each file is applied once
and recorded in `schema_migrations`, so later versions only add what is new.
Re-running is safe: every statement is `IF NOT EXISTS`, and a keyspace whose
replication differs from the settings is altered (then run a repair).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cassandra.cluster import Cluster, Session

from cassmail.config import CassandraSettings
from cassmail.store.base import StoreError, StoreUnavailable
from cassmail.store.cassandra import CassandraStore
from cassmail.store.cassandra_cql import DRIVER_FAILURES, brief

SCHEMA_DIR = Path(__file__).resolve().parent.parent.parent / "schema"
_FILE = re.compile(r"(\d{3})_([a-z0-9_]+)\.cql\Z")
#: Statements that change the schema (the rest read or write data, which waits for agreement).
SCHEMA_VERBS = frozenset({"CREATE", "ALTER", "DROP"})
#: Seconds `apply` waits for every node to have the schema before it goes on.
AGREEMENT_WAIT = 60.0


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: list[str]


def migrations(directory: Path = SCHEMA_DIR) -> list[Migration]:
    """The schema files in version order. Two files of one version are refused: a keyspace
    records versions only, so the second would never be applied where the first had been."""
    found: list[Migration] = []
    for path in sorted(directory.glob("*.cql")):
        match = _FILE.match(path.name)
        if not match:
            continue
        text = "\n".join(line for line in path.read_text().splitlines() if not line.strip().startswith("--"))
        statements = [s.strip() for s in text.split(";") if s.strip()]
        version = int(match.group(1))
        if found and found[-1].version == version:
            raise StoreError(
                f"schema files {version:03d}_{found[-1].name}.cql and {path.name} in {directory} share "
                f"version {version}: give one of them the next free number"
            )
        found.append(Migration(version, match.group(2), statements))
    if not found:
        raise FileNotFoundError(f"no schema files in {directory}")
    return found


def replication_map(settings: CassandraSettings) -> dict[str, str]:
    if settings.replication_strategy == "NetworkTopologyStrategy":
        return {"class": "NetworkTopologyStrategy", **{dc: str(rf) for dc, rf in settings.datacenters.items()}}
    return {"class": "SimpleStrategy", "replication_factor": str(settings.replication_factor)}


def _cql_map(values: dict[str, str]) -> str:
    return "{" + ", ".join(f"'{k}': '{v}'" for k, v in values.items()) + "}"


def _same_replication(current: dict[str, str], wanted: dict[str, str]) -> bool:
    def norm(m: dict[str, str]) -> dict[str, str]:
        return {k: v.rsplit(".", 1)[-1] for k, v in m.items()}

    return norm(current) == norm(wanted)


def apply(settings: CassandraSettings, directory: Path = SCHEMA_DIR) -> list[str]:
    """Create or update the keyspace and apply new migrations; returns what was done, line by line.

    Every statement goes to one node (the first contact point that answers), one after the
    other, and the nodes' agreement on the schema is awaited before the next statement that reads
    or writes data, not after each change: on a cluster each wait is a round of schema pushes to
    every node (about a second each, on a small machine), and changes made by one coordinator in
    order cannot conflict. The driver waits for agreement as that node sees it, so until every
    node has its schema. So a fresh keyspace waits twice: before `schema_migrations` is read, and
    before the versions applied are recorded, all at the end (every statement is idempotent: a
    run cut short before that applies them again)."""
    store = CassandraStore(settings)
    cluster, session = _connect_one(store)
    done: list[str] = []
    changed = False

    def agree() -> None:
        nonlocal changed
        changed = False
        if not cluster.control_connection.wait_for_schema_agreement(wait_time=AGREEMENT_WAIT):
            done.append(f"warning: nodes did not agree on the schema within {AGREEMENT_WAIT:g} s")

    def execute(statement: str, values: tuple[object, ...] | None = None) -> list[Any]:
        nonlocal changed
        schema = statement.split(None, 1)[0].upper() in SCHEMA_VERBS
        if changed and not schema:
            agree()
        rows = list(session.execute(statement, values, timeout=120))
        changed = changed or schema
        return rows

    try:
        ks = settings.keyspace
        wanted = replication_map(settings)
        current = _current(session, ks)
        if not current:
            execute(f"CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = {_cql_map(wanted)}")
            done.append(f"created keyspace {ks} with {wanted}")
        elif not _same_replication(current, wanted):
            execute(f"ALTER KEYSPACE {ks} WITH replication = {_cql_map(wanted)}")
            done.append(f"altered keyspace {ks} replication to {wanted}: run a full repair on every node")
        session.set_keyspace(ks)
        execute("CREATE TABLE IF NOT EXISTS schema_migrations (version int PRIMARY KEY, name text, applied_at timestamp)")
        applied = {row.version for row in execute("SELECT version FROM schema_migrations")}
        new = [m for m in migrations(directory) if m.version not in applied]
        for migration in new:
            for statement in migration.statements:
                execute(statement)
        for migration in new:
            execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (%s, %s, %s)",
                (migration.version, migration.name, datetime.now(timezone.utc)),
            )
            done.append(f"applied schema {migration.version:03d}_{migration.name}")
        if changed:
            agree()
        return done
    except DRIVER_FAILURES as exc:  # e.g. the node died mid-way: NoHostAvailable is no DriverException
        raise StoreUnavailable(f"schema apply failed: {brief(exc)}") from exc
    finally:
        cluster.shutdown()


def _connect_one(store: CassandraStore) -> tuple[Cluster, Session]:
    """A session whose requests all go to one node, the first contact point that answers."""
    failures = []
    for address in store.settings.contact_points:
        cluster = store._make_cluster(only=address)
        cluster.max_schema_agreement_wait = 0  # (awaited where `apply` says)
        try:
            return cluster, cluster.connect()
        except Exception as exc:  # the driver raises NoHostAvailable (a plain Exception) here
            cluster.shutdown()
            failures.append(brief(exc))
    raise StoreUnavailable(f"cannot reach Cassandra at {store._where()}: {'; '.join(failures)}")


def _current(session: Session, keyspace: str) -> dict[str, str]:
    row = session.execute(
        "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s", (keyspace,)
    ).one()
    return dict(row.replication) if row else {}


def drop(settings: CassandraSettings) -> None:
    """Drop the keyspace and all mail in it. For tests and benchmarks that made their own
    keyspace; deliberately not a `cassmail` command, since it destroys every user's mail."""
    store = CassandraStore(settings)
    cluster = store._make_cluster()
    try:
        cluster.connect().execute(f"DROP KEYSPACE IF EXISTS {settings.keyspace}", timeout=120)
    except DRIVER_FAILURES as exc:
        raise StoreUnavailable(f"cannot drop keyspace {settings.keyspace} at {store._where()}: {brief(exc)}") from exc
    finally:
        cluster.shutdown()


async def apply_async(settings: CassandraSettings) -> list[str]:
    return await asyncio.to_thread(apply, settings)
