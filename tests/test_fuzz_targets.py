"""Each coverage-guided fuzz target (tests/fuzz_targets.py) for a few seconds from its seed corpus
(tests/fuzz_corpus/<target>/, which holds every crash found so far): no input may escape its
parser as anything but the parser's own error. CASSMAIL_FUZZ_TARGET_SECONDS makes the runs
longer; `python -m tests.fuzz_targets all --seconds 600` runs them by hand (docs/hardening.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fuzz_targets import CORPUS, INSTRUMENTED, TARGETS

SECONDS = int(os.environ.get("CASSMAIL_FUZZ_TARGET_SECONDS", "2"))
REPO = Path(__file__).resolve().parent.parent
#: name -> (the run's directory, the run)
Runs = dict[str, tuple[Path, Future[subprocess.CompletedProcess[str]]]]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """The run of every target this session tests, as many at once as there are cores (each is
    one busy process)."""
    chosen = sorted({item.callspec.params["name"] for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec")})

    def fuzz(name: str, work: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.fuzz_targets", name, "--seconds", str(SECONDS), "--work", str(work / "work"),
             "--artifacts", str(work / "artifacts")],
            cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 120,
        )

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        started: Runs = {}
        for name in chosen:
            work = tmp_path_factory.mktemp(f"fuzz-{name}")
            started[name] = (work, pool.submit(fuzz, name, work))
        yield started


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target_finds_no_crash(name: str, runs: Runs) -> None:
    assert any((CORPUS / name).iterdir()), f"no seeds for {name}"
    work, run = runs[name]
    result = run.result()
    output = result.stdout + result.stderr
    crashes = list((work / "artifacts").glob("crash-*"))
    assert result.returncode == 0 and not crashes, output[-4000:]
    done = re.search(r"Done (\d+) runs", output)
    assert done is not None and int(done.group(1)) >= len(list((CORPUS / name).iterdir())), output[-2000:]
    # Coverage guides the fuzzing from the target's own modules only (and starts in seconds).
    instrumented = set(re.findall(r"INFO: Instrumenting (\S+)", output))
    own = INSTRUMENTED[name]
    assert instrumented and all(m in own or m.startswith(tuple(f"{o}." for o in own)) for m in instrumented), \
        sorted(instrumented)
