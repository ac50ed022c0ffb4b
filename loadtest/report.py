"""Turn load-test runs into a Markdown report with PNG plots.

    .venv/bin/python loadtest/report.py RESULTS_DIR [MORE_DIRS...] [--out DIR] [--baseline NAME]

Reads, in every directory given:
- `json/run-*.json`: postal and rabid runs written by loadtest/postal.py (and compare.py):
  per-interval message counts and CPU samples;
- `*_stats.csv` and `*_stats_history.csv`: locust's `--csv PREFIX` output (`--csv-full-history`
  for per-request series).
Writes into --out (default: the first directory) `report.md` and beside it:
- `throughput.png`: messages per minute in each interval of every postal/rabid run;
- `cpu.png`: cores used on average over the measured intervals, per process group (cassmail,
  Cassandra, the baseline servers, the load generator) and per run;
- `latency.png`: p50/p95/p99 response time of every locust request, and `locust.png`: locust's
  requests/s and p50/p95 over the run.
With runs of the baseline server (--baseline, default "Postfix+Dovecot") and of others under the
same tool and sizes, a ratio table says how each compares (other / baseline, msgs/min).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from _common import fmt, markdown  # noqa: E402
from postal import LoadRun  # noqa: E402

BASELINE = "Postfix+Dovecot"


# --------------------------------------------------------------------------- reading


def load_runs(directories: Sequence[Path]) -> list[LoadRun]:
    runs = []
    for d in directories:
        for path in sorted((d / "json").glob("run-*.json")):
            runs.append(LoadRun.from_json(json.loads(path.read_text())))
    return runs


def _num(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def load_locust(directories: Sequence[Path]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(stats rows, history rows) of every locust CSV found."""
    stats, history = [], []
    for d in directories:
        for path in sorted(d.glob("*_stats.csv")):
            with open(path, newline="") as fh:
                stats += list(csv.DictReader(fh))
        for path in sorted(d.glob("*_stats_history.csv")):
            with open(path, newline="") as fh:
                history += list(csv.DictReader(fh))
    return stats, history


# --------------------------------------------------------------------------- tables


def cpu_groups(runs: Sequence[LoadRun]) -> list[str]:
    seen: dict[str, None] = {}
    for r in runs:
        for t in r.ticks:
            for name in t.cpu:
                seen.setdefault(name, None)
    return list(seen)


def runs_table(runs: Sequence[LoadRun]) -> list[str]:
    groups = cpu_groups(runs)
    head = ["tool", "server", "sizes", "intervals", "msgs/min", "MB/s", "messages", "errors",
            *[f"{g} cores" for g in groups], "machine cores"]
    rows = []
    for r in runs:
        mean, sd = r.stat()
        lo, hi = r.window()
        rows.append([
            r.tool, r.server, r.sizes, f"{hi - lo} x {r.interval:g} s",
            f"{mean:.0f}" + (f" ± {sd:.0f}" if sd is not None else ""), fmt(r.mb_per_s()), str(r.total),
            str(r.errors), *[fmt(r.cores(g), ".2f") for g in groups], fmt(r.machine_cores(), ".2f"),
        ])
    return markdown(head, rows, {0, 1, 2})


def ratio_table(runs: Sequence[LoadRun], baseline: str) -> list[str]:
    base = {(r.tool, r.sizes): r for r in runs if r.server == baseline}
    rows = []
    for r in runs:
        b = base.get((r.tool, r.sizes))
        if r.server == baseline or b is None or b.stat()[0] <= 0:
            continue
        rmb, bmb = r.mb_per_s(), b.mb_per_s()
        rows.append([
            r.tool, r.sizes, r.server, f"{r.stat()[0]:.0f}", f"{b.stat()[0]:.0f}", f"{r.stat()[0] / b.stat()[0]:.2f}",
            fmt(rmb / bmb if rmb is not None and bmb else None, ".2f"),
        ])
    if not rows:
        return []
    return markdown(["tool", "sizes", "server", "msgs/min", f"{baseline} msgs/min", "ratio msgs/min", "ratio MB/s"],
                    rows, {0, 1, 2})


def locust_table(stats: Sequence[dict[str, str]]) -> list[str]:
    rows = []
    for s in stats:
        rows.append([
            s.get("Type", ""), s.get("Name", ""), s.get("Request Count", ""), s.get("Failure Count", ""),
            fmt(_num(s.get("Requests/s")), ".1f"), s.get("50%", ""), s.get("95%", ""), s.get("99%", ""),
            fmt(_num(s.get("Average Content Size")), ".0f"),
        ])
    return markdown(["type", "request", "count", "failures", "req/s", "p50 ms", "p95 ms", "p99 ms", "mean bytes"],
                    rows, {0, 1})


# --------------------------------------------------------------------------- plots


def plot_throughput(runs: Sequence[LoadRun], path: Path) -> None:
    tools = sorted({r.tool for r in runs})
    fig, axes = plt.subplots(len(tools), 1, figsize=(9, 3.2 * len(tools)), squeeze=False)
    for ax, tool in zip(axes[:, 0], tools):
        for r in (r for r in runs if r.tool == tool):
            xs = [(b.t) / 60 for b in r.ticks[1:]]
            ax.plot(xs, r.rates(), marker="o", markersize=3, label=f"{r.server} {r.sizes}")
            lo, hi = r.window()
            if hi > lo:
                ax.axvspan(r.ticks[lo].t / 60, r.ticks[hi].t / 60, alpha=0.04, color="grey")
        ax.set_title(f"{tool}: messages per minute (shaded: averaged intervals)")
        ax.set_xlabel("minutes since start")
        ax.set_ylabel("msgs/min")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cpu(runs: Sequence[LoadRun], path: Path) -> None:
    groups = cpu_groups(runs)
    labels = [f"{r.tool}\n{r.server}\n{r.sizes}" for r in runs]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(runs)), 4.5))
    bottom = [0.0] * len(runs)
    for g in groups:
        values = [r.cores(g) or 0.0 for r in runs]
        ax.bar(range(len(runs)), values, bottom=bottom, label=g)
        bottom = [b + v for b, v in zip(bottom, values)]
    machine = [r.machine_cores() for r in runs]
    ax.scatter(range(len(runs)), [m if m is not None else 0 for m in machine], color="black", marker="_", s=400,
               label="whole machine", zorder=3)
    ax.set_xticks(range(len(runs)), labels, fontsize=7)
    ax.set_ylabel("cores (averaged intervals)")
    ax.set_title("CPU per process group")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(stats: Sequence[dict[str, str]], path: Path) -> None:
    rows = [s for s in stats if s.get("Name") != "Aggregated"]
    names = [f"{s.get('Type', '')} {s.get('Name', '')}" for s in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    width = 0.27
    for i, q in enumerate(("50%", "95%", "99%")):
        values = [_num(s.get(q)) or 0.0 for s in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=f"p{q[:-1]}")
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_title("locust response times")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_locust_history(history: Sequence[dict[str, str]], path: Path) -> None:
    agg = [h for h in history if h.get("Name") == "Aggregated"]
    if not agg:
        return
    t0 = _num(agg[0]["Timestamp"]) or 0.0
    xs = [((_num(h["Timestamp"]) or t0) - t0) for h in agg]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a1.plot(xs, [_num(h.get("Requests/s")) or 0.0 for h in agg], label="requests/s")
    a1.plot(xs, [_num(h.get("Failures/s")) or 0.0 for h in agg], label="failures/s")
    a1.set_ylabel("per second")
    a1.legend()
    a1.grid(alpha=0.3)
    for q in ("50%", "95%"):
        a2.plot(xs, [_num(h.get(q)) for h in agg], label=f"p{q[:-1]} (all requests)")
    a2.set_ylabel("ms")
    a2.set_xlabel("seconds since start")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.suptitle("locust over the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- the report


def build(directories: Sequence[Path], out: Path, baseline: str = BASELINE, title: str = "cassmail load test",
          preface: Sequence[str] = ()) -> Path:
    """Write out/report.md (and its PNGs) from the runs in `directories`; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(directories)
    stats, history = load_locust(directories)
    lines = [f"# {title}", "", f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from "
             + ", ".join(f"`{d}`" for d in directories) + ".", ""]
    lines += list(preface)
    if runs:
        lines += ["## postal and rabid", "",
                  "msgs/min: messages per minute in each interval (postal: sent; rabid: retrieved), the first "
                  "interval dropped as warm-up, the last ones averaged: mean ± sample standard deviation. MB/s: "
                  "that rate times the mean size of the messages the server gained (postal) or lost (rabid) "
                  "over the run. Cores: CPU seconds per second over the averaged intervals.", ""]
        lines += runs_table(runs)
        ratios = ratio_table(runs, baseline)
        if ratios:
            lines += ["", f"### Compared with {baseline}", ""] + ratios
        notes = [f"- {r.server} {r.tool} {r.sizes}: {n}" for r in runs for n in r.notes]
        notes += [f"- {r.server} {r.tool} {r.sizes}: {r.errors} errors, e.g. `{r.error_lines[0][:200]}`"
                  for r in runs if r.errors and r.error_lines]
        if notes:
            lines += ["", "Notes:", "", *notes]
        commands = sorted({" ".join(r.command) for r in runs})
        lines += ["", "Commands:", "", *[f"- `{c}`" for c in commands]]
        plot_throughput(runs, out / "throughput.png")
        plot_cpu(runs, out / "cpu.png")
        lines += ["", "![throughput per interval](throughput.png)", "", "![CPU per process group](cpu.png)", ""]
    if stats:
        lines += ["## locust", "", "Response times in ms (locust's percentiles); bytes: message size sent "
                  "(SMTP send), retrieved (POP3 retr, IMAP fetch) or listed (POP3 list).", ""]
        lines += locust_table(stats)
        plot_latency(stats, out / "latency.png")
        lines += ["", "![latency percentiles](latency.png)", ""]
        if history:
            plot_locust_history(history, out / "locust.png")
            if (out / "locust.png").exists():
                lines += ["![locust over time](locust.png)", ""]
    if not runs and not stats:
        lines += ["No runs found (json/run-*.json or *_stats.csv)."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Markdown report and PNG plots from postal/rabid runs and locust CSVs.")
    p.add_argument("directories", nargs="+", type=Path, help="result directories (postal.py --out, locust --csv dir)")
    p.add_argument("--out", type=Path, help="where report.md and the PNGs go (default: the first directory)")
    p.add_argument("--baseline", default=BASELINE, help=f"server the others are compared with (default {BASELINE})")
    p.add_argument("--title", default="cassmail load test")
    args = p.parse_args(argv)
    missing = [d for d in args.directories if not d.is_dir()]
    if missing:
        p.error(f"not a directory: {', '.join(map(str, missing))}")
    path = build(args.directories, args.out or args.directories[0], args.baseline, args.title)
    print(path)
    return 0 if path.read_text().count("No runs found") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
