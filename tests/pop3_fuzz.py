"""A mutation fuzzer for the POP3 front end over a real socket: valid commands (from a corpus)
mutated byte-wise and token-wise (tests/wire_fuzz.py), half of the sessions logged in, half
not. Each must get +OK, -ERR or a SASL continuation (never the internal-error -ERR), or end
the session after QUIT; the node's log must hold no traceback (checked by the caller).

`run(port, user, password, count, seconds, seed, pid)` returns the findings;
`python -m tests.pop3_fuzz --help` runs it by hand for longer.
"""

from __future__ import annotations

import random
import re
import socket

from tests.wire_fuzz import Findings, arguments, pick, report, run_bounded

CORPUS = [
    b"CAPA", b"NOOP", b"STAT", b"LIST", b"LIST 1", b"UIDL", b"UIDL 1", b"RETR 1", b"TOP 1 0", b"TOP 1 5", b"DELE 1",
    b"RSET", b"LAST", b"USER anne@x.test", b"PASS anne", b"APOP anne 0123456789abcdef", b"AUTH", b"AUTH PLAIN",
    b"AUTH PLAIN AGFubmVAeC50ZXN0AGFubmU=", b"AUTH LOGIN", b"STLS", b"UTF8", b"LANG", b"RETR 4294967296",
    b"LIST -1", b"TOP 1 -1", b"TOP 1 99999999999999999999", b"UIDL 0", b"RETR 1_0", b"LIST \xd9\xa1",
]
#: Inputs per session: mutated logins rarely succeed, so sessions are renewed, half logged in.
SESSION_LENGTH = 40
#: The internal error's text (cassmail.pop3.server.INTERNAL_ERROR).
INTERNAL = b"Internal error"


class _Session:
    def __init__(self, port: int, login: tuple[str, str] | None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.file = self.sock.makefile("rb")
        self.greeting = self.file.readline()
        if login is not None:
            for line in (f"USER {login[0]}".encode(), f"PASS {login[1]}".encode()):
                self.sock.sendall(line + b"\r\n")
                answer = self.file.readline()
                assert answer.startswith(b"+OK"), answer

    def command(self, data: bytes) -> bytes:
        """The status line; the body of a multi-line answer is read and dropped."""
        self.sock.sendall(data + b"\r\n")
        try:
            status = self.file.readline()
        except TimeoutError:
            return b"timeout"
        if status.startswith(b"+OK") and _multi_line(data):
            while True:
                line = self.file.readline()
                if line in (b".\r\n", b""):
                    break
        return status

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def _multi_line(data: bytes) -> bool:
    """Whether a command's +OK answer is followed by lines ending with a lone dot."""
    words = data.split()
    if not words:
        return False
    name = words[0].upper()
    return (name in (b"CAPA", b"RETR", b"TOP") or (name in (b"LIST", b"UIDL") and len(words) == 1)
            or (name == b"AUTH" and len(words) == 1))


def run(port: int, user: str, password: str, count: int = 2000, seconds: float = 60.0, seed: int = 1,
        pid: int | None = None) -> Findings:
    rng = random.Random(seed)
    findings = Findings()
    login = (user, password)
    session = _Session(port, login)
    sessions = 1

    def step(i: int) -> None:
        nonlocal session, sessions
        if i and i % SESSION_LENGTH == 0:  # a new session now and then, logged in every other time
            session.close()
            sessions += 1
            session = _Session(port, login if sessions % 2 else None)
        data = pick(rng, CORPUS).replace(b"\r\n", b"").replace(b"\n", b" ")
        words = data.split()
        name = words[0].upper() if words else b""
        if name == b"STLS":
            return  # the fuzzer speaks no TLS
        findings.sent += 1
        try:
            answer = session.command(data)
            if answer.startswith(b"+ ") or answer == b"+\r\n":
                answer = session.command(rng.choice([b"*", b"AGFAAGI=", b"%%%", b""]))
        except OSError as exc:
            answer = repr(exc).encode()
        kind = answer[:4].strip().decode("ascii", "replace") if answer not in (b"", b"timeout") else (
            "closed" if not answer else "timeout")
        findings.count(kind)
        if INTERNAL in answer or b"Traceback" in answer:
            findings.problems.append(f"{data!r} -> {answer[:200]!r}")
        elif answer and answer != b"timeout" and not re.fullmatch(rb"(\+OK|-ERR|\+)( [^\r\n]*)?\r\n", answer):
            findings.problems.append(f"{data!r} -> not a POP3 answer: {answer[:200]!r}")
        announced = name == b"QUIT" or b"closing the connection" in answer
        if announced or not answer or answer == b"timeout":
            if not announced:
                findings.problems.append(f"{data!r}: {'no answer' if answer == b'timeout' else 'closed'}")
            session.close()
            sessions += 1
            session = _Session(port, login if sessions % 2 else None)

    try:
        run_bounded(step, count, seconds, findings, pid)
    finally:
        session.close()
    return findings


def main() -> None:
    args = arguments("Mutation-fuzz a running cassmail POP3 listener.", login=True).parse_args()
    report(run(args.port, args.user, args.password, args.count, args.seconds, args.seed, args.pid))


if __name__ == "__main__":
    main()
