"""A local N-node cassmail cluster without Docker: `cassmail cluster ...`.

Node i is the loopback address 127.0.0.i, where it runs one Cassandra (through
deploy/cassandra/launcher.py) and one `cassmail serve` front end with the SMTP,
submission, POP3 and IMAP listeners on the same ports as every other node, the
way N machines would. It is for fault tests and for trying the design's claims
on a laptop: any node serves any user, and a node lost loses neither mail nor
service (at the replication factor and consistency levels chosen).

Everything lives under one base directory (`$CASSMAIL_CLUSTER`, default
`var/cluster` in the source tree):

    cluster.json        what `up` started: ports, RF, front-end pids, whether it is up
    cassmail.toml       settings that reach the cluster; while it is up every other
                        `cassmail` command without --config uses them (see `active_config`)
    nodeI/cassmail.toml the settings of node I's front end; nodeI/frontend.log its log
    cassandra/          the launcher's nodes (data, logs, state.json)

Front ends run detached in their own process group, so a `kill --frontend`
takes the supervisor and its workers at once, like a machine losing power.

With `up --netns` each node (its Cassandra and its front end) runs in a network
namespace of its own at 10.77.0.(10+i) instead (see cassmail.netns), so that
`cassmail cluster partition|delay|heal` can cut or slow the network between
nodes, as an operator rehearsing failures would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cassmail import config, healthcheck, netns
from cassmail.checkout import REPO_ROOT, CommandError, load_launcher

ENV_BASE = "CASSMAIL_CLUSTER"
DEFAULT_BASE = REPO_ROOT / "var" / "cluster"
STATE = "cluster.json"
CLIENT_CONFIG = "cassmail.toml"
#: Listener -> port on every node (the dev ports of the design).
DEFAULT_PORTS = {"smtp": 2525, "submission": 2587, "pop3": 1110, "imap": 1143}
#: Parts of a node that start/stop/kill act on.
PARTS = ("cassandra", "frontend")


class ClusterError(CommandError):
    """A cluster operation failed; the message says which node and why."""


def base_dir(env: dict[str, str] | os._Environ[str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(ENV_BASE) or DEFAULT_BASE).expanduser().resolve()


def active_config(env: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """The settings file of a local cluster that is up, for commands given no config.

    An explicit CASSMAIL_CONFIG wins (None is returned), so does a cluster that was
    taken down: then the usual defaults apply.
    """
    env = os.environ if env is None else env
    if env.get("CASSMAIL_CONFIG") or env.get(ENV_BASE, "").lower() == "off":
        return None
    base = base_dir(env)
    try:
        state = json.loads((base / STATE).read_text())
    except (OSError, ValueError):
        return None
    path = base / CLIENT_CONFIG
    return str(path) if state.get("up") and path.is_file() else None


def ownership(tokens: dict[str, list[int]], rf: int) -> dict[str, float]:
    """Share of the Murmur3 ring each node holds a replica of, under SimpleStrategy at `rf`.

    Range (previous token, t] belongs to t's node and the next rf-1 distinct nodes
    clockwise. With rf=1 this is plain token ownership; the shares sum to min(rf, nodes).
    """
    ring = sorted((t, node) for node, ts in tokens.items() for t in ts)
    owned = dict.fromkeys(tokens, 0)
    if not ring:
        return {node: 0.0 for node in tokens}
    size = 2**64
    want = min(rf, len(tokens))
    for k, (token, _) in enumerate(ring):
        span = (token - ring[k - 1][0]) % size or size
        replicas: list[str] = []
        j = k
        while len(replicas) < want:
            owner = ring[j % len(ring)][1]
            if owner not in replicas:
                replicas.append(owner)
            j += 1
        for owner in replicas:
            owned[owner] += span
    return {node: share / size for node, share in owned.items()}


def _proc_identity(launcher: Any, pid: int | None) -> str | None:
    return launcher._proc_start(pid) if pid else None


class LocalMailCluster:
    """N Cassandra nodes and N front ends, recorded in base/cluster.json so any process can manage them."""

    def __init__(self, base: Path | None = None) -> None:
        self.base = Path(base) if base else base_dir()
        self.launcher = load_launcher()
        self.state: dict[str, Any] = {}
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        if (self.base / STATE).is_file():
            self.state = json.loads((self.base / STATE).read_text())

    # ----------------------------------------------------------------- state and layout

    @property
    def nodes(self) -> int:
        return int(self.state.get("nodes", 0))

    def _save(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        tmp = self.base / (STATE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        os.replace(tmp, self.base / STATE)

    def _require(self) -> None:
        if not self.state:
            raise ClusterError(f"no local cluster in {self.base}: run `cassmail cluster up` first")

    def _check(self, i: int) -> None:
        self._require()
        if not 1 <= i <= self.nodes:
            raise ClusterError(f"no node {i}: this cluster has nodes 1..{self.nodes}")

    @property
    def in_netns(self) -> bool:
        return bool(self.state.get("netns"))

    def address(self, i: int) -> str:
        return netns.address(i) if self.in_netns else f"127.0.0.{i}"

    def cassandra(self) -> Any:
        """The launcher's cluster, with the token allocator balancing for this cluster's RF.

        A joining node picks its 16 tokens so that the data it will hold a replica of at that
        RF is even (tokens never move afterwards, so it is decided by the first `up`).
        """
        s = self.state
        rf = s["rf"]
        isolated = self.in_netns

        class Balanced(self.launcher.LocalCluster):  # type: ignore[name-defined,misc]
            def node_config(self, i: int) -> dict[str, Any]:
                return {**super().node_config(i), "allocate_tokens_for_local_replication_factor": rf}

            def address(self, i: int) -> str:
                return netns.address(i) if isolated else super().address(i)

            def command_prefix(self, i: int) -> list[str]:
                return netns.exec_prefix(i) if isolated else []

            def port_free(self, i: int, port: int) -> bool:
                return netns.port_free(i, port) if isolated else super().port_free(i, port)

        return Balanced(
            self.base / "cassandra", s["nodes"], cluster_name="cassmail-cluster",
            native_port=s["native_port"], storage_port=s["storage_port"], heap_mb=s["heap_mb"],
        )

    def store_settings(self) -> config.CassandraSettings:
        """[store.cassandra] as every node and client of this cluster uses it."""
        s = self.state
        return config.CassandraSettings(
            contact_points=[self.address(i) for i in range(1, s["nodes"] + 1)],
            port=s["native_port"],
            keyspace=s["keyspace"],
            replication_factor=s["rf"],
            read_consistency=s["read_consistency"],
            write_consistency=s["write_consistency"],
            serial_consistency=s["serial_consistency"],
        )

    def _settings_toml(self, i: int | None) -> str:
        """The settings file of node i's front end, or (i None) the one other commands use."""
        cs = self.store_settings()
        lines = ["# Written by `cassmail cluster up`; rewritten on every up.", "[store]", 'backend = "cassandra"', "",
                 "[store.cassandra]"]
        for f in ("contact_points", "port", "keyspace", "replication_factor", "read_consistency",
                  "write_consistency", "serial_consistency"):
            lines.append(f"{f} = {config.toml_value(getattr(cs, f))}")
        if i is not None:
            lines += ["", "[node]", f'name = "node{i}"', f"workers = {self.state['workers']}"]
            for name, port in self.state["ports"].items():
                lines += ["", f"[{name}]", f'listen = "{self.address(i)}:{port}"', "enabled = true",
                          # Loopback only and no certificate: logins in clear text, as `make run`.
                          "allow_plaintext_auth = true"]
        return "\n".join(lines) + "\n"

    def frontend_config(self, i: int) -> Path:
        return self.base / f"node{i}" / "cassmail.toml"

    def frontend_log(self, i: int) -> Path:
        return self.base / f"node{i}" / "frontend.log"

    def frontend_settings(self, i: int) -> config.Settings:
        return config.load(self.frontend_config(i), env={}, overrides=self.state.get("overrides", []))

    # ----------------------------------------------------------------- whole cluster

    def up(self, nodes: int, rf: int, settings: config.Settings, *, native_port: int | None = None,
           storage_port: int | None = None, heap_mb: int = 768, ports: dict[str, int] | None = None, workers: int = 1,
           overrides: list[str] | None = None, timeout: float = 300, use_netns: bool = False) -> float:
        """Start what is not running (with use_netns, the namespaces first; Cassandra nodes one by
        one, the schema at `rf`, then the front ends side by side); idempotent. Returns the seconds
        it took.
        Cassandra's ports (None: those recorded, else 9042 and 7000) are those of the nodes' data:
        ports given that differ from a recorded cluster's are refused, never silently replaced."""
        started = time.monotonic()
        if self.state and nodes < self.nodes:
            raise ClusterError(f"{self.base} holds a {self.nodes}-node cluster; a cluster is never shrunk")
        for flag, key, given in (("--native-port", "native_port", native_port),
                                 ("--storage-port", "storage_port", storage_port)):
            recorded = self.state.get(key)
            if given is not None and recorded is not None and given != recorded:
                raise ClusterError(f"{self.base} holds a cluster with {flag} {recorded}, not {given}: run "
                                   f"`cassmail cluster down` and remove {self.base} to start one on {given}")
        if self.state.get("rf") and bool(self.state.get("netns")) != use_netns:
            # Cassandra's data on disk names its peers by address: the layout cannot change under it.
            was = "in network namespaces (--netns)" if self.state.get("netns") else "on loopback (no --netns)"
            raise ClusterError(f"{self.base} holds a cluster that ran {was}: give the same choice, or use "
                               f"another {ENV_BASE}")
        if not 1 <= rf <= nodes:
            raise ClusterError(f"--rf must be between 1 and the number of nodes ({nodes}), got {rf}")
        cs = settings.store.cassandra
        previous = self.state
        self.state = {
            "nodes": nodes, "rf": rf, "native_port": previous.get("native_port", native_port or 9042),
            "storage_port": previous.get("storage_port", storage_port or 7000),
            "heap_mb": previous.get("heap_mb", heap_mb),
            "keyspace": cs.keyspace, "read_consistency": cs.read_consistency, "write_consistency": cs.write_consistency,
            "serial_consistency": cs.serial_consistency, "ports": ports or dict(DEFAULT_PORTS), "workers": workers,
            "overrides": list(overrides or []), "up": previous.get("up", False),
            "frontends": previous.get("frontends", []), "netns": use_netns,
        }
        while len(self.state["frontends"]) < nodes:
            self.state["frontends"].append({"index": len(self.state["frontends"]) + 1, "pid": None, "start": None})
        self._save()
        from cassmail.store import cassandra_schema

        def schema_on_node_one() -> None:
            # A new cluster gets its schema while node 1 is its whole ring: each change is then
            # one node's work, where on three it is every node's, pushed and pulled between them
            # (here 5 s against 25-75 s). At ONE, since a ring of one node holds one replica;
            # the others join with the schema and stream their share of what was written.
            alone = dataclasses.replace(self.store_settings(), read_consistency="ONE", write_consistency="ONE")
            cassandra_schema.apply(alone)

        try:
            if use_netns:
                netns.create(nodes)
            cassandra = self.cassandra()
            fresh = cassandra.is_new()
            cassandra.up(timeout=timeout, new_cluster=fresh, after_first=schema_on_node_one if fresh else None)
        except (self.launcher.LauncherError, netns.NetnsError) as exc:
            raise ClusterError(str(exc)) from None
        cassandra_schema.apply(self.store_settings())  # (up to date when node 1 alone applied it)
        (self.base / CLIENT_CONFIG).write_text(self._settings_toml(None))
        for i in range(1, nodes + 1):
            self.frontend_config(i).parent.mkdir(parents=True, exist_ok=True)
            self.frontend_config(i).write_text(self._settings_toml(i))
        self.start_frontends(range(1, nodes + 1), timeout=timeout)
        self.state["up"] = True
        self._save()
        return time.monotonic() - started

    def down(self) -> None:
        """Stop exactly what `up` started: every front end, then every Cassandra node, then (netns)
        the namespaces and the bridge, even when a stop failed."""
        self._require()
        try:
            self.stop_frontends(range(1, self.nodes + 1))
            try:
                self.cassandra().down()
            except self.launcher.LauncherError as exc:
                raise ClusterError(str(exc)) from None
        finally:
            self.state["up"] = False
            self._save()
            if self.in_netns:
                failed = netns.destroy(self.nodes)
                if failed:
                    raise ClusterError("could not remove: " + "; ".join(failed))

    # ----------------------------------------------------------------- network faults (netns only)

    def _require_netns(self) -> None:
        self._require()
        if not self.in_netns:
            raise ClusterError("network faults need a cluster started with `cassmail cluster up --netns`")

    def _peers(self, i: int, peer: int | None) -> list[int]:
        self._check(i)
        if peer is not None:
            self._check(peer)
            if peer == i:
                raise ClusterError(f"node {i} cannot be partitioned from itself")
            return [peer]
        return [n for n in range(1, self.nodes + 1) if n != i]

    def partition(self, i: int, peer: int | None = None, one_way: bool = False) -> list[int]:
        """Cut node i off from the other nodes (or from `peer` only); one_way drops only what i sends.

        Clients still reach node i's front end, the way clients on its side of a split would.
        """
        self._require_netns()
        peers = self._peers(i, peer)
        try:
            netns.partition(i, peers, one_way)
        except netns.NetnsError as exc:
            raise ClusterError(str(exc)) from None
        return peers

    def delay(self, i: int, ms: int, loss: float = 0.0, peer: int | None = None) -> list[int]:
        """Delay by `ms` (and lose `loss` percent of) what node i sends to the other nodes (or `peer`)."""
        self._require_netns()
        if ms < 0 or not 0 <= loss <= 100:
            raise ClusterError(f"--ms must be 0 or more and --loss between 0 and 100, got {ms} and {loss}")
        peers = self._peers(i, peer)
        try:
            netns.delay(i, peers, ms, loss)
        except netns.NetnsError as exc:
            raise ClusterError(str(exc)) from None
        return peers

    def heal(self, i: int | None = None) -> list[int]:
        """Remove every fault of node i (or of every node)."""
        self._require_netns()
        which = [i] if i is not None else list(range(1, self.nodes + 1))
        for n in which:
            self._check(n)
            try:
                netns.heal(n)
            except netns.NetnsError as exc:
                raise ClusterError(str(exc)) from None
        return which

    # ----------------------------------------------------------------- front ends

    def _frontend(self, i: int) -> dict[str, Any]:
        self._check(i)
        return self.state["frontends"][i - 1]

    def frontend_pid(self, i: int) -> int | None:
        """Node i's `cassmail serve` supervisor, if the recorded process is still that one."""
        entry = self._frontend(i)
        pid = entry.get("pid")
        if pid and entry.get("start") and _proc_identity(self.launcher, pid) == entry["start"]:
            return int(pid)
        return None

    def start_frontend(self, i: int, timeout: float = 60) -> None:
        """Start node i's front end unless it runs, and wait until every listener greets."""
        self.start_frontends([i], timeout)

    def start_frontends(self, nodes: Iterable[int], timeout: float = 60) -> None:
        """`start_frontend` of several nodes at once: each is started first, then each waited for
        (they connect to Cassandra and prepare their statements side by side)."""
        nodes = list(nodes)
        for i in nodes:
            self._spawn_frontend(i)
        deadline = time.monotonic() + timeout
        for i in nodes:
            self.wait_frontend(i, max(deadline - time.monotonic(), 1))

    def _spawn_frontend(self, i: int) -> None:
        if self.frontend_pid(i) is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_") or k == "CASSMAIL_CACHE"}
            prefix = netns.exec_prefix(i) if self.in_netns else []
            cmd = [*prefix, sys.executable, "-m", "cassmail.cli", "--config", str(self.frontend_config(i))]
            for item in self.state.get("overrides", []):
                cmd += ["--set", item]
            with self.frontend_log(i).open("ab") as log:
                proc = subprocess.Popen(
                    [*cmd, "serve"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, cwd=str(self.base), start_new_session=True,
                )
            self._children[i] = proc
            entry = self._frontend(i)
            entry.update(pid=proc.pid, start=None)
            deadline = time.monotonic() + 5
            while entry["start"] is None and time.monotonic() < deadline:
                entry["start"] = _proc_identity(self.launcher, proc.pid)
                time.sleep(0.01)
            self._save()

    def wait_frontend(self, i: int, timeout: float = 60) -> None:
        settings = self.frontend_settings(i)
        deadline = time.monotonic() + timeout
        while True:
            if self.frontend_pid(i) is None:
                raise ClusterError(f"node {i}'s front end exited; see {self.frontend_log(i)}:\n{self._log_tail(i)}")
            failures = healthcheck.check(settings, timeout=2)
            if not failures:
                return
            if time.monotonic() >= deadline:
                raise ClusterError(f"node {i}'s front end is not serving after {timeout:.0f} s: {failures[0]}")
            time.sleep(0.2)

    def _log_tail(self, i: int, lines: int = 15) -> str:
        try:
            return "\n".join(self.frontend_log(i).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _signal_frontend(self, i: int, sig: int) -> int | None:
        """Send sig to node i's front end: the whole process group for SIGKILL (the workers too)."""
        pid = self.frontend_pid(i)
        if pid is not None:
            try:
                os.killpg(pid, sig) if sig == signal.SIGKILL else os.kill(pid, sig)
            except ProcessLookupError:
                return None
        return pid

    def _wait_frontend_gone(self, i: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.frontend_pid(i) is not None and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        return self.frontend_pid(i) is None

    def _reap(self) -> None:
        """Collect front ends this process started (its own children only) so none stays a zombie."""
        for proc in self._children.values():
            proc.poll()

    def stop_frontend(self, i: int, grace: float = 15) -> None:
        """SIGTERM (sessions in progress may finish), then SIGKILL to the group after `grace` seconds."""
        self.stop_frontends([i], grace)

    def stop_frontends(self, nodes: Iterable[int], grace: float = 15) -> None:
        """`stop_frontend` of several nodes at once: each is told first, then each waited for."""
        nodes = list(nodes)
        told = [i for i in nodes if self._signal_frontend(i, signal.SIGTERM) is not None]
        deadline = time.monotonic() + grace
        for i in told:
            if not self._wait_frontend_gone(i, max(deadline - time.monotonic(), 0)):
                self._signal_frontend(i, signal.SIGKILL)
                self._wait_frontend_gone(i, 10)
        for i in nodes:
            self._frontend(i).update(pid=None, start=None)
        self._save()

    def kill_frontend(self, i: int) -> None:
        if self._signal_frontend(i, signal.SIGKILL) is not None:
            self._wait_frontend_gone(i, 10)
        self._frontend(i).update(pid=None, start=None)
        self._save()

    # ----------------------------------------------------------------- one node

    def act(self, action: str, i: int, parts: tuple[str, ...], timeout: float = 300) -> None:
        """start / stop / kill the given parts of node i (Cassandra first on start, last on stop)."""
        self._check(i)
        cassandra = self.cassandra()
        try:
            if action == "start":
                if "cassandra" in parts:
                    cassandra.start_node(i, timeout=timeout)
                if "frontend" in parts:
                    self.start_frontend(i, timeout=min(timeout, 120))
            elif action == "stop":
                if "frontend" in parts:
                    self.stop_frontend(i)
                if "cassandra" in parts:
                    cassandra.stop_node(i)
            elif action == "kill":
                if "frontend" in parts:
                    self.kill_frontend(i)
                if "cassandra" in parts:
                    cassandra.kill_node(i)
            else:  # pragma: no cover - the parser offers only the three
                raise ClusterError(f"unknown action {action}")
        except self.launcher.LauncherError as exc:
            raise ClusterError(str(exc)) from None

    # ----------------------------------------------------------------- status

    def tokens(self) -> dict[str, list[int]]:
        """Every node's tokens, as the cluster's system tables (through any live node) record them."""
        from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
        from cassandra.policies import WhiteListRoundRobinPolicy

        cs = self.store_settings()
        up = [a for a in cs.contact_points if self.launcher.cql_ready(a, cs.port, timeout=1.0)]
        if not up:
            return {}
        # Both queries on one node: system.local and system.peers together describe the ring only there.
        profile = ExecutionProfile(load_balancing_policy=WhiteListRoundRobinPolicy(up[:1]))
        cluster = Cluster(contact_points=up[:1], port=cs.port, protocol_version=cs.protocol_version, connect_timeout=5,
                          execution_profiles={EXEC_PROFILE_DEFAULT: profile})
        try:
            session = cluster.connect()
            local = session.execute("SELECT broadcast_address, tokens FROM system.local").one()
            found = {str(local.broadcast_address): [int(t) for t in local.tokens]}
            for row in session.execute("SELECT peer, tokens FROM system.peers"):
                found[str(row.peer)] = [int(t) for t in row.tokens or ()]
            return found
        finally:
            cluster.shutdown()

    def status(self) -> list[dict[str, Any]]:
        """Per node: Cassandra process and CQL, front-end process and listeners, ring shares."""
        from cassandra import DriverException
        from cassandra.cluster import NoHostAvailable

        self._require()
        rows = {r["index"]: r for r in self.cassandra().status()}
        try:
            tokens = self.tokens()
        except (DriverException, NoHostAvailable, OSError) as exc:
            raise ClusterError(f"cannot read the ring: {exc}") from None
        owned = ownership(tokens, 1)
        effective = ownership(tokens, self.state["rf"])
        indexes = range(1, self.nodes + 1)
        pids = {i: self.frontend_pid(i) for i in indexes}

        def probe(i: int) -> list[str]:
            # A front end busy for a moment (one just started, on a loaded machine) is not failing:
            # the probe waits as long as the container's health check does.
            return healthcheck.check(self.frontend_settings(i)) if pids[i] else ["not running"]

        with ThreadPoolExecutor(max_workers=self.nodes) as pool:
            failures = dict(zip(indexes, pool.map(probe, indexes)))
        out = []
        for i in indexes:
            address, pid = self.address(i), pids[i]
            try:
                faults = netns.faults(i) if self.in_netns else []
            except netns.NetnsError as exc:
                faults = [str(exc)]
            out.append({
                "node": i, "address": address,
                "cassandra": "up" if rows[i]["cql"] else ("starting" if rows[i]["running"] else "down"),
                "cassandra_pid": rows[i]["pid"], "frontend": "up" if not failures[i] else ("failing" if pid else "down"),
                "frontend_pid": pid, "frontend_failures": failures[i], "tokens": len(tokens.get(address, [])),
                "owns": owned.get(address), "effective": effective.get(address), "faults": faults,
            })
        return out


# --------------------------------------------------------------------------- the `cluster` commands


def add_commands(sub: Any) -> None:
    """`cassmail cluster up|down|status|start|stop|kill`, added to the cli's parser."""
    cl = sub.add_parser("cluster", help="a local N-node cluster: Cassandra and a front end on 127.0.0.1..N (or in network namespaces)").add_subparsers(
        metavar="ACTION"
    )
    up = cl.add_parser("up", help="start N Cassandra nodes, apply the schema at RF, start N front ends")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--rf", type=int, default=None, help="replication factor (default: min(3, nodes))")
    up.add_argument("--heap-mb", type=int, default=768, help="Cassandra heap per node (default 768)")
    up.add_argument("--native-port", type=int, default=None,
                    help="CQL port of every node (default 9042, or the existing cluster's)")
    up.add_argument("--storage-port", type=int, default=None,
                    help="inter-node port (default 7000, or the existing cluster's)")
    for name, port in DEFAULT_PORTS.items():
        up.add_argument(f"--{name}-port", type=int, default=port, help=f"{name} port of every node (default {port})")
    up.add_argument("--workers", type=int, default=1, help="worker processes per front end (default 1)")
    up.add_argument("--netns", action="store_true",
                    help="each node in a network namespace of its own at 10.77.0.(10+N) (root; for partition/delay)")
    up.set_defaults(run=cmd_up)
    cl.add_parser("down", help="stop every front end and Cassandra node `up` started").set_defaults(run=cmd_down)
    st = cl.add_parser("status", help="each node's Cassandra, front end and share of the ring")
    st.add_argument("--json", action="store_true")
    st.set_defaults(run=cmd_status)
    for action, text in (("start", "start node N (after stop or kill)"), ("stop", "stop node N gracefully"),
                         ("kill", "SIGKILL node N, as a crash would")):
        p = cl.add_parser(action, help=f"{text}: its Cassandra by default")
        p.add_argument("node", type=int, metavar="N")
        which = p.add_mutually_exclusive_group()
        which.add_argument("--frontend", action="store_const", dest="parts", const=("frontend",),
                           help="its cassmail front end instead")
        which.add_argument("--all", action="store_const", dest="parts", const=PARTS, help="both")
        p.set_defaults(run=cmd_node, action=action, parts=("cassandra",))
    part = cl.add_parser("partition", help="cut node N off from the other nodes (--netns clusters)")
    part.add_argument("node", type=int, metavar="N")
    part.add_argument("--from", type=int, dest="peer", metavar="M", help="from node M only")
    part.add_argument("--one-way", action="store_true", help="drop only what N sends; N still hears the others")
    part.set_defaults(run=cmd_partition)
    dl = cl.add_parser("delay", help="delay and lose what node N sends to the other nodes (--netns clusters)")
    dl.add_argument("node", type=int, metavar="N")
    dl.add_argument("--ms", type=int, required=True, help="added latency in milliseconds")
    dl.add_argument("--loss", type=float, default=0.0, help="percent of packets lost (default 0)")
    dl.add_argument("--to", type=int, dest="peer", metavar="M", help="to node M only")
    dl.set_defaults(run=cmd_delay)
    hl = cl.add_parser("heal", help="remove the network faults of node N, or of every node")
    hl.add_argument("node", type=int, metavar="N", nargs="?")
    hl.set_defaults(run=cmd_heal)


def cmd_up(settings: config.Settings, args: Any) -> int:
    cluster = LocalMailCluster()
    rf = args.rf if args.rf is not None else min(3, args.nodes)
    ports = {name: getattr(args, f"{name}_port") for name in DEFAULT_PORTS}
    seconds = cluster.up(args.nodes, rf, settings, native_port=args.native_port, storage_port=args.storage_port,
                         heap_mb=args.heap_mb, ports=ports, workers=args.workers, overrides=args.set,
                         use_netns=args.netns)
    print(f"cluster of {args.nodes} node(s) up in {seconds:.0f} s (RF={rf}, reads {cluster.state['read_consistency']}, "
          f"writes {cluster.state['write_consistency']}); state in {cluster.base}")
    _print_status(cluster.status())
    print("other cassmail commands now use " + str(cluster.base / CLIENT_CONFIG))
    return 0


def cmd_down(settings: config.Settings, args: Any) -> int:
    cluster = LocalMailCluster()
    cluster.down()
    print(f"cluster in {cluster.base} stopped")
    return 0


def _print_status(rows: list[dict[str, Any]]) -> None:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    print(f"{'NODE':>4}  {'ADDRESS':<11}  {'CASSANDRA':<9}  {'FRONTEND':<8}  {'TOKENS':>6}  {'OWNS':>6}  {'EFFECTIVE':>9}")
    for r in rows:
        print(f"{r['node']:>4}  {r['address']:<11}  {r['cassandra']:<9}  {r['frontend']:<8}  {r['tokens']:>6}  "
              f"{pct(r['owns']):>6}  {pct(r['effective']):>9}")
    for r in rows:
        for fault in r.get("faults", []):
            print(f"node {r['node']} fault: {fault}")
        if r["frontend"] == "failing":
            for failure in r["frontend_failures"]:
                print(f"node {r['node']} front end: {failure}")
    for key, what in (("owns", "token ownership"), ("effective", "effective ownership")):
        shares = [r[key] for r in rows if r[key]]
        if len(shares) > 1:
            print(f"{what} spread: {100 * min(shares):.1f}% .. {100 * max(shares):.1f}% "
                  f"(largest / smallest = {max(shares) / min(shares):.3f}; even would be "
                  f"{100 * sum(shares) / len(rows):.1f}%)")


def cmd_status(settings: config.Settings, args: Any) -> int:
    rows = LocalMailCluster().status()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_status(rows)
    return 0


def cmd_partition(settings: config.Settings, args: Any) -> int:
    peers = LocalMailCluster().partition(args.node, args.peer, args.one_way)
    how = "drops what it sends to" if args.one_way else "is cut off from"
    print(f"node {args.node} {how} node(s) {', '.join(map(str, peers))}; `cassmail cluster heal {args.node}` undoes it")
    return 0


def cmd_delay(settings: config.Settings, args: Any) -> int:
    peers = LocalMailCluster().delay(args.node, args.ms, args.loss, args.peer)
    print(f"node {args.node}: {args.ms} ms added, {args.loss:g}% lost on what it sends to node(s) "
          f"{', '.join(map(str, peers))}")
    return 0


def cmd_heal(settings: config.Settings, args: Any) -> int:
    healed = LocalMailCluster().heal(args.node)
    print(f"network faults removed from node(s) {', '.join(map(str, healed))}")
    return 0


def cmd_node(settings: config.Settings, args: Any) -> int:
    cluster = LocalMailCluster()
    cluster.act(args.action, args.node, args.parts)
    done = {"start": "started", "stop": "stopped", "kill": "killed"}[args.action]
    print(f"node {args.node}: {' and '.join(args.parts)} {done}")
    return 0


__all__ = ["LocalMailCluster", "ClusterError", "active_config", "add_commands", "ownership"]
