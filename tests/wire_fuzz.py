"""What the socket-level fuzzers of the three protocols share (tests/smtp_fuzz.py,
tests/pop3_fuzz.py, tests/imap_fuzz.py): the mutation of valid commands from a corpus, the
findings of a run, the worker's resident memory, and the command line of a long run.

Each protocol's module gives a session class that sends one input and reads what the server
answers, and decides what counts as a problem (an internal-error reply, a connection closed
without the protocol's goodbye, a reply that is not the protocol's).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Bytes that mean something to one of the three parsers, spliced in by `mutate`.
SPECIALS = [b"(", b")", b"[", b"]", b"<", b">", b"{", b"}", b"{0}", b"{4294967296}", b"{5+}", b'"', b"\\", b" ", b"*",
            b"%", b"\x00", b"\xff", b"\n", b"\xed\xa0\x80", b"\xc3", b"\r", b"0", b"4294967295", b"-1", b":", b",", b".",
            b"NIL", b"~{3}", b"&", b"&Jjo-", b"@", b"@a,@b:", b"xn--", b"xn--exmple-cua", b"=", b"SIZE=", b"+",
            b"\t", b"BODY[", b"HEADER.FIELDS", b"NOT ", b"OR ", b"UID ", b"1:*", b"$", b"99999999999999999999"]


@dataclass
class Findings:
    """What a run sent and got: answers counted by kind, and every problem with its input."""

    sent: int = 0
    answers: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: The worker's resident memory (KiB) after each tenth of the run, when a pid was given.
    rss_kib: list[int] = field(default_factory=list)

    def count(self, kind: str) -> None:
        self.answers[kind] = self.answers.get(kind, 0) + 1


def mutate(rng: random.Random, command: bytes, corpus: Sequence[bytes], specials: Sequence[bytes] = SPECIALS) -> bytes:
    """One to four byte- and token-level edits of a valid command: a byte changed, a special
    token or another command spliced in, a piece cut, repeated or the tail cut off."""
    data = bytearray(command)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        position = rng.randint(0, len(data))
        if choice < 0.3 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.55:
            data[position:position] = rng.choice(specials)
        elif choice < 0.7 and data:
            del data[position : position + rng.randint(1, 8)]
        elif choice < 0.8:
            data[position:position] = rng.choice(corpus)
        elif choice < 0.9 and data:
            piece = bytes(data[position : position + rng.randint(1, 20)])
            data[position:position] = piece * rng.randint(2, 50)
        else:
            data = data[: rng.randint(0, len(data))]
    return bytes(data)


def pick(rng: random.Random, corpus: Sequence[bytes], specials: Sequence[bytes] = SPECIALS) -> bytes:
    """The next input: a command of the corpus as it is one time in five (so that sessions get
    somewhere: logged in, a transaction open), else a mutated one."""
    command = rng.choice(corpus)
    return command if rng.random() < 0.2 else mutate(rng, command, corpus, specials)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident set size in KiB (VmRSS of /proc/PID/status), or another of its
    figures (RssAnon: the part that is the process's own memory, not pages of mapped files)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def run_bounded(step: Callable[[int], None], count: int, seconds: float, findings: Findings,
                pid: int | None = None) -> None:
    """Call `step(i)` up to `count` times or until `seconds` have passed, sampling the worker's
    RSS (when `pid` is given) ten times along the way and at the end."""
    deadline = time.monotonic() + seconds
    every = max(count // 10, 1)
    for i in range(count):
        if time.monotonic() >= deadline:
            break
        step(i)
        if pid is not None and i % every == 0:
            findings.rss_kib.append(rss_kib(pid))
    if pid is not None:
        findings.rss_kib.append(rss_kib(pid))


#: How much a worker may grow over the second half of a fuzz run (allocator noise, a new
#: thread's arena); a leak per input would pass it.
RSS_SLACK_KIB = 8 * 1024


def rss_growth_kib(findings: Findings) -> int:
    """How much the worker grew over the second half of the run: a leak per input shows as
    steady growth there, while the first half includes one-time warm-up (caches, imports)."""
    samples = findings.rss_kib
    if len(samples) < 2:
        return 0
    return samples[-1] - samples[len(samples) // 2]


def arguments(description: str, login: bool) -> argparse.ArgumentParser:
    """The command line of a long run by hand: where the server is, how long, which seed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, required=True)
    if login:
        parser.add_argument("--user", required=True)
        parser.add_argument("--password", required=True)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long (default an hour)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pid", type=int, help="the worker process, to report its memory")
    return parser


def report(findings: Findings) -> None:
    """Print a run's findings and exit 1 when there was a problem."""
    print(f"{findings.sent} inputs: {findings.answers}")
    if findings.rss_kib:
        print(f"worker RSS KiB: first {findings.rss_kib[0]}, last {findings.rss_kib[-1]}, max {max(findings.rss_kib)}")
    for problem in findings.problems:
        print("PROBLEM:", problem)
    raise SystemExit(1 if findings.problems else 0)
