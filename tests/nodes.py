"""Real `cassmail serve` processes for protocol tests: a config file, free ports, start, wait, stop."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cassmail.config import LISTENER_PROTOCOLS, Settings, to_toml

CASSMAIL = str(Path(sys.executable).parent / "cassmail")


#: Every port free_port has handed out in this process. A port is only free when asked for; the
#: kernel may offer it again before its taker binds it, and cassmail's listeners bind with
#: SO_REUSEPORT, so two of them given one port would both bind it and share its connections
#: (an IMAP client greeted by SMTP).
_HANDED_OUT: set[int] = set()


def take_port(port: int) -> bool:
    """Whether `port` is new to this process's port pickers; it is theirs from now on."""
    if port in _HANDED_OUT:
        return False
    _HANDED_OUT.add(port)
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 that no earlier pick in this process returned."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if take_port(port):
            return port


class Node:
    """One `cassmail serve` process with its own ports; `port(name)` gives a listener's port."""

    def __init__(self, settings: Settings, directory: Path, **listeners: dict[str, Any]) -> None:
        self.settings = dataclasses.replace(settings)
        self.settings.node = dataclasses.replace(settings.node, name="mx.test", workers=1, log_level="INFO")
        for name in LISTENER_PROTOCOLS:
            listener = dataclasses.replace(getattr(settings, name))
            listener.listen = f"127.0.0.1:{free_port()}"
            # The implicit-TLS listeners (submissions, pop3s, imaps) only when a test asks for them.
            listener.enabled = name in ("smtp", "submission", "lmtp", "pop3", "imap")
            for key, value in listeners.get(name, {}).items():
                setattr(listener, key, value)
            setattr(self.settings, name, listener)
        for key, value in listeners.get("node", {}).items():
            setattr(self.settings.node, key, value)
        # Queue workers only where a test asks for them: they would take what other tests queue.
        self.settings.delivery = dataclasses.replace(settings.delivery, enabled=False)
        self.settings.relay = dataclasses.replace(settings.relay)
        self.settings.inbound = dataclasses.replace(settings.inbound)
        for section in ("delivery", "relay", "inbound"):
            for key, value in listeners.get(section, {}).items():
                setattr(getattr(self.settings, section), key, value)
        self.settings.metrics = dataclasses.replace(settings.metrics, listen=f"127.0.0.1:{free_port()}")
        for key, value in listeners.get("metrics", {}).items():
            setattr(self.settings.metrics, key, value)
        self.config = directory / f"node-{os.getpid()}-{time.monotonic_ns()}.toml"
        self.config.write_text(to_toml(self.settings))
        self.log = self.config.with_suffix(".log")
        self.process: subprocess.Popen[bytes] | None = None

    def port(self, name: str) -> int:
        """The port of a listener, or of the metrics endpoint ("metrics")."""
        return int(getattr(self.settings, name).listen.rsplit(":", 1)[1])

    def start(self, timeout: float = 60) -> Node:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [CASSMAIL, "--config", str(self.config), "serve"], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env,
            )
        deadline = time.monotonic() + timeout
        ports = [self.port(n) for n in ("smtp", "submission", "submissions", "lmtp", "pop3", "pop3s")
                 if getattr(self.settings, n).enabled]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"cassmail serve exited with {self.process.returncode}:\n{self.log.read_text()}")
            if all(_accepts(p) for p in ports) and "worker-ready" in self.log.read_text():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"cassmail serve did not come up in {timeout} s:\n{self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_text(self) -> str:
        return self.log.read_text()

    def own_tracebacks(self) -> list[str]:
        """Log lines with a traceback from cassmail itself. The Cassandra driver logs the failed
        reconnections of its control connection with one; a node being down causes those."""
        return [line for line in self.log_text().splitlines()
                if "Traceback" in line and "logger=cassandra." not in line]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- shared by the protocol suites

#: Message size limit of the test nodes: a 50 MB message fits, 53 MB does not.
MAX_SIZE = 52 * 1024 * 1024
CLIENT_TLS = ssl.create_default_context()
CLIENT_TLS.check_hostname = False
CLIENT_TLS.verify_mode = ssl.CERT_NONE


def node_settings(backend_settings: Settings) -> Settings:
    """The backend's settings with the test nodes' message size limit."""
    settings = dataclasses.replace(backend_settings)
    settings.store = dataclasses.replace(backend_settings.store, max_message_size=MAX_SIZE)
    return settings


async def inbox(store: Any, user: str, mailbox: str = "INBOX") -> list[bytes]:
    """Every message of a mailbox, in arrival order, read through the store."""
    return [await store.read_message(user, mailbox, s.id) async for s in store.list_messages(user, mailbox)]


def strip_trace(message: bytes) -> tuple[bytes, bytes]:
    """(trace headers cassmail added, the message as the client sent it)."""
    match = re.match(rb"(Return-Path: [^\r]*\r\n(?:Received: .*?\r\n)(?:\t[^\r]*\r\n)*)", message, re.S)
    assert match, message[:300]
    return match.group(1), message[match.end() :]


def server_end_quickack(client: socket.socket) -> int:
    """TCP_QUICKACK of the server's end of `client`'s connection, the server listening in this
    process: its socket is found by the connection's ports in /proc/self/net/tcp and its inode
    among this process's file descriptors. 1: out of the delayed-ACK mode, 0: in it."""
    mine, theirs = client.getsockname()[1], client.getpeername()[1]
    inode = next(
        fields[9] for fields in (line.split() for line in open("/proc/self/net/tcp").read().splitlines()[1:])
        if int(fields[1].rsplit(":", 1)[1], 16) == theirs and int(fields[2].rsplit(":", 1)[1], 16) == mine
    )
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]":
                server_end = socket.socket(fileno=os.dup(int(fd)))
                try:
                    return server_end.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK)
                finally:
                    server_end.close()  # the duplicate only
    raise AssertionError(f"no descriptor of this process is socket {inode}")
