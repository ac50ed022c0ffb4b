#!/usr/bin/env python3
"""Start one Apache Cassandra node inside a container, configured from the environment.

The image built by ``deploy/images.py`` runs this as its entrypoint. It honours the
variables of the official ``cassandra`` image that docker-compose.yml sets, so the same
compose file runs either image:

``CASSANDRA_CLUSTER_NAME``   cluster name (default ``Test Cluster``, as upstream)
``CASSANDRA_SEEDS``          comma-separated seed hosts (default: this node's own address)
``CASSANDRA_LISTEN_ADDRESS`` address to listen on (default: the address of the container's hostname)
``CASSANDRA_BROADCAST_ADDRESS`` / ``CASSANDRA_BROADCAST_RPC_ADDRESS``  what peers and drivers are told
``CASSANDRA_ENDPOINT_SNITCH`` snitch class (default ``SimpleSnitch``)
``CASSANDRA_DC`` / ``CASSANDRA_RACK``  datacenter and rack, for GossipingPropertyFileSnitch
``CASSANDRA_NUM_TOKENS``     vnodes per node (default 16)
``MAX_HEAP_SIZE``            JVM heap, e.g. ``768M`` or ``1G`` (default 1024M)
``HEAP_NEWSIZE``             accepted for compatibility; G1 sizes the young generation itself

Everything else (directories, small thread pools, the Java 17 module flags) comes from
the launcher beside this file, which the test suite uses for its local clusters, so a
containerised node and a local one are configured alike. The JVM replaces this process
(``exec``), so it is PID 1 and a SIGTERM from ``docker stop`` reaches Cassandra's own
shutdown hook.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launcher  # noqa: E402  (beside this file in the image)

DATA = Path(os.environ.get("CASSANDRA_HOME_DATA", "/var/lib/cassandra"))
LIB = Path(os.environ.get("CASSANDRA_LIB", "/opt/cassandra/lib"))

#: Console-only logging: a container's log is its standard output.
LOGBACK = """<?xml version="1.0" encoding="UTF-8"?>
<configuration scan="false">
  <appender name="STDOUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%-5level [%thread] %date{ISO8601} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="STDOUT"/></root>
  <logger name="org.apache.cassandra.db.ColumnFamilyStore" level="WARN"/>
  <logger name="org.apache.cassandra.db.compaction" level="WARN"/>
</configuration>
"""


def heap_mb(value: str) -> int:
    """``MAX_HEAP_SIZE`` as the official image takes it (``512M``, ``1G``, ``1024m``) in MiB."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", value)
    if not match:
        raise launcher.LauncherError(f"MAX_HEAP_SIZE={value!r}: expected a size such as 512M or 1G")
    number, unit = int(match.group(1)), match.group(2).upper()
    return {"K": number // 1024, "M": number, "G": number * 1024, "": number // (1024 * 1024)}[unit]


def own_address() -> str:
    """The container's address on its network: what its hostname resolves to."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise launcher.LauncherError(f"cannot resolve this container's hostname {socket.gethostname()!r}: {exc}") from exc


class ContainerNode(launcher.LocalCluster):
    """The launcher's node 1, laid out in /var/lib/cassandra and addressed on the container network."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.listen = env.get("CASSANDRA_LISTEN_ADDRESS") or own_address()
        seeds = [s.strip() for s in env.get("CASSANDRA_SEEDS", "").split(",") if s.strip()]
        self.seeds = seeds or [env.get("CASSANDRA_BROADCAST_ADDRESS") or self.listen]
        # Laid out as one node of several: the launcher lets a lone node skip the wait for gossip
        # to settle, but a container cannot tell a lone node from the seed of a cluster being
        # restarted, which must hear its peers (and their hints) before it serves.
        super().__init__(
            DATA, 2,
            cluster_name=env.get("CASSANDRA_CLUSTER_NAME", "Test Cluster"),
            heap_mb=heap_mb(env.get("MAX_HEAP_SIZE", "1024M")),
        )

    def _save_state(self) -> None:
        """A container has one node and no launcher state to keep between runs."""

    def address(self, i: int) -> str:
        return self.listen

    def node_dir(self, i: int) -> Path:
        return DATA

    def node_config(self, i: int) -> dict[str, Any]:
        config = super().node_config(i)
        env = self.env
        config["seed_provider"][0]["parameters"] = [{"seeds": ",".join(self.seeds)}]
        config["listen_address"] = self.listen
        config["rpc_address"] = "0.0.0.0"
        config["broadcast_address"] = env.get("CASSANDRA_BROADCAST_ADDRESS") or self.listen
        config["broadcast_rpc_address"] = env.get("CASSANDRA_BROADCAST_RPC_ADDRESS") or config["broadcast_address"]
        config["endpoint_snitch"] = env.get("CASSANDRA_ENDPOINT_SNITCH", "SimpleSnitch")
        config["num_tokens"] = int(env.get("CASSANDRA_NUM_TOKENS", "16"))
        return config

    def write_node_files(self, i: int, *, new_cluster: bool = False) -> None:
        super().write_node_files(i, new_cluster=new_cluster)
        conf = DATA / "conf"
        (conf / "logback.xml").write_text(LOGBACK)
        (conf / "cassandra-rackdc.properties").write_text(
            f"dc={self.env.get('CASSANDRA_DC', 'datacenter1')}\nrack={self.env.get('CASSANDRA_RACK', 'rack1')}\n"
        )

    def command(self) -> list[str]:
        self.write_node_files(1)
        return [launcher.check_java(), *self.jvm_args(1, LIB)]


def main() -> int:
    try:
        argv = ContainerNode(dict(os.environ)).command()
    except launcher.LauncherError as exc:
        print(f"cassandra: {exc}", file=sys.stderr)
        return 1
    launcher.timer_slack(launcher.TIMER_SLACK_NS)  # kept across exec (see TIMER_SLACK_NS)
    os.execv(argv[0], argv)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
