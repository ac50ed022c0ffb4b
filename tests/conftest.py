"""Shared fixtures: a real Cassandra for the session, and the store backends under test.

Where the Cassandra comes from, in order:
1. CASSMAIL_TEST_CASSANDRA=host:port, an already running one;
2. a testcontainers Cassandra when a Docker engine answers;
3. the project's own launcher (deploy/cassandra/launcher.py), a node on 127.0.0.1:19042
   under var/test-cassandra, started for the session and stopped after it
   (left running when CASSMAIL_TEST_KEEP=1, and reused by the next run).
In CI (CI=true) a test that needs Cassandra fails when none can be had; elsewhere it skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cassmail.auth import HashParams, hash_password
from cassmail.checkout import load_launcher
from cassmail.config import CassandraSettings, Settings, host_port
from cassmail.store import make_store
from cassmail.store.base import Store
from tests.nodes import Node, node_settings

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TEST_NATIVE_PORT = 19042
TEST_STORAGE_PORT = 17000
#: Cheap hashes for test users: the cost is a setting and is tested on its own in test_auth.
FAST_HASH = HashParams(log2_n=10, r=8, p=1)

#: Every backend the shared Store contract suite and the protocol suites run against. The WheelFS
#: store runs twice: "wheelfs" with its semantic cues (on a plain directory each cue is a real
#: directory, the paths WheelFS would see) and "wheelfs-plain" with `cues = false`, the layout for
#: NFS, CephFS or a local directory.
BACKENDS = ["cassandra", "mbox", "wheelfs", "wheelfs-plain"]
#: The two WheelFS layouts differ below the Store contract only, so "wheelfs-plain" runs in the
#: contract suite and the WheelFS store's own tests; the protocol suites above the contract run it
#: too when CASSMAIL_ALL_BACKENDS=1 (they take a quarter longer for it).
PLAIN_LAYOUT_SUITES = ("tests/contract/", "tests/test_wheelfs")
#: Where a test marked `store_independent` runs (it checks what no backend changes: timers, TLS,
#: connection limits), unless CASSMAIL_ALL_BACKENDS=1 runs it on every backend.
INDEPENDENT_BACKEND = "mbox"


def _backend_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend_settings") if callspec is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CASSMAIL_ALL_BACKENDS", "").lower() in ("1", "true", "yes"):
        return
    keep, drop = [], []
    for item in items:
        path = Path(str(item.path)).relative_to(REPO).as_posix()
        plain = "[wheelfs-plain" in item.nodeid or "-wheelfs-plain" in item.nodeid
        elsewhere = (item.get_closest_marker("store_independent") is not None
                     and _backend_of(item) not in (None, INDEPENDENT_BACKEND))
        (drop if elsewhere or (plain and not path.startswith(PLAIN_LAYOUT_SUITES)) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def unavailable(reason: str, what: str = "Cassandra") -> None:
    """A part the test needs cannot be had: a failure in CI, a skip elsewhere."""
    if IN_CI:
        pytest.fail(f"{what} is required in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def cassandra_endpoint() -> Iterator[tuple[str, int]]:
    """(host, port) of a Cassandra answering CQL, for the whole test session."""
    launcher = load_launcher()
    named = os.environ.get("CASSMAIL_TEST_CASSANDRA")
    if named:
        host, port = host_port(named, "CASSMAIL_TEST_CASSANDRA")
        if not launcher.cql_ready(host, port, timeout=5):
            unavailable(f"CASSMAIL_TEST_CASSANDRA={named} does not answer CQL")
        yield host, port
        return
    if _docker_engine():
        from testcontainers.cassandra import CassandraContainer

        container = CassandraContainer("cassandra:5.0")
        try:
            container.start()
        except Exception as exc:  # testcontainers raises docker's own errors
            unavailable(f"testcontainers Cassandra did not start: {exc}")
        try:
            yield container.get_container_host_ip(), int(container.get_exposed_port(9042))
        finally:
            container.stop()
        return
    cluster = launcher.LocalCluster(
        REPO / "var" / "test-cassandra",
        1,
        cluster_name="cassmail-test",
        native_port=TEST_NATIVE_PORT,
        storage_port=TEST_STORAGE_PORT,
        heap_mb=1024,
    )
    was_running = cluster.status()[0]["cql"] if (REPO / "var" / "test-cassandra" / "state.json").exists() else False
    try:
        cluster.up(timeout=600)
    except launcher.LauncherError as exc:
        unavailable(f"local Cassandra did not start: {exc}")
    try:
        yield "127.0.0.1", TEST_NATIVE_PORT
    finally:
        if not was_running and os.environ.get("CASSMAIL_TEST_KEEP") != "1":
            cluster.down()


@pytest.fixture(scope="session")
def cassandra_settings(cassandra_endpoint: tuple[str, int]) -> Iterator[CassandraSettings]:
    """A fresh keyspace with the schema applied, dropped after the session."""
    from cassmail.store import cassandra_schema

    host, port = cassandra_endpoint
    settings = CassandraSettings(
        contact_points=[host],
        port=port,
        keyspace=f"cmtest_{uuid.uuid4().hex[:12]}",
        read_consistency="ONE",
        write_consistency="ONE",
        serial_consistency="SERIAL",
        chunk_size=64 * 1024,
        queue_inline_max=128 * 1024,  # so the queue's tests see bodies in the entry and in chunks
    )
    cassandra_schema.apply(settings)
    yield settings
    cassandra_schema.drop(settings)


def backend_settings_for(name: str, request: pytest.FixtureRequest) -> Settings:
    """Complete settings whose [store] section names one backend (an id of BACKENDS) prepared for
    tests; "wheelfs-plain" is store.backend = "wheelfs" with cues off."""
    settings = Settings()
    settings.store.backend = "wheelfs" if name == "wheelfs-plain" else name
    settings.store.max_message_size = 128 * 1024 * 1024
    if name == "cassandra":
        settings.store.cassandra = request.getfixturevalue("cassandra_settings")
    elif name == "mbox":
        from cassmail.config import MboxSettings

        path = request.getfixturevalue("tmp_path_factory").mktemp("mbox-store")
        settings.store.mbox = MboxSettings(path=str(path))
    elif name in ("wheelfs", "wheelfs-plain"):
        from cassmail.config import WheelFSSettings

        path = request.getfixturevalue("tmp_path_factory").mktemp(f"{name}-store")
        settings.store.wheelfs = WheelFSSettings(root=str(path), cues=name == "wheelfs", home_site="test", rep_sites=2,
                                                 sync_level=2)
    else:  # pragma: no cover - a backend listed without a factory
        raise AssertionError(f"no settings for backend {name}")
    return settings


@pytest.fixture(scope="session", params=BACKENDS)
def backend_settings(request: pytest.FixtureRequest) -> Settings:
    """Each backend in turn, as settings: the store fixture and the `cassmail serve` nodes share it."""
    return backend_settings_for(request.param, request)


@contextlib.asynccontextmanager
async def opened_store(settings: Settings) -> AsyncIterator[Store]:
    """The store the settings name, opened in the test process, closed afterwards."""
    opened = make_store(settings)
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture(scope="session")
async def store(backend_settings: Settings) -> AsyncIterator[Store]:
    """The backend's store, opened in the test process; tests isolate themselves by domain."""
    async with opened_store(backend_settings) as opened:
        yield opened


@pytest.fixture
async def domain(store: Store) -> str:
    name = f"t{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(name)
    return name


@pytest.fixture
async def user(store: Store, domain: str) -> str:
    address = f"anne@{domain}"
    await store.create_user(address, hash_password("secret", FAST_HASH))
    return address


# ----------------------------------------------------------------------------- protocol nodes


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed certificate for mx.test."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=mx.test", "-days", "2",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return {"tls_cert": str(cert), "tls_key": str(key)}


@pytest.fixture(scope="session")
def node(backend_settings: Settings, tls_files: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A running `cassmail serve`: MX with STARTTLS and a 5-recipient limit, submission with
    STARTTLS, LMTP in clear text, POP3 with STLS and IMAP with STARTTLS (plaintext login only after
    them)."""
    running = Node(
        node_settings(backend_settings),
        tmp_path_factory.mktemp("node"),
        smtp={**tls_files, "max_recipients": 5},
        submission={**tls_files},
        lmtp={"enabled": True},
        pop3={**tls_files, "auth_failure_delay": 0.5},
        imap={**tls_files, "auth_failure_delay": 0.5, "idle_poll": 0.5},
    ).start()
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.log_text()


@pytest.fixture
async def users(store: Store, domain: str) -> dict[str, str]:
    """anne, bob and carol in a fresh local domain, password = their name."""
    out = {}
    for name in ("anne", "bob", "carol"):
        out[name] = f"{name}@{domain}"
        await store.create_user(out[name], hash_password(name, FAST_HASH))
    return out
