"""Sieve benchmark: what a user's script adds to the delivery of one message, beside the delivery itself.

Not a test. It runs the Sieve step of the SMTP handler (`SieveFilter.plan`, with
the store reads it makes: the active script and the mailbox list) and the
store's `deliver` of the same message, one message at a time, in this process,
so the two columns compare directly:

    .venv/bin/python loadtest/bench_sieve.py                      # the mbox store in a temporary directory
    .venv/bin/python loadtest/bench_sieve.py --backend cassandra --set store.cassandra.port=19042

Per size and per script it delivers for --seconds (or --messages, whichever
comes first): "none" (the user has no script: one store read), "editor" (ten
rules of the kind Thunderbird's and Roundcube's editors write: header, address
and envelope tests, a :regex, a :value comparison, flags; the message ends up in
INBOX), and "body" (the editor rules plus a body :contains over the text parts).
Sizes are decimal (K = 10^3). The table gives per-message milliseconds (mean
and p99) of the Sieve step and of deliver, and the step's share of the sum.
On Cassandra a fresh keyspace is created and dropped; on mbox a temporary
directory is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cassmail.config import ConfigError
from cassmail.store import make_store
from cassmail.sieve.delivery import SieveFilter
from cassmail.store.base import Target

from _common import bench_settings, fmt, human, make_users, markdown, parse_size, pct, positive

EDITOR = r'''require ["fileinto", "imap4flags", "envelope", "regex", "relational", "comparator-i;ascii-numeric", "variables"];
if header :contains "list-id" "announce" { fileinto "Lists"; stop; }
if address :is :domain "from" "spam.example" { discard; stop; }
if header :contains "subject" ["[SPAM]", "viagra", "lottery"] { fileinto "Junk"; stop; }
if header :value "ge" :comparator "i;ascii-numeric" "x-spam-score" "10" { fileinto "Junk"; stop; }
if envelope :is "from" "boss@work.example" { addflag "\\Flagged"; }
if header :regex "subject" "^(re|fwd?): .*invoice [0-9]+" { addflag "$invoice"; }
if address :localpart :matches "to" "*-alerts" { addflag "$alert"; }
if anyof (header :contains "x-mailer" "mass", exists "x-campaign") { fileinto "Newsletters"; stop; }
if header :matches "subject" "*weekly*" { set "tag" "${1}"; }
if size :over 20M { addflag "$big"; }
'''
BODY = EDITOR.replace('"variables"]', '"variables", "body"]') + 'if body :text :contains "unsubscribe now" { fileinto "Junk"; }\n'


def message(size: int, n: int) -> bytes:
    head = (f"From: Sender {n} <sender{n}@remote.example>\r\nTo: user@bench.example\r\n"
            f"Subject: weekly figures {n}\r\nMessage-ID: <{n}.{secrets.token_hex(4)}@remote.example>\r\n"
            "Date: Tue, 24 Nov 2026 10:00:00 +0000\r\nMIME-Version: 1.0\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n\r\n").encode()
    line = b"The quick brown fox jumps over the lazy dog, then files a report.\r\n"
    return head + line * max(1, (size - len(head)) // len(line))


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("mbox", "cassandra", "wheelfs"), default="mbox")
    p.add_argument("--config", help="cassmail TOML settings (which Cassandra)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--sizes", default="10K,100K,1M", help="message sizes (default 10K,100K,1M)")
    p.add_argument("--seconds", type=positive(float), default=5.0, help="per size and script (default 5)")
    p.add_argument("--messages", type=positive(int), default=2000, help="at most this many per size and script")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="bench_sieve_"))
    try:
        settings = bench_settings(args.config, args.overrides, args.backend, "bench_sieve", workdir / "mbox")
    except ConfigError as exc:
        print(f"bench_sieve: {exc}", file=sys.stderr)
        return 2
    if args.backend == "wheelfs":
        settings.store.wheelfs.root = str(workdir / "wheelfs")
    if args.backend == "cassandra":
        from cassmail.store import cassandra_schema

        await asyncio.to_thread(cassandra_schema.apply, settings.store.cassandra)
    store = make_store(settings)
    await store.open()
    rows: list[list[str]] = []
    try:
        domain = f"bench-{secrets.token_hex(4)}.example"
        await store.add_domain(domain)
        users = await make_users(store, domain, 3)
        scripts = {"none": None, "editor": EDITOR, "body": BODY}
        sieve = SieveFilter(store, settings.sieve, "bench.example")
        print(f"# Sieve step vs deliver, {args.backend} store, {os.cpu_count()} CPUs, load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for user, (label, text) in zip(users, scripts.items()):
            if text is not None:
                await store.put_sieve_script(user, "rules", text)
                await store.set_active_sieve_script(user, "rules")
            for size in sizes:
                step: list[float] = []
                store_ms: list[float] = []
                deadline = time.monotonic() + args.seconds
                n = 0
                while n < args.messages and time.monotonic() < deadline:
                    body = message(size, n)
                    t0 = time.perf_counter()
                    plan = await sieve.plan(body, f"sender{n}@remote.example", {user: user}, [Target(user)])
                    t1 = time.perf_counter()
                    await store.deliver(body, plan.targets)
                    t2 = time.perf_counter()
                    assert [t.mailbox for t in plan.targets] == ["INBOX"], plan.targets
                    step.append((t1 - t0) * 1000)
                    store_ms.append((t2 - t1) * 1000)
                    n += 1
                share = statistics.fmean(step) / (statistics.fmean(step) + statistics.fmean(store_ms))
                rows.append([label, human(size), str(n), fmt(statistics.fmean(step), ".2f"), fmt(pct(step, 99), ".2f"),
                             fmt(statistics.fmean(store_ms), ".2f"), fmt(pct(store_ms, 99), ".2f"), f"{share:.0%}"])
                print(f"  {label:7} {human(size):>5}: {n} messages", flush=True)
        print()
        for line in markdown(["script", "size", "messages", "Sieve ms", "Sieve p99", "deliver ms", "deliver p99",
                              "Sieve share"], rows, {0, 1}):
            print(line)
    finally:
        await store.close()
        if args.backend == "cassandra":
            from cassmail.store import cassandra_schema

            await asyncio.to_thread(cassandra_schema.drop, settings.store.cassandra)
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
