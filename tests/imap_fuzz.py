"""A mutation fuzzer for the IMAP front end over a real socket: valid commands (from a corpus)
mutated byte-wise and token-wise, sent to a logged-in session with a selected mailbox. The
server must answer each with OK, NO or BAD (never NO [SERVERBUG]), or end the session with a
BYE it announced, and never leave a command it has whole unanswered (a stall: the client follows
the server's framing of what it sent, so it can tell a stall from the server rightly waiting
for the rest of a literal); the node's log must hold no traceback (checked by the caller).

`run(port, user, password, count, seed, seconds, pid)` returns the findings;
`python -m tests.imap_fuzz --help` runs it by hand for longer. The mutation, the findings and
the command line are shared with the SMTP and POP3 fuzzers (tests/wire_fuzz.py).
"""

from __future__ import annotations

import random
import re
import select
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
    b"ENABLE QRESYNC", b"SELECT INBOX (CONDSTORE)", b"EXAMINE INBOX (QRESYNC (1 5 1:9 (1:2,5 1,3:4)))",
    b"FETCH 1:* (FLAGS MODSEQ) (CHANGEDSINCE 3)", b"UID FETCH 1:* (FLAGS) (CHANGEDSINCE 1 VANISHED)",
    b"STORE 1:2 (UNCHANGEDSINCE 7) +FLAGS.SILENT (\\Seen)", b'SEARCH MODSEQ "/flags/\\\\seen" all 4',
    b"STATUS INBOX (HIGHESTMODSEQ UIDNEXT)",
]
#: A literal announced at the end of a line (RFC 3501, LITERAL+, BINARY's literal8).
_LITERAL = re.compile(rb"(~?)\{(\d{1,20})(\+?)\}\Z")
#: Literals up to this size are taken whatever the command (the server's `max_string_literal`);
#: a larger one may be refused for its size, which the model below does not try to tell.
_ALWAYS_TAKEN = 8192
#: What a command's string literals may add up to (`max_line_length`).
_STRINGS_TAKEN = 65536
#: Waiting this long with nothing from the server is how a run notices that it waits.
QUIET = 1.0
#: Nothing from the server for this long while it owes an answer to a complete command: a stall.
STALL = 10.0


class _Framer:
    """What the server makes of the bytes a client sent on one connection, as
    `connection.read_command` frames them: lines, each with the literal it announces. It counts
    the whole commands sent and the synchronising literals announced (each owes a `+` or a
    refusal). `certain` turns False where the model cannot follow the server: a literal the
    server may refuse for its size, or a continuation that is not a literal's (IDLE, AUTHENTICATE
    read a line that is not a command)."""

    def __init__(self) -> None:
        self.pending = bytearray()
        #: Bytes of a literal still to come; whether a literal was read and the line after it is due.
        self.literal = 0
        self.inside = False
        self.strings = 0
        self.commands = 0
        self.synchronising = 0
        self.certain = True

    def feed(self, data: bytes) -> None:
        self.pending += data
        while self.certain:
            if self.literal:
                taken = min(self.literal, len(self.pending))
                del self.pending[:taken]
                self.literal -= taken
                if self.literal:
                    return
            end = self.pending.find(b"\n")
            if end < 0:
                return
            line = bytes(self.pending[:end]).removesuffix(b"\r")
            del self.pending[: end + 1]
            m = _LITERAL.search(line)
            if m is None:
                self.commands, self.strings, self.inside = self.commands + 1, 0, False
                continue
            size, synchronising = int(m.group(2)), not m.group(3)
            if size > 0xFFFFFFFF:  # no IMAP number: answered (BAD, or BYE for LITERAL+) at once, not read
                self.commands, self.strings, self.inside = self.commands + 1, 0, False
                continue
            self.strings += size
            if size > _ALWAYS_TAKEN or self.strings > _STRINGS_TAKEN:
                self.certain = False
                return
            self.synchronising += synchronising
            self.literal, self.inside = size, True

    @property
    def partial(self) -> bool:
        """In the middle of a command: a line or a literal not sent whole, or the line after a
        literal not begun."""
        return bool(self.literal or self.pending or self.inside)


class _Session:
    """One connection: sends an input, reads what the server answers, and keeps the count of
    whole commands sent against answers received, so that silence can be judged."""

    def __init__(self, port: int, user: str, password: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=STALL)
        self.buffer = bytearray()
        self.framer = _Framer()
        #: Tagged answers (and the untagged BAD or NO [TOOBIG] of a command without a valid tag).
        self.answered = 0
        self.continuations = 0
        self.tag = 0
        self._read_line(STALL)  # the greeting
        for command in (f"LOGIN {user} {password}".encode(), b"SELECT INBOX"):
            self.command(command)

    def send(self, data: bytes) -> None:
        self.framer.feed(data)
        self.sock.sendall(data)

    def owes(self) -> bool:
        """Whether the server, by what was sent, owes an answer: a whole command not answered, or
        a synchronising literal neither continued nor refused."""
        framer = self.framer
        if not framer.certain or self.continuations > framer.synchronising:
            return False  # the model cannot tell, or the server waits for a line that is not a command
        return framer.commands > self.answered or self.continuations < framer.synchronising

    def _fill(self, quiet: float) -> bool:
        """More bytes from the server; False after `quiet` seconds of nothing, or `STALL` seconds
        while it owes an answer. Raises ConnectionError when the server closed."""
        waited = 0.0
        while True:
            if select.select([self.sock], [], [], quiet)[0]:
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionResetError("closed")
                self.buffer += data
                return True
            waited += quiet
            if not self.owes() or waited >= STALL:
                return False

    def _read_line(self, quiet: float) -> bytes | None:
        """A response line with its literals; None when the server went quiet."""
        while (end := self.buffer.find(b"\n")) < 0:
            if not self._fill(quiet):
                return None
        line = bytes(self.buffer[: end + 1])
        del self.buffer[: end + 1]
        m = re.search(rb"\{(\d+)\}\r\n\Z", line)
        if m:
            size = int(m.group(1))
            while len(self.buffer) < size:
                if not self._fill(quiet):
                    return None
            del self.buffer[:size]
            rest = self._read_line(quiet)
            return None if rest is None else line + rest
        tag, _, rest = line.partition(b" ")
        if line.startswith(b"+"):
            self.continuations += 1
        elif tag != b"*" and rest[:3] in (b"OK ", b"NO ", b"BAD"):
            self.answered += 1
        elif line.startswith((b"* BAD ", b"* NO [TOOBIG]")):
            self.answered += 1
        return line

    def command(self, data: bytes) -> tuple[str, bytes]:
        """(how it ended, the last line): "tagged", "bye", "closed", "quiet" (the server waits
        for more, as it may: a literal not sent whole, a line that is no command) or "stall" (a
        command the server had whole went unanswered for STALL seconds)."""
        self.tag += 1
        tag = b"f%d" % self.tag
        payload = tag + b" " + data
        self.send(payload + b"\r\n")
        pending_literal = re.search(rb"\{(\d+)\}\Z", payload)
        while True:
            try:
                line = self._read_line(QUIET)
            except OSError:
                return "closed", b""
            if line is None:
                return ("stall" if self.owes() else "quiet"), b""
            if line.startswith(b"+") and pending_literal:
                size = int(pending_literal.group(1))
                self.send(b"x" * min(size, 1 << 16) + b"\r\n")
                pending_literal = None
                continue
            if line.startswith(b"* BYE"):
                return "bye", line
            if line.startswith(tag + b" "):
                return "tagged", line

    @property
    def in_step(self) -> bool:
        """Whether the next input starts a command of its own, as the model can follow."""
        return self.framer.certain and not self.framer.partial and self.continuations <= self.framer.synchronising

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
        if how == "stall":
            findings.problems.append(f"{data!r}: a whole command unanswered for {STALL:g} s")
        if b"Command not allowed now" in line:  # a mutated CLOSE or a failed SELECT: select again
            again, _ = session.command(b"SELECT INBOX")
            if again == "stall":
                findings.problems.append(f"{data!r}, then SELECT: a whole command unanswered for {STALL:g} s")
            how = again if again != "tagged" else how
        if how == "closed":
            findings.problems.append(f"{data!r}: connection closed without BYE")
        if how != "tagged" or not session.in_step:
            # waiting for bytes a mutation cut off, or out of the model's step: a fresh connection
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
