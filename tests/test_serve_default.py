"""`cassmail serve` with no configuration at all: the embedded mbox store under ./var/mail.

A new user's first run, as a real process: no config file, no $CASSMAIL_CONFIG, no
Cassandra, only the listen ports moved to free ones and plaintext login allowed (there is no
certificate). The domain and the user are made with the CLI in the same directory while the
server runs; mail goes in by SMTP and comes out by POP3, and the mbox file is where the
default says.
"""

from __future__ import annotations

import mailbox
import os
import poplib
import signal
import smtplib
import subprocess
import time
from pathlib import Path

from tests.nodes import CASSMAIL, _accepts, free_port

LISTENERS = ("smtp", "submission", "pop3", "imap")
MESSAGE = b"From: someone@remote.test\r\nTo: anne@example.org\r\nSubject: first light\r\n\r\nHello from the default store.\r\n"


def cli(directory: Path, env: dict[str, str], *args: str, stdin: str = "") -> str:
    done = subprocess.run([CASSMAIL, *args], cwd=directory, env=env, input=stdin.encode(), capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def test_serve_with_no_configuration_keeps_mail_in_mbox_files_under_var_mail(tmp_path: Path) -> None:
    # Nothing of the developer's environment: no CASSMAIL_* settings, no local cluster's config.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
    env["CASSMAIL_CLUSTER"] = "off"
    ports = {name: free_port() for name in LISTENERS}
    env.update({f"CASSMAIL_{name.upper()}_LISTEN": f"127.0.0.1:{port}" for name, port in ports.items()})
    env["CASSMAIL_POP3_ALLOW_PLAINTEXT_AUTH"] = "true"
    assert not list(tmp_path.iterdir())

    log = tmp_path.parent / f"{tmp_path.name}-serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([CASSMAIL, "serve"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (all(_accepts(p) for p in ports.values()) and "worker-ready" in log.read_text()):
            assert server.poll() is None, f"cassmail serve exited with {server.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"cassmail serve did not come up:\n{log.read_text()}"
            time.sleep(0.1)
        assert "backend=mbox" in log.read_text()

        # The administrator's first steps, in the same directory, while the server runs.
        assert "example.org" in cli(tmp_path, env, "domain", "add", "example.org") + cli(tmp_path, env, "domain", "list")
        assert "created anne@example.org" in cli(tmp_path, env, "user", "add", "anne@example.org", "--password-stdin",
                                                  stdin="s3cret\n")

        with smtplib.SMTP("127.0.0.1", ports["smtp"], timeout=30) as client:
            assert client.sendmail("someone@remote.test", ["anne@example.org"], MESSAGE) == {}

        session = poplib.POP3("127.0.0.1", ports["pop3"], timeout=30)
        session.user("anne@example.org")
        session.pass_("s3cret")
        count, _ = session.stat()
        assert count == 1
        lines = session.retr(1)[1]
        session.quit()
        assert b"Subject: first light" in lines and b"Hello from the default store." in lines
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(30)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()

    # The mail is in an mbox file under ./var/mail that other mbox tools read.
    data = tmp_path / "var" / "mail"
    boxes = [p for p in data.rglob("mbox") if p.is_file() and p.stat().st_size]
    assert len(boxes) == 1, sorted(str(p.relative_to(tmp_path)) for p in data.rglob("*"))
    [path] = boxes
    assert "anne@example.org" in str(path.relative_to(data)) and path.parent.name == "INBOX"
    box = mailbox.mbox(str(path), create=False)
    try:
        [message] = list(box)
        assert message["Subject"] == "first light"
        assert "Hello from the default store." in message.get_payload()
    finally:
        box.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["var"]  # nothing written anywhere else
