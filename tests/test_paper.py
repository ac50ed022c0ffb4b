"""`loadtest/paper.py` works end to end, in a short bounded run: a 1-node sweep cell and a
2-node Figure 6 timeline (RF=2, CL=ONE) whose second Cassandra is SIGKILLed half way, each on a
fresh `cassmail cluster` with ports of its own, postal against the front ends, the report with
its tables and plots, and every cluster taken down afterwards. The full sweep is a benchmark
(loadtest/RESULTS.md), never run here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

LOADTEST = REPO / "loadtest"
sys.path.insert(0, str(LOADTEST))

from postal import LoadRun  # noqa: E402

pytestmark = pytest.mark.cassandra

#: Every port of the clusters moved by this much (CQL 30042, storage 28000, SMTP 23525, ...): clear
#: of the suite's own Cassandra, of tests/test_cluster.py's cluster and of the defaults.
PORT_OFFSET = 21000


def _tools() -> None:
    from baseline import ensure_packages, missing_packages

    if missing_packages(postal=True):
        ensure_packages(postal=True)


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    _tools()
    work = tmp_path_factory.mktemp("paper")
    base, out = work / "clusters", work / "out"
    cmd = [sys.executable, str(LOADTEST / "paper.py"), "--nodes", "1", "--rf", "1", "--cl", "ONE",
           "--sizes", "5K-50K", "--seconds", "20", "--interval", "5", "--average-last", "2", "--users", "10",
           "--threads", "4", "--timeline-nodes", "2", "--timeline-rf", "2", "--timeline-minutes", "0.75",
           "--timeline-interval", "9", "--kill-at", "0.3", "--timeline-sizes", "5K-50K", "--heap-mb", "512",
           "--port-offset", str(PORT_OFFSET), "--base", str(base), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, stdin=subprocess.DEVNULL)
    return base, out, done


def _runs(out: Path) -> list[LoadRun]:
    return [LoadRun.from_json(json.loads(p.read_text())) for p in sorted((out / "json").glob("run-*.json"))]


def test_the_sweep_and_the_timeline_run_and_lose_nothing(paper_run) -> None:
    base, out, done = paper_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    runs = _runs(out)
    sweep = [r for r in runs if "kill_at" not in r.settings]
    timeline = [r for r in runs if "kill_at" in r.settings]
    assert [(r.settings["nodes"], r.settings["rf"], r.settings["cl"]) for r in sweep] == [("1", "1", "ONE")]
    assert [(r.settings["nodes"], r.settings["rf"], r.settings["cl"]) for r in timeline] == [("2", "2", "ONE")]
    for r in runs:
        assert r.total > 0 and r.errors == 0, (r.server, r.error_lines[:3])
        # Everything postal saw accepted is in the mailboxes (counted through the store afterwards).
        assert r.server_after[0] - r.server_before[0] >= r.total, r.server
        assert r.cores("Cassandra") is not None and r.cores("cassmail") is not None
    (kill,) = timeline
    assert any("killed node 2's Cassandra" in n for n in kill.notes), kill.notes
    # At CL=ONE with RF=2 the surviving node keeps accepting mail after the kill.
    killed_at = float(kill.settings["kill_at"])
    assert kill.ticks[-1].messages > max(t.messages for t in kill.ticks if t.t <= killed_at)
    # The Figure 6 table has a rate before and after the kill.
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines()
            if line.startswith("| CL ") or line.startswith("| ONE ")]
    head, row = rows
    assert float(row[head.index("before kill")]) > 0 and float(row[head.index("after kill")]) > 0


def test_the_report_has_the_figures_and_every_cluster_is_down(paper_run) -> None:
    base, out, done = paper_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    text = (out / "report.md").read_text()
    assert "## Figures 3-5" in text and "## Figure 6" in text
    assert (out / "sweep.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    # The sweep table is printed as well as written.
    assert re.search(r"^\| 5K-50K +\| +1 \| +1 \| ONE +\|", done.stdout, re.M), done.stdout[-3000:]
    # Each cluster was taken down and its directory removed; no Cassandra of this run survives.
    assert not base.exists() or not any(base.iterdir())
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(base) not in ps
