"""Locust users for cassmail (or any mail server): SMTP senders, POP3 and IMAP readers.

    CASSMAIL_SMTP=127.0.0.1:2525 CASSMAIL_POP3=127.0.0.1:1110 CASSMAIL_CONFIG=node.toml \\
        .venv/bin/locust -f loadtest/locustfile.py --headless -u 20 -r 10 -t 2m --csv results/locust

Targets come from the environment, each host:port on 127.0.0.0/8; a user class whose target is
absent does not run:
- `CASSMAIL_SMTP`: `SmtpUser` connects, sends 1..CASSMAIL_LOADTEST_PER_CONNECTION messages (one
  local recipient each) and quits; requests "connect" and "send".
- `CASSMAIL_POP3`: `Pop3User` logs in (USER/PASS), LISTs, RETRs and DELEs up to
  CASSMAIL_LOADTEST_FETCH messages and QUITs (the deletions happen there); one request each.
- `CASSMAIL_IMAP`: `ImapUser` logs in, SELECTs INBOX, FETCHes up to CASSMAIL_LOADTEST_FETCH
  unseen messages, IDLEs for CASSMAIL_LOADTEST_IDLE seconds when the server offers IDLE, and
  logs out; one request each.
Every request goes to locust's own statistics (response time, bytes, failures), so `--csv`
writes them and loadtest/report.py plots them.

Who logs in and who receives mail:
- `CASSMAIL_LOADTEST_USERS=FILE`: "address password" per line (what `cassmail user import` reads);
- else `CASSMAIL_CONFIG` (the node's settings): with `CASSMAIL_LOADTEST_DOMAIN` the users of that
  domain are listed from the store (password CASSMAIL_LOADTEST_PASSWORD, default "pw");
  without it CASSMAIL_LOADTEST_NUSERS users (default 50) are created in a fresh domain when
  locust starts (before --run-time counts) and removed when the test stops. The store is
  reached through loadtest/postal.py in a process of its own, so the Cassandra driver never
  runs under locust's gevent.

Profiles (`CASSMAIL_LOADTEST_PROFILE`), the mixes of the two systems cassmail follows:
- `write-intensive` (CassMail's Postal runs): SMTP only, 50K-500K;
- `wheemail` (WheelFS's Wheemail): 90% SMTP and 10% IMAP sessions, messages 1K-12.8K (6.9 KB mean);
- `mixed` (default): every class whose target is set, equal weights, 50K-500K.
`CASSMAIL_LOADTEST_SIZES=LO-HI` (e.g. 200K-2M) overrides the profile's sizes: each message's
size is drawn uniformly from the range.
"""

from __future__ import annotations

import base64
import imaplib
import os
import poplib
import random
import select
import smtplib
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from locust import User, constant, events, task
from locust.runners import WorkerRunner

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import parse_range  # noqa: E402


@dataclass(frozen=True)
class Profile:
    weights: dict[str, int]
    sizes: str
    why: str


PROFILES = {
    "write-intensive": Profile({"smtp": 1}, "50K-500K", "CassMail's write-intensive Postal load: SMTP only"),
    "wheemail": Profile({"smtp": 9, "imap": 1}, "1K-12.8K", "WheelFS's Wheemail: 90% SMTP / 10% IMAP, 6.9 KB mean"),
    "mixed": Profile({"smtp": 1, "pop3": 1, "imap": 1}, "50K-500K", "every protocol whose target is set"),
}


def _target(name: str) -> tuple[str, int] | None:
    value = os.environ.get(f"CASSMAIL_{name.upper()}", "").strip()
    if not value:
        return None
    host, _, port = value.rpartition(":")
    if not (host.startswith("127.") or host == "localhost") or not port.isdigit():
        raise SystemExit(f"CASSMAIL_{name.upper()}={value}: must be 127.x.x.x:PORT (load stays on loopback)")
    return host, int(port)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise SystemExit(f"{name} must be an integer") from None


PROFILE_NAME = os.environ.get("CASSMAIL_LOADTEST_PROFILE", "mixed")
if PROFILE_NAME not in PROFILES:
    raise SystemExit(f"CASSMAIL_LOADTEST_PROFILE={PROFILE_NAME}: one of {', '.join(PROFILES)}")
PROFILE = PROFILES[PROFILE_NAME]
TARGETS = {name: _target(name) for name in ("smtp", "pop3", "imap")}
SIZES = parse_range(os.environ.get("CASSMAIL_LOADTEST_SIZES") or PROFILE.sizes)
PER_CONNECTION = max(1, _env_int("CASSMAIL_LOADTEST_PER_CONNECTION", 10))
FETCH = max(1, _env_int("CASSMAIL_LOADTEST_FETCH", 5))
IDLE_SECONDS = float(os.environ.get("CASSMAIL_LOADTEST_IDLE", "1"))
TIMEOUT = float(os.environ.get("CASSMAIL_LOADTEST_TIMEOUT", "60"))
SENDER = "loadtest@locust.example.org"


# --------------------------------------------------------------------------- the user population


class Population:
    """The accounts the users log in as and send to: from a file, or listed or created in the store."""

    def __init__(self) -> None:
        self.accounts: list[tuple[str, str]] = []
        self.created_domain: str | None = None

    def load(self) -> None:
        path = os.environ.get("CASSMAIL_LOADTEST_USERS")
        password = os.environ.get("CASSMAIL_LOADTEST_PASSWORD", "pw")
        if path:
            for line in Path(path).read_text().splitlines():
                parts = line.split()
                if parts:
                    self.accounts.append((parts[0], parts[1] if len(parts) > 1 else password))
        elif os.environ.get("CASSMAIL_CONFIG"):
            domain = os.environ.get("CASSMAIL_LOADTEST_DOMAIN")
            if domain:
                users = _store_helper("--list-users", domain)
            else:
                domain = f"locust-{os.getpid()}-{int(time.time())}.example"
                users = _store_helper("--create-users", domain, "--users", str(_env_int("CASSMAIL_LOADTEST_NUSERS", 50)))
                self.created_domain = domain
            self.accounts = [(u, password) for u in users]
        else:
            raise SystemExit("set CASSMAIL_LOADTEST_USERS (a users file) or CASSMAIL_CONFIG (the node's settings)")
        if not self.accounts:
            raise SystemExit("no users to load-test with")

    def remove_created(self) -> None:
        if self.created_domain:
            _store_helper("--remove-users", self.created_domain)
            self.created_domain = None

    def pick(self) -> tuple[str, str]:
        return random.choice(self.accounts)


def _store_helper(*args: str) -> list[str]:
    """Run loadtest/postal.py's user commands against $CASSMAIL_CONFIG; its stdout lists addresses."""
    cmd = [sys.executable, str(HERE / "postal.py"), "--config", os.environ["CASSMAIL_CONFIG"], *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
    return [ln.strip() for ln in out.stdout.splitlines() if "@" in ln]


POPULATION = Population()


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    """Find or create the users before the clock of --run-time starts."""
    if isinstance(environment.runner, WorkerRunner) and not os.environ.get("CASSMAIL_LOADTEST_USERS") \
            and not os.environ.get("CASSMAIL_LOADTEST_DOMAIN"):
        raise SystemExit("distributed runs need CASSMAIL_LOADTEST_USERS or CASSMAIL_LOADTEST_DOMAIN")
    if not POPULATION.accounts:
        POPULATION.load()


@events.test_stop.add_listener
def _on_stop(environment, **_kw) -> None:
    POPULATION.remove_created()


# --------------------------------------------------------------------------- messages


class Bodies:
    """Message bytes cut from one pool of base64 text: making a message costs nothing in the loop."""

    def __init__(self, largest: int) -> None:
        raw = random.randbytes(largest * 3 // 4 + 4096)
        self.pool = base64.encodebytes(raw).replace(b"\n", b"\r\n")

    def make(self, to: str) -> bytes:
        size = random.randint(*SIZES)
        head = (f"From: Locust <{SENDER}>\r\nTo: <{to}>\r\nSubject: load test {random.getrandbits(32):08x}\r\n"
                f"Message-ID: <{time.time_ns()}.{random.getrandbits(32):x}@locust.example.org>\r\n"
                "MIME-Version: 1.0\r\nContent-Type: text/plain\r\n\r\n").encode()
        body_len = max(0, size - len(head) - 2)
        start = random.randrange(0, max(1, len(self.pool) - body_len - 2))
        start -= start % 78  # whole 76-character lines
        body = self.pool[start : start + body_len].rstrip(b"\r")
        return head + body + b"\r\n"


BODIES = Bodies(SIZES[1])


# --------------------------------------------------------------------------- users


class MailUser(User):
    """A client that works as fast as the server answers (like postal and rabid: no think time)."""

    abstract = True
    wait_time = constant(0)
    protocol = ""

    @contextmanager
    def request(self, name: str):
        """Time the block as one locust request; `box[0]` may be set to the bytes moved.
        A failure is reported and ends the session (raised again as _SessionOver)."""
        box = [0]
        t0 = time.perf_counter()
        exc: BaseException | None = None
        try:
            yield box
        except (OSError, EOFError, smtplib.SMTPException, poplib.error_proto, imaplib.IMAP4.error, ValueError) as e:
            exc = e
        self.environment.events.request.fire(
            request_type=self.protocol, name=name, response_time=(time.perf_counter() - t0) * 1000,
            response_length=box[0], exception=exc, context={},
        )
        if exc is not None:
            raise _SessionOver from exc

    @contextmanager
    def connection(self):
        """One session: a failed request ends it quietly (locust has it already), and a connection
        left open is closed."""
        s = _Session()
        try:
            yield s
        except _SessionOver:
            pass
        finally:
            if s.client is not None:
                with suppress(OSError):
                    # smtplib and poplib close(); imaplib shutdown()
                    (s.client.shutdown if isinstance(s.client, imaplib.IMAP4) else s.client.close)()


class _SessionOver(Exception):
    """A request failed: it was reported, the session is dropped and the next one starts."""


class _Session:
    """The connection of one session: closed at the end unless a clean QUIT/LOGOUT cleared it."""

    def __init__(self) -> None:
        self.client = None


class SmtpUser(MailUser):
    protocol = "SMTP"
    abstract = TARGETS["smtp"] is None or "smtp" not in PROFILE.weights
    weight = PROFILE.weights.get("smtp", 1)

    @task
    def session(self) -> None:
        host, port = TARGETS["smtp"]
        with self.connection() as s:
            with self.request("connect"):
                s.client = smtplib.SMTP(host, port, local_hostname="locust.localhost", timeout=TIMEOUT)
                s.client.ehlo()
            for _ in range(random.randint(1, PER_CONNECTION)):
                to, _pw = POPULATION.pick()
                message = BODIES.make(to)
                with self.request("send") as box:
                    refused = s.client.sendmail(SENDER, [to], message)
                    if refused:
                        raise smtplib.SMTPRecipientsRefused(refused)
                    box[0] = len(message)
            with self.request("quit"):
                s.client.quit()
                s.client = None


class Pop3User(MailUser):
    protocol = "POP3"
    abstract = TARGETS["pop3"] is None or "pop3" not in PROFILE.weights
    weight = PROFILE.weights.get("pop3", 1)

    @task
    def session(self) -> None:
        host, port = TARGETS["pop3"]
        user, password = POPULATION.pick()
        with self.connection() as s:
            with self.request("login"):
                s.client = poplib.POP3(host, port, timeout=TIMEOUT)
                s.client.user(user)
                s.client.pass_(password)
            with self.request("list") as box:
                _resp, listing, octets = s.client.list()
                box[0] = octets
            for n in [int(line.split()[0]) for line in listing][:FETCH]:
                with self.request("retr") as box:
                    _resp, _lines, octets = s.client.retr(n)
                    box[0] = octets
                with self.request("dele"):
                    s.client.dele(n)
            with self.request("quit"):
                s.client.quit()
                s.client = None


class ImapUser(MailUser):
    protocol = "IMAP"
    abstract = TARGETS["imap"] is None or "imap" not in PROFILE.weights
    weight = PROFILE.weights.get("imap", 1)

    @task
    def session(self) -> None:
        host, port = TARGETS["imap"]
        user, password = POPULATION.pick()
        with self.connection() as s:
            with self.request("login"):
                s.client = imaplib.IMAP4(host, port, timeout=TIMEOUT)
                s.client.login(user, password)
            with self.request("select"):
                _check(s.client.select("INBOX"))
            with self.request("search"):
                found = _check(s.client.search(None, "UNSEEN"))
            for n in (found[0].split()[:FETCH] if found and found[0] else []):
                with self.request("fetch") as box:
                    data = _check(s.client.fetch(n, "(RFC822)"))
                    box[0] = sum(len(part[1]) for part in data if isinstance(part, tuple))
            if IDLE_SECONDS > 0 and "IDLE" in s.client.capabilities:
                with self.request("idle"):
                    idle(s.client, IDLE_SECONDS)
            with self.request("logout"):
                s.client.logout()
                s.client = None


def _check(answer: tuple[str, list]) -> list:
    status, data = answer
    if status != "OK":
        raise imaplib.IMAP4.error(f"{status} {data!r}")
    return data


def idle(client: imaplib.IMAP4, seconds: float) -> None:
    """IDLE (RFC 2177) for `seconds`, then DONE; imaplib before Python 3.14 has no IDLE of its own.
    Untagged updates that arrive meanwhile are read and dropped."""
    tag = client._new_tag().decode()  # noqa: SLF001 - imaplib's own tag sequence, so later commands stay in step
    client.send(f"{tag} IDLE\r\n".encode())
    line = client.readline()
    if not line.startswith(b"+"):
        raise imaplib.IMAP4.error(f"IDLE refused: {line!r}")
    # Wait with select, never with a socket timeout: a timed-out read leaves imaplib's buffered
    # file unusable. Lines already buffered are read after DONE, with the rest.
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([client.socket()], [], [], left)
        if ready and not client.readline():
            raise EOFError("server closed the connection during IDLE")
    client.send(b"DONE\r\n")
    while True:
        line = client.readline()
        if not line:
            raise EOFError("server closed the connection after DONE")
        if line.startswith(tag.encode() + b" "):
            if not line.split()[1:2] == [b"OK"]:
                raise imaplib.IMAP4.error(f"IDLE ended with {line!r}")
            return
