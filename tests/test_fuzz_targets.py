"""Each coverage-guided fuzz target (tests/fuzz_targets.py) for a few seconds from its seed corpus
(tests/fuzz_corpus/<target>/, which holds every crash found so far): no input may escape its
parser as anything but the parser's own error. CASSMAIL_FUZZ_TARGET_SECONDS makes the runs
longer; `python -m tests.fuzz_targets all --seconds 600` runs them by hand (docs/hardening.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz_targets import CORPUS, INSTRUMENTED, TARGETS

SECONDS = int(os.environ.get("CASSMAIL_FUZZ_TARGET_SECONDS", "2"))
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target_finds_no_crash(name: str, tmp_path: Path) -> None:
    assert any((CORPUS / name).iterdir()), f"no seeds for {name}"
    result = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_targets", name, "--seconds", str(SECONDS), "--work", str(tmp_path / "work"),
         "--artifacts", str(tmp_path / "artifacts")],
        cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 120,
    )
    output = result.stdout + result.stderr
    crashes = list((tmp_path / "artifacts").glob("crash-*"))
    assert result.returncode == 0 and not crashes, output[-4000:]
    runs = re.search(r"Done (\d+) runs", output)
    assert runs is not None and int(runs.group(1)) >= len(list((CORPUS / name).iterdir())), output[-2000:]
    # Coverage guides the fuzzing from the target's own modules only (and starts in seconds).
    instrumented = set(re.findall(r"INFO: Instrumenting (\S+)", output))
    own = INSTRUMENTED[name]
    assert instrumented and all(m in own or m.startswith(tuple(f"{o}." for o in own)) for m in instrumented), \
        sorted(instrumented)
