"""A real rspamd for the MX's spam filter tests and benchmark: Debian's package, started in the
foreground from the packaged configuration with a directory of our own for its overrides, run
files, database and log (no system service), listening on loopback only.

Its DNS is the test's own server, and the modules that ask the internet (RBLs, fuzzy hashes,
phishing feeds, ...) are off, so a verdict takes milliseconds and depends on nothing outside.
With `test_rules`, rspamd's every action can be had on demand: its own GTUBE variants (turned on
by `enable_test_patterns`) for "reject", "add header" and "rewrite subject", and a prefilter of
ours (`rspamd.local.lua`) that gives a message whose Subject holds `[rspamd-action: NAME]` the
action NAME ("greylist", "soft reject", ...).

`Breaker` sits between a client and rspamd and, when told, refuses connections or closes them
unanswered: the faults rspamd_failure is about.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
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

#: rspamd's own test strings (enable_test_patterns): the standard GTUBE gets "reject", these
#: "add header" and "rewrite subject" (rspamd >= 3.0).
GTUBE_TAIL = b"JS*C4JDBQADN1.NSBN3*2IDNEN*GTUBE-STANDARD-ANTI-UBE-TEST-EMAIL*C.34X"
GTUBE = b"X" + GTUBE_TAIL
GTUBE_ADD_HEADER = b"Y" + GTUBE_TAIL
GTUBE_REWRITE_SUBJECT = b"Z" + GTUBE_TAIL

#: The prefilter behind `[rspamd-action: NAME]` in a Subject.
TEST_ACTION_RULE = """\
rspamd_config:register_symbol({
  name = 'CASSMAIL_TEST_ACTION',
  type = 'prefilter',
  priority = 10,
  callback = function(task)
    local subject = task:get_subject()
    local action = subject and subject:match('%[rspamd%-action: ([%a ]+)%]')
    if action then
      task:set_pre_result(action, 'cassmail test rule: ' .. action, 'cassmail_test')
    end
  end,
})
"""


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
                 redis: str | None = None, test_rules: bool = False) -> None:
        self.dir = directory
        self.test_rules = test_rules
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
            + ("enable_test_patterns = true;\n" if self.test_rules else "")
        )
        rule = self.dir / "rspamd.local.lua"
        if self.test_rules:
            rule.write_text(TEST_ACTION_RULE)
        else:
            rule.unlink(missing_ok=True)
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


class Breaker:
    """A TCP relay on 127.0.0.1 to `upstream` (host, port), run in threads. `mode` says what a new
    connection gets: "pass" (relayed both ways), "close" (closed at once, unanswered) or
    "refuse" (the port stops listening: connection refused)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = free_port_on("127.0.0.1")
        self.mode = "pass"
        self._listener: socket.socket | None = None
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Breaker:
        self._listen()
        return self

    def set(self, mode: str) -> None:
        assert mode in ("pass", "close", "refuse"), mode
        with self._lock:
            self.mode = mode
            if mode == "refuse" and self._listener is not None:
                _unlisten(self._listener)
                self._listener = None
        if mode != "refuse" and self._listener is None:
            self._listen()

    def stop(self) -> None:
        self._stopped = True
        with self._lock:
            if self._listener is not None:
                _unlisten(self._listener)
                self._listener = None

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: refuse or stop
            if self.mode != "pass":
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _unlisten(listener: socket.socket) -> None:
    """Stop listening now: shutdown wakes the thread blocked in accept (close alone would leave
    the socket listening until that accept returned)."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
