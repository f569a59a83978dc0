"""Keep a build from driving the host out of memory: pause the youngest compiles, resume later.

A compile job is a process group that ninja started inside the build: a process of the build
whose pgid equals its pid and differs from the build's own group. With the compile cache, ninja
starts sccache *clients*, which only wait, while the compilers run as children of the build's
sccache server (``worker.compilecache``), all in the server's one process group. So a group led
by a process that carries :data:`~worker.compilecache.SERVER_MARK` in its environment is not one
job: each child of its leader is one (with its descendants), and groups led by the server's own
program (its clients) are none. SIGSTOP doesn't free memory,
but it stops a job from growing further while older jobs finish and release theirs. The last
running job is never paused, so a build cannot deadlock; a paused build still obeys its deadline
(the kill path sends SIGCONT after SIGTERM).

What is *learned* from a build (:attr:`MemoryGovernor.compile_peaks`, the next MAX_JOBS'
figure) is narrower: only the memory of a job's compiler processes (:data:`COMPILERS`, by
program name), so a build that parks a big process of its own in a group of its own (or beside
a compiler) does not teach its project's later builds that compiles need it. A build can still
name a process like a compiler; :mod:`wheelhouse.builds.maxjobs` bounds what any figure can move.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import psutil

from worker.compilecache import SERVER_MARK
from worker.supervision.reaper import BuildProcess, signal_group_quietly, signal_quietly

HORIZON = 1.0
"""Seconds ahead the governor projects the running jobs' growth (two ticks at 2 Hz)."""

#: The programs a compile job's memory is learned from: nvcc and what it runs (cicc, ptxas,
#: fatbinary, nvlink, cudafe++), the host compilers and their back ends, also under a target
#: triple or a version (``x86_64-linux-gnu-g++-13``, ``clang++-18``).
COMPILERS = re.compile(r"(?:[\w.]+-)*?(?:nvcc|cicc|ptxas|fatbinary|nvlink|cudafe\+\+|cc1|"
                       r"cc1plus|gcc|g\+\+|c\+\+|cc|clang|clang\+\+)(?:-[\d.]+)?")


def is_compiler(name: str) -> bool:
    """Whether a process's name (``psutil.Process.name``) is one of :data:`COMPILERS`."""
    return COMPILERS.fullmatch(name) is not None


@dataclass
class _Job:
    pgid: int
    """The job's process group; for a child of the compile server, that child's pid."""
    started: float
    peak: int = 0
    rss: int = 0
    rate: float = 0.0
    """Recent growth in bytes per second (0 while shrinking)."""
    compile_rss: int = 0
    """The part of ``rss`` held by compiler processes (:data:`COMPILERS`)."""
    compile_peak: int = 0
    paused: bool = False
    alive: bool = True
    members: tuple[int, ...] = ()
    """For a child of the compile server (which shares the server's group): its processes,
    signalled one by one instead of by group."""


#: How old a process must be before the governor believes it is not the compile server.
_SETTLE_SECONDS = 2.0


class MemoryGovernor:
    """Watches available memory and the tree's RSS; pauses/resumes compile jobs.

    ``budget_bytes`` replaces the host's available memory by an artificial budget (tests and the
    bench): then "available" is the budget minus the tree's RSS. Call ``tick`` about twice a
    second (``BuildProcess.wait(on_tick=governor.tick)``).

    Pausing: while the available memory, less what the running jobs will grow by within
    ``HORIZON`` seconds at their recent rate, is below ``low_watermark``, the youngest running
    job is paused (never the last one). Resuming: one job per tick, the oldest paused one, when
    available memory is above ``high_watermark`` and still above ``low_watermark`` after the job
    grows to the typical peak of the jobs that already finished; or at once when no job runs.
    """

    def __init__(
        self, build: BuildProcess, *, budget_bytes: int | None = None,
        low_watermark: int, high_watermark: int,
    ) -> None:
        if high_watermark < low_watermark:
            raise ValueError("high_watermark must be >= low_watermark")
        self.build = build
        self.budget_bytes = budget_bytes
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        self.pauses = 0
        self.resumes = 0
        self.peak_tree_rss = 0
        self.min_available: int | None = None
        """Lowest available memory seen (bytes); with a budget, negative means it was exceeded."""
        self._jobs: dict[tuple[int, float], _Job] = {}
        self._last_tick: float | None = None
        # Per (pid, start time): whether a group leader is the compile server, and programs.
        self._servers: dict[tuple[int, float], bool] = {}
        self._exes: dict[tuple[int, float], str | None] = {}

    @property
    def job_peaks(self) -> list[int]:
        """Peak RSS of each job seen so far (whatever it runs: what pausing weighs), in start
        order (bytes); :attr:`compile_peaks` is what is learned."""
        return [job.peak for job in sorted(self._jobs.values(), key=lambda j: j.started)]

    @property
    def compile_peaks(self) -> list[int]:
        """Peak RSS of the compiler processes of each job that ran one, in start order (bytes):
        what a build teaches the next MAX_JOBS."""
        return [job.compile_peak for job in sorted(self._jobs.values(), key=lambda j: j.started)
                if job.compile_peak > 0]

    @property
    def paused_jobs(self) -> int:
        return sum(1 for job in self._jobs.values() if job.paused and job.alive)

    def available(self, tree_rss: int) -> int:
        if self.budget_bytes is not None:
            return self.budget_bytes - tree_rss
        return int(psutil.virtual_memory().available)

    def _measure(self) -> int:
        """Update every job's RSS, peak and growth rate; return the tree's RSS."""
        now = time.monotonic()
        elapsed = None if self._last_tick is None else max(now - self._last_tick, 0.01)
        self._last_tick = now
        build_pgid = self.build.pid
        tree_rss = 0
        seen: dict[int, tuple[int, int, int, float]] = {}  # pid -> (ppid, pgid, rss, ctime)
        compilers: set[int] = set()
        for proc in self.build.processes():
            try:
                with proc.oneshot():
                    rss = proc.memory_info().rss
                    pgid = os.getpgid(proc.pid)
                    ctime = proc.create_time()
                    ppid = proc.ppid()
                    # Read each time, never cached: a shell of ninja's execs the compiler.
                    if is_compiler(proc.name()):
                        compilers.add(proc.pid)
            except (psutil.Error, OSError):
                continue
            tree_rss += rss
            seen[proc.pid] = (ppid, pgid, rss, ctime)
        self.peak_tree_rss = max(self.peak_tree_rss, tree_rss)
        servers = {pid for pid, (_, pgid, _, ctime) in seen.items()
                   if pid == pgid != build_pgid and self._is_server(pid, ctime)}
        server_exes = {self._exe(pid, seen[pid][3]) for pid in servers} - {None}
        group_rss: dict[tuple[int, float], int] = {}
        compile_rss: dict[tuple[int, float], int] = {}
        members: dict[tuple[int, float], list[int]] = {}
        for pid, (_, pgid, rss, _) in seen.items():
            key = self._job_of(pid, pgid, build_pgid, seen, servers, server_exes)
            if key is not None:
                group_rss[key] = group_rss.get(key, 0) + rss
                if pid in compilers:
                    compile_rss[key] = compile_rss.get(key, 0) + rss
                members.setdefault(key, []).append(pid)
        for job in self._jobs.values():
            job.alive = False
        for key, rss in group_rss.items():
            pgid, started = key
            in_server = seen[pgid][1] in servers
            job = self._jobs.setdefault(key, _Job(pgid=pgid, started=started))
            job.members = tuple(members[key]) if in_server else ()
            if elapsed is not None and job.rss:
                job.rate = max(0.0, (rss - job.rss) / elapsed)
            job.rss = rss
            job.peak = max(job.peak, rss)
            job.compile_rss = compile_rss.get(key, 0)
            job.compile_peak = max(job.compile_peak, job.compile_rss)
            job.alive = True
        return tree_rss

    def _job_of(self, pid: int, pgid: int, build_pgid: int,
                seen: dict[int, tuple[int, int, int, float]], servers: set[int],
                server_exes: set[str | None]) -> tuple[int, float] | None:
        """The (leader pid, start time) of the job ``pid`` belongs to, or None."""
        if pgid in servers:
            # Climb to the server's direct child: that child and its descendants are one job.
            current = pid
            while current in seen and seen[current][0] != pgid:
                current = seen[current][0]
            if current == pgid or current not in seen:
                return None  # the server itself, or a process whose parent already left
            return (current, seen[current][3])
        if pgid == build_pgid or pgid not in seen:
            return None
        if servers and self._exe(pgid, seen[pgid][3]) in server_exes:
            return None  # a compile-cache client: it only waits for the server
        return (pgid, seen[pgid][3])

    def _is_server(self, pid: int, ctime: float) -> bool:
        key = (pid, ctime)
        if key not in self._servers:
            try:
                marked = SERVER_MARK in psutil.Process(pid).environ()
            except (psutil.Error, OSError):
                return False  # not cached: it may still be starting
            # Between fork and exec a process shows its parent's environment: a "no" from a
            # process this young may turn into a "yes" once it runs its own program (on a
            # loaded host, clients were counted as jobs because the server's "no" stuck).
            if not marked and time.time() - ctime < _SETTLE_SECONDS:
                return False
            self._servers[key] = marked
        return self._servers[key]

    def _exe(self, pid: int, ctime: float) -> str | None:
        key = (pid, ctime)
        if key not in self._exes:
            try:
                exe = psutil.Process(pid).exe() or None
            except (psutil.Error, OSError):
                return None
            if time.time() - ctime < _SETTLE_SECONDS:
                return exe  # maybe still its parent's program (before exec): not kept
            self._exes[key] = exe
        return self._exes[key]

    def _typical_peak(self) -> int:
        finished = [job.peak for job in self._jobs.values() if not job.alive]
        return max(finished, default=0)

    def tick(self) -> None:
        """Measure once, then pause jobs under pressure, or resume at most one."""
        available = self.available(self._measure())
        if self.min_available is None or available < self.min_available:
            self.min_available = available
        live = [job for job in self._jobs.values() if job.alive]
        running = sorted((j for j in live if not j.paused), key=lambda j: j.started)
        paused = sorted((j for j in live if j.paused), key=lambda j: j.started)

        def projected() -> float:
            return available - HORIZON * sum(job.rate for job in running)

        paused_now = False
        while len(running) > 1 and projected() < self.low_watermark:
            youngest = running.pop()  # the youngest has made the least progress
            self._pause(youngest)
            paused_now = True
        if paused_now or not paused:
            return
        oldest = paused[0]  # the oldest is closest to finishing
        growth = max(0, self._typical_peak() - oldest.rss)
        if not running or (available > self.high_watermark
                           and available - growth > self.low_watermark):
            self._resume(oldest)

    def _signal(self, job: _Job, sig: signal.Signals) -> bool:
        if not job.members:
            return signal_group_quietly(job.pgid, sig)
        return any([signal_quietly(pid, sig) for pid in job.members])

    def _pause(self, job: _Job) -> None:
        if self._signal(job, signal.SIGSTOP):
            job.paused = True
            job.rate = 0.0
            self.pauses += 1

    def _resume(self, job: _Job) -> None:
        self._signal(job, signal.SIGCONT)
        job.paused = False
        self.resumes += 1

    def resume_all(self) -> None:
        """SIGCONT every paused job (before a kill or cancel)."""
        for job in self._jobs.values():
            if job.paused:
                self._resume(job)


_OOM_PATTERNS = re.compile(
    r"Killed signal terminated program"  # gcc/g++: cc1plus SIGKILLed
    r"|died due to signal 9"  # nvcc: 'cicc' died due to signal 9 (Kill signal)
    r"|out of memory"
    r"|Cannot allocate memory"
    r"|std::bad_alloc"
    r"|virtual memory exhausted"
    r"|MemoryError",
    re.IGNORECASE,
)
_SIGKILL_CODES = {-signal.SIGKILL, 128 + signal.SIGKILL}


def was_oom_killed(returncode: int | None, log_tail: str, *, oom_kill_events: int = 0) -> bool:
    """Whether a failed build looks like the kernel's OOM killer took a compile.

    Call it only for builds that were not timed out or cancelled (those are SIGKILLed by us).
    ``oom_kill_events`` is ``BuildProcess.oom_kills()`` where a memory cgroup exists.
    """
    if returncode == 0:
        return False
    if oom_kill_events > 0:
        return True
    if returncode in _SIGKILL_CODES:
        return True
    return bool(_OOM_PATTERNS.search(log_tail))

