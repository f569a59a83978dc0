"""Run a build's programs in a sandbox: another identity, its own view of the host, no network.

An sdist is arbitrary code. Everything that runs it (metadata preparation, the build backend,
``setup.py``, nvcc, the import check) is wrapped by :meth:`Sandbox.wrap` in bubblewrap
(Debian's ``bubblewrap``), which gives it

- its own PID namespace with a private ``/proc``: only the build's processes are visible, so no
  other process's ``environ`` or ``cmdline`` can be read and no other pid can be signalled; when
  the namespace's init dies the kernel kills everything in it;
- its own mount namespace on an empty root: the system directories (``/usr``, ``/etc``, ...)
  read-only, the paths of :class:`Layout` read-only or writable at the same place as outside (a
  venv's scripts carry absolute paths) except the build's source, which every build sees at
  :data:`SOURCE_INSIDE` (the compile cache's keys hold nvcc's absolute source path), a minimal
  ``/dev`` without GPU devices, and size-capped
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
sandbox's processes are all dead, and only by descriptor (:mod:`worker.sandbox.safefs`):
:func:`worker.sandbox.takeout.take_wheel` copies out one regular file, never following a link the
build may have planted. :mod:`worker.sandbox.limits` caps what a build writes, its processes and
memory; :mod:`worker.sandbox.uids` gives each build a uid of its own;
:mod:`worker.sandbox.seccomp` denies it user namespaces and kernel keyrings.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from worker.errors import SandboxUnavailable
from worker.sandbox import seccomp
from worker.sandbox.limits import GIB, MAX_DEPTH, TooDeep, walk_tree
from worker.sandbox.uids import claim_uid, uid_range

MODES = ("on", "off")
"""Values of ``WHEELHOUSE_BUILD_SANDBOX``; ``off`` is the only way to build unsandboxed."""

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

SOURCE_INSIDE = Path("/wheelhouse/src")
"""Where every sandboxed build sees its source path (``<workspace root>/src/<project>-<version>``
outside), on every host, whatever its ``WHEELHOUSE_WORKSPACE``: sccache 0.16.0 hashes the
absolute source path nvcc hands cicc, so nvcc's cache entries hit between hosts only where this
path is the same (docs/compiling.md)."""

VENV_INSIDE = Path("/wheelhouse/venv")
"""Where every sandboxed build sees its venv (``<build workspace>/venv`` outside, a new directory
for every build): torch's headers are included from there, and nvcc's front end writes their
absolute paths into the host code it generates, which sccache 0.16.0 caches and hashes as it
is. A cached copy from a build whose venv lay elsewhere never hit the host compile's entry
(docs/compiling.md)."""


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
    devices: tuple[Path, ...] = ()
    """Host device nodes added to the sandbox's own ``/dev`` (a GPU proof's ``/dev/nvidia*``):
    character devices only, never links."""
    moved: tuple[tuple[Path, Path], ...] = ()
    """(outside, inside) pairs: a read-only or writable path at or below ``outside`` is mounted
    at the same place below ``inside`` (the build's source at :data:`SOURCE_INSIDE`, its venv
    at :data:`VENV_INSIDE`)."""

    @classmethod
    def in_workspace(cls, workspace: Path, *, read_only: Iterable[Path] = (),
                     writable: Iterable[Path] = (), devices: Iterable[Path] = (),
                     moved: Iterable[tuple[Path, Path]] = ()) -> Layout:
        """The build's ``HOME`` and ``TMPDIR`` in ``workspace/home`` and ``workspace/tmp``."""
        return cls(home=workspace / "home", tmp=workspace / "tmp",
                   read_only=tuple(read_only), writable=tuple(writable), devices=tuple(devices),
                   moved=tuple(moved))

    @property
    def all_writable(self) -> tuple[Path, ...]:
        return (self.home, self.tmp, *self.writable)

    def inside(self, path: Path) -> Path:
        """Where the sandboxed program sees ``path`` (a path outside)."""
        return seen_at(path, self.moved)


def seen_at(path: Path, moved: Iterable[tuple[Path, Path]]) -> Path:
    """Where ``path`` (outside) is inside a sandbox whose :attr:`Layout.moved` is ``moved``."""
    for outside, there in moved:
        if path.is_relative_to(outside):
            return there / path.relative_to(outside)
    return path


#: Every directory a build can write, named relative to the places it lies in (``{build}``: the
#: build's workspace, ``{source}``: its project version's source path, ``{cache}``: the compile
#: cache's root), and all the worker does there once the build's processes are dead. A step
#: that gives a build anything else writable is refused (:func:`writable_place`); the table in
#: docs/security.md lists these, and a test keeps the two equal.
BUILD_WRITABLE: dict[str, str] = {
    "{build}/home": "nothing; removed with the workspace, by descriptor",
    "{build}/tmp": "nothing; removed with the workspace, by descriptor",
    "{build}/dist": "take_wheel: one regular file copied out by descriptor, size-capped",
    "{build}/sccache": "read_stats: stats.json read by descriptor, size-capped, never blocking",
    "{build}/load-check": "nothing; removed with the workspace, by descriptor",
    "{build}/inspect": "Runner.untrusted: report.json read by descriptor, size-capped; the "
                       "checked wheels and their METADATA copied out by descriptor, size-capped",
    "{source}": "nothing; removed by descriptor when the build ends",
    "{cache}/<project>/cu<cuda>": "pull creates fresh entries, push copies entries out, both "
                                  "by descriptor and of sccache's layout only",
}


def writable_place(path: Path, *, build: Path, source: Path, cache: Path) -> str:
    """The :data:`BUILD_WRITABLE` name of ``path``; :class:`SandboxUnavailable` for a path
    that is not one of them (a step that would hand the build a place nobody checked)."""
    if path == source:
        return "{source}"
    if path.parent == build and f"{{build}}/{path.name}" in BUILD_WRITABLE:
        return f"{{build}}/{path.name}"
    if path.parent.parent == cache and path.name.startswith("cu"):
        return "{cache}/<project>/cu<cuda>"
    raise SandboxUnavailable(f"{path} is not a registered build-writable place "
                             "(worker.sandbox.wrapper.BUILD_WRITABLE)")


def source_path(config: Config) -> Path:
    """Where this worker's builds see the directory their sources are unpacked in (what its
    advert says, :func:`wheelhouse.builds.fleet.source_paths_differ`): :data:`SOURCE_INSIDE`
    sandboxed, ``<workspace>/src`` unsandboxed."""
    if config.build_sandbox.strip().lower() == "off":
        return Path(config.workspace).resolve() / "src"
    return SOURCE_INSIDE


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
    uids: tuple[int, int] = (0, 0)
    """The configured range (first, last) :meth:`claim` takes a build's uid from."""
    max_processes: int = 0
    """RLIMIT_NPROC of the build's uid (root workers; 0: none)."""
    seccomp_dir: Path | None = None
    """Where the worker keeps the seccomp filter (:mod:`worker.sandbox.seccomp`); None: no
    filter."""
    slots_dir: Path | None = None
    """Where the locks of claimed uids live: one directory for the whole host
    (``WHEELHOUSE_BUILD_UID_LOCK_DIR``), whatever each worker's workspace, so that two workers
    on one host never hand out the same uid."""

    def __post_init__(self) -> None:
        if self.as_root and (self.uid <= 0 or self.gid <= 0):
            raise ValueError("WHEELHOUSE_BUILD_UID_RANGE must name unprivileged uids (not 0)")

    @classmethod
    def from_config(cls, config: Config) -> Sandbox | None:
        """The configured sandbox, or None when ``WHEELHOUSE_BUILD_SANDBOX=off``."""
        mode = config.build_sandbox.strip().lower()
        if mode not in MODES:
            raise ValueError(f"WHEELHOUSE_BUILD_SANDBOX must be on or off, got "
                             f"{config.build_sandbox[:40]!r}")
        if mode == "off":
            return None
        first, last = uid_range(config.build_uid_range)
        workspace = Path(config.workspace).resolve()
        return cls(uid=first, gid=first, bwrap=config.build_sandbox_bwrap, uids=(first, last),
                   max_processes=max(0, config.build_max_processes),
                   seccomp_dir=workspace / ".sandbox" if seccomp.supported() else None,
                   slots_dir=Path(config.build_uid_lock_dir))

    def claim(self, *, wait: Callable[[], None] | None = None) -> tuple[Sandbox, int | None]:
        """This sandbox with a uid of the range no other build on this host holds, and the lock
        that holds it (close it when the build's processes are all gone).

        Builds of different projects, or two at once, then never share a uid: not its kernel
        keyring, its process limit, its files in shared places. All taken: ``wait`` is called
        between tries (it raises to give up). A worker that is not root has one identity only.
        """
        if not self.as_root or self.slots_dir is None:
            return self, None
        uid, fd = claim_uid(self.slots_dir, self.uids, wait=wait)
        return replace(self, uid=uid, gid=uid), fd

    @property
    def build_uids(self) -> frozenset[int]:
        """The uids the build's processes have on the host (the reaper looks for these)."""
        return frozenset({self.uid if self.as_root else os.getuid()})

    @property
    def range_uids(self) -> frozenset[int]:
        """Every uid any build on this host may run as (orphans of dead builds have these)."""
        if not self.as_root:
            return self.build_uids
        return frozenset(range(self.uids[0], self.uids[1] + 1)) | {self.uid}

    def describe(self) -> str:
        """One line for the worker's start-up log and the build record."""
        if self.as_root:
            return (f"bubblewrap: build user {self.uid}:{self.gid}, own PID, mount, network, "
                    "IPC and UTS namespaces, no user namespaces or keyrings"
                    + (f", at most {self.max_processes} processes" if self.max_processes else ""))
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
        if parent.st_uid in self.range_uids - {os.getuid()}:
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
        for device in layout.devices:
            try:
                mode = os.lstat(device).st_mode
            except OSError as exc:
                raise SandboxUnavailable(f"{device}: {exc.strerror}") from None
            if not stat.S_ISCHR(mode) or not device.is_relative_to("/dev"):
                raise SandboxUnavailable(f"{device} is not a character device under /dev")
            out += ["--dev-bind", str(device), str(device)]
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
                links += ["--symlink", os.readlink(path), str(layout.inside(path))]
                path = path.parent / os.readlink(path)
            if not _is_system(path):
                binds.append((Path(os.path.normpath(path)), "--ro-bind"))
        binds += [(path, "--bind") for path in layout.all_writable]
        mounts = [(path, layout.inside(path), how) for path, how in binds]
        _check_moved(layout, [(path, there) for path, there, _ in mounts])
        # bubblewrap gives the directories it creates above a mount the modes of their
        # counterparts outside, and a 0700 /root or pytest's 0700 base directory would hide the
        # mount from the build user: create them first, root's and traversable.
        for parent in _parents_to_create([there for _, there, _ in mounts]):
            out += ["--perms", "0755", "--dir", str(parent)]
        for path, there, how in sorted(mounts, key=lambda mount: len(mount[1].parts)):
            out += [how, str(path), str(there)]
        out += links
        # In a user namespace the sandbox's own root belongs to the build user: keep it from
        # becoming an unsized RAM disk (/tmp and /dev/shm are separate, capped mounts).
        out += ["--remount-ro", "/", "--chdir", str(layout.inside(cwd))]
        if self.as_root:
            setpriv = shutil.which(self.setpriv)
            if setpriv is None:
                raise SandboxUnavailable(f"setpriv ({self.setpriv!r}, util-linux) is not "
                                         "installed")
            for cap in _DROP_CAPS:
                out += ["--cap-add", cap]
            out.append("--")
            if self.max_processes > 0:
                # Before the drop: the limit counts the build uid's tasks from its first fork.
                prlimit = shutil.which("prlimit")
                if prlimit is None:
                    raise SandboxUnavailable("prlimit (util-linux) is not installed")
                out += [prlimit, f"--nproc={self.max_processes}:{self.max_processes}", "--"]
            out += [setpriv, "--reuid", str(self.uid), "--regid", str(self.gid),
                    "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                    "--no-new-privs", "--"]
        else:
            out.append("--")
        if self.seccomp_dir is not None:
            # bubblewrap reads the filter from a descriptor: a shell opens the worker's file as
            # descriptor 9 and execs bubblewrap (arguments as positional parameters, unparsed).
            filter_file = seccomp.write_filter(self.seccomp_dir)
            out = ["/bin/sh", "-c", 'exec 9<"$1" || exit 1; shift; exec "$0" "$@"', out[0],
                   str(filter_file), "--seccomp", "9", *out[1:]]
        return [*out, *argv]


def _check_moved(layout: Layout, mounts: Sequence[tuple[Path, Path]]) -> None:
    """Refuse a layout where a path from elsewhere would be mounted below a moved place (its
    mount point would be made in the build's own tree), or a moved place that is a system
    directory, the root or ``/tmp``."""
    for outside, there in layout.moved:
        if _is_system(there) or there in (Path("/"), Path("/tmp")):  # noqa: S108
            raise SandboxUnavailable(f"{there} can't take the build's {outside}")
        for path, at in mounts:
            if at.is_relative_to(there) and not path.is_relative_to(outside):
                raise SandboxUnavailable(
                    f"{path} would be mounted inside {there}, where the build sees its "
                    f"{outside} (is WHEELHOUSE_WORKSPACE below {there}?)")


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


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid, follow_symlinks=False)
    try:
        for dir_fd, name, _ in walk_tree(root):
            with contextlib.suppress(FileNotFoundError):
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
    except TooDeep:
        raise BuildFailed(FailureKind.TOO_LARGE,
                          f"{root.name} nests directories deeper than {MAX_DEPTH} levels"
                          ) from None


# --- fail closed --------------------------------------------------------------------------


def startup_check(config: Config, *, claimed: Sandbox | None = None) -> str | None:
    """Create a sandbox as builds get it and run ``true`` in it; None when that worked.

    Otherwise one line saying why not, for the worker to print before it refuses build jobs.
    With ``WHEELHOUSE_BUILD_SANDBOX=off`` there is nothing to check (the worker warns instead).
    ``claimed`` is a sandbox whose uid the caller holds (a build's own); without it the check
    claims a uid of the range for as long as it runs, as a build would: running as a uid some
    build on the host holds would share that build's identity.
    """
    lock = None
    if claimed is None:
        try:
            sandbox = Sandbox.from_config(config)
        except ValueError as exc:
            return str(exc)
        if sandbox is None:
            return None
        try:
            claimed, lock = sandbox.claim(wait=_check_waiter())
        except SandboxUnavailable as exc:
            return f"the build sandbox is unavailable: {exc}"
        except OSError as exc:
            return f"the build sandbox cannot be created: {exc}"
    try:
        return _check(config, claimed)
    finally:
        if lock is not None:
            os.close(lock)


def _check_waiter() -> Callable[[], None]:
    """Wait for a free uid up to the check's timeout, then give up (every uid is busy)."""
    end = time.monotonic() + _CHECK_TIMEOUT

    def wait() -> None:
        if time.monotonic() > end:
            raise SandboxUnavailable(f"no build uid of WHEELHOUSE_BUILD_UID_RANGE came free "
                                     f"within {_CHECK_TIMEOUT:.0f} s")
        time.sleep(0.5)

    return wait


def _check(config: Config, sandbox: Sandbox) -> str | None:
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
