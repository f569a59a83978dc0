"""Per-build cgroup v2 directories, where this host delegates a writable subtree.

A build in its own cgroup can be frozen (so a fast forker can't outrun a scan), killed whole
(``cgroup.kill``), capped (``memory.max``) and asked about OOM kills (``memory.events``). Where
no writable cgroup v2 exists every function here says so (None, False, empty) and the reaper
falls back to sessions, ancestry and the environment cookie.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from pathlib import Path

PREFIX = "wheelhouse-"
"""Name prefix of the per-build cgroup directories."""

_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def _mount() -> Path | None:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            return Path(left.split(" ")[4])
    return None


def base() -> Path | None:
    """This process's own cgroup v2 directory, if it is writable (builds go below it)."""
    mount = _mount()
    if mount is None:
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            base = mount / line[3:].lstrip("/")
            if os.access(base, os.W_OK) and (base / "cgroup.procs").exists():
                return base
    return None


def pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in (path / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def kill(path: Path) -> bool:
    try:
        (path / "cgroup.kill").write_text("1")
    except OSError:
        return False
    return True


def freeze(path: Path, frozen: bool, timeout: float = 0.5) -> bool:
    """Freeze (or thaw) a cgroup, so a fast forker can't outrun a scan; wait until it's done."""
    try:
        (path / "cgroup.freeze").write_text("1" if frozen else "0")
    except OSError:
        return False
    end = time.monotonic() + timeout
    want = f"frozen {int(frozen)}"
    while time.monotonic() < end:
        try:
            if want in (path / "cgroup.events").read_text().splitlines():
                return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


def remove(path: Path, timeout: float = 2.0) -> bool:
    """rmdir a cgroup; it stays busy for a moment after its last process dies."""
    end = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= end:
                return False
            time.sleep(0.02)
        else:
            return True


def make(build_id: str, memory_max: int | None) -> Path | None:
    if not _SAFE_ID.fullmatch(build_id):
        return None
    root = base()
    if root is None:
        return None
    path = root / f"{PREFIX}{build_id}"
    try:
        path.mkdir()
    except OSError:
        return None
    if memory_max is not None:
        controllers = (path / "cgroup.controllers").read_text().split()
        if "memory" in controllers:
            with contextlib.suppress(OSError):
                (path / "memory.max").write_text(str(memory_max))
    return path


def oom_kills(path: Path | None) -> int:
    if path is None:
        return 0
    try:
        text = (path / "memory.events").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


# The trampoline moves itself into the cgroup and then execs the build, so the build's very first
# instruction already runs inside it (no fork can race the move). The build's argv travels as
# positional parameters, never through the shell's parser.
TRAMPOLINE = '{ echo 0 > "$0"; } 2>/dev/null; exec "$@"'


# --- the kill loop ------------------------------------------------------------------------
