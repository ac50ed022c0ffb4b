"""Outbound benchmark: mail relayed to another domain, end to end, cassmail against Postfix.

Not a test. postal submits to a remote-bound domain (`sink.bench`) through each server, and
each server relays it through its transport map to the same fast SMTP sink
(loadtest/sink.py, counting what arrives); what is measured is what reaches the sink:

    .venv/bin/python loadtest/bench_outbound.py                  # Postfix, cassmail on Cassandra and on mbox

1. Installs the Debian packages `postal` and `postfix` when missing (as bench_smtp.py does).
2. The sink on a free 127.0.0.1 port (its own process).
3. Postfix: a private instance (`postfix -c DIR`, /etc/postfix untouched) that relays for
   127.0.0.0/8 (mynetworks) with `transport_maps` sending sink.bench to the sink, TLS off, its
   default concurrency (20 per destination).
4. cassmail: `cassmail serve` with the submission listener trusting 127.0.0.0/8 (postal has
   no AUTH: `submission.trusted_networks`, Postfix's mynetworks), `relay.transport` sending
   sink.bench to the sink, `relay.tls = "none"`, destination_concurrency 20; on Cassandra (a
   node of its own started with the launcher unless --cassandra HOST:PORT names one; a fresh
   keyspace, RF=1, reads and writes at ONE) and on the mbox store (fsync on, like Postfix).
5. Per size range and server: postal for --seconds; the sink's count over the last
   (--seconds - --warmup) seconds is the throughput (messages/min, MB/s of message bytes as
   the sink received them); then postal stops and the server's queue is left to empty (at most
   --drain seconds), and the sink's total is checked against what is still queued. CPU
   seconds of the server (cassmail or Postfix), Cassandra, postal and the sink over the window.
6. A Markdown table and the ratios cassmail / Postfix. Everything started is stopped, the
   keyspace dropped and the work directory removed (--keep keeps them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cassmail import config
from cassmail.config import Settings
from cassmail.store import make_store
from cassmail.store.base import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RF1_CL_ONE, CassandraCpu, CassmailNode, die_with_us, free_port, human, machine_cpu,  # noqa: E402
                     parse_ranges, positive, run_cmd, tree_cpu)
from baseline import Postfix, ensure_packages  # noqa: E402
from postal import UNLIMITED_RATE, postal_kib  # noqa: E402

SINK_DOMAIN = "sink.bench"
HERE = Path(__file__).resolve().parent
BENCH_CASSANDRA = HERE.parent / "var" / "bench-cassandra"


def log(text: str = "") -> None:
    print(text, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_ranges, default=parse_ranges("10K-100K,200K-2M"),
                   help="message size ranges (decimal units), comma separated (default 10K-100K,200K-2M)")
    p.add_argument("--seconds", type=positive(float), default=90.0, help="postal's run per size and server")
    p.add_argument("--warmup", type=positive(float), default=20.0, help="seconds of each run not counted")
    p.add_argument("--drain", type=positive(float), default=180.0, help="seconds a queue may take to empty after")
    p.add_argument("--threads", type=positive(int), default=8, help="postal's connections at once")
    p.add_argument("--per-connection", type=positive(int), default=10, help="postal's messages per connection")
    p.add_argument("--recipients", type=positive(int), default=100, help="distinct sink.bench addresses")
    p.add_argument("--workers", type=int, default=0, help="cassmail worker processes (0 = one per core)")
    p.add_argument("--targets", default="postfix,cassandra,mbox",
                   help="servers to run, comma separated: postfix, cassandra (cassmail on it), mbox")
    p.add_argument("--cassandra", default="launch",
                   help="HOST:PORT of a Cassandra to use, or 'launch' (a node of its own on port 29042)")
    p.add_argument("--keep", action="store_true", help="keep the work directory, keyspace and Cassandra node")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a cassmail setting for both stores, after the benchmark's own (repeatable)")
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(args.targets) - {"postfix", "cassandra", "mbox"}
    if unknown or not args.targets:
        p.error(f"--targets: unknown {', '.join(sorted(unknown)) or '(none given)'}")
    if args.warmup >= args.seconds:
        p.error("--warmup must be shorter than --seconds")
    return args


# --------------------------------------------------------------------------- the sink


class Sink:
    """loadtest/sink.py in a process of its own; `counts()` is its latest line."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.latest = (0.0, 0, 0)
        self.workdir = workdir
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cmd = [sys.executable, str(HERE / "sink.py"), "--port", str(self.port)]
        self.proc = await asyncio.create_subprocess_exec(*die_with_us(cmd), stdout=asyncio.subprocess.PIPE,
                                                         stdin=asyncio.subprocess.DEVNULL)
        assert self.proc.stdout is not None
        first = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if not first.startswith(b"listening"):
            raise RuntimeError(f"the sink did not start: {first!r}")
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return
            t, messages, size, _ = line.split()
            self.latest = (time.monotonic(), int(messages), int(size))

    async def counts(self) -> tuple[int, int]:
        """(messages, bytes) received so far, at most a second old: waits for the next line."""
        seen = self.latest[0]
        deadline = time.monotonic() + 3
        while self.latest[0] == seen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.latest[1], self.latest[2]

    def cpu(self) -> float | None:
        return tree_cpu(self.proc.pid) if self.proc else None

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), 10)
        if self._reader is not None:
            self._reader.cancel()


# --------------------------------------------------------------------------- the servers


class RelayPostfix(Postfix):
    """The private Postfix of the baselines, relaying for loopback clients to the sink."""

    def __init__(self, workdir: Path, sink_port: int) -> None:
        super().__init__(workdir, f"local-{secrets.token_hex(3)}.example", ["postmaster"])
        self.sink_port = sink_port

    def configure(self) -> None:
        super().configure()
        (self.dir / "transport").write_text(f"{SINK_DOMAIN} smtp:[127.0.0.1]:{self.sink_port}\n")
        self.postconf(
            "-e",
            f"transport_maps = texthash:{self.dir / 'transport'}",
            "smtpd_relay_restrictions = permit_mynetworks, reject",
            "smtp_tls_security_level = none",
        )
        run_cmd(["postfix", "-c", str(self.dir), "check"])


@dataclass
class Target:
    name: str
    port: int
    queued: object  # () -> int, awaitable
    pids: object  # () -> list of pids whose trees are "the server"
    stop: object


@dataclass
class Result:
    target: str
    sizes: str
    window: float
    messages: int
    size: int
    backlog: int = 0
    drain: float = 0.0
    left: int = 0
    delivered_total: int = 0
    cpu: dict[str, float | None] = field(default_factory=dict)
    machine: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def per_minute(self) -> float:
        return self.messages / self.window * 60

    @property
    def mb_s(self) -> float:
        return self.size / self.window / 1e6


def cassmail_settings(backend: str, args: argparse.Namespace, workdir: Path, sink_port: int,
                      cassandra: tuple[str, int] | None) -> Settings:
    overrides = [
        f'relay.transport={{"{SINK_DOMAIN}" = "[127.0.0.1]:{sink_port}"}}', "relay.tls=none",
        "delivery.destination_concurrency=20", "delivery.concurrency=40", "store.max_message_size=67108864",
    ]
    if backend == "cassandra":
        assert cassandra is not None
        overrides += [f"{k}={v}" for k, v in RF1_CL_ONE.items()]
        overrides += [f"store.cassandra.contact_points={cassandra[0]}", f"store.cassandra.port={cassandra[1]}",
                      f"store.cassandra.keyspace=bench_out_{secrets.token_hex(4)}"]
    else:
        overrides += ["store.backend=mbox", f"store.mbox.path={workdir / 'mbox'}"]
    settings = config.load(env={}, overrides=[*overrides, *args.overrides])
    settings.delivery = dataclasses.replace(settings.delivery, enabled=True)
    return settings


async def start_cassmail(settings: Settings, args: argparse.Namespace, workdir: Path, name: str) -> tuple[Target, Store]:
    store = make_store(settings)
    await store.open()
    node = CassmailNode(settings, workdir, ["submission"], args.workers, name=name,
                        submission={"trusted_networks": ["127.0.0.0/8"], "max_connections": 1000})
    await asyncio.to_thread(node.start)

    async def queued() -> int:
        return len(await store.list_queue())

    async def stop() -> str:
        state = await asyncio.to_thread(node.stop)
        problems = [ln for ln in node.log_text(50000).splitlines() if "level=error" in ln or "Traceback" in ln]
        await store.close()
        return state + (f"; {len(problems)} error line(s) in its log, first: {problems[0][:300]}" if problems else "")

    log(f"cassmail ({settings.store.backend}) pid {node.pid} submission on 127.0.0.1:{node.ports['submission']}, "
        f"{node.workers} worker(s), config {node.config}")
    return Target(name, node.ports["submission"], queued, lambda: [node.pid], stop), store


async def start_postfix(workdir: Path, sink_port: int) -> Target:
    postfix = RelayPostfix(workdir, sink_port)
    await asyncio.to_thread(postfix.configure)
    await asyncio.to_thread(postfix.start)
    version = run_cmd(["postconf", "-c", str(postfix.dir), "-h", "mail_version"], check=False).strip()
    log(f"Postfix {version} on 127.0.0.1:{postfix.port}, a private instance in {postfix.dir}:")
    for change in postfix.changes:
        log("  " + change)

    async def queued() -> int:
        return await asyncio.to_thread(postfix.queued)

    async def stop() -> str:
        return await asyncio.to_thread(postfix.stop)

    return Target("Postfix", postfix.port, queued, lambda: [postfix.master_pid()], stop)


# --------------------------------------------------------------------------- one run


async def run(target: Target, sink: Sink, lo: int, hi: int, label: str, args: argparse.Namespace,
              users: Path, workdir: Path, cass: CassandraCpu | None) -> Result:
    lo_k, hi_k = postal_kib(lo, hi)
    cmd = ["postal", "-t", str(args.threads), "-c", str(args.per_connection), "-M", str(lo_k), "-m", str(hi_k),
           "-r", str(UNLIMITED_RATE), f"[127.0.0.1]{target.port}", str(users)]
    log(f"\n## {target.name}, {label}\n  {' '.join(cmd)}")
    before_total = (await sink.counts())[0]
    err = open(workdir / f"postal-{target.name}-{label}.err", "wb")
    proc = await asyncio.create_subprocess_exec(*die_with_us(cmd), stdout=asyncio.subprocess.DEVNULL, stderr=err,
                                                stdin=asyncio.subprocess.DEVNULL, cwd=workdir)
    try:
        await asyncio.sleep(args.warmup)
        m0, b0 = await sink.counts()
        t0 = time.monotonic()
        cpu0 = {"server": sum(filter(None, (tree_cpu(p) for p in target.pids()))), "postal": tree_cpu(proc.pid),
                "sink": sink.cpu(), "cassandra": cass.seconds() if cass else None}
        busy0 = machine_cpu()[0]
        await asyncio.sleep(args.seconds - args.warmup)
        m1, b1 = await sink.counts()
        t1 = time.monotonic()
        cpu1 = {"server": sum(filter(None, (tree_cpu(p) for p in target.pids()))), "postal": tree_cpu(proc.pid),
                "sink": sink.cpu(), "cassandra": cass.seconds() if cass else None}
        busy1 = machine_cpu()[0]
    finally:
        for sig, wait in ((signal.SIGINT, 5.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if proc.returncode is not None:
                break
            proc.send_signal(sig)
            try:
                await asyncio.wait_for(proc.wait(), wait)
            except asyncio.TimeoutError:
                continue
        err.close()
    result = Result(target.name, label, t1 - t0, m1 - m0, b1 - b0)
    result.cpu = {k: (cpu1[k] - cpu0[k]) if cpu1[k] is not None and cpu0[k] is not None else None for k in cpu0}
    result.machine = busy1 - busy0
    result.backlog = await target.queued()  # type: ignore[operator]
    started = time.monotonic()
    while time.monotonic() - started < args.drain:
        left = await target.queued()  # type: ignore[operator]
        if left == 0:
            break
        await asyncio.sleep(1)
    result.drain = time.monotonic() - started
    result.left = await target.queued()  # type: ignore[operator]
    await asyncio.sleep(2)
    result.delivered_total = (await sink.counts())[0] - before_total
    log(f"  {result.per_minute:.0f} msgs/min, {result.mb_s:.1f} MB/s at the sink over {result.window:.0f} s; "
        f"{result.backlog} queued when postal stopped, empty after {result.drain:.0f} s ({result.left} left); "
        f"{result.delivered_total} delivered in all")
    return result


def table(results: list[Result]) -> list[str]:
    out = ["| server | sizes | msgs/min delivered | MB/s delivered | queued at the end | drained in | "
           "CPU s: server / Cassandra / postal / sink | machine busy (cores) |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        cpu = " / ".join("-" if r.cpu.get(k) is None else f"{r.cpu[k]:.0f}" for k in ("server", "cassandra", "postal", "sink"))
        out.append(f"| {r.target} | {r.sizes} | {r.per_minute:,.0f} | {r.mb_s:.1f} | {r.backlog} | {r.drain:.0f} s | "
                   f"{cpu} | {r.machine / r.window:.2f} |")
    return out


def ratios(results: list[Result]) -> list[str]:
    lines = []
    for label in dict.fromkeys(r.sizes for r in results):
        base = next((r for r in results if r.sizes == label and r.target == "Postfix"), None)
        if base is None or not base.size:
            continue
        for r in results:
            if r.sizes == label and r.target != "Postfix":
                lines.append(f"- {label}: {r.target} / Postfix = {r.mb_s / base.mb_s:.2f}x (MB/s delivered), "
                             f"{r.per_minute / base.per_minute:.2f}x (msgs/min)")
    return lines


# --------------------------------------------------------------------------- main


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        await asyncio.to_thread(ensure_packages, True, "postfix" in args.targets, False, log)
    except Exception as exc:  # noqa: BLE001
        print(f"bench_outbound: {exc}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="bench_outbound_"))
    os.chmod(workdir, 0o755)
    users = workdir / "recipients.txt"
    users.write_text("".join(f"r{i:03d}@{SINK_DOMAIN}\n" for i in range(args.recipients)))
    log("# cassmail outbound benchmark (postal -> server -> sink)")
    log(f"  {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; work directory {workdir}")
    sink = Sink(workdir)
    results: list[Result] = []
    launched = None
    status = 0
    stores: list[tuple[Settings, Store]] = []
    try:
        await sink.start()
        log(f"sink on 127.0.0.1:{sink.port}")
        cassandra: tuple[str, int] | None = None
        if "cassandra" in args.targets:
            if args.cassandra == "launch":
                from cassmail.checkout import load_launcher

                launcher = load_launcher()
                launched = launcher.LocalCluster(BENCH_CASSANDRA, 1, cluster_name="cassmail-bench", native_port=29042,
                                                 storage_port=27000, heap_mb=1024)
                t = time.monotonic()
                await asyncio.to_thread(launched.up)
                cassandra = ("127.0.0.1", 29042)
                log(f"Cassandra (a node of its own) on 127.0.0.1:29042, up in {time.monotonic() - t:.0f} s")
            else:
                host, port = config.host_port(args.cassandra, "--cassandra")
                cassandra = (host, port)
        targets: list[Target] = []
        if "postfix" in args.targets:
            targets.append(await start_postfix(workdir, sink.port))
        for backend in ("cassandra", "mbox"):
            if backend not in args.targets:
                continue
            settings = cassmail_settings(backend, args, workdir, sink.port, cassandra)
            if backend == "cassandra":
                from cassmail.store import cassandra_schema

                await asyncio.to_thread(cassandra_schema.apply, settings.store.cassandra)
            target, store = await start_cassmail(settings, args, workdir, f"cassmail-{backend}")
            stores.append((settings, store))
            targets.append(target)
        cass = CassandraCpu([cassandra[0]], cassandra[1]) if cassandra else None
        for lo, hi in args.sizes:
            label = f"{human(lo)}-{human(hi)}"
            for target in targets:
                results.append(await run(target, sink, lo, hi, label, args, users, workdir,
                                         cass if target.name == "cassmail-cassandra" else None))
        for target in targets:
            log(f"stopped {target.name}: {await target.stop()}")  # type: ignore[operator]
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - print what was measured, clean up
        print(f"\nbench_outbound: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc()
        status = 1
    finally:
        await sink.stop()
        for settings, _ in stores:
            if settings.store.backend == "cassandra" and not args.keep:
                from cassmail.store import cassandra_schema

                await asyncio.to_thread(cassandra_schema.drop, settings.store.cassandra)
        if launched is not None and not args.keep:
            await asyncio.to_thread(launched.down)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if results:
        log("\n## results\n")
        for line in table(results):
            log(line)
        log("")
        for line in ratios(results):
            log(line)
        log(f"\nDelivered = what the sink received in the {args.seconds - args.warmup:.0f} s after a "
            f"{args.warmup:.0f} s warm-up, while postal ({args.threads} connections, up to {args.per_connection} "
            "messages each) submitted as fast as each server took it; queued at the end: accepted but not yet "
            "relayed when postal stopped; drained in: until the queue was empty. CPU over the window.")
    return status


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
