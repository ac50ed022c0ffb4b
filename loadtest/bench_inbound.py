"""MX ingest with the inbound checks off, with sender authentication, and with rspamd, beside
Postfix alone and Postfix with rspamd as its milter: what the checks cost.

Not a test. One command, every server in turn on this machine:

    flock /work/bench.lock .venv/bin/python loadtest/bench_inbound.py

What it does:

1. A DNS server of its own on loopback (the tests' dnslib server) holding the SPF, DKIM and
   DMARC (p=reject) records of the sending domain `sender.bench`, and a real rspamd (Debian's
   package, its own configuration directory, loopback ports, DNS pointed at that server, the
   modules that ask the internet off; `tests/inbound_peers.py`; one normal and one proxy worker
   per core, rspamd's default) with its proxy worker in milter mode for Postfix.
2. A pool of DKIM-signed messages from `sender.bench` (dkimpy, a 2048-bit key, fresh
   Message-IDs), --size bytes each, made before any run.
3. For each server: --connections SMTP clients (aiosmtplib, in this process) send from
   127.0.0.1 as fast as the server answers, each message to one of --users users, for --seconds
   of which the first --warmup are not counted. The rate and the time from MAIL FROM to the
   reply to DATA of each message counted are the figures. The servers:
   - `cassmail off`: the MX with `[inbound]` at its defaults (nothing checked);
   - `cassmail auth`: `inbound.authentication = true` (SPF of MAIL FROM and HELO, DKIM, ARC,
     DMARC through the local DNS server, via `relay.nameservers`);
   - `cassmail auth+rspamd`: that and `inbound.rspamd_url` (rspamd's normal worker);
   - `Postfix`: a private instance (loadtest/baseline.py), no checks;
   - `Postfix+rspamd`: the same with `smtpd_milters` = rspamd's proxy (rspamd does SPF, DKIM,
     DMARC and ARC itself, through the same DNS server, and the spam rules).
   cassmail runs on the mbox store (fsync on) by default, or on Cassandra with
   --backend cassandra (--set store.cassandra.port=... names the node; a fresh keyspace).
4. Each server's stored mail is counted afterwards (cassmail: INBOX through the Store API;
   Postfix: its Maildirs once its queue is empty) and must equal what was accepted; CPU seconds
   of the server, of rspamd and of this process (the clients) over the counted window, the same
   per message counted (the cost of the checks, less sensitive than the rate to what else the
   machine runs), and the whole machine's busy cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import email.utils
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiosmtplib
import dkim

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cassmail.delivery.dkim import generate  # noqa: E402
from cassmail.store import make_store  # noqa: E402
from cassmail.store.base import Store  # noqa: E402

from _common import (CassmailNode, bench_settings, count_inboxes, delta, fmt, machine_cpu, make_users,  # noqa: E402
                     markdown, own_cpu, pct, positive, tree_cpu)
from baseline import Postfix, ensure_packages  # noqa: E402
from tests.inbound_peers import RspamdServer  # noqa: E402
from tests.outbound_peers import Dns  # noqa: E402

SENDER_DOMAIN = "sender.bench"
SENDER = f"news@{SENDER_DOMAIN}"
HELO = f"mail.{SENDER_DOMAIN}"


def log(text: str = "") -> None:
    print(text, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=positive(float), default=40.0, help="length of each server's run")
    p.add_argument("--warmup", type=positive(float), default=10.0, help="seconds of each run not counted")
    p.add_argument("--connections", type=positive(int), default=8, help="SMTP clients at once")
    p.add_argument("--size", type=positive(int), default=5000, help="bytes of each message (about)")
    p.add_argument("--users", type=positive(int), default=100, help="recipients")
    p.add_argument("--pool", type=positive(int), default=500, help="distinct signed messages")
    p.add_argument("--workers", type=int, default=0, help="cassmail worker processes (0 = one per core)")
    p.add_argument("--backend", choices=("mbox", "cassandra"), default="mbox", help="cassmail's store")
    p.add_argument("--config", default=None, help="a cassmail config file for the store settings")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="setting=value (cassmail)")
    p.add_argument("--targets", default="off,auth,rspamd,postfix,postfix-rspamd",
                   help="runs, comma separated: off, auth, rspamd (cassmail auth+rspamd), postfix, postfix-rspamd")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(args.targets) - {"off", "auth", "rspamd", "postfix", "postfix-rspamd"}
    if unknown or not args.targets:
        p.error(f"--targets: unknown {', '.join(sorted(unknown)) or '(none given)'}")
    if args.warmup >= args.seconds:
        p.error("--warmup must be shorter than --seconds")
    return args


def signed_pool(n: int, size: int, key: bytes) -> list[bytes]:
    """n messages of about `size` bytes from SENDER, each DKIM-signed with its own Message-ID."""
    line = b"The quarterly figures are attached below; nothing here is urgent, read at leisure.\r\n"
    body = line * max(1, size // len(line))
    out = []
    for i in range(n):
        head = (f"From: News <{SENDER}>\r\nTo: reader@bench\r\nSubject: bulletin {i}\r\n"
                f"Message-ID: <{secrets.token_hex(8)}.{i}@{SENDER_DOMAIN}>\r\n"
                f"Date: {email.utils.formatdate(usegmt=True)}\r\nMIME-Version: 1.0\r\n"
                "Content-Type: text/plain; charset=us-ascii\r\n\r\n").encode()
        msg = head + body
        out.append(dkim.sign(msg, b"bench", SENDER_DOMAIN.encode(), key,
                             include_headers=[b"from", b"to", b"subject", b"message-id", b"date"]) + msg)
    return out


@dataclasses.dataclass
class Counted:
    accepted: int = 0
    #: Accepted over the whole run, warm-up included: what the store must hold afterwards.
    total: int = 0
    refused: int = 0
    errors: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)


async def drive(port: int, users: list[str], pool: list[bytes], args: argparse.Namespace,
                on_window: "asyncio.Future[None] | None" = None) -> tuple[Counted, float]:
    """Send for args.seconds from args.connections clients; (what the counted window saw, its length)."""
    start = time.monotonic()
    window_start, stop = start + args.warmup, start + args.seconds
    counted = Counted()

    async def client(n: int) -> None:
        i = n
        while time.monotonic() < stop:
            smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, local_hostname=HELO, timeout=60,
                                   start_tls=False)
            try:
                await smtp.connect()
                for _ in range(50):
                    if time.monotonic() >= stop:
                        break
                    i += args.connections
                    t0 = time.monotonic()
                    try:
                        await smtp.sendmail(SENDER, [users[i % len(users)]], pool[i % len(pool)])
                        ok = True
                        counted.total += 1
                    except aiosmtplib.SMTPResponseException:
                        ok = False
                    if t0 >= window_start:
                        if ok:
                            counted.accepted += 1
                            counted.latencies.append(time.monotonic() - t0)
                        else:
                            counted.refused += 1
                await smtp.quit()
            except (aiosmtplib.SMTPException, OSError):
                counted.errors += 1
                await asyncio.sleep(0.1)

    async def mark() -> None:
        await asyncio.sleep(args.warmup)
        if on_window is not None and not on_window.done():
            on_window.set_result(None)

    await asyncio.gather(mark(), *(client(n) for n in range(args.connections)))
    return counted, args.seconds - args.warmup


@dataclasses.dataclass
class Row:
    name: str
    counted: Counted
    window: float
    stored: int
    total_accepted: int
    cpu_server: float | None
    cpu_rspamd: float | None
    cpu_clients: float | None
    busy: float | None

    def cells(self) -> list[str]:
        lat = [x * 1000 for x in self.counted.latencies]
        rate = self.counted.accepted / self.window
        n = self.counted.accepted

        def per_message(cpu: float | None) -> str:
            return fmt(cpu * 1000 / n if cpu is not None and n else None, ".2f")

        return [self.name, f"{rate:,.0f}", fmt(pct(lat, 50)), fmt(pct(lat, 99)),
                f"{self.counted.refused + self.counted.errors}", f"{self.stored:,} / {self.total_accepted:,}",
                f"{per_message(self.cpu_server)} / {per_message(self.cpu_rspamd)}",
                f"{fmt(self.cpu_server)} / {fmt(self.cpu_rspamd)} / {fmt(self.cpu_clients)}", fmt(self.busy, ".2f")]


async def measure(name: str, port: int, server_cpu, rspamd: RspamdServer | None, users: list[str],
                  pool: list[bytes], args: argparse.Namespace) -> tuple[Counted, float, list[float | None]]:
    """Run the clients; CPU and machine time over the counted window only."""
    loop = asyncio.get_running_loop()
    window: asyncio.Future[None] = loop.create_future()
    marks: list[tuple[float | None, float | None, float, tuple[float, float]]] = []

    async def sample() -> None:
        await window
        marks.append((server_cpu(), tree_cpu(rspamd.process.pid) if rspamd and rspamd.process else None,
                      own_cpu(), machine_cpu()))

    sampler = asyncio.ensure_future(sample())
    counted, length = await drive(port, users, pool, args, window)
    await sampler
    end = (server_cpu(), tree_cpu(rspamd.process.pid) if rspamd and rspamd.process else None, own_cpu(), machine_cpu())
    start = marks[0]
    busy = (end[3][0] - start[3][0]) / length
    return counted, length, [delta(start[0], end[0]), delta(start[1], end[1]), end[2] - start[2], busy]


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-inbound-"))
    os.chmod(workdir, 0o755)  # Postfix's processes (user postfix, nobody) go through it
    dns = Dns().start()
    pem, public = generate(2048)
    zone = dns.zone
    zone.add(f"bench._domainkey.{SENDER_DOMAIN}", "TXT",
             " ".join(f'"{t[i:i + 200]}"' for t in [f"v=DKIM1; k=rsa; p={public}"] for i in range(0, len(t), 200)))
    zone.add(SENDER_DOMAIN, "TXT", '"v=spf1 ip4:127.0.0.1 -all"')
    zone.add(HELO, "TXT", '"v=spf1 ip4:127.0.0.1 -all"')
    zone.add(f"_dmarc.{SENDER_DOMAIN}", "TXT", '"v=DMARC1; p=reject"')
    rspamd = RspamdServer(workdir / "rspamd", dns.address, milter=True, workers=os.cpu_count() or 1)
    need_rspamd = bool({"rspamd", "postfix-rspamd"} & set(args.targets))
    if need_rspamd:
        rspamd.start_process()
    log(f"# bench_inbound: {args.connections} connections, {args.size}-byte DKIM-signed messages, "
        f"{args.seconds:g} s per run ({args.warmup:g} s warm-up), cassmail on {args.backend}")
    pool = signed_pool(args.pool, args.size, pem.encode())
    rows: list[Row] = []
    try:
        if need_rspamd:
            rspamd.wait()
        domain = f"bench-{secrets.token_hex(4)}.example"
        settings = bench_settings(args.config, args.overrides, args.backend, "bench_inbound", workdir / "mbox")
        store: Store = make_store(settings)
        await store.open()
        try:
            await store.add_domain(domain)
            users = await make_users(store, domain, args.users)
            for target in args.targets:
                if target.startswith("postfix"):
                    continue
                inbound: dict[str, object] = {}
                if target in ("auth", "rspamd"):
                    inbound = {"authentication": True}
                if target == "rspamd":
                    inbound["rspamd_url"] = rspamd.url
                s = dataclasses.replace(settings)
                s.inbound = dataclasses.replace(settings.inbound, **inbound)
                s.relay = dataclasses.replace(settings.relay, nameservers=[dns.address], dns_timeout=5.0)
                node = CassmailNode(s, workdir / target, ["smtp"], workers=args.workers, name=f"cassmail-{target}")
                node.start()
                before, _ = await count_inboxes(store, users)
                try:
                    counted, length, cpu = await measure(target, node.ports["smtp"], node.cpu,
                                                         rspamd if target == "rspamd" else None, users, pool, args)
                finally:
                    log(f"  cassmail {target}: {node.stop()}")
                after, _ = await count_inboxes(store, users)
                rows.append(Row(f"cassmail {'auth+rspamd' if target == 'rspamd' else target}", counted, length,
                                after - before, counted.total, *cpu))
                log(f"  {rows[-1].cells()}")
        finally:
            await store.close()
        for target in args.targets:
            if not target.startswith("postfix"):
                continue
            ensure_packages(postal=False, postfix=True, say=log)
            postfix = Postfix(workdir / target, domain, users)
            postfix.configure()
            if target == "postfix-rspamd":
                postfix.postconf("-e", f"smtpd_milters = inet:127.0.0.1:{rspamd.milter_port}",
                                 "milter_default_action = accept", "milter_protocol = 6")
            postfix.start()
            try:
                counted, length, cpu = await measure(target, postfix.port, postfix.cpu,
                                                     rspamd if target == "postfix-rspamd" else None, users, pool, args)
                postfix.wait_queue_empty()
                stored, _ = postfix.delivered()
            finally:
                log(f"  {target}: {postfix.stop()}")
            name = "Postfix+rspamd milter" if target == "postfix-rspamd" else "Postfix"
            rows.append(Row(name, counted, length, stored, counted.total, *cpu))
            log(f"  {rows[-1].cells()}")
    finally:
        rspamd.stop()
        dns.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"kept {workdir}")
    log()
    head = ["server / checks", "msgs/s", "p50 ms", "p99 ms", "refused+errors", "stored / accepted (whole run)",
            "CPU ms per message: server / rspamd", "CPU s: server / rspamd / clients", "machine busy (cores)"]
    for line in markdown(head, [r.cells() for r in rows], left={0}):
        log(line)
    base = {r.name.split()[0]: r for r in rows if r.name in ("cassmail off", "Postfix")}
    for r in rows:
        ref = base.get(r.name.split()[0])
        if ref is not None and r is not ref and ref.counted.accepted:
            log(f"- {r.name}: {r.counted.accepted / r.window / (ref.counted.accepted / ref.window):.2f}x "
                f"the rate of {ref.name}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
