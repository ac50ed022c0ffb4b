"""What the commands need from a cassmail source checkout, below both `cli` and `cluster`: the
checkout's root, the local Cassandra launcher kept in deploy/ (not part of the installed
package), and CommandError, the one-line failure every command reports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = REPO_ROOT / "deploy" / "cassandra" / "launcher.py"


class CommandError(Exception):
    """A failure to report as one line."""


def load_launcher() -> ModuleType:
    """deploy/cassandra/launcher.py from the source tree (it is not part of the installed package)."""
    if not LAUNCHER.exists():
        raise CommandError(f"{LAUNCHER} not found: the local Cassandra commands need a cassmail source checkout")
    spec = importlib.util.spec_from_file_location("cassmail_launcher", LAUNCHER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
