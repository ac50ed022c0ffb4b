"""Is this node serving? Each enabled listener must greet like its protocol.

A TCP connect proves little (a worker can accept and then hang on a store it
cannot reach); the greeting is the first thing a client needs, so the check
reads it: ``220`` for SMTP, submission and LMTP, ``+OK`` for POP3, ``* OK`` for
IMAP. The container image runs ``python -m cassmail.healthcheck`` as its
HEALTHCHECK, and the local cluster waits on the same probe for its front ends.
Exit status 0 when every listener greets, 1 otherwise (one line per failure).
"""

from __future__ import annotations

import socket
import ssl
import sys
from concurrent.futures import ThreadPoolExecutor

from cassmail import config
from cassmail.server import enabled_listeners

#: What each listener's greeting starts with.
GREETINGS = {"smtp": b"220", "submission": b"220", "lmtp": b"220", "pop3": b"+OK", "imap": b"* OK",
             "managesieve": b"\"IMPLEMENTATION\""}

_NO_VERIFY = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # (no CA certificates loaded: nothing is verified)
_NO_VERIFY.check_hostname = False
_NO_VERIFY.verify_mode = ssl.CERT_NONE


def probe_host(listen_host: str) -> str:
    """Where to connect for a listener bound to listen_host (a wildcard means this machine)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(listen_host, listen_host)


def greets(host: str, port: int, expected: bytes, timeout: float = 3.0, tls: bool = False) -> bool:
    """True when host:port sends a first line starting with `expected` within `timeout` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            raw.settimeout(timeout)
            sock = _NO_VERIFY.wrap_socket(raw, server_hostname=host) if tls else raw
            line = b""
            while b"\n" not in line and len(line) < 1024:
                chunk = sock.recv(1024)
                if not chunk:
                    break
                line += chunk
            return line.startswith(expected)
    except (OSError, ssl.SSLError):
        return False


def check(settings: config.Settings, timeout: float = 3.0) -> list[str]:
    """One message per enabled listener that does not greet; empty when the node is healthy.
    The listeners are probed side by side: a node answers in one timeout at most."""
    listeners = enabled_listeners(settings)

    def probe(name: str) -> str | None:
        host, port = listeners[name]
        expected = GREETINGS[config.LISTENER_PROTOCOLS[name]]
        if greets(probe_host(host), port, expected, timeout, getattr(settings, name).implicit_tls):
            return None
        return f"{name} on {host}:{port} does not greet with {expected.decode()!r} within {timeout:g} s"

    with ThreadPoolExecutor(max_workers=max(1, len(listeners))) as pool:
        return [failure for failure in pool.map(probe, listeners) if failure]


def main() -> int:
    try:
        settings = config.load()
    except config.ConfigError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    failures = check(settings)
    for line in failures:
        print(f"unhealthy: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
