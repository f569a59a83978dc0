"""What one build may hold: its disk (:class:`DiskQuota`), its processes and memory
(:class:`TreeLimits`), and how deep the worker walks a tree it wrote (:func:`walk_tree`).

Both caps are checked from the reaper's tick (``BuildProcess.wait``'s ``on_tick``); past one the
build ends as too-large, classified, instead of failing in whatever way its programs fail.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil

from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind

GIB = 1024**3
MAX_DEPTH = 256
"""Deepest directory nesting the worker walks in a build's tree (an sdist's, or what it wrote)."""


class TooDeep(Exception):
    """A tree nested past :data:`MAX_DEPTH`."""


def walk_tree(root: Path) -> Iterator[tuple[int, str, os.stat_result]]:
    """``(directory fd, name, lstat)`` of everything below ``root``, depth first.

    Relative to open directory descriptors, never through built-up paths: links are never
    followed and no path grows past ``PATH_MAX``, however deep a hostile tree is. Raises
    ``TooDeep`` past ``MAX_DEPTH`` levels, which bounds the descriptors held open.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    top = os.open(root, flags)
    stack = [(top, os.scandir(top))]
    try:
        while stack:
            fd, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                entries.close()
                os.close(fd)
                stack.pop()
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed while we looked
            yield fd, entry.name, st
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= MAX_DEPTH:
                    raise TooDeep
                try:
                    sub = os.open(entry.name, flags, dir_fd=fd)
                except OSError:
                    continue
                stack.append((sub, os.scandir(sub)))
    finally:
        for fd, entries in stack:
            entries.close()
            os.close(fd)


class DiskQuota:
    """A cap on what a build writes into its writable paths, enforced by polling.

    Kernel quotas would be exact but need a filesystem prepared for them (project quotas) or a
    loop device per build, which neither containers nor most hosts give a worker (and a sized
    tmpfs per build would put its whole workspace in RAM). So the worker measures, every
    ``every`` seconds from the reaper's tick, the blocks allocated below the paths (st_blocks,
    never st_size, so a sparse file counts what it holds and a preallocated one all of it;
    hard links counted once, links never followed) and the files the build's processes hold
    open, or mapped, after unlinking them (found through ``/proc/<pid>/fd`` and
    ``/proc/<pid>/map_files``, stat-ed there, never opened), and kills the build past the cap:
    it may overshoot by what the build writes between two looks. The RAM-backed ``/tmp`` and
    ``/dev/shm`` have their own hard cap (:data:`worker.sandbox.wrapper.TMPFS_BYTES`).

    ``shared`` paths outlive the build (the compile cache's directory): only what they grow by
    after the quota is made counts, not what earlier builds left there.
    """

    def __init__(self, paths: Iterable[Path], limit_bytes: int, *, every: float = 5.0,
                 max_entries: int = 2_000_000, shared: Iterable[Path] = ()) -> None:
        self.paths = tuple(paths)
        self.shared = tuple(shared)
        self.limit_bytes = limit_bytes
        self.every = every
        self.max_entries = max_entries
        self.peak = 0
        self.peak_unlinked = 0
        """Most bytes seen in files the build held open after unlinking them."""
        self._next = 0.0
        self._shared_before = self._measure(self.shared)

    @classmethod
    def from_config(cls, config: Config, paths: Iterable[Path],
                    shared: Iterable[Path] = ()) -> DiskQuota | None:
        if config.build_disk_limit_gib <= 0:
            return None
        return cls(paths, int(config.build_disk_limit_gib * GIB), shared=shared)

    def usage(self, processes: Iterable[psutil.Process] = ()) -> int:
        """Bytes the build holds below the paths (and has added below the shared ones), and in
        unlinked files ``processes`` keep open there; raise ``BuildFailed`` for a tree too big
        to walk."""
        unlinked = self._unlinked(processes)
        total = (self._measure(self.paths) + unlinked
                 + max(0, self._measure(self.shared) - self._shared_before))
        self.peak = max(self.peak, total)
        self.peak_unlinked = max(self.peak_unlinked, unlinked)
        return total

    def _measure(self, paths: Iterable[Path]) -> int:
        linked: set[tuple[int, int]] = set()  # only multiply-linked files: a set of all is big
        total = entries = 0
        try:
            for root in paths:
                for _, _, st in walk_tree(root):
                    entries += 1
                    if entries > self.max_entries:
                        raise BuildFailed(FailureKind.TOO_LARGE,
                                          f"the build created more than {self.max_entries} "
                                          "files and directories in its workspace")
                    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                        if (st.st_dev, st.st_ino) in linked:
                            continue
                        linked.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        except TooDeep:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"the build nested directories deeper than {MAX_DEPTH} levels"
                              ) from None
        return total

    def _unlinked(self, processes: Iterable[psutil.Process]) -> int:
        """Blocks of the unlinked regular files the processes hold, on the filesystems of the
        capped paths (each inode once: many descriptors may share one file)."""
        devices = set()
        for root in (*self.paths, *self.shared):
            with contextlib.suppress(OSError):
                devices.add(os.lstat(root).st_dev)
        seen: set[tuple[int, int]] = set()
        total = looked = 0
        for proc in processes:
            for handle in _unlinked_handles(proc.pid):
                looked += 1
                if looked > self.max_entries:
                    raise BuildFailed(FailureKind.TOO_LARGE,
                                      f"the build held more than {self.max_entries} files open")
                try:
                    st = os.stat(handle)  # the open file itself; the kernel resolves it
                except OSError:
                    continue  # closed, or the process ended, while we looked
                key = (st.st_dev, st.st_ino)
                if stat.S_ISREG(st.st_mode) and st.st_dev in devices and key not in seen:
                    seen.add(key)
                    total += st.st_blocks * 512
        return total

    def check(self, processes: Callable[[], Iterable[psutil.Process]] | None = None) -> None:
        """Measure when due; raise ``BuildFailed`` (too-large) past the cap.

        Call it from ``BuildProcess.wait``'s ``on_tick`` with ``BuildProcess.processes``: an
        exception there kills the tree.
        """
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every
        used = self.usage(processes() if processes is not None else ())
        if used > self.limit_bytes:
            held = (f", {_size(self.peak_unlinked)} of it in files it unlinked but kept open"
                    if self.peak_unlinked else "")
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"the build wrote {_size(used)} into its workspace{held}, over "
                              f"the {_size(self.limit_bytes)} cap "
                              "(WHEELHOUSE_BUILD_DISK_LIMIT_GIB)")


_DELETED = " (deleted)"
_MAX_MAPS_BYTES = 16 * 1024 * 1024


def _unlinked_handles(pid: int) -> Iterator[str]:
    """``/proc`` paths of the files ``pid`` holds open or mapped whose names are gone.

    Only the kernel's own text is read (link targets, ``maps``); the files are stat-ed
    through these paths by the caller, never opened.
    """
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return
    for name in names:
        try:
            target = os.readlink(f"{fds}/{name}")
        except OSError:
            continue
        if target.endswith(_DELETED):
            yield f"{fds}/{name}"
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            text = maps.read(_MAX_MAPS_BYTES)
    except OSError:
        return
    for line in text.splitlines():
        # start-end perms offset dev inode path; the kernel escapes newlines in the path.
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != b"0" and line.endswith(_DELETED.encode()):
            yield f"/proc/{pid}/map_files/{fields[0].decode()}"


class TreeLimits:
    """Caps on a build's processes (and threads) and memory, checked from the reaper's tick.

    The process cap is enforced by the kernel too: a root worker's sandbox sets the build uid's
    ``RLIMIT_NPROC`` (:attr:`Sandbox.max_processes`), and each build has its own uid
    (:meth:`Sandbox.claim`), so a fork bomb stops at the cap; reaching it ends the build here,
    classified, instead of leaving it to fail in whatever way its programs fail. Memory is
    capped by the build's cgroup (``memory.max``) where the worker has a writable one, and
    always by this sampled sum of the tree's resident memory: it may overshoot by what the build
    allocates between two looks, as the disk cap does.
    """

    def __init__(self, *, max_processes: int, max_bytes: int, every: float = 1.0,
                 margin: int = 8) -> None:
        self.max_processes = max_processes
        self.max_bytes = max_bytes
        self.every = every
        self.margin = margin
        self.peak_processes = 0
        self.peak_bytes = 0
        self._next = 0.0

    @classmethod
    def from_config(cls, config: Config) -> TreeLimits:
        limit = int(config.build_memory_limit_gib * GIB)
        if limit <= 0:
            # The host's memory: a legitimate build that needs more is killed by the kernel
            # first and retried as oom at half MAX_JOBS (the governor keeps it below anyway);
            # a lower cap is for hosts that share their memory with more than one build.
            limit = int(psutil.virtual_memory().total)
        return cls(max_processes=max(0, config.build_max_processes), max_bytes=limit)

    def check(self, processes: Callable[[], Iterable[psutil.Process]]) -> None:
        """Measure when due; raise ``BuildFailed`` (too-large) at the caps.

        ``processes`` gives the build's ``psutil.Process`` objects (``BuildProcess.processes``).
        """
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every
        tasks = held = 0
        for proc in processes():
            try:
                with proc.oneshot():
                    tasks += proc.num_threads()
                    held += proc.memory_info().rss
            except psutil.Error:
                continue
        self.peak_processes = max(self.peak_processes, tasks)
        self.peak_bytes = max(self.peak_bytes, held)
        if self.max_processes and tasks >= self.max_processes - self.margin:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"the build ran {tasks} processes and threads at once, at its cap "
                              f"of {self.max_processes} (WHEELHOUSE_BUILD_MAX_PROCESSES)")
        if held > self.max_bytes:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"the build's processes held {_size(held)} of memory, over the "
                              f"{_size(self.max_bytes)} cap (WHEELHOUSE_BUILD_MEMORY_LIMIT_GIB)")


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n >> 20} MiB"
