"""Own a build's whole process tree: start it, find every process of it, and kill exactly those.

A build runs in its own session and carries a unique cookie in its environment
(``WHEELHOUSE_BUILD_ID``). "The build's processes" are the union of

- descendants of the build's main process and of every process already known to be the build's
  (psutil's ``children()`` alone misses the descendants of a child that already exited),
- members of the build's session (ninja puts each job in its own process group, not session),
- the processes in the build's own cgroup v2, where a writable one exists,
- any process of this user (or of the sandbox's build user) whose environment carries the
  build's cookie, which catches the ones that escaped with ``setsid`` or a double fork,
- every process in a PID namespace the build created (a sandbox), for as long as that
  namespace's init lives; killing the init makes the kernel kill the rest.

Nothing is ever matched by name: a neighbour's ``nvcc`` is not ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from worker.supervision import cgroups

BUILD_ID_ENV = "WHEELHOUSE_BUILD_ID"
"""The environment variable every process of a build carries: its build id."""

#: Separates a build id's base (the fleet's prefix and the job id, which never hold a dot) from
#: the random suffix that makes every build's cookie its own.
_SUFFIX_SEP = "."

CGROUP_PREFIX = cgroups.PREFIX
cgroup_base = cgroups.base

KILL_LIMIT = 60.0
"""Seconds after which ``kill_tree`` gives up and reports survivors."""

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
# psutil's create_time has jiffy resolution and is derived from the boot time; leave slack.
_CTIME_SLACK = 2.0

_Key = tuple[int, float]
"""A process identity that survives pid reuse: (pid, create_time)."""


def unique_build_id(base: str) -> str:
    """``base`` (``wh1a2b3c4d-<job id>``, or a spec's job id) plus a random suffix.

    Two builds of one spec on one host (two ``wheelhouse build`` runs, a retry beside a
    leftover) would otherwise share the cookie, and the first to finish would kill the
    other's processes as its own strays. The base stays recognisable (:func:`build_id_base`),
    so a sweep still knows which job a cookie belongs to.
    """
    return f"{base}{_SUFFIX_SEP}{secrets.token_hex(4)}"


def build_id_base(build_id: str) -> str:
    """The base :func:`unique_build_id` was given (an id without a suffix is its own base)."""
    base, sep, _ = build_id.rpartition(_SUFFIX_SEP)
    return base if sep else build_id


def become_subreaper(enable: bool = True) -> bool:
    """Make this process a child subreaper, so orphans of its builds re-parent to it, not init.

    Returns False where prctl is unavailable. Orphans that re-parent here become our zombies
    when they die; ``BuildProcess`` reaps those that belong to its build.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    prctl.restype = ctypes.c_int
    flag = ctypes.c_ulong(1 if enable else 0)
    zero = ctypes.c_ulong(0)
    return int(prctl(_PR_SET_CHILD_SUBREAPER, flag, zero, zero, zero)) == 0


def is_subreaper() -> bool:
    """Whether this process is currently a child subreaper."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    value = ctypes.c_int(0)
    zero = ctypes.c_ulong(0)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), zero, zero, zero) != 0:
        return False
    return value.value != 0


@dataclass
class ReapReport:
    """What a kill did; goes into the build record (JSON-serializable via ``asdict``)."""

    processes: int
    """How many distinct processes were signalled."""
    signals: list[str] = field(default_factory=list)
    """Signals used, in order, e.g. ``["SIGTERM", "SIGKILL"]`` (SIGCONT always follows SIGTERM)."""
    seconds: float = 0.0
    survivors: int = 0
    """Processes still alive when the kill gave up; 0 unless something is badly wrong."""


@dataclass
class Outcome:
    """How ``BuildProcess.wait`` ended."""

    returncode: int | None
    """The main process's exit status (negative: killed by that signal)."""
    timed_out: bool = False
    cancelled: bool = False
    reap: ReapReport | None = None
    """Set when processes were killed: on timeout/cancel, or strays after a normal exit."""


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    ctime: float
    uid: int
    zombie: bool


def _scan() -> dict[int, _Proc]:
    """One snapshot of every process on the host."""
    table: dict[int, _Proc] = {}
    for p in psutil.process_iter(["ppid", "create_time", "uids", "status"]):
        info = p.info
        uids = info.get("uids")
        ctime = info.get("create_time")
        ppid = info.get("ppid")
        if uids is None or ctime is None or ppid is None:
            continue  # vanished or unreadable mid-scan
        table[p.pid] = _Proc(
            pid=p.pid, ppid=ppid, ctime=ctime, uid=uids.real,
            zombie=info.get("status") == psutil.STATUS_ZOMBIE,
        )
    return table


def _environ_cookie(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get(BUILD_ID_ENV)
    except (psutil.Error, OSError):
        return None


def _pid_namespace(pid: int) -> str | None:
    """``pid:[4026532177]``: which PID namespace a process lives in (None if unreadable)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _children_map(table: dict[int, _Proc]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for proc in table.values():
        kids.setdefault(proc.ppid, []).append(proc.pid)
    return kids


def _closure(roots: Iterable[int], table: dict[int, _Proc]) -> set[int]:
    """The roots and all their descendants, as far as the snapshot shows."""
    kids = _children_map(table)
    found: set[int] = set()
    stack = [pid for pid in roots if pid in table]
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(kids.get(pid, ()))
    return found


def _reap_zombie(pid: int) -> None:
    """Collect the exit status of a zombie child of ours (a re-parented orphan)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def signal_quietly(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to a process that may be gone (or no longer ours); whether it was sent."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_group_quietly(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to a process group that may be gone; whether it was sent."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (someone else's counts: signal 0 is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- cgroup v2 ------------------------------------------------------------------------------


def _kill_loop(
    find: Callable[[], dict[_Key, _Proc]],
    *,
    grace: float,
    limit: float = KILL_LIMIT,
    cgroup: Path | None = None,
    reap: Callable[[dict[int, _Proc]], None] = lambda table: None,
) -> ReapReport:
    """SIGTERM (+SIGCONT), wait ``grace``, then SIGKILL until ``find`` returns nothing live."""
    start = time.monotonic()
    end = start + limit
    signalled: set[_Key] = set()
    signals: list[str] = []

    def live() -> dict[_Key, _Proc]:
        found = find()
        reap({k[0]: p for k, p in found.items()})
        return {k: p for k, p in found.items() if not p.zombie}

    procs = live()
    if procs:
        signals.append("SIGTERM")
        # The cookie and tree stay consistent while we look; new processes get TERM as we see
        # them during the grace period, so a forker that obeys TERM stops forking.
        grace_end = min(start + grace, end)
        while procs:
            for key in procs:
                if key not in signalled and signal_quietly(key[0], signal.SIGTERM):
                    signalled.add(key)
                    # A stopped process would hold the TERM pending until resumed.
                    signal_quietly(key[0], signal.SIGCONT)
            if time.monotonic() >= grace_end:
                break
            time.sleep(0.05)
            procs = live()
    while time.monotonic() < end:
        if cgroup is not None:
            # Frozen, the cgroup's member list is exact: every process is counted and killed.
            cgroups.freeze(cgroup, True)
        procs = live()
        if not procs:
            break
        if "SIGKILL" not in signals:
            signals.append("SIGKILL")
        for key in procs:
            if signal_quietly(key[0], signal.SIGKILL):
                signalled.add(key)
        if cgroup is not None:
            cgroups.kill(cgroup)
        time.sleep(0.02)
    if cgroup is not None:
        cgroups.freeze(cgroup, False, timeout=0)
    return ReapReport(
        processes=len(signalled), signals=signals,
        seconds=round(time.monotonic() - start, 3), survivors=len(procs),
    )


# --- one build --------------------------------------------------------------------------


class BuildProcess:
    """A running build and everything it started."""

    def __init__(
        self, popen: subprocess.Popen[bytes], *, build_id: str, cgroup: Path | None,
        started_at: float, uids: Collection[int] = (),
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.build_id = build_id
        self.cgroup = cgroup
        """The build's own cgroup v2 directory, or None in the fallback."""
        self.uids = frozenset({os.getuid(), *uids})
        """Whose processes may carry the cookie: this user's, and a sandbox's build user's."""
        self._started_at = started_at
        self._own_namespace = _pid_namespace(os.getpid())
        # PID namespaces the build created: namespace -> its init (pid, create_time). Members
        # are found by namespace only while that init lives, so a namespace id the kernel
        # reuses after ours is gone never leads to another build's processes.
        self._namespaces: dict[str, _Key] = {}
        self._namespace_checked: set[_Key] = set()
        try:
            self._main_ctime: float | None = psutil.Process(self.pid).create_time()
        except psutil.Error:
            self._main_ctime = None
        # Every process ever seen as part of the build, so descendants of an exited child can
        # still be traced through it while it is alive under a new parent.
        self._known: dict[int, float] = {}
        if self._main_ctime is not None:
            self._known[self.pid] = self._main_ctime

    @classmethod
    def start(
        cls, argv: list[str], *, build_id: str, env: dict[str, str], cwd: Path,
        log_path: Path | None = None, stdout: int | None = None,
        memory_max: int | None = None, use_cgroup: bool = True, uids: Collection[int] = (),
    ) -> BuildProcess:
        """Start argv in a new session, with the build id cookie, output appended to log_path
        or written to the descriptor ``stdout`` (a pipe the builder drains), stderr with it.

        Uses a per-build cgroup v2 (and sets memory.max) where a writable one exists and the id
        is safe as a directory name; otherwise falls back to session/tree/cookie tracking.
        ``uids``: other users the build's processes run as (``Sandbox.build_uids``).
        """
        if (log_path is None) == (stdout is None):
            raise ValueError("give one of log_path and stdout")
        if not argv:
            raise ValueError("empty argv")
        cgroup = cgroups.make(build_id, memory_max) if use_cgroup else None
        full_argv = list(argv)
        if cgroup is not None:
            full_argv = ["/bin/sh", "-c", cgroups.TRAMPOLINE, str(cgroup / "cgroup.procs"),
                         *argv]
        full_env = {**env, BUILD_ID_ENV: build_id}
        started_at = time.time()
        with contextlib.ExitStack() as stack:
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                stdout = stack.enter_context(open(log_path, "ab")).fileno()
            try:
                popen = subprocess.Popen(
                    full_argv, env=full_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )
            except BaseException:
                if cgroup is not None:
                    cgroups.remove(cgroup)
                raise
        return cls(popen, build_id=build_id, cgroup=cgroup, started_at=started_at, uids=uids)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def oom_kills(self) -> int:
        """The cgroup's ``memory.events`` oom_kill counter (0 without a memory cgroup)."""
        return cgroups.oom_kills(self.cgroup)

    # -- finding the build's processes --

    def _session_usable(self, table: dict[int, _Proc]) -> bool:
        """The build's session id is its main pid; don't trust it once that pid is reused."""
        leader = table.get(self.pid)
        return leader is None or self._main_ctime is None or abs(
            leader.ctime - self._main_ctime) < 0.01 or leader.zombie

    def _find(self) -> dict[_Key, _Proc]:
        table = _scan()
        me = os.getpid()
        roots: set[int] = set()
        for pid, ctime in list(self._known.items()):
            proc = table.get(pid)
            if proc is not None and abs(proc.ctime - ctime) < 0.01:
                roots.add(pid)
            else:
                del self._known[pid]
        if self.cgroup is not None:
            roots |= cgroups.pids(self.cgroup) & table.keys()
        by_session = self._session_usable(table)
        namespaces = self._live_namespaces(table)
        oldest = self._started_at - _CTIME_SLACK
        for proc in table.values():
            if proc.pid in roots or proc.pid == me or proc.ctime < oldest:
                continue  # anything older than the build cannot carry its session or cookie
            if by_session and _getsid(proc.pid) == self.pid:
                roots.add(proc.pid)
            elif namespaces and _pid_namespace(proc.pid) in namespaces:
                roots.add(proc.pid)
            elif proc.uid in self.uids and not proc.zombie and (
                    _environ_cookie(proc.pid) == self.build_id):
                roots.add(proc.pid)
        members = _closure(roots, table)
        members.discard(me)
        self._note_namespaces(members, table)
        found: dict[_Key, _Proc] = {}
        for pid in members:
            proc = table[pid]
            found[(pid, proc.ctime)] = proc
            self._known[pid] = proc.ctime
        return found

    def _live_namespaces(self, table: dict[int, _Proc]) -> set[str]:
        live = set()
        for ns, (pid, ctime) in list(self._namespaces.items()):
            proc = table.get(pid)
            if proc is not None and abs(proc.ctime - ctime) < 0.01 and not proc.zombie:
                live.add(ns)
            else:
                del self._namespaces[ns]
        return live

    def _note_namespaces(self, members: set[int], table: dict[int, _Proc]) -> None:
        """Remember the init of every PID namespace a member of the build created."""
        for pid in members:
            proc = table[pid]
            key = (pid, proc.ctime)
            if key in self._namespace_checked:
                continue
            self._namespace_checked.add(key)
            ns = _pid_namespace(pid)
            if ns is None or ns == self._own_namespace or ns in self._namespaces:
                continue
            if _pid_namespace(proc.ppid) != ns:  # its parent is outside: it is the init
                self._namespaces[ns] = key

    def _reap(self, procs: dict[int, _Proc]) -> None:
        me = os.getpid()
        for pid, proc in procs.items():
            if pid == self.pid:
                self._popen.poll()
            elif proc.zombie and proc.ppid == me:
                _reap_zombie(pid)

    def processes(self) -> list[psutil.Process]:
        """Every live process of this build (see the module docstring). Never matches by name."""
        found = self._find()
        self._reap({k[0]: p for k, p in found.items()})
        result: list[psutil.Process] = []
        for (pid, ctime), proc in sorted(found.items()):
            if proc.zombie:
                continue
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ctime) < 0.01:
                    result.append(p)
            except psutil.Error:
                continue
        return result

    # -- waiting and killing --

    def wait(
        self, *, deadline: float | None, should_cancel: Callable[[], bool] | None = None,
        on_tick: Callable[[], None] | None = None, tick: float = 0.5, grace: float = 5.0,
    ) -> Outcome:
        """Wait for the main process; on deadline (``time.monotonic()``) or cancel, kill the tree.

        After a normal exit, stray processes of the build are killed too: a finished build
        must not leave compilers behind. If anything interrupts the wait (an exception from a
        callback, RQ's job timeout, KeyboardInterrupt), the tree is killed before it propagates.
        """
        try:
            return self._wait(deadline, should_cancel, on_tick, tick, grace)
        except BaseException:
            self._finish_kill(grace)
            raise

    def _wait(
        self, deadline: float | None, should_cancel: Callable[[], bool] | None,
        on_tick: Callable[[], None] | None, tick: float, grace: float,
    ) -> Outcome:
        while True:
            if self._popen.poll() is not None:
                break
            if should_cancel is not None and should_cancel():
                killed = self._finish_kill(grace)
                return Outcome(self._popen.returncode, cancelled=True, reap=killed)
            if deadline is not None and time.monotonic() >= deadline:
                killed = self._finish_kill(grace)
                return Outcome(self._popen.returncode, timed_out=True, reap=killed)
            if on_tick is not None:
                on_tick()
            self._find()  # remember descendants while the tree is intact
            timeout = tick
            if deadline is not None:
                timeout = max(0.0, min(tick, deadline - time.monotonic()))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=timeout)
        returncode = self._popen.returncode
        reap: ReapReport | None = None
        if self.processes():
            reap = self.kill_tree(grace)
        self.close()
        return Outcome(returncode, reap=reap)

    def _finish_kill(self, grace: float) -> ReapReport:
        report = self.kill_tree(grace)
        self.close()
        return report

    def kill_tree(self, grace: float = 5.0) -> ReapReport:
        """SIGTERM everything (ninja forwards it), wait ``grace``, then SIGKILL until none is left.

        Stopped processes get SIGCONT after SIGTERM. Zombies that re-parented to us are reaped.
        Bounded by ``KILL_LIMIT`` seconds; ``survivors`` says what was left.
        """
        report = _kill_loop(self._find, grace=grace, cgroup=self.cgroup, reap=self._reap)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=1.0)
        if self._popen.returncode is not None and report.survivors == 0:
            self.close()
        return report

    def close(self) -> None:
        """Remove the build's cgroup (once it is empty)."""
        if self.cgroup is not None and not cgroups.pids(self.cgroup):
            if cgroups.remove(self.cgroup):
                self.cgroup = None


# --- orphans of dead workers ----------------------------------------------------------------


def _ancestors(pid: int, table: dict[int, _Proc]) -> set[int]:
    seen: set[int] = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid].ppid
    return seen


def sweep_orphans(
    live_build_ids: Collection[str], *, id_prefix: str = "", grace: float = 5.0,
    uids: Collection[int] = (),
) -> ReapReport:
    """Kill processes carrying ``BUILD_ID_ENV`` whose id is not in ``live_build_ids``.

    A cookie matches a live id exactly or by its base (:func:`build_id_base`), so the live set
    can name builds by job (``prefix + job id``), as the workers' adverts do. These are
    leftovers of a worker that was SIGKILLed or lost mid-build. Only processes of the
    current user (and of ``uids``, a sandbox's build user) are considered, with their
    descendants, plus leftover per-build cgroups; never anything by name. ``live_build_ids``
    must hold every build running on this host, by any worker. ``id_prefix`` restricts the
    sweep to build ids with that prefix (a fleet namespace).
    """
    live = set(live_build_ids)
    owners = {os.getuid(), *uids}
    me = os.getpid()

    def stale(build_id: str | None) -> bool:
        return (build_id is not None and build_id.startswith(id_prefix)
                and build_id not in live and build_id_base(build_id) not in live)

    stale_groups: list[Path] = []
    base = cgroups.base()
    if base is not None:
        with contextlib.suppress(OSError):
            for path in base.iterdir():
                name = path.name
                if path.is_dir() and name.startswith(CGROUP_PREFIX) and stale(
                        name[len(CGROUP_PREFIX):]):
                    stale_groups.append(path)

    def find() -> dict[_Key, _Proc]:
        table = _scan()
        protected = _ancestors(me, table)
        roots: set[int] = set()
        for cg in stale_groups:
            roots |= cgroups.pids(cg)
        for proc in table.values():
            if proc.uid in owners and not proc.zombie and stale(_environ_cookie(proc.pid)):
                roots.add(proc.pid)
        members = _closure(roots, table) - protected
        return {(pid, table[pid].ctime): table[pid] for pid in members}

    def reap(procs: dict[int, _Proc]) -> None:
        for pid, proc in procs.items():
            if proc.zombie and proc.ppid == me:
                _reap_zombie(pid)

    report = _kill_loop(find, grace=grace, reap=reap)
    for cg in stale_groups:
        cgroups.kill(cg)
        cgroups.remove(cg)
    return report
