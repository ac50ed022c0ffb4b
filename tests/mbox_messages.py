"""The test user and the reproducible messages of the mbox store's tests, in a module of their
own: the crash tests' worker processes import it (and not the test module, which would import
pytest into every one of them)."""

from __future__ import annotations

import hashlib
import random

USER = "anne@example.org"


def body_for(n: int, size: int | None = None) -> bytes:
    """A reproducible message: headers, some From_ lines to quote, and `size`-ish bytes of text."""
    rnd = random.Random(n)
    size = size if size is not None else rnd.randint(300, 11_000)
    lines = [b"From: sender%d@example.net\r\n" % n, b"Subject: message %d\r\n" % n, b"\r\n"]
    if n % 3 == 0:
        lines += [b"From the start of a line\r\n", b">From already quoted\n", b">>From twice\n"]
    while sum(map(len, lines)) < size:
        lines.append(hashlib.sha256(b"%d-%d" % (n, len(lines))).hexdigest().encode() + b"\r\n")
    body = b"".join(lines)[:size]
    return body if n % 4 else body.rstrip(b"\r\n")  # some without a final newline
