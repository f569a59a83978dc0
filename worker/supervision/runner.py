"""Running one program of a build under supervision, and what came of it.

The :class:`Runner` is the only part of the build that knows the deadline, the cancel request,
the memory governor, the disk cap and the sandbox. Every program runs under
:class:`worker.supervision.reaper.BuildProcess` (its own session, the build's cookie), so a
deadline or a
cancel kills exactly this build's tree; its output goes through a pipe into the build's capped
log. A program that executes the sdist's code, or code it chose, runs through
:meth:`Runner.sandboxed`; the worker's own installers run through :meth:`Runner.install`. What
happened comes back as a :class:`Ran`; a deadline or a cancel raises :class:`BuildFailed`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import elftools
import packaging

import wheelhouse
import worker
from wheelhouse.builds.facts import Reaped
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind, InfrastructureError
from worker.buildenv import sanitized_env
from worker.errors import SandboxUnavailable, UnsafePath
from worker.events import Journal
from worker.failures import classify_install, classify_unreachable
from worker.sandbox import safefs
from worker.sandbox.limits import DiskQuota, TreeLimits
from worker.sandbox.wrapper import (
    SOURCE_INSIDE,
    VENV_INSIDE,
    Layout,
    Sandbox,
    python_prefix,
    seen_at,
    startup_check,
    writable_place,
)
from worker.supervision.buildlog import BuildLog
from worker.supervision.governor import MemoryGovernor
from worker.supervision.reaper import BuildProcess, Outcome

log = logging.getLogger("wheelhouse.worker")

#: What the build record and the build page say of a build that ran unsandboxed.
UNSANDBOXED = "off (unsafe): WHEELHOUSE_BUILD_SANDBOX=off"
#: uv's words when a build requirement exists only as an sdist (the venv is installed with
#: ``--no-build``, so nothing the sdist chose is ever built outside the sandbox).
_NO_BUILD_HINT = "building from source is disabled"


@dataclass(frozen=True)
class Ran:
    """How one program ended (it did end: a deadline or a cancel raised instead)."""

    returncode: int | None
    """The main process's exit status (negative: killed by that signal)."""
    job_peaks: tuple[int, ...] = ()
    """Under the memory governor: the peak memory of the compilers of each compile job it saw
    (:attr:`worker.supervision.governor.MemoryGovernor.compile_peaks`)."""


T = TypeVar("T")


class BuildScope(Protocol):
    """What the runner reads of its build (a :class:`worker.steps.context.BuildContext` is
    one): the host's settings, the build's id and places, its log and journal, and its retry
    policy; nothing of its spec, recipe or storage."""

    @property
    def config(self) -> Config: ...

    @property
    def build_id(self) -> str: ...

    @property
    def workspace(self) -> Path: ...

    @property
    def source_root(self) -> Path: ...

    @property
    def venv_root(self) -> Path: ...

    @property
    def log(self) -> BuildLog: ...

    @property
    def journal(self) -> Journal: ...

    def say(self, line: str) -> None: ...

    def retried(self, what: str, attempt: Callable[[], T]) -> T: ...


@dataclass(frozen=True)
class Runner:
    """Runs the programs of one build: supervised, logged, sandboxed where they run its code."""

    ctx: BuildScope
    sandbox: Sandbox | None
    """None only with ``WHEELHOUSE_BUILD_SANDBOX=off``."""
    deadline: float
    """``time.monotonic()`` past which the build is killed."""
    timeout: float
    uid_lock: int | None = None
    """The lock on the build uid :meth:`Sandbox.claim` gave this build; :meth:`close` frees it."""

    @classmethod
    def start(cls, ctx: BuildScope, *, deadline: float, timeout: float) -> Runner:
        """Decide how this build is sandboxed, and say so in its log and record."""
        try:
            sandbox = Sandbox.from_config(ctx.config)
        except ValueError as exc:
            raise SandboxUnavailable(str(exc)) from None
        uid_lock = None
        if sandbox is not None:
            # A uid no other build on this host holds (docs/security.md, the sandbox's edge).
            sandbox, uid_lock = sandbox.claim(
                wait=_waiter(ctx, deadline, "a free build uid (WHEELHOUSE_BUILD_UID_RANGE)"))
            # The worker checked at start-up; a host can lose what the sandbox needs since (a
            # changed seccomp profile, a removed package), and then no step of this build may
            # run. The check runs as the uid just claimed, never as one another build holds.
            why = startup_check(ctx.config, claimed=sandbox)
            if why is not None:
                if uid_lock is not None:
                    os.close(uid_lock)
                raise SandboxUnavailable(why)
        if sandbox is None:
            warning = ("WARNING: this build runs unsandboxed (WHEELHOUSE_BUILD_SANDBOX=off): "
                       "the sdist's code runs as the worker's user, sees its files and "
                       "processes and reaches its network and services")
            log.warning("build %s: %s", ctx.build_id, warning)
            ctx.say(warning)
            ctx.journal.measured(sandbox=UNSANDBOXED)
        else:
            ctx.say(f"sandbox: {sandbox.describe()}")
            ctx.journal.measured(sandbox=sandbox.describe())
        return cls(ctx, sandbox, deadline, timeout, uid_lock)

    def close(self) -> None:
        """Hand the build's uid back; call it once none of the build's processes lives."""
        if self.uid_lock is not None:
            os.close(self.uid_lock)

    def sandboxed(self, argv: Sequence[str], *, env: dict[str, str], cwd: Path,
                  what: str, read_only: Iterable[Path | None] = (),
                  writable: Iterable[Path] = (),
                  shared: Iterable[Path] = (), network: bool = False,
                  governor_reserve: int | None = None,
                  periodic: Periodic | None = None,
                  devices: Iterable[Path] = ()) -> Ran:
        """Run a program that executes the sdist's code, or code it chose, in the sandbox.

        Use it for every such step (the compile, the torch check, the load check).
        ``read_only`` and ``writable`` are what the program sees besides the system (e.g.
        ``venv.read_only`` to run the venv's Python): keep each a direct child of the
        workspace, or a path outside it the build never had writable (a toolkit). ``shared``
        is writable too, but the disk cap counts only what it grows by. ``HOME`` and
        ``TMPDIR`` are ``<workspace>/home`` and ``<workspace>/tmp``. With
        ``governor_reserve`` the memory governor pauses compile jobs to keep that much free.
        ``periodic`` is called every so often while the program runs, from the supervising
        thread (the compile cache's push as it goes). ``devices`` are host device nodes the
        program gets (a GPU proof's). With ``WHEELHOUSE_BUILD_SANDBOX=off`` the program runs as
        it is.
        """
        shared_paths = tuple(shared)
        layout = Layout.in_workspace(self.ctx.workspace,
                                     read_only=[p for p in read_only if p is not None],
                                     writable=[*writable, *shared_paths], devices=devices,
                                     moved=self._moved())
        for path in layout.all_writable:  # only places the worker knows how to read back
            writable_place(path, build=self.ctx.workspace, source=self.ctx.source_root,
                           cache=Path(self.ctx.config.workspace).resolve() / "sccache")
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
            self.ctx.config, [p for p in layout.all_writable if p not in shared_paths],
            shared=shared_paths)
        shown = [*(["[unsandboxed]"] if self.sandbox is None else ["[sandbox]"]), *argv]
        return self._supervise(wrapped, env=run_env, cwd=cwd, what=what, shown=shown,
                               uids=uids, quota=quota, governor_reserve=governor_reserve,
                               limits=TreeLimits.from_config(self.ctx.config),
                               periodic=periodic)

    def _moved(self) -> tuple[tuple[Path, Path], ...]:
        """The places a sandboxed program sees elsewhere: the source path at
        :data:`~worker.sandbox.wrapper.SOURCE_INSIDE` and the build venv at
        :data:`~worker.sandbox.wrapper.VENV_INSIDE` (none unsandboxed)."""
        if self.sandbox is None:
            return ()
        return ((self.ctx.source_root, SOURCE_INSIDE), (self.ctx.venv_root, VENV_INSIDE))

    def seen(self, path: Path) -> Path:
        """Where a program :meth:`sandboxed` runs sees ``path`` (the build's source path is
        :data:`~worker.sandbox.wrapper.SOURCE_INSIDE` there, its venv
        :data:`~worker.sandbox.wrapper.VENV_INSIDE`): for its argv and environment."""
        return seen_at(path, self._moved())

    def untrusted(self, request: Mapping[str, Any], *, what: str, failure: FailureKind,
                  read_only: Iterable[Path] = (), writable: Iterable[Path] = ()
                  ) -> dict[str, Any]:
        """Run one operation of :mod:`worker.sandbox.untrusted` (a parse of the build's hostile
        bytes) in the sandbox, as the build's uid under its caps; return its report.

        The report is read from ``<workspace>/inspect`` by descriptor and size-capped; it is
        the caller's to check, field by field, before anything in it counts. A report that
        says the operation failed becomes that :class:`BuildFailed` (its kind among the ones
        an operation may name, its reason cleaned); no report at all is ``failure``.
        """
        inspect = self.ctx.workspace / "inspect"
        safefs.discard_tree(inspect)  # an earlier operation's outputs: by descriptor
        inspect.mkdir(parents=True)
        argv = [sys.executable, "-I", "-B", "-c", _UNTRUSTED_BOOT, _code_root(),
                json.dumps({**request, "report": str(inspect / _REPORT)})]
        start = self.ctx.log.size()
        ran = self.sandboxed(argv, env=sanitized_env(os.environ), cwd=self.ctx.workspace / "home",
                             what=what, read_only=[*_worker_interpreter(), *read_only],
                             writable=[inspect, *writable])
        try:
            text = safefs.read_text(inspect, _REPORT, max_bytes=MAX_REPORT_BYTES)
            report = json.loads(text)
        except (OSError, UnsafePath, ValueError):
            report = None
        if not isinstance(report, dict) or (ran.returncode != 0 and report.get("ok")):
            lines = [ln for ln in self.ctx.log.since(start).splitlines() if ln.strip()]
            last = clean_line(lines[-1]) if lines else ""
            raise BuildFailed(failure, f"{what} failed in the sandbox (exit {ran.returncode})"
                                       + (f": {last}" if last else ""))
        if report.get("ok") is True:
            return report
        try:
            kind = FailureKind(str(report.get("kind")))
        except ValueError:
            kind = failure
        if kind not in _REPORTABLE:
            kind = failure
        raise BuildFailed(kind, clean_line(str(report.get("reason", ""))) or f"{what} failed")

    def install(self, argv: list[str], *, env: dict[str, str], what: str) -> None:
        """Run one of the worker's installers (uv) in the workspace, outside the sandbox.

        Network trouble is retried under the build's policy; a build requirement that exists
        only as an sdist is ``incompatible`` (nothing the sdist chose is built out here).
        """

        def attempt() -> None:
            ran = self._supervise(argv, env=env, cwd=self.ctx.workspace, what=what)
            if ran.returncode != 0:
                raise self._install_failure(ran, what)

        self.ctx.retried(what, attempt)

    def wait_until(self, ready: Callable[[], bool], *, what: str) -> None:
        """Poll ``ready()`` every second until it is true; a cancel or the deadline ends the
        wait with :class:`BuildFailed` (``what`` is what the build waits for)."""
        while not ready():
            if self.ctx.journal.should_cancel():
                raise BuildFailed(FailureKind.CANCELLED, f"cancelled while waiting for {what}")
            if time.monotonic() > self.deadline:
                raise BuildFailed(FailureKind.TIMEOUT,
                                  f"the build ran past its deadline waiting for {what}")
            time.sleep(1.0)

    def _supervise(self, argv: list[str], *, env: dict[str, str], cwd: Path,
                   what: str, shown: Sequence[str] | None = None,
                   uids: frozenset[int] = frozenset(), quota: DiskQuota | None = None,
                   governor_reserve: int | None = None,
                   limits: TreeLimits | None = None, periodic: Periodic | None = None) -> Ran:
        """Run one program under the reaper until it ends, the deadline passes or the build is
        cancelled; the governor and ``quota`` (past it: killed, too-large) tick meanwhile."""
        ctx = self.ctx
        # Scripts handed over with ``-c`` (the load check, the compile cache's wrapper) would
        # fill the log; their JSON arguments say what they do.
        ctx.say("$ " + " ".join("<script>" if "\n" in a else a
                                for a in (shown if shown is not None else argv)))
        read_end, write_end = os.pipe()
        try:
            bp = BuildProcess.start(argv, build_id=ctx.build_id, env=env, cwd=cwd,
                                    stdout=write_end, uids=uids,
                                    memory_max=limits.max_bytes if limits else None)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        drain = ctx.log.drain(read_end)
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
                cancelled = ctx.journal.should_cancel()
            return cancelled

        def on_tick() -> None:
            if governor is not None:
                governor.tick()
            if quota is not None:
                quota.check(bp.processes)
            if limits is not None:  # processes and memory (past them: killed, too-large)
                limits.check(bp.processes)
            ctx.log.pump()
            if periodic is not None:
                periodic.tick()

        try:
            outcome = bp.wait(deadline=self.deadline, should_cancel=should_cancel,
                              on_tick=on_tick)
        finally:
            drain.close()
        self._measured(outcome, governor)
        if outcome.cancelled:
            raise BuildFailed(FailureKind.CANCELLED, f"cancelled during {what}")
        if outcome.timed_out:
            raise BuildFailed(FailureKind.TIMEOUT,
                              f"the build ran past its {self.timeout:.0f} s deadline during "
                              f"{what} and was killed")
        return Ran(outcome.returncode,
                   tuple(governor.compile_peaks) if governor is not None else ())

    def _measured(self, outcome: Outcome, governor: MemoryGovernor | None) -> None:
        """What the governor and the reaper saw, into the build's facts (also when it failed)."""
        changes: dict[str, object] = {}
        if governor is not None:
            changes.update(peak_tree_bytes=governor.peak_tree_rss,
                           governor_pauses=governor.pauses)
        if outcome.reap is not None:
            changes["reaped"] = Reaped(processes=outcome.reap.processes,
                                       signals=tuple(outcome.reap.signals),
                                       seconds=round(outcome.reap.seconds, 2),
                                       survivors=outcome.reap.survivors)
        if changes:
            self.ctx.journal.measured(**changes)

    def _install_failure(self, ran: Ran, what: str) -> Exception:
        text = self.ctx.log.tail(20_000)
        tail = [line for line in text.splitlines() if line.strip()]
        last = tail[-1] if tail else ""
        if _NO_BUILD_HINT in text:
            because = next((line.strip() for line in reversed(tail)
                            if "has no usable wheels" in line), last)
            return BuildFailed(FailureKind.INCOMPATIBLE,
                               f"a build requirement has no wheel for this platform, and "
                               f"workers never build one outside the sandbox: "
                               f"{because.removeprefix('cause: ')[:300]}")
        unresolved = classify_unreachable(text, what,
                                          torch_index=self.ctx.config.torch_index_url)
        if unresolved is not None:
            return unresolved.error()
        unsatisfiable = classify_install(text, what)
        if unsatisfiable is not None:
            return unsatisfiable.error()
        return InfrastructureError(f"{what} failed (exit {ran.returncode}): {last[:300]}")


@dataclass
class Periodic:
    """``call`` every ``seconds`` of a supervised program's life (first after ``seconds``)."""

    seconds: float
    call: Callable[[], None]
    _last: float = field(default_factory=time.monotonic)

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.seconds:
            self._last = now
            self.call()


#: Starts :mod:`worker.sandbox.untrusted` in the worker's own interpreter inside the sandbox, with
#: only
#: the worker's package directories (mounted read-only at the same place) ahead on the path.
_UNTRUSTED_BOOT = ("import sys; sys.path[:0] = [sys.argv[1]]; "
                   "from worker.sandbox.untrusted import main; sys.exit(main(sys.argv[2:]))")
_REPORT = "report.json"
MAX_REPORT_BYTES = 4 * 1024 * 1024
"""Largest report an operation of :mod:`worker.sandbox.untrusted` may leave."""
#: What a report may say an operation failed as; anything else is the caller's ``failure``.
_REPORTABLE = frozenset({FailureKind.UNSAFE_ARCHIVE, FailureKind.TOO_LARGE,
                         FailureKind.INCOMPATIBLE, FailureKind.PATCH_FAILED,
                         FailureKind.INVALID_WHEEL})
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def clean_line(text: str, limit: int = 300) -> str:
    """One line of what a sandboxed program said, fit for a build page: control characters
    (terminal escapes among them) replaced, whitespace folded, capped."""
    return " ".join(_CONTROL.sub(" ", text).split())[:limit]


def _code_root() -> str:
    """The directory the ``worker`` package lies in (the sandbox mounts the package only)."""
    return str(Path(worker.__file__).resolve().parent.parent)


def _worker_interpreter() -> list[Path]:
    """What the worker's own Python needs mounted read-only to run :mod:`worker.sandbox.untrusted`:
    its installation and venv, the site directories of what that imports, and the
    ``worker`` and ``wheelhouse`` package directories (not the tree around them)."""
    exe = Path(sys.executable)
    paths = [Path(sys.prefix), Path(sys.base_prefix), *([p] if (p := python_prefix(exe)) else [])]
    for module in (packaging, elftools):
        paths.append(Path(module.__file__ or "").resolve().parent.parent)
    paths += [Path(worker.__file__).resolve().parent, Path(wheelhouse.__file__).resolve().parent]
    out: list[Path] = []
    for path in paths:
        if path not in out and not any(path.is_relative_to(p) for p in out):
            out = [p for p in out if not p.is_relative_to(path)] + [path]
    return out


def _waiter(ctx: BuildScope, deadline: float, what: str) -> Callable[[], None]:
    """Called between tries while a build waits for something of the host's: says so once,
    and ends the wait on a cancel or the deadline (:class:`BuildFailed`)."""
    said = False

    def wait() -> None:
        nonlocal said
        if not said:
            said = True
            ctx.say(f"waiting for {what}: as many builds as it allows run on this host now")
        if ctx.journal.should_cancel():
            raise BuildFailed(FailureKind.CANCELLED, f"cancelled while waiting for {what}")
        if time.monotonic() > deadline:
            raise BuildFailed(FailureKind.TIMEOUT,
                              f"the build ran past its deadline waiting for {what}")
        time.sleep(1.0)

    return wait
