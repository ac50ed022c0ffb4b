"""Applying schema/*.cql to a Cassandra cluster: `cassmail schema apply`.

The keyspace, its replication strategy and factors come from settings; the
tables come from the numbered CQL files in schema/. Each file is applied once
and recorded in `schema_migrations`, so later versions only add what is new.
Re-running is safe: every statement is `IF NOT EXISTS`, and a keyspace whose
replication differs from the settings is altered (then run a repair). A keyspace
with no tables yet gets each table in one statement, its later ALTERs written into
its CREATE (`folded`).
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


_CREATE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)\s*\(", re.I)
_ADD = re.compile(r"ALTER TABLE (\w+) ADD IF NOT EXISTS\s+(.+)\Z", re.I | re.S)
_SET = re.compile(r"ALTER TABLE (\w+) WITH\s+(\w+)\s*=\s*(.+)\Z", re.I | re.S)


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one just before `start`."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def _top_level(text: str) -> list[str]:
    """`text` split at the commas outside parentheses and angle brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def folded(statements: list[str]) -> list[str] | None:
    """The same tables in fewer statements, for a keyspace that has none yet: each `ALTER TABLE t
    ADD IF NOT EXISTS` and `ALTER TABLE t WITH` written into t's `CREATE TABLE`. Every schema
    change costs each node a flush of its schema tables (about 0.2 s on one node here, a second
    or more on three), and a keyspace's migrations hold ten such ALTERs. None when a statement
    is of another kind, or would change what a CREATE already says: those are applied one by
    one, as written."""
    out: list[str] = []
    creates: dict[str, int] = {}
    for statement in statements:
        if created := _CREATE.match(statement):
            creates[created.group(1).lower()] = len(out)
            out.append(statement)
            continue
        alter = _ADD.match(statement) or _SET.match(statement)
        if alter is None or alter.group(1).lower() not in creates:
            return None
        at = creates[alter.group(1).lower()]
        create = out[at]
        opened = _CREATE.match(create).end()  # type: ignore[union-attr]
        closed = _closing(create, opened)
        columns, tail = create[opened:closed], create[closed + 1:]
        if alter.re is _ADD:
            added = alter.group(2).strip()
            if added.startswith("(") and _closing(added, 1) == len(added) - 1:
                added = added[1:-1]
            parts, more = [c for c in _top_level(columns) if c], _top_level(added)
            if {c.split()[0].lower() for c in more} & {c.split()[0].lower() for c in parts}:
                return None
            keys = [i for i, c in enumerate(parts) if re.match(r"PRIMARY\s+KEY\b", c, re.I)]
            at_key = keys[0] if keys else len(parts)  # (the columns go before a PRIMARY KEY clause)
            parts[at_key:at_key] = more
            out[at] = f"{create[:opened]}\n    " + ",\n    ".join(parts) + f"\n){tail}"
        else:
            option, value = alter.group(2), alter.group(3).strip()
            if re.search(rf"\b{option}\s*=", tail, re.I) or re.search(r"\bAND\b", value, re.I):
                return None
            joined = "AND" if re.search(r"\bWITH\b", tail, re.I) else "WITH"
            out[at] = f"{create[:closed + 1]}{tail.rstrip()} {joined} {option} = {value}"
    return out


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
        statements = [statement for migration in new for statement in migration.statements]
        if not applied and _tables(session, ks) <= {"schema_migrations"}:
            # A keyspace with no tables yet. (A run cut short leaves whole tables: the next one
            # applies every statement as written, each IF NOT EXISTS.)
            statements = folded(statements) or statements
        for statement in statements:
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


def _tables(session: Session, keyspace: str) -> set[str]:
    rows = session.execute("SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s", (keyspace,))
    return {row.table_name for row in rows}


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
