"""Specifications of deploy/cassandra/launcher.py that need no running Cassandra.

The launcher is loaded from its path (it is a script beside the deployment files,
not part of the cassmail package).  Everything here runs in well under a second
per test: java and mvn are replaced by tiny shell scripts where they matter, and
"Cassandra processes" are Python sleepers whose command line looks like one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

LAUNCHER_PATH = Path(__file__).resolve().parent.parent / "deploy" / "cassandra" / "launcher.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launcher_under_test", LAUNCHER_PATH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass/typing lookups need the module registered
    spec.loader.exec_module(module)
    return module


launcher = _load()


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def top_level_yaml(text: str) -> dict[str, object]:
    """The top-level ``key: scalar`` pairs of the launcher's own YAML output."""
    out: dict[str, object] = {}
    for line in text.splitlines():
        if not line or line.startswith((" ", "#", "-")) or ":" not in line:
            continue
        key, _, value = line.partition(":")
        value = value.strip()
        if not value:
            continue
        out[key] = json.loads(value) if value[0] in '"[0123456789' else {
            "true": True, "false": False}.get(value, value)
    return out


def yaml_list_under(text: str, key: str) -> list[str]:
    """The indented ``- item`` lines right under a top-level key."""
    lines = text.splitlines()
    start = lines.index(f"{key}:")
    items = []
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        items.append(line.strip().removeprefix("- "))
    return items


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin dir that is the whole PATH: tests put fake java/mvn scripts in it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    return bin_dir


def fake_java(bin_dir: Path, version: str = "17.0.15") -> Path:
    return write_script(bin_dir, "java", f'echo \'openjdk version "{version}" 2025-04-15\' >&2\n')


@pytest.fixture
def sleeper() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start processes with chosen command lines; all are reaped afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*extra_args: str) -> subprocess.Popen[bytes]:
        code = "import time\nwhile True: time.sleep(0.05)"
        proc = subprocess.Popen([sys.executable, "-c", code, *extra_args])
        procs.append(proc)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until /proc shows the final command line
            if Path(f"/proc/{proc.pid}/cmdline").read_bytes().count(b"\0") > 2:
                break
            time.sleep(0.01)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def write_state(base: Path, pids: list[int | None], native_port: int = 9042,
                storage_port: int = 7000) -> None:
    base.mkdir(parents=True, exist_ok=True)
    nodes = [
        {"index": i, "address": f"127.0.0.{i}", "pid": pid,
         "config": str(base / f"node{i}" / "conf" / "cassandra.yaml")}
        for i, pid in enumerate(pids, start=1)
    ]
    (base / "state.json").write_text(json.dumps({
        "cluster_name": "cassmail", "native_port": native_port,
        "storage_port": storage_port, "heap_mb": 1024, "nodes": nodes,
    }))


class OneShotServer:
    """A TCP server on 127.0.0.1 answering each connection with ``reply(request)``."""

    def __init__(self, reply: Callable[[bytes], bytes | None]) -> None:
        self.reply = reply
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    data = conn.recv(1024)
                    self.received.append(data)
                    answer = self.reply(data)
                    if answer:
                        conn.sendall(answer)
                    time.sleep(0.05)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------- configuration


def test_node_2_of_3_gets_its_own_address_the_shared_ports_and_node_1_as_seed(tmp_path: Path) -> None:
    cluster = launcher.LocalCluster(tmp_path / "c", 3, native_port=19042, storage_port=17000,
                                    cluster_name="mail-test")
    cluster.write_node_files(2)
    node = (tmp_path / "c" / "node2").resolve()
    text = (node / "conf" / "cassandra.yaml").read_text()
    conf = top_level_yaml(text)

    assert conf["cluster_name"] == "mail-test"
    assert conf["listen_address"] == "127.0.0.2"
    assert conf["rpc_address"] == "127.0.0.2"
    assert conf["native_transport_port"] == 19042
    assert conf["storage_port"] == 17000
    assert '- seeds: "127.0.0.1:17000"' in text
    assert "org.apache.cassandra.locator.SimpleSeedProvider" in text
    assert conf["commitlog_directory"] == str(node / "commitlog")
    assert conf["saved_caches_directory"] == str(node / "saved_caches")
    assert conf["hints_directory"] == str(node / "hints")
    assert conf["cdc_raw_directory"] == str(node / "cdc_raw")
    assert yaml_list_under(text, "data_file_directories") == [json.dumps(str(node / "data"))]
    for sub in ("data", "commitlog", "saved_caches", "hints", "cdc_raw", "logs"):
        assert (node / sub).is_dir()


def test_yaml_keeps_tests_cheap_balanced_and_simple(tmp_path: Path) -> None:
    cluster = launcher.LocalCluster(tmp_path, 3)
    cluster.write_node_files(3)
    conf = top_level_yaml(cluster.config_path(3).read_text())

    assert conf["num_tokens"] == 16
    assert conf["allocate_tokens_for_local_replication_factor"] == 3
    assert conf["partitioner"] == "org.apache.cassandra.dht.Murmur3Partitioner"
    assert conf["endpoint_snitch"] == "SimpleSnitch"
    assert conf["commitlog_sync"] == "periodic"
    assert conf["phi_convict_threshold"] == 5  # (a dead node is seen in about 11 s, not 18)
    assert conf["auto_snapshot"] is False
    assert conf["materialized_views_enabled"] is False
    assert conf["user_defined_functions_enabled"] is False


def test_only_nodes_joining_a_cluster_no_client_has_used_skip_the_paxos_repair(tmp_path: Path) -> None:
    cluster = launcher.LocalCluster(tmp_path, 3)
    assert cluster.is_new()
    cluster.write_node_files(2, new_cluster=True)
    assert top_level_yaml(cluster.config_path(2).read_text())["skip_paxos_repair_on_topology_change"] is True
    (cluster.node_dir(1) / "data" / "system").mkdir(parents=True)  # node 1 has run
    assert not cluster.is_new()
    cluster.write_node_files(2)  # a restart, or a node added later: the join repairs
    assert "skip_paxos_repair" not in cluster.config_path(2).read_text()


def test_logback_writes_info_to_a_rolling_system_log_and_nothing_to_the_console(tmp_path: Path) -> None:
    cluster = launcher.LocalCluster(tmp_path, 1)
    cluster.write_node_files(1)
    xml = (cluster.node_dir(1) / "conf" / "logback.xml").read_text()

    assert f"<file>{cluster.node_dir(1) / 'logs'}/system.log</file>" in xml
    assert "RollingFileAppender" in xml
    assert "ConsoleAppender" not in xml
    assert '<root level="INFO">' in xml


def test_jvm_command_runs_cassandra_daemon_with_heap_java17_opens_and_this_nodes_config(
        tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "jamm-0.4.0.jar").write_bytes(b"")
    cluster = launcher.LocalCluster(tmp_path / "c", 2, heap_mb=512)
    args = cluster.jvm_args(2, lib)

    assert args[-1] == "org.apache.cassandra.service.CassandraDaemon"
    assert "-Xms512m" in args and "-Xmx512m" in args
    assert f"-Dcassandra.config=file://{cluster.config_path(2)}" in args
    assert f"-javaagent:{lib / 'jamm-0.4.0.jar'}" in args
    assert "java.base/java.lang=ALL-UNNAMED" in args
    assert "-Djava.net.preferIPv4Stack=true" in args
    # Skipping the gossip settle wait is only safe when there is nobody to gossip with.
    assert "-Dcassandra.skip_wait_for_gossip_to_settle=0" not in args
    single = launcher.LocalCluster(tmp_path / "s", 1).jvm_args(1, lib)
    assert "-Dcassandra.skip_wait_for_gossip_to_settle=0" in single


def test_contact_points_are_one_loopback_address_per_node(tmp_path: Path) -> None:
    assert launcher.LocalCluster(tmp_path, 3).contact_points() == [
        "127.0.0.1", "127.0.0.2", "127.0.0.3"]


# --------------------------------------------------------------------------- state


def test_a_later_process_adopts_the_recorded_ports_and_node_count(tmp_path: Path) -> None:
    write_state(tmp_path, [None, None], native_port=19042, storage_port=17000)

    cluster = launcher.LocalCluster(tmp_path)  # defaults, as `launcher.py down` would pass

    assert (cluster.nodes, cluster.native_port, cluster.storage_port) == (2, 19042, 17000)


def test_asking_for_other_ports_than_the_recorded_cluster_is_refused(tmp_path: Path) -> None:
    write_state(tmp_path, [None], native_port=19042, storage_port=17000)

    with pytest.raises(launcher.LauncherError, match="native_port=19042"):
        launcher.LocalCluster(tmp_path, native_port=29042)


def test_status_reports_every_node_down_when_nothing_runs(tmp_path: Path) -> None:
    write_state(tmp_path, [None, None])

    rows = launcher.LocalCluster(tmp_path).status()

    assert [(r["index"], r["address"], r["running"], r["cql"]) for r in rows] == [
        (1, "127.0.0.1", False, False), (2, "127.0.0.2", False, False)]


# --------------------------------------------------------------------------- process safety


def test_down_never_signals_a_recorded_pid_that_is_not_a_cassandra_process(
        tmp_path: Path, sleeper, monkeypatch: pytest.MonkeyPatch) -> None:
    stranger = sleeper()  # e.g. the pid was recycled by an unrelated program
    write_state(tmp_path, [stranger.pid])
    signalled: list[tuple[int, int]] = []
    real_kill = os.kill
    monkeypatch.setattr(os, "kill", lambda pid, sig: (signalled.append((pid, sig)), real_kill(pid, sig)))

    launcher.LocalCluster(tmp_path).down()

    assert signalled == []
    assert stranger.poll() is None


def test_down_never_signals_a_cassandra_daemon_of_another_base_dir(
        tmp_path: Path, sleeper, monkeypatch: pytest.MonkeyPatch) -> None:
    other_config = tmp_path / "other" / "node1" / "conf" / "cassandra.yaml"
    other = sleeper(f"-Dcassandra.config=file://{other_config}",
                    "org.apache.cassandra.service.CassandraDaemon")
    mine = tmp_path / "mine"
    write_state(mine, [other.pid])
    signalled: list[tuple[int, int]] = []
    real_kill = os.kill
    monkeypatch.setattr(os, "kill", lambda pid, sig: (signalled.append((pid, sig)), real_kill(pid, sig)))

    cluster = launcher.LocalCluster(mine)
    assert cluster.is_running(1) is False
    cluster.down()

    assert signalled == []
    assert other.poll() is None


def test_down_terminates_this_base_dirs_daemon_and_clears_its_pid(tmp_path: Path, sleeper) -> None:
    base = tmp_path.resolve()
    config = base / "node1" / "conf" / "cassandra.yaml"
    daemon = sleeper(f"-Dcassandra.config=file://{config}",
                     "org.apache.cassandra.service.CassandraDaemon")
    write_state(base, [daemon.pid])
    cluster = launcher.LocalCluster(base)
    assert cluster.is_running(1)

    cluster.down(timeout=5)

    assert daemon.wait(timeout=5) == -signal.SIGTERM
    assert json.loads((base / "state.json").read_text())["nodes"][0]["pid"] is None


def test_kill_node_sends_sigkill_only_to_that_node(tmp_path: Path, sleeper) -> None:
    base = tmp_path.resolve()
    daemons = [sleeper(f"-Dcassandra.config=file://{base / f'node{i}' / 'conf' / 'cassandra.yaml'}",
                       "org.apache.cassandra.service.CassandraDaemon") for i in (1, 2)]
    write_state(base, [d.pid for d in daemons])

    launcher.LocalCluster(base).kill_node(2)

    assert daemons[1].wait(timeout=5) == -signal.SIGKILL
    assert daemons[0].poll() is None


# --------------------------------------------------------------------------- timer slack


def test_timer_slack_is_set_for_the_calling_thread_and_inherited_by_what_it_starts() -> None:
    before = launcher.timer_slack()
    assert before > 0  # Linux: 50 us unless something changed it
    try:
        assert launcher.timer_slack(launcher.TIMER_SLACK_NS) == before
        child = subprocess.run(["cat", "/proc/self/timerslack_ns"], capture_output=True, text=True, check=True)
        assert int(child.stdout) == launcher.TIMER_SLACK_NS
    finally:
        launcher.timer_slack(before)
    assert launcher.timer_slack() == before


@pytest.mark.cassandra
def test_the_suites_cassandra_node_and_its_threads_run_with_the_launchers_timer_slack(cassandra_endpoint) -> None:
    """The node the suite started with the launcher: its idle pool workers' short parks are
    grouped (see TIMER_SLACK_NS), and the launcher's own thread got its slack back."""
    if os.environ.get("CASSMAIL_TEST_CASSANDRA"):
        pytest.skip("CASSMAIL_TEST_CASSANDRA names a Cassandra the launcher did not start")
    state = json.loads((Path(__file__).resolve().parent.parent / "var" / "test-cassandra" / "state.json").read_text())
    pid = state["nodes"][0]["pid"]
    threads = os.listdir(f"/proc/{pid}/task")
    assert len(threads) > 20  # Cassandra's pools
    slacks = {int(Path(f"/proc/{tid}/timerslack_ns").read_text()) for tid in threads}
    assert slacks == {launcher.TIMER_SLACK_NS}
    assert launcher.timer_slack() != launcher.TIMER_SLACK_NS


def test_the_suites_cassandra_node_takes_trie_memtables_trie_indexed_sstables_and_paxos_v2(cassandra_endpoint) -> None:
    """The launcher's storage settings (5.0's cassandra_latest.yaml ones) and its Paxos variant,
    as the running node reports the configuration it took."""
    from cassandra.cluster import Cluster

    if os.environ.get("CASSMAIL_TEST_CASSANDRA"):
        pytest.skip("CASSMAIL_TEST_CASSANDRA names a Cassandra the launcher did not start")

    host, port = cassandra_endpoint
    cluster = Cluster([host], port=port)
    try:
        settings = {r.name: r.value for r in cluster.connect().execute("SELECT name, value FROM system_views.settings")}
    finally:
        cluster.shutdown()
    assert settings["storage_compatibility_mode"] == "NONE"
    assert settings["sstable.selected_format"] == "bti"
    assert "default=trie" in settings["memtable.configurations"]
    assert "trie=TrieMemtable" in settings["memtable.configurations"]
    assert (settings["paxos_variant"], settings["paxos_state_purging"]) == ("v2", "legacy")
    assert settings["memtable_allocation_type"] == "offheap_buffers"
    # The suite's node lives on a file system that takes O_DIRECT (the probe says which).
    mode = launcher.commitlog_access_mode(Path(__file__).resolve().parent.parent / "var" / "test-cassandra")
    assert settings["commitlog_disk_access_mode"] == mode


def test_the_commit_log_is_written_directly_where_the_file_system_takes_o_direct(tmp_path, monkeypatch) -> None:
    assert launcher.commitlog_access_mode(tmp_path / "node1" / "commitlog") == "direct"  # ext4, tmpfs since 6.6
    refusing = tmp_path / "refuses"
    refusing.mkdir()
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # what a file system without O_DIRECT answers
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    assert launcher.commitlog_access_mode(refusing / "commitlog") == "legacy"
    monkeypatch.undo()
    assert list(refusing.iterdir()) == []  # the probe leaves nothing behind


# --------------------------------------------------------------------------- CQL probe


def test_cql_ready_is_false_on_a_closed_port() -> None:
    assert launcher.cql_ready("127.0.0.1", free_port(), timeout=1.0) is False


def test_cql_ready_is_false_for_a_tcp_server_that_does_not_speak_cql() -> None:
    server = OneShotServer(lambda _req: b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        assert launcher.cql_ready("127.0.0.1", server.port, timeout=1.0) is False
        assert server.received, "the probe must actually talk to the server"
    finally:
        server.close()


def test_cql_ready_is_false_for_a_silent_server_and_for_an_echo_server() -> None:
    silent = OneShotServer(lambda _req: None)
    echo = OneShotServer(lambda req: req)
    try:
        assert launcher.cql_ready("127.0.0.1", silent.port, timeout=0.5) is False
        assert launcher.cql_ready("127.0.0.1", echo.port, timeout=0.5) is False
    finally:
        silent.close()
        echo.close()


def test_cql_ready_sends_options_and_accepts_a_supported_response() -> None:
    def supported(req: bytes) -> bytes:
        version, _flags, stream, opcode, _length = req[0], req[1], req[2:4], req[4], req[5:9]
        assert opcode == 0x05  # OPTIONS
        body = b"\x00\x00"  # an empty string multimap
        return bytes([0x80 | version, 0]) + stream + bytes([0x06]) + len(body).to_bytes(4, "big") + body

    server = OneShotServer(supported)
    try:
        assert launcher.cql_ready("127.0.0.1", server.port, timeout=1.0) is True
        assert server.received[0][0] in (4, 5)
    finally:
        server.close()


# --------------------------------------------------------------------------- tools


def test_missing_java_is_a_clear_launcher_error(tmp_path: Path, fake_tools: Path) -> None:
    cluster = launcher.LocalCluster(tmp_path / "c", native_port=free_port(), storage_port=free_port(),
                                    cache_dir=tmp_path / "cache")

    with pytest.raises(launcher.LauncherError, match=r"java not found on PATH.*OpenJDK 17"):
        cluster.start_node(1)
    assert not (tmp_path / "c" / "state.json").exists() or \
        json.loads((tmp_path / "c" / "state.json").read_text())["nodes"][0]["pid"] is None


def test_fetching_jars_without_java_is_a_clear_launcher_error(tmp_path: Path, fake_tools: Path) -> None:
    with pytest.raises(launcher.LauncherError, match="java not found on PATH"):
        launcher.ensure_jars(tmp_path / "cache")


def test_java_21_is_refused_because_cassandra_5_runs_on_11_or_17(fake_tools: Path) -> None:
    fake_java(fake_tools, "21.0.2")

    with pytest.raises(launcher.LauncherError, match=r"Java 21.*only on Java 11 or 17"):
        launcher.check_java()


@pytest.mark.parametrize("printed, major", [("17.0.15", 17), ("11.0.22", 11), ("1.8.0_392", 8)])
def test_java_version_reads_the_feature_release(fake_tools: Path, printed: str, major: int) -> None:
    fake_java(fake_tools, printed)
    assert launcher.java_version() == major


def test_missing_mvn_is_a_clear_launcher_error(tmp_path: Path, fake_tools: Path) -> None:
    fake_java(fake_tools)

    with pytest.raises(launcher.LauncherError, match="mvn not found on PATH"):
        launcher.ensure_jars(tmp_path / "cache")


def test_jars_already_cached_are_used_without_running_mvn(tmp_path: Path, fake_tools: Path) -> None:
    lib = tmp_path / "cache" / "cassandra-5.0.6" / "lib"
    lib.mkdir(parents=True)
    (lib / "cassandra-all-5.0.6.jar").write_bytes(b"")

    assert launcher.ensure_jars(tmp_path / "cache") == lib.resolve()


def test_a_failed_fetch_reports_mvns_last_lines_and_leaves_no_lib_dir(tmp_path: Path, fake_tools: Path) -> None:
    fake_java(fake_tools)
    write_script(fake_tools, "mvn", "echo '[ERROR] Could not resolve org.apache.cassandra:cassandra-all'\nexit 1\n")

    with pytest.raises(launcher.LauncherError, match="Could not resolve"):
        launcher.ensure_jars(tmp_path / "cache")
    home = tmp_path / "cache" / "cassandra-5.0.6"
    assert not (home / "lib").exists()
    assert list(home.iterdir()) == []  # the partial download was removed


def test_a_successful_fetch_appears_at_once_with_the_requested_version(tmp_path: Path, fake_tools: Path) -> None:
    fake_java(fake_tools)
    # Writes a jar named after -Dcassandra.version into -DoutputDirectory.
    write_script(fake_tools, "mvn", """
for a in "$@"; do
  case "$a" in
    -DoutputDirectory=*) out="${a#-DoutputDirectory=}" ;;
    -Dcassandra.version=*) v="${a#-Dcassandra.version=}" ;;
  esac
done
: > "$out/cassandra-all-$v.jar"
: > "$out/jamm-0.4.0.jar"
""")

    lib = launcher.ensure_jars(tmp_path / "cache", version="5.0.9")

    assert lib == (tmp_path / "cache" / "cassandra-5.0.9" / "lib").resolve()
    assert sorted(p.name for p in lib.iterdir()) == ["cassandra-all-5.0.9.jar", "jamm-0.4.0.jar"]


def test_default_cache_dir_honours_cassmail_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CASSMAIL_CACHE", str(tmp_path))
    assert launcher.default_cache_dir() == tmp_path
    monkeypatch.delenv("CASSMAIL_CACHE")
    assert launcher.default_cache_dir() == Path.home() / ".cache" / "cassmail"


# --------------------------------------------------------------------------- CLI


def test_cli_errors_are_one_line_on_stderr_with_a_nonzero_exit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = launcher.main(["--base-dir", str(tmp_path), "stop", "5"])

    err = capsys.readouterr().err
    assert code != 0
    assert err.strip() == "launcher: error: no node 5: this cluster has nodes 1..1"
    assert "Traceback" not in err


def test_cli_status_prints_a_table_with_one_row_per_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_state(tmp_path, [None, None], native_port=19042, storage_port=17000)

    assert launcher.main(["--base-dir", str(tmp_path), "status"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["node", "address", "port", "pid", "process", "cql"]
    assert lines[1].split() == ["1", "127.0.0.1", "19042", "-", "down", "no"]
    assert lines[2].split() == ["2", "127.0.0.2", "19042", "-", "down", "no"]


def test_cli_runs_as_a_script_without_traceback_on_errors(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(LAUNCHER_PATH), "--base-dir", str(tmp_path), "kill", "3"],
        capture_output=True, text=True, timeout=60)

    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "no node 3" in proc.stderr
