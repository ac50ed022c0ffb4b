"""A mutation fuzzer for the IMAP front end over a real socket: valid commands (from a corpus)
mutated byte-wise and token-wise, sent to a logged-in session with a selected mailbox. The
server must answer each with OK, NO or BAD (never NO [SERVERBUG]), or end the session with a
BYE it announced; the node's log must hold no traceback (checked by the caller).

`run(port, user, password, count, seed, seconds, pid)` returns the findings;
`python -m tests.imap_fuzz --help` runs it by hand for longer. The mutation, the findings and
the command line are shared with the SMTP and POP3 fuzzers (tests/wire_fuzz.py).
"""

from __future__ import annotations

import random
import re
import socket

from tests.wire_fuzz import Findings, arguments, mutate, report, run_bounded

CORPUS = [
    b"NOOP", b"CHECK", b"CAPABILITY", b"ID NIL", b'ID ("name" "fuzz" "version" "1")', b"NAMESPACE", b"ENABLE CONDSTORE",
    b"FETCH 1:* (FLAGS UID)", b"FETCH 1 (BODY.PEEK[HEADER.FIELDS (SUBJECT FROM)]<0.50>)", b"FETCH 1:2 ALL",
    b"FETCH 1 (BODY[1.2.MIME] BODY.PEEK[TEXT] RFC822.SIZE ENVELOPE BODYSTRUCTURE)", b"UID FETCH 1:* FULL",
    b"FETCH 1 BODY.PEEK[]<10.20>", b"FETCH * (INTERNALDATE RFC822.HEADER)",
    b"STORE 1 +FLAGS (\\Seen $Label1)", b"STORE 1:* -FLAGS.SILENT (\\Flagged)", b"UID STORE 1 FLAGS (\\Draft)",
    b'SEARCH OR (FROM "a" SUBJECT b) NOT UNSEEN', b"SEARCH SINCE 1-Feb-2026 BEFORE 2-Mar-2027 LARGER 10",
    b'SEARCH CHARSET UTF-8 HEADER "X-Test" "v" UID 1:*', b"UID SEARCH KEYWORD $Label1 1:* NEW OLD RECENT",
    b"SEARCH TEXT hello BODY world SENTON 2-Nov-2026 SMALLER 100000",
    b'LIST "" "*"', b'LIST "" "%/%"', b'LIST (SUBSCRIBED RECURSIVEMATCH) "" ("%" "*") RETURN (CHILDREN STATUS (MESSAGES))',
    b'LSUB "" "*"', b"STATUS INBOX (MESSAGES RECENT UIDNEXT UIDVALIDITY UNSEEN)",
    b"CREATE fuzz/box", b"RENAME fuzz/box fuzz/other", b"DELETE fuzz/other", b"SUBSCRIBE Junk", b"UNSUBSCRIBE Junk",
    b"EXAMINE Junk", b"SELECT INBOX", b"COPY 1 Junk", b"UID COPY 1:* Trash", b"MOVE 2 Junk", b"UID MOVE 9 Trash",
    b"EXPUNGE", b"UID EXPUNGE 1:3", b"CLOSE", b"UNSELECT", b"SELECT INBOX",
    b'APPEND INBOX (\\Seen) "04-Jul-2026 10:02:01 +0000" {18+}\r\nSubject: x\r\n\r\nhi\r\n',
    b"APPEND Junk {5+}\r\nhello", b"LOGIN {3+}\r\nabc pw", b"SEARCH SUBJECT {4+}\r\nr\xc3\xa9s",
]
class _Session:
    def __init__(self, port: int, user: str, password: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=1)
        self.file = self.sock.makefile("rb")
        self.file.readline()
        self.tag = 0
        for command in (f"LOGIN {user} {password}".encode(), b"SELECT INBOX"):
            self.command(command)

    def command(self, data: bytes) -> tuple[str, bytes]:
        """(how it ended, the last line): "tagged", "bye" or "timeout"."""
        self.tag += 1
        tag = b"f%d" % self.tag
        payload = tag + b" " + data
        self.sock.sendall(payload + b"\r\n")
        pending_literal = re.search(rb"\{(\d+)\}\Z", payload)
        while True:
            try:
                line = self.file.readline()
            except TimeoutError:
                return "timeout", b""
            if not line:
                return "closed", b""
            if line.startswith(b"+") and pending_literal:
                size = int(pending_literal.group(1))
                self.sock.sendall(b"x" * min(size, 1 << 16) + b"\r\n")
                pending_literal = None
                continue
            m = re.search(rb"\{(\d+)\}\r\n\Z", line)
            if m:
                self.file.read(int(m.group(1)))
            if line.startswith(b"* BYE"):
                return "bye", line
            if line.startswith(tag + b" "):
                return "tagged", line

    def close(self) -> None:
        self.sock.close()


def run(port: int, user: str, password: str, count: int = 2000, seed: int = 1, seconds: float = 600.0,
        pid: int | None = None) -> Findings:
    rng = random.Random(seed)
    findings = Findings()
    session = _Session(port, user, password)

    def step(_: int) -> None:
        nonlocal session
        data = mutate(rng, rng.choice(CORPUS), CORPUS)
        if b"LOGOUT" in data.upper():
            return
        findings.sent += 1
        try:
            how, line = session.command(data)
        except OSError as exc:
            how, line = "closed", repr(exc).encode()
        key = how if how != "tagged" else line.split(b" ", 2)[1].decode("ascii", "replace")
        findings.count(key)
        if b"SERVERBUG" in line or b"Internal error" in line:
            findings.problems.append(f"{data!r} -> {line!r}")
        if b"Command not allowed now" in line:  # a mutated CLOSE or a failed SELECT: select again
            session.command(b"SELECT INBOX")
        if how == "timeout":
            # an announced non-synchronising literal may wait for bytes the mutation cut off
            session.sock.sendall(b"\r\n" * 4 + b"x" * 70_000 + b"\r\n")
            session.close()
            session = _Session(port, user, password)
        elif how in ("bye", "closed"):
            if how == "closed":
                findings.problems.append(f"{data!r}: connection closed without BYE")
            session.close()
            session = _Session(port, user, password)

    try:
        run_bounded(step, count, seconds, findings, pid)
    finally:
        session.close()
    return findings


def main() -> None:
    args = arguments("Mutation-fuzz a running cassmail IMAP listener.", login=True).parse_args()
    report(run(args.port, args.user, args.password, args.count, args.seed, args.seconds, args.pid))


if __name__ == "__main__":
    main()
