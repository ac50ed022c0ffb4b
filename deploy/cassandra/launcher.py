#!/usr/bin/env python3
"""Run a throw-away Apache Cassandra 5.0 cluster on this machine, without Docker.

cassmail keeps all of its mail in Cassandra, so its integration tests, the load
test and a developer's laptop all need a real Cassandra.  Docker is not always
available (CI sandboxes, locked-down laptops), and a distribution tarball is not
on any package registry, but Maven Central is: ``cassandra-all`` and its
dependencies are exactly the server.  This module fetches those jars once with
``mvn`` (see ``pom.xml`` beside this file), writes a minimal configuration per
node and starts ``org.apache.cassandra.service.CassandraDaemon`` directly with
``java``.

Node *i* (1-based) listens on the loopback address ``127.0.0.i``; every node uses
the same native (CQL) and storage ports, which is how a real cluster looks to the
driver.  Node 1 is the seed.  Everything a node writes lives under
``BASE_DIR/nodeI/``, and ``BASE_DIR/state.json`` records which processes were
started so that a later invocation (``down``, ``status``) can find them.

It is deliberately standard-library only: it must run before any
``pip install``.  It is both importable (the test suite loads it by path) and a
command-line tool::

    python deploy/cassandra/launcher.py [--base-dir DIR] [--nodes N] up
    python deploy/cassandra/launcher.py status
    python deploy/cassandra/launcher.py down
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable
from xml.sax.saxutils import escape as xml_escape

__all__ = [
    "LauncherError",
    "LocalCluster",
    "cql_ready",
    "default_cache_dir",
    "ensure_jars",
    "java_version",
    "main",
]

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
REPO_ROOT = HERE.parent.parent
DEFAULT_BASE_DIR = REPO_ROOT / "var" / "cassandra"
DEFAULT_VERSION = "5.0.6"
DAEMON_CLASS = "org.apache.cassandra.service.CassandraDaemon"
STATE_FILE = "state.json"
#: Timer slack of Cassandra's threads, in nanoseconds (Linux's PR_SET_TIMERSLACK; 50 us by
#: default). While requests keep arriving, the idle workers of Cassandra's shared thread pool
#: park for 10 us to 1 ms at a time to be ready for the next one: on a node of two cores about
#: 24,000 wake-ups a second, half of Cassandra's CPU under cassmail's outbound load
#: (loadtest/RESULTS.md#timer-slack). With 1 ms of slack the kernel groups them (4,300 a second).
#: Work handed to a parked worker still wakes it at once; only timed waits may end up to 1 ms
#: late. Operators running Cassandra under systemd get the same with `TimerSlackNSec=1ms`.
TIMER_SLACK_NS = 1_000_000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
SUPPORTED_JAVA = (11, 17)

# Cassandra 5.0 reaches into JDK internals (Unsafe, direct buffers, jamm's object
# sizing, Chronicle queues for audit logs...).  Java 17 forbids that unless the
# packages are exported/opened explicitly.  The distribution passes this list from
# conf/jvm17-server.options, which is not inside the jars on Maven Central, so it is
# copied here (apache/cassandra, cassandra-5.0 branch, "### JPMS" section).
JAVA17_MODULE_FLAGS: tuple[str, ...] = (
    "-Djdk.attach.allowAttachSelf=true",
    "--add-exports", "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-exports", "java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED",
    "--add-exports", "java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports", "java.rmi/sun.rmi.server=ALL-UNNAMED",
    "--add-exports", "java.sql/java.sql=ALL-UNNAMED",
    "--add-exports", "java.base/java.lang.ref=ALL-UNNAMED",
    "--add-exports", "jdk.unsupported/sun.misc=ALL-UNNAMED",
    "--add-exports", "jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED",
    "--add-exports", "jdk.attach/sun.tools.attach=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang.module=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.loader=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.reflect=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.math=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.module=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.util.jar=ALL-UNNAMED",
    "--add-opens", "jdk.management/com.sun.management.internal=ALL-UNNAMED",
    "--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens", "java.base/java.io=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens", "jdk.compiler/com.sun.tools.javac=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang=ALL-UNNAMED",
    "--add-opens", "java.base/java.util=ALL-UNNAMED",
    "--add-opens", "java.base/java.nio=ALL-UNNAMED",
    # Netty settings from the same file: let Netty use Unsafe for direct buffers and
    # keep the pre-4.1.75 allocator defaults Cassandra is tuned for.
    "-Dio.netty.tryReflectionSetAccessible=true",
    "-Dio.netty.allocator.useCacheForAllThreads=true",
    "-Dio.netty.allocator.maxOrder=11",
)

NODE_SUBDIRS = (
    "conf", "data", "commitlog", "saved_caches", "hints", "cdc_raw", "triggers", "logs",
)


class LauncherError(Exception):
    """Anything that stops the launcher from doing its job, with one clear message.

    The CLI prints ``str(error)`` as a single line (plus, for start failures, the
    tail of the node's log) instead of a traceback, so the message must say what
    is wrong and, where possible, what to do about it.
    """


# --------------------------------------------------------------------------- #
# Tools: java, mvn, jars                                                      #
# --------------------------------------------------------------------------- #


def default_cache_dir() -> Path:
    """Where downloaded jars live: ``$CASSMAIL_CACHE`` or ``~/.cache/cassmail``.

    Outside the repository so that a ``git clean`` or a fresh checkout does not
    re-download 66 MB, and shared between checkouts and base dirs.
    """
    env = os.environ.get("CASSMAIL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "cassmail"


def find_java() -> str:
    """Return the ``java`` executable to use, preferring ``$JAVA_HOME/bin/java``.

    Raises LauncherError when there is none, because everything else (mvn and
    Cassandra itself) needs it.
    """
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if not found:
        raise LauncherError(
            "java not found on PATH (nor in $JAVA_HOME): install OpenJDK 17 "
            "(e.g. apt-get install openjdk-17-jre-headless)"
        )
    return found


def java_version(java: str | None = None) -> int:
    """Return the feature version (8, 11, 17, 21, ...) of ``java``.

    Parsed from ``java -version`` (which prints on stderr) because that works on
    every JDK vendor, unlike ``--version`` which Java 8 lacks.
    """
    java = java or find_java()
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as exc:
        raise LauncherError(f"cannot run {java} -version: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise LauncherError(f"{java} -version did not answer within 60 s") from exc
    text = proc.stderr + proc.stdout
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        first = text.strip().splitlines()[0] if text.strip() else "(no output)"
        raise LauncherError(f"cannot tell the version of {java}: {first}")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0_392" style
        major = int(match.group(2))
    return major


def check_java() -> str:
    """Return the java executable after making sure Cassandra 5.0 can run on it.

    Cassandra 5.0 supports Java 11 and 17 only; on 21 it fails deep inside start-up
    with an obscure error, so say so up front.
    """
    java = find_java()
    major = java_version(java)
    if major not in SUPPORTED_JAVA:
        raise LauncherError(
            f"{java} is Java {major}, but Cassandra 5.0 runs only on Java 11 or 17: "
            "install OpenJDK 17 and put it first on PATH or set JAVA_HOME"
        )
    return java


def ensure_jars(cache_dir: Path | None = None, version: str = DEFAULT_VERSION) -> Path:
    """Return the directory holding cassandra-all-VERSION and its dependencies.

    The jars are fetched once with Maven into ``CACHE/cassandra-VERSION/lib``.
    Maven downloads into a temporary sibling directory which is renamed into place
    only when complete, so a fetch that was interrupted (Ctrl-C, network) is simply
    redone next time instead of leaving a half-filled lib dir that fails at run time.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    home = cache_dir.expanduser().resolve() / f"cassandra-{version}"
    lib = home / "lib"
    marker = lib / f"cassandra-all-{version}.jar"
    if marker.is_file():
        return lib

    java = find_java()  # mvn needs it too; give the clearer message first
    mvn = shutil.which("mvn")
    if not mvn:
        raise LauncherError(
            "mvn not found on PATH: install Maven 3 (e.g. apt-get install maven); "
            "it downloads Cassandra's jars from Maven Central"
        )
    if not POM.is_file():
        raise LauncherError(f"{POM} is missing: it describes what Maven must fetch")

    home.mkdir(parents=True, exist_ok=True)
    _remove_stale_downloads(home)
    if lib.exists():  # present but incomplete (e.g. copied by hand): fetch afresh
        shutil.rmtree(lib, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix="lib.partial-", dir=home))
    env = dict(os.environ)
    env.setdefault("JAVA_HOME", str(Path(java).resolve().parent.parent))
    cmd = [
        mvn, "-q", "-B", "-f", str(POM),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={tmp}",
        "-DincludeScope=runtime",
        f"-Dcassandra.version={version}",
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, check=False, cwd=str(HERE)
        )
        if proc.returncode != 0:
            tail = _last_lines((proc.stdout + proc.stderr).splitlines(), 20)
            raise LauncherError(
                f"mvn could not fetch cassandra-all {version} (exit {proc.returncode}):\n{tail}"
            )
        if not (tmp / marker.name).is_file():
            raise LauncherError(
                f"mvn finished but {marker.name} is not in its output; check {POM}"
            )
        try:
            os.rename(tmp, lib)
        except OSError as exc:
            # Another process won the race and renamed its copy first: use that.
            if not marker.is_file():
                raise LauncherError(f"cannot move jars into {lib}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return lib


def _remove_stale_downloads(home: Path, older_than: float = 3600.0) -> None:
    """Delete leftovers of interrupted fetches, but not a fetch running right now."""
    now = time.time()
    for leftover in home.glob("lib.partial-*"):
        try:
            if now - leftover.stat().st_mtime > older_than:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------- #
# CQL readiness probe                                                         #
# --------------------------------------------------------------------------- #

_OPCODE_ERROR = 0x00
_OPCODE_OPTIONS = 0x05
_OPCODE_SUPPORTED = 0x06


def cql_ready(host: str, port: int, timeout: float = 2.0) -> bool:
    """True when ``host:port`` speaks the CQL native protocol right now.

    A TCP connect is not enough: the port could belong to something else (another
    service, or a proxy), and during start-up Cassandra is not serving requests
    yet.  So send an OPTIONS request, the one request allowed before STARTUP, and
    expect a SUPPORTED response.  Protocol v4 is tried first (every Cassandra
    since 2.2 answers it); v5 is tried when the server rejects v4.
    """
    deadline = time.monotonic() + timeout
    for version in (4, 5):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        opcode = _cql_options_roundtrip(host, port, version, remaining)
        if opcode == _OPCODE_SUPPORTED:
            return True
        if opcode != _OPCODE_ERROR:  # not CQL at all, or nothing listening
            return False
    return False


def _cql_options_roundtrip(host: str, port: int, version: int, timeout: float) -> int | None:
    """Send one OPTIONS frame; return the response opcode, or None if not CQL."""
    # Frame header (protocol v3+): version, flags, stream id (int16), opcode, length.
    request = struct.pack(">BBhBI", version, 0, 1, _OPCODE_OPTIONS, 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(request)
            header = _recv_exact(sock, 9)
            if header is None:
                return None
            resp_version, _flags, stream, opcode, length = struct.unpack(">BBhBI", header)
            if not resp_version & 0x80 or stream != 1 or length > 1 << 20:
                return None  # not a response frame to our request
            if (resp_version & 0x7F) not in (1, 2, 3, 4, 5, 6):
                return None
            # Read the body so the server sees an orderly close, not a reset.
            _recv_exact(sock, length)
            return opcode
    except (OSError, ValueError):
        return None


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Read exactly n bytes, or return None if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf.extend(chunk)
    return bytes(buf)


# --------------------------------------------------------------------------- #
# Processes                                                                   #
# --------------------------------------------------------------------------- #


def _cmdline(pid: int) -> list[str]:
    """Arguments of a live process, or [] if it is gone (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def _stat_fields(path: str) -> list[str]:
    """Fields of a /proc stat file after the "(comm)" one: [state, ppid, ...]."""
    try:
        return Path(path).read_text().rpartition(")")[2].split()
    except OSError:
        return []


def _proc_start(pid: int) -> str | None:
    """Start time of a process that still holds its resources; None once it has exited.

    (pid, start time) identifies a process for good, unlike the pid alone.  It
    also tells "exiting" from "exited": a dying JVM loses its memory, and with it
    /proc/PID/cmdline, before its hundreds of threads let go of its sockets, and
    its main thread can already show as a zombie while the others are still
    running.  Only when every thread is a zombie (or the pid is gone) are the
    node's ports free again.
    """
    fields = _stat_fields(f"/proc/{pid}/stat")
    if len(fields) < 20:
        return None
    if fields[0] in ("Z", "X", "x"):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        if all(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[:1] in ([], ["Z"], ["X"], ["x"])
               for tid in tasks):
            return None
    return fields[19]


def _last_lines(lines: Iterable[str], n: int) -> str:
    return "\n".join(deque((line.rstrip("\n") for line in lines), maxlen=n))


def _tail(path: Path, n: int = 30) -> str:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as fh:
            return _last_lines(fh, n)
    except OSError:
        return ""


def _port_free(address: str, port: int) -> bool:
    """Can address:port be bound now?  (SO_REUSEADDR as Cassandra's Netty sets it.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise LauncherError(
                f"cannot bind {address}:{port} ({exc.strerror}); on macOS add the "
                f"loopback alias first: sudo ifconfig lo0 alias {address}"
            ) from exc
    return True


# --------------------------------------------------------------------------- #
# Configuration rendering                                                     #
# --------------------------------------------------------------------------- #


def timer_slack(ns: int | None = None) -> int:
    """Set the calling thread's timer slack (inherited by the processes and threads it starts,
    kept across exec) and return the one it had; with None only return it. 0 where the
    platform has no such setting (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return 0
    prctl.restype = ctypes.c_int
    old = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if ns is not None and old >= 0:
        prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0)
    return max(old, 0)


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if value is None:
        return "null"
    # A JSON string is a valid YAML double-quoted scalar.
    return json.dumps(str(value))


def to_yaml(obj: Any, indent: int = 0) -> str:
    """Render dicts/lists/scalars as block YAML (enough for cassandra.yaml).

    The standard library has no YAML writer and PyYAML may not be installed yet.
    """
    pad = " " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, (dict, list)) and value:
                lines.append(f"{pad}{key}:")
                lines.append(to_yaml(value, indent + 2))
            elif isinstance(value, list):
                lines.append(f"{pad}{key}: []")
            else:
                lines.append(f"{pad}{key}: {_yaml_scalar(value)}")
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, dict) and item:
                body = to_yaml(item, indent + 2).splitlines()
                lines.append(f"{pad}- {body[0].lstrip()}")
                lines.extend(body[1:])
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
    else:
        lines.append(f"{pad}{_yaml_scalar(obj)}")
    return "\n".join(lines)


LOGBACK_TEMPLATE = """<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by cassmail's deploy/cassandra/launcher.py.  INFO and above go to
     logs/system.log, rolled by size; nothing goes to the console (stdout.log only
     catches JVM-level output such as crashes). -->
<configuration scan="false">
  <appender name="SYSTEMLOG" class="ch.qos.logback.core.rolling.RollingFileAppender">
    <filter class="ch.qos.logback.classic.filter.ThresholdFilter">
      <level>INFO</level>
    </filter>
    <file>{logdir}/system.log</file>
    <rollingPolicy class="ch.qos.logback.core.rolling.FixedWindowRollingPolicy">
      <fileNamePattern>{logdir}/system.log.%i.zip</fileNamePattern>
      <minIndex>1</minIndex>
      <maxIndex>5</maxIndex>
    </rollingPolicy>
    <triggeringPolicy class="ch.qos.logback.core.rolling.SizeBasedTriggeringPolicy">
      <maxFileSize>20MB</maxFileSize>
    </triggeringPolicy>
    <encoder>
      <pattern>%-5level [%thread] %date{{ISO8601}} %F:%L - %msg%n</pattern>
    </encoder>
  </appender>

  <root level="INFO">
    <appender-ref ref="SYSTEMLOG" />
  </root>
  <logger name="org.apache.cassandra" level="INFO"/>
  <!-- Chatty at INFO on a test cluster that creates and drops many tables. -->
  <logger name="org.apache.cassandra.db.ColumnFamilyStore" level="WARN"/>
  <logger name="org.apache.cassandra.db.compaction" level="WARN"/>
  <logger name="org.apache.cassandra.dht.RangeStreamer" level="WARN"/>
</configuration>
"""


# --------------------------------------------------------------------------- #
# The cluster                                                                 #
# --------------------------------------------------------------------------- #


def commitlog_access_mode(directory: Path) -> str:
    """``direct`` where the file system of the commit log takes O_DIRECT writes (ext4, xfs),
    else ``legacy`` (mmap; tmpfs before Linux 6.6 refuses O_DIRECT, and so would Cassandra)."""
    probe_dir = directory
    while not probe_dir.is_dir() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "legacy"
    try:
        fd, name = tempfile.mkstemp(prefix=".direct-probe-", dir=probe_dir)
    except OSError:
        return "legacy"
    try:
        os.close(fd)
        fd = os.open(name, os.O_WRONLY | flag)
        os.close(fd)
        return "direct"
    except OSError:
        return "legacy"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


class LocalCluster:
    """A Cassandra cluster of ``nodes`` JVMs on 127.0.0.1 .. 127.0.0.N.

    All knowledge about running processes is kept in ``base_dir/state.json`` so
    that the object is cheap to re-create in another process: ``up`` in one
    shell and ``down`` in another operate on the same nodes.

    If ``base_dir`` already holds a cluster, its cluster name, ports and heap size
    are kept (the data on disk is tied to them); passing a conflicting non-default
    value raises LauncherError.  ``nodes`` larger than the recorded count grows the
    cluster on the next ``up``; it is never shrunk.
    """

    _DEFAULTS = {"cluster_name": "cassmail", "native_port": 9042, "storage_port": 7000,
                 "heap_mb": 1024}

    def __init__(
        self,
        base_dir: Path,
        nodes: int = 1,
        *,
        cluster_name: str = "cassmail",
        native_port: int = 9042,
        storage_port: int = 7000,
        heap_mb: int = 1024,
        cache_dir: Path | None = None,
        version: str = DEFAULT_VERSION,
    ) -> None:
        if nodes < 1 or nodes > 254:
            raise LauncherError(f"nodes must be between 1 and 254, not {nodes}")
        if heap_mb < 256:
            raise LauncherError(f"heap_mb={heap_mb} is too small: Cassandra 5.0 needs 256 MB or more")
        if native_port == storage_port:
            raise LauncherError("native_port and storage_port must differ")
        self.base_dir = Path(base_dir).expanduser().resolve()
        self.cache_dir = cache_dir
        self.version = version
        self.nodes = nodes
        self.cluster_name = cluster_name
        self.native_port = native_port
        self.storage_port = storage_port
        self.heap_mb = heap_mb
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._state: dict[str, Any] = {}
        self._load_existing_state(
            cluster_name=cluster_name, native_port=native_port,
            storage_port=storage_port, heap_mb=heap_mb,
        )

    # ----- state ----------------------------------------------------------- #

    @property
    def state_path(self) -> Path:
        return self.base_dir / STATE_FILE

    def _load_existing_state(self, **requested: Any) -> None:
        """Adopt the settings of a cluster already recorded in base_dir."""
        if not self.state_path.is_file():
            self._state = self._fresh_state()
            return
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError) as exc:
            raise LauncherError(f"cannot read {self.state_path}: {exc}") from exc
        for key, wanted in requested.items():
            recorded = state.get(key)
            if recorded is None:
                continue
            if wanted != recorded and wanted != self._DEFAULTS[key]:
                raise LauncherError(
                    f"{self.base_dir} already holds a cluster with {key}={recorded}, "
                    f"not {wanted}: use another --base-dir, or run down and delete it"
                )
            setattr(self, key, recorded)
        self.version = state.get("version", self.version)
        self.nodes = max(self.nodes, len(state.get("nodes", [])))
        self._state = state
        self._sync_state_nodes()

    def _fresh_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"nodes": []}
        self._state = state
        self._sync_state_nodes()
        return state

    def _sync_state_nodes(self) -> None:
        """Make the state's settings and node list match this object."""
        self._state.update(
            cluster_name=self.cluster_name, native_port=self.native_port,
            storage_port=self.storage_port, heap_mb=self.heap_mb, version=self.version,
            base_dir=str(self.base_dir),
        )
        nodes = self._state.setdefault("nodes", [])
        for i in range(len(nodes) + 1, self.nodes + 1):
            nodes.append({"index": i, "address": self.address(i), "pid": None,
                          "config": str(self.config_path(i))})

    def _save_state(self) -> None:
        """Write state.json atomically, so a crash never leaves half a file."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self._state, indent=2) + "\n")
        os.replace(tmp, self.state_path)

    def _node_state(self, i: int) -> dict[str, Any]:
        self._check_index(i)
        return self._state["nodes"][i - 1]

    def _check_index(self, i: int) -> None:
        if not 1 <= i <= self.nodes:
            raise LauncherError(f"no node {i}: this cluster has nodes 1..{self.nodes}")

    # ----- layout ---------------------------------------------------------- #

    def address(self, i: int) -> str:
        """Node i listens on 127.0.0.i: distinct addresses, identical ports."""
        return f"127.0.0.{i}"

    def command_prefix(self, i: int) -> list[str]:
        """What node i's java command runs under (none here); a subclass that puts each node in
        a network namespace of its own returns ``ip netns exec NAME``, which execs in place, so
        the pid started is still the JVM's."""
        return []

    def port_free(self, i: int, port: int) -> bool:
        """Can node i bind its address and ``port`` now (where node i runs)?"""
        return _port_free(self.address(i), port)

    def node_dir(self, i: int) -> Path:
        return self.base_dir / f"node{i}"

    def config_path(self, i: int) -> Path:
        return self.node_dir(i) / "conf" / "cassandra.yaml"

    def contact_points(self) -> list[str]:
        """Addresses to give the driver (all nodes; it discovers the rest anyway)."""
        return [self.address(i) for i in range(1, self.nodes + 1)]

    def node_config(self, i: int) -> dict[str, Any]:
        """The cassandra.yaml settings for node i, as a dict (see write_node_files).

        Minimal but complete for 5.0: everything not set here takes Cassandra's
        built-in default.  Values are sized for a 2-core laptop running several
        nodes, not for throughput.
        """
        d = self.node_dir(i)
        addr = self.address(i)
        return {
            "cluster_name": self.cluster_name,
            # 16 vnodes with the token allocator gives balanced ownership with few
            # tokens, which keeps start-up and repair cheap.
            "num_tokens": 16,
            "allocate_tokens_for_local_replication_factor": 3,
            "partitioner": "org.apache.cassandra.dht.Murmur3Partitioner",
            "seed_provider": [{
                "class_name": "org.apache.cassandra.locator.SimpleSeedProvider",
                "parameters": [{"seeds": f"{self.address(1)}:{self.storage_port}"}],
            }],
            "listen_address": addr,
            "rpc_address": addr,
            "storage_port": self.storage_port,
            "native_transport_port": self.native_port,
            "start_native_transport": True,
            "endpoint_snitch": "SimpleSnitch",
            "data_file_directories": [str(d / "data")],
            "commitlog_directory": str(d / "commitlog"),
            "saved_caches_directory": str(d / "saved_caches"),
            "hints_directory": str(d / "hints"),
            "cdc_raw_directory": str(d / "cdc_raw"),
            "commitlog_sync": "periodic",
            "commitlog_sync_period": "10000ms",
            "commitlog_segment_size": "32MiB",
            "disk_optimization_strategy": "ssd",
            # Tests create and drop keyspaces constantly: snapshots would only eat disk.
            "auto_snapshot": False,
            "snapshot_before_compaction": False,
            "incremental_backups": False,
            "materialized_views_enabled": False,
            "user_defined_functions_enabled": False,
            "sasi_indexes_enabled": False,
            "cdc_enabled": False,
            "authenticator": "AllowAllAuthenticator",
            "authorizer": "AllowAllAuthorizer",
            "role_manager": "CassandraRoleManager",
            # A fresh cluster needs no compatibility with 4.x sstables/messaging.
            "storage_compatibility_mode": "NONE",
            # Cassandra 5.0's trie memtables and trie-indexed sstables (its cassandra_latest.yaml).
            "memtable": {"configurations": {
                "skiplist": {"class_name": "SkipListMemtable"},
                "trie": {"class_name": "TrieMemtable"},
                "default": {"inherits": "trie"},
            }},
            "sstable": {"selected_format": "bti"},
            # Paxos v2 (Cassandra 4.1 and later): fewer round trips per
            # lightweight transaction (IMAP flag changes, expunges, UIDs, queue leases). Paxos
            # state is still purged the legacy way (by TTL), so no Paxos repairs are needed.
            "paxos_variant": "v2",
            # Small pools and caches: 2 cores, possibly several nodes.
            "concurrent_reads": 8,
            "concurrent_writes": 8,
            "concurrent_counter_writes": 4,
            "concurrent_materialized_view_writes": 2,
            "concurrent_compactors": 1,
            "compaction_throughput": "64MiB/s",
            "native_transport_max_threads": 32,
            "key_cache_size": "16MiB",
            "counter_cache_size": "4MiB",
            "prepared_statements_cache_size": "16MiB",
            "file_cache_size": "64MiB",
            "memtable_heap_space": f"{max(64, self.heap_mb // 4)}MiB",
            # Cell values (mail bodies) in memtables live off the heap: the collector no longer
            # copies every byte of mail from young to old generation while it waits to be flushed.
            # That room costs the heap nothing, so it is twice the on-heap room; with one flush
            # writer (2 cores) a memtable is flushed at half of it: fewer, larger sstables for
            # compaction to merge.
            "memtable_offheap_space": f"{max(64, self.heap_mb // 2)}MiB",
            "memtable_allocation_type": "offheap_buffers",
            "memtable_flush_writers": 1,
            # The commit log written with O_DIRECT from buffers of its own (Cassandra 5.0), not
            # through mmap and the page cache; the same periodic sync, so the same durability.
            "commitlog_disk_access_mode": commitlog_access_mode(d / "commitlog"),
            # Mail bodies can be large; keep a single mutation under the commit log cap.
            "max_mutation_size": "16MiB",
            "native_transport_max_frame_size": "16MiB",
            "hinted_handoff_enabled": True,
            # The nodes share one machine, where gossip is never late for long: a node silent
            # for about 11 s is down (the least Cassandra allows; its default, 8, waits about 18 s).
            "phi_convict_threshold": 5,
            "max_hint_window": "3h",
            "dynamic_snitch": True,
        }

    def jvm_args(self, i: int, lib: Path) -> list[str]:
        """The java command line (without the java binary) for node i."""
        d = self.node_dir(i)
        jamm = sorted(lib.glob("jamm-*.jar"))
        if not jamm:
            raise LauncherError(f"jamm jar missing from {lib}: delete it and fetch again")
        args = [
            f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
            "-Xss256k",
            "-XX:+UseG1GC", "-XX:+ParallelRefProcEnabled", "-XX:MaxTenuringThreshold=1",
            "-XX:MaxGCPauseMillis=300", "-XX:InitiatingHeapOccupancyPercent=70",
            # Die at once on OOM (a wedged node is worse in tests); no multi-GB heap dumps.
            "-XX:+ExitOnOutOfMemoryError",
            "-XX:+PerfDisableSharedMem",  # no /tmp/hsperfdata files
            "-XX:StringTableSize=1000003",
            "-Djava.net.preferIPv4Stack=true",
            f"-javaagent:{jamm[-1]}",
            *JAVA17_MODULE_FLAGS,
            f"-Dcassandra.config=file://{self.config_path(i)}",
            f"-Dlogback.configurationFile=file://{d / 'conf' / 'logback.xml'}",
            f"-Dcassandra.logdir={d / 'logs'}",
            f"-Dcassandra.storagedir={d}",
            f"-Dcassandra.triggers_dir={d / 'triggers'}",
            "-Dcassandra-foreground=yes",
            # Start fast: a local cluster needs no 30 s ring delay.
            "-Dcassandra.ring_delay_ms=3000",
            "-Dcassandra.superuser_setup_delay_ms=0",
            "-Dcassandra.gossip_settle_min_wait_ms=500",
            "-Dcassandra.gossip_settle_interval_ms=250",
            "-Dcassandra.gossip_settle_poll_success_required=3",
            # Nodes on one machine hear a shutdown announcement at once; default 2 s.
            "-Dcassandra.shutdown_announce_in_ms=500",
        ]
        if self.nodes == 1:
            args.append("-Dcassandra.skip_wait_for_gossip_to_settle=0")
        args += ["-cp", f"{d / 'conf'}:{lib}/*", DAEMON_CLASS]
        return args

    def write_node_files(self, i: int, *, new_cluster: bool = False) -> None:
        """Create node i's directories and (re)write its cassandra.yaml and logback.xml.

        A node joining a cluster no client has used yet (`new_cluster`) skips the Paxos repair
        that a join otherwise runs first, table by table (about 20 s a node here): the repair
        completes the lightweight transactions the ranges' old owners left open, and there are
        none yet.  Every later start (a restart, a node added to a cluster in use) repairs."""
        d = self.node_dir(i)
        for sub in NODE_SUBDIRS:
            (d / sub).mkdir(parents=True, exist_ok=True)
        header = (f"# Written by cassmail's deploy/cassandra/launcher.py for node {i} of "
                  f"{self.nodes}; rewritten on every start, edit the launcher instead.\n")
        config = self.node_config(i)
        if new_cluster:
            config["skip_paxos_repair_on_topology_change"] = True
        self.config_path(i).write_text(header + to_yaml(config) + "\n")
        (d / "conf" / "logback.xml").write_text(LOGBACK_TEMPLATE.format(logdir=xml_escape(str(d / "logs"))))

    # ----- processes ------------------------------------------------------- #

    def _owns(self, pid: int, i: int) -> bool:
        """Is pid a live CassandraDaemon started with node i's config of this base_dir?"""
        args = _cmdline(pid)
        if DAEMON_CLASS not in args:
            return False
        wanted = f"-Dcassandra.config=file://{self.config_path(i)}"
        return wanted in args

    def _find_pid(self, i: int) -> int | None:
        """The pid of node i's JVM, if it is alive.

        The recorded pid is trusted only if /proc says it is still our daemon (pids
        get recycled).  If the record is missing (launcher killed between spawning
        and saving), look for a daemon with this node's config path.
        """
        node = self._node_state(i)
        pid = node.get("pid")
        if isinstance(pid, int) and pid > 0:
            child = self._children.get(i)
            if child is not None and child.pid == pid:
                # Our own child cannot be a recycled pid; right after spawning its
                # /proc cmdline may still be empty, so do not rely on it here.
                return pid if child.poll() is None else None
            if self._owns(pid, i):
                return pid
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and self._owns(int(entry.name), i):
                return int(entry.name)
        return None

    def is_running(self, i: int) -> bool:
        """Whether node i's JVM is alive (it may still be starting up)."""
        return self._find_pid(i) is not None

    def status(self) -> list[dict[str, Any]]:
        """Per node: index, address, native_port, pid, running, cql."""
        rows = []
        for i in range(1, self.nodes + 1):
            pid = self._find_pid(i)
            rows.append({
                "index": i,
                "address": self.address(i),
                "native_port": self.native_port,
                "pid": pid,
                "running": pid is not None,
                "cql": cql_ready(self.address(i), self.native_port, timeout=1.0)
                if pid is not None else False,
            })
        return rows

    def is_new(self) -> bool:
        """No node of this cluster has ever run (none has a system keyspace on disk)."""
        return not any((self.node_dir(i) / "data" / "system").exists() for i in range(1, self.nodes + 1))

    def up(self, timeout: float = 300, *, new_cluster: bool | None = None,
           after_first: Callable[[], None] | None = None) -> None:
        """Start every node that is not running, one after another, and wait for CQL.

        Sequential because Cassandra refuses concurrent bootstraps and node 1 (the
        seed) must be up before the others can join.  ``timeout`` applies per node.
        Idempotent: nodes already running are only waited for.

        ``new_cluster`` (default: whether no node has ever run) says that no client has used
        the cluster yet, so there is no Paxos state for a joining node to repair
        (see write_node_files).  ``after_first`` is called once node 1 answers, before the others
        join: work done then (a schema, say) is one node's instead of every node's.
        """
        if new_cluster is None:
            new_cluster = self.is_new()
        self._save_state()
        for i in range(1, self.nodes + 1):
            self.start_node(i, timeout=timeout, new_cluster=new_cluster)
            if i == 1 and after_first is not None:
                after_first()

    def start_node(self, i: int, timeout: float = 300, *, new_cluster: bool = False) -> None:
        """Start node i (unless already running) and return once it answers CQL.

        A node that dies or does not answer within ``timeout`` seconds is killed and
        LauncherError carries the end of its logs, since that is where the reason is.
        """
        self._check_index(i)
        if self._find_pid(i) is not None:
            self.wait_node(i, timeout)
            return
        java = check_java()
        addr = self.address(i)
        # Checked before starting because cql_ready cannot tell our node from a
        # stranger already serving CQL on the same address and port.  A few seconds
        # of grace: a node killed a moment ago may still be releasing its sockets.
        for port in (self.native_port, self.storage_port):
            deadline = time.monotonic() + 5
            while not self.port_free(i, port) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.port_free(i, port):
                raise LauncherError(
                    f"{addr}:{port} is already in use (another Cassandra? see "
                    f"`ss -ltnp 'sport = :{port}'`): stop it or choose other ports"
                )
        lib = ensure_jars(self.cache_dir, self.version)
        self.write_node_files(i, new_cluster=new_cluster)
        d = self.node_dir(i)
        cmd = [*self.command_prefix(i), java, *self.jvm_args(i, lib)]
        stdout_log = d / "logs" / "stdout.log"
        with stdout_log.open("ab") as out:
            out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} launcher: "
                      f"starting node {i} ====\n".encode())
            out.flush()
            slack = timer_slack(TIMER_SLACK_NS)  # the node inherits this thread's (see TIMER_SLACK_NS)
            try:
                proc = subprocess.Popen(
                    cmd, cwd=str(d), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                )
            except OSError as exc:
                raise LauncherError(f"cannot start {java}: {exc}") from exc
            finally:
                if slack:
                    timer_slack(slack)
        self._children[i] = proc
        node = self._node_state(i)
        node.update(pid=proc.pid, address=addr, config=str(self.config_path(i)),
                    started_at=time.time())
        self._save_state()
        self.wait_node(i, timeout, kill_on_timeout=True)

    def wait_node(self, i: int, timeout: float = 300, *, grace: float = 0.0,
                  kill_on_timeout: bool = False) -> None:
        """Block until node i answers CQL.

        Fails early, with the end of the node's logs, once its process is gone;
        ``grace`` tolerates a process that has not appeared yet (another shell may
        be about to start it).  A node this call's caller just spawned is killed on
        timeout (``kill_on_timeout``) so a failed start leaves nothing behind.
        """
        started = time.monotonic()
        deadline = started + timeout
        addr = self.address(i)
        while True:
            if self._find_pid(i) is None and time.monotonic() - started >= grace:
                raise LauncherError(self._failure_text(i, "is not running (its process exited)"))
            if cql_ready(addr, self.native_port, timeout=2.0):
                return
            if time.monotonic() >= deadline:
                if kill_on_timeout:
                    self.kill_node(i)
                raise LauncherError(self._failure_text(
                    i, f"did not answer CQL on {addr}:{self.native_port} within "
                       f"{timeout:.0f} s" + (" (killed it)" if kill_on_timeout else "")))
            time.sleep(0.5)

    def wait(self, timeout: float = 300) -> None:
        """Block until every node answers CQL (for `launcher.py wait`).

        Nodes may still be being started by another process, so a missing process
        is tolerated for a short grace period before it counts as a failure.
        """
        deadline = time.monotonic() + timeout
        for i in range(1, self.nodes + 1):
            self.wait_node(i, max(1.0, deadline - time.monotonic()), grace=20.0)

    def _failure_text(self, i: int, what: str) -> str:
        logs = self.node_dir(i) / "logs"
        parts = [f"node {i} ({self.address(i)}) {what}"]
        for name in ("system.log", "stdout.log"):
            tail = _tail(logs / name, 30)
            if tail.strip():
                parts.append(f"--- last lines of {logs / name} ---\n{tail}")
        return "\n".join(parts)

    def _signal(self, i: int, sig: int) -> tuple[int, str] | None:
        """Send sig to node i's verified JVM; return its (pid, start time) identity."""
        pid = self._find_pid(i)
        if pid is None:
            return None
        start = _proc_start(pid)
        if start is None:
            return None
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return None
        return pid, start

    def _wait_gone(self, procs: dict[int, tuple[int, str]],
                   timeout: float) -> dict[int, tuple[int, str]]:
        """Wait until the given node -> (pid, start) processes have fully exited.

        Returns the survivors.  Fully means zombie or reaped: only then are the
        node's ports free for a restart.
        """
        deadline = time.monotonic() + timeout
        alive = dict(procs)
        while alive:
            for i, (pid, start) in list(alive.items()):
                child = self._children.get(i)
                if child is not None and child.pid == pid:
                    # Our own child: waitpid reports it only once all threads are gone
                    # (and reaps it, so it does not stay a zombie).
                    if child.poll() is not None:
                        del alive[i]
                elif _proc_start(pid) != start:
                    del alive[i]
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return alive

    def _kill_survivors(self, survivors: dict[int, tuple[int, str]]) -> None:
        """SIGKILL processes that ignored SIGTERM (identity re-checked: no pid reuse)."""
        for pid, start in survivors.values():
            if _proc_start(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._wait_gone(survivors, 30)

    def _forget(self, i: int) -> None:
        self._node_state(i)["pid"] = None
        self._children.pop(i, None)

    def stop_node(self, i: int, timeout: float = 60) -> None:
        """Stop node i gracefully (SIGTERM: Cassandra drains and flushes), SIGKILL after timeout."""
        proc = self._signal(i, signal.SIGTERM)
        if proc is not None:
            self._kill_survivors(self._wait_gone({i: proc}, timeout))
        self._forget(i)
        self._save_state()

    def kill_node(self, i: int) -> None:
        """SIGKILL node i at once, as a crash would: for fault-tolerance tests."""
        proc = self._signal(i, signal.SIGKILL)
        if proc is not None:
            self._wait_gone({i: proc}, 30)
        self._forget(i)
        self._save_state()

    def down(self, timeout: float = 60) -> None:
        """Stop every node of this base_dir: SIGTERM all, wait, then SIGKILL survivors.

        Only processes verified to be this base_dir's daemons are signalled, so a
        stale state.json can never kill an unrelated process that reused a pid.
        """
        procs = {}
        for i in range(1, self.nodes + 1):
            proc = self._signal(i, signal.SIGTERM)
            if proc is not None:
                procs[i] = proc
        self._kill_survivors(self._wait_gone(procs, timeout))
        for i in range(1, self.nodes + 1):
            self._forget(i)
        if self.state_path.is_file():
            self._save_state()


# --------------------------------------------------------------------------- #
# Command line                                                                #
# --------------------------------------------------------------------------- #


def _format_status(rows: list[dict[str, Any]]) -> str:
    header = ("node", "address", "port", "pid", "process", "cql")
    table = [header] + [
        (str(r["index"]), r["address"], str(r["native_port"]), str(r["pid"] or "-"),
         "running" if r["running"] else "down", "yes" if r["cql"] else "no")
        for r in rows
    ]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in table)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launcher.py",
        description="Run a local Apache Cassandra 5.0 cluster for cassmail (no Docker).",
    )
    p.add_argument("--base-dir", type=Path, default=DEFAULT_BASE_DIR,
                   help=f"where state, config, data and logs live (default {DEFAULT_BASE_DIR})")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1)")
    p.add_argument("--native-port", type=int, default=None, help="CQL port (default 9042)")
    p.add_argument("--storage-port", type=int, default=None,
                   help="inter-node port (default 7000)")
    p.add_argument("--heap-mb", type=int, default=None, help="JVM heap per node (default 1024)")
    p.add_argument("--cluster-name", default=None, help="cluster name (default cassmail)")
    p.add_argument("--version", default=DEFAULT_VERSION,
                   help=f"Cassandra version to fetch/run (default {DEFAULT_VERSION})")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds to wait for each node to answer CQL (default 300)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("fetch", help="download the Cassandra jars (once) and print their dir")
    sub.add_parser("up", help="start all nodes and wait until they answer CQL")
    sub.add_parser("down", help="stop all nodes this base dir started")
    st = sub.add_parser("status", help="show each node's process and CQL state")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    for name, text in (("start", "start node I and wait for CQL"),
                       ("stop", "stop node I gracefully"),
                       ("kill", "SIGKILL node I (fault tests)")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("node", type=int, metavar="I")
    sub.add_parser("wait", help="block until every node answers CQL")
    return p


def _cluster_from_args(args: argparse.Namespace) -> LocalCluster:
    """Explicit options win; otherwise an existing state.json's values; else defaults."""
    kwargs: dict[str, Any] = {}
    for key in ("cluster_name", "native_port", "storage_port", "heap_mb"):
        value = getattr(args, key)
        if value is not None:
            kwargs[key] = value
    return LocalCluster(args.base_dir, nodes=args.nodes or 1, version=args.version, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the CLI; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "fetch":
            print(ensure_jars(version=args.version))
            return 0
        cluster = _cluster_from_args(args)
        cmd = args.command
        if cmd == "up":
            started = time.monotonic()
            cluster.up(timeout=args.timeout)
            print(f"cluster {cluster.cluster_name!r} up in {time.monotonic() - started:.1f} s: "
                  f"contact points {','.join(cluster.contact_points())} "
                  f"port {cluster.native_port}")
        elif cmd == "down":
            cluster.down()
            print(f"cluster in {cluster.base_dir} stopped")
        elif cmd == "status":
            rows = cluster.status()
            print(json.dumps(rows, indent=2) if args.json else _format_status(rows))
        elif cmd == "start":
            cluster.start_node(args.node, timeout=args.timeout)
            print(f"node {args.node} up")
        elif cmd == "stop":
            cluster.stop_node(args.node)
            print(f"node {args.node} stopped")
        elif cmd == "kill":
            cluster.kill_node(args.node)
            print(f"node {args.node} killed")
        elif cmd == "wait":
            cluster.wait(timeout=args.timeout)
            print("all nodes answer CQL")
    except LauncherError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("launcher: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
