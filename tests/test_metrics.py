"""The Prometheus endpoint as a scraper sees it: a real `cassmail serve` with two workers, mail
sent with smtplib and read with poplib and imaplib, then GET /metrics with urllib; the totals are
the node's over both workers and survive a worker killed with SIGKILL. Plus the store wrapper
on a real store, in this process."""

from __future__ import annotations

import asyncio
import glob
import imaplib
import logging
import os
import poplib
import re
import shutil
import signal
import smtplib
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from cassmail import metrics
from cassmail.auth import hash_password
from cassmail.config import Settings
from cassmail.metrics import CONTRACT_OPS, Metrics, TimedStore
from cassmail.store import make_store
from cassmail.store.base import NoSuchMailbox, NoSuchUser, Store, Target
from tests.conftest import FAST_HASH, backend_settings_for, opened_store
from tests.nodes import CASSMAIL, Node, node_settings

#: Messages larger than this are refused while DATA is read (result too-large).
LIMIT = 64 * 1024

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module", params=["mbox", pytest.param("cassandra", marks=pytest.mark.cassandra)])
def settings(request: pytest.FixtureRequest) -> Settings:
    return backend_settings_for(request.param, request)


@pytest.fixture(scope="module")
async def store(settings: Settings) -> AsyncIterator[Store]:
    async with opened_store(settings) as opened:
        yield opened


@pytest.fixture
async def anne(store: Store) -> str:
    domain = f"m{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    await store.create_user(f"anne@{domain}", hash_password("anne", FAST_HASH))
    return f"anne@{domain}"


def scrape(node: Node, path: str = "/metrics") -> Samples:
    """Every sample of the endpoint, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.port('metrics')}{path}", timeout=10) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain; version=")  # the Prometheus text format
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def settled(node: Node, timeout: float = 30) -> Samples:
    """A scrape once two in a row 0.3 s apart agree and no session is open: `Node.start` probes
    each port with a bare connection, and those sessions are counted when the server notices
    they closed (on a busy machine, a while after the probe has gone)."""
    deadline = time.monotonic() + timeout
    last = scrape(node)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = scrape(node)
        idle = all(v == 0 for (name, _), v in now.items() if name == "cassmail_sessions_open")
        if now == last and idle:
            return now
        last = now
    raise AssertionError(f"the metrics of an idle node never settled: {last}")


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def wait_for(node: Node, expected: dict[tuple[str, tuple[tuple[str, str], ...]], float],
             timeout: float = 15) -> Samples:
    """Scrape until every expected sample has its value (sessions are counted when the server
    has closed them, a moment after the client), then compare them all."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(node)
        if all(samples.get(key) == want for key, want in expected.items()) or time.monotonic() > deadline:
            assert {key: samples.get(key) for key in expected} == expected
            return samples
        time.sleep(0.2)


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def message(n: int, size: int = 0) -> bytes:
    body = f"Subject: metrics {n}\r\nFrom: a@b.test\r\n\r\nbody {n}\r\n".encode()
    return body + b"x" * size + (b"\r\n" if size else b"")


def send(node: Node, rcpt: str, body: bytes) -> None:
    with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
        client.sendmail("a@b.test", [rcpt], body)


def worker_pids(node: Node) -> list[int]:
    """Pids of the workers that said worker-ready, in order."""
    return [int(pid) for pid in re.findall(r"pid=(\d+) \S+ event=worker-ready", node.log_text())]


def serving_pid(port: int, client: socket.socket, candidates: list[int]) -> int:
    """Which of the candidate processes holds the server side of `client`'s connection to `port`."""
    client_port = client.getsockname()[1]
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
        if local == port and remote == client_port:
            inode = fields[9]
    assert inode is not None
    for pid in candidates:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no worker among {candidates} holds the connection")


def metrics_dirs(node: Node) -> list[str]:
    assert node.process is not None
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{metrics.DIR_PREFIX}{node.process.pid}-*"))


# ----------------------------------------------------------------------------- the node


def test_node_totals_over_two_workers_survive_a_killed_worker(settings: Settings, anne: str, tmp_path: Path) -> None:
    base = node_settings(settings)
    base.store.max_message_size = LIMIT
    plain = {"allow_plaintext_auth": True, "auth_failure_delay": 0.0}
    node = Node(base, tmp_path, node={"workers": 2}, metrics={"enabled": True}, pop3=plain, imap=plain).start()
    victim = 0
    try:
        start = settled(node)
        # Every enabled listener's series exist from the start; only the start-up probes' bare
        # connections were counted (Node.start connects to each port until the node answers).
        for listener in ("smtp", "submission", "lmtp", "pop3", "imap"):
            assert value(start, "cassmail_sessions_total", listener=listener) is not None
            assert value(start, "cassmail_sessions_open", listener=listener) == 0
        assert value(start, "cassmail_sessions_total", listener="imap") == 0  # not probed
        for result in ("ok", "tempfail", "too-large"):
            assert value(start, "cassmail_deliveries_total", listener="smtp", result=result) == 0

        def sessions(listener: str, more: int) -> float:
            return value(start, "cassmail_sessions_total", listener=listener) + more
        assert len(metrics_dirs(node)) == 1

        bodies = [message(n) for n in range(3)]
        for body in bodies:
            send(node, anne, body)
        with smtplib.SMTP("127.0.0.1", node.port("smtp"), timeout=30) as client:
            client.ehlo()
            client.mail("a@b.test")  # no SIZE=: refused while DATA is read, past the limit
            client.rcpt(anne)
            assert client.data(message(9, size=LIMIT + 1000))[0] == 552

        client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
        client.user(anne)
        with pytest.raises(poplib.error_proto):
            client.pass_("wrong")  # the session goes on after a failed login
        client.quit()
        client = poplib.POP3("127.0.0.1", node.port("pop3"), timeout=30)
        client.user(anne)
        client.pass_("anne")
        assert client.stat()[0] == 3
        assert b"body 0" in b"\r\n".join(client.retr(1)[1])
        client.quit()

        with imaplib.IMAP4("127.0.0.1", node.port("imap")) as mail:
            mail.login(anne, "anne")
            assert mail.select("INBOX") == ("OK", [b"3"])
            status, data = mail.fetch("2", "(BODY.PEEK[])")
            assert status == "OK" and b"body 1" in data[0][1]
            mail.logout()

        expected = {
            key("cassmail_deliveries_total", listener="smtp", result="ok"): 3,
            key("cassmail_deliveries_total", listener="smtp", result="too-large"): 1,
            key("cassmail_deliveries_total", listener="smtp", result="tempfail"): 0,
            key("cassmail_deliveries_total", listener="submission", result="ok"): 0,
            key("cassmail_delivery_bytes_total", listener="smtp"): sum(len(b) for b in bodies),
            key("cassmail_delivery_recipients_total", listener="smtp"): 3,
            key("cassmail_delivery_seconds_count", listener="smtp"): 4,
            key("cassmail_sessions_total", listener="smtp"): sessions("smtp", 4),
            key("cassmail_sessions_total", listener="pop3"): sessions("pop3", 2),
            key("cassmail_sessions_total", listener="imap"): 1,
            key("cassmail_sessions_total", listener="submission"): sessions("submission", 0),
            key("cassmail_session_seconds_count", listener="pop3"): sessions("pop3", 2),
            key("cassmail_auth_total", listener="pop3", result="ok"): 1,
            key("cassmail_auth_total", listener="pop3", result="fail"): 1,
            key("cassmail_auth_total", listener="imap", result="ok"): 1,
            key("cassmail_store_seconds_count", op="deliver"): 3,  # the refused message never reached it
            key("cassmail_worker_exits_total"): 0,
        }
        before = wait_for(node, expected)
        for op in ("get_password_hash", "read_chunks", "list_messages", "assign_uids"):
            assert (value(before, "cassmail_store_seconds_count", op=op) or 0) > 0, op
        assert value(before, "cassmail_store_seconds_sum", op="deliver") > 0
        errors = {k: v for k, v in before.items() if k[0] in ("cassmail_errors_total", "cassmail_store_errors_total")}
        assert errors and not any(errors.values()), errors  # nothing failed

        # An open session is in the gauge; the worker holding it is killed: the gauge drops it,
        # the supervisor starts another worker, and no total goes down.
        workers = worker_pids(node)
        assert len(workers) == 2
        held = socket.create_connection(("127.0.0.1", node.port("imap")), timeout=30)
        assert held.recv(1024).startswith(b"* OK")
        wait_for(node, {key("cassmail_sessions_open", listener="imap"): 1})
        victim = serving_pid(node.port("imap"), held, workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(worker_pids(node)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(worker_pids(node)) == 3 and victim not in worker_pids(node)[2:]
        held.close()
        after = wait_for(node, {key("cassmail_sessions_open", listener="imap"): 0,
                                key("cassmail_worker_exits_total"): 1})
        counters = [k for k in before if k[0].endswith(("_total", "_count", "_sum", "_bucket"))
                    and k[0] != "cassmail_worker_exits_total"]
        assert counters and all(after[k] >= before[k] for k in counters)
        # Unchanged but for the new worker's store open.
        unchanged = [k for k in counters if ("op", "open") not in k[1]]
        assert {k: after[k] for k in unchanged} == {k: before[k] for k in unchanged}
        assert value(after, "cassmail_store_seconds_count", op="open") == 3

        # Both workers, the new one too, add to the same totals.
        for n in range(3, 7):
            send(node, anne, message(n))
        wait_for(node, {key("cassmail_deliveries_total", listener="smtp", result="ok"): 7,
                        key("cassmail_store_seconds_count", op="deliver"): 7,
                        key("cassmail_sessions_total", listener="smtp"): sessions("smtp", 8)})

        # The exporter itself killed: the supervisor starts another on the same socket, same totals.
        assert node.process is not None
        children = Path(f"/proc/{node.process.pid}/task/{node.process.pid}/children").read_text().split()
        [exporter] = [int(pid) for pid in children if int(pid) not in worker_pids(node)]
        totals = settled(node)
        os.kill(exporter, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while f"event=metrics-exit pid={exporter} code=-9" not in node.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert settled(node) == totals

        # Only /metrics is served.
        with pytest.raises(urllib.error.HTTPError) as missing:
            scrape(node, "/")
        assert missing.value.code == 404
    finally:
        assert node.stop() == 0
    log = node.log_text()
    assert "Traceback" not in log and "event=stopped" in log
    assert f"event=worker-exit worker={victim} code=-9" in log
    assert metrics_dirs(node) == []  # the private directory is gone with the node
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", node.port("metrics")), timeout=2)


def test_metrics_are_off_by_default(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    settings = backend_settings_for("mbox", request)
    assert settings.metrics.enabled is False and settings.metrics.listen == "127.0.0.1:9150"
    node = Node(node_settings(settings), tmp_path).start()
    try:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", node.port("metrics")), timeout=2)
        assert metrics_dirs(node) == []
    finally:
        assert node.stop() == 0


async def test_one_worker_counts_a_store_failure(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Without a supervisor (workers = 1) the serving process counts and the exporter still runs.
    Fault injection: a dot-lock held on the mailbox makes the mbox store give up (lock_timeout),
    so the delivery is a tempfail, a store error and a failed store call."""
    settings = node_settings(backend_settings_for("mbox", request))
    settings.store.mbox.lock_timeout = 0.5
    store = make_store(settings)
    await store.open()
    domain = f"f{uuid.uuid4().hex[:10]}.example"
    await store.add_domain(domain)
    await store.create_user(f"anne@{domain}", hash_password("anne", FAST_HASH))
    mbox, _ = store.mailbox_paths(f"anne@{domain}", "INBOX")
    await store.close()
    # The directory a node killed with SIGKILL left goes at the next start; a live node's stays.
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    left = Path(tempfile.gettempdir(), f"{metrics.DIR_PREFIX}{dead}-test")
    live = Path(tempfile.gettempdir(), f"{metrics.DIR_PREFIX}{os.getpid()}-test")
    for directory in (left, live):
        directory.mkdir()
        (directory / "counter_1.db").write_bytes(b"")
    node = Node(settings, tmp_path, metrics={"enabled": True}).start()
    assert not left.exists() and live.exists()
    shutil.rmtree(live)
    try:
        probed = value(settled(node), "cassmail_sessions_total", listener="smtp")
        lock = Path(f"{mbox}.lock")
        lock.write_text(f"{os.getpid()}\n")  # a live process holds it: never taken as stale
        try:
            with pytest.raises(smtplib.SMTPDataError) as refused:
                await asyncio.to_thread(send, node, f"anne@{domain}", message(1))
            assert refused.value.smtp_code == 451
        finally:
            lock.unlink()
        await asyncio.to_thread(send, node, f"anne@{domain}", message(2))
        await asyncio.to_thread(wait_for, node, {
            key("cassmail_sessions_total", listener="smtp"): probed + 2,
            key("cassmail_deliveries_total", listener="smtp", result="tempfail"): 1,
            key("cassmail_deliveries_total", listener="smtp", result="ok"): 1,
            key("cassmail_errors_total", listener="smtp", kind="store"): 1,
            key("cassmail_errors_total", listener="smtp", kind="internal"): 0,
            key("cassmail_store_errors_total", op="deliver", kind="StoreUnavailable"): 1,
            key("cassmail_store_seconds_count", op="deliver"): 2,
        })
    finally:
        assert node.stop() == 0
    assert metrics_dirs(node) == [] and "Traceback" not in node.log_text()


def test_a_busy_metrics_address_is_one_clear_line(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = Node(node_settings(backend_settings_for("mbox", request)), tmp_path,
                    metrics={"enabled": True, "listen": f"127.0.0.1:{port}"})
        result = subprocess.run([CASSMAIL, "--config", str(node.config), "serve"], capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1
    assert f"metrics.listen: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- the store wrapper


def test_the_wrapper_defines_every_method_of_the_contract() -> None:
    contract = {name for name, attr in vars(Store).items() if not name.startswith("_") and callable(attr)}
    assert contract == set(CONTRACT_OPS)
    assert all(op in vars(TimedStore) for op in CONTRACT_OPS)
    assert not TimedStore.__abstractmethods__


async def test_store_calls_are_timed_and_their_failures_counted(request: pytest.FixtureRequest) -> None:
    """On the mbox store: the wrapper knows no backend, so one proves it."""
    store = make_store(backend_settings_for("mbox", request))
    await store.open()
    try:
        domain = f"w{uuid.uuid4().hex[:10]}.example"
        await store.add_domain(domain)
        await store.create_user(f"anne@{domain}", hash_password("anne", FAST_HASH))
        await _timed_calls(store, f"anne@{domain}")
    finally:
        await store.close()


async def _timed_calls(store: Store, anne: str) -> None:
    registry = CollectorRegistry()
    timed = TimedStore(store, Metrics(registry))
    sample: Callable[..., float | None] = registry.get_sample_value
    assert timed.max_message_size == store.max_message_size

    [message_id] = await timed.deliver(message(1, size=10_000), [Target(anne)])
    assert sample("cassmail_store_seconds_count", {"op": "deliver"}) == 1
    listed = [s.id async for s in timed.list_messages(anne, "INBOX")]
    assert listed == [s.id async for s in store.list_messages(anne, "INBOX")] == [message_id]
    assert sample("cassmail_store_seconds_count", {"op": "list_messages"}) == 1

    # A stream counts the time spent waiting for the store, not the consumer's.
    chunks = []
    async for chunk in timed.read_chunks(anne, "INBOX", message_id):
        chunks.append(chunk)
        await asyncio.sleep(0.3)
    assert b"".join(chunks) == await store.read_message(anne, "INBOX", message_id)
    assert sample("cassmail_store_seconds_count", {"op": "read_chunks"}) == 1
    assert sample("cassmail_store_seconds_sum", {"op": "read_chunks"}) < 0.3
    # Closed before its end, it is recorded once too.
    stream = timed.read_chunks(anne, "INBOX", message_id, 0, 10)
    assert await stream.__anext__() == chunks[0][:10]
    await stream.aclose()
    assert sample("cassmail_store_seconds_count", {"op": "read_chunks"}) == 2

    with pytest.raises(NoSuchUser):
        await timed.get_password_hash("nobody@" + anne.split("@")[1])
    with pytest.raises(NoSuchMailbox):
        await timed.deliver(b"Subject: x\r\n\r\nx\r\n", [Target(anne, "Nowhere")])
    assert sample("cassmail_store_errors_total", {"op": "get_password_hash", "kind": "NoSuchUser"}) == 1
    assert sample("cassmail_store_errors_total", {"op": "deliver", "kind": "NoSuchMailbox"}) == 1
    assert sample("cassmail_store_seconds_count", {"op": "deliver"}) == 2  # a failed call is timed too
    assert await timed.user_exists(anne) and sample("cassmail_store_seconds_count", {"op": "user_exists"}) == 1


# ----------------------------------------------------------------------------- events to counters


def test_events_become_bounded_counters() -> None:
    """The mapping from log events for the failures a test cannot provoke from outside (a bug
    caught in a front end): each failure counted once, labels only from bounded sets."""
    from cassmail.logs import add_observer, kv, remove_observer
    from cassmail.metrics import _UnstructuredErrors

    registry = CollectorRegistry()
    counted = Metrics(registry)
    handler = _UnstructuredErrors(counted)
    add_observer(counted.on_event)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        kv("session-error", error="KeyError")  # aiosmtpd's handler errors say no listener
        kv("pop3-error", peer="192.0.2.1", user="anne@x.test", command="retr")
        kv("auth", listener="pop3", peer="192.0.2.1", user="anne@x.test", error="down")  # then the result line:
        kv("auth", listener="pop3", peer="192.0.2.1", user="anne@x.test", result="tempfail", ms=3)
        kv("imap-syntax", peer="192.0.2.1", error="bad literal")  # the client's mistake, not ours
        kv("retr", listener="pop3", user="anne@x.test", result="stalled", error="no reads")  # the client's too
        kv("retr", listener="pop3", user="anne@x.test", result="cut", error="down")  # the store's
        kv("imap-closed", peer="192.0.2.1", reason="gone")
        kv("session", listener="anne@x.test", ms=5)  # never a user as a label value
        kv("delivery", listener="lmtp", result="weird", ms=7, size=10, rcpts=1)
        logging.getLogger("cassmail.imap.session").error("imap command failed")  # not an event: counted here
        logging.getLogger("cassmail.pop3.server").error(kv("pop3-error", command="quit"))  # an event: counted once
        logging.getLogger("cassandra.cluster").error("control connection lost")  # the driver's, not ours
    finally:
        remove_observer(counted.on_event)
        root.removeHandler(handler)
    kv("session-error", error="after")  # no longer observed

    def count(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert count("cassmail_errors_total", listener="smtp", kind="internal") == 1
    assert count("cassmail_errors_total", listener="pop3", kind="internal") == 2
    assert count("cassmail_errors_total", listener="pop3", kind="store") == 2
    assert count("cassmail_errors_total", listener="imap", kind="internal") == 1
    assert count("cassmail_errors_total", listener="imap", kind="store") is None
    assert count("cassmail_auth_total", listener="pop3", result="tempfail") == 1
    assert count("cassmail_sessions_total", listener="other") == 1
    assert count("cassmail_deliveries_total", listener="lmtp", result="other") == 1
    assert count("cassmail_delivery_bytes_total", listener="lmtp") is None  # only delivered mail
    assert sum(s.value for f in registry.collect() if f.name == "cassmail_errors" for s in f.samples
               if s.name == "cassmail_errors_total") == 6
