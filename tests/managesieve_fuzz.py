"""A mutation fuzzer for the ManageSieve front end over a real socket: valid commands (from a
corpus: quoted strings, numbers, scripts as literals) mutated byte-wise and token-wise
(tests/wire_fuzz.py), half of the sessions logged in, half not. Every line the server sends must
be ManageSieve (a status OK/NO/BYE, a string, a literal, a capability) and never the internal
error; a session may end only after its BYE or LOGOUT's OK; the node's log must hold no
traceback (checked by the caller).

After each input a `NOOP "sN"` must come back as `OK (TAG "sN")`, so answers never drift apart
from their commands. An input that leaves the server reading a literal still owed (a mutated
size) is finished with filler bytes when small; when not, the session is ended and counted as
"dropped", as the server may rightly wait for a literal of megabytes. Silence after an input
that announced a literal is counted as "timeout" (the filler is reckoned from the framing
alone); after any other input it is a problem.

`run(port, user, password, count, seconds, seed, pid)` returns the findings;
`python -m tests.managesieve_fuzz --help` runs it by hand for longer.
"""

from __future__ import annotations

import base64
import random
import re
import socket

from tests.wire_fuzz import SPECIALS, Findings, arguments, pick, report, run_bounded

SCRIPT = (b'require ["fileinto", "variables", "date"];\r\nif header :contains "subject" "x" { fileinto "Junk"; }\r\n'
          b'if currentdate :zone "+0100" :is "hour" "10" { set "a" "${1}"; }\r\n')
#: What ManageSieve clients send; the login is added by `corpus`.
COMMANDS = [
    b"CAPABILITY", b"NOOP", b'NOOP "t1"', b"LISTSCRIPTS", b'HAVESPACE "rules" 100', b'HAVESPACE "x" 99999999',
    b'PUTSCRIPT "rules" {%d+}\r\n%s' % (len(SCRIPT), SCRIPT), b'PUTSCRIPT "r2" "keep;"',
    b'PUTSCRIPT "r\xc3\xa9gles" {5}\r\nkeep;', b'CHECKSCRIPT {%d+}\r\n%s' % (len(SCRIPT), SCRIPT),
    b'CHECKSCRIPT "if true { keep;"', b'SETACTIVE "rules"', b'SETACTIVE ""', b'GETSCRIPT "rules"', b'GETSCRIPT "nope"',
    b'DELETESCRIPT "r2"', b'RENAMESCRIPT "r2" "r3"', b'RENAMESCRIPT "r3" "r2"', b"UNAUTHENTICATE", b"LOGOUT",
    b'AUTHENTICATE "PLAIN"', b'AUTHENTICATE "PLAIN" "*"', b'AUTHENTICATE "DIGEST-MD5"', b'NOOP "a\\"b\\\\c"',
    b'PUTSCRIPT "big" {6000+}', b"PUTSCRIPT {4294967296+}", b'GETSCRIPT "unterminated', b"NOOP 12 13", b"STARTTLS",
]
#: Tokens that mean something to ManageSieve's reader, added to the shared ones.
MANAGESIEVE_SPECIALS = [*SPECIALS, b'""', b'"\\', b"{0+}", b"{2048+}", b"{65537+}", b"{17000000+}", b"\r\n",
                        b"ACTIVE", b'"*"', b"require", b"${1}", b"text:\r\n", b"\r\n.\r\n", b"/*", b"#"]
#: SASL answers to the empty challenge (`""`) of AUTHENTICATE without an initial response.
SASL_ANSWERS = [b'"*"', b'"AGFAAGI="', b'"%%%"', b"", b"{4+}\r\nAGE=", b'"unterminated', b"{99999999999}"]
#: Inputs per session; sessions are renewed, logged in every other time.
SESSION_LENGTH = 40
#: A literal still owed after an input is sent as filler bytes up to this size: less than a line
#: may be (8 KiB by default), so that filler the server does not take for a literal is one line
#: it answers, not a line past its limit that ends the session. A node with scripts smaller than
#: this (the suite's: 4 KiB) has the reading and dropping of a literal too large reached too.
MAX_FILLER = 8000
#: A quoted string as the server writes one (RFC 5804 4: only " and \\ escaped, no line break).
QUOTED = rb'"(?:[^"\\\r\n]|\\["\\])*"'
#: A status line: OK, NO or BYE, a response code (its strings may hold parentheses), a text.
STATUS = re.compile(rb"(OK|NO|BYE)( \((?:[^)\"\r\n]|" + QUOTED + rb")*\))?( " + QUOTED + rb")?\r\n")
#: A capability, or a script name of LISTSCRIPTS (with ACTIVE), or the empty SASL challenge.
STRING = re.compile(QUOTED + rb"( [^\r\n]*)?\r\n")
LITERAL = re.compile(rb"\{(\d+)\}\r\n")
ANNOUNCED = re.compile(rb"\{(\d{1,10})\+?\}\Z")
LOGGED_OUT = b'OK "Logout completed"\r\n'


def corpus(user: str, password: str) -> list[bytes]:
    token = base64.b64encode(f"\0{user}\0{password}".encode())
    return [*COMMANDS, b'AUTHENTICATE "PLAIN" "' + token + b'"',
            b'AUTHENTICATE "PLAIN" {%d+}\r\n%s' % (len(token), token)]


def owed(data: bytes) -> int | None:
    """How many bytes of a literal announced in `data` + CRLF do not follow it (then a line end
    finishes the command), as the server frames lines: {n} or {n+} at a line's end, then n
    bytes, then the command goes on to the next line end. None when nothing is owed."""
    buffer = data + b"\r\n"
    pos = 0
    while True:
        end = buffer.find(b"\n", pos)
        if end < 0:
            return None
        match = ANNOUNCED.search(buffer[pos:end].rstrip(b"\r"))
        pos = end + 1
        if match:
            size = int(match.group(1))
            if pos + size >= len(buffer):
                return pos + size - len(buffer)
            pos += size


class _Session:
    def __init__(self, port: int, login: tuple[str, str] | None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        self.file = self.sock.makefile("rb")
        self.sync = 0
        self.greeting = self.answer()
        assert self.greeting[-1].startswith(b"OK"), self.greeting
        if login is not None:
            token = base64.b64encode(f"\0{login[0]}\0{login[1]}".encode())
            self.sock.sendall(b'AUTHENTICATE "PLAIN" "' + token + b'"\r\n')
            answer = self.answer()
            assert answer[-1].startswith(b"OK"), answer

    def answer(self) -> list[bytes]:
        """The lines of one answer up to its status line (a literal's bytes joined to its line),
        or up to the empty SASL challenge `""`; the last is b"" when the server closed."""
        lines: list[bytes] = []
        while True:
            line = self.file.readline()
            if not line:
                return [*lines, b""]
            literal = LITERAL.fullmatch(line)
            if literal:  # a script or a long name: its bytes, then the rest of its line
                line += self.file.read(int(literal.group(1))) + self.file.readline()
            lines.append(line)
            if STATUS.fullmatch(line) or line == b'""\r\n':
                return lines

    def command(self, data: bytes, rng: random.Random) -> list[bytes]:
        """Every line the server sent for `data` up to the NOOP's tagged OK that follows it; the
        last is b"" when the server closed, b"timeout" when it went silent."""
        self.sync += 1
        tag = b"s%d" % self.sync
        owing = owed(data)
        lines: list[bytes] = []
        try:
            if owing is not None and owing > MAX_FILLER:
                self.sock.sendall(data)
                return [b"dropped"]  # the caller ends the session
            self.sock.sendall(data + b"\r\n" + (b"" if owing is None else b"x" * owing + b"\r\n"))
            lines += self.answer()
            if lines[-1] == b'""\r\n':
                self.sock.sendall(rng.choice(SASL_ANSWERS) + b"\r\n")
                lines += self.answer()
            if lines[-1] == b"" or lines[-1].startswith(b"BYE"):
                return lines
            if lines[-1] == LOGGED_OUT:
                return [*lines, self.file.readline()]
            noop = b'NOOP "' + tag + b'"\r\n'
            self.sock.sendall(noop)
            while lines[-1] != b'OK (TAG "' + tag + b'") "Done"\r\n':
                lines += self.answer()
                if lines[-1] == b'""\r\n':  # AUTHENTICATE on a later line of the input took the NOOP
                    self.sock.sendall(noop)
                elif lines[-1] == b"" or lines[-1].startswith(b"BYE"):
                    return lines
        except TimeoutError:
            lines.append(b"timeout")
        except OSError:  # a reset, as when the server closes with bytes of ours unread (after LOGOUT)
            lines.append(b"")
        return lines

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def check(findings: Findings, data: bytes, lines: list[bytes]) -> None:
    """Count the answer by its first status line; note every line that is not ManageSieve, and
    the internal error."""
    if lines == [b"dropped"]:
        return
    statuses = [line.split(b" ", 1)[0].strip() for line in lines if STATUS.fullmatch(line)]
    findings.count(statuses[0].decode() if statuses else "none")
    for line in lines:
        if b"Internal error" in line or b"Traceback" in line:
            findings.problems.append(f"{data!r} -> {line[:200]!r}")
        elif line in (b"", b"timeout", b'""\r\n') or STATUS.fullmatch(line) or STRING.fullmatch(line):
            continue
        elif not LITERAL.match(line):
            findings.problems.append(f"{data!r} -> not a ManageSieve answer: {line[:200]!r}")


def run(port: int, user: str, password: str, count: int = 2000, seconds: float = 60.0, seed: int = 1,
        pid: int | None = None) -> Findings:
    rng = random.Random(seed)
    findings = Findings()
    login = (user, password)
    inputs = corpus(user, password)
    session = _Session(port, login)
    sessions = 1

    def renew() -> None:
        nonlocal session, sessions
        session.close()
        sessions += 1
        session = _Session(port, login if sessions % 2 else None)

    def step(i: int) -> None:
        if i and i % SESSION_LENGTH == 0:
            renew()
        data = pick(rng, inputs, MANAGESIEVE_SPECIALS)  # STARTTLS too: the node has no certificate
        findings.sent += 1
        lines = session.command(data, rng)
        check(findings, data, lines)
        last = lines[-1]
        said_bye = any(line.startswith(b"BYE") for line in lines)
        logged_out = LOGGED_OUT in lines
        if last in (b"timeout", b"dropped"):
            # The server may rightly wait for the rest of a literal it was promised (owed() reads
            # the framing only roughly: a line it fails to parse announces none); else it is silent.
            findings.count(last.decode())
            if b"{" not in data:
                findings.problems.append(f"{data!r}: no answer")
            renew()
        elif last == b"" or said_bye:
            if not (said_bye or logged_out):
                findings.problems.append(f"{data!r}: closed without BYE")
            renew()

    try:
        run_bounded(step, count, seconds, findings, pid)
    finally:
        session.close()
    return findings


def main() -> None:
    args = arguments("Mutation-fuzz a running cassmail ManageSieve listener.", login=True).parse_args()
    report(run(args.port, args.user, args.password, args.count, args.seconds, args.seed, args.pid))


if __name__ == "__main__":
    main()
