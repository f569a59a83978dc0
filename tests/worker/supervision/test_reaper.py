"""A timeout or cancel kills exactly the build's own process tree, checked on the processes.

Hostile trees come from tests/worker/hostile/: jobs in their own process groups (as ninja
starts them), a setsid double fork, a SIGTERM-ignorer, a stopped process, a fast forker. Each
hostile process records its pid; the assertions look at those pids with psutil.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from worker.supervision.reaper import (
    BUILD_ID_ENV,
    BuildProcess,
    ReapReport,
    become_subreaper,
    build_id_base,
    cgroup_base,
    is_subreaper,
    pid_alive,
    signal_group_quietly,
    signal_quietly,
    unique_build_id,
)

HOSTILE = Path(__file__).resolve().parents[1] / "hostile"
REPO = Path(__file__).resolve().parents[3]
HAS_CGROUP = cgroup_base() is not None
# The roles every hostile tree records; "forked" (the fast forker's children) comes on top.
TREE_ROLES = {"main", "ninja", "job", "nvcc", "escaped", "ignorer", "stopped", "forker"}


def _recorded(pid_dir: Path) -> dict[int, tuple[str, float]]:
    """pid -> (role, time the pid was recorded)."""
    found = {}
    for entry in pid_dir.iterdir():
        role, _, pid = entry.name.rpartition("-")
        found[int(pid)] = (role, entry.stat().st_mtime)
    return found


def _alive(pid: int, recorded_at: float) -> bool:
    """Whether the recorded process still runs (a zombie doesn't; a reused pid isn't it)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() <= recorded_at + 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signals_pending(pid: int) -> bool:
    """Whether a signal waits to be delivered to the process (its own or its group's)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    pending = {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in status.splitlines())
               if k in ("SigPnd", "ShdPnd")}
    return any(pending.values())


def _survivors(pid_dir: Path) -> list[tuple[int, str]]:
    return [(pid, role) for pid, (role, at) in _recorded(pid_dir).items() if _alive(pid, at)]


def _dead(pid_dir: Path) -> list[tuple[int, str]]:
    """Recorded processes that no longer run (for neighbours: must be empty)."""
    return [(pid, role) for pid, (role, at) in _recorded(pid_dir).items() if not _alive(pid, at)]


def _wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the hostile tree")
        time.sleep(0.05)


def _tree_ready(pid_dir: Path, roles: set[str] = TREE_ROLES, forked: int = 5) -> bool:
    seen = [role for role, _ in _recorded(pid_dir).values()]
    return roles <= set(seen) and seen.count("forked") >= forked


class Trees:
    """Starts hostile builds and unrelated processes; kills whatever is left of them at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.builds: list[BuildProcess] = []
        self.pid_dirs: list[Path] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        bindir = tmp_path / "bin"
        bindir.mkdir()
        self.nvcc = bindir / "nvcc"
        self.nvcc.symlink_to("/bin/sleep")  # its comm and argv[0] are "nvcc"
        self.counter = 0

    def pid_dir(self, name: str) -> Path:
        path = self.tmp_path / name
        path.mkdir()
        self.pid_dirs.append(path)
        return path

    def build(
        self, name: str, *, script: str = "tree.py", args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None, use_cgroup: bool = True,
    ) -> tuple[BuildProcess, Path]:
        self.counter += 1
        pid_dir = self.pid_dir(name)
        env = {**os.environ, "HOSTILE_PIDS": str(pid_dir), "HOSTILE_NVCC": str(self.nvcc),
               **(extra_env or {})}
        build = BuildProcess.start(
            [sys.executable, str(HOSTILE / script), *args],
            build_id=unique_build_id(f"test-{os.getpid()}-{self.counter}-{name}"), env=env,
            cwd=self.tmp_path,
            log_path=self.tmp_path / f"{name}.log", use_cgroup=use_cgroup,
        )
        self.builds.append(build)
        return build, pid_dir

    def unrelated_nvcc(self) -> subprocess.Popen[bytes]:
        """A process named nvcc that belongs to nobody's build."""
        proc = subprocess.Popen([str(self.nvcc), "1000"], start_new_session=True)
        self.popens.append(proc)
        return proc

    def cleanup(self) -> None:
        for build in self.builds:
            build.kill_tree(grace=0)
            build.close()
        for proc in self.popens:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for pid_dir in self.pid_dirs:  # only pids our own scripts recorded
            for pid, (_, at) in _recorded(pid_dir).items():
                if _alive(pid, at):
                    os.kill(pid, signal.SIGKILL)
        for pid_dir in self.pid_dirs:
            for pid in _recorded(pid_dir):  # zombies re-parented to us
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[Trees]:
    t = Trees(tmp_path)
    try:
        yield t
    finally:
        t.cleanup()


@pytest.fixture(params=[True, False], ids=["subreaper", "no-subreaper"])
def subreaper(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Run with and without PR_SET_CHILD_SUBREAPER on the test process (restored after)."""
    before = is_subreaper()
    if request.param:
        assert become_subreaper(), "prctl(PR_SET_CHILD_SUBREAPER) is available on Linux"
    else:
        become_subreaper(False)
    try:
        yield bool(request.param)
    finally:
        become_subreaper(before)


def _our_zombies(pid_dir: Path) -> list[int]:
    me = os.getpid()
    zombies = []
    for pid in _recorded(pid_dir):
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() == me:
                zombies.append(pid)
        except psutil.NoSuchProcess:
            pass
    return zombies


CGROUP_MODES = [
    pytest.param(False, id="fallback"),
    pytest.param(True, id="cgroup", marks=pytest.mark.skipif(
        not HAS_CGROUP, reason="no writable cgroup v2 subtree here")),
]


@pytest.mark.parametrize("use_cgroup", CGROUP_MODES)
def test_timeout_kills_the_whole_hostile_tree_and_spares_neighbours(
    trees: Trees, subreaper: bool, use_cgroup: bool,
) -> None:
    neighbour, neighbour_pids = trees.build("neighbour", use_cgroup=use_cgroup)
    unrelated = trees.unrelated_nvcc()
    hostile, hostile_pids = trees.build("hostile", use_cgroup=use_cgroup,
                                        extra_env={"HOSTILE_HOG_MB": "50"})
    assert (hostile.cgroup is not None) == use_cgroup
    _wait_for(lambda: _tree_ready(hostile_pids, TREE_ROLES | {"hog"})
              and _tree_ready(neighbour_pids))
    assert "nvcc" in {psutil.Process(pid).name() for pid in _recorded(hostile_pids)
                      if _recorded(hostile_pids)[pid][0] == "nvcc"}

    outcome = hostile.wait(deadline=time.monotonic() + 0.2, grace=1.0)

    assert outcome.timed_out and not outcome.cancelled
    assert outcome.reap is not None
    assert _survivors(hostile_pids) == []
    assert outcome.reap.survivors == 0
    # The ignorer and the fast forker ignore SIGTERM: only SIGKILL ends them.
    assert outcome.reap.signals == ["SIGTERM", "SIGKILL"]
    assert outcome.reap.processes >= len(_recorded(hostile_pids))
    assert hostile.processes() == []
    if subreaper:
        assert _our_zombies(hostile_pids) == []
    # Every neighbour lives: the other build (with its own nvcc) and the unrelated nvcc.
    assert unrelated.poll() is None and psutil.Process(unrelated.pid).name() == "nvcc"
    assert _dead(neighbour_pids) == []
    assert neighbour.poll() is None
    json.dumps(asdict(outcome.reap))  # goes into the build record as is

    report = neighbour.kill_tree(grace=0.5)
    assert report.survivors == 0 and _survivors(neighbour_pids) == []


def test_cancel_kills_the_tree(trees: Trees) -> None:
    build, pid_dir = trees.build("cancelled", use_cgroup=False)
    _wait_for(lambda: _tree_ready(pid_dir))
    ticks: list[float] = []

    outcome = build.wait(deadline=None, should_cancel=lambda: len(ticks) >= 2,
                         on_tick=lambda: ticks.append(time.monotonic()), tick=0.05, grace=0.5)

    assert outcome.cancelled and not outcome.timed_out
    assert outcome.returncode == -signal.SIGTERM  # the main obeyed SIGTERM
    assert outcome.reap is not None and outcome.reap.survivors == 0
    assert _survivors(pid_dir) == []


def test_escapee_without_cookie_or_session_is_caught_by_the_cgroup(trees: Trees) -> None:
    if not HAS_CGROUP:
        pytest.skip("no writable cgroup v2 subtree here")
    build, pid_dir = trees.build("escape", extra_env={"HOSTILE_CLEAR_ENV": "1"})
    assert build.cgroup is not None
    cgroup = build.cgroup
    _wait_for(lambda: _tree_ready(pid_dir, TREE_ROLES | {"escaped-noenv"}))
    escapee = next(pid for pid, (role, _) in _recorded(pid_dir).items()
                   if role == "escaped-noenv")
    proc = psutil.Process(escapee)
    assert BUILD_ID_ENV not in proc.environ() and os.getsid(escapee) != build.pid

    outcome = build.wait(deadline=time.monotonic(), grace=0.5)

    assert outcome.reap is not None and outcome.reap.survivors == 0
    assert _survivors(pid_dir) == []
    assert not cgroup.exists()  # removed once empty


def test_normal_exit_reaps_stray_processes(trees: Trees) -> None:
    """A finished build must not leave compilers behind."""
    build, pid_dir = trees.build("strays", script="leaves_strays.py", use_cgroup=False)

    outcome = build.wait(deadline=time.monotonic() + 30, grace=0.5)

    assert outcome.returncode == 0 and not outcome.timed_out
    stragglers = [pid for pid, (role, _) in _recorded(pid_dir).items() if role == "straggler"]
    assert len(stragglers) == 2
    assert outcome.reap is not None and outcome.reap.processes == 2
    assert outcome.reap.signals == ["SIGTERM", "SIGKILL"] and outcome.reap.survivors == 0
    assert _survivors(pid_dir) == []


def test_clean_build_reports_no_reap(trees: Trees) -> None:
    build, _ = trees.build("clean", script="memory_hog.py", args=("1", "0", "0"))
    outcome = build.wait(deadline=time.monotonic() + 30)
    assert outcome == type(outcome)(returncode=0)
    assert build.cgroup is None  # removed


def test_sweep_orphans_of_a_sigkilled_worker(trees: Trees) -> None:
    prefix = f"test-{os.getpid()}-sweep-"
    neighbour, neighbour_pids = trees.build("sweep-neighbour")
    unrelated = trees.unrelated_nvcc()
    orphan_pids = trees.pid_dir("orphans")
    worker = subprocess.Popen(
        [sys.executable, str(HOSTILE / "orphan_worker.py"), unique_build_id(prefix + "dead"),
         str(trees.tmp_path)],
        env={**os.environ, "HOSTILE_PIDS": str(orphan_pids), "HOSTILE_NVCC": str(trees.nvcc)},
        stdout=subprocess.PIPE, cwd=REPO,
    )
    trees.popens.append(worker)
    assert worker.stdout is not None
    ready = worker.stdout.readline().decode().split()
    assert ready[0] == "ready"
    orphan_cgroup = Path(ready[2]) if len(ready) > 2 else None
    _wait_for(lambda: _tree_ready(orphan_pids) and _tree_ready(neighbour_pids))
    worker.kill()  # the worker dies mid-build; its build lives on
    worker.wait()
    # Its exit has been handled whole (orphans re-parented, any death signal sent): the tree
    # runs on with nothing on its way to end it.
    survivors = _survivors(orphan_pids)
    assert {role for _, role in survivors} >= TREE_ROLES
    assert [(pid, role) for pid, role in survivors if _signals_pending(pid)] == []

    # Live builds are named by job, as workers advertise them: the cookie's base.
    live = [build_id_base(neighbour.build_id)]
    assert live != [neighbour.build_id]
    swept = subprocess.run(
        [sys.executable, "-c",
         "import json, sys; from dataclasses import asdict; "
         "from worker.supervision.reaper import sweep_orphans; "
         "print(json.dumps(asdict(sweep_orphans(sys.argv[2:], id_prefix=sys.argv[1], "
         "grace=0.5))))",
         f"test-{os.getpid()}-", *live],
        capture_output=True, text=True, check=True, cwd=REPO, timeout=60,
    )

    report = ReapReport(**json.loads(swept.stdout))
    assert report.survivors == 0
    assert report.processes >= len(_recorded(orphan_pids))
    assert _survivors(orphan_pids) == []
    if orphan_cgroup is not None:
        assert not orphan_cgroup.exists()
    assert unrelated.poll() is None
    assert neighbour.poll() is None
    assert _dead(neighbour_pids) == []


def test_build_ids_are_unique_and_keep_their_base() -> None:
    base = "wh1a2b3c4d-build-flash-attn-2_8_3"
    first, second = unique_build_id(base), unique_build_id(base)
    assert first != second and first.startswith(base + ".")
    assert build_id_base(first) == build_id_base(second) == base
    assert build_id_base(base) == base  # an id from before suffixes is its own base


def test_an_exception_during_wait_kills_the_tree(trees: Trees) -> None:
    """E.g. RQ's job timeout fires inside the horse while the build runs."""
    build, pid_dir = trees.build("interrupted")
    cgroup = build.cgroup
    _wait_for(lambda: _tree_ready(pid_dir))

    class JobTimeout(Exception):
        pass

    def on_tick() -> None:
        raise JobTimeout

    with pytest.raises(JobTimeout):
        build.wait(deadline=None, on_tick=on_tick, grace=0.2)

    assert _survivors(pid_dir) == []
    assert build.poll() is not None
    if cgroup is not None:
        assert not cgroup.exists()


def test_signals_to_processes_that_are_gone_are_quiet() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    assert pid_alive(child.pid)
    assert signal_group_quietly(child.pid, signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM
    # Reaped: no such process any more (nor group), and saying so is not an error.
    assert not pid_alive(child.pid)
    assert not signal_quietly(child.pid, signal.SIGTERM)
    assert not signal_group_quietly(child.pid, signal.SIGTERM)
