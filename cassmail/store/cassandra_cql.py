"""Running CQL for the Cassandra store: the one executor every table object shares.

It owns what is the same for every statement: the session, the consistency level of each
class of statement (read, write, serial read, conditional write), every page of a result,
the retry of a request the driver could never send, turning driver failures into
StoreUnavailable, batches, and the tracing diagnostic. What each table's statements say is
in cassandra_tables.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import random
import re
import threading
import time
import uuid
from collections import namedtuple
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cassandra import ConsistencyLevel, DriverException, ReadTimeout, WriteTimeout, WriteType
from cassandra.cluster import NoHostAvailable, ResponseFuture, Session
from cassandra.connection import ConnectionBusy, ConnectionException
from cassandra.metadata import NetworkTopologyStrategy, SimpleStrategy
from cassandra.policies import RetryPolicy
from cassandra.pool import NoConnectionsAvailable
from cassandra.query import BatchStatement, BatchType, PreparedStatement, Statement

from cassmail.config import CassandraSettings
from cassmail.model import QUICK_UUIDS, uuid_from_bytes
from cassmail.store.base import StoreUnavailable
from cassmail.threads import inbox, settle

#: What the driver raises when Cassandra fails: not all of it derives from DriverException
#: (NoHostAvailable, the connection errors and the pool's are plain Exceptions), so code that
#: turns driver failures into StoreUnavailable catches this whole tuple.
DRIVER_FAILURES: tuple[type[Exception], ...] = (
    DriverException,
    NoHostAvailable,
    ConnectionException,
    ConnectionBusy,
    NoConnectionsAvailable,
)
#: CQL protocol v5's CAS_WRITE_UNKNOWN error (Cassandra 4+): a Paxos proposal was accepted by
#: fewer replicas than a quorum, so its outcome is unknown. The driver (3.x) has no class for it
#: and raises its plain ErrorMessage with this code. Over protocol v4 Cassandra sends the same
#: case as a WriteTimeout of write type CAS.
CAS_WRITE_UNKNOWN = 0x1700
_READ_EVENT = re.compile(r"Read (\d+) live rows? and (\d+) tombstone cells?")


class Kind(enum.Enum):
    """The consistency class of a statement: which configured level it runs at."""

    #: read_consistency.
    READ = "read"
    #: write_consistency.
    WRITE = "write"
    #: serial_consistency: a read that sees every committed lightweight transaction.
    SERIAL_READ = "serial read"
    #: write_consistency, with serial_consistency for its Paxos round (also a plain write that
    #: goes into a conditional batch).
    CONDITIONAL = "conditional"


def reads_see_writes(read_cl: int, write_cl: int, strategy: object) -> bool:
    """Whether a read at `read_cl` sees every write acknowledged at `write_cl` before it began,
    in a keyspace of the driver's replication `strategy`: the replicas the two touch overlap
    (R + W > RF). False where unsure: other strategies, several data centres with LOCAL levels."""
    if isinstance(strategy, SimpleStrategy):
        centres = [strategy.replication_factor]
    elif isinstance(strategy, NetworkTopologyStrategy):
        centres = list(strategy.dc_replication_factors.values())
    else:
        return False
    total = sum(centres)
    if total == 1:
        return True
    one_centre = len(centres) == 1
    levels = ConsistencyLevel
    replicas = {levels.ONE: 1, levels.TWO: 2, levels.THREE: 3, levels.QUORUM: total // 2 + 1, levels.ALL: total,
                levels.LOCAL_ONE: 1, levels.LOCAL_QUORUM: total // 2 + 1 if one_centre else 1}
    return replicas.get(read_cl, 0) + replicas.get(write_cl, 0) > total


def add_serialized(batch: BatchStatement, prepared: PreparedStatement, values: list[bytes | None]) -> None:
    """Add a prepared statement to a batch with its values serialized by the caller (each the
    bytes of its column's type, in the statement's order), past `PreparedStatement.bind` and the
    BoundStatement it makes. Uses the driver's private `BatchStatement._add_statement_and_params`
    (cassandra-driver 3.x, pinned in pyproject.toml;
    tests/test_cassandra_store.py::test_a_batch_takes_statements_with_values_serialized_by_the_store
    fails if it changes)."""
    batch._add_statement_and_params(True, prepared.query_id, values)


@dataclass
class ReadCost:
    """What Cassandra reported reading for the statements run inside `Cql.tracing()`."""

    statements: int = 0
    live_rows: int = 0
    tombstones: int = 0


_tracing: contextvars.ContextVar[ReadCost | None] = contextvars.ContextVar("cassmail_tracing", default=None)


class Cql:
    """The session and the levels of one store; runs statements and makes batches."""

    def __init__(self, settings: CassandraSettings) -> None:
        self.settings = settings
        self._session: Session | None = None
        cl = ConsistencyLevel.name_to_value
        self.read_cl = cl[settings.read_consistency.upper()]
        self.write_cl = cl[settings.write_consistency.upper()]
        self.serial_cl = cl[settings.serial_consistency.upper()]

    @property
    def session(self) -> Session:
        if self._session is None:
            raise StoreUnavailable("store is not open")
        return self._session

    @session.setter
    def session(self, session: Session | None) -> None:
        self._session = session

    @property
    def is_open(self) -> bool:
        return self._session is not None

    def prepare(self, kind: Kind, cql: str) -> PreparedStatement:
        """Prepare one statement (blocking: called off the event loop) at the levels of its kind;
        its table, named unqualified, is qualified with the keyspace."""
        qualified = re.sub(r"\b(FROM|INTO|UPDATE) (\w+)", rf"\1 {self.settings.keyspace}.\2", cql)
        ps = self.session.prepare(qualified)
        if kind is Kind.READ:
            ps.consistency_level = self.read_cl
        elif kind is Kind.SERIAL_READ:
            ps.consistency_level = self.serial_cl
        else:
            ps.consistency_level = self.write_cl
        if kind is Kind.CONDITIONAL:
            ps.serial_consistency_level = self.serial_cl
        return ps

    async def run(self, statement: Statement) -> list[Any]:
        """Run a statement, every page. A request the driver could not even send (its connection
        busy) is retried with backoff until request_timeout, and so is a read at SERIAL that lost
        its Paxos round to contention (`contended`: it changes nothing, and sessions on several
        nodes reading one mailbox at SERIAL while others change it collide); any other failure is
        StoreUnavailable."""
        cost = _tracing.get()
        deadline = time.monotonic() + self.settings.request_timeout
        pause = 0.002
        contentions = 0
        while True:
            try:
                rf = self.session.execute_async(statement, timeout=self.settings.request_timeout, trace=cost is not None)
                rows: list[Any] = []
                while True:
                    page = await _wrap(rf)
                    if page:
                        rows.extend(page)
                    if cost is not None:
                        await asyncio.to_thread(_add_trace, cost, rf)
                    if not rf.has_more_pages:
                        return rows
                    rf.start_fetching_next_page()
            except NoHostAvailable as exc:
                if not _never_sent(exc) or time.monotonic() + pause > deadline:
                    raise StoreUnavailable(f"Cassandra: {brief(exc)}") from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.1)
                continue
            except DriverException as exc:
                failure = StoreUnavailable(f"Cassandra: {brief(exc)}")
                failure.__cause__ = exc
            except StoreUnavailable as exc:  # see _settle
                failure = exc
            wait = contention_pause(contentions)
            if not (_serial_read(statement) and contended(failure)) or time.monotonic() + wait > deadline:
                raise failure
            contentions += 1
            await asyncio.sleep(wait)

    async def conditional(self, statement: Statement, contention_not_applied: bool = False) -> tuple[bool, Any]:
        """Run a conditional statement or batch: (applied, first result row).

        With `contention_not_applied`, a Paxos round that timed out (contention between
        coordinators: its outcome is unknown) answers "not applied" instead of StoreUnavailable,
        for callers that read the state again at SERIAL before they retry, and so find out."""
        try:
            rows = await self.run(statement)
        except StoreUnavailable as exc:
            if contention_not_applied and contended(exc):
                return False, None
            raise
        row = rows[0] if rows else None
        return (bool(row[0]) if row is not None else False), row

    def batch(self, batch_type: BatchType = BatchType.LOGGED, conditional: bool = False,
              statements: Iterable[Statement] = ()) -> BatchStatement:
        """A batch at this store's write level (and serial level, `conditional`), holding `statements`."""
        batch = BatchStatement(batch_type=batch_type, consistency_level=self.write_cl)
        if conditional:
            batch.serial_consistency_level = self.serial_cl
        for statement in statements:
            batch.add(statement)
        return batch

    @staticmethod
    @contextlib.contextmanager
    def tracing() -> Iterator[ReadCost]:
        """Trace every statement run inside (in this task) and add up what Cassandra read.

        A diagnostic: it shows, for example, that a listing does not walk the
        tombstones of deleted mail. Tracing costs a write per statement; never
        leave it on.
        """
        cost = ReadCost()
        token = _tracing.set(cost)
        try:
            yield cost
        finally:
            _tracing.reset(token)


#: Row classes by column names (see `row_factory`), at most this many.
_ROW_CLASSES_KEPT = 1024
_row_classes: dict[tuple[str, ...], Any] = {}


def row_factory(colnames: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[Any]:
    """Rows as named tuples, like the driver's named_tuple_factory, whose class is made once per
    column list: the driver's makes a new namedtuple class for every result, which took about a
    tenth of a worker's CPU under an IMAP load. Names that are not identifiers are cleaned as
    the driver does ("[applied]" is `applied`)."""
    key = tuple(colnames)
    cls = _row_classes.get(key)
    if cls is None:
        names = [re.sub(r"[^a-zA-Z0-9_]", "_", c).strip("_") or "_" for c in key]
        cls = namedtuple("Row", names, rename=True)  # type: ignore[misc]
        if len(_row_classes) < _ROW_CLASSES_KEPT:
            _row_classes[key] = cls
    return [cls(*row) for row in rows]


def _uuid_from_bytes(*, bytes: bytes) -> uuid.UUID:  # noqa: A002 - uuid.UUID's own keyword
    """`model.uuid_from_bytes` called as `uuid.UUID(bytes=...)` (the driver's compiled decoder of uuid)."""
    return uuid_from_bytes(bytes)


def decode_uuids_fast() -> bool:
    """Have the driver decode uuid and timeuuid values with `model.uuid_from_bytes` (with
    uuid.UUID's own, a twentieth of a worker's CPU under an IMAP load went to the id of each row
    of a listing). It decodes them in two places: the types' `deserialize` in cassandra.cqltypes
    (every timeuuid, since its compiled decoder is never picked: cassandra.deserializers names it
    TimeUUIDType where `find_deserializer` looks for DesTimeUUIDType), and for uuid the compiled
    DesUUIDType, which calls its module's `UUID(bytes=...)`. False when either is not where this
    expects it (tests/test_cassandra_store.py fails then); the driver's own decoding is kept
    there."""
    from cassandra import cqltypes

    types = (cqltypes.UUIDType, cqltypes.TimeUUIDType)
    if not QUICK_UUIDS or not all(isinstance(t.__dict__.get("deserialize"), staticmethod) for t in types):
        return False
    try:
        from cassandra import deserializers
    except ImportError:  # the driver without its compiled decoders: cqltypes' alone decode
        deserializers = None
    if deserializers is not None and getattr(deserializers, "UUID", None) not in (uuid.UUID, _uuid_from_bytes):
        return False
    for t in types:
        t.deserialize = staticmethod(uuid_from_bytes)
    if deserializers is not None:
        deserializers.UUID = _uuid_from_bytes
    return True


def _wrap(rf: ResponseFuture) -> asyncio.Future[Any]:
    """An asyncio future for the driver's current page. When the loop serves the store's
    connections (cassandra_io) the driver calls back on the loop's thread, and the future is
    settled at once; from the driver's own threads (its libev thread, or a connection that
    failed or closed there) the outcome is handed to the loop."""
    loop = asyncio.get_running_loop()
    here = threading.get_ident()
    fut: asyncio.Future[Any] = loop.create_future()

    def outcome(result: Any, exc: BaseException | None) -> None:
        if threading.get_ident() == here:
            _settle(fut, result, exc)
        else:
            inbox(loop).put(_settle, fut, result, exc)

    rf.add_callbacks(lambda result: outcome(result, None), lambda exc: outcome(None, exc))
    return fut


def contention_pause(attempt: int) -> float:
    """How long to wait before the next attempt of a Paxos round lost to contention: longer each
    attempt (up to about a second), so that sessions on several nodes contending for one
    partition take turns instead of colliding again."""
    return random.uniform(0.005, min(0.05 * 1.5**attempt, 1.0))


#: Levels of reads that go through Paxos: their timeouts are contention, which `Cql.run` retries.
SERIAL_LEVELS = (ConsistencyLevel.SERIAL, ConsistencyLevel.LOCAL_SERIAL)


def _serial_read(statement: Statement) -> bool:
    return statement.consistency_level in SERIAL_LEVELS


class ReadRetryPolicy(RetryPolicy):
    """The driver's retries, and one more: a read that timed out on its coordinator without the
    answers of the replicas it needed is tried once more through the next node of its query plan.
    The replica the coordinator asked was slow or gone and not known to be down yet (a node killed
    is noticed after seconds of silence; on one busy machine, a connection between two nodes can
    hold a request until it expires), while another replica holds the data; a read changes nothing,
    so trying it again is safe. Paxos reads (their timeouts are contention, retried with a pause by
    `Cql.run`) and writes (a write that timed out may yet be applied) keep the driver's rules."""

    def on_read_timeout(self, query: Any, consistency: int, required_responses: int, received_responses: int,
                        data_retrieved: bool, retry_num: int) -> tuple[int, Any]:
        if retry_num == 0 and received_responses < required_responses and consistency not in SERIAL_LEVELS:
            return self.RETRY_NEXT_HOST, None
        return super().on_read_timeout(query, consistency, required_responses, received_responses,
                                       data_retrieved, retry_num)


def contended(exc: StoreUnavailable) -> bool:
    """True when the failure is a Paxos round (a conditional write or a SERIAL read) that ran out
    of time or of acceptors while other coordinators contended for the same partition: its
    outcome is unknown, and a SERIAL read finds it out. Other failures (replicas down, no
    connection) are not contention."""
    cause = exc.__cause__
    if isinstance(cause, WriteTimeout):
        return cause.write_type == WriteType.CAS
    if isinstance(cause, ReadTimeout):
        return cause.consistency in SERIAL_LEVELS
    return getattr(cause, "code", None) == CAS_WRITE_UNKNOWN


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """`threads.settle`, with a failure the driver reports as a plain exception (a connection
    error, for one) made StoreUnavailable."""
    if exc is not None and not isinstance(exc, (DriverException, NoHostAvailable)):
        unavailable = StoreUnavailable(f"Cassandra: {brief(exc)}")
        unavailable.__cause__ = exc
        exc = unavailable
    settle(fut, result, exc)


def _never_sent(exc: NoHostAvailable) -> bool:
    """True when every host refused the request before sending it (connection busy or out of
    stream ids), so sending it again cannot apply it twice."""
    errors = list(exc.errors.values())
    return bool(errors) and all(isinstance(e, (ConnectionBusy, NoConnectionsAvailable)) for e in errors)


def _add_trace(cost: ReadCost, rf: ResponseFuture) -> None:
    trace = rf.get_query_trace(max_wait=10)
    cost.statements += 1
    for event in trace.events:
        match = _READ_EVENT.search(event.description)
        if match:
            cost.live_rows += int(match.group(1))
            cost.tombstones += int(match.group(2))


def brief(exc: BaseException) -> str:
    """A driver error as one line of at most 300 characters."""
    text = str(exc) or type(exc).__name__
    return text if len(text) < 300 else text[:297] + "..."

