"""Network faults on a 3-node cluster whose nodes each live in a network namespace of their own.

`cassmail cluster up --netns --nodes 3 --rf 3` on CQL port 39042, then for each consistency level
(ONE, QUORUM, ALL: the front ends restarted with it for reads and writes) a short fault-free
baseline and three faults in turn, each for PHASE seconds, under load on every node: a steady
smtplib sender per node whose every message has a name of its own, postal over all the nodes, a
POP3 reader per node that retrieves and deletes (as rabid does) what the senders send to its user,
and state-checking IMAP sessions (tests/imap_stress.py) spread over the nodes:

- node 3 partitioned from the other nodes both ways (`cassmail cluster partition 3`),
- node 3 partitioned one way: what it sends to the others is dropped (`--one-way`),
- 200 ms added to, and 5% lost of, what every node sends to the others (`cassmail cluster delay`).

After each `cassmail cluster heal`, the seconds until every node takes a delivery and serves an IMAP
session again. At the end of a level every node's view of every mailbox, with what POP3 retrieved,
gives: acknowledged messages lost (goal 0), duplicates, and UIDs naming two messages (goal 0); postal's
count of accepted messages against its users' mailboxes gives its losses (goal 0), and every message
POP3 retrieved must be the one sent. The table is printed, and written
as markdown to $CASSMAIL_PARTITION_REPORT when set.

It takes about nine minutes and needs root (ip netns, iptables), so the drill runs only with
CASSMAIL_PARTITION_TESTS=1 (never in CI's default run), under the cluster lock:

    CASSMAIL_PARTITION_TESTS=1 flock /work/cluster.lock .venv/bin/pytest -s tests/test_partitions.py

CASSMAIL_PARTITION_PHASE_SECONDS sets each fault's length (default 20).
"""

from __future__ import annotations

import collections
import dataclasses
import imaplib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cassmail import netns
from cassmail.cluster import DEFAULT_PORTS
from tests import imap_stress
from tests.cluster_clients import Outcome, imap_uids, make_message, pop3_read, smtp_send, subject_of
from tests.conftest import REPO, unavailable
from tests.test_cluster import HEAP_MB, LEVELS, NATIVE_PORT, STORAGE_PORT, Cluster, Load, _alive, _cluster_pids, \
    _password, _prepare, _users, run

sys.path.insert(0, str(REPO / "loadtest"))
from postal import LoadRun, LineCounter, run_postal, write_users  # noqa: E402

DRILL = os.environ.get("CASSMAIL_PARTITION_TESTS") == "1"
PHASE = float(os.environ.get("CASSMAIL_PARTITION_PHASE_SECONDS", "20"))
BASELINE = 10.0
NODES = 3
CUT = 3  # the node the partitions cut off
#: postal beside the drill's own senders: threads per node, messages a minute in all, sizes in bytes.
POSTAL_THREADS = 1
POSTAL_RATE = 600
POSTAL_SIZES = (1_000, 20_000)
#: Seconds a node may take to serve again after a heal before the drill calls it not back.
RECOVERY_LIMIT = 180.0
#: The drill's tests: opt-in, and longer than the suite's timeout (the module's fixtures run in the first one's time).
drill = pytest.mark.skipif(not DRILL, reason="the network-fault drill runs with CASSMAIL_PARTITION_TESTS=1 (root, ~9 min)")
DRILL_TIMEOUT = pytest.mark.timeout(3600)


class NetnsCluster(Cluster):
    """The module's cluster: node i at 10.77.0.(10+i), in namespace cassmail-nI."""

    def address(self, i: int) -> str:
        return netns.address(i)


def _up_args(level: str) -> list[str]:
    return ["-o", f"store.cassandra.read_consistency={level}", "-o", f"store.cassandra.write_consistency={level}",
            "-o", "store.cassandra.serial_consistency=SERIAL", "-o", "auth.scrypt_n=1024",
            # The load comes from the bridge's address, not loopback: keep it out of the rate limits.
            "-o", f'smtp.rate_limit_exempt=["{netns.SUBNET}.0/{netns.PREFIX}"]',
            "cluster", "up", "--netns", "--nodes", str(NODES), "--rf", "3", "--heap-mb", str(HEAP_MB),
            "--native-port", str(NATIVE_PORT), "--storage-port", str(STORAGE_PORT)]


@dataclasses.dataclass
class Phase:
    level: str
    fault: str
    command: str
    started: float
    ended: float = 0.0
    healed: float | None = None
    #: Seconds from heal until every node delivered and served IMAP again (None: not within the limit).
    recovery: float | None = None
    imap_runs: int = 0
    imap_commands: int = 0
    imap_violations: list[str] = dataclasses.field(default_factory=list)
    #: SMTP outcomes of the deliveries started while the fault was in place (or in the baseline).
    acked: int = 0
    refused: int = 0
    dropped: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)
    #: Extra copies of messages acknowledged in this phase, as the node showing most of them has them.
    duplicates: int = 0
    #: A UID naming two different messages (across the nodes' views) among messages of this phase.
    uid_conflicts: list[str] = dataclasses.field(default_factory=list)
    faults_seen: list[str] = dataclasses.field(default_factory=list)
    #: POP3 sessions (each retrieving and deleting every message) started while the fault was in place.
    pop3: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def violations(self, kind: str) -> list[str]:
        return [v for v in self.imap_violations if _violation_kind(v) == kind]


@dataclasses.dataclass
class Level:
    level: str
    phases: list[Phase]
    #: Acknowledged messages some node still did not show a minute after the last heal.
    unseen_on_some_node: int
    #: Messages retrieved over POP3 that were not the message sent (its Subject named).
    pop3_wrong: list[str]
    #: postal over the whole level: messages it saw accepted, and its users' messages on the node
    #: that shows fewest and on the one that shows most.
    postal_accepted: int
    postal_stored: tuple[int, int]

    @property
    def postal_lost(self) -> int:
        return max(0, self.postal_accepted - self.postal_stored[1])


class Pop3Drain(threading.Thread):
    """One node's POP3 reader, as rabid reads: sessions one after another as `user`, each
    retrieving and deleting every message, until stopped. Keeps each session's outcome, the
    Subject of every message retrieved, and those whose bytes were not the message sent."""

    def __init__(self, name: str, host: str, port: int, user: str, pause: float = 0.5) -> None:
        super().__init__(name=name, daemon=True)
        self.host, self.port, self.user, self.pause = host, port, user, pause
        self.sessions: list[tuple[float, Outcome]] = []
        self.retrieved: set[str] = set()
        self.wrong: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            got = pop3_read(self.host, self.port, self.user, _password(self.user), timeout=15, delete=True)
            self.sessions.append((started, got))
            for message in got.messages:
                subject = subject_of(message)
                self.retrieved.add(subject)
                if not (message + b"\r\n").endswith(make_message(subject)):  # after the trace headers
                    self.wrong.append(subject)
            self.halt.wait(self.pause)


def _imap_count(host: str, port: int, user: str) -> int | None:
    """The messages in a user's INBOX as one node's IMAP SELECT says (None: not answered)."""
    try:
        with imaplib.IMAP4(host, port, timeout=30) as client:
            client.login(user, _password(user))
            kind, data = client.select("INBOX", readonly=True)
            return int(data[0]) if kind == "OK" else None
    except (imaplib.IMAP4.error, OSError, ValueError):
        return None


def _violation_kind(text: str) -> str:
    """What an imap_stress violation was: a UID naming other bytes is the one that must never happen."""
    if "named other bytes" in text or "bytes differ" in text:
        return "uid"
    if re.search(r": NO for ", text):
        return "refused"  # the protocol's own refusal while a quorum is out of reach
    if "no answer within" in text or "closed the connection" in text or "Error" in text:
        return "stalled"
    return "other"


def _imap_until(cluster: NetnsCluster, user: str, until: float, phase: Phase) -> None:
    """Stress sessions over every node's IMAP until `until`, a new run whenever one stopped on a violation."""
    while time.monotonic() < until - 1:
        report = imap_stress.run([(cluster.address(i), cluster.ports["imap"]) for i in range(1, NODES + 1)], user,
                                 _password(user), sessions=6, seconds=until - time.monotonic(), answer_timeout=10)
        phase.imap_runs += 1
        phase.imap_commands += sum(report.commands.values())
        phase.imap_violations += report.violations
        if report.violations:
            time.sleep(1)


def _service_back(cluster: NetnsCluster, user: str, tag: str, probes: list[tuple[str, float]]) -> float | None:
    """Seconds from now until every node took a delivery (250 after DATA) and served an IMAP session."""
    healed = time.monotonic()
    pending = set(range(1, NODES + 1))
    n = 0
    while pending and time.monotonic() - healed < RECOVERY_LIMIT:
        for i in sorted(pending):
            subject = f"probe-{tag}-{i}-{n}"
            sent = smtp_send(cluster.address(i), cluster.ports["smtp"], user, make_message(subject), timeout=15)
            if sent.ok:
                probes.append((subject, time.monotonic()))
            if sent.ok and imap_uids(cluster.address(i), cluster.ports["imap"], user, _password(user), timeout=15).ok:
                pending.discard(i)
            n += 1
        if pending:
            time.sleep(0.5)
    return None if pending else time.monotonic() - healed


def _views(cluster: NetnsCluster, users: list[str]) -> dict[int, dict[str, list[tuple[int, str]]]]:
    """Node -> user -> (UID, Subject) of every message in the INBOX, as that node's IMAP shows it."""
    views: dict[int, dict[str, list[tuple[int, str]]]] = {}
    for i in range(1, NODES + 1):
        views[i] = {}
        for user in users:
            got = imap_uids(cluster.address(i), cluster.ports["imap"], user, _password(user))
            views[i][user] = list(zip(got.uids, (subject_of(m) for m in got.messages))) if got.ok else []
    return views


def _run_level(cluster: NetnsCluster, level: str) -> Level:
    for i in range(1, NODES + 1):
        cluster.must("cluster", "stop", str(i), "--frontend")
    cluster.must(*_up_args(level), timeout=900)
    tag = level.lower()
    load_users, probe_user = _users(f"{tag}-load", 3), f"{tag}-probe@cluster.test"
    pop_users = _users(f"{tag}-pop", NODES)  # node i's POP3 reader drains pop_users[i - 1]
    postal_users = _users(f"{tag}-postal", 4)
    faults: list[tuple[str, list[list[str]]]] = [
        ("none (baseline)", []),
        (f"node {CUT} partitioned, both ways", [["partition", str(CUT)]]),
        (f"node {CUT} partitioned, one way", [["partition", str(CUT), "--one-way"]]),
        ("200 ms + 5% loss between all nodes",
         [["delay", str(i), "--ms", "200", "--loss", "5"] for i in range(1, NODES + 1)]),
    ]
    stress_users = [f"{tag}-stress{k}@cluster.test" for k in range(len(faults))]
    run(_prepare(cluster.store_settings(), [*load_users, probe_user, *stress_users, *pop_users, *postal_users], 0))
    loads = [Load(f"{tag}-n{i}", cluster.address(i), cluster.ports["smtp"], [*load_users, *pop_users])
             for i in range(1, NODES + 1)]
    drains = [Pop3Drain(f"{tag}-pop{i}", cluster.address(i), cluster.ports["pop3"], pop_users[i - 1])
              for i in range(1, NODES + 1)]
    postal_file, _ = write_users(postal_users, cluster.base / "postal" / tag)
    postal_run: list[LoadRun] = []
    postal = threading.Thread(target=lambda: postal_run.append(run_postal(
        f"drill-{tag}", [(cluster.address(i), cluster.ports["smtp"]) for i in range(1, NODES + 1)], POSTAL_SIZES,
        postal_file, cluster.base / "postal" / tag, BASELINE + 3 * PHASE, threads=POSTAL_THREADS, interval=5.0,
        rate=POSTAL_RATE, say=lambda _: None)), daemon=True)
    probes: list[tuple[str, float]] = []
    phases: list[Phase] = []
    for worker in [*loads, *drains, postal]:
        worker.start()
    try:
        for k, (fault, commands) in enumerate(faults):
            phase = Phase(level, fault, "; ".join("cassmail cluster " + " ".join(c) for c in commands) or "-",
                          time.monotonic())
            phases.append(phase)
            for command in commands:
                cluster.must("cluster", *command)
            length = BASELINE if not commands else PHASE
            if commands:
                rows = json.loads(cluster.must("cluster", "status", "--json", timeout=120))
                phase.faults_seen = [f for r in rows for f in r.get("faults", [])]
            _imap_until(cluster, stress_users[k], phase.started + length, phase)
            time.sleep(max(0.0, phase.started + length - time.monotonic()))
            if commands:
                cluster.must("cluster", "heal")
                phase.healed = time.monotonic()
                phase.recovery = _service_back(cluster, probe_user, f"{tag}{k}", probes)
            phase.ended = time.monotonic()
    finally:
        for stoppable in [*loads, *drains]:
            stoppable.halt.set()
        for worker in [*loads, *drains, postal]:
            worker.join(120)
    deliveries = [d for load in loads for d in load.deliveries]
    acked = {d.subject: d.sent for d in deliveries if d.outcome.ok} | dict(probes)
    retrieved = set().union(*(drain.retrieved for drain in drains))

    def phase_of(when: float) -> Phase:
        return next((p for p in reversed(phases) if p.started <= when), phases[0])

    for d in deliveries:
        p = phase_of(d.sent)
        if p.healed is not None and d.sent >= p.healed:
            continue  # after the heal: counted for loss below, not as an outcome under the fault
        if d.outcome.ok:
            p.acked += 1
        elif d.outcome.kind == "dropped":
            p.dropped += 1
        else:
            p.refused += 1
    for drain in drains:
        for started, outcome in drain.sessions:
            p = phase_of(started)
            if p.healed is None or started < p.healed:
                p.pop3[outcome.kind] += 1
    # Every node's view, read again until each holds every acknowledged message (hints and read
    # repair catch a node up) or a minute has passed.
    # A message POP3 retrieved (and deleted) counts as seen everywhere.
    users = [*load_users, *pop_users, probe_user]
    deadline = time.monotonic() + 60
    while True:
        views = _views(cluster, users)
        missing_somewhere = {s for i in views for s in acked
                             if s not in retrieved and s not in {t for u in views[i] for _, t in views[i][u]}}
        if not missing_somewhere or time.monotonic() > deadline:
            break
        time.sleep(2)
    everywhere = {t for i in views for u in views[i] for _, t in views[i][u]} | retrieved
    for subject, when in acked.items():
        if subject not in everywhere:
            phase_of(when).lost.append(subject)
    duplicates: dict[str, int] = {}
    for user in users:
        named: dict[int, set[str]] = collections.defaultdict(set)
        for i in views:
            counts = collections.Counter(t for _, t in views[i][user])
            for subject, copies in counts.items():
                if copies > 1:
                    duplicates[subject] = max(duplicates.get(subject, 0), copies - 1)
            for uid, subject in views[i][user]:
                assert uid > 0, f"node {i} showed {user} a message without a UID: {subject}"
                named[uid].add(subject)
        for uid, names in named.items():
            if len(names) > 1:
                when = min(acked.get(name, phases[-1].started) for name in names)
                phase_of(when).uid_conflicts.append(f"{user} UID {uid}: {sorted(names)}")
    for subject, extra in duplicates.items():
        phase_of(acked.get(subject, phases[-1].started)).duplicates += extra
    # postal's messages carry no name of ours: its count against its users' mailboxes, per node.
    accepted = LineCounter(cluster.base / "postal" / tag / postal_run[0].slug / "postal.log").count() \
        if postal_run else 0
    counts = [sum(_imap_count(cluster.address(i), cluster.ports["imap"], u) or 0 for u in postal_users)
              for i in range(1, NODES + 1)]
    return Level(level, phases, len(missing_somewhere), [w for d in drains for w in d.wrong], accepted,
                 (min(counts), max(counts)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    base = tmp_path_factory.mktemp("netns-cluster")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_") or k == "CASSMAIL_CACHE"}
    env["CASSMAIL_CLUSTER"] = str(base)
    handle = NetnsCluster(base, env, dict(DEFAULT_PORTS), "")
    try:
        started = handle.cli(*_up_args(LEVELS[0]), timeout=900)
        if started.returncode != 0:
            unavailable(f"cassmail cluster up --netns failed: {started.stderr[-3000:]}")
        handle.up_output = started.stdout
        yield handle
    finally:
        if (base / "cluster.json").is_file():
            pids = _cluster_pids(base)
            down = handle.cli("cluster", "down", timeout=300)
            assert down.returncode == 0, down.stderr
            assert not [pid for pid in pids if _alive(pid)], "cluster down left processes running"
        assert not [i for i in range(1, NODES + 1) if netns.exists(netns.namespace(i))], "namespaces left behind"


def _table(levels: list[Level]) -> str:
    head = ("| CL | fault | SMTP acked | refused | dropped | lost | duplicates | POP3 sessions ok / -ERR / dropped "
            "| IMAP commands (runs) | UID conflicts | IMAP NO / stalled / other | service back after heal |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for lv in levels:
        for p in lv.phases:
            back = "-" if p.healed is None else (f"{p.recovery:.1f} s" if p.recovery is not None else "not back")
            lines.append(
                f"| {p.level} | {p.fault} | {p.acked} | {p.refused} | {p.dropped} | {len(p.lost)} | {p.duplicates} | "
                f"{p.pop3['ok']} / {p.pop3['temp']} / {p.pop3['dropped']} | "
                f"{p.imap_commands} ({p.imap_runs}) | {len(p.violations('uid')) + len(p.uid_conflicts)} | "
                f"{len(p.violations('refused'))} / {len(p.violations('stalled'))} / {len(p.violations('other'))} | "
                f"{back} |")
    head = ("| CL | postal: messages accepted | stored (node showing fewest / most) | lost "
            "| POP3 messages retrieved with other bytes |")
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    for lv in levels:
        lines.append(f"| {lv.level} | {lv.postal_accepted} | {lv.postal_stored[0]} / {lv.postal_stored[1]} | "
                     f"{lv.postal_lost} | {len(lv.pop3_wrong)} |")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def results(cluster: NetnsCluster) -> list[Level]:
    levels = []
    for level in LEVELS:
        levels.append(_run_level(cluster, level))
        print(f"\n{_table(levels[-1:])}", flush=True)
    table = _table(levels)
    print(f"\n{table}\n(faults of {PHASE:.0f} s each, baseline {BASELINE:.0f} s)")
    for lv in levels:
        for p in lv.phases:
            for v in p.imap_violations[:3]:
                print(f"  {lv.level} / {p.fault}: {v[:200]}")
        for p in lv.phases:
            for c in p.uid_conflicts[:3]:
                print(f"  {lv.level} / {p.fault}: UID conflict {c[:200]}")
        if lv.unseen_on_some_node:
            print(f"  {lv.level}: {lv.unseen_on_some_node} acknowledged message(s) not visible on every node after 60 s")
    report = os.environ.get("CASSMAIL_PARTITION_REPORT")
    if report:
        Path(report).write_text(table + "\n")
    return levels


@drill
@DRILL_TIMEOUT
def test_faults_are_in_place_while_injected(results: list[Level]) -> None:
    for lv in results:
        both, one, slow = lv.phases[1:]
        assert any("-A INPUT -s" in f for f in both.faults_seen) and any("-A OUTPUT -d" in f for f in both.faults_seen)
        assert not any("-A INPUT" in f for f in one.faults_seen) and any("-A OUTPUT -d" in f for f in one.faults_seen)
        assert any("NFQUEUE" in f for f in slow.faults_seen) and any("statistic" in f for f in slow.faults_seen)


@drill
@DRILL_TIMEOUT
def test_no_acknowledged_message_is_lost(results: list[Level]) -> None:
    lost = {f"{p.level} / {p.fault}": p.lost[:5] for lv in results for p in lv.phases if p.lost}
    assert not lost, lost
    assert all(p.acked for lv in results for p in lv.phases[:1]), "the baseline delivered nothing"


@drill
@DRILL_TIMEOUT
def test_postal_and_pop3_lose_and_garble_nothing(results: list[Level]) -> None:
    assert all(lv.postal_accepted > 0 for lv in results), [lv.postal_accepted for lv in results]
    assert not [lv.level for lv in results if lv.postal_lost], [(lv.postal_accepted, lv.postal_stored) for lv in results]
    assert not [w for lv in results for w in lv.pop3_wrong]
    assert all(lv.phases[0].pop3["ok"] for lv in results), "POP3 served nothing in a baseline"


@drill
@DRILL_TIMEOUT
def test_no_uid_names_two_messages(results: list[Level]) -> None:
    conflicts = [c for lv in results for p in lv.phases for c in [*p.uid_conflicts, *p.violations("uid")]]
    assert not conflicts, conflicts[:10]
    assert sum(p.imap_commands for lv in results for p in lv.phases) > 0


@drill
@DRILL_TIMEOUT
def test_service_returns_after_every_heal(results: list[Level]) -> None:
    late = [f"{p.level} / {p.fault}" for lv in results for p in lv.phases if p.healed and p.recovery is None]
    assert not late, f"not serving {RECOVERY_LIMIT:.0f} s after heal: {late}"


# --------------------------------------------------------------------------- fast, in the default run


@pytest.mark.parametrize("action", [["partition", "2"], ["delay", "2", "--ms", "200"], ["heal"]])
def test_fault_commands_on_a_loopback_cluster_say_why_in_one_line(tmp_path: Path, action: list[str]) -> None:
    (tmp_path / "cluster.json").write_text(json.dumps({"nodes": 3, "rf": 3, "up": True, "frontends": []}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
    done = subprocess.run([sys.executable, "-m", "cassmail.cli", "cluster", *action], capture_output=True, text=True,
                          env={**env, "CASSMAIL_CLUSTER": str(tmp_path)}, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "cassmail: error: network faults need a cluster started with `cassmail cluster up --netns`"]
