"""Build uids: one of the configured range per build on this host, held by a lock file.

Builds of different projects, or two at once, then never share a uid: not its kernel keyring,
its process limit, its files in shared places. The locks live in one directory for the whole
host (``WHEELHOUSE_BUILD_UID_LOCK_DIR``), whatever each worker's workspace, so that two workers
on one host never hand out the same uid; :meth:`worker.sandbox.wrapper.Sandbox.claim` takes one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path

from worker.errors import SandboxUnavailable


def uid_range(text: str) -> tuple[int, int]:
    """``WHEELHOUSE_BUILD_UID_RANGE`` (``65500-65531``, or one uid) as (first, last)."""
    first, sep, last = text.strip().partition("-")
    try:
        low, high = int(first), int(last if sep else first)
    except ValueError:
        raise ValueError(f"WHEELHOUSE_BUILD_UID_RANGE must be FIRST-LAST, got {text[:40]!r}"
                         ) from None
    if not 0 < low <= high or high - low > 65535:
        raise ValueError(f"WHEELHOUSE_BUILD_UID_RANGE must be FIRST-LAST of unprivileged uids "
                         f"(not 0), got {text[:40]!r}")
    return low, high


def claim_uid(slots_dir: Path, uids: tuple[int, int], *,
              wait: Callable[[], None] | None = None) -> tuple[int, int]:
    """A uid of ``uids`` (first, last) no other build on this host holds, and the descriptor
    of the lock that holds it (close it when the build's processes are all gone).

    All taken: ``wait`` is called between tries (it raises to give up); without it,
    :class:`SandboxUnavailable`.
    """
    _lock_dir(slots_dir)
    while True:
        for uid in range(uids[0], uids[1] + 1):
            fd = os.open(slots_dir / str(uid),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return uid, fd
        if wait is None:
            raise SandboxUnavailable(f"every build uid of {uids[0]}-{uids[1]} is "
                                     "in use (WHEELHOUSE_BUILD_UID_RANGE)")
        wait()


def _lock_dir(path: Path) -> None:
    """Create the host-wide uid lock directory, root's and 0700, or check the one there.

    Builds must not reach it: a build uid that could replace a lock file could make two
    builds share a uid. So it is a real directory of the worker's, writable by it alone.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    # Checked and fixed through one descriptor: no link followed, no swap between the two.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = -1
    try:
        st = os.fstat(fd) if fd >= 0 else None
        if st is None or st.st_uid != os.geteuid():
            raise SandboxUnavailable(f"{path} (WHEELHOUSE_BUILD_UID_LOCK_DIR) is not a "
                                     "directory of the worker's own")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        if fd >= 0:
            os.close(fd)
