"""Network namespaces for the local cluster, and the faults an operator injects into them.

With `cassmail cluster up --netns`, node i runs in a network namespace of its own
(`cassmail-nI`), joined by a veth pair to a bridge in the root namespace
(`cassmail-br`, 10.77.0.1/24); the node is 10.77.0.(10+i). Its Cassandra and its
front end both live there, so a rule in that namespace cuts or slows exactly
what a network fault between machines would: the node's gossip, its replica
traffic and its coordinator's requests, while clients in the root namespace
keep reaching its front end over the bridge (the way a client on the node's
side of a split would).

Faults are plain iptables rules inside the namespace (DROP for partitions and
loss, NFQUEUE to cassmail.netdelay for latency); nothing else lives there, so
healing is flushing them and stopping the delayer. Everything here needs root
and iproute2/iptables; each failure is one line naming the command.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from cassmail.checkout import CommandError

BRIDGE = "cassmail-br"
SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.1"
PREFIX = 24
#: The interface name a node sees inside its namespace.
INSIDE = "eth0"


class NetnsError(CommandError):
    """A namespace, link or fault command failed; the message names it and what it said."""


def namespace(i: int) -> str:
    return f"cassmail-n{i}"


def address(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def _outside(i: int) -> str:
    return f"cassmail-v{i}"


def _run(*cmd: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise NetnsError(f"{full[0]} not found: network namespaces need iproute2 and iptables") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(full)}` did not finish within 30 s") from None
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(full)}` failed: {(done.stderr or done.stdout).strip() or done.returncode}")
    return done


def exec_prefix(i: int) -> list[str]:
    """Run a command inside node i's namespace (`ip netns exec` execs in place: the pid is the command's)."""
    return ["ip", "netns", "exec", namespace(i)]


def exists(name: str) -> bool:
    return _run("ip", "netns", "pids", name, check=False).returncode == 0


def _link_exists(name: str) -> bool:
    return _run("ip", "link", "show", name, check=False).returncode == 0


def check_tools() -> None:
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"--netns needs {', '.join(missing)} (Debian: iproute2, iptables)")


def create(nodes: int) -> None:
    """The bridge and one namespace per node, each with its veth and address; idempotent."""
    check_tools()
    if not _link_exists(BRIDGE):
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{GATEWAY}/{PREFIX}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    # With br_netfilter loaded, frames between two ports of the bridge cross the root FORWARD
    # chain, where a container runtime's rules may sit: let the cluster's own traffic through.
    rule = ("FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT")
    if _run("iptables", "-C", *rule, check=False).returncode != 0:
        _run("iptables", "-I", *rule)
    for i in range(1, nodes + 1):
        ns = namespace(i)
        if not exists(ns):
            _run("ip", "netns", "add", ns)
        if not _link_exists(_outside(i)):
            _run("ip", "link", "add", _outside(i), "type", "veth", "peer", "name", INSIDE, "netns", ns)
            _run("ip", "link", "set", _outside(i), "master", BRIDGE)
            _run("ip", "addr", "add", f"{address(i)}/{PREFIX}", "dev", INSIDE, netns=ns)
        _run("ip", "link", "set", _outside(i), "up")
        _run("ip", "link", "set", "lo", "up", netns=ns)
        _run("ip", "link", "set", INSIDE, "up", netns=ns)
        if "default" not in _run("ip", "route", "show", "default", netns=ns).stdout:
            _run("ip", "route", "add", "default", "via", GATEWAY, netns=ns)


def destroy(nodes: int) -> list[str]:
    """Remove the namespaces (their veths go with them), the bridge and its FORWARD rule.

    Goes on past failures so that one stuck piece does not keep the others; returns what failed.
    """
    failed = []
    for i in range(1, nodes + 1):
        if exists(namespace(i)):
            heal(i)
            done = _run("ip", "netns", "del", namespace(i), check=False)
            if done.returncode:
                failed.append(f"ip netns del {namespace(i)}: {done.stderr.strip()}")
        if _link_exists(_outside(i)):
            _run("ip", "link", "del", _outside(i), check=False)
    rule = ("FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT")
    while _run("iptables", "-C", *rule, check=False).returncode == 0:
        _run("iptables", "-D", *rule, check=False)
    if _link_exists(BRIDGE):
        done = _run("ip", "link", "del", BRIDGE, check=False)
        if done.returncode:
            failed.append(f"ip link del {BRIDGE}: {done.stderr.strip()}")
    return failed


def partition(i: int, peers: Sequence[int], one_way: bool = False) -> None:
    """Drop what node i sends to `peers`, and (unless one_way) what it receives from them."""
    ns = namespace(i)
    for peer in peers:
        _run("iptables", "-A", "OUTPUT", "-d", address(peer), "-j", "DROP", netns=ns)
        if not one_way:
            _run("iptables", "-A", "INPUT", "-s", address(peer), "-j", "DROP", netns=ns)


#: The netfilter queue a node's delayed packets go through (one per namespace, so one number serves all).
QUEUE = 7


def delay(i: int, peers: Sequence[int], ms: int, loss: float = 0.0) -> subprocess.Popen[bytes] | None:
    """Delay by `ms` (and drop `loss` percent of) what node i sends to `peers`; clients' traffic is untouched.

    Loss is an iptables `statistic` match; latency is cassmail.netdelay holding the packets of an
    NFQUEUE (kernels without sch_netem have it), started here inside the namespace and returned so
    the caller can record it; `heal` stops it. `--queue-bypass` lets packets through unheld if the
    process is gone, so a dead delayer never becomes a partition.
    """
    ns = namespace(i)
    heal(i)
    proc = None
    if ms > 0:
        log = open(os.devnull, "wb")  # noqa: SIM115 - handed to the detached process
        proc = subprocess.Popen([*exec_prefix(i), sys.executable, "-m", "cassmail.netdelay", "--queue", str(QUEUE),
                                 "--ms", str(ms)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE,
                                start_new_session=True)
        log.close()
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass  # bound and holding: it runs until heal
        else:
            raise NetnsError(f"the packet delayer of node {i} exited: "
                             f"{proc.stderr.read().decode(errors='replace').strip() if proc.stderr else ''}")
        if proc.stderr:
            proc.stderr.close()
    for peer in peers:
        if loss:
            _run("iptables", "-A", "OUTPUT", "-d", address(peer), "-m", "statistic", "--mode", "random",
                 "--probability", f"{loss / 100:.4f}", "-j", "DROP", netns=ns)
        if ms > 0:
            _run("iptables", "-A", "OUTPUT", "-d", address(peer), "-j", "NFQUEUE", "--queue-num", str(QUEUE),
                 "--queue-bypass", netns=ns)
    return proc


def _delayers(i: int) -> list[int]:
    """Pids of the packet delayers running in node i's namespace."""
    pids = _run("ip", "netns", "pids", namespace(i), check=False).stdout.split()
    found = []
    for pid in pids:
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"cassmail.netdelay" in args:
            found.append(int(pid))
    return found


def heal(i: int) -> None:
    """Remove every fault of node i: its iptables rules and its packet delayer."""
    ns = namespace(i)
    for chain in ("INPUT", "OUTPUT"):
        _run("iptables", "-F", chain, netns=ns)
    for pid in _delayers(i):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def faults(i: int) -> list[str]:
    """Node i's faults as they are (iptables rules, a running packet delayer), for status."""
    ns = namespace(i)
    rules = [line for line in _run("iptables", "-S", netns=ns).stdout.splitlines() if line.startswith("-A ")]
    return rules + [f"packet delayer pid {pid}" for pid in _delayers(i)]


def port_free(i: int, port: int) -> bool:
    """Whether node i's address and `port` can be bound inside its namespace now."""
    probe = ("import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
             f"try:\n s.bind(('{address(i)}',{port}))\nexcept OSError:\n sys.exit(1)")
    return _run(sys.executable, "-c", probe, netns=namespace(i), check=False).returncode == 0


__all__ = ["NetnsError", "address", "create", "delay", "destroy", "exec_prefix", "faults", "heal", "namespace",
           "partition", "port_free"]
