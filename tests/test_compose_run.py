"""The project's compose cluster, run for real on this machine's container engine.

Images come from deploy/images.py (a local Debian base, Cassandra 5.0 and cassmail; cached
after the first build), the compose file from deploy/compose.py, and `docker compose`
drives Docker or podman's Docker API (deploy/compose_run.py). Mail goes in over SMTP on
node 1's published port and comes out over POP3 and IMAP on the last node's; users are
made with `compose exec`, as an operator would.

The default run (`make test`, and so CI) brings up one node: 2 to 3 minutes on 2 cores with
nothing cached (podman, the images, Compose v2), 1 with the images built. Without a container
engine the test fails in CI and is skipped elsewhere; CASSMAIL_COMPOSE_TEST=0 leaves it out.
`make compose-test COMPOSE_NODES=3` (or 5) is the run from the command line, which also stops
one Cassandra container while mail is delivered (RF=2, consistency ONE) and checks that every
acknowledged message can be read afterwards. CASSMAIL_COMPOSE_OUTAGE_SECONDS (default 20)
is how long that container stays stopped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from tests.cluster_clients import imap_read, make_message, pop3_read, smtp_send, subject_of
from tests.conftest import unavailable

REPO = Path(__file__).resolve().parent.parent
NODES = int(os.environ.get("CASSMAIL_COMPOSE_NODES", "1"))
OUTAGE_SECONDS = float(os.environ.get("CASSMAIL_COMPOSE_OUTAGE_SECONDS", "20"))
#: Host address the nodes' ports are published on: a loopback address of its own, so a
#: developer's `make run` on 127.0.0.1:2525 does not collide with node 1.
PUBLISH = os.environ.get("CASSMAIL_COMPOSE_PUBLISH", "127.0.0.61")
DOMAIN = "compose.test"
LOGS = REPO / "var" / "compose-test"
USERS = [f"user{i}@{DOMAIN}" for i in range(1, 6)]
#: Terminal control sequences some Compose versions write into `logs` even with --no-color.
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

pytestmark = pytest.mark.skipif(os.environ.get("CASSMAIL_COMPOSE_TEST") == "0", reason="CASSMAIL_COMPOSE_TEST=0")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"cassmail_deploy_{name}", REPO / "deploy" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compose_run = _load("compose_run")
compose_gen = _load("compose")


@dataclass
class Cluster:
    engine: object
    nodes: int
    figures: dict[str, float] = field(default_factory=dict)

    def port(self, listener: str, node: int) -> int:
        return compose_gen.host_port(listener, node)

    def compose(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.engine.compose(*args, **kwargs)  # type: ignore[attr-defined]


def _password(user: str) -> str:
    return "pw-" + user.split("@")[0]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    try:
        compose_run.images.find_engine()
    except compose_run.images.ImageError as exc:
        unavailable(f"{exc} (make compose-tools installs podman)", "A container engine")
    built = subprocess.run([sys.executable, str(REPO / "deploy" / "images.py"), "all"], capture_output=True, text=True)
    assert built.returncode == 0, f"images could not be built:\n{built.stdout[-3000:]}\n{built.stderr[-2000:]}"
    env = dict(os.environ)
    env.update({
        "CASSANDRA_HEAP": env.get("CASSANDRA_HEAP", "512M"),
        "CASSMAIL_WORKERS": "1",
        "CASSMAIL_PUBLISH_ADDRESS": PUBLISH,
        "CASSMAIL_RF": str(min(2, NODES)),
        "CASSMAIL_READ_CONSISTENCY": "ONE",
        "CASSMAIL_WRITE_CONSISTENCY": "ONE",
    })
    project = f"cassmailtest{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="cassmail-compose-test-") as tmp:
        files = compose_run.compose_file(NODES, Path(tmp))
        with compose_run.Engine(project, files, env) as engine:
            started = time.monotonic()
            try:
                engine.compose("up", "-d", "--wait", "--wait-timeout", str(300 * NODES), timeout=400 * NODES)
                cluster = Cluster(engine, NODES)
                cluster.figures["seconds to a healthy cluster"] = round(time.monotonic() - started)
                yield cluster
                print(f"\ncompose figures ({NODES} node(s)): {cluster.figures}")
            finally:
                # Every container's log, kept for the post-mortem of a failed run (var/ is not committed).
                logs = engine.compose("logs", "--no-color", "--timestamps", check=False, capture=True)
                LOGS.mkdir(parents=True, exist_ok=True)
                (LOGS / f"{project}.log").write_text(ANSI.sub("", logs.stdout + logs.stderr))
                print(f"\ncontainer logs: {LOGS / (project + '.log')}")
                engine.compose("down", "-v", "--timeout", "20", check=False, timeout=300)


def _add_users(cluster: Cluster) -> None:
    cluster.compose("exec", "-T", "mail1", "cassmail", "domain", "add", DOMAIN)
    for user in USERS:
        cluster.compose("exec", "-T", "mail1", "cassmail", "user", "add", "--password-stdin", user,
                        input=_password(user) + "\n")


def test_mail_in_over_smtp_on_node_one_and_out_over_pop3_and_imap_on_the_last_node(cluster: Cluster) -> None:
    _add_users(cluster)
    last = cluster.nodes
    subject = f"compose-{uuid.uuid4().hex}"
    sent = smtp_send(PUBLISH, cluster.port("smtp", 1), USERS[0], make_message(subject))
    assert sent.ok, sent.text
    popped = pop3_read(PUBLISH, cluster.port("pop3", last), USERS[0], _password(USERS[0]))
    assert popped.ok, popped.text
    assert [subject_of(m) for m in popped.messages] == [subject]
    fetched = imap_read(PUBLISH, cluster.port("imap", last), USERS[0], _password(USERS[0]))
    assert fetched.ok, fetched.text
    assert [subject_of(m) for m in fetched.messages] == [subject]
    # Every node's healthcheck (SMTP, submission, POP3 and IMAP greetings) holds inside the image too.
    for i in range(1, last + 1):
        cluster.compose("exec", "-T", f"mail{i}", "python", "-m", "cassmail.healthcheck")


@pytest.mark.skipif(NODES < 3, reason="the Cassandra stop needs RF=2 on three nodes: CASSMAIL_COMPOSE_NODES=3")
def test_a_cassandra_container_stopped_under_load_loses_no_acknowledged_message(cluster: Cluster) -> None:
    """Deliveries to nodes 1 and 2 go on while cassandra2 is stopped and started again; every
    message a node answered 250 for is then read over IMAP on the last node."""
    acked: dict[str, str] = {}
    refused: list[str] = []
    phase = {"now": "before"}
    during: list[str] = []
    stop = threading.Event()

    def load(node: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            user = USERS[n % len(USERS)]
            subject = f"load-{node}-{n}-{uuid.uuid4().hex[:8]}"
            outcome = smtp_send(PUBLISH, cluster.port("smtp", node), user, make_message(subject), timeout=30)
            if outcome.ok:
                acked[subject] = user
                if phase["now"] == "stopped":
                    during.append(subject)
            else:
                refused.append(outcome.text)
            time.sleep(0.05)

    senders = [threading.Thread(target=load, args=(node,), daemon=True) for node in (1, 2)]
    for sender in senders:
        sender.start()
    try:
        time.sleep(5)
        cluster.compose("stop", "--timeout", "20", "cassandra2")
        phase["now"] = "stopped"
        time.sleep(OUTAGE_SECONDS)
        phase["now"] = "restarting"
        # --no-deps: `start` would start the services it depends on as well.
        cluster.compose("up", "-d", "--no-deps", "--wait", "--wait-timeout", "300", "cassandra2", timeout=400)
        phase["now"] = "after"
        time.sleep(5)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    assert during, f"no delivery was acknowledged while cassandra2 was stopped; refusals: {refused[-5:]}"
    missing, failures = _unread(cluster, acked, deadline=time.monotonic() + 120)
    cluster.figures.update({
        "acknowledged": len(acked),
        "acknowledged while a Cassandra node was stopped": len(during),
        "refused (not acknowledged)": len(refused),
        "lost": len(missing),
    })
    assert not missing, (f"{len(missing)} acknowledged message(s) never read: {sorted(missing)[:10]}; "
                         f"last read failures: {failures}")


def _unread(cluster: Cluster, acked: dict[str, str], deadline: float) -> tuple[set[str], dict[str, str]]:
    """Acknowledged subjects not (yet) seen over IMAP on the last node, and each user's last failed
    read; retried until `deadline`, since a replica that was down gets its missed writes from hints
    after it is back."""
    missing = set(acked)
    failures: dict[str, str] = {}
    while True:
        for user in USERS:
            fetched = imap_read(PUBLISH, cluster.port("imap", cluster.nodes), user, _password(user))
            if fetched.ok:
                missing -= {subject_of(m) for m in fetched.messages}
                failures.pop(user, None)
            else:
                failures[user] = f"{fetched.kind}: {fetched.text[:300]}"
        if not missing or time.monotonic() > deadline:
            return missing, failures
        time.sleep(5)
