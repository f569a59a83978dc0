"""The build pipeline: sdist → patches → fresh venv → compile (cached) under supervision →
checked wheel (device code, load check) → published.

This module is the sequence of steps. Every step that runs a program runs it through
:class:`worker.reaper.BuildProcess`, so a timeout or cancel kills exactly this build's process
tree. The build sees a sanitized environment (:mod:`worker.buildenv`: no storage or Redis
credentials, tokens or worker settings); uploading happens here, outside it. Output goes through
a pipe into one capped log (:mod:`worker.buildlog`), which feeds the reporter (live log and
ninja's ``[N/M]`` progress) and is stored next to the result when the build ends.

Who runs what: the worker, with its network and identity, fetches and unpacks the sdist and
installs the build venv from wheels only (``--no-build``: no sdist is ever built out here). From
then on everything that executes code the sdist wrote or chose (its build requirements' ``.pth``
files run at every interpreter start) runs in the build sandbox (:mod:`worker.sandbox`) through
:meth:`Builder._sandboxed`: the torch check, the compile and the import check. After that the
worker never runs the build venv's Python itself; what leaves is one wheel file, taken out by
:func:`worker.sandbox.take_wheel` and checked by :func:`wheelhouse.wheels.validate_wheel`.

The steps that matter for what users install: the recipe's patches are applied to the unpacked
sdist (:mod:`wheelhouse.patches`) and named in the record and the wheel's METADATA; a CUDA label
is published only on a wheel whose libraries hold SASS for every requested architecture
(:mod:`worker.devicecode`); each library is loaded the way its package loads it
(:mod:`worker.loadcheck`). A project version's sdist is unpacked at one path per host, under a
lock, so that the compile cache (:mod:`worker.compilecache`) hits across Python versions.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from packaging.version import InvalidVersion, Version
from uv import find_uv_bin

from wheelhouse.buildfacts import BuildFacts, MaxJobs, Reaped
from wheelhouse.buildspec import BuildSpec
from wheelhouse.catalog import Record, record_key
from wheelhouse.config import Config
from wheelhouse.errors import (
    AlreadyPublished,
    BuildFailed,
    FailureKind,
    InfrastructureError,
    InvalidWheel,
    SandboxUnavailable,
    StorageError,
    UnsafePath,
    WheelhouseError,
)
from wheelhouse.fleet import ToolkitInfo, pick_toolkit
from wheelhouse.maxjobs import GIB, decide, record_peaks, reserve_bytes
from wheelhouse.patches import apply_patches, note_wheel
from wheelhouse.publish import publish
from wheelhouse.recipes import Recipe, load_recipe, recipe_dirs
from wheelhouse.retry import BUILD_STEPS, LOG_UPLOAD, OOM_COMPILE, RetryPolicy
from wheelhouse.storage import LocalStorage, Storage
from wheelhouse.wheels import parse_name, relabel, validate_wheel
from worker import compilecache, devicecode, loadcheck, safefs
from worker.buildenv import compile_env, install_env, sanitized_env
from worker.buildlog import MIB, BuildLog
from worker.capabilities import DEFAULT_ROOTS, discover_toolkits, nvcc_version, usable_cores
from worker.failures import Classified, classify_log, with_retries
from worker.governor import MemoryGovernor, was_oom_killed
from worker.reaper import BuildProcess, Outcome, unique_build_id
from worker.sandbox import (
    DiskQuota,
    Layout,
    Sandbox,
    TreeLimits,
    python_prefix,
    startup_check,
    take_wheel,
    writable_place,
)
from worker.sdist import SdistLimits, download_sdist, find_sdist, unpack
from worker.toolkit import ToolkitError, provision, provisionable_cuda, toolkit_root

log = logging.getLogger("wheelhouse.worker")

#: What the build record and the build page say of a build that ran unsandboxed.
UNSANDBOXED = "off (unsafe): WHEELHOUSE_BUILD_SANDBOX=off"
#: uv's words when a build requirement exists only as an sdist (the venv is installed with
#: ``--no-build``, so nothing the sdist chose is ever built outside the sandbox).
_NO_BUILD_HINT = "building from source is disabled"
_TORCH_INFO = "wheelhouse-torch-info: "


class Reporter:
    """Where a build reports to; the base class reports nowhere (override what you need)."""

    def phase(self, name: str) -> None:
        """A new step began: fetch, venv, compile, check, publish."""

    def progress(self, done: int, total: int) -> None:
        """Ninja's ``[N/M]``."""

    def lines(self, lines: list[str]) -> None:
        """New lines of the build log."""

    def note(self, **fields: Any) -> None:
        """Facts for the build page: max_jobs, max_jobs_reason, toolkit, torch."""

    def facts(self, facts: BuildFacts) -> None:
        """What the build has measured so far (after each program it ran)."""

    def should_cancel(self) -> bool:
        return False


@dataclass(frozen=True)
class BuildVenv:
    """The build venv, and what the worker learned of it before anything the sdist chose was
    installed into it (a wheel may overwrite ``pyvenv.cfg`` and ``bin/python``)."""

    python: Path
    """``<venv>/bin/python``: only ever run inside the sandbox once requirements are in."""
    interpreter: Path
    """The interpreter the venv was made from: the worker's ``uv`` installs into the venv with
    it (``--prefix``), never with the venv's own Python, whose ``.pth`` files the sdist chose."""
    prefix: Path | None
    """The installation ``interpreter`` belongs to, mounted read-only into the sandbox."""

    @property
    def root(self) -> Path:
        return self.python.parent.parent

    @property
    def read_only(self) -> tuple[Path, ...]:
        """What a sandboxed program needs to run this venv's Python."""
        return (self.root, *([self.prefix] if self.prefix is not None else []))


@dataclass
class BuildResult:
    spec: BuildSpec
    record: Record
    already_published: bool = False
    max_jobs: MaxJobs | None = None
    log_key: str | None = None
    seconds: float = 0.0
    build: BuildFacts = field(default_factory=BuildFacts)


def log_key(spec: BuildSpec) -> str:
    """Where the full log is stored: beside the wheel's record, under the same name."""
    return (f"logs/{spec.variant.base.key}/{spec.project}/"
            f"{spec.expected_wheel_name}.log")


class Builder:
    """One build of one spec. Use :func:`run_build`; the class keeps the steps readable."""

    def __init__(self, spec: BuildSpec, *, config: Config, storage: Storage, reporter: Reporter,
                 source: Path | None, timeout: float, build_id: str,
                 max_jobs: int | None, toolkits: list[ToolkitInfo] | None,
                 keep_workspace: bool, retry: RetryPolicy) -> None:
        self.spec = spec
        self.config = config
        self.storage = storage
        self.reporter = reporter
        self.source = source
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.build_id = build_id
        self.max_jobs_override = max_jobs
        self.toolkits = toolkits
        self.keep_workspace = keep_workspace
        self.retry = retry
        self.recipe: Recipe = load_recipe(spec.project, recipe_dirs(config))
        # The build id is unique to this build (see unique_build_id), so it names the workspace.
        self.workspace = Path(config.workspace).resolve() / build_id
        self.log = BuildLog(self.workspace / "build.log", on_lines=reporter.lines,
                            on_progress=reporter.progress,
                            limit_bytes=int(config.build_log_max_mib * MIB))
        self.facts = BuildFacts(build_id=build_id, recipe=self.recipe.name,
                                host=socket.gethostname())
        self.job_peaks: list[int] = []
        self.sandbox: Sandbox | None = None
        # The sdist is unpacked at one path per project version on this host (see _source).
        self.source_root = (Path(config.workspace).resolve() / "src"
                            / f"{spec.project}-{spec.version}")
        self._source_lock: int | None = None
        # The compile cache's storage keys seen before the compile (None: nothing to share
        # through storage), and the nvcc it caches (None: only the host compiler).
        self._cache_known: set[str] | None = None
        self._cache_nvcc: Path | None = None
        # The lock on the build uid this build claimed (Sandbox.claim), held to its end.
        self._uid_lock: int | None = None
        self._cache_lock: int | None = None
        self._waiting_for_uid = False

    # -- running programs --

    def _run(self, argv: list[str], *, env: dict[str, str], cwd: Path, what: str,
             governor_reserve: int | None = None, shown: Sequence[str] | None = None,
             uids: frozenset[int] = frozenset(), quota: DiskQuota | None = None,
             limits: TreeLimits | None = None,
             ) -> tuple[Outcome, MemoryGovernor | None]:
        """Run one program of the build under the reaper; raise on timeout or cancel.

        Its output goes through a pipe that a thread drains into the capped log. ``quota``
        is checked on every tick: past it, the tree is killed and the build fails too-large.
        """
        # Scripts handed over with ``-c`` (the load check, the compile cache's wrapper) would
        # fill the log; their JSON arguments say what they do.
        self.log.write("$ " + " ".join("<script>" if "\n" in a else a
                                       for a in (shown if shown is not None else argv)))
        read_end, write_end = os.pipe()
        try:
            bp = BuildProcess.start(argv, build_id=self.build_id, env=env, cwd=cwd,
                                    stdout=write_end, uids=uids,
                                    memory_max=limits.max_bytes if limits else None)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        drain = self.log.drain(read_end)
        governor = None
        if governor_reserve is not None:
            governor = MemoryGovernor(bp, low_watermark=governor_reserve // 2,
                                      high_watermark=governor_reserve)
        last_cancel_check = 0.0
        cancelled = False

        def should_cancel() -> bool:
            nonlocal last_cancel_check, cancelled
            now = time.monotonic()
            if now - last_cancel_check >= 1.0:
                last_cancel_check = now
                cancelled = self.reporter.should_cancel()
            return cancelled

        def on_tick() -> None:
            if governor is not None:
                governor.tick()
            if quota is not None:
                quota.check()
            if limits is not None:
                limits.check(bp.processes)
            self.log.pump()

        try:
            outcome = bp.wait(deadline=self.deadline, should_cancel=should_cancel,
                              on_tick=on_tick)
        finally:
            drain.close()
        if governor is not None:
            self.job_peaks = governor.job_peaks
            self.facts.peak_tree_bytes = governor.peak_tree_rss
            self.facts.governor_pauses = governor.pauses
        if outcome.reap is not None:
            self.facts.reaped = Reaped(processes=outcome.reap.processes,
                                       signals=tuple(outcome.reap.signals),
                                       seconds=round(outcome.reap.seconds, 2),
                                       survivors=outcome.reap.survivors)
        self.reporter.facts(self.facts)
        if outcome.cancelled:
            raise BuildFailed(FailureKind.CANCELLED, f"cancelled during {what}")
        if outcome.timed_out:
            raise BuildFailed(FailureKind.TIMEOUT,
                              f"the build ran past its {self.timeout:.0f} s deadline during "
                              f"{what} and was killed")
        return outcome, governor

    def _sandboxed(self, argv: Sequence[str], *, env: dict[str, str], cwd: Path, what: str,
                   read_only: Iterable[Path | None] = (), writable: Iterable[Path] = (),
                   shared: Iterable[Path] = (),
                   network: bool = False, governor_reserve: int | None = None,
                   ) -> tuple[Outcome, MemoryGovernor | None]:
        """Run a program that executes the sdist's code, or code it chose, in the sandbox.

        Use it for every such step (the compile, the torch check, load and import checks).
        ``read_only`` and ``writable`` are what the program sees besides the system (e.g.
        ``venv.read_only`` to run the venv's Python): keep each a direct child of the
        workspace, or a path outside it the build never had writable (a toolkit). ``HOME``
        and ``TMPDIR`` are ``<workspace>/home`` and ``<workspace>/tmp``. The disk cap counts
        what it writes. With ``WHEELHOUSE_BUILD_SANDBOX=off`` the program runs as it is.
        """
        shared = tuple(shared)
        layout = Layout.in_workspace(self.workspace,
                                     read_only=[p for p in read_only if p is not None],
                                     writable=[*writable, *shared])
        for path in layout.all_writable:
            writable_place(path, build=self.workspace, source=self.source_root,
                           cache=Path(self.config.workspace).resolve() / "sccache")
        uids: frozenset[int] = frozenset()
        if self.sandbox is None:
            for path in layout.all_writable:
                path.mkdir(parents=True, exist_ok=True)
            run_env = {**env, "HOME": str(layout.home), "TMPDIR": str(layout.tmp)}
            wrapped = list(argv)
        else:
            self.sandbox.prepare(layout)
            wrapped = self.sandbox.wrap(argv, layout=layout, cwd=cwd, network=network)
            run_env = self.sandbox.environment(env, layout)
            uids = self.sandbox.build_uids
        quota = DiskQuota.from_config(
            self.config, [p for p in layout.all_writable if p not in shared], shared=shared)
        shown = [*(["[unsandboxed]"] if self.sandbox is None else ["[sandbox]"]), *argv]
        return self._run(wrapped, env=run_env, cwd=cwd, what=what, shown=shown, uids=uids,
                         quota=quota, governor_reserve=governor_reserve,
                         limits=TreeLimits.from_config(self.config))

    def _run_checked(self, argv: list[str], *, env: dict[str, str], what: str) -> None:
        """Run an installer step in the workspace; network trouble is retried with backoff."""

        def attempt() -> None:
            outcome, _ = self._run(argv, env=env, cwd=self.workspace, what=what)
            self._check(outcome, what)

        with_retries(self.retry, what, attempt, say=self.log.write)

    def _check(self, outcome: Outcome, what: str) -> None:
        if outcome.returncode != 0:
            text = self.log.tail(20_000)
            tail = [line for line in text.splitlines() if line.strip()]
            last = tail[-1] if tail else ""
            if _NO_BUILD_HINT in text:
                because = next((line.strip() for line in reversed(tail)
                                if "has no usable wheels" in line), last)
                raise BuildFailed(FailureKind.INCOMPATIBLE,
                                  f"a build requirement has no wheel for this platform, and "
                                  f"workers never build one outside the sandbox: "
                                  f"{because.removeprefix('cause: ')[:300]}")
            raise InfrastructureError(f"{what} failed (exit {outcome.returncode}): {last[:300]}")

    # -- the steps --

    def run(self) -> BuildResult:
        started = time.monotonic()
        try:
            existing = self._already_published()
            if existing is not None:
                self.reporter.phase("published")
                return BuildResult(self.spec, existing, already_published=True)
            self.workspace.mkdir(parents=True, exist_ok=True)
            self.log.write(f"building {self.spec.describe()} with recipe {self.recipe.name}")
            self._sandbox()
            toolkit = self._toolkit()
            src = self._source()
            venv = self._venv(src)
            jobs = self._max_jobs()
            cache = self._compile_cache(venv.python, toolkit)
            wheel = self._compile(src, venv, toolkit, jobs, cache)
            wheel = self._check_wheel(wheel, venv)
            record = self._publish(wheel, started)
            self.facts.seconds = round(time.monotonic() - started, 1)
            self._store_log()
            return BuildResult(self.spec, record, max_jobs=jobs, log_key=log_key(self.spec),
                               seconds=time.monotonic() - started, build=self.facts)
        except SandboxUnavailable as exc:
            failed = BuildFailed(FailureKind.SANDBOX_UNAVAILABLE, str(exc))
            self._fail(failed, started)
            raise failed from exc
        except (StorageError, InfrastructureError) as exc:
            # Storage trouble outside a retried step (e.g. the learned memory figures): the
            # same class of failure as a retried step that ran out of attempts.
            failed = BuildFailed(FailureKind.INFRASTRUCTURE, str(exc))
            self._fail(failed, started)
            raise failed from exc
        except BuildFailed as exc:
            self._fail(exc, started)
            raise
        finally:
            if not self.keep_workspace:
                _remove(self.workspace)
            self._release_source()
            self._release_uid()

    def _fail(self, exc: BuildFailed, started: float) -> None:
        self.log.write(f"FAILED [{exc.kind.value}]: {exc.reason}")
        self._store_log()
        exc.facts = replace(self.facts, seconds=round(time.monotonic() - started, 1))

    def _already_published(self) -> Record | None:
        key = record_key(self.spec.variant.base, self.spec.project, self.spec.expected_wheel_name)

        def look() -> Record | None:
            try:
                return Record.from_json(self.storage.get_bytes(key))
            except FileNotFoundError:
                return None

        return with_retries(self.retry, "reading storage", look, say=self.log.write)

    def _sandbox(self) -> None:
        """Decide how this build is sandboxed, and say so in its log and record."""
        # The worker checked at start-up; a host can lose what the sandbox needs since (a
        # changed seccomp profile, a removed package), and then no step of this build may run.
        why = startup_check(self.config)
        if why is not None:
            raise SandboxUnavailable(why)
        self.sandbox = Sandbox.from_config(self.config)
        if self.sandbox is not None:
            self.sandbox, self._uid_lock = self.sandbox.claim(wait=self._wait_for_uid)
        if self.sandbox is None:
            self.facts.sandbox = UNSANDBOXED
            warning = ("WARNING: this build runs unsandboxed (WHEELHOUSE_BUILD_SANDBOX=off): "
                       "the sdist's code runs as the worker's user, sees its files and "
                       "processes and reaches its network and services")
            log.warning("build %s: %s", self.build_id, warning)
            self.log.write(warning)
        else:
            self.facts.sandbox = self.sandbox.describe()
            self.log.write(f"sandbox: {self.facts.sandbox}")
        self.reporter.facts(self.facts)

    def _wait_for_uid(self) -> None:
        """Every build uid of this host is taken: wait for one, as long as the build may."""
        if not self._waiting_for_uid:
            self._waiting_for_uid = True
            self.log.write("waiting for a free build uid (WHEELHOUSE_BUILD_UID_RANGE): as many "
                           "builds as it holds run on this host now")
        if self.reporter.should_cancel():
            raise BuildFailed(FailureKind.CANCELLED, "cancelled while waiting for a build uid")
        if time.monotonic() > self.deadline:
            raise BuildFailed(FailureKind.TIMEOUT, "the build ran past its deadline waiting for "
                              "a free build uid")
        time.sleep(1.0)

    def _release_uid(self) -> None:
        """Hand the build's uid (and the project's cache) back; only once none of its
        processes lives."""
        for fd in (self._cache_lock, self._uid_lock):
            if fd is not None:
                os.close(fd)
        self._cache_lock = self._uid_lock = None

    def _toolkit(self) -> ToolkitInfo:
        """A host toolkit of torch's CUDA major.minor; else one installed from NVIDIA's wheels;
        else a newer minor of the same major; else the combination is incompatible here."""
        self.reporter.phase("toolkit")
        root = toolkit_root(self.config)
        toolkits = (self.toolkits if self.toolkits is not None
                    else discover_toolkits(roots=(*DEFAULT_ROOTS, root)))
        toolkit = next((t for t in toolkits if t.cuda == self.spec.cuda), None)
        if toolkit is None and self.config.toolkit_wheels \
                and self.spec.cuda in provisionable_cuda():
            toolkit = self._provision(root)
        toolkit = toolkit or pick_toolkit(toolkits, self.spec.cuda)
        if toolkit is None:
            found = ", ".join(f"{t.cuda} ({t.home})" for t in toolkits) or "none"
            raise BuildFailed(FailureKind.INCOMPATIBLE,
                              f"no CUDA {self.spec.cuda.split('.')[0]}.x toolkit of version "
                              f"{self.spec.cuda} or newer on this host; found: {found}")
        self.log.write(f"CUDA toolkit {toolkit.release} at {toolkit.home}")
        provisioned = Path(toolkit.home).is_relative_to(root)
        self.facts.toolkit = toolkit.release + (" (wheels)" if provisioned else "")
        self.reporter.note(toolkit=self.facts.toolkit)
        return toolkit

    def _provision(self, root: Path) -> ToolkitInfo:
        self.log.write(f"no CUDA {self.spec.cuda} toolkit on this host: installing nvcc, the "
                       f"runtime headers and CCCL from NVIDIA's wheels into {root}")
        uv = self._uv()

        def attempt() -> ToolkitInfo:
            try:
                return provision(self.spec.cuda, root, uv=uv,
                                 index_url=self.config.build_index_url, env=install_env())
            except ToolkitError as exc:
                raise InfrastructureError(str(exc)) from None

        return with_retries(self.retry, f"installing the CUDA {self.spec.cuda} toolkit", attempt,
                            say=self.log.write)

    def _source(self) -> Path:
        self.reporter.phase("fetch")
        limits = SdistLimits.from_config(self.config)
        if self.source is not None:
            sdist = self.source
            self.log.write(f"source: local {sdist}")
        else:
            index = self.config.upstream
            if index == "off":
                raise BuildFailed(FailureKind.INCOMPATIBLE,
                                  "no upstream index is configured, so the sdist must be given")
            link = with_retries(
                self.retry, "looking up the sdist",
                lambda: find_sdist(index, self.spec.project, self.spec.version),
                say=self.log.write)
            self.log.write(f"source: {link.url} (sha256 {link.sha256})")
            sdist = with_retries(
                self.retry, "downloading the sdist",
                lambda: download_sdist(link, self.workspace / "sdist",
                                       max_bytes=limits.max_bytes),
                say=self.log.write)
            self.log.write(f"sha256 verified: {sdist.name}")
            self.facts.sdist_sha256 = link.sha256
        self.facts.sdist = sdist.name
        self._lock_source()
        _remove(self.source_root)  # a crashed build's leftovers
        src = unpack(sdist, self.source_root, limits=limits)
        self._patch(src)
        return src

    def _lock_source(self) -> None:
        """Hold this host's lock on the project version's source path for the whole build.

        nvcc hands the source path to cicc, which the compile cache hashes verbatim, so every
        build of one project version unpacks to the same path: a second Python then hits for
        every kernel. Two such builds on one host take turns (the second one's kernels hit).
        """
        self.source_root.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.source_root.with_name(self.source_root.name + ".lock"),
                     os.O_RDWR | os.O_CREAT, 0o600)
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    waiting = True
                    self.log.write(f"waiting for another build of {self.spec.project} "
                                   f"{self.spec.version} on this host to finish (its source "
                                   f"path is shared, so this build's compiles will hit its cache)")
                if self.reporter.should_cancel():
                    os.close(fd)
                    raise BuildFailed(FailureKind.CANCELLED, "cancelled while waiting for "
                                      "another build of the same version") from None
                if time.monotonic() > self.deadline:
                    os.close(fd)
                    raise BuildFailed(FailureKind.TIMEOUT, "the build ran past its deadline "
                                      "waiting for another build of the same version") from None
                time.sleep(1.0)
        self._source_lock = fd

    def _release_source(self) -> None:
        if self._source_lock is None:
            return
        if not self.keep_workspace:
            _remove(self.source_root)
        os.close(self._source_lock)  # closing the descriptor releases the lock
        self._source_lock = None

    def _patch(self, src: Path) -> None:
        """Apply the recipe's patches for this version and torch; record what was applied."""
        try:
            version = Version(self.spec.version)
        except InvalidVersion:
            self.facts.patches = ()
            return
        # Before the venv, the variant's torch (``2.14``) stands for the installed one.
        patches = self.recipe.patches_for(version, Version(self.spec.torch))
        applied = apply_patches(patches, src)
        for patch in applied:
            self.log.write(f"patch {patch.ref} applied: {patch.description}")
        self.facts.patches = tuple(applied)
        self.reporter.facts(self.facts)

    def _uv(self) -> str:
        return find_uv_bin()  # the uv package's own binary: a worker's PATH needn't have it

    def _venv(self, src: Path) -> BuildVenv:
        """Create the build venv and install torch and the build requirements into it.

        The worker does this with its network, before any code of the sdist runs: wheels only
        (``--no-build``), in one ``uv`` call, since from then on the venv's Python runs code
        the sdist chose and only the sandbox may start it.
        """
        self.reporter.phase("venv")
        uv = self._uv()
        root = self.workspace / "venv"
        env = install_env()
        self._run_checked([uv, "venv", "--seed", "--clear", "--python", self.spec.python,
                           str(root)], env=env, what="creating the venv")
        python = root / "bin" / "python"
        venv = BuildVenv(python=python, interpreter=Path(os.path.realpath(python)),
                         prefix=python_prefix(python))
        cu = self.spec.variant.cu
        argv = [uv, "pip", "install", "--python", str(python), "--no-build",
                "--index-url", self.config.build_index_url]
        if self.config.torch_index_url:
            argv += ["--extra-index-url", self.config.torch_index_url.format(cu=cu)]
        for link in self.config.torch_find_links.split():
            argv += ["--find-links", link.format(cu=cu)]
        requires = [f"torch=={self.spec.torch}.*", *self.recipe.build_requires,
                    *_pyproject_requires(src)]
        self._run_checked([*argv, *requires], env=env,
                          what="installing torch and the build requirements")
        self._check_torch(venv)
        return venv

    def _check_torch(self, venv: BuildVenv) -> None:
        code = (f"import json, torch; print({_TORCH_INFO!r} + json.dumps({{"
                "'version': torch.__version__, 'cuda': torch.version.cuda, "
                "'abi': bool(torch.compiled_with_cxx11_abi())}), flush=True)")
        outcome, _ = self._sandboxed([str(venv.python), "-c", code],
                                     env=sanitized_env(os.environ), cwd=self.workspace / "home",
                                     what="checking torch", read_only=venv.read_only)
        tail = [line for line in self.log.tail(100_000).splitlines() if line.strip()]
        found = [line for line in tail if line.startswith(_TORCH_INFO)]
        if outcome.returncode != 0 or not found:
            raise BuildFailed(FailureKind.INFRASTRUCTURE,
                              f"torch does not import in the build venv: "
                              f"{(tail or [''])[-1][:300]}")
        # Printed from inside the sandbox, where the sdist's requirements could print anything:
        # parsed as data, never trusted beyond this check of the venv.
        try:
            info = json.loads(found[-1].removeprefix(_TORCH_INFO))
        except ValueError:
            info = None
        if not (isinstance(info, dict) and isinstance(info.get("version"), str)
                and isinstance(info.get("cuda"), str | None)
                and isinstance(info.get("abi"), bool)):
            raise BuildFailed(FailureKind.INFRASTRUCTURE,
                              f"the torch check printed {found[-1][:200]!r}")
        self.log.write(f"torch {info['version']} (CUDA {info['cuda']}, cxx11abi {info['abi']})")
        self.facts.torch = info["version"]
        self.reporter.note(torch=info["version"])
        if info["cuda"] != self.spec.cuda:
            raise BuildFailed(FailureKind.INCOMPATIBLE,
                              f"the configured torch source gave torch {info['version']} built "
                              f"for CUDA {info['cuda'] or 'none (CPU)'}, not {self.spec.cuda}")
        if info["abi"] != self.spec.cxx11abi:
            raise BuildFailed(FailureKind.INCOMPATIBLE,
                              f"torch {info['version']} uses cxx11abi={int(info['abi'])}, the "
                              f"spec asks for {int(self.spec.cxx11abi)}")

    def _max_jobs(self) -> MaxJobs:
        mem = psutil.virtual_memory()
        reserve = int(self.config.build_reserve_gib * GIB) or None
        jobs = decide(self.storage, recipe=self.recipe.name, cuda=self.spec.cuda,
                      recipe_per_thread=self.recipe.job_memory_bytes,
                      nvcc_threads=self.recipe.nvcc_threads, available=int(mem.available),
                      archs=self.recipe.targets_for(self.spec.variant),
                      total=int(mem.total), cores=usable_cores(), reserve=reserve)
        if self.max_jobs_override is not None:
            jobs = MaxJobs(**{**jobs.to_dict(), "jobs": self.max_jobs_override,
                              "reason": f"MAX_JOBS={self.max_jobs_override}: set by the caller"})
        return jobs

    def _compile_cache(self, python: Path,
                       toolkit: ToolkitInfo) -> compilecache.CompileCache | None:
        """This build's compile cache, its entries pulled from storage; None when off."""
        if not self.config.compile_cache:
            return None
        sccache = compilecache.find_sccache()
        version = compilecache.sccache_version(sccache) if sccache is not None else None
        if sccache is None or version is None:
            self.log.write("compile cache off: sccache is not installed on the worker")
            return None
        space = compilecache.namespace(self.spec.project, self.spec.cuda)
        limit = int(self.config.compile_cache_max_gib * GIB)
        backend = compilecache.DiskBackend(Path(self.config.workspace).resolve() / "sccache",
                                           size=f"{max(1, limit // (1024 ** 2))}M")
        if not self._lock_cache(backend.path(space)):
            self.log.write(f"compile cache off: another build on this host uses {space}'s "
                           "cache now (one build at a time writes a project's cache)")
            return None
        # The build's tools directory (launchers, sccache), which the sandbox mounts read-only:
        # sccache is a copy there, as a hard link would share the worker's own binary.
        tools = self.workspace / "sccache-tools"
        tools.mkdir(exist_ok=True)
        inside = tools / "sccache"
        shutil.copy2(sccache, inside)
        cache = compilecache.CompileCache(
            inside, backend, space, self.workspace / "sccache",
            basedirs=[self.workspace, self.source_root], tools_dir=tools)
        owner = ((self.sandbox.uid, self.sandbox.gid)
                 if self.sandbox is not None and self.sandbox.as_root else None)
        if not isinstance(self.storage, LocalStorage):
            try:
                fetched, known = with_retries(
                    self.retry, "fetching the compile cache",
                    lambda: compilecache.pull(self.storage, space, cache.directory, owner=owner,
                                              max_bytes=limit),
                    say=self.log.write)
                self._cache_known = known
                self.log.write(f"compile cache: {fetched} of {len(known)} entries fetched from "
                               f"storage ({compilecache.STORAGE_PREFIX}{space}/)")
            except BuildFailed as exc:  # the cache is an optimization: build without the pull
                self.log.write(f"compile cache not fetched from storage: {exc.reason}")
        nvcc = nvcc_version(Path(toolkit.nvcc))
        mm = tuple(int(p) for p in nvcc[0].split(".")) if nvcc else (0, 0)
        cacheable, line = compilecache.nvcc_cacheable(version, (mm[0], mm[1]))
        self.log.write(f"compile cache: {line}")
        self._cache_nvcc = Path(toolkit.nvcc) if cacheable else None
        return cache

    def _cache_done(self, cache: compilecache.CompileCache | None) -> None:
        """Record the cache's statistics; share its new entries through storage."""
        if cache is None:
            return
        stats = cache.read_stats()
        if stats is not None:
            self.facts.compile_cache = stats
            self.log.write(f"compile cache: {stats.hits} hits, {stats.misses} misses "
                           f"({stats.hit_rate:.0%}), {stats.errors} errors")
        if self._cache_known is None:
            return
        known = self._cache_known
        limit = int(self.config.compile_cache_max_gib * GIB)

        try:
            sent = with_retries(self.retry, "storing the compile cache",
                                lambda: compilecache.push(self.storage, cache.space,
                                                          cache.directory, known,
                                                          scratch=self.workspace / "sccache-push"),
                                say=self.log.write)
            known |= sent  # an out-of-memory retry pushes only what it adds
            self.log.write(f"compile cache: {len(sent)} new entries stored")
        except BuildFailed as exc:
            self.log.write(f"compile cache not stored: {exc.reason}")
            return
        try:
            evicted = compilecache.evict(self.storage, cache.space, limit)
        except (OSError, WheelhouseError) as exc:  # e.g. worker credentials that can't delete
            self.log.write(f"compile cache not evicted in storage: {exc}")
            return
        if evicted:
            self.log.write(f"compile cache: {evicted} oldest entries evicted from storage "
                           "(WHEELHOUSE_COMPILE_CACHE_MAX_GIB)")

    def _lock_cache(self, directory: Path) -> bool:
        """Hold this host's lock on a project's cache directory for the build, if free.

        The directory is writable by the build that uses it, and builds have their own uids:
        one build at a time (the directory is handed to its uid, see ``Sandbox.prepare``).
        """
        directory.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory.with_name(directory.name + ".lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._cache_lock = fd
        return True

    def _compile(self, src: Path, venv: BuildVenv, toolkit: ToolkitInfo, jobs: MaxJobs,
                 cache: compilecache.CompileCache | None = None) -> Path:
        dist = self.workspace / "dist"
        for attempt in range(1, OOM_COMPILE.attempts + 1):
            self.reporter.phase("compile")
            self.reporter.note(max_jobs=jobs.jobs, max_jobs_reason=jobs.reason)
            self.log.write(jobs.reason)
            self.facts.max_jobs = jobs
            env = compile_env(self.workspace, venv.python, toolkit, jobs, self.recipe,
                              self.spec.variant)
            _remove(dist)  # an earlier attempt's, by descriptor
            argv = [str(venv.python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "--no-index", "-v", "-w", str(dist), str(src)]
            if cache is not None:
                try:
                    argv = cache.wrap(venv.python, argv, nvcc=self._cache_nvcc, path=env["PATH"])
                except FileNotFoundError as exc:  # no host compiler to put it in front of
                    self.log.write(f"compile cache off: {exc}")
                    cache = None
            reserve = jobs.reserve_bytes or reserve_bytes(int(psutil.virtual_memory().total))
            # The compile writes the source tree, dist/ and, with the compile cache, the
            # server's runtime directory and the project's cache directory (docs/compiling.md).
            writable = [self.source_root, dist]
            read_only = [*venv.read_only, Path(toolkit.home), self.workspace / "probe-bin"]
            if cache is not None:
                writable.append(cache.runtime_dir)
                read_only.append(cache.tools)
            try:
                outcome, _ = self._sandboxed(
                    argv, env=env, cwd=src, what="the compile",
                    read_only=read_only,
                    writable=writable, governor_reserve=reserve,
                    shared=[cache.directory] if cache is not None else [])
            finally:
                self._cache_done(cache)
            if outcome.returncode == 0:
                break
            tail = self.log.tail()
            oom = was_oom_killed(outcome.returncode, tail[-20_000:])
            found: Classified = classify_log(tail, self.spec, oom=oom)
            if found.kind is FailureKind.OOM:
                self._learn()
                if attempt < OOM_COMPILE.attempts and jobs.jobs > 1:
                    half = max(1, jobs.jobs // 2)
                    self.log.write(f"{found.reason}; retrying once with MAX_JOBS={half}")
                    jobs = MaxJobs(**{**jobs.to_dict(), "jobs": half,
                                      "reason": f"MAX_JOBS={half}: halved after an "
                                                f"out-of-memory kill ({jobs.reason})"})
                    continue
            raise found.error()
        self._learn()
        # The sandbox's processes are all dead: only now is what it left read, and only a copy
        # of one regular file leaves.
        return take_wheel(dist, self.workspace / "out")

    def _learn(self) -> None:
        if not self.job_peaks:
            return
        try:
            per_thread = record_peaks(self.storage, self.recipe.name, self.spec.cuda,
                                      self.job_peaks, self.recipe.nvcc_threads,
                                      archs=self.recipe.targets_for(self.spec.variant))
        except (OSError, WheelhouseError) as exc:
            self.log.write(f"could not record memory statistics: {exc}")
            return
        self.facts.peak_job_bytes = max(self.job_peaks)
        self.log.write(f"peak compile job: {max(self.job_peaks) / GIB:.2f} GiB "
                       f"({(per_thread or 0) / GIB:.2f} GiB per nvcc thread)")

    def _check_wheel(self, wheel: Path, venv: BuildVenv) -> Path:
        """The wheel is well-formed and the one asked for, then its extension loads.

        What the build left is untrusted: :func:`validate_wheel` checks it as it came out (the
        public version, when the recipe relabels) and again after relabelling; any failure is
        ``invalid-wheel`` and nothing is published.
        """
        self.reporter.phase("check")
        spec = self.spec
        try:
            name = parse_name(wheel.name)
            if name.version.public != spec.wheel_version.public:
                raise InvalidWheel(f"{wheel.name}: built version {name.version}, expected "
                                   f"{spec.wheel_version}")
            validate_wheel(wheel, spec.project, name.version, spec.tags_match)
            if self.recipe.relabel and name.version != spec.wheel_version:
                out = self.workspace / "relabelled"
                out.mkdir(exist_ok=True)
                wheel = relabel(wheel, spec.variant.local_label, out)
                self.log.write(f"relabelled into {wheel.name}")
            elif name.version != spec.wheel_version:
                raise InvalidWheel(f"{wheel.name}: built version {name.version}, expected "
                                   f"{spec.wheel_version} (does the recipe put the label into "
                                   "METADATA?)")
            validate_wheel(wheel, spec.project, spec.wheel_version, spec.tags_match)
        except InvalidWheel as exc:
            raise BuildFailed(FailureKind.INVALID_WHEEL, str(exc)) from None
        self.log.write(f"wheel checked: {wheel.name} (zip, RECORD hashes, names, metadata, tags)")
        modules = extension_modules(wheel)
        missing = [m for m in self.recipe.import_check if m not in modules]
        if missing:
            raise BuildFailed(FailureKind.INCOMPATIBLE,
                              f"{wheel.name} lacks {', '.join(missing)}; the CUDA build was "
                              "skipped")
        self._check_device_code(wheel)
        if self.facts.patches:
            out = self.workspace / "noted"
            out.mkdir(exist_ok=True)
            wheel = note_wheel(wheel, self.facts.patches, out)
            self.log.write(f"METADATA names the patches: "
                           f"{', '.join(p.ref for p in self.facts.patches)}")
        self._install_for_check(wheel, venv)
        self._load_check(wheel, venv)
        return wheel

    def _install_for_check(self, wheel: Path, venv: BuildVenv) -> None:
        """Install the checked wheel into the build venv, from outside the sandbox.

        ``uv`` runs with the interpreter the venv was made from and ``--prefix``: asked for the
        venv's own Python, it would start it, and the ``.pth`` files of what the sdist chose
        would run as the worker.
        """
        self._run_checked([self._uv(), "pip", "install", "--python", str(venv.interpreter),
                           "--prefix", str(venv.root), "--no-deps", "--reinstall", "--offline",
                           str(wheel)], env=install_env(),
                          what="installing the wheel for the load check")

    def _check_device_code(self, wheel: Path) -> None:
        """No CUDA label without device code: SASS for every requested architecture."""
        found = devicecode.wheel_device_code(wheel)
        self.facts.device_code = devicecode.archs_found(found)
        self.reporter.facts(self.facts)
        for name, code in sorted(found.items()):
            self.log.write(f"device code in {name}: {code.describe()}")
        devicecode.check_device_code(found, self.recipe.archs_for(self.spec.variant),
                                     wheel_name=wheel.name)

    def _load_check(self, wheel: Path, venv: BuildVenv) -> None:
        """Load each library of the installed wheel as its package does, in the sandbox.

        What it prints comes from inside the sandbox: it is parsed as data, and a build that
        fakes it fools only the check of its own wheel.
        """
        steps = loadcheck.plan(wheel, self.recipe.load_check)
        # Without a GPU only loading can be checked: libcudart comes with torch's wheels and the
        # driver is needed only when a kernel runs.
        check_dir = self.workspace / "load-check"
        start = self.log.size()
        outcome, _ = self._sandboxed(loadcheck.argv(venv.python, steps),
                                     env=sanitized_env(os.environ), cwd=check_dir,
                                     what="the load check", read_only=venv.read_only,
                                     writable=[check_dir])
        report = loadcheck.parse(self.log.since(start), steps,
                                 -1 if outcome.returncode is None else outcome.returncode)
        for line in loadcheck.check(report, wheel_name=wheel.name):
            self.log.write(line)

    def _publish(self, wheel: Path, started: float) -> Record:
        self.reporter.phase("publish")
        self.facts.seconds = round(time.monotonic() - started, 1)
        self.facts.log_key = log_key(self.spec)
        archs = self.recipe.archs_for(self.spec.variant)

        def attempt() -> Record:
            try:
                return publish(self.storage, wheel, self.spec.variant, archs=archs,
                               build=replace(self.facts),
                               claim_timeout=self.config.publish_timeout,
                               by=f"build {self.facts.build_id}" if self.facts.build_id else None)
            except AlreadyPublished:
                existing = self._already_published()
                if existing is None:
                    raise
                return existing

        try:
            record = with_retries(self.retry, "publishing", attempt, say=self.log.write)
        except InvalidWheel as exc:
            raise BuildFailed(FailureKind.INCOMPATIBLE, str(exc)) from None
        self.log.write(f"published {record.filename} into {self.spec.variant.key}")
        return record

    def _store_log(self) -> None:
        if not self.log.path.exists():
            return
        self.log.seal()
        try:
            with_retries(LOG_UPLOAD, "storing the log",
                         lambda: self.storage.put_file(log_key(self.spec), self.log.path))
        except BuildFailed:
            return  # the log is a convenience; the build's own outcome stands


MAX_PYPROJECT_BYTES = 1024 * 1024


def _remove(path: Path) -> None:
    """Remove a tree a build wrote, never following its links (see :mod:`worker.safefs`)."""
    try:
        safefs.remove_tree(path)
    except (OSError, UnsafePath) as exc:
        log.warning("could not remove %s: %s", path, exc)


def _pyproject_requires(src: Path) -> list[str]:
    """``[build-system] requires`` of the sdist, minus torch (which the spec pins).

    The worker installs these outside the sandbox, so each must be a name and version
    specifiers: a direct reference (``name @ file:///…``, ``name @ https://…``) or a local path
    would make it read its own disk into the build or connect where the sdist says, and fails
    the build at once (``unsafe-requirement``).
    """
    import tomllib

    from packaging.requirements import InvalidRequirement, Requirement

    try:
        text = safefs.read_text(src, "pyproject.toml", max_bytes=MAX_PYPROJECT_BYTES)
    except FileNotFoundError:
        return []
    except (OSError, UnsafePath) as exc:
        raise BuildFailed(FailureKind.UNSAFE_ARCHIVE, f"pyproject.toml: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return []
    requires = data.get("build-system", {}).get("requires", [])
    out = []
    for raw in requires if isinstance(requires, list) else []:
        try:
            req = Requirement(str(raw))
        except InvalidRequirement:
            raise BuildFailed(FailureKind.UNSAFE_REQUIREMENT,
                              f"build requirement {str(raw)[:200]!r} is not a name and version "
                              "specifiers (a local path?); workers install only those") from None
        if req.url is not None:
            raise BuildFailed(FailureKind.UNSAFE_REQUIREMENT,
                              f"build requirement {str(raw)[:200]!r} is a direct reference; "
                              "workers install only names and version specifiers from the "
                              "configured index")
        if req.name.lower() != "torch":
            out.append(str(req))
    return out


def extension_modules(wheel: Path) -> list[str]:
    """Importable names of the compiled modules in a wheel (``pkg/_C.cpython-311-….so``)."""
    names = []
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if not member.endswith(".so") or ".dist-info/" in member or ".data/" in member:
                continue
            module = member[: -len(".so")].split(".", 1)[0]
            names.append(module.replace("/", "."))
    return sorted(set(names))


def run_build(
    spec: BuildSpec,
    *,
    config: Config,
    storage: Storage,
    reporter: Reporter | None = None,
    source: Path | None = None,
    timeout: float | None = None,
    build_id: str | None = None,
    max_jobs: int | None = None,
    toolkits: list[ToolkitInfo] | None = None,
    keep_workspace: bool = False,
    retry: RetryPolicy = BUILD_STEPS,
) -> BuildResult:
    """Build ``spec`` and publish it; raise :class:`BuildFailed` with a classified reason.

    ``build_id`` names the build (the fleet's prefix and the RQ job id in the worker, the
    spec's job id by default); a random suffix makes the cookie every process of the build
    carries unique (:func:`worker.reaper.unique_build_id`), so two builds of one spec on one
    host never take each other's processes for strays. ``toolkits`` defaults to what this host
    has; ``retry`` is the policy of the steps that talk to the network and storage.
    """
    return Builder(
        spec, config=config, storage=storage, reporter=reporter or Reporter(), source=source,
        timeout=float(timeout if timeout is not None else config.build_timeout),
        build_id=unique_build_id(build_id or spec.job_id), max_jobs=max_jobs, toolkits=toolkits,
        keep_workspace=keep_workspace, retry=retry,
    ).run()
