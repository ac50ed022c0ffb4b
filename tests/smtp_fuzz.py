"""A mutation fuzzer for the SMTP front end over a real socket: valid commands (from a corpus)
mutated byte-wise and token-wise (tests/wire_fuzz.py), sent after EHLO. Each must get an SMTP
reply that is not an internal error (451 4.3.0 Internal error), or end the session with the
421/221/502 the server announced; the node's log must hold no traceback (checked by the caller).

`run(port, count, seconds, seed, pid)` returns the findings; `python -m tests.smtp_fuzz --help`
runs it by hand for longer.
"""

from __future__ import annotations

import random
import re
import socket

from tests.wire_fuzz import Findings, arguments, pick, report, run_bounded

CORPUS = [
    b"EHLO client.test", b"HELO client.test", b"EHLO [127.0.0.1]", b"NOOP", b"RSET", b"HELP", b"HELP MAIL",
    b"MAIL FROM:<a@b.test>", b"MAIL FROM:<> SIZE=100", b"MAIL FROM:<a@b.test> BODY=8BITMIME SMTPUTF8",
    b"MAIL FROM:<@a,@b:user@c.test>", b"MAIL FROM:<\"quoted local\"@b.test>", b"MAIL FROM:<user@[127.0.0.1]>",
    b"MAIL FROM:<user@xn--exmple-cua.test>", b"MAIL FROM:<\xc3\xa9@b.test> SMTPUTF8", b"MAIL FROM:a@b.test",
    b"RCPT TO:<anne@x.test>", b"RCPT TO:<postmaster>", b"RCPT TO:<Anne@X.TEST> NOTIFY=NEVER",
    b"RCPT TO:<a@b.test>", b"VRFY anne", b"VRFY <anne@x.test>", b"EXPN staff", b"DATA", b"BDAT 10 LAST",
    b"AUTH PLAIN AGFAAGI=", b"AUTH LOGIN", b"AUTH CRAM-MD5", b"QUIT", b"XCLIENT ADDR=1.2.3.4", b"TURN", b"ETRN x",
]
BODIES = [b"Subject: x\r\n\r\nhi", b"", b"..\r\n.x\r\n\r\n.", b"a\nb\rc\r\n\xff\xfe", b"Subject: " + b"y" * 3000]
#: Replies after which the server has closed the session (or is about to): not a problem.
GOODBYE = re.compile(rb"^(221|421|502 5\.5\.1 Too many)")


class _Session:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.file = self.sock.makefile("rb")
        self.greeting = self.reply()
        self.command(b"EHLO fuzz.test")

    def reply(self) -> bytes:
        """One reply, all its lines; b"" when the connection closed, b"timeout" on silence."""
        lines = []
        while True:
            try:
                line = self.file.readline()
            except TimeoutError:
                return b"timeout"
            if not line:
                return b"".join(lines)
            lines.append(line)
            if line[3:4] != b"-":
                return b"".join(lines)

    def command(self, data: bytes) -> bytes:
        self.sock.sendall(data + b"\r\n")
        return self.reply()

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def check(findings: Findings, data: bytes, answer: bytes) -> None:
    """Count an answer and note it as a problem when it is not an SMTP reply, or an internal error."""
    if not answer:
        findings.count("closed")
        return
    if answer == b"timeout":
        findings.count("timeout")
        return
    findings.count(answer[:1].decode("ascii", "replace") + "xx")
    lines = answer.split(b"\r\n")
    if lines[-1] or not all(re.fullmatch(rb"\d{3}([ -][^\r\n]*)?", line) for line in lines[:-1]):
        findings.problems.append(f"{data!r} -> not an SMTP reply: {answer[:200]!r}")
    if b"Internal error" in answer or b"Traceback" in answer or answer.startswith(b"451 4.3.0"):
        findings.problems.append(f"{data!r} -> {answer[:200]!r}")


def run(port: int, count: int = 2000, seconds: float = 60.0, seed: int = 1, pid: int | None = None) -> Findings:
    rng = random.Random(seed)
    findings = Findings()
    session = _Session(port)

    def step(_: int) -> None:
        nonlocal session
        # A line feed would make two commands of one input (and two replies): the line ends here.
        data = pick(rng, CORPUS).replace(b"\n", b"")
        if data.upper().lstrip().startswith(b"STARTTLS"):
            return  # the fuzzer speaks no TLS
        findings.sent += 1
        try:
            answer = session.command(data)
            check(findings, data, answer)
            if answer.startswith(b"354"):
                answer = session.command(rng.choice(BODIES) + b"\r\n.")
                check(findings, data + b" (DATA)", answer)
            elif answer.startswith(b"334"):
                answer = session.command(rng.choice([b"*", b"AGFAAGI=", b"%%%", b""]))
                check(findings, data + b" (AUTH answer)", answer)
        except OSError as exc:
            answer = repr(exc).encode()
        if not answer or answer == b"timeout" or GOODBYE.match(answer) or answer.startswith(b"ConnectionReset"):
            if not GOODBYE.match(answer):
                findings.problems.append(f"{data!r}: {'no reply' if answer == b'timeout' else 'closed'} "
                                         "without the protocol's goodbye")
            session.close()
            session = _Session(port)

    try:
        run_bounded(step, count, seconds, findings, pid)
    finally:
        session.close()
    return findings


def main() -> None:
    args = arguments("Mutation-fuzz a running cassmail SMTP listener.", login=False).parse_args()
    report(run(args.port, args.count, args.seconds, args.seed, args.pid))


if __name__ == "__main__":
    main()
