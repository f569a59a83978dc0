"""Shared by the hostile scripts: record this process's pid for the test to check."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def record(role: str, pid: int | None = None) -> None:
    """Leave ``<role>-<pid>`` in $HOSTILE_PIDS; the test checks these pids, not any log."""
    directory = os.environ.get("HOSTILE_PIDS")
    if directory:
        (Path(directory) / f"{role}-{pid or os.getpid()}").touch()


def script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / name), *args]
