"""The CassMail paper's figures 3-6, scaled to one machine, on a local cluster (`cassmail cluster`).

    .venv/bin/python loadtest/paper.py                      # the sweep and the timeline: hours
    .venv/bin/python loadtest/paper.py --nodes 1,3 --rf 1,3 --seconds 120 --no-timeline

- Figures 3-5 (the sweep): for every node count N in --nodes, replication factor R <= N in
  --rf and consistency level in --cl (at R=1 only the first: with one replica they are all ONE): `cassmail -o ...consistency=CL cluster up --nodes N --rf R`
  (a fresh cluster directory and keyspace per N and R), a fresh domain of --users users, then
  postal for --seconds per size range against every node's SMTP listener at once (postal's
  round-robin list, --threads per node), then `cassmail cluster down`. One row per
  (N, R, CL, sizes): msgs/min (mean ± sd of the averaged intervals), MB/s, errors.
- Figure 6 (the timeline): a --timeline-nodes cluster at RF --timeline-rf, postal for
  --timeline-minutes with one sample a minute (--timeline-interval), and `cassmail cluster kill K` (SIGKILL of node K's
  Cassandra) at minute --kill-at; once at CL ONE and once at ALL. Postal sends only to the front
  ends of the other nodes, so what the plot shows is the store losing a replica.
Everything is written as postal.py runs into --out and turned into report.md by report.py.

The cluster commands are the documented interface of `cassmail cluster` (up --nodes N --rf R,
kill N, start N, down); the cluster's base directory is set per run through $CASSMAIL_CLUSTER,
and its client settings (base/cassmail.toml) reach the store for users and counts. Every postal
run is bounded by --seconds (the timeline by --timeline-minutes); a cluster brought up here is
always taken down, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from cassmail import config

import report
from _common import (CASSMAIL, count_inboxes, fmt, make_users, markdown, number, parse_ranges, pid_cpu, range_label,
                     tree_cpu)
from postal import LoadRun, Probes, StoreSide, run_postal, write_users

#: How long a count after a run may keep failing once a killed node was started again for it.
RECOUNT_SECONDS = 120.0

#: The ports `cassmail cluster up` gives every node by default; --port-offset moves them all, so a
#: paper run can share the machine with a cluster or `make run` on the defaults.
CLUSTER_PORTS = {"native": 9042, "storage": 7000, "smtp": 2525, "submission": 2587, "pop3": 1110, "imap": 1143}


def say(text: str = "") -> None:
    print(text, flush=True)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The CassMail paper's sweeps (nodes, RF, CL) and failure timeline.")
    p.add_argument("--nodes", type=int_list, default=[1, 2, 3], help="node counts (default 1,2,3)")
    p.add_argument("--rf", type=int_list, default=[1, 2, 3], help="replication factors, each <= nodes (default 1,2,3)")
    p.add_argument("--cl", default="ONE,ALL", help="write (and read) consistency levels (default ONE,ALL)")
    p.add_argument("--sizes", type=parse_ranges, default=parse_ranges("200K-2M,50K-500K"))
    p.add_argument("--seconds", type=number(float), default=180.0, help="each sweep run (default 180)")
    p.add_argument("--interval", type=number(float, 0.5), default=30.0, help="sweep sample interval (default 30)")
    p.add_argument("--average-last", type=number(int), default=4)
    p.add_argument("--users", type=number(int), default=100)
    p.add_argument("--threads", type=number(int), default=16, help="postal threads per front end (default 16)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--no-timeline", dest="timeline", action="store_false")
    p.add_argument("--timeline-nodes", type=number(int), default=3)
    p.add_argument("--timeline-rf", type=number(int), default=3)
    p.add_argument("--timeline-minutes", type=number(float, 0.1), default=10.0)
    p.add_argument("--timeline-interval", type=number(float, 0.5), default=60.0,
                   help="timeline sample interval in seconds (default 60: one a minute, as in the paper)")
    p.add_argument("--kill-at", type=number(float, 0), default=3.0, help="minute the node is killed (default 3)")
    p.add_argument("--kill-node", type=number(int), default=None, help="node killed (default: the last)")
    p.add_argument("--timeline-sizes", type=parse_ranges, default=parse_ranges("50K-500K"))
    p.add_argument("--heap-mb", type=number(int), default=768, help="Cassandra heap per node (default 768)")
    p.add_argument("--port-offset", type=number(int, 0), default=0,
                   help="added to every port of the cluster (default 0: CQL 9042, SMTP 2525, ...)")
    p.add_argument("--base", type=Path, default=Path("var/paper"), help="cluster directories (default var/paper)")
    p.add_argument("--out", type=Path, help="results (default loadtest-results/paper-<time>)")
    args = p.parse_args(argv)
    args.cl = [c.strip().upper() for c in args.cl.split(",") if c.strip()]
    args.out = (args.out or Path("loadtest-results") / f"paper-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}").resolve()
    if args.timeline_rf > args.timeline_nodes:
        p.error("--timeline-rf must be <= --timeline-nodes")
    if args.timeline and args.kill_at >= args.timeline_minutes:
        p.error("--kill-at must be inside the timeline (< --timeline-minutes)")
    return args


class Cluster:
    """`cassmail cluster` in a directory of its own; `with` takes it down whatever happens."""

    def __init__(self, base: Path, nodes: int, rf: int, cl: str, keyspace: str, heap_mb: int,
                 port_offset: int = 0) -> None:
        self.base, self.nodes, self.rf, self.cl = base, nodes, rf, cl
        self.keyspace, self.heap_mb = keyspace, heap_mb
        self.ports = {name: port + port_offset for name, port in CLUSTER_PORTS.items()}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CASSMAIL_")}
        self.env["CASSMAIL_CLUSTER"] = str(base)
        self.upped = False
        #: False when `cluster down` failed: its directory is what `cassmail cluster down` needs then.
        self.down_ok = True

    def cassmail(self, *args: str, timeout: float = 900) -> str:
        overrides = []
        for key, value in (("keyspace", self.keyspace), ("read_consistency", self.cl),
                           ("write_consistency", self.cl)):
            overrides += ["-o", f"store.cassandra.{key}={value}"]
        cmd = [str(CASSMAIL), *overrides, "cluster", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env,
                             stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}: {(out.stderr or out.stdout).strip()}")
        return out.stdout

    def __enter__(self) -> Cluster:
        self.base.mkdir(parents=True, exist_ok=True)
        self.upped = True
        ports = [x for name, port in self.ports.items() for x in (f"--{name}-port", str(port))]
        say(self.cassmail("up", "--nodes", str(self.nodes), "--rf", str(self.rf), "--heap-mb", str(self.heap_mb), *ports))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.upped:
            try:
                say(self.cassmail("down").strip())
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                self.down_ok = False
                say(f"cluster down failed: {err}; take it down with CASSMAIL_CLUSTER={self.base} cassmail cluster down")

    def client_settings(self) -> config.Settings:
        return config.load(self.base / "cassmail.toml", env={})

    def smtp_servers(self, skip: int | None = None) -> list[tuple[str, int]]:
        return [(f"127.0.0.{i}", self.ports["smtp"]) for i in range(1, self.nodes + 1) if i != skip]

    def probes(self, skip: int | None = None) -> Probes:
        """CPU seconds of the front ends and of the Cassandras of every node but `skip` (a node about
        to be killed would take its seconds with it), read from `cluster status --json`."""
        rows = [r for r in json.loads(self.cassmail("status", "--json")) if r["node"] != skip]
        fronts = [r["frontend_pid"] for r in rows if r.get("frontend_pid")]
        cassandras = [r["cassandra_pid"] for r in rows if r.get("cassandra_pid")]

        def total(pids: list[int], cpu) -> float | None:
            values = [cpu(p) for p in pids]
            return None if not values or None in values else sum(values)

        return {"cassmail": lambda: total(fronts, tree_cpu), "Cassandra": lambda: total(cassandras, pid_cpu)}


def measure(cluster: Cluster, label: str, sizes: Sequence[tuple[int, int]], seconds: float, interval: float,
            average_last: int, args: argparse.Namespace, out: Path, kill: tuple[float, int] | None = None) -> list[LoadRun]:
    """Users in a fresh domain, then postal per size range against the cluster's front ends."""
    side = StoreSide(cluster.client_settings())
    runs = []
    try:
        domain = f"paper-{secrets.token_hex(4)}.example"
        side.call(side.store.add_domain(domain))
        users = side.call(make_users(side.store, domain, args.users))
        postal_users, _ = write_users(users, out / "users" / "".join(c if c.isalnum() else "-" for c in label))
        for lo, hi in sizes:
            actions = None
            skip = None
            if kill is not None:
                at, node = kill
                skip = node
                actions = {at: lambda n=node: (cluster.cassmail("kill", str(n)), f"killed node {n}'s Cassandra")[1]}
            before = side.call(count_inboxes(side.store, users))
            run = run_postal(label, cluster.smtp_servers(skip), (lo, hi), postal_users, out, seconds, args.threads,
                             interval=interval, average_last=average_last, probes=cluster.probes(skip),
                             actions=actions, say=say)
            run.server_before = before
            run.server_after, restarted = count_after(cluster, side, users, run, skip)
            run.settings.update({"nodes": str(cluster.nodes), "rf": str(cluster.rf), "cl": cluster.cl,
                                 "sizes": range_label(lo, hi)})
            if kill is not None:
                run.settings.update({"kill_at": f"{kill[0]:g}", "killed": str(kill[1])})
            run.save(out / "json")
            runs.append(run)
            if kill is not None and not restarted and (lo, hi) != sizes[-1]:
                say(cluster.cassmail("start", str(kill[1])).strip())  # the next size range kills it again
    finally:
        side.close()
    return runs


def count_after(cluster: Cluster, side: StoreSide, users: Sequence[str], run: LoadRun,
                killed: int | None) -> tuple[tuple[int, int] | None, bool]:
    """(the mailboxes' count after a run, whether the killed node was started again for it).

    The count is first read with the killed node still down: at CL ONE a node that missed the
    writes could answer for its replicas once back. At CL ALL no read succeeds with a replica
    down, so the node is started again and the count retried (for at most RECOUNT_SECONDS, while
    the coordinators see it come back): what was acknowledged at ALL must be on every replica,
    and the table can say so instead of leaving the cell empty."""
    try:
        return side.call(count_inboxes(side.store, users)), False
    except Exception as exc:  # noqa: BLE001 - at CL=ALL with a node down the count itself fails
        failed = f"{type(exc).__name__}: {exc}"
    if killed is None:
        run.notes.append(f"could not count the mailboxes after the run: {failed}")
        return None, False
    say(cluster.cassmail("start", str(killed)).strip())
    deadline = time.monotonic() + RECOUNT_SECONDS
    while True:
        try:
            counted = side.call(count_inboxes(side.store, users))
        except Exception as exc:  # noqa: BLE001 - the node may not be seen as up yet
            if time.monotonic() >= deadline:
                run.notes.append(f"could not count the mailboxes after the run, with node {killed} down "
                                 f"({failed}) nor after starting it again ({type(exc).__name__}: {exc})")
                return None, True
            time.sleep(2.0)
            continue
        run.notes.append(f"mailboxes counted after node {killed} was started again (with it down: {failed})")
        return counted, True


def on_cluster(args: argparse.Namespace, out: Path, n: int, rf: int, cl: str, name: str, label: str,
               sizes: Sequence[tuple[int, int]], seconds: float, interval: float, average_last: int,
               kill: tuple[float, int] | None = None) -> list[LoadRun]:
    """A fresh cluster (its own directory and keyspace), the postal runs on it, the cluster down."""
    say(f"\n## {label}" + (f": node {kill[1]} killed at {kill[0] / 60:g} min" if kill else ""))
    base = args.base / name
    shutil.rmtree(base, ignore_errors=True)
    cluster = Cluster(base, n, rf, cl, f"paper_{name.replace('-', '_')}", args.heap_mb, args.port_offset)
    try:
        with cluster:
            return measure(cluster, label, sizes, seconds, interval, average_last, args, out, kill)
    finally:
        if cluster.down_ok:
            shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- the figures


def _stored(run: LoadRun) -> str:
    """Messages the mailboxes gained over the run (the store's own count), "-" if unknown."""
    if run.server_before is None or run.server_after is None:
        return "-"
    return str(run.server_after[0] - run.server_before[0])


def _key(run: LoadRun) -> tuple:
    st = run.settings
    return (st.get("sizes", ""), int(st.get("nodes", 0)), int(st.get("rf", 0)), st.get("cl", ""))


def sweep_table(runs: Sequence[LoadRun]) -> list[str]:
    """Figures 3-5 as one table: a row per size range, N, RF and CL."""
    rows = []
    for r in sorted((r for r in runs if "kill_at" not in r.settings), key=_key):
        mean, sd = r.stat()
        st = r.settings
        rows.append([st["sizes"], st["nodes"], st["rf"], st["cl"], f"{mean:.0f}" + (f" ± {sd:.0f}" if sd is not None else ""),
                     fmt(r.mb_per_s()), str(r.total), _stored(r), str(r.errors),
                     fmt(r.cores("cassmail"), ".2f"), fmt(r.cores("Cassandra"), ".2f")])
    return markdown(["sizes", "nodes", "RF", "CL", "msgs/min", "MB/s", "sent", "stored", "errors",
                     "cassmail cores", "Cassandra cores"], rows, {0, 3})


def kill_window(run: LoadRun) -> tuple[float, float]:
    """Seconds since the start when the kill began and ended (the planned time if not recorded)."""
    if run.events:
        return run.events[0][0], run.events[0][1]
    planned = float(run.settings["kill_at"])
    return planned, planned


def before_after(run: LoadRun) -> tuple[list[float], list[float]]:
    """msgs/min of the intervals before the kill (but the first, warm-up) and after it. The sample
    due at the kill's time is taken once the kill returned, so the interval ending there is "before"
    whatever the kill took; an interval the kill fell inside of (a kill time off the sampling grid)
    is neither."""
    start, end = kill_window(run)
    spans = run.spans()
    before = [rate for i, (_, stop, rate) in enumerate(spans) if i > 0 and stop <= end + 1.0]
    after = [rate for begin, _, rate in spans if begin >= start]
    return before, after


def timeline_table(runs: Sequence[LoadRun]) -> list[str]:
    """Figure 6 as a table: msgs/min in every interval, before and after the kill."""
    timeline = sorted((r for r in runs if "kill_at" in r.settings), key=_key)
    if not timeline:
        return []
    width = max(len(r.spans()) for r in timeline)
    head = ["CL", *[f"{(i + 1) * timeline[0].interval / 60:g}" for i in range(width)], "before kill", "after kill",
            "sent", "stored", "errors"]
    rows = []
    for r in timeline:
        rates = r.rates()
        before, after = before_after(r)
        rows.append([r.settings["cl"], *[f"{x:.0f}" for x in rates], *[""] * (width - len(rates)),
                     fmt(sum(before) / len(before) if before else None, ".0f"),
                     fmt(sum(after) / len(after) if after else None, ".0f"),
                     str(r.total), _stored(r), str(r.errors)])
    return markdown(head, rows, {0})


def plot_sweep(runs: Sequence[LoadRun], path: Path) -> bool:
    sweep = [r for r in runs if "kill_at" not in r.settings]
    sizes = sorted({r.settings["sizes"] for r in sweep})
    if not sweep:
        return False
    fig, axes = report.plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        series: dict[tuple[int, str], list[tuple[int, float]]] = {}
        for r in sorted((r for r in sweep if r.settings["sizes"] == size), key=_key):
            series.setdefault((int(r.settings["rf"]), r.settings["cl"]), []).append(
                (int(r.settings["nodes"]), r.mb_per_s() or 0.0))
        for (rf, cl), points in sorted(series.items()):
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o", label=f"RF={rf} CL={cl}")
        ax.set_title(f"postal {size}")
        ax.set_xlabel("nodes")
        ax.set_ylabel("MB/s")
        ax.set_xticks(sorted({int(r.settings["nodes"]) for r in sweep}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    report.plt.close(fig)
    return True


def plot_timeline(runs: Sequence[LoadRun], path: Path) -> bool:
    timeline = [r for r in runs if "kill_at" in r.settings]
    if not timeline:
        return False
    fig, ax = report.plt.subplots(figsize=(8, 4))
    for r in sorted(timeline, key=_key):
        spans = r.spans()
        ax.plot([end / 60 for _, end, _ in spans], [rate for *_, rate in spans], marker="o",
                label=f"CL={r.settings['cl']}")
    kill = kill_window(timeline[0])[0] / 60
    ax.axvline(kill, color="red", linestyle="--", label=f"node {timeline[0].settings['killed']} killed")
    st = timeline[0].settings
    ax.set_title(f"{st['nodes']} nodes, RF={st['rf']}, postal {st['sizes']}: messages per interval")
    ax.set_xlabel("minutes since start")
    ax.set_ylabel("msgs/min")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    report.plt.close(fig)
    return True


def figures(runs: Sequence[LoadRun], out: Path) -> list[str]:
    """The sweep and timeline tables and plots, as lines for the top of the report."""
    lines = []
    if any("kill_at" not in r.settings for r in runs):
        lines += ["## Figures 3-5: nodes, replication factor, consistency level", "",
                  "sent: messages postal saw accepted; stored: messages the mailboxes gained (the store's count "
                  "after the run, at the cluster's CL).", "", *sweep_table(runs), ""]
        if plot_sweep(runs, out / "sweep.png"):
            lines += ["![MB/s by nodes, RF and CL](sweep.png)", ""]
    if any("kill_at" in r.settings for r in runs):
        lines += ["## Figure 6: a Cassandra node killed under load", "",
                  "msgs/min in each interval (column: minutes since start at the interval's end); before kill: "
                  "the mean of the intervals before it but the first (warm-up), after kill: of those after it.", "",
                  *timeline_table(runs), ""]
        if plot_timeline(runs, out / "timeline.png"):
            lines += ["![throughput with a node killed](timeline.png)", ""]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from baseline import ensure_packages

    ensure_packages(postal=True, say=say)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    runs: list[LoadRun] = []
    status = 0
    preface = [f"- started {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {os.uname().nodename}, "
               f"{os.cpu_count()} CPUs; command `{' '.join(['loadtest/paper.py', *(argv or sys.argv[1:])])}`", ""]
    try:
        if args.sweep:
            for n in args.nodes:
                for rf in (r for r in args.rf if r <= n):
                    # With one replica every consistency level is ONE: one run stands for them all.
                    for cl in (args.cl if rf > 1 else args.cl[:1]):
                        runs += on_cluster(args, out, n, rf, cl, f"n{n}-rf{rf}-{cl.lower()}", f"N={n} RF={rf} CL={cl}",
                                           args.sizes, args.seconds, args.interval, args.average_last)
        if args.timeline:
            n, rf = args.timeline_nodes, args.timeline_rf
            victim = args.kill_node or n
            for cl in args.cl:
                runs += on_cluster(args, out, n, rf, cl, f"timeline-{cl.lower()}", f"timeline N={n} RF={rf} CL={cl}",
                                   args.timeline_sizes, args.timeline_minutes * 60.0, args.timeline_interval,
                                   max(1, round(args.timeline_minutes * 60.0 / args.timeline_interval)),
                                   kill=(args.kill_at * 60.0, victim))
    except KeyboardInterrupt:
        status = 130
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        say(f"paper: stopped by {type(exc).__name__}: {exc}")
        status = 1
    if runs:
        tables = figures(runs, out)
        say("")
        for line in tables:
            say(line)
        path = report.build([out], out, title="The CassMail paper on a local cluster", preface=[*preface, *tables])
        say(f"report: {path}")
    return status or (0 if runs else 1)


if __name__ == "__main__":
    sys.exit(main())
