"""The memory governor pauses the youngest compile jobs under pressure and resumes them later.

"Compile jobs" are memory hogs, each in its own process group as ninja starts them; the
pressure comes from an artificial budget. The assertions look at the processes' states.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import wait_until
from worker.compilecache import SERVER_MARK as COMPILE_SERVER
from worker.supervision.governor import MemoryGovernor, was_oom_killed
from worker.supervision.reaper import BuildProcess

HOSTILE = Path(__file__).resolve().parents[1] / "hostile"
MiB = 1 << 20


@pytest.fixture
def builds() -> Iterator[list[BuildProcess]]:
    started: list[BuildProcess] = []
    try:
        yield started
    finally:
        for build in started:  # only the trees these tests started
            build.kill_tree(grace=0)
            build.close()


def _hog_build(tmp_path: Path, builds: list[BuildProcess], *args: str) -> BuildProcess:
    build = BuildProcess.start(
        [sys.executable, str(HOSTILE / "hog_jobs.py"), *args],
        build_id=f"test-{os.getpid()}-hogs-{len(builds)}", env=dict(os.environ), cwd=tmp_path,
        log_path=tmp_path / "build.log",
    )
    builds.append(build)
    return build


class JobStates:
    """After each governor tick: how many compile jobs run and how many are stopped."""

    def __init__(self, build: BuildProcess, governor: MemoryGovernor) -> None:
        self.build = build
        self.governor = governor
        self.samples: list[tuple[int, int]] = []

    def tick(self) -> None:
        self.governor.tick()
        running = stopped = 0
        for proc in self.build.processes():
            try:
                if proc.pid != os.getpgid(proc.pid) or proc.pid == self.build.pid:
                    continue  # not a job leader
                if proc.status() == psutil.STATUS_STOPPED:
                    stopped += 1
                else:
                    running += 1
            except (psutil.Error, OSError):
                continue
        if running or stopped:
            self.samples.append((running, stopped))


def test_hogs_are_paused_and_resumed_and_the_build_completes(
    tmp_path: Path, builds: list[BuildProcess],
) -> None:
    # Four jobs of 200 MiB each want ~850 MiB with their interpreters; the budget is 600 MiB.
    build = _hog_build(tmp_path, builds, "4", "200", "2", "0.3")
    budget = 600 * MiB
    governor = MemoryGovernor(build, budget_bytes=budget, low_watermark=150 * MiB,
                              high_watermark=250 * MiB)
    states = JobStates(build, governor)

    outcome = build.wait(deadline=time.monotonic() + 40, on_tick=states.tick, tick=0.1)

    log = (tmp_path / "build.log").read_text()
    assert outcome.returncode == 0, log  # every job exited 0: none was killed
    assert not outcome.timed_out and outcome.reap is None
    assert governor.pauses >= 1 and governor.resumes == governor.pauses
    assert max(stopped for _, stopped in states.samples) >= 1  # seen SIGSTOPped, by psutil
    assert all(running >= 1 for running, _ in states.samples)  # never the last running one
    assert governor.peak_tree_rss <= budget
    assert governor.min_available is not None and governor.min_available >= 0
    assert len(governor.job_peaks) == 4
    assert all(peak >= 200 * MiB for peak in governor.job_peaks)


def test_only_compilers_memory_is_learned(tmp_path: Path, builds: list[BuildProcess]) -> None:
    """A build that parks 300 MiB in a group of its own, and 300 MiB more in a plain child of
    its compile job, teaches only what its compiler (``cc1plus``) held: the learned figure of
    its project is not raised by what it parked."""
    links = tmp_path / "links"
    links.mkdir()
    build = BuildProcess.start(
        [sys.executable, str(HOSTILE / "parked_hog.py"), str(links), "100", "300"],
        build_id=f"test-{os.getpid()}-parked", env=dict(os.environ), cwd=tmp_path,
        log_path=tmp_path / "build.log")
    builds.append(build)
    governor = MemoryGovernor(build, budget_bytes=64 << 30, low_watermark=0, high_watermark=0)
    names: set[str] = set()

    def tick() -> None:
        governor.tick()
        for proc in build.processes():
            with contextlib.suppress(psutil.Error):
                names.add(proc.name())

    outcome = build.wait(deadline=time.monotonic() + 60, on_tick=tick, tick=0.1)

    assert outcome.returncode == 0, (tmp_path / "build.log").read_text()
    assert "cc1plus" in names
    # The governor saw the parked memory (both groups are jobs to pause) ...
    assert max(governor.job_peaks) >= 300 * MiB
    # ... but learns only the compiler's 100 MiB (and its interpreter's few MiB).
    assert len(governor.compile_peaks) == 1
    assert 100 * MiB <= governor.compile_peaks[0] < 200 * MiB


def test_under_the_compile_cache_each_child_of_the_server_is_a_job(
    tmp_path: Path, builds: list[BuildProcess],
) -> None:
    """sccache runs every compile as a child of its server, all in the server's one process
    group: each child is one job (paused alone, its own peak), the server and its waiting
    clients are none."""
    build = BuildProcess.start(
        [sys.executable, str(HOSTILE / "server_jobs.py"), "3", "200", "2", "0.3"],
        build_id=f"test-{os.getpid()}-server", env=dict(os.environ), cwd=tmp_path,
        log_path=tmp_path / "build.log")
    builds.append(build)
    budget = 600 * MiB
    governor = MemoryGovernor(build, budget_bytes=budget, low_watermark=150 * MiB,
                              high_watermark=250 * MiB)
    server_stopped = False

    def tick() -> None:
        nonlocal server_stopped
        governor.tick()
        for proc in build.processes():
            try:
                if (COMPILE_SERVER in proc.environ()
                        and proc.status() == psutil.STATUS_STOPPED):
                    server_stopped = True
            except psutil.Error:
                continue

    outcome = build.wait(deadline=time.monotonic() + 60, on_tick=tick, tick=0.1)

    assert outcome.returncode == 0, (tmp_path / "build.log").read_text()
    assert governor.pauses >= 1 and governor.resumes == governor.pauses
    assert not server_stopped  # pausing a compile never stops the server (or every compile)
    assert len(governor.job_peaks) == 3  # the three hogs; not the server, not its clients
    assert all(200 * MiB <= peak < 400 * MiB for peak in governor.job_peaks)


def test_a_paused_build_still_obeys_its_deadline(
    tmp_path: Path, builds: list[BuildProcess],
) -> None:
    # Always under pressure: every job but one is paused, and they never finish.
    build = _hog_build(tmp_path, builds, "3", "10", "0", "1000")
    governor = MemoryGovernor(build, budget_bytes=1, low_watermark=0, high_watermark=0)
    states = JobStates(build, governor)
    deadline = time.monotonic() + 30

    def paused_two() -> bool:
        return bool(states.samples) and states.samples[-1] == (1, 2)

    outcome = build.wait(deadline=deadline, should_cancel=paused_two, on_tick=states.tick,
                         tick=0.1, grace=0.5)

    assert outcome.cancelled, "two of three jobs should have been paused"
    assert all(running == 1 for running, _ in states.samples[1:])
    assert outcome.reap is not None and outcome.reap.survivors == 0
    assert build.processes() == []
    assert governor.pauses == 2


def test_resume_all_continues_every_paused_job(
    tmp_path: Path, builds: list[BuildProcess],
) -> None:
    build = _hog_build(tmp_path, builds, "3", "10", "0", "1000")
    governor = MemoryGovernor(build, budget_bytes=1, low_watermark=0, high_watermark=0)

    def two_paused() -> bool:
        governor.tick()
        return governor.paused_jobs == 2

    wait_until(two_paused, "the governor to pause two jobs")
    leaders = [p for p in build.processes() if p.pid == os.getpgid(p.pid) != build.pid]
    assert len(leaders) == 3
    wait_until(lambda: sum(p.status() == psutil.STATUS_STOPPED for p in leaders) == 2,
               "two jobs to stop")

    governor.resume_all()

    assert governor.paused_jobs == 0
    # SIGCONT is delivered asynchronously: wait until every job runs again.
    wait_until(lambda: all(p.status() != psutil.STATUS_STOPPED for p in leaders),
               "every paused job to continue")


@pytest.mark.parametrize(
    ("returncode", "log_tail", "oom_events", "expected"),
    [
        (0, "Killed signal terminated program cc1plus", 0, False),
        (1, "g++: fatal error: Killed signal terminated program cc1plus", 0, True),
        (1, "nvcc error   : 'cicc' died due to signal 9 (Kill signal)", 0, True),
        (1, "cc1plus: out of memory allocating 65536 bytes", 0, True),
        (-signal.SIGKILL, "", 0, True),
        (137, "", 0, True),
        (1, "error: identifier \"std::strong_ordering\" is undefined", 0, False),
        (1, "ninja: build stopped: subcommand failed.", 1, True),
        (2, "ninja: build stopped: subcommand failed.", 0, False),
    ],
)
def test_was_oom_killed(returncode: int, log_tail: str, oom_events: int, expected: bool) -> None:
    assert was_oom_killed(returncode, log_tail, oom_kill_events=oom_events) is expected


def test_watermarks_must_be_ordered(tmp_path: Path, builds: list[BuildProcess]) -> None:
    build = _hog_build(tmp_path, builds, "0", "1", "0", "0")
    with pytest.raises(ValueError, match="high_watermark"):
        MemoryGovernor(build, low_watermark=2, high_watermark=1)
