"""The docker-compose path, the part that needs no container engine (tests/test_compose_run.py
builds the images and runs the cluster for real).

The generated YAML is parsed and checked service by service (N of each, the start-up
order, ports, volumes, environment); the environment of every cassmail service is
loaded as real cassmail settings; the Dockerfile's shape is checked; and the schema job's
and a node's commands run with the compose environment against a real Cassandra, after
which the image's HEALTHCHECK command judges the node.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from cassmail import config, healthcheck
from cassmail.config import CassandraSettings
from cassmail.store import cassandra_schema
from tests.nodes import free_port

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _load_compose() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cassmail_compose", REPO / "deploy" / "compose.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compose = _load_compose()


def generated(nodes: int) -> dict[str, Any]:
    """What `deploy/compose.py --nodes N` prints, parsed as YAML (through the real command line)."""
    out = subprocess.run([sys.executable, str(REPO / "deploy" / "compose.py"), "--nodes", str(nodes)],
                         capture_output=True, text=True, check=True)
    return yaml.safe_load(out.stdout)


def substitute(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default} interpolation, with the variables unset unless given."""
    env = env or {}
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), value)


@pytest.mark.parametrize("nodes", [1, 3, 5])
def test_compose_has_n_cassandra_nodes_one_schema_job_and_n_mail_nodes(nodes: int) -> None:
    services = generated(nodes)["services"]
    assert sorted(s for s in services if s.startswith("cassandra")) == [f"cassandra{i}" for i in range(1, nodes + 1)]
    assert sorted(s for s in services if s.startswith("mail")) == [f"mail{i}" for i in range(1, nodes + 1)]
    assert set(services) - {f"cassandra{i}" for i in range(1, nodes + 1)} - {f"mail{i}" for i in range(1, nodes + 1)} == {"schema"}
    for i in range(1, nodes + 1):
        cassandra = services[f"cassandra{i}"]
        assert cassandra["image"] == "cassandra:5.0"
        assert cassandra["environment"]["CASSANDRA_SEEDS"] == "cassandra1"
        assert "cqlsh" in " ".join(cassandra["healthcheck"]["test"])
        assert services[f"mail{i}"]["command"] == ["cassmail", "serve"]
    assert services["schema"]["command"] == ["cassmail", "schema", "apply"]


def test_compose_starts_cassandra_one_node_at_a_time_then_the_schema_then_the_front_ends() -> None:
    services = generated(4)["services"]
    assert "depends_on" not in services["cassandra1"]
    for i in range(2, 5):
        assert services[f"cassandra{i}"]["depends_on"] == {f"cassandra{i - 1}": {"condition": "service_healthy"}}
    assert services["schema"]["depends_on"] == {f"cassandra{i}": {"condition": "service_healthy"} for i in range(1, 5)}
    for i in range(1, 5):
        assert services[f"mail{i}"]["depends_on"]["schema"] == {"condition": "service_completed_successfully"}


def test_compose_publishes_distinct_host_ports_for_every_listener_of_every_node() -> None:
    services = generated(compose.MAX_NODES)["services"]
    published = []
    for i in range(1, compose.MAX_NODES + 1):
        mappings = [substitute(p) for p in services[f"mail{i}"]["ports"]]
        assert all(m.startswith("127.0.0.1:") for m in mappings)  # loopback unless the operator says otherwise
        published += [int(m.split(":")[1]) for m in mappings]
        containers = {int(m.split(":")[2]) for m in mappings}
        assert containers == set(compose.PORTS.values())
    assert len(published) == len(set(published)) and max(published) < 65536
    three = generated(3)["services"]
    assert [substitute(p) for p in three["mail2"]["ports"]] == [
        "127.0.0.1:3525:2525", "127.0.0.1:3587:2587", "127.0.0.1:2110:1110", "127.0.0.1:2143:1143"]


def test_compose_gives_every_cassandra_node_its_own_volume() -> None:
    document = generated(3)
    assert set(document["volumes"]) == {"cassandra1-data", "cassandra2-data", "cassandra3-data"}
    for i in range(1, 4):
        assert document["services"][f"cassandra{i}"]["volumes"] == [f"cassandra{i}-data:/var/lib/cassandra"]


@pytest.mark.parametrize("nodes", [1, 3, 5])
def test_compose_environment_is_valid_cassmail_settings_pointing_at_every_cassandra(nodes: int) -> None:
    services = generated(nodes)["services"]
    for name in ["schema", *(f"mail{i}" for i in range(1, nodes + 1))]:
        env = {k: substitute(v) for k, v in services[name]["environment"].items()}
        settings = config.load(env=env)  # unknown or invalid keys would raise here
        cs = settings.store.cassandra
        assert settings.store.backend == "cassandra"
        assert cs.contact_points == [f"cassandra{i}" for i in range(1, nodes + 1)]
        assert cs.replication_factor == min(3, nodes)
        if name != "schema":
            assert settings.node.name == name
            for listener, port in compose.PORTS.items():
                assert getattr(settings, listener).listen == f"0.0.0.0:{port}"
    rf = config.load(env={k: substitute(v, {"CASSMAIL_RF": "2"}) for k, v in services["schema"]["environment"].items()})
    assert rf.store.cassandra.replication_factor == 2


def test_committed_docker_compose_is_the_generator_output_for_three_nodes() -> None:
    out = subprocess.run([sys.executable, str(REPO / "deploy" / "compose.py"), "--nodes", "3"],
                         capture_output=True, text=True, check=True)
    assert (REPO / "docker-compose.yml").read_text() == out.stdout


def test_compose_refuses_a_node_count_it_cannot_lay_out() -> None:
    for bad in ("0", str(compose.MAX_NODES + 1)):
        done = subprocess.run([sys.executable, str(REPO / "deploy" / "compose.py"), "--nodes", bad],
                              capture_output=True, text=True)
        assert done.returncode == 2 and "--nodes must be between" in done.stderr and "Traceback" not in done.stderr


# ----------------------------------------------------------------------------- the Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_builds_a_slim_non_root_image_with_a_protocol_healthcheck() -> None:
    """Two stages: pip and the build happen in the first; the image is Debian's python3, the
    virtualenv and the sources, run by a non-root user. (tests/test_compose_run.py builds and runs it.)"""
    steps = dockerfile()
    assert steps[0] == ("ARG", "BASE_IMAGE=debian:bookworm-slim")
    stages = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    assert len(stages) == 2 and steps[stages[0]][1] == "${BASE_IMAGE} AS build" and steps[stages[1]][1] == "${BASE_IMAGE}"
    final = steps[stages[1]:]
    installs = [args for op, args in final if op == "RUN" and "apt-get install" in args]
    assert len(installs) == 1 and re.search(r"--no-install-recommends python3\s", installs[0])
    assert not any("pip install" in args or "gcc" in args for op, args in final if op == "RUN")
    assert ("COPY", "--from=build /opt/cassmail /opt/cassmail") in final
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = [args for op, args in final if op == "HEALTHCHECK"]
    assert len(health) == 1 and '"cassmail.healthcheck"' in health[0]
    for op, args in steps:
        if op == "COPY" and not args.startswith("--from="):
            for source in shlex.split(args)[:-1]:
                assert (REPO / source).exists(), source
    assert ("CMD", '["cassmail", "serve"]') in final


@pytest.mark.cassandra
def test_compose_node_started_before_its_keyspace_waits_then_serves_once_the_schema_job_ran(
    tmp_path: Path, cassandra_endpoint: tuple[str, int]
) -> None:
    """The compose file's mail node and schema job commands with their environment, outside a
    container, against a real Cassandra: the node starts first, finds no keyspace and says it
    retries (no exit, no restart loop); the schema job runs; the image's HEALTHCHECK command then
    accepts the node, and SIGTERM stops it cleanly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
    venv = Path(sys.executable).parent.parent  # this test run's virtualenv, where cassmail is installed
    cassmail = str(venv / "bin" / "cassmail")
    services = generated(1)["services"]
    host, port = cassandra_endpoint
    keyspace = f"cmcompose_{uuid.uuid4().hex[:10]}"
    cluster_env = {"CASSMAIL_STORE_CASSANDRA_CONTACT_POINTS": host, "CASSMAIL_STORE_CASSANDRA_PORT": str(port),
                   "CASSMAIL_STORE_CASSANDRA_KEYSPACE": keyspace}
    node_env = {**env, **{k: substitute(v) for k, v in services["mail1"]["environment"].items()}, **cluster_env}
    assert node_env["CASSMAIL_STORE_OPEN_WAIT"] == "600"
    node_env.update({f"CASSMAIL_{name.upper()}_LISTEN": f"127.0.0.1:{free_port()}" for name in compose.PORTS})
    node_env["CASSMAIL_NODE_WORKERS"] = "1"
    check = [str(venv / "bin" / "python"), "-m", "cassmail.healthcheck"]
    assert subprocess.run(check, env=node_env, cwd=tmp_path, capture_output=True).returncode == 1  # nothing serves yet
    serve = subprocess.Popen([cassmail, "serve"], env=node_env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(serve.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        for _ in range(300):
            if any("event=store-open result=retry" in line for line in lines):
                break
            assert serve.poll() is None, "".join(lines)
            time.sleep(0.1)
        retry = [line for line in lines if "event=store-open result=retry" in line]
        assert retry and f"keyspace {keyspace} does not exist" in retry[0], "".join(lines)
        schema_env = {**env, **{k: substitute(v) for k, v in services["schema"]["environment"].items()}, **cluster_env}
        done = subprocess.run([cassmail, "schema", "apply"], env=schema_env, capture_output=True, text=True,
                              cwd=tmp_path, timeout=300)
        assert done.returncode == 0 and f"created keyspace {keyspace}" in done.stdout, done.stderr
        healthy = None
        for _ in range(150):
            healthy = subprocess.run(check, env=node_env, cwd=tmp_path, capture_output=True, text=True)
            if healthy.returncode == 0:
                break
            assert serve.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert healthy is not None and healthy.returncode == 0, healthy.stderr if healthy else ""
        assert any("event=store-open result=ok" in line for line in lines), "".join(lines)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0, "".join(lines)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        cassandra_schema.drop(CassandraSettings(contact_points=[host], port=port, keyspace=keyspace))


def test_compose_run_without_any_container_engine_fails_with_one_line(tmp_path: Path) -> None:
    """No podman, no docker on PATH: one line saying what is missing, exit status 1, no traceback."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    for script in ("compose_run.py", "images.py"):
        done = subprocess.run([sys.executable, str(REPO / "deploy" / script), *(["--nodes", "1", "up"] if script == "compose_run.py" else [])],
                              env={"PATH": str(bare), "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done
        assert done.stderr.count("\n") == 1 and "no container engine: install podman" in done.stderr, done.stderr


# ----------------------------------------------------------------------------- the healthcheck probe


def _greeter(greeting: bytes) -> tuple[Any, int]:
    """A listener that sends one greeting to each client, on a free port."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(greeting)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.parametrize("listener", ["smtp", "pop3", "imap"])
def test_healthcheck_wants_each_protocols_own_greeting(listener: str) -> None:
    right = {"smtp": b"220 mx ESMTP\r\n", "pop3": b"+OK ready\r\n", "imap": b"* OK [CAPABILITY IMAP4rev1] ready\r\n"}
    for greeting, expected in ((right[listener], True), (b"-ERR busy\r\n", False), (b"", False)):
        server, port = _greeter(greeting)
        try:
            assert healthcheck.greets("127.0.0.1", port, healthcheck.GREETINGS[listener], timeout=2) is expected
        finally:
            server.close()
    assert not healthcheck.greets("127.0.0.1", free_port(), b"220", timeout=1)


def test_healthcheck_names_every_listener_that_does_not_greet() -> None:
    settings = config.load(env={"CASSMAIL_SMTP_LISTEN": f"127.0.0.1:{free_port()}",
                                "CASSMAIL_SUBMISSION_ENABLED": "false", "CASSMAIL_POP3_LISTEN": f"0.0.0.0:{free_port()}"})
    failures = healthcheck.check(settings, timeout=1)
    assert any(f.startswith("smtp on 127.0.0.1:") for f in failures)
    assert any(f.startswith("pop3 on 0.0.0.0:") for f in failures)
    assert not any(f.startswith("submission") for f in failures)
