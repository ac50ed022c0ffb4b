"""The comparison run: cassmail side by side with Postfix and Dovecot on one machine, in one run.

    .venv/bin/python loadtest/compare.py --set store.cassandra.port=29042

1. Installs Debian's postal, postfix and dovecot-{core,pop3d,imapd} when missing, so that no
   system instance is configured or started (see loadtest/baseline.py).
2. Targets, one after the other, each with the same --users users (password "pw") in one
   fresh domain; cassmail's users hold scrypt hashes (N=2^10), Dovecot's a hash whose check
   costs about as much (--dovecot-hash):
   - `baseline`: a private Postfix (SMTP, virtual domain into Maildirs) and a private Dovecot
     (POP3/IMAP on the same Maildirs), in a temporary directory, on free 127.0.0.1 ports;
   - `cassandra`: `cassmail serve` (SMTP and POP3) on a fresh keyspace, SimpleStrategy RF=1,
     read and write consistency ONE (the Cassandra from --config/--set; none is started here);
   - `mbox`: `cassmail serve` on the mbox store in the temporary directory.
3. Per target and size range: postal sends for --seconds, then rabid retrieves and deletes for
   --seconds (the mail postal just delivered). Throughput is sampled every --interval seconds;
   the first interval is warm-up and the last --average-last are averaged (the CassMail
   paper's method, scaled down: it ran 10 minutes and averaged the last 5). CPU of the
   servers, Cassandra and the load generator is sampled at the same ticks.
4. Prints one table, the ratios cassmail / baseline per tool and size range, and writes
   report.md with its plots (loadtest/report.py) into --out.
Every load run is bounded by --seconds; everything started is stopped at the end (also on
Ctrl-C), the keyspace dropped and the temporary directory removed (--keep keeps them).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import traceback
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from cassmail.config import ConfigError, Settings

import report
from _common import (BENCH_HASH, PASSWORD, CassandraCpu, CassmailNode, bench_settings, count_inboxes, make_users, number,
                     parse_ranges, range_label, run_cmd, scrypt_verify_ms)
from baseline import Dovecot, Postfix, choose_dovecot_hash, ensure_packages, maildir_count
from postal import LoadRun, Probes, StoreSide, run_postal, run_rabid, write_users

TARGETS = ("baseline", "cassandra", "mbox")
BASELINE_NAME = report.BASELINE
#: A run starts once Cassandra has calmed down from the previous one (flushes, compaction),
#: waiting at most QUIET_MAX seconds for it to use less than QUIET_CORES.
QUIET_MAX = 60.0
QUIET_CORES = 0.3


def say(text: str = "") -> None:
    print(text, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="cassmail vs Postfix+Dovecot under postal and rabid, one machine, one run.")
    p.add_argument("--config", metavar="FILE", help="cassmail settings: which Cassandra (default: built-ins)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set store.cassandra.port=29042 (repeatable)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated, in order (default {','.join(TARGETS)})")
    p.add_argument("--sizes", type=parse_ranges, default=parse_ranges("200K-2M,50K-500K"),
                   help="message size ranges (default 200K-2M,50K-500K: the CassMail paper's)")
    p.add_argument("--seconds", type=number(float), default=90.0, help="each postal and each rabid run (default 90)")
    p.add_argument("--interval", type=number(float, 0.5), default=15.0, help="seconds per sample (default 15)")
    p.add_argument("--average-last", type=number(int), default=5, help="intervals averaged (default 5)")
    p.add_argument("--users", type=number(int), default=200, help="mailboxes (default 200)")
    p.add_argument("--threads", type=number(int), default=32, help="postal threads (default 32)")
    p.add_argument("--processes", type=number(int), default=8, help="rabid processes (default 8)")
    p.add_argument("--workers", type=number(int, 0), default=0, help="cassmail workers (default 0 = one per core)")
    p.add_argument("--no-rabid", dest="rabid", action="store_false", help="SMTP only")
    p.add_argument("--dovecot-hash", default="auto", metavar="SCHEME[:COST]",
                   help="the hash Dovecot checks POP3 logins against: auto (BLF-CRYPT at the cost nearest the "
                        "scrypt hash of cassmail's users here, N=2^10), PLAIN (Dovecot's default: none), or e.g. "
                        "SHA512-CRYPT:5000")
    p.add_argument("--out", type=Path, help="result directory (default loadtest-results/compare-<time>)")
    p.add_argument("--keep", action="store_true", help="keep the keyspace and the temporary directory")
    args = p.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.targets if t not in TARGETS]
    if bad or not args.targets:
        p.error(f"--targets: choose from {', '.join(TARGETS)}")
    # Absolute: the load generators run in directories of their own and read the users file from there.
    args.out = (args.out or Path("loadtest-results") / f"compare-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}").resolve()
    return args


class Target:
    """One server under test: start, CPU probes, a count of the mail it holds, stop."""

    name = ""
    probes: Probes

    def start(self) -> None:
        raise NotImplementedError

    def ports(self) -> tuple[int, int]:
        """(SMTP, POP3) ports on 127.0.0.1."""
        raise NotImplementedError

    def count(self) -> tuple[int, int]:
        """(messages, bytes) the server holds for the test users."""
        raise NotImplementedError

    def quiet(self) -> float:
        """Wait until the previous run's background work is done; seconds waited."""
        return 0.0

    def after_postal(self) -> str | None:
        return None

    def stop(self) -> list[str]:
        raise NotImplementedError


class Baseline(Target):
    name = BASELINE_NAME

    def __init__(self, workdir: Path, domain: str, users: list[str], stored: str) -> None:
        self.postfix = Postfix(workdir, domain, users)
        self.dovecot = Dovecot(workdir, self.postfix.mail, users, PASSWORD, hashes={u: stored for u in users})
        self.probes = {"Postfix": self.postfix.cpu, "Dovecot": self.dovecot.cpu}

    def start(self) -> None:
        self.postfix.configure()
        self.postfix.start()
        self.dovecot.configure()
        self.dovecot.start()
        version = run_cmd(["postconf", "-c", str(self.postfix.dir), "-h", "mail_version"], check=False).strip()
        say(f"  Postfix {version} master pid {self.postfix.master_pid()} on 127.0.0.1:{self.postfix.port}, "
            f"Dovecot {self.dovecot.version()} pid {self.dovecot.master_pid()} POP3 :{self.dovecot.pop3_port} "
            f"IMAP :{self.dovecot.imap_port}, in {self.postfix.dir.parent}")

    def ports(self) -> tuple[int, int]:
        return self.postfix.port, self.dovecot.pop3_port

    def after_postal(self) -> str | None:
        waited, left = self.postfix.wait_queue_empty(120)
        if left:
            return f"{left} messages still in Postfix's queue {waited:.0f} s after postal stopped"
        return f"Postfix's queue emptied {waited:.0f} s after postal stopped" if waited > 2 else None

    def count(self) -> tuple[int, int]:
        return maildir_count(self.postfix.mail)

    def stop(self) -> list[str]:
        return [f"Dovecot: {self.dovecot.stop()}", f"Postfix: {self.postfix.stop()}"]


class Cassmail(Target):
    def __init__(self, name: str, settings: Settings, workdir: Path, domain: str, n_users: int, workers: int) -> None:
        self.name = name
        self.settings = settings
        self.workdir = workdir
        self.domain = domain
        self.n_users = n_users
        self.workers = workers
        self.side: StoreSide | None = None
        self.node: CassmailNode | None = None
        self.users: list[str] = []
        self.made_keyspace = False
        c = settings.store.cassandra
        self.cass = CassandraCpu(c.contact_points, c.port) if settings.store.backend == "cassandra" else None
        self.probes = {}

    def start(self) -> None:
        if self.settings.store.backend == "cassandra":
            from cassmail.store import cassandra_schema

            self.made_keyspace = True
            cassandra_schema.apply(self.settings.store.cassandra)
        self.side = StoreSide(self.settings)
        self.side.call(self.side.store.add_domain(self.domain))
        self.users = self.side.call(make_users(self.side.store, self.domain, self.n_users))
        self.node = CassmailNode(self.settings, self.workdir, ["smtp", "pop3"], self.workers,
                                 name=self.name.replace(" ", "-").replace("(", "").replace(")", "")).start()
        self.probes = {"cassmail": self.node.cpu}
        if self.cass is not None and self.cass.enabled:
            self.probes["Cassandra"] = self.cass.seconds
        store = self.settings.store
        where = (f"keyspace {store.cassandra.keyspace} on {','.join(store.cassandra.contact_points)}:"
                 f"{store.cassandra.port} (RF=1, CL=ONE)" if store.backend == "cassandra" else f"mbox in {store.mbox.path}")
        say(f"  cassmail serve pid {self.node.pid}, {self.node.workers} worker(s), SMTP :{self.node.ports['smtp']} "
            f"POP3 :{self.node.ports['pop3']}, {where}" + (f"; {self.cass.label}" if self.cass else ""))

    def ports(self) -> tuple[int, int]:
        assert self.node is not None
        return self.node.ports["smtp"], self.node.ports["pop3"]

    def count(self) -> tuple[int, int]:
        assert self.side is not None
        return self.side.call(count_inboxes(self.side.store, self.users))

    def quiet(self) -> float:
        """Wait (bounded) until Cassandra is done with the previous run's flushes and compactions."""
        return self.cass.wait_quiet(QUIET_MAX, QUIET_CORES) if self.cass is not None else 0.0

    def stop(self) -> list[str]:
        out = []
        if self.node is not None:
            out.append(f"{self.name}: {self.node.stop()}")
            problems = [ln for ln in self.node.log_text(200_000).splitlines() if "level=error" in ln or "Traceback" in ln]
            if problems:
                out.append(f"  its log had {len(problems)} error line(s), first: {problems[0][:300]}")
        if self.side is not None:
            self.side.close()
        if self.made_keyspace:
            from cassmail.store import cassandra_schema

            try:
                cassandra_schema.drop(self.settings.store.cassandra)
                out.append(f"  dropped keyspace {self.settings.store.cassandra.keyspace}")
            except Exception as exc:  # noqa: BLE001 - cleanup reports, never hides the results
                out.append(f"  could not drop keyspace {self.settings.store.cassandra.keyspace}: {exc}")
        return out


def run_target(target: Target, args: argparse.Namespace, users_files: tuple[Path, Path], out: Path) -> list[LoadRun]:
    runs: list[LoadRun] = []
    smtp, pop3 = target.ports()
    for lo, hi in args.sizes:
        label = range_label(lo, hi)
        waited = target.quiet()
        say(f"\n### {target.name}, {label} (load average {os.getloadavg()[0]:.2f}"
            + (f", waited {waited:.0f} s for a quiet Cassandra" if waited > 5 else "") + ")")
        before = target.count()
        run = run_postal(target.name, smtp, (lo, hi), users_files[0], out, args.seconds, args.threads,
                         interval=args.interval, average_last=args.average_last, probes=target.probes, say=say)
        note = target.after_postal()
        if note:
            run.notes.append(note)
        run.server_before, run.server_after = before, target.count()
        run.save(out / "json")
        runs.append(run)
        say(f"    the server holds {run.server_after[0] - before[0]} new messages; postal logged {run.total} "
            f"in the measured time")
        if args.rabid:
            target.quiet()
            before = run.server_after
            run = run_rabid(target.name, pop3, label, users_files[1], out, args.seconds, args.processes,
                            interval=args.interval, average_last=args.average_last, probes=target.probes, say=say,
                            messages=before[0])
            run.server_before, run.server_after = before, target.count()
            run.save(out / "json")
            runs.append(run)
            say(f"    {before[0] - run.server_after[0]} messages deleted; rabid logged {run.total} retrievals")
    return runs


def dovecot_login_hash(spec: str, scrypt_ms: float) -> tuple[str, str, float]:
    """(stored hash, label, ms per check) of Dovecot's users. rabid logs in to mailboxes picked at
    random, so as they empty, more and more of its sessions find nothing: in a 50K-500K run there
    are about 40 logins a second beside 220 retrievals. cassmail checks each against a scrypt
    hash; Dovecot's {PLAIN} would leave that cost out of its side of the comparison."""
    if spec.upper() == "PLAIN":
        return "{PLAIN}" + PASSWORD, "{PLAIN}, no hash", 0.0
    return choose_dovecot_hash(spec, scrypt_ms)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cass_settings = (bench_settings(args.config, args.overrides, "cassandra", "compare")
                         if "cassandra" in args.targets else None)
    except ConfigError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    try:
        ensure_packages(postal=True, postfix="baseline" in args.targets, dovecot="baseline" in args.targets, say=say)
    except Exception as exc:  # noqa: BLE001
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="cassmail-compare-"))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    domain = f"compare-{secrets.token_hex(4)}.example"
    users = [f"u{i:04d}@{domain}" for i in range(args.users)]
    users_files = write_users(users, out)
    started = datetime.now(timezone.utc)
    logins = ""
    if "baseline" in args.targets:
        scrypt_ms = scrypt_verify_ms(BENCH_HASH)
        stored, label, dovecot_ms = dovecot_login_hash(args.dovecot_hash, scrypt_ms)
        logins = (f"- POP3 logins: cassmail's users hold scrypt hashes (N=2^{BENCH_HASH.log2_n}, one check "
                  f"{scrypt_ms:.1f} ms here), Dovecot's {label} ({dovecot_ms:.1f} ms)")
    preface = [
        f"- started {started:%Y-%m-%d %H:%M} UTC on {os.uname().nodename}: {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- command: `{' '.join([Path(sys.executable).name, 'loadtest/compare.py', *(argv if argv is not None else sys.argv[1:])])}`",
        f"- {args.users} mailboxes; postal -t {args.threads}, rabid -p {args.processes}; {args.seconds:g} s per run, "
        f"samples every {args.interval:g} s, first dropped, last {args.average_last} averaged",
        *([logins] if logins else []),
        "",
    ]
    say("# cassmail vs Postfix+Dovecot")
    for line in preface:
        say(line)
    runs: list[LoadRun] = []
    status = 0
    for name in args.targets:
        target: Target
        if name == "baseline":
            target = Baseline(workdir, domain, users, stored)
        elif name == "cassandra":
            assert cass_settings is not None
            target = Cassmail("cassmail (Cassandra)", cass_settings, workdir / "cassandra", domain, args.users, args.workers)
        else:
            settings = bench_settings(args.config, args.overrides, "mbox", mbox_path=workdir / "mbox-store")
            target = Cassmail("cassmail (mbox)", settings, workdir / "mbox", domain, args.users, args.workers)
        say(f"\n## {target.name}")
        try:
            target.start()
            runs += run_target(target, args, users_files, out)
        except KeyboardInterrupt:
            say("\ninterrupted")
            status = 130
        except Exception as exc:  # noqa: BLE001 - report what was measured, stop what was started
            say(f"\n{target.name} stopped by {type(exc).__name__}: {exc}")
            traceback.print_exc()
            status = 1
        finally:
            for line in target.stop():
                say("  " + line)
            if not args.keep:  # free the disk before the next target
                for sub in ("postfix", "dovecot", "mbox-store", "cassandra", "mbox"):
                    shutil.rmtree(workdir / sub, ignore_errors=True)
        if status == 130:
            break
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        say(f"--keep: left {workdir}")
    if not runs:
        return status or 1
    say("\n## results\n")
    for line in report.runs_table(runs):
        say(line)
    ratios = report.ratio_table(runs, BASELINE_NAME)
    if ratios:
        say("")
        for line in ratios:
            say(line)
    path = report.build([out], out, BASELINE_NAME, "cassmail vs Postfix+Dovecot", preface)
    say(f"\nreport: {path}")
    idle = [f"{r.server} {r.tool} {r.sizes}" for r in runs if r.total == 0]
    if idle:
        say(f"no message counted in: {', '.join(idle)} (see the notes in the report)")
    return status or (1 if idle else 0)


if __name__ == "__main__":
    sys.exit(main())
