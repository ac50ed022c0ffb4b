#!/usr/bin/env python3
"""Print a docker-compose file for an N-node cassmail cluster on standard output.

    python deploy/compose.py --nodes 5 > docker-compose.yml

Each node is a Cassandra (the official Apache Cassandra 5.0 image) and a cassmail
front end (the image of deploy/Dockerfile) that serves SMTP, submission, POP3 and
IMAP. Cassandra nodes join one at a time (each waits until the one before answers
CQL: Cassandra refuses concurrent bootstraps), a one-shot job applies the schema
with the replication factor of $CASSMAIL_RF, and only then do the front ends start.
Every front end can reach every Cassandra node, so any node serves any user.

The committed docker-compose.yml is this script's output for --nodes 3.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

CASSANDRA_IMAGE = "cassandra:5.0"
IMAGE = "cassmail:latest"
#: Listener -> port inside the container (unprivileged: the image runs as a non-root user).
PORTS = {"smtp": 2525, "submission": 2587, "pop3": 1110, "imap": 1143}
#: Host port of node i's listener = its container port + NODE_STRIDE * (i - 1): the last three
#: digits (525, 587, 110, 143) never meet, so no two published ports collide for up to 60 nodes.
NODE_STRIDE = 1000
MAX_NODES = 60


def host_port(listener: str, node: int) -> int:
    return PORTS[listener] + NODE_STRIDE * (node - 1)


def cassandra_service(i: int) -> dict[str, Any]:
    service: dict[str, Any] = {
        "image": CASSANDRA_IMAGE,
        "hostname": f"cassandra{i}",
        "environment": {
            "CASSANDRA_CLUSTER_NAME": "cassmail",
            "CASSANDRA_SEEDS": "cassandra1",
            "CASSANDRA_ENDPOINT_SNITCH": "GossipingPropertyFileSnitch",
            "CASSANDRA_DC": "dc1",
            "CASSANDRA_RACK": "rack1",
            # Sized for a laptop; raise both for real mail.
            "MAX_HEAP_SIZE": "${CASSANDRA_HEAP:-768M}",
            "HEAP_NEWSIZE": "${CASSANDRA_HEAP_NEW:-128M}",
        },
        "volumes": [f"cassandra{i}-data:/var/lib/cassandra"],
        "healthcheck": {
            # cqlsh in the official image; cql-ready (a native-protocol OPTIONS probe) in the one
            # deploy/images.py builds where no registry is reachable.
            "test": ["CMD-SHELL", "cqlsh -e 'SELECT release_version FROM system.local' >/dev/null 2>&1 || cql-ready"],
            "interval": "10s",
            "timeout": "10s",
            "retries": 30,
            "start_period": "60s",
        },
        "restart": "unless-stopped",
    }
    if i > 1:
        service["depends_on"] = {f"cassandra{i - 1}": {"condition": "service_healthy"}}
    return service


def _cassmail_environment(nodes: int) -> dict[str, str]:
    return {
        "CASSMAIL_STORE_BACKEND": "cassandra",
        "CASSMAIL_STORE_CASSANDRA_CONTACT_POINTS": ",".join(f"cassandra{i}" for i in range(1, nodes + 1)),
        "CASSMAIL_STORE_CASSANDRA_KEYSPACE": "${CASSMAIL_KEYSPACE:-cassmail}",
        "CASSMAIL_STORE_CASSANDRA_REPLICATION_FACTOR": f"${{CASSMAIL_RF:-{min(3, nodes)}}}",
        "CASSMAIL_STORE_CASSANDRA_READ_CONSISTENCY": "${CASSMAIL_READ_CONSISTENCY:-LOCAL_QUORUM}",
        "CASSMAIL_STORE_CASSANDRA_WRITE_CONSISTENCY": "${CASSMAIL_WRITE_CONSISTENCY:-LOCAL_QUORUM}",
    }


def schema_service(nodes: int) -> dict[str, Any]:
    return {
        "image": IMAGE,
        "build": {"context": ".", "dockerfile": "deploy/Dockerfile"},
        "command": ["cassmail", "schema", "apply"],
        "environment": _cassmail_environment(nodes),
        "depends_on": {f"cassandra{i}": {"condition": "service_healthy"} for i in range(1, nodes + 1)},
        "restart": "on-failure",
        "healthcheck": {"disable": True},  # a one-shot job: it serves nothing
    }


def cassmail_service(i: int, nodes: int) -> dict[str, Any]:
    environment = _cassmail_environment(nodes)
    environment["CASSMAIL_NODE_NAME"] = f"mail{i}"
    environment["CASSMAIL_NODE_WORKERS"] = "${CASSMAIL_WORKERS:-2}"
    # A node whose Cassandra is not ready (after a host restart nothing orders the containers)
    # waits and logs each retry instead of exiting and being restarted in a loop.
    environment["CASSMAIL_STORE_OPEN_WAIT"] = "${CASSMAIL_STORE_OPEN_WAIT:-600}"
    for listener, port in PORTS.items():
        key = listener.upper()
        environment[f"CASSMAIL_{key}_LISTEN"] = f"0.0.0.0:{port}"
        if listener != "smtp":
            # Ports are published on the host's loopback only (below); set tls_cert/tls_key and
            # turn this off before publishing them anywhere else.
            environment[f"CASSMAIL_{key}_ALLOW_PLAINTEXT_AUTH"] = "${CASSMAIL_ALLOW_PLAINTEXT_AUTH:-true}"
    return {
        "image": IMAGE,
        "hostname": f"mail{i}",
        "command": ["cassmail", "serve"],
        "environment": environment,
        "ports": [f"${{CASSMAIL_PUBLISH_ADDRESS:-127.0.0.1}}:{host_port(name, i)}:{port}" for name, port in PORTS.items()],
        "depends_on": {
            "schema": {"condition": "service_completed_successfully"},
            f"cassandra{i}": {"condition": "service_healthy"},
        },
        "restart": "unless-stopped",
        # SIGTERM lets sessions in progress finish for up to 10 s (node.stop_grace).
        "stop_grace_period": "20s",
    }


def compose(nodes: int) -> dict[str, Any]:
    """The compose file for `nodes` nodes, as a mapping."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"--nodes must be between 1 and {MAX_NODES}, got {nodes}")
    services: dict[str, Any] = {f"cassandra{i}": cassandra_service(i) for i in range(1, nodes + 1)}
    services["schema"] = schema_service(nodes)
    services.update({f"mail{i}": cassmail_service(i, nodes) for i in range(1, nodes + 1)})
    return {
        "name": "cassmail",
        "services": services,
        "volumes": {f"cassandra{i}-data": {} for i in range(1, nodes + 1)},
    }


def render(nodes: int) -> str:
    header = (
        f"# A {nodes}-node cassmail cluster: `docker compose up -d`, then see docs/operating.md (docker-compose).\n"
        f"# Generated by `python deploy/compose.py --nodes {nodes}`; edit the generator, not this file.\n"
        f"# Host ports of node i: SMTP 2525, submission 2587, POP3 1110, IMAP 1143, each + 1000 x (i - 1).\n"
    )
    return header + yaml.safe_dump(compose(nodes), sort_keys=False, default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render(args.nodes))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
