"""Run a build's programs in a sandbox: another identity, its own view of the host, no network.

An sdist is arbitrary code. Everything that runs it (metadata preparation, the build backend,
``setup.py``, nvcc, the import check) is wrapped by :meth:`Sandbox.wrap` in bubblewrap
(Debian's ``bubblewrap``), which gives it

- its own PID namespace with a private ``/proc``: only the build's processes are visible, so no
  other process's ``environ`` or ``cmdline`` can be read and no other pid can be signalled; when
  the namespace's init dies the kernel kills everything in it;
- its own mount namespace on an empty root: the system directories (``/usr``, ``/etc``, ...)
  read-only, the paths of :class:`Layout` read-only or writable at the same place as outside (a
  venv's scripts carry absolute paths), a minimal ``/dev`` without GPU devices, and size-capped
  private ``/tmp`` and ``/dev/shm``. The worker's home, credentials, configuration, the storage
  directory and the rest of the workspace root are not mounted at all;
- its own network namespace with only a loopback of its own (unless ``network=True``), and its own
  IPC and UTS namespaces (and cgroup namespace where the kernel allows);
- another identity. A root worker runs bubblewrap without a user namespace and drops to the
  configured build uid/gid with ``setpriv`` (no supplementary groups, empty capability sets and
  bounding set, ``no_new_privs``) before the build's first instruction: the build is an
  unprivileged user on the host, not root in disguise. A worker that is not root can only get
  namespaces through a user namespace, which maps the build back to the worker's own uid outside:
  the namespaces still hide the worker's processes, files and network, but there is no second
  identity behind them (documented as the weaker mode; :meth:`Sandbox.describe` says which).

What leaves the sandbox is only what the worker reads back from the writable paths after the
sandbox's processes are all dead: :func:`take_wheel` copies out one regular file, never following
a link the build may have planted. :class:`DiskQuota` caps what a build writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind, SandboxUnavailable

MODES = ("on", "off")
"""Values of ``WHEELHOUSE_BUILD_SANDBOX``; ``off`` is the only way to build unsandboxed."""

GIB = 1024**3
TMPFS_BYTES = 1 * GIB
"""Size cap of the private ``/tmp`` and ``/dev/shm`` (RAM-backed); ``TMPDIR`` points at the
workspace, so only programs that hard-code ``/tmp`` land here."""

#: System directories every sandbox sees read-only (a merged-/usr link is recreated as a link).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")

#: Capabilities bubblewrap leaves to setpriv so that it can drop to the build user (and drop the
#: bounding set); setpriv's own exec of the build clears them all.
_DROP_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")
_CHECK_TIMEOUT = 60.0
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup


@dataclass(frozen=True)
class Layout:
    """What one sandboxed program sees of the workspace and toolchain, besides the system.

    Every path appears at the same place inside as outside. ``writable`` paths (and ``home``
    and ``tmp``) belong to the build user after :meth:`Sandbox.prepare`; ``read_only`` paths
    (toolkit, build venv, its base Python) must be readable by it. Keep every path a direct
    child of a directory the build never had writable (the workspace itself is never mounted):
    mount sources are resolved outside, by the worker's identity, and a worker that is not
    root cannot tell the build's files from its own.
    """

    home: Path
    tmp: Path
    read_only: tuple[Path, ...] = ()
    writable: tuple[Path, ...] = ()

    @classmethod
    def in_workspace(cls, workspace: Path, *, read_only: Iterable[Path] = (),
                     writable: Iterable[Path] = ()) -> Layout:
        """The build's ``HOME`` and ``TMPDIR`` in ``workspace/home`` and ``workspace/tmp``."""
        return cls(home=workspace / "home", tmp=workspace / "tmp",
                   read_only=tuple(read_only), writable=tuple(writable))

    @property
    def all_writable(self) -> tuple[Path, ...]:
        return (self.home, self.tmp, *self.writable)


def python_prefix(python: Path) -> Path | None:
    """The installation a venv's interpreter belongs to (``pyvenv.cfg``'s ``home``, one up).

    A venv's ``bin/python`` is a link into it (e.g. uv's managed Pythons under the worker's
    home), so the sandbox must mount it read-only too. None for an interpreter outside a venv.
    """
    cfg = python.parent.parent / "pyvenv.cfg"
    try:
        lines = cfg.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home":
            return Path(value.strip()).parent
    return None


@dataclass(frozen=True)
class Sandbox:
    """How this worker sandboxes builds; build one with :meth:`from_config`."""

    uid: int
    gid: int
    bwrap: str = "bwrap"
    setpriv: str = "setpriv"
    tmpfs_bytes: int = TMPFS_BYTES
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    """Whether the worker is root (a real second identity) or not (a user namespace)."""

    @classmethod
    def from_config(cls, config: Config) -> Sandbox | None:
        """The configured sandbox, or None when ``WHEELHOUSE_BUILD_SANDBOX=off``."""
        mode = config.build_sandbox.strip().lower()
        if mode not in MODES:
            raise ValueError(f"WHEELHOUSE_BUILD_SANDBOX must be on or off, got "
                             f"{config.build_sandbox[:40]!r}")
        if mode == "off":
            return None
        sandbox = cls(uid=config.build_uid, gid=config.build_gid,
                      bwrap=config.build_sandbox_bwrap)
        if sandbox.as_root and (sandbox.uid <= 0 or sandbox.gid <= 0):
            raise ValueError("WHEELHOUSE_BUILD_UID and WHEELHOUSE_BUILD_GID must name an "
                             "unprivileged user and group (not 0)")
        return sandbox

    @property
    def build_uids(self) -> frozenset[int]:
        """The uids the build's processes have on the host (the reaper looks for these)."""
        return frozenset({self.uid if self.as_root else os.getuid()})

    def describe(self) -> str:
        """One line for the worker's start-up log and the build record."""
        if self.as_root:
            return (f"bubblewrap: build user {self.uid}:{self.gid}, own PID, mount, network, "
                    "IPC and UTS namespaces")
        return (f"bubblewrap in a user namespace: the worker is not root, so builds keep its uid "
                f"{os.getuid()} outside; own PID, mount, network, IPC and UTS namespaces")

    # -- setting up --

    def prepare(self, layout: Layout) -> None:
        """Create the writable paths and hand them to the build user; check the read-only ones.

        Call it only while no process of the build's earlier steps lives. bubblewrap resolves
        mount sources as root, so every layout path must be a real directory whose parent the
        build user does not own: a path inside an earlier step's writable tree could have been
        swapped for a link to the worker's secrets. Ownership is changed without following
        links (a tree the build already wrote into can be prepared again).
        """
        for path in layout.all_writable:
            path.mkdir(parents=True, exist_ok=True)
            self._check_source(path, link_ok=False)
        for path in layout.read_only:
            self._check_source(path, link_ok=True)
        if not self.as_root:
            return
        for path in layout.all_writable:
            if os.lstat(path).st_uid != self.uid:  # new, or the worker's (an unpacked sdist)
                _chown_tree(path, self.uid, self.gid)
        for path in layout.read_only:
            try:
                mode = path.stat().st_mode
            except OSError as exc:
                raise SandboxUnavailable(f"{path}: {exc.strerror}") from None
            need = (stat.S_IROTH | stat.S_IXOTH) if stat.S_ISDIR(mode) else stat.S_IROTH
            if mode & need != need:
                raise SandboxUnavailable(
                    f"{path} is not readable by the build user {self.uid} (mode "
                    f"{stat.S_IMODE(mode):o}; is the worker's umask 077?)")

    def _check_source(self, path: Path, *, link_ok: bool) -> None:
        try:
            own = os.lstat(path)
            parent = os.lstat(path.parent)
        except OSError as exc:
            raise SandboxUnavailable(f"{path}: {exc.strerror}") from None
        if stat.S_ISLNK(own.st_mode) and not link_ok:
            raise SandboxUnavailable(f"{path} is a link; writable paths must be real directories")
        if parent.st_uid in self.build_uids - {os.getuid()}:
            raise SandboxUnavailable(f"{path} lies in a directory the build user owns")

    def environment(self, env: Mapping[str, str], layout: Layout) -> dict[str, str]:
        """``env`` with the build's own ``HOME``, ``TMPDIR`` and user name."""
        return {**env, "HOME": str(layout.home), "TMPDIR": str(layout.tmp),
                "USER": "build", "LOGNAME": "build"}

    def wrap(self, argv: Sequence[str], *, layout: Layout, cwd: Path,
             network: bool = False) -> list[str]:
        """The argv that runs ``argv`` inside a fresh sandbox, in ``cwd``.

        ``network=True`` shares the host's network (a recipe that opted in with a reason); the
        build still sees no credentials, so the worker's services only see an unauthenticated
        stranger. Raise :class:`SandboxUnavailable` when a program the sandbox needs is missing.
        """
        if not argv:
            raise ValueError("empty argv")
        bwrap = shutil.which(self.bwrap)
        if bwrap is None:
            raise SandboxUnavailable(f"bubblewrap ({self.bwrap!r}) is not installed")
        out = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--hostname", "wheelhouse-build"]
        if not network:
            out.append("--unshare-net")
        if not self.as_root:
            out += ["--unshare-user", "--uid", str(self.uid), "--gid", str(self.gid),
                    "--disable-userns"]
        for name in SYSTEM_PATHS:
            path = Path(name)
            if path.is_symlink():
                out += ["--symlink", os.readlink(path), name]
            elif path.exists():
                out += ["--ro-bind", name, name]
        out += ["--proc", "/proc", "--dev", "/dev"]
        # A tmpfs /tmp first: workspace paths below /tmp (as in tests) get their mount points
        # in it rather than in anything on disk.
        size = str(self.tmpfs_bytes)
        out += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp",  # noqa: S108
                "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]  # noqa: S108
        binds: list[tuple[Path, str]] = []
        links: list[str] = []
        for path in layout.read_only:
            # A toolkit at /opt/cuda -> /opt/cuda-12.8: the link inside too, and its target.
            for _ in range(_MAX_LINKS):
                if not path.is_symlink() or _is_system(path):
                    break
                links += ["--symlink", os.readlink(path), str(path)]
                path = path.parent / os.readlink(path)
            if not _is_system(path):
                binds.append((Path(os.path.normpath(path)), "--ro-bind"))
        binds += [(path, "--bind") for path in layout.all_writable]
        # bubblewrap gives the directories it creates above a mount the modes of their
        # counterparts outside, and a 0700 /root or pytest's 0700 base directory would hide the
        # mount from the build user: create them first, root's and traversable.
        for parent in _parents_to_create([path for path, _ in binds]):
            out += ["--perms", "0755", "--dir", str(parent)]
        for path, how in sorted(binds, key=lambda bind: len(bind[0].parts)):
            out += [how, str(path), str(path)]
        out += links
        # In a user namespace the sandbox's own root belongs to the build user: keep it from
        # becoming an unsized RAM disk (/tmp and /dev/shm are separate, capped mounts).
        out += ["--remount-ro", "/", "--chdir", str(cwd)]
        if self.as_root:
            setpriv = shutil.which(self.setpriv)
            if setpriv is None:
                raise SandboxUnavailable(f"setpriv ({self.setpriv!r}, util-linux) is not "
                                         "installed")
            for cap in _DROP_CAPS:
                out += ["--cap-add", cap]
            out += ["--", setpriv, "--reuid", str(self.uid), "--regid", str(self.gid),
                    "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                    "--no-new-privs", "--"]
        else:
            out.append("--")
        return [*out, *argv]


def _is_system(path: Path) -> bool:
    """Already visible through a system mount (e.g. a toolkit under /usr/local)."""
    return any(path.is_relative_to(name) for name in SYSTEM_PATHS)


def _parents_to_create(paths: Sequence[Path]) -> list[Path]:
    """Directories above the mounted paths that exist only in the sandbox's own root."""
    bound = {Path(p) for p in SYSTEM_PATHS} | set(paths)
    parents: set[Path] = set()
    for path in paths:
        for parent in path.parents:
            if parent in (Path("/"), Path("/tmp")) or any(  # noqa: S108
                    parent.is_relative_to(b) for b in bound):
                continue  # the root and /tmp are the sandbox's own; the rest exist already
            parents.add(parent)
    return sorted(parents, key=lambda p: len(p.parts))


MAX_DEPTH = 256
"""Deepest directory nesting the worker walks in a build's tree (an sdist's, or what it wrote)."""


class _TooDeep(Exception):
    pass


def _walk(root: Path) -> Iterator[tuple[int, str, os.stat_result]]:
    """``(directory fd, name, lstat)`` of everything below ``root``, depth first.

    Relative to open directory descriptors, never through built-up paths: links are never
    followed and no path grows past ``PATH_MAX``, however deep a hostile tree is. Raises
    ``_TooDeep`` past ``MAX_DEPTH`` levels, which bounds the descriptors held open.
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
                    raise _TooDeep
                try:
                    sub = os.open(entry.name, flags, dir_fd=fd)
                except OSError:
                    continue
                stack.append((sub, os.scandir(sub)))
    finally:
        for fd, entries in stack:
            entries.close()
            os.close(fd)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid, follow_symlinks=False)
    try:
        for dir_fd, name, _ in _walk(root):
            with contextlib.suppress(FileNotFoundError):
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
    except _TooDeep:
        raise BuildFailed(FailureKind.TOO_LARGE,
                          f"{root.name} nests directories deeper than {MAX_DEPTH} levels"
                          ) from None


# --- fail closed --------------------------------------------------------------------------


def startup_check(config: Config) -> str | None:
    """Create a sandbox as builds get it and run ``true`` in it; None when that worked.

    Otherwise one line saying why not, for the worker to print before it refuses build jobs.
    With ``WHEELHOUSE_BUILD_SANDBOX=off`` there is nothing to check (the worker warns instead).
    """
    try:
        sandbox = Sandbox.from_config(config)
    except ValueError as exc:
        return str(exc)
    if sandbox is None:
        return None
    workspace = Path(config.workspace).resolve()
    try:
        workspace.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="sandbox-check-", dir=workspace) as tmp:
            layout = Layout.in_workspace(Path(tmp))
            sandbox.prepare(layout)
            argv = sandbox.wrap(["true"], layout=layout, cwd=layout.home)
            env = sandbox.environment({"PATH": "/usr/bin:/bin"}, layout)
            done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=_CHECK_TIMEOUT, check=False)
    except SandboxUnavailable as exc:
        return f"the build sandbox is unavailable: {exc}"
    except subprocess.TimeoutExpired:
        return f"the build sandbox did not run `true` within {_CHECK_TIMEOUT:.0f} s"
    except OSError as exc:
        return f"the build sandbox cannot be created: {exc}"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        why = lines[-1].strip() if lines else f"exit status {done.returncode}"
        return f"the build sandbox cannot be created: {why[:300]}"
    return None


# --- limits -------------------------------------------------------------------------------


class DiskQuota:
    """A cap on what a build writes into its writable paths, measured by walking them.

    Kernel quotas would be exact but need a filesystem prepared for them (project quotas) or a
    loop device per build, which neither containers nor most hosts give a worker. So the worker
    measures allocated blocks (hard links counted once, links never followed) every ``every``
    seconds from the reaper's tick and kills the build past the cap: it may overshoot by what
    the build writes between two looks. The RAM-backed ``/tmp`` and ``/dev/shm`` have their own
    hard cap (``TMPFS_BYTES``).

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
        self._next = 0.0
        self._shared_before = self._measure(self.shared)

    @classmethod
    def from_config(cls, config: Config, paths: Iterable[Path],
                    shared: Iterable[Path] = ()) -> DiskQuota | None:
        if config.build_disk_limit_gib <= 0:
            return None
        return cls(paths, int(config.build_disk_limit_gib * GIB), shared=shared)

    def usage(self) -> int:
        """Bytes the build holds below the paths (and has added below the shared ones); raise
        ``BuildFailed`` for a tree too big to walk."""
        total = (self._measure(self.paths)
                 + max(0, self._measure(self.shared) - self._shared_before))
        self.peak = max(self.peak, total)
        return total

    def _measure(self, paths: Iterable[Path]) -> int:
        linked: set[tuple[int, int]] = set()  # only multiply-linked files: a set of all is big
        total = entries = 0
        try:
            for root in paths:
                for _, _, st in _walk(root):
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
        except _TooDeep:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"the build nested directories deeper than {MAX_DEPTH} levels"
                              ) from None
        return total

    def check(self) -> None:
        """Measure when due; raise ``BuildFailed`` (too-large) past the cap.

        Call it from ``BuildProcess.wait``'s ``on_tick``: an exception there kills the tree.
        """
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every
        used = self.usage()
        if used > self.limit_bytes:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"the build wrote {used / GIB:.1f} GiB into its workspace, over "
                              f"the {self.limit_bytes / GIB:.1f} GiB cap "
                              "(WHEELHOUSE_BUILD_DISK_LIMIT_GIB)")


# --- what leaves the sandbox --------------------------------------------------------------


def take_wheel(dist: Path, dest: Path) -> Path:
    """Copy the one wheel the build left in ``dist`` into ``dest`` (a directory the worker owns).

    Call it only once every process of the sandbox is dead. The build owned ``dist``: a link
    there (to the worker's credentials, say) or a FIFO is refused, never followed or opened.
    """
    try:
        entries = sorted(p for p in dist.iterdir() if p.name.endswith(".whl"))
    except OSError as exc:
        raise BuildFailed(FailureKind.COMPILE_ERROR,
                          f"the build left no output directory: {exc.strerror}") from None
    if len(entries) != 1:
        raise BuildFailed(FailureKind.COMPILE_ERROR,
                          f"the build produced {len(entries)} wheels, expected one")
    wheel = entries[0]
    if not stat.S_ISREG(os.lstat(wheel).st_mode):
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{wheel.name[:100]} is not a regular file; refusing to read it")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / wheel.name
    fd = os.open(wheel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as src, target.open("wb") as out:
        shutil.copyfileobj(src, out)
    return target
