"""The build log: one file that our notes and every program of the build write into.

It is tailed while the build runs (the live log, ninja's ``[N/M]`` progress), its end is
what a failure is classified from, and the whole file is stored beside the result.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

_PROGRESS = re.compile(r"^\s*\[(\d+)/(\d+)\]")


class BuildLog:
    """The build log file: our own notes go in, the subprocesses append, ``pump`` tails it.

    Each :meth:`pump` hands the new complete lines to ``on_lines`` and the last ninja
    ``[N/M]`` among them to ``on_progress``.
    """

    def __init__(self, path: Path, *, on_lines: Callable[[list[str]], None],
                 on_progress: Callable[[int, int], None]) -> None:
        self.path = path
        self.on_lines = on_lines
        self.on_progress = on_progress
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        self._offset = 0
        self._partial = b""

    def write(self, text: str) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            for line in text.splitlines() or [""]:
                f.write(f"wheelhouse: {line}\n")
        self.pump()

    def pump(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        if not data:
            return
        self._offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        lines = [line.decode("utf-8", errors="replace").rstrip("\r") for line in complete]
        if not lines:
            return
        for line in reversed(lines):
            m = _PROGRESS.match(line)
            if m is not None:
                self.on_progress(int(m.group(1)), int(m.group(2)))
                break
        self.on_lines(lines)

    def size(self) -> int:
        """Where the log ends now: pass it to :meth:`since` to read what a program adds."""
        return self.path.stat().st_size

    def since(self, offset: int, limit: int = 1_000_000) -> str:
        """What was written after ``offset`` (at most ``limit`` bytes of it, from the start)."""
        with self.path.open("rb") as f:
            f.seek(offset)
            return f.read(limit).decode("utf-8", errors="replace")

    def tail(self, limit: int = 400_000) -> str:
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", errors="replace")
