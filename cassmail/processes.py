"""Processes of this machine, as the stores and the metrics exporter ask after them."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
