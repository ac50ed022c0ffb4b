"""The mature baseline: private Postfix and Dovecot instances on loopback ports.

Both are Debian's packages, installed when missing with debconf's "No configuration" for
Postfix and with invoke-rc.d's policy denying service starts, so installing them sets up and
starts no system instance. Each instance lives in a temporary directory of its own
(`postfix -c DIR`, `dovecot -c DIR/dovecot.conf`): /etc/postfix and /etc/dovecot are never
written, and every process they start is stopped by `stop()`.

Postfix delivers a virtual domain to Maildirs under DIR/mail/<domain>/<user>/ and Dovecot
serves the same Maildirs over POP3 and IMAP, so mail sent with postal can be read with rabid:
the same pair of loads cassmail gets.
"""

from __future__ import annotations

import contextlib
import math
import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

from _common import PASSWORD, alive, descendants, free_port, greets, proc_stat, run_cmd, tree_cpu

#: Seconds the Postfix queue may take to empty after a run before its count is taken anyway.
QUEUE_DRAIN_MAX = 300.0
POLICY_RC = Path("/usr/sbin/policy-rc.d")


# --------------------------------------------------------------------------- packages


def missing_packages(postal: bool = True, postfix: bool = False, dovecot: bool = False) -> list[str]:
    wanted = []
    if postal and shutil.which("postal", path="/usr/sbin:/usr/bin") is None:
        wanted.append("postal")
    if postfix and not (Path("/usr/sbin/postfix").exists() and Path("/usr/sbin/postconf").exists()):
        wanted.append("postfix")
    if dovecot:
        if not Path("/usr/sbin/dovecot").exists():
            wanted.append("dovecot-core")
        if not Path("/usr/lib/dovecot/pop3").exists():
            wanted.append("dovecot-pop3d")
        if not Path("/usr/lib/dovecot/imap").exists():
            wanted.append("dovecot-imapd")
    return wanted


def ensure_packages(postal: bool = True, postfix: bool = False, dovecot: bool = False,
                    say=print) -> None:
    """Install the Debian packages that are missing, without any system mail service starting."""
    missing = missing_packages(postal, postfix, dovecot)
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"missing Debian packages {' '.join(missing)}: install them (needs root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if "postfix" in missing:
        # "No configuration": the package writes no main.cf and starts no instance on port 25.
        subprocess.run(["debconf-set-selections"], input="postfix postfix/main_mailer_type select No configuration\n",
                       text=True, check=False, timeout=60)
    # invoke-rc.d asks policy-rc.d whether a package may start its service: 101 = no. Only when no
    # policy is in place already, and removed again afterwards.
    own_policy = not POLICY_RC.exists()
    if own_policy:
        POLICY_RC.write_text("#!/bin/sh\n# written by cassmail's loadtest while it installs packages\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        say(f"installing {' '.join(missing)} (apt-get install -y)")
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
        if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
            run_cmd(["apt-get", "update", "-q"], timeout=600, env=env)
            run_cmd(cmd, timeout=600, env=env)
    finally:
        if own_policy:
            POLICY_RC.unlink(missing_ok=True)


# --------------------------------------------------------------------------- Postfix


class PrivateServer:
    """A daemon started with a config of its own: its master's pid file, its CPU, a clean stop."""

    started = False

    def pid_file(self) -> Path:
        raise NotImplementedError

    def stop_commands(self) -> tuple[list[str], list[str]]:
        """(the polite stop, the forceful one)."""
        raise NotImplementedError

    def master_pid(self) -> int | None:
        try:
            pid = int(self.pid_file().read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if proc_stat(pid) is not None else None

    def cpu(self) -> float | None:
        """CPU seconds of the master and everything it forked (and reaped)."""
        return tree_cpu(self.master_pid())

    def stop(self, timeout: float = 30) -> str:
        """The polite stop, then (after `timeout`) the forceful one, then SIGKILL to what is left."""
        if not self.started:
            return "not started"
        master = self.master_pid()
        if master is None:
            return "not running"
        procs = [master, *descendants(master)]
        polite, forceful = self.stop_commands()
        subprocess.run(polite, capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(alive(p) for p in procs):
            time.sleep(0.2)
        left = [p for p in procs if alive(p)]
        self.started = False
        if not left:
            return "stopped"
        subprocess.run(forceful, capture_output=True, timeout=60)
        time.sleep(1)
        for pid in left:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return f"aborted ({len(left)} processes did not stop in {timeout:g} s)"


class Postfix(PrivateServer):
    """A Postfix instance of its own (`postfix -c DIR`): /etc/postfix is never read or written."""

    def __init__(self, workdir: Path, domain: str, users: list[str]) -> None:
        self.dir = workdir / "postfix"
        self.queue = self.dir / "queue"
        self.mail = self.dir / "mail"
        self.port = free_port()
        self.domain = domain
        self.users = users
        self.changes: list[str] = []
        self.started = False

    def postconf(self, *args: str) -> None:
        cmd = ["postconf", "-c", str(self.dir), *args]
        run_cmd(cmd)
        head = [a for a in cmd if a.startswith("-") or a in ("postconf", str(self.dir))]
        self.changes.append(" ".join(head))
        self.changes += [f"    {a!r}" for a in cmd[len(head):]]

    def configure(self) -> None:
        for d in (self.dir, self.queue, self.dir / "data", self.mail):
            d.mkdir(parents=True, exist_ok=True)
        # virtual(8) delivers as nobody (a static uid), Postfix runs as the postfix user: both need
        # to get through the temporary directory.
        os.chmod(self.dir.parent, 0o755)
        os.chmod(self.dir, 0o755)
        os.chown(self.mail, 65534, 65534)
        pw = pwd.getpwnam("postfix")
        os.chown(self.dir / "data", pw.pw_uid, pw.pw_gid)  # master refuses to start otherwise
        shutil.copy("/etc/postfix/master.cf", self.dir / "master.cf")
        (self.dir / "main.cf").write_text("")
        (self.dir / "vmailbox").write_text(
            "".join(f"{u} {self.domain}/{u.split('@', 1)[0]}/\n" for u in self.users)  # trailing / = Maildir
        )
        self.postconf(
            "-e",
            "compatibility_level = 3.6",
            f"queue_directory = {self.queue}",
            f"data_directory = {self.dir / 'data'}",
            "myhostname = bench-postfix.localhost",
            "inet_interfaces = loopback-only",
            "inet_protocols = ipv4",
            "mynetworks = 127.0.0.0/8",
            "mydestination =",
            "relay_domains =",
            "relayhost =",
            "local_recipient_maps =",
            "alias_maps =",
            "alias_database =",
            f"virtual_mailbox_domains = {self.domain}",
            f"virtual_mailbox_maps = texthash:{self.dir / 'vmailbox'}",
            f"virtual_mailbox_base = {self.mail}",
            "virtual_uid_maps = static:65534",
            "virtual_gid_maps = static:65534",
            "virtual_mailbox_limit = 0",
            "message_size_limit = 67108864",
            "smtp_host_lookup = native",
            "disable_dns_lookups = yes",
            "smtpd_peername_lookup = no",
            "header_checks =",
            "body_checks =",
            "mime_header_checks =",
            "nested_header_checks =",
            "smtpd_client_restrictions =",
            "smtpd_helo_restrictions =",
            "smtpd_sender_restrictions =",
            "smtpd_relay_restrictions = permit_mynetworks, reject_unauth_destination",
            "smtpd_recipient_restrictions =",
            "smtpd_tls_security_level = none",
            "smtp_tls_security_level = none",
            "biff = no",
        )
        # master.cf: no smtpd on port 25, one on our port, no chroot (the queue is in a temp dir).
        self.postconf("-MX", "smtp/inet")
        self.postconf("-M", f"127.0.0.1:{self.port}/inet = 127.0.0.1:{self.port} inet n - n - - smtpd")
        self.postconf("-F", "*/*/chroot = n")
        run_cmd(["postfix", "-c", str(self.dir), "check"])

    def start(self, timeout: float = 60) -> None:
        try:
            run_cmd(["postfix", "-c", str(self.dir), "start"])
        except RuntimeError:
            # Postfix logs to syslog, which may not exist here: once more with a log file, to say why.
            run_cmd(["postconf", "-c", str(self.dir), "-e", f"maillog_file = {self.dir / 'maillog'}"])
            out = subprocess.run(["postfix", "-c", str(self.dir), "start"], capture_output=True, text=True,
                                 timeout=120)
            if out.returncode == 0:
                subprocess.run(["postfix", "-c", str(self.dir), "stop"], capture_output=True, timeout=60)
            raise RuntimeError(f"postfix -c {self.dir} start failed:\n{out.stdout}{out.stderr}") from None
        self.started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.master_pid() and greets(self.port):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Postfix did not answer on 127.0.0.1:{self.port} in {timeout:g} s")

    def pid_file(self) -> Path:
        return self.queue / "pid" / "master.pid"

    def stop_commands(self) -> tuple[list[str], list[str]]:
        return ["postfix", "-c", str(self.dir), "stop"], ["postfix", "-c", str(self.dir), "abort"]

    def queued(self) -> int:
        n = 0
        for sub in ("maildrop", "incoming", "active", "deferred", "hold"):
            for _, _, files in os.walk(self.queue / sub):
                n += len(files)
        return n

    def delivered(self) -> tuple[int, int]:
        """(messages, bytes) in the Maildirs (new/ and cur/)."""
        return maildir_count(self.mail)

    def wait_queue_empty(self, limit: float = QUEUE_DRAIN_MAX) -> tuple[float, int]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            if self.queued() == 0:
                break
            time.sleep(0.5)
        return time.monotonic() - t0, self.queued()

# --------------------------------------------------------------------------- Dovecot


class Dovecot(PrivateServer):
    """A Dovecot instance of its own (`dovecot -c DIR/dovecot.conf`) serving POP3 and IMAP on
    loopback ports from the Maildirs Postfix delivers to; /etc/dovecot is never read or written.

    Users and passwords come from a passwd-file in the instance's directory: `password` in clear
    (Dovecot's {PLAIN}) unless `hashes` gives a user a stored hash of its own ("{SCHEME}..."), so
    logins can be measured with a slow hash too. Mail is read and written as `uid` (nobody, the
    owner Postfix's virtual delivery gives the Maildirs).
    """

    def __init__(self, workdir: Path, mail: Path, users: list[str], password: str, uid: int = 65534,
                 hashes: dict[str, str] | None = None) -> None:
        self.dir = workdir / "dovecot"
        self.mail = mail
        self.users = users
        self.password = password
        self.hashes = hashes or {}
        self.uid = uid
        self.pop3_port = free_port()
        self.imap_port = free_port()
        self.conf = self.dir / "dovecot.conf"
        self.started = False

    def configure(self) -> None:
        for d in (self.dir, self.dir / "run", self.dir / "state", self.mail):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        os.chown(self.mail, self.uid, self.uid)
        plain = "{PLAIN}" + self.password
        (self.dir / "passwd").write_text("".join(f"{u}:{self.hashes.get(u, plain)}\n" for u in self.users))
        mail = self.mail
        self.conf.write_text(f"""# A private Dovecot for cassmail's load tests; nothing here is read from /etc/dovecot.
base_dir = {self.dir / 'run'}
state_dir = {self.dir / 'state'}
instance_name = cassmail-loadtest-{self.pop3_port}
log_path = {self.dir / 'dovecot.log'}
protocols = pop3 imap
listen = 127.0.0.1
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
default_internal_user = dovecot
default_login_user = dovenull
first_valid_uid = 1
mail_location = maildir:{mail}/%d/%n
mail_uid = {self.uid}
mail_gid = {self.uid}
pop3_uidl_format = %08Xu%08Xv
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {self.dir / 'passwd'}
}}
userdb {{
  driver = static
  args = uid={self.uid} gid={self.uid} home={mail}/%d/%n
}}
service pop3-login {{
  inet_listener pop3 {{
    address = 127.0.0.1
    port = {self.pop3_port}
  }}
  inet_listener pop3s {{
    port = 0
  }}
  process_limit = 1000
}}
service imap-login {{
  inet_listener imap {{
    address = 127.0.0.1
    port = {self.imap_port}
  }}
  inet_listener imaps {{
    port = 0
  }}
  process_limit = 1000
}}
service pop3 {{
  process_limit = 1000
}}
service anvil {{
  client_limit = 2500
}}
service auth {{
  client_limit = 2500
}}
service imap {{
  process_limit = 1000
}}
""")
        run_cmd(["doveconf", "-c", str(self.conf), "-n"])  # a bad setting fails here, with its line

    def start(self, timeout: float = 60) -> None:
        # Its daemons would hold a captured stdout open (and run() wait for them): a log file instead.
        with open(self.dir / "start.log", "ab") as out:
            subprocess.run(["dovecot", "-c", str(self.conf)], stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, check=True, timeout=60)
        self.started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.master_pid() and greets(self.pop3_port) and greets(self.imap_port):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Dovecot did not answer on 127.0.0.1:{self.pop3_port} in {timeout:g} s: "
                           f"{self.log_text()[-1000:]}")

    def version(self) -> str:
        return run_cmd(["dovecot", "--version"], check=False).strip()

    def pid_file(self) -> Path:
        return self.dir / "run" / "master.pid"

    def stop_commands(self) -> tuple[list[str], list[str]]:
        return ["doveadm", "-c", str(self.conf), "stop"], ["doveadm", "-c", str(self.conf), "stop"]

    def log_text(self) -> str:
        try:
            return (self.dir / "dovecot.log").read_text(errors="replace")
        except OSError:
            return ""


def maildir_count(base: Path) -> tuple[int, int]:
    """(messages, bytes) in every Maildir under base/<domain>/<user>/ (new/ and cur/)."""
    n = size = 0
    if not base.is_dir():
        return 0, 0
    for domain in os.scandir(base):
        if not domain.is_dir():
            continue
        for user in os.scandir(domain.path):
            for sub in ("new", "cur"):
                try:
                    for entry in os.scandir(os.path.join(user.path, sub)):
                        n += 1
                        size += entry.stat().st_size
                except FileNotFoundError:
                    continue
    return n, size


# --------------------------------------------------------------------------- Dovecot's password schemes


def _doveadm_seconds(stored: str, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        run_cmd(["doveadm", "-O", "pw", "-t", stored, "-p", PASSWORD], timeout=60)
        best = min(best, time.perf_counter() - t0)
    return best


def dovecot_verify_ms(stored: str, repeat: int = 5) -> float:
    """Dovecot's own check of a right password (`doveadm pw -t`), less the same for {PLAIN}:
    the fastest of `repeat` runs each, so process start-up cancels out."""
    if stored.startswith("{PLAIN}"):
        return 0.0
    return max(0.0, _doveadm_seconds(stored, repeat) - _doveadm_seconds("{PLAIN}" + PASSWORD, repeat)) * 1000


def dovecot_hash(scheme: str, cost: int | None) -> str:
    cmd = ["doveadm", "-O", "pw", "-s", scheme, "-p", PASSWORD] + (["-r", str(cost)] if cost else [])
    return run_cmd(cmd, timeout=120).strip()


def choose_dovecot_hash(spec: str, scrypt_ms: float) -> tuple[str, str, float]:
    """(stored hash, label, verification ms) of Dovecot's slow scheme. "auto": BLF-CRYPT, the one
    slow scheme whose cost doveadm sets freely (in powers of two), at the cost nearest scrypt's time;
    this Dovecot has no scrypt, and doveadm makes ARGON2ID hashes of 64 MiB or more (scrypt's
    default: 16 MiB)."""
    if spec == "auto":
        # Costs around the estimate from cost 8 (each step doubles the time), the nearest one measured.
        probe = dovecot_verify_ms(dovecot_hash("BLF-CRYPT", 8))
        guess = 8 + round(math.log2(scrypt_ms / probe)) if probe > 0 and scrypt_ms > 0 else 10
        timed = {c: dovecot_verify_ms(dovecot_hash("BLF-CRYPT", c)) for c in range(max(4, guess - 1), min(guess + 1, 16) + 1)}
        scheme = "BLF-CRYPT"
        cost = min(timed, key=lambda c: abs(math.log(max(timed[c], 1e-3) / max(scrypt_ms, 1e-3))))
    else:
        scheme, _, cost_text = spec.partition(":")
        scheme = scheme.upper()
        cost = int(cost_text) if cost_text.strip().isdigit() else None
    stored = dovecot_hash(scheme, cost)
    parts = stored.split("$")
    if scheme == "BLF-CRYPT" and len(parts) > 2:
        label = f"{{BLF-CRYPT}} cost {int(parts[2])}"
    elif scheme.startswith("ARGON2") and len(parts) > 3:
        label = f"{{{scheme}}} {parts[3]}"
    else:
        label = f"{{{scheme}}} rounds {cost or 'default'}"
    return stored, label, dovecot_verify_ms(stored)
