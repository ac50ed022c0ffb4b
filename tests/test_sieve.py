"""Sieve at delivery and ManageSieve, as users see them: a real `cassmail serve` on the mbox store and on
Cassandra, mail sent with smtplib, read back with imaplib, scripts edited with sievelib's ManageSieve
client and with Thunderbird's command sequence on a raw socket."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import email
import imaplib
import smtplib
import socket
import ssl
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sievelib.managesieve import Client

from cassmail.store import make_store
from cassmail.config import to_toml
from cassmail.store.base import SieveScriptInfo, Store
from tests.conftest import FAST_HASH, backend_settings_for, hash_password
from tests.nodes import Node, node_settings

pytestmark = pytest.mark.cassandra

REMOTE = "remote.example"


@pytest.fixture(scope="module")
def sieve_tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A certificate for 127.0.0.1 that clients verify (sievelib checks the name and the chain)."""
    directory = tmp_path_factory.mktemp("sieve-tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-days", "2",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return {"tls_cert": str(cert), "tls_key": str(key)}


@pytest.fixture(scope="module", params=["mbox", "cassandra"])
def sieve_settings(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return backend_settings_for(request.param, request)


@pytest.fixture(scope="module")
async def sstore(sieve_settings) -> AsyncIterator[Store]:  # type: ignore[no-untyped-def]
    opened = make_store(sieve_settings)
    await opened.open()
    yield opened
    await opened.close()


@pytest.fixture(scope="module")
def snode(sieve_settings, sieve_tls: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:  # type: ignore[no-untyped-def]
    running = Node(
        node_settings(sieve_settings), tmp_path_factory.mktemp("sieve-node"),
        smtp={}, lmtp={"enabled": True}, imap={"allow_plaintext_auth": True},
        submission={"allow_plaintext_auth": True},
        managesieve={"enabled": True, "auth_failure_delay": 0.2, **sieve_tls},
    ).start()
    yield running
    assert running.stop() == 0
    assert running.own_tracebacks() == []


@pytest.fixture
async def people(sstore: Store) -> dict[str, str]:
    domain = f"s{uuid.uuid4().hex[:10]}.example"
    await sstore.add_domain(domain)
    out = {}
    for name in ("anne", "bob"):
        out[name] = f"{name}@{domain}"
        await sstore.create_user(out[name], hash_password(name, FAST_HASH))
    return out


async def activate(store: Store, user: str, text: str, name: str = "rules") -> None:
    await store.put_sieve_script(user, name, text)
    await store.set_active_sieve_script(user, name)


def send(node: Node, sender: str, rcpts: list[str], message: str, port: str = "smtp") -> dict:
    with smtplib.SMTP("127.0.0.1", node.port(port), timeout=30) as client:
        return client.sendmail(sender, rcpts, message.encode())


def mail(sender: str, to: str, subject: str, body: str = "Hello\r\n", extra: str = "") -> str:
    return (f"From: {sender}\r\nTo: {to}\r\nSubject: {subject}\r\nMessage-ID: <{uuid.uuid4().hex}@x>\r\n"
            f"Date: Tue, 24 Nov 2026 10:00:00 +0000\r\n{extra}\r\n{body}")


def imap_view(node: Node, user: str) -> dict[str, list[tuple[str, bytes]]]:
    """Mailbox -> (flags, subject) of each message, over IMAP."""
    client = imaplib.IMAP4("127.0.0.1", node.port("imap"), timeout=30)
    client.login(user, user.split("@")[0])
    out: dict[str, list[tuple[str, bytes]]] = {}
    _, boxes = client.list()
    for line in boxes:
        if b"\\Noselect" in line or b"\\NonExistent" in line:
            continue
        name = line.decode().rsplit(' "/" ', 1)[1].strip('"')
        typ, data = client.select(f'"{name}"', readonly=True)
        assert typ == "OK"
        if int(data[0]) == 0:
            continue
        _, fetched = client.fetch("1:*", "(FLAGS BODY.PEEK[HEADER.FIELDS (SUBJECT)])")
        out[name] = [(part[0].decode(), part[1].strip()) for part in fetched if isinstance(part, tuple)]
    client.logout()
    return out


async def queued_to(store: Store, address: str) -> list:
    return [e for e in await store.list_queue() if any(r.address == address for r in e.recipients)]


# ----------------------------------------------------------------------------- delivery


async def test_scripts_file_flag_and_keep_as_read_over_imap(snode: Node, sstore: Store, people: dict[str, str]) -> None:
    anne = people["anne"]
    await activate(sstore, anne, r'''require ["fileinto", "mailbox", "imap4flags", "variables", "envelope",
        "subaddress", "relational", "comparator-i;ascii-numeric", "regex"];
if header :matches "subject" "*[list-*]*" { fileinto :create "Lists/${2}"; stop; }
if envelope :detail "to" "shop" { fileinto :flags "\\Flagged" "Junk"; stop; }
if header :value "ge" :comparator "i;ascii-numeric" "x-score" "5" { discard; stop; }
if header :regex "subject" "^urgent: (.+)$" { addflag "\\Flagged"; addflag "$work"; }
''')
    send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "news [list-dev] today"))
    local, domain = anne.split("@")
    send(snode, f"x@{REMOTE}", [f"{local}+shop@{domain}"], mail(f"x@{REMOTE}", anne, "your order"))
    send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "spam", extra="X-Score: 7\r\n"))
    send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "urgent: the roof"))
    send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "plain"))
    view = imap_view(snode, anne)
    assert [s for _, s in view["Lists/dev"]] == [b"Subject: news [list-dev] today"]
    assert "\\Flagged" in view["Junk"][0][0] and view["Junk"][0][1] == b"Subject: your order"
    inbox = dict((s, f) for f, s in view["INBOX"])
    assert set(inbox) == {b"Subject: urgent: the roof", b"Subject: plain"}  # the spam was discarded
    assert "\\Flagged" in inbox[b"Subject: urgent: the roof"] and "$work" in inbox[b"Subject: urgent: the roof"]
    assert "\\Flagged" not in inbox[b"Subject: plain"]


async def test_a_broken_or_failing_script_delivers_to_inbox_and_logs(snode: Node, sstore: Store,
                                                                     people: dict[str, str]) -> None:
    anne, bob = people["anne"], people["bob"]
    await activate(sstore, anne, 'if header :contains "subject" "x" { fileinto "Nowhere"; ')  # not Sieve
    await activate(sstore, bob, 'require "fileinto"; fileinto "No such mailbox";')  # fails when it runs
    send(snode, f"x@{REMOTE}", [anne, bob], mail(f"x@{REMOTE}", anne, "still here x"))
    assert [s for _, s in imap_view(snode, anne)["INBOX"]] == [b"Subject: still here x"]
    assert [s for _, s in imap_view(snode, bob)["INBOX"]] == [b"Subject: still here x"]
    log = snode.log_text()
    assert f"user={anne}" in log and "result=error" in log and "No such mailbox" in log


async def test_reject_refuses_at_smtp_or_notifies_the_sender(snode: Node, sstore: Store,
                                                             people: dict[str, str]) -> None:
    anne, bob = people["anne"], people["bob"]
    await activate(sstore, anne, 'require "reject"; if header :contains "subject" "buy" { reject "No ads, thanks"; }')
    with pytest.raises(smtplib.SMTPDataError) as refused:
        send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "buy now"))
    assert refused.value.smtp_code == 550 and b"No ads, thanks" in refused.value.smtp_error
    assert "INBOX" not in imap_view(snode, anne)
    # With another recipient taking it, the message is accepted and the sender gets a DSN.
    send(snode, f"x@{REMOTE}", [anne, bob], mail(f"x@{REMOTE}", anne, "buy more"))
    assert [s for _, s in imap_view(snode, bob)["INBOX"]] == [b"Subject: buy more"]
    [notice] = await queued_to(sstore, f"x@{REMOTE}")
    report = await sstore.read_queued(notice.id)
    assert notice.sender == "" and b"No ads, thanks" in report and b"Status: 5.7.1" in report
    await sstore.delete_queued(notice.id)


async def test_redirect_goes_through_the_queue_or_to_the_local_user(snode: Node, sstore: Store,
                                                                    people: dict[str, str]) -> None:
    anne, bob = people["anne"], people["bob"]
    away = f"anne-{uuid.uuid4().hex[:6]}@{REMOTE}"
    await activate(sstore, anne, f'require "copy"; redirect :copy "{away}"; redirect "{bob}";')
    send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "pass it on"))
    [entry] = await queued_to(sstore, away)
    copy = await sstore.read_queued(entry.id)
    assert entry.sender == anne and copy.startswith(f"Delivered-To: {anne}\r\n".encode())
    assert [s for _, s in imap_view(snode, bob)["INBOX"]] == [b"Subject: pass it on"]
    assert "INBOX" not in imap_view(snode, anne)  # redirect without :copy cancels the keep
    await sstore.delete_queued(entry.id)
    # A copy that comes back (it names anne in Delivered-To) is kept, not redirected again.
    send(snode, f"x@{REMOTE}", [anne], f"Delivered-To: {anne}\r\n" + mail(f"x@{REMOTE}", anne, "loop"))
    assert await queued_to(sstore, away) == []
    assert [s for _, s in imap_view(snode, anne)["INBOX"]] == [b"Subject: loop"]


async def test_vacation_answers_once_per_period_never_lists_or_null_senders(snode: Node, sstore: Store,
                                                                           people: dict[str, str]) -> None:
    anne, bob = people["anne"], people["bob"]
    await activate(sstore, anne, 'require "vacation"; vacation :days 7 :subject "Away" "Back on Monday.";')
    stranger = f"s-{uuid.uuid4().hex[:6]}@{REMOTE}"
    send(snode, stranger, [anne], mail(stranger, anne, "question"))
    send(snode, stranger, [anne], mail(stranger, anne, "question again"))
    [answer] = await queued_to(sstore, stranger)
    reply = email.message_from_bytes(await sstore.read_queued(answer.id))
    assert answer.sender == "" and reply["Subject"] == "Away" and reply["Auto-Submitted"].startswith("auto-replied")
    assert reply["To"] == stranger and reply["In-Reply-To"] and "Back on Monday." in reply.get_payload(decode=True).decode()
    await sstore.delete_queued(answer.id)
    lister = f"l-{uuid.uuid4().hex[:6]}@{REMOTE}"
    send(snode, lister, [anne], mail(lister, anne, "digest", extra="List-Id: <dev.lists.example>\r\n"))
    send(snode, lister, [anne], mail(lister, anne, "bulk", extra="Precedence: bulk\r\n"))
    send(snode, "<>", [anne], mail("MAILER-DAEMON@x", anne, "bounce"))
    assert await queued_to(sstore, lister) == []
    # A local sender gets the answer in their INBOX, and all five messages reached anne's.
    send(snode, bob, [anne], mail(bob, anne, "lunch?"))
    assert [s for _, s in imap_view(snode, bob)["INBOX"]] == [b"Subject: Away"]
    assert len(imap_view(snode, anne)["INBOX"]) == 6
    assert 'reason="mailing list"' in snode.log_text() and 'reason="null sender"' in snode.log_text()


async def test_lmtp_runs_the_same_scripts(snode: Node, sstore: Store, people: dict[str, str]) -> None:
    anne = people["anne"]
    await activate(sstore, anne, 'require "fileinto"; fileinto "Receipts";')
    await sstore.create_mailbox(anne, "Receipts")
    with smtplib.LMTP("127.0.0.1", snode.port("lmtp"), timeout=30) as client:
        client.sendmail(f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "via lmtp").encode())
    assert [s for _, s in imap_view(snode, anne)["Receipts"]] == [b"Subject: via lmtp"]


async def test_submission_filters_local_recipients_not_the_senders_sent_copy(snode: Node, sstore: Store,
                                                                              people: dict[str, str]) -> None:
    anne, bob = people["anne"], people["bob"]
    await activate(sstore, anne, "discard;")
    await activate(sstore, bob, 'require "fileinto"; fileinto "Junk";')
    with smtplib.SMTP("127.0.0.1", snode.port("submission"), timeout=30) as client:
        client.login(anne, "anne")
        client.sendmail(anne, [anne, bob], mail(anne, f"{anne}, {bob}", "minutes").encode())
    assert [s for _, s in imap_view(snode, bob)["Junk"]] == [b"Subject: minutes"]
    view = imap_view(snode, anne)
    assert [s for _, s in view["Sent"]] == [b"Subject: minutes"] and "INBOX" not in view


# ----------------------------------------------------------------------------- ManageSieve


def sieve_client(node: Node, user: str, monkeypatch: pytest.MonkeyPatch, tls: dict[str, str]) -> Client:
    monkeypatch.setenv("SSL_CERT_FILE", tls["tls_cert"])  # sievelib verifies the certificate and its name
    client = Client("127.0.0.1", node.port("managesieve"))
    assert client.connect(user, user.split("@")[0], starttls=True, authmech="PLAIN")
    return client


async def test_sievelib_client_edits_scripts_that_then_run(snode: Node, sstore: Store, people: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           sieve_tls: dict[str, str]) -> None:
    anne = people["anne"]
    client = sieve_client(snode, anne, monkeypatch, sieve_tls)
    assert client.get_implementation() == "cassmail"
    assert {"fileinto", "vacation", "imap4flags", "regex"} <= set(client.get_sieve_capabilities())
    script = 'require ["fileinto", "mailbox"];\r\nif header :contains "subject" "report" {\r\n  fileinto :create "Reports";\r\n}\r\n'
    assert client.havespace("main", len(script))
    assert not client.havespace("main", 10**7)
    assert client.checkscript(script)
    assert not client.checkscript('fileinto "x";')  # fileinto without require
    assert not client.putscript("bad", "if true {")
    assert client.putscript("main", script)
    assert client.putscript("spare", "keep;")
    assert client.setactive("main")
    assert client.listscripts() == ("main", ["spare"])
    assert client.getscript("main").splitlines() == script.splitlines()  # sievelib gives lines joined by LF
    assert not client.deletescript("main")  # active
    assert client.renamescript("main", "rules")
    assert client.listscripts() == ("rules", ["spare"])
    assert not client.renamescript("spare", "rules")
    assert client.deletescript("spare")
    assert not client.getscript("spare")
    client.logout()
    assert await sstore.active_sieve_script(anne) == ("rules", script)
    send(snode, f"x@{REMOTE}", [anne], mail(f"x@{REMOTE}", anne, "monthly report"))
    assert [s for _, s in imap_view(snode, anne)["Reports"]] == [b"Subject: monthly report"]


class Raw:
    """A ManageSieve client at the byte level: what Thunderbird's filter editor sends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> bytes:
        return self.file.readline()

    def until_status(self) -> list[bytes]:
        lines = []
        while True:
            line = self.line()
            assert line, lines
            lines.append(line)
            if line.startswith((b"OK", b"NO", b"BYE")):
                return lines

    def tls(self) -> None:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        self.sock = context.wrap_socket(self.sock)
        self.file = self.sock.makefile("rb")

    @classmethod
    def secured(cls, port: int) -> Raw:
        """Past the greeting and STARTTLS, with the capabilities sent again read."""
        raw = cls(port)
        raw.until_status()
        raw.send(b"STARTTLS\r\n")
        assert raw.until_status()[-1].startswith(b"OK")
        raw.tls()
        raw.until_status()
        return raw


async def test_a_command_sent_in_clear_behind_starttls_is_dropped_not_run_over_tls(snode: Node,
                                                                                   people: dict[str, str]) -> None:
    """STARTTLS command injection (CVE-2011-0411's kind): an AUTHENTICATE written in the same packet
    as STARTTLS, by anyone on the path, must not run once TLS is on."""
    anne = people["anne"]
    raw = Raw(snode.port("managesieve"))
    raw.until_status()
    raw.send(b'STARTTLS\r\nAUTHENTICATE "PLAIN" "' + base64.b64encode(f"\0{anne}\0anne".encode()) + b'"\r\n')
    assert raw.until_status()[-1].startswith(b"OK")
    raw.tls()
    assert b'"SASL" "PLAIN"\r\n' in raw.until_status()
    raw.send(b'NOOP "after"\r\n')
    assert raw.until_status() == [b'OK (TAG "after") "Done"\r\n']  # the injected command got no answer
    raw.send(b"LISTSCRIPTS\r\n")
    assert raw.until_status()[-1].startswith(b"NO")  # and logged nobody in
    assert re.search(r"managesieve-starttls .*dropped_bytes=\d+", snode.log_text())


async def test_thunderbird_command_sequence(snode: Node, sstore: Store, people: dict[str, str]) -> None:
    anne = people["anne"]
    raw = Raw(snode.port("managesieve"))
    greeting = raw.until_status()
    assert greeting[0] == b'"IMPLEMENTATION" "cassmail"\r\n' and b'"STARTTLS"\r\n' in greeting
    assert b'"SASL" ""\r\n' in greeting  # no password before TLS
    raw.send(b'AUTHENTICATE "PLAIN" "' + base64.b64encode(f"\0{anne}\0anne".encode()) + b'"\r\n')
    assert raw.until_status()[-1].startswith(b"NO (ENCRYPT-NEEDED)")
    raw.send(b"STARTTLS\r\n")
    assert raw.until_status()[-1].startswith(b"OK")
    raw.tls()
    after = raw.until_status()
    assert b'"SASL" "PLAIN"\r\n' in after and b'"STARTTLS"\r\n' not in after
    # Thunderbird: AUTHENTICATE "PLAIN" with the response as a literal on the next line.
    token = base64.b64encode(f"\0{anne}\0anne".encode())
    raw.send(b'AUTHENTICATE "PLAIN" {' + str(len(token)).encode() + b'+}\r\n' + token + b"\r\n")
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b"CAPABILITY\r\n")
    assert raw.until_status()[-1] == b"OK\r\n"
    raw.send(b"LISTSCRIPTS\r\n")
    assert raw.until_status() == [b"OK\r\n"]
    script = b'require ["vacation"];\r\nvacation :days 3 "Out of office";\r\n'
    raw.send(b'CHECKSCRIPT {' + str(len(script)).encode() + b'+}\r\n' + script + b"\r\n")
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b'PUTSCRIPT "thunderbird" {' + str(len(script)).encode() + b'+}\r\n' + script + b"\r\n")
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b'SETACTIVE "thunderbird"\r\n')
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b"LISTSCRIPTS\r\n")
    assert raw.until_status() == [b'"thunderbird" ACTIVE\r\n', b"OK\r\n"]
    raw.send(b'GETSCRIPT "thunderbird"\r\n')
    got = raw.line()
    assert got == b"{" + str(len(script)).encode() + b"}\r\n"
    assert raw.file.read(len(script)) == script
    assert raw.until_status() == [b"\r\n", b"OK\r\n"]
    raw.send(b'NOOP "tag1"\r\n')
    rest = raw.until_status()
    assert rest[-1] == b'OK (TAG "tag1") "Done"\r\n'
    raw.send(b'SETACTIVE ""\r\n')
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b'DELETESCRIPT "thunderbird"\r\n')
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b'DELETESCRIPT "thunderbird"\r\n')
    assert raw.until_status()[-1].startswith(b"NO (NONEXISTENT)")
    raw.send(b"UNAUTHENTICATE\r\n")
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b"LISTSCRIPTS\r\n")
    assert raw.until_status()[-1].startswith(b"NO")
    raw.send(b"LOGOUT\r\n")
    assert raw.until_status()[-1].startswith(b"OK")
    assert raw.line() == b""
    assert await sstore.list_sieve_scripts(anne) == []


async def test_bad_input_gets_no_or_bye_never_a_traceback(snode: Node, sstore: Store, people: dict[str, str]) -> None:
    anne = people["anne"]
    raw = Raw.secured(snode.port("managesieve"))
    for bad in (b"\r\n", b"FROB\r\n", b'PUTSCRIPT "x"\r\n', b'"quoted first"\r\n', b'GETSCRIPT "unterminated\r\n',
                b"LISTSCRIPTS\r\n", b"AUTHENTICATE \"DIGEST-MD5\"\r\n", b"HAVESPACE \"a\" x\r\n", b"\xff\xfe\r\n"):
        raw.send(bad)
        assert raw.until_status()[-1].startswith(b"NO"), bad
    raw.send(b'AUTHENTICATE "PLAIN" "not base64!"\r\n')
    assert raw.until_status()[-1].startswith(b"NO")
    raw.send(b'AUTHENTICATE "PLAIN"\r\n')
    assert raw.line() == b'""\r\n'
    raw.send(b'"unterminated\r\n')
    assert raw.until_status()[-1].startswith(b"NO")
    token = base64.b64encode(f"\0{anne}\0anne".encode())
    raw.send(b'AUTHENTICATE "PLAIN"\r\n')
    assert raw.line() == b'""\r\n'
    raw.send(b'"' + token + b'"\r\n')
    assert raw.until_status()[-1].startswith(b"OK")
    raw.send(b'PUTSCRIPT "big" {200000+}\r\n' + b"#" * 200000 + b"\r\n")
    assert raw.until_status()[-1].startswith(b"NO (QUOTA/MAXSIZE)")
    raw.send(b'PUTSCRIPT "bad\\x" "keep;"\r\n')
    assert raw.until_status()[-1].startswith(b"NO")
    raw.send(b'PUTSCRIPT "ok" "keep;"\r\n')
    assert raw.until_status()[-1].startswith(b"OK")  # the session went on after all that
    raw.send(b"PUTSCRIPT {99999999999+}\r\n")
    assert raw.until_status()[-1].startswith(b"NO")
    raw.send(b'PUTSCRIPT "huge" {999999999+}\r\n')
    assert raw.until_status()[-1].startswith(b"BYE")
    # Three wrong passwords end the session.
    raw = Raw.secured(snode.port("managesieve"))
    wrong = base64.b64encode(f"\0{anne}\0wrong".encode())
    answers = []
    for _ in range(3):
        raw.send(b'AUTHENTICATE "PLAIN" "' + wrong + b'"\r\n')
        answers.append(raw.until_status()[-1][:3])
    assert answers == [b"NO ", b"NO ", b"BYE"]
    assert await sstore.list_sieve_scripts(anne) == [SieveScriptInfo("ok", False)]


def test_operator_cli_puts_lists_activates_gets_and_deletes(request: pytest.FixtureRequest, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`cassmail sieve ...` through the CLI's entry point (in this process: its commands are the same
    over every store, they use the contract), once, on mbox."""
    from cassmail import cli

    user = f"cli-{uuid.uuid4().hex[:6]}@cli{uuid.uuid4().hex[:6]}.example"
    config = str(tmp_path / "cli.toml")

    def run(*args: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        code = cli.main(["--config", config, *args])
        out, err = capsys.readouterr()
        return code, out, err

    settings = backend_settings_for("mbox", request)
    Path(config).write_text(to_toml(settings))

    async def make_user() -> None:
        async with make_store(settings) as store:
            await store.add_domain(user.split("@")[1])
            await store.create_user(user, hash_password("pw", FAST_HASH))

    asyncio.run(make_user())
    script = tmp_path / "rules.sieve"
    script.write_text('require "fileinto";\nfileinto "Junk";\n')
    assert run("sieve", "put", user, "rules", str(script), "--activate") == (
        0, f"stored script 'rules' of {user} (active)\n", "")
    code, _, err = run("sieve", "put", user, "broken", "-", stdin='fileinto "x";')
    assert code == 1 and 'needs require "fileinto"' in err
    assert run("sieve", "list", user)[1] == "rules  (active)\n"
    assert run("sieve", "get", user, "rules")[1] == script.read_text()
    code, _, err = run("sieve", "delete", user, "rules")
    assert code == 1 and "active" in err
    assert run("sieve", "activate", user, "--none")[0] == 0
    assert run("sieve", "delete", user, "rules")[0] == 0
    assert run("sieve", "list", user)[1] == ""
    code, _, err = run("sieve", "get", user, "rules")
    assert code == 1 and "no such Sieve script" in err
