"""Fault tests on a 3-node local cluster: the CassMail paper's availability experiment and more.

One cluster serves the whole module, brought up by the real command
(`cassmail cluster up --nodes 3 --rf 2`, reads and writes at ONE as in the paper) on ports
of its own (CQL 39042, storage 37000, front ends on free ports), so it never meets
a developer's cluster or the suite's own Cassandra. The outage runs once, as a
module fixture: a steady SMTP load spread over the three nodes, node 3's Cassandra
SIGKILLed, POP3/IMAP sessions and the RF x CL matrix measured while it is down,
the node started again, every message read back through every node. The tests
then check what the experiment recorded, one promise each.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import imaplib
import json
import os
import poplib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from cassmail.cluster import active_config, ownership
from cassmail.config import CassandraSettings, Settings
from cassmail.store import cassandra_schema
from cassmail.store.base import Target
from cassmail.store.cassandra import CassandraStore
from tests import imap_stress
from tests.cluster_clients import Outcome, imap_read, make_message, pop3_read, smtp_send, subject_of
from tests.conftest import FAST_HASH, hash_password, unavailable
from tests.nodes import Node, free_port
from tests.outbound_peers import RemoteMx

pytestmark = pytest.mark.cassandra

NODES = 3
NATIVE_PORT = 39042
STORAGE_PORT = 37000
HEAP_MB = 512
DOMAIN = "cluster.test"
DOWN = 3  # the node whose Cassandra the outage kills
LEVELS = ("ONE", "QUORUM", "ALL")
#: The replication factors of the RF x CL matrix: the cluster's own keyspace (RF=2) and one more
#: keyspace per other RF. RF=1 adds a keyspace's schema and three front ends to the run, so it is
#: measured from the command line (CASSMAIL_MATRIX_RFS=1,2,3), not in every run of the suite.
MATRIX_RFS = tuple(sorted({2, *(int(rf) for rf in os.environ.get("CASSMAIL_MATRIX_RFS", "2,3").split(","))}))
STRESS_SECONDS = float(os.environ.get("CASSMAIL_STRESS_SECONDS", "10"))
OUTBOUND = "outbound.test"  # a remote domain, reached through the front ends' transport map
LEASE = 6.0

@dataclasses.dataclass
class Cluster:
    """The module's cluster, driven through the `cassmail` command as an operator would."""

    base: Path
    env: dict[str, str]
    ports: dict[str, int]
    up_output: str
    #: Where the front ends' transport map sends mail for OUTBOUND (the remote MX of the tests).
    outbound_port: int = 0

    def cli(self, *args: str, timeout: float = 600, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cassmail.cli", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, input=stdin,
                              stdin=None if stdin is not None else subprocess.DEVNULL)

    def must(self, *args: str, **kw: Any) -> str:
        done = self.cli(*args, **kw)
        assert done.returncode == 0, f"cassmail {' '.join(args)}: {done.stderr}{done.stdout}"
        return done.stdout

    def address(self, i: int) -> str:
        return f"127.0.0.{i}"

    def store_settings(self, **changes: Any) -> CassandraSettings:
        state = json.loads((self.base / "cluster.json").read_text())
        settings = CassandraSettings(
            contact_points=[self.address(i) for i in range(1, NODES + 1)], port=NATIVE_PORT,
            keyspace=state["keyspace"], replication_factor=state["rf"], read_consistency="QUORUM",
            write_consistency="QUORUM", serial_consistency="SERIAL",
        )
        return dataclasses.replace(settings, **changes)

    def system_log(self, i: int) -> str:
        return (self.base / "cassandra" / f"node{i}" / "logs" / "system.log").read_text(errors="replace")


def _free_ports() -> dict[str, int]:
    ports: dict[str, int] = {}
    while len(set(ports.values())) < 4:
        ports = {name: free_port() for name in ("smtp", "submission", "pop3", "imap")}
    return ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("cluster")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_") or k == "CASSMAIL_CACHE"}
    env["CASSMAIL_CLUSTER"] = str(base)
    ports = _free_ports()
    handle = Cluster(base, env, ports, "", outbound_port=free_port())
    started = handle.cli(
        "-o", "store.cassandra.read_consistency=ONE", "-o", "store.cassandra.write_consistency=ONE",
        "-o", "store.cassandra.serial_consistency=SERIAL", "-o", "auth.scrypt_n=1024",
        # Outbound mail: every front end delivers, through the transport map to the test's MX;
        # leases and retries short, so a dead node's mail moves on within seconds.
        "-o", f'relay.transport={{"{OUTBOUND}" = "[127.0.0.1]:{handle.outbound_port}"}}',
        "-o", f"delivery.lease={LEASE}", "-o", "delivery.poll_interval=0.5", "-o", "delivery.min_backoff=2",
        "-o", "delivery.max_backoff=4", "-o", "relay.timeout=30",
        "cluster", "up", "--nodes", str(NODES), "--rf", "2", "--heap-mb", str(HEAP_MB),
        "--native-port", str(NATIVE_PORT), "--storage-port", str(STORAGE_PORT),
        *(arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))),
        timeout=900,
    )
    try:
        if started.returncode != 0:
            unavailable(f"cassmail cluster up failed: {started.stderr[-3000:]}")
        handle.up_output = started.stdout
        yield handle
    finally:
        started_pids = _cluster_pids(base)
        down = handle.cli("cluster", "down", timeout=300)
        assert down.returncode == 0, down.stderr
        assert not [pid for pid in started_pids if _alive(pid)], "cluster down left processes running"


def _cluster_pids(base: Path) -> list[int]:
    """Every process `cluster up` recorded: the front ends and the Cassandra nodes."""
    pids = []
    for path, key in ((base / "cluster.json", "frontends"), (base / "cassandra" / "state.json", "nodes")):
        if path.is_file():
            pids += [entry["pid"] for entry in json.loads(path.read_text()).get(key, []) if entry.get("pid")]
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _prepare(settings: CassandraSettings, users: list[str], messages_each: int) -> None:
    """Users (password = their local part) with messages already in their INBOX."""
    async with CassandraStore(settings) as store:
        await store.add_domain(DOMAIN)
        for user in users:
            await store.create_user(user, hash_password(user.split("@")[0], FAST_HASH))
            for k in range(messages_each):
                await store.deliver(make_message(f"pre-{user.split('@')[0]}-{k}"), [Target(user)])


def _users(prefix: str, count: int = 6) -> list[str]:
    return [f"{prefix}{k}@{DOMAIN}" for k in range(count)]


def _password(user: str) -> str:
    return user.split("@")[0]


# ----------------------------------------------------------------------------- the ring and the state file


def test_ownership_is_each_nodes_share_of_the_ring_and_of_its_replicas() -> None:
    assert ownership({"a": [0], "b": [2**62]}, 1) == {"a": 0.75, "b": 0.25}  # (2^62, 0] wraps round to a
    assert ownership({"a": [-(2**63), 0], "b": [-(2**62), 2**62]}, 1) == {"a": 0.5, "b": 0.5}
    assert ownership({"a": [0], "b": [2**62]}, 2) == {"a": 1.0, "b": 1.0}
    assert ownership({"a": [0], "b": [2**62]}, 3) == {"a": 1.0, "b": 1.0}  # no more replicas than nodes
    three = ownership({"a": [0], "b": [2**62], "c": [2**63 - 1]}, 2)
    assert sum(three.values()) == pytest.approx(2.0)


def test_commands_use_the_cluster_settings_only_while_it_is_up_and_no_config_is_named(tmp_path: Path) -> None:
    (tmp_path / "cassmail.toml").write_text("[store]\nbackend = \"cassandra\"\n")
    state = tmp_path / "cluster.json"
    state.write_text(json.dumps({"up": True}))
    env = {"CASSMAIL_CLUSTER": str(tmp_path)}
    assert active_config(env) == str(tmp_path / "cassmail.toml")
    assert active_config({**env, "CASSMAIL_CONFIG": "/etc/cassmail.toml"}) is None
    assert active_config({"CASSMAIL_CLUSTER": "off"}) is None
    state.write_text(json.dumps({"up": False}))
    assert active_config(env) is None


# ----------------------------------------------------------------------------- a healthy cluster


def test_up_starts_three_nodes_with_balanced_token_ownership(cluster: Cluster) -> None:
    rows = json.loads(cluster.must("cluster", "status", "--json"))
    assert [r["address"] for r in rows] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    seen = [(r["node"], r["cassandra"], r["frontend"], r["tokens"], r["frontend_failures"]) for r in rows]
    assert seen == [(i, "up", "up", 16, []) for i in (1, 2, 3)], seen
    owns, effective = [r["owns"] for r in rows], [r["effective"] for r in rows]
    assert sum(owns) == pytest.approx(1.0) and sum(effective) == pytest.approx(2.0)
    assert "token ownership spread" in cluster.up_output
    print(f"\ntoken ownership: {', '.join(f'{100 * o:.1f}%' for o in owns)}; "
          f"effective at RF=2: {', '.join(f'{100 * e:.1f}%' for e in effective)}")
    # The allocator balances what each node holds at the RF it is given (random tokens drift far more).
    assert max(effective) / min(effective) < 1.3, effective
    # A new cluster: its schema was made while node 1 was alone, and the nodes that joined then
    # had no Paxos state to repair (a repair is ~20 s a node).
    for i in (2, 3):
        assert "skipping paxos repair for bootstrap" in cluster.system_log(i)


def test_other_commands_reach_the_cluster_with_no_flags(cluster: Cluster) -> None:
    cluster.must("domain", "add", DOMAIN)
    cluster.must("-o", "auth.scrypt_n=1024", "user", "add", f"flagless@{DOMAIN}", "--password-stdin", stdin="pw\n")
    assert f"flagless@{DOMAIN}" in cluster.must("user", "list", "--domain", DOMAIN).split()
    delivered = smtp_send(cluster.address(2), cluster.ports["smtp"], f"flagless@{DOMAIN}", make_message("flagless"))
    assert delivered.ok, delivered.text
    fetched = pop3_read(cluster.address(3), cluster.ports["pop3"], f"flagless@{DOMAIN}", "pw")
    assert fetched.ok and [subject_of(m) for m in fetched.messages] == ["flagless"], fetched.text


def test_any_node_serves_any_user(cluster: Cluster) -> None:
    users = _users("any", 3)
    run(_prepare(cluster.store_settings(), users, 0))
    for i in range(1, NODES + 1):
        for user in users:
            sent = smtp_send(cluster.address(i), cluster.ports["smtp"], user, make_message(f"via{i}-{_password(user)}"))
            assert sent.ok, sent.text
    for i in range(1, NODES + 1):
        for user in users:
            fetched = pop3_read(cluster.address(i), cluster.ports["pop3"], user, _password(user))
            wanted = {f"via{n}-{_password(user)}" for n in range(1, NODES + 1)}
            assert fetched.ok and {subject_of(m) for m in fetched.messages} == wanted, fetched.text
            seen = imap_read(cluster.address(i), cluster.ports["imap"], user, _password(user))
            assert seen.ok and {subject_of(m) for m in seen.messages} == wanted, seen.text


def test_imap_sessions_on_two_nodes_keep_one_mailbox_consistent(cluster: Cluster) -> None:
    """The state-checking stress run (tests/imap_stress.py) with its sessions spread over the front
    ends of nodes 1 and 2, each on its own Cassandra coordinator (RF=2, reads and writes at ONE)."""
    [user] = _users("stress", 1)
    run(_prepare(cluster.store_settings(), [user], 0))
    report = imap_stress.run([(cluster.address(i), cluster.ports["imap"]) for i in (1, 2)], user, _password(user),
                             sessions=8, seconds=STRESS_SECONDS)
    assert not report.violations, "\n".join(report.violations[:10])
    assert report.flags_agree and report.answers.get("APPEND OK") and report.answers.get("EXPUNGE OK")


# ----------------------------------------------------------------------------- the outage experiment


@dataclasses.dataclass
class Delivery:
    frontend: str
    subject: str
    user: str
    sent: float
    outcome: Outcome


class Load(threading.Thread):
    """A steady sender: one message after another to one node, users in turn, until stopped.
    With `login` it submits (AUTH as that user) instead of handing mail to the MX."""

    def __init__(self, name: str, host: str, port: int, users: list[str], pause: float = 0.5,
                 login: tuple[str, str] | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.host, self.port, self.users, self.pause, self.login = host, port, users, pause, login
        self.deliveries: list[Delivery] = []
        self.halt = threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.halt.is_set():
            user = self.users[seq % len(self.users)]
            subject = f"{self.name}-{seq}"
            sent = time.monotonic()
            self.deliveries.append(Delivery(self.name, subject, user, sent,
                                            smtp_send(self.host, self.port, user, make_message(subject),
                                                      login=self.login)))
            seq += 1
            self.halt.wait(self.pause)


@dataclasses.dataclass
class Matrix:
    """Per (RF, CL): the outcomes of SMTP, POP3 and IMAP sessions while node 3's Cassandra is down."""

    cells: dict[tuple[int, str], dict[str, list[Outcome]]]


@dataclasses.dataclass
class Experiment:
    killed: float
    detected: float
    back: float
    loads: list[Load]
    all_load: Load
    pop3_during: list[Outcome]
    imap_during: list[Outcome]
    held_session: list[str]
    held_imap: list[str]
    matrix: Matrix
    read_back: dict[int, dict[str, Outcome]]
    timings: dict[str, float]
    #: Submissions to OUTBOUND through every node (queued in the store at ONE) during the outage.
    outbound: list[Load] = dataclasses.field(default_factory=list)


def held_imap_steps(session: imaplib.IMAP4, exists: int) -> list[str]:
    """Commands on an IMAP session that was selected before the failure: each as "NAME: status"."""
    steps = []
    for n in range(1, exists + 1):
        typ, data = session.fetch(str(n), "(UID BODY.PEEK[])")
        whole = typ == "OK" and isinstance(data[0], tuple) and data[0][1].startswith(b"From:")
        steps.append(f"FETCH {n}: {typ if whole else f'{typ} {data!r:.200}'}")
    steps.append(f"SEARCH: {session.search(None, 'ALL')[0]}")
    flagged = session.store("1", "+FLAGS", r"(\Flagged)")[0]
    steps.append(f"STORE: {flagged}")
    steps.append(f"NOOP: {session.noop()[0]}")
    return steps


def _wait_for_log(cluster: Cluster, nodes: list[int], pattern: str, since: dict[int, int], timeout: float = 60) -> float:
    """When every given node has logged `pattern` past its log's length `since` (what gossip decided)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(re.search(pattern, cluster.system_log(i)[since[i]:]) for i in nodes):
            return time.monotonic()
        time.sleep(0.2)
    raise AssertionError(f"nodes {nodes} did not log {pattern!r} within {timeout} s")


def _frontend(settings: CassandraSettings, directory: Path) -> Node:
    """An extra `cassmail serve` on 127.0.0.1 with its own store settings (keyspace, levels)."""
    base = Settings()
    base.store.backend = "cassandra"
    base.store.cassandra = settings
    plain = {"allow_plaintext_auth": True, "auth_failure_delay": 0.0}
    return Node(base, directory, pop3=plain, submission=plain, imap={"enabled": True, **plain})


def _measure(node: Node, users: list[str], tag: str) -> dict[str, list[Outcome]]:
    """One SMTP delivery, one POP3 session and (when built) one IMAP session per user."""
    cell: dict[str, list[Outcome]] = {"smtp": [], "pop3": [], "imap": []}
    for user in users:
        cell["smtp"].append(smtp_send("127.0.0.1", node.port("smtp"), user, make_message(f"{tag}-{_password(user)}")))
        cell["pop3"].append(pop3_read("127.0.0.1", node.port("pop3"), user, _password(user)))
        cell["imap"].append(imap_read("127.0.0.1", node.port("imap"), user, _password(user)))
    return cell


@pytest.fixture(scope="module")
def remote_mx(cluster: Cluster) -> Iterator[RemoteMx]:
    """The remote MX of OUTBOUND (aiosmtpd on 127.0.0.1, recording what it accepts)."""
    mx = RemoteMx("127.0.0.1", cluster.outbound_port, None)
    mx.start()
    yield mx
    mx.stop()


def _delivered(mx: RemoteMx) -> collections.Counter[str]:
    """Subject -> copies the remote MX accepted (it said 250)."""
    with mx.mx.lock:
        return collections.Counter(subject_of(m.content) for m in mx.mx.messages)


@pytest.fixture(scope="module")
def experiment(cluster: Cluster, remote_mx: RemoteMx, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Experiment]:
    directory = tmp_path_factory.mktemp("frontends")
    load_users, all_users, read_users = _users("one"), _users("all"), _users("read")
    out_user = f"sender@{DOMAIN}"
    run(_prepare(cluster.store_settings(), load_users + all_users + [out_user], 0))
    run(_prepare(cluster.store_settings(), read_users, 2))
    # The matrix: a keyspace per RF (the cluster's own is RF=2), a front end per (RF, CL).
    keyspaces = {rf: cluster.store_settings().keyspace if rf == 2 else f"matrix_rf{rf}" for rf in MATRIX_RFS}
    others = [rf for rf in MATRIX_RFS if rf != 2]
    with ThreadPoolExecutor(2) as pool:  # (each apply waits on its node more than it works)
        list(pool.map(lambda rf: cassandra_schema.apply(cluster.store_settings(keyspace=keyspaces[rf],
                                                                               replication_factor=rf)), others))
    matrix_users = _users("m")
    for rf, keyspace in keyspaces.items():
        run(_prepare(cluster.store_settings(keyspace=keyspace, replication_factor=rf, write_consistency="ALL"),
                     matrix_users, 1))
    frontends = {
        (rf, cl): _frontend(cluster.store_settings(keyspace=ks, replication_factor=rf, read_consistency=cl,
                                                   write_consistency=cl), directory)
        for rf, ks in keyspaces.items() for cl in LEVELS
    }
    # Writes at ALL; reads (the RCPT checks) at ONE, so what a refusal measures is the write.
    all_node = _frontend(cluster.store_settings(write_consistency="ALL", read_consistency="ONE"), directory)
    # One reader per node, reading at QUORUM, each given only its node as contact point.
    readers = [_frontend(cluster.store_settings(contact_points=[cluster.address(i)]), directory)
               for i in range(1, NODES + 1)]
    started = [*frontends.values(), all_node, *readers]
    timings: dict[str, float] = {}
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: n.start(timeout=120), started))
        loads = [Load(f"one{i}", cluster.address(i), cluster.ports["smtp"], load_users) for i in range(1, NODES + 1)]
        all_load = Load("all", "127.0.0.1", all_node.port("smtp"), all_users)
        out_loads = [Load(f"out{i}", cluster.address(i), cluster.ports["submission"], [f"far{i}@{OUTBOUND}"],
                          pause=1.0, login=(out_user, _password(out_user))) for i in range(1, NODES + 1)]
        for load in (*loads, all_load, *out_loads):
            load.start()
        # UIDs handed out while every replica is up (a new UID needs a Paxos quorum)
        assert all(imap_read(cluster.address(1), cluster.ports["imap"], u, _password(u)).ok for u in read_users)
        # A POP3 session opened before the failure and used during it.
        held = poplib.POP3(cluster.address(1), cluster.ports["pop3"], timeout=60)
        held.user(read_users[0])
        held.pass_(_password(read_users[0]))
        held_count = held.stat()[0]
        # And an IMAP session, selected before the failure and used during it.
        held_imap = imaplib.IMAP4(cluster.address(1), cluster.ports["imap"], timeout=60)
        held_imap.login(read_users[1], _password(read_users[1]))
        held_imap_exists = int(held_imap.select("INBOX")[1][0])
        time.sleep(3)

        marks = {i: len(cluster.system_log(i)) for i in (1, 2)}
        killed = time.monotonic()
        cluster.must("cluster", "kill", str(DOWN))
        detected = _wait_for_log(cluster, [1, 2], rf"/127\.0\.0\.{DOWN}:\d+ is now DOWN", marks)
        held_session = []
        for n in range(1, held_count + 1):
            try:
                held_session.append(f"RETR {n}: {'ok' if held.retr(n)[1] else 'empty'}")
            except poplib.error_proto as exc:
                held_session.append(f"RETR {n}: {exc.args[0].decode()}")
        held_session.append(f"NOOP: {held.noop().decode()}")
        imap_steps = held_imap_steps(held_imap, held_imap_exists)
        pop3_during = [pop3_read(cluster.address(1), cluster.ports["pop3"], u, _password(u)) for u in read_users]
        imap_during = [imap_read(cluster.address(1), cluster.ports["imap"], u, _password(u)) for u in read_users]
        matrix_start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            cells = dict(zip(frontends, pool.map(lambda item: _measure(item[1], matrix_users, f"m{item[0][0]}{item[0][1]}"),
                                                 frontends.items())))
        matrix_done = time.monotonic()
        held_session.append(f"QUIT: {held.quit().decode()}")
        imap_steps.append(f"LOGOUT: {held_imap.logout()[0]}")

        marks = {i: len(cluster.system_log(i)) for i in (1, 2)}
        cluster.must("cluster", "start", str(DOWN))
        back = _wait_for_log(cluster, [1, 2], rf"/127\.0\.0\.{DOWN}:\d+ is now UP", marks)
        time.sleep(5)
        timings["matrix"] = matrix_done - matrix_start
        timings["detected"] = detected - killed
        timings["outage"] = back - killed
        for load in (*loads, all_load, *out_loads):
            load.halt.set()
        for load in (*loads, all_load, *out_loads):
            load.join(120)
        acked = {d.subject for load in (*loads, all_load) for d in load.deliveries if d.outcome.ok}
        # Right after the return: at QUORUM (R + W > RF) every node's front end must show everything;
        # at ONE the returned node may not have its hints yet (measured, not promised).
        retried: list[str] = []
        read_back = _read_back([("127.0.0.1", r.port("pop3")) for r in readers], load_users + all_users, retried)
        timings["retried"] = len(retried)
        at_one = _read_back([(cluster.address(i), cluster.ports["pop3"]) for i in range(1, NODES + 1)],
                            load_users + all_users)
        timings["missing_at_one"] = _missing(at_one, acked)
        yield Experiment(killed, detected, back, loads, all_load, pop3_during, imap_during, held_session,
                         imap_steps,
                         Matrix(cells), read_back, timings, out_loads)
    finally:
        with ThreadPoolExecutor(len(started)) as pool:  # (each waits for its store to close)
            list(pool.map(lambda n: n.stop(), started))
        for node in started:
            assert not node.own_tracebacks()


def _read_back(ports: list[tuple[str, int]], users: list[str],
               retried: list[str] | None = None) -> dict[int, dict[str, Outcome]]:
    """Every user's mailbox through each POP3 listener in `ports` (numbered from 1).

    A session told to try again later (-ERR [SYS/TEMP]) is tried again, as a mail client would,
    up to four times a second apart: in the seconds after its return, the node that was down
    may still time out a read (it is replaying hints). Each retry is noted in `retried`; a
    message that no attempt shows is missing."""
    reading: dict[int, dict[str, Outcome]] = {}
    for i, (host, port) in enumerate(ports, 1):
        reading[i] = {}
        for user in users:
            outcome = pop3_read(host, port, user, _password(user))
            for _ in range(4):
                if outcome.kind != "temp":
                    break
                if retried is not None:
                    retried.append(f"node {i}, {user}: {outcome.text}")
                time.sleep(1)
                outcome = pop3_read(host, port, user, _password(user))
            reading[i][user] = outcome
    return reading


def _missing(reading: dict[int, dict[str, Outcome]], acked: set[str]) -> int:
    """Acknowledged messages some listener did not show (a failed session shows none)."""
    return sum(len(acked - {subject_of(m) for f in by_user.values() for m in f.messages}) for by_user in reading.values())


def _phases(experiment: Experiment, deliveries: list[Delivery]) -> dict[str, list[Delivery]]:
    return {
        "before": [d for d in deliveries if d.sent < experiment.killed],
        "outage": [d for d in deliveries if experiment.killed <= d.sent < experiment.back],
        "after": [d for d in deliveries if d.sent >= experiment.back],
    }


def test_at_write_one_no_delivery_fails_while_a_node_is_down(experiment: Experiment) -> None:
    deliveries = [d for load in experiment.loads for d in load.deliveries]
    phases = _phases(experiment, deliveries)
    assert all(len(p) >= 3 for p in phases.values()), {k: len(v) for k, v in phases.items()}
    failed = [(d.subject, d.outcome.text) for d in deliveries if not d.outcome.ok]
    print(f"\nwrite ONE, RF=2: {len(deliveries)} deliveries over 3 nodes "
          f"({len(phases['outage'])} while node {DOWN} was down or coming back), {len(failed)} failed")
    assert not failed


def test_at_write_one_every_acknowledged_message_is_readable_on_every_node_after_return(experiment: Experiment) -> None:
    acked = {d.subject for load in experiment.loads for d in load.deliveries if d.outcome.ok}
    for i, by_user in experiment.read_back.items():
        seen: set[str] = set()
        for user, fetched in by_user.items():
            assert fetched.ok, f"node {i}, {user}: {fetched.text}"
            seen |= {subject_of(m) for m in fetched.messages}
        assert acked <= seen, f"node {i} misses {sorted(acked - seen)[:10]}"
    t = experiment.timings
    print(f"\nevery acknowledged message ({len(acked)}) readable through POP3 on every node at read QUORUM; "
          f"at read ONE, {t['missing_at_one']:.0f} (message, node) pairs not yet visible 5 s after the return; "
          f"node {DOWN} down {t['outage']:.0f} s (declared down by the others after {t['detected']:.0f} s); "
          f"matrix measured in {t['matrix']:.0f} s; {t['retried']:.0f} session(s) told to try again later "
          f"and tried again")


def test_at_write_all_deliveries_during_the_outage_answer_4xx_and_none_acknowledged_is_lost(
    experiment: Experiment,
) -> None:
    phases = _phases(experiment, experiment.all_load.deliveries)
    during = [d for d in phases["outage"] if d.sent >= experiment.detected]
    refused = [d for d in during if not d.outcome.ok]
    assert during and refused, "no delivery at ALL was refused while a replica was down"
    # A refusal is a 4xx: the sender keeps the message and retries. Never a 5xx, never a dropped session.
    assert {d.outcome.kind for d in during} <= {"ok", "temp"}, {d.outcome.text for d in during}
    assert all(d.outcome.code == 451 for d in refused), {d.outcome.text for d in refused}
    acked = {d.subject for d in experiment.all_load.deliveries if d.outcome.ok}
    for i, by_user in experiment.read_back.items():
        seen = {subject_of(m) for user, f in by_user.items() if user.startswith("all") for m in f.messages}
        assert acked <= seen, f"node {i} lost {sorted(acked - seen)}"
    print(f"\nwrite ALL, RF=2, node {DOWN} down: {len(refused)} of {len(during)} deliveries answered 451 "
          f"(the rest had both replicas of every partition they wrote on the live nodes)")


def test_at_write_all_service_returns_with_the_node(experiment: Experiment) -> None:
    after = _phases(experiment, experiment.all_load.deliveries)["after"]
    assert after and all(d.outcome.ok for d in after), [d.outcome.text for d in after if not d.outcome.ok]


def test_pop3_on_a_surviving_node_keeps_working_at_read_one(experiment: Experiment) -> None:
    """RF=2, reads at ONE: every mailbox keeps a live replica, so new sessions and a session
    opened before the failure read everything."""
    assert all(o.ok and len(o.messages) == 2 for o in experiment.pop3_during), [o.text for o in experiment.pop3_during]
    assert all(step.split(": ", 1)[1].startswith(("ok", "+OK")) for step in experiment.held_session), experiment.held_session


def test_pop3_at_read_quorum_with_rf2_refuses_mailboxes_that_lost_a_replica(experiment: Experiment) -> None:
    """QUORUM of 2 replicas is both: a mailbox with a replica on the lost node answers the
    protocol's own temporary error, the others work, and the session ends cleanly."""
    outcomes = experiment.matrix.cells[(2, "QUORUM")]["pop3"]
    for outcome in outcomes:
        assert outcome.ok or (outcome.kind == "temp" and "[SYS/TEMP]" in outcome.text), outcome.text


def test_imap_on_a_surviving_node_keeps_working_at_read_one(experiment: Experiment) -> None:
    """New sessions, and a session selected before the failure (FETCH, SEARCH, STORE, NOOP during
    the outage, LOGOUT after it), all answer OK."""
    assert all(o.ok and len(o.messages) == 2 for o in experiment.imap_during), [o.text for o in experiment.imap_during]
    assert len(experiment.held_imap) == 2 + 3 + 1, experiment.held_imap  # FETCH x2, SEARCH, STORE, NOOP; LOGOUT
    assert all(step.split(": ", 1)[1] in ("OK", "BYE") for step in experiment.held_imap), experiment.held_imap


def _cell_text(outcomes: list[Outcome]) -> str:
    ok = sum(o.ok for o in outcomes)
    kinds = sorted({o.kind for o in outcomes if not o.ok})
    return f"{ok}/{len(outcomes)} ok" + (f" ({', '.join(kinds)})" if kinds else "")


def test_rf_cl_matrix_during_a_node_loss(experiment: Experiment, capsys: pytest.CaptureFixture[str]) -> None:
    """What losing one of three nodes does to each protocol, for every RF and consistency level."""
    cells = experiment.matrix.cells
    lines = ["| RF | CL (reads and writes) | SMTP deliveries | POP3 sessions | IMAP sessions |",
             "| --- | --- | --- | --- | --- |"]
    for (rf, cl), cell in sorted(cells.items(), key=lambda kv: (kv[0][0], LEVELS.index(kv[0][1]))):
        lines.append(f"| {rf} | {cl} | {_cell_text(cell['smtp'])} | {_cell_text(cell['pop3'])} | {_cell_text(cell['imap'])} |")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    for (rf, cl), cell in cells.items():
        for protocol, outcomes in cell.items():
            # Whatever the level, a refusal is the protocol's own temporary error, never a dropped session.
            assert all(o.kind in ("ok", "temp") for o in outcomes), (rf, cl, protocol, [o.text for o in outcomes])
        needed = {"ONE": 1, "QUORUM": rf // 2 + 1, "ALL": rf}[cl]
        if needed <= rf - 1:  # a partition keeps at least rf - 1 live replicas
            assert all(o.ok for o in cell["smtp"] + cell["pop3"]), (rf, cl, [o.text for o in cell["smtp"] + cell["pop3"]])
        if needed == rf == NODES:  # every partition has a replica on the lost node, and needs it
            assert not any(o.ok for o in cell["smtp"] + cell["pop3"]), (rf, cl)


# ----------------------------------------------------------------------------- a front end killed mid-DATA


def test_front_end_killed_mid_data_leaves_each_message_acknowledged_and_stored_or_unacknowledged(
    cluster: Cluster,
) -> None:
    user = f"middata@{DOMAIN}"
    run(_prepare(cluster.store_settings(), [user], 0))
    host, port = cluster.address(2), cluster.ports["smtp"]
    big = make_message("middata-big", 3 * 1024 * 1024)
    sent: dict[str, bytes] = {}
    outcomes: dict[str, Outcome] = {}
    half_sent, killed = threading.Event(), threading.Event()

    def big_sender() -> None:
        import smtplib

        try:
            client = smtplib.SMTP(host, port, timeout=60)
            client.ehlo("load.test")
            client.mail("load@sender.test")
            client.rcpt(user)
            client.putcmd("data")
            client.getreply()
            client.send(big[: len(big) // 2])
            half_sent.set()
            killed.wait(60)  # the rest only once the front end is gone: mid-DATA, however slow the kill
            client.send(big[len(big) // 2 :] + b".\r\n")
            code, text = client.getreply()
            outcomes["middata-big"] = Outcome("ok" if code == 250 else "temp", f"{code} {text!r}", code)
        except (OSError, smtplib.SMTPException) as exc:
            half_sent.set()
            outcomes["middata-big"] = Outcome("dropped", repr(exc))

    def small_sender(k: int) -> None:
        for n in range(40):
            subject = f"middata-{k}-{n}"
            sent[subject] = make_message(subject, 200_000)
            outcomes[subject] = smtp_send(host, port, user, sent[subject], timeout=30)
            if outcomes[subject].kind == "dropped":
                return

    sent["middata-big"] = big
    threads = [threading.Thread(target=big_sender)] + [threading.Thread(target=small_sender, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    assert half_sent.wait(60)
    time.sleep(0.3)
    try:
        cluster.must("cluster", "kill", "2", "--frontend")
    finally:
        killed.set()
    for t in threads:
        t.join(120)
    cluster.must("cluster", "start", "2", "--frontend")
    assert outcomes["middata-big"].kind == "dropped", outcomes["middata-big"].text

    fetched = pop3_read(cluster.address(2), cluster.ports["pop3"], user, "middata")
    assert fetched.ok, fetched.text
    stored = {subject_of(m): m for m in fetched.messages}
    acked = {s for s, o in outcomes.items() if o.ok}
    assert acked <= set(stored), sorted(acked - set(stored))
    for subject, message in stored.items():
        # Every message listed is whole: the bytes sent (after cassmail's trace headers), never a part.
        assert subject in sent and message.endswith(sent[subject].rstrip(b"\r\n")), subject
    assert "middata-big" not in stored
    print(f"\nfront end 2 killed mid-DATA: {len(acked)} acknowledged and stored, "
          f"{len(set(stored) - acked)} stored without an acknowledgement (the client saw the connection drop), "
          f"{len(outcomes) - len(acked)} not acknowledged, none half-stored")


# ----------------------------------------------------------------------------- outbound mail


def test_outbound_mail_acknowledged_at_one_while_a_cassandra_node_was_down_is_all_delivered(
    experiment: Experiment, remote_mx: RemoteMx,
) -> None:
    """RF=2, writes at ONE: submission kept queueing while node 3's Cassandra was down (the
    accept path needs no Paxos); an entry whose lease needs node 3 waits for it, and once it is
    back every acknowledged message reaches the remote MX."""
    sent = [d for load in experiment.outbound for d in load.deliveries]
    acked = {d.subject for d in sent if d.outcome.ok}
    during = [d for d in _phases(experiment, sent)["outage"]]
    assert during and all(d.outcome.ok for d in during), [d.outcome.text for d in during if not d.outcome.ok]
    deadline = time.monotonic() + 180
    while not acked <= set(_delivered(remote_mx)) and time.monotonic() < deadline:
        time.sleep(0.5)
    copies = _delivered(remote_mx)
    assert acked <= set(copies), f"not delivered: {sorted(acked - set(copies))[:10]}"
    duplicates = sum(n - 1 for s, n in copies.items() if s in acked)
    print(f"\noutbound at ONE, RF=2: {len(acked)} submissions acknowledged ({len(during)} while node {DOWN} was "
          f"down or coming back), all delivered to the remote MX, {duplicates} duplicate(s)")


def test_a_node_killed_while_it_holds_a_lease_mid_delivery_loses_nothing(cluster: Cluster, remote_mx: RemoteMx) -> None:
    """The remote answers DATA slowly; the node whose worker holds the message's lease is killed
    (front end and workers, SIGKILL) in the middle of DATA. After its lease runs out another node
    takes the entry and delivers it."""
    user = f"leaser@{DOMAIN}"
    run(_prepare(cluster.store_settings(), [user], 0))
    subject = f"lease-{int(time.time())}"
    rcpt = f"slow-lease@{OUTBOUND}"
    remote_mx.mx.slow_seconds = 2 * LEASE
    started = len(remote_mx.mx.data_started)
    sent = smtp_send(cluster.address(1), cluster.ports["submission"], rcpt, make_message(subject),
                     login=(user, _password(user)))
    assert sent.ok, sent.text

    def holder() -> tuple[int, float] | None:
        """The node holding the entry's lease, and until when (to the second, rounded down)."""
        entries = json.loads(cluster.must("queue", "list", "--domain", OUTBOUND, "--json"))
        leases = [(e["lease_owner"], e["lease_until"]) for e in entries
                  if e["lease_until"] and any(r["address"] == rcpt for r in e["recipients"])]
        if not leases:
            return None
        until = datetime.strptime(leases[0][1], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
        return int(leases[0][0].split("/")[0].removeprefix("node")), until

    deadline = time.monotonic() + 60
    while len(remote_mx.mx.data_started) == started and time.monotonic() < deadline:
        time.sleep(0.1)  # the remote got DATA and is slow to answer it
    held = holder()
    assert held is not None and len(remote_mx.mx.data_started) > started
    node, lease_until = held
    killed = time.monotonic()
    cluster.must("cluster", "kill", str(node), "--frontend")
    remote_mx.mx.slow_seconds = 0.0  # (the next attempt, another node's, is answered at once)
    try:
        deadline = time.monotonic() + 60
        while _delivered(remote_mx)[subject] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        took = time.monotonic() - killed
        assert _delivered(remote_mx)[subject] >= 1, "not delivered after the lease ran out"
        # Nobody took it while the lease ran: the second DATA came once the lease was over.
        again = remote_mx.mx.data_started[started + 1] + time.time() - time.monotonic()
        assert again >= lease_until, f"taken {lease_until - again:.1f} s before the lease ran out"
        time.sleep(1)
        duplicates = _delivered(remote_mx)[subject] - 1
        whole_data = len(remote_mx.mx.data_started) - started
        print(f"\nnode {node} killed holding the lease mid-DATA: delivered by another node {took:.1f} s later "
              f"(lease {LEASE:.0f} s); {duplicates} duplicate(s) accepted by the remote, which saw the message "
              f"{whole_data} times (the killed node's copy was never answered 250)")
        assert duplicates == 0
    finally:
        remote_mx.mx.slow_seconds = 3.0
        cluster.must("cluster", "start", str(node), "--frontend")
