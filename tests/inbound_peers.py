"""A real rspamd for the MX's spam filter tests and benchmark: Debian's package, started in the
foreground from the packaged configuration with a directory of our own for its overrides, run
files, database and log (no system service), listening on loopback only.

Its DNS is the test's own server, and the modules that ask the internet (RBLs, fuzzy hashes,
phishing feeds, ...) are off, so a verdict takes milliseconds and depends on nothing outside.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.outbound_peers import free_port_on

RSPAMD = "/usr/bin/rspamd"
REDIS = "/usr/bin/redis-server"
HS_CACHE = Path(os.environ.get("CASSMAIL_CACHE", Path.home() / ".cache" / "cassmail")) / "rspamd-hs"
PACKAGED = Path("/etc/rspamd/rspamd.conf")
#: Modules whose checks go out to the internet or need Redis.
NETWORK_MODULES = (
    "rbl", "surbl", "fuzzy_check", "phishing", "asn", "emails", "mx_check", "dcc", "url_redirector",
    "rspamd_update", "greylist", "ratelimit", "neural", "reputation", "history_redis", "replies",
    "spamtrap", "clickhouse", "elastic", "antivirus", "external_services", "p0f", "bimi", "dkim_signing",
    "metric_exporter",
)


def ensure_rspamd() -> None:
    """Debian's rspamd, installed when missing (the tests run as root, as CI does)."""
    if not Path(RSPAMD).exists():
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", "rspamd"], check=True, env=env, capture_output=True,
                       timeout=600)


class RspamdServer:
    """rspamd's normal worker on 127.0.0.1:`port` (its controller on another port), configured
    under `directory`; with `milter`, also its proxy worker as a milter on `milter_port` (for
    Postfix's smtpd_milters)."""

    def __init__(self, directory: Path, dns: str, milter: bool = False, workers: int = 1,
                 redis: str | None = None) -> None:
        self.dir = directory
        #: A Redis ("host:port") for the Bayes classifier's statistics: with it rspamd can learn.
        self.redis = redis
        self.workers = workers
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(free_port_on("127.0.0.1"))
        self.port, self.controller, self.milter_port = sorted(ports)
        self.milter = milter
        self.dns = dns
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def controller_url(self) -> str:
        return f"http://127.0.0.1:{self.controller}"

    def learned(self) -> int:
        """How many messages the Bayes classifier has learned, from the controller's /stat (with
        the Redis backend it does not say how many of each class)."""
        with urllib.request.urlopen(f"{self.controller_url}/stat", timeout=10) as answer:
            return int(json.loads(answer.read()).get("learned", 0))

    def configure(self) -> None:
        for sub in ("local.d", "override.d", "run", "db", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        override = self.dir / "override.d"
        (override / "worker-normal.inc").write_text(f'bind_socket = "127.0.0.1:{self.port}";\ncount = {self.workers};\n')
        (override / "worker-controller.inc").write_text(
            f'bind_socket = "127.0.0.1:{self.controller}";\ncount = 1;\nsecure_ip = "127.0.0.1";\n')
        if self.milter:
            (override / "worker-proxy.inc").write_text(
                f'bind_socket = "127.0.0.1:{self.milter_port}";\nmilter = yes;\ntimeout = 120s;\ncount = {self.workers};\n'
                f'upstream "local" {{\n  default = yes;\n  self_scan = no;\n  hosts = "127.0.0.1:{self.port}";\n}}\n')
        else:
            (override / "worker-proxy.inc").write_text("enabled = false;\n")
        (override / "logging.inc").write_text(f'type = "file";\nfilename = "{self.dir}/log/rspamd.log";\n'
                                              'level = "notice";\n')
        (self.dir / "local.d" / "options.inc").write_text(
            f'dns {{\n  nameserver = ["{self.dns}"];\n  timeout = 1s;\n  retransmits = 1;\n}}\n'
            "local_addrs = [];\n"  # mail from loopback is not "local": every rule applies
            # Compiled hyperscan databases (named by their content's hash) kept between runs:
            # compiling them takes rspamd's start from seconds to tens of seconds.
            f'hs_cache_dir = "{HS_CACHE}";\n'
        )
        HS_CACHE.mkdir(parents=True, exist_ok=True)
        for module in NETWORK_MODULES:
            (self.dir / "local.d" / f"{module}.conf").write_text("enabled = false;\n")
        if self.redis is not None:
            (self.dir / "local.d" / "redis.conf").write_text(f'servers = "{self.redis}";\n')
            (self.dir / "local.d" / "classifier-bayes.conf").write_text(
                f'backend = "redis";\nservers = "{self.redis}";\nautolearn = false;\nmin_learns = 1;\n')

    def start_process(self) -> RspamdServer:
        """Start rspamd without waiting for it (its rules take seconds to load): `wait` does."""
        ensure_rspamd()
        self.configure()
        variables = {"LOCAL_CONFDIR": self.dir, "RUNDIR": self.dir / "run", "DBDIR": self.dir / "db",
                     "LOGDIR": self.dir / "log"}
        command = [RSPAMD, "-f", "-i", "-c", str(PACKAGED), "-u", "root", "-g", "root",
                   *[f"--var={k}={v}" for k, v in variables.items()]]
        with open(self.dir / "log" / "stdout.log", "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        return self

    def wait(self, timeout: float = 60) -> RspamdServer:
        """Until the normal worker answers /ping."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rspamd exited with {self.process.returncode}:\n{self.log()}")
            if _ping(self.port):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"rspamd did not answer in {timeout} s:\n{self.log()}")

    def start(self, timeout: float = 60) -> RspamdServer:
        return self.start_process().wait(timeout)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log(self) -> str:
        parts = []
        for name in ("stdout.log", "rspamd.log"):
            path = self.dir / "log" / name
            if path.exists():
                parts.append(path.read_text(errors="replace")[-4000:])
        return "\n".join(parts)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _ping(port: int) -> bool:
    """rspamd's /ping answers "pong" once its workers are up."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"GET /ping HTTP/1.0\r\n\r\n")
            sock.settimeout(2)
            return b"pong" in sock.recv(4096)
    except OSError:
        return False


class RedisServer:
    """Debian's redis-server on 127.0.0.1, in memory only, for rspamd's statistics."""

    def __init__(self) -> None:
        self.port = free_port_on("127.0.0.1")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20) -> RedisServer:
        if not Path(REDIS).exists():
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, env=env,
                           capture_output=True, timeout=600)
        self.process = subprocess.Popen(
            [REDIS, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
