"""What leaves the sandbox: the one wheel a build made, copied out by descriptor.

The worker reads nothing else back from a build's writable paths but what
:data:`worker.sandbox.wrapper.BUILD_WRITABLE` lists, and only after the sandbox's processes are
all dead.
"""

from __future__ import annotations

import os
from pathlib import Path

from wheelhouse.errors import BuildFailed, FailureKind
from worker.errors import UnsafePath
from worker.sandbox import safefs
from worker.sandbox.limits import GIB

MAX_WHEEL_BYTES = 16 * GIB
"""Largest wheel the worker copies out of a build (flash-attn's are a few hundred MiB)."""


def take_wheel(dist: Path, dest: Path, *, max_bytes: int = MAX_WHEEL_BYTES) -> Path:
    """Copy the one wheel the build left in ``dist`` into ``dest`` (a directory the worker owns).

    Call it only once every process of the sandbox is dead. ``dist`` must be a directory the
    worker created in one the build never had; the build owned what is in it: a link there (to
    the worker's credentials, say), a FIFO, device or socket is refused (``unsafe-result``),
    never followed or opened, and the copy stops at ``max_bytes``.
    """
    try:
        dirfd = safefs.open_dir(dist)
    except (OSError, UnsafePath) as exc:
        raise BuildFailed(FailureKind.COMPILE_ERROR,
                          f"the build left no output directory: {exc}") from None
    try:
        with os.scandir(dirfd) as found:
            entries = sorted(e.name for e in found if e.name.endswith(".whl"))
        if len(entries) != 1:
            raise BuildFailed(FailureKind.COMPILE_ERROR,
                              f"the build produced {len(entries)} wheels, expected one")
        name = entries[0]
        if "/" in name or name.startswith("."):
            raise BuildFailed(FailureKind.UNSAFE_RESULT, f"{name[:100]!r} is not a wheel's name")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / name
        try:
            safefs.copy_out(dirfd, name, target, max_bytes=max_bytes)
        except UnsafePath as exc:
            raise BuildFailed(FailureKind.UNSAFE_RESULT, str(exc)) from None
    finally:
        os.close(dirfd)
    return target
