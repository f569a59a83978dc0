"""RAM-aware MAX_JOBS: the reserve rule, the clamp, effective nvcc threads, and per-job memory
learned across builds per effective thread count."""

from __future__ import annotations

import json

import pytest

from wheelhouse.builds.facts import MaxJobs
from wheelhouse.builds.maxjobs import (
    GIB,
    choose_max_jobs,
    decide,
    effective_threads,
    learned_job_peaks,
    learned_per_thread,
    record_peaks,
    reserve_bytes,
    stats_key,
)
from wheelhouse.index.storage import LocalStorage, Storage

#: flash-attn's recipe: 5 GiB per nvcc thread, NVCC_THREADS=4.
RECIPE = 5 * GIB


@pytest.mark.parametrize(
    ("total_gib", "reserve_gib"),
    [
        (880, 132.0),  # 15 % on a big host
        (64, 9.6),  # still 15 % (above 8 GiB)
        (48, 8.0),  # the 8 GiB floor
        (24, 6.0),  # small host: capped at a quarter
        (16, 4.0),
        (2, 1.0),  # never below 1 GiB
    ],
)
def test_reserve(total_gib: int, reserve_gib: float) -> None:
    assert reserve_bytes(total_gib * GIB) == pytest.approx(reserve_gib * GIB, rel=1e-6)


@pytest.mark.parametrize(("nvcc_threads", "archs", "threads"), [
    (4, 1, 1), (4, 2, 2), (4, 4, 4), (4, 9, 4), (1, 4, 1), (4, 0, 1),
])
def test_effective_threads(nvcc_threads: int, archs: int, threads: int) -> None:
    assert effective_threads(nvcc_threads, archs) == threads


@pytest.mark.parametrize(
    ("available", "total", "cores", "per_thread", "threads", "archs", "jobs"),
    [
        # The host of flash-attn issue #2493: its own heuristic picked 42 jobs, then rebooted.
        (860, 880, 96, 5.0, 4, 4, 36),
        (860, 880, 96, 5.0, 4, 2, 72),  # two targets: two threads busy, twice the jobs
        (860, 880, 200, 5.0, 4, 1, 145),  # one target: one thread's memory per job
        (22, 24, 2, 5.0, 4, 4, 1),  # nothing fits: one job, the governor guards it
        (22, 24, 2, 1.0, 1, 2, 2),  # 16 fit, capped at the cores
        (100, 128, 64, 2.0, 1, 2, 40),  # (100 - 19.2) / 2 = 40
        (5, 128, 64, 2.0, 1, 2, 1),  # available below the reserve
    ],
)
def test_choose(available: float, total: float, cores: int, per_thread: float, threads: int,
                archs: int, jobs: int) -> None:
    decision = choose_max_jobs(available=int(available * GIB), total=int(total * GIB),
                               cores=cores, per_thread_bytes=int(per_thread * GIB),
                               nvcc_threads=threads, archs=archs)
    assert decision.jobs == jobs
    assert decision.reason.startswith(f"MAX_JOBS={jobs}: ")
    assert "reserve" in decision.reason and "from the recipe" in decision.reason
    effective = min(threads, archs)
    assert decision.targets == archs and decision.effective_threads == effective
    assert f"NVCC_THREADS={threads}" in decision.reason
    # The promise behind the number: the chosen jobs fit beside the reserve, unless only one runs.
    if jobs > 1:
        used = jobs * per_thread * effective * GIB
        assert used + decision.reserve_bytes <= available * GIB


def test_reason_says_why_when_clamped() -> None:
    assert "capped at 2 cores" in choose_max_jobs(
        available=22 * GIB, total=24 * GIB, cores=2, per_thread_bytes=GIB, archs=1).reason
    clamped = choose_max_jobs(available=8 * GIB, total=24 * GIB, cores=2,
                              per_thread_bytes=5 * GIB, nvcc_threads=4, archs=4)
    assert "running 1 job anyway" in clamped.reason
    assert "x 4 nvcc threads: 4 device targets, NVCC_THREADS=4" in clamped.reason


def _stats(storage: Storage, data: dict[str, object]) -> None:
    storage.put_bytes(stats_key("flash-attn", "flash-attn", "13.0"), json.dumps(data).encode())


def _v3(by_threads: dict[int, list[float]]) -> dict[str, object]:
    return {"version": 3, "job_peaks": {str(t): [int(p * GIB) for p in peaks]
                                        for t, peaks in by_threads.items()}}


def _decide(storage: Storage | None, archs: int, *, project: str = "flash-attn",
            recipe: str = "flash-attn", available: int = 500 * GIB,
            total: int = 512 * GIB) -> MaxJobs:
    return decide(storage, recipe=recipe, project=project, cuda="13.0",
                  recipe_per_thread=RECIPE, nvcc_threads=4, archs=archs, available=available,
                  total=total, cores=128)


def _record(storage: Storage, peaks: list[int], nvcc_threads: int, archs: int, *,
            project: str = "flash-attn", recipe: str = "flash-attn",
            per_thread: int = RECIPE) -> int | None:
    return record_peaks(storage, recipe, project, "13.0", peaks, nvcc_threads, archs=archs,
                        recipe_per_thread=per_thread)


@pytest.mark.parametrize(
    ("stored", "archs", "charge_gib", "learned"),
    [
        # Nothing measured: the recipe's figure times the effective threads.
        ({}, 1, 5.0, False),
        ({}, 4, 20.0, False),
        ({}, 9, 20.0, False),  # nine targets still run on NVCC_THREADS=4
        # A learned figure below the recipe's never lowers the charge (a small build must not
        # make the next one over-commit), whatever the thread counts (issue 22: after an
        # sm90-only build, a 4-arch build on 512 GiB got ~68 jobs of ~20 GiB each).
        (_v3({1: [1.0]}), 4, 20.0, False),
        (_v3({1: [1.0]}), 2, 10.0, False),
        (_v3({1: [1.0]}), 1, 5.0, False),
        (_v3({4: [8.0]}), 4, 20.0, False),
        (_v3({2: [12.0], 4: [8.0]}), 4, 20.0, False),
        # Above it, what was measured raises it: at as many threads, or at fewer (more threads
        # never need less than one thread did) ...
        (_v3({4: [25.0]}), 4, 30.0, True),
        (_v3({1: [30.0]}), 4, 36.0, True),
        (_v3({1: [3.0], 4: [18.0]}), 4, 21.6, True),
        (_v3({2: [18.0], 4: [17.0]}), 4, 21.6, True),  # the 2-thread peak is a floor
        # ... up to twice the recipe's figure (one build that parked memory moves no further).
        (_v3({4: [50.0]}), 4, 40.0, True),
        (_v3({1: [30.0]}), 1, 10.0, True),
        # A peak measured with more threads says nothing about fewer: the recipe stands.
        (_v3({4: [8.0]}), 1, 5.0, False),
        (_v3({2: [12.0]}), 4, 20.0, False),  # 14.4 from two threads is below the recipe's 20
        ({"per_thread_peaks": [1], "job_peaks": {"x": [1], "0": [1], "2": "y"}}, 4, 20.0,
         False),
    ],
)
def test_the_charge_per_job(local_storage: LocalStorage, stored: dict[str, object], archs: int,
                            charge_gib: float, learned: bool) -> None:
    if stored:
        _stats(local_storage, stored)
    decision = _decide(local_storage, archs)
    threads = min(4, archs)
    assert decision.per_thread_bytes * threads == pytest.approx(charge_gib * GIB, abs=threads)
    assert decision.learned is learned
    assert decision.targets == archs and decision.effective_threads == threads
    summary = decision.charge_summary()
    assert summary is not None and f"{charge_gib:.1f} GiB per compile job" in summary
    assert f"on {threads} nvcc thread" in summary


def test_single_arch_builds_run_about_nvcc_threads_times_the_jobs(
        local_storage: LocalStorage) -> None:
    """A 128-core, 512 GiB host: one target per job runs ~4x the jobs of four targets, also
    after a single-arch build measured its (lower) peak, which lowers nothing."""
    def jobs(archs: int) -> int:
        return _decide(local_storage, archs, available=512 * GIB).jobs

    single, four = jobs(1), jobs(4)
    assert (single, four) == (87, 21)  # (512 - 76.8) / 5 and / 20
    assert 3.5 <= single / four <= 4.5
    # One sm90-only build measured 3.4 GiB per job (bench/flash_attn_kernel.py's kernel).
    _record(local_storage, [int(3.4 * GIB)], 4, 1)
    assert (jobs(1), jobs(4)) == (single, four)


def test_learned_per_project_recipe_cuda_and_thread_count(storage: Storage) -> None:
    def per_thread(threads: int, archs: int) -> int | None:
        return learned_per_thread(storage, "flash-attn", "flash-attn", "13.0",
                                  nvcc_threads=threads, archs=archs, recipe_per_thread=RECIPE)

    assert per_thread(4, 4) is None
    # A 4-arch build measured 12 GiB per compile job at 2 nvcc threads: 6 GiB per thread.
    assert _record(storage, [2 * GIB, 12 * GIB, 5 * GIB], 2, 4) == 6 * GIB
    assert per_thread(2, 4) == int(7.2 * GIB)
    # A single-arch build with NVCC_THREADS=4 ran one thread: its peak is one thread's.
    assert _record(storage, [6 * GIB], 4, 1) == 6 * GIB
    assert learned_job_peaks(storage, "flash-attn", "flash-attn", "13.0") == {
        1: [6 * GIB], 2: [12 * GIB]}
    # Per CUDA version, and per project: other ones keep their own figures.
    assert learned_job_peaks(storage, "flash-attn", "flash-attn", "12.8") == {}
    assert learned_job_peaks(storage, "flash-attn", "other", "13.0") == {}
    assert storage.exists(stats_key("flash-attn", "flash-attn", "13.0"))
    # Only the recent builds of each count count: after ten smaller ones the old peak is gone,
    # and the other counts keep theirs.
    for _ in range(10):
        _record(storage, [GIB], 2, 2)
    assert learned_job_peaks(storage, "flash-attn", "flash-attn", "13.0") == {
        1: [6 * GIB], 2: [GIB] * 10}


def test_one_projects_build_moves_no_other_projects_figure(local_storage: LocalStorage) -> None:
    """Under a generic recipe (2 GiB per job) project A's build that parked 3 GiB beside its
    compiles, or a tiny one, leaves project B's charge where it was."""
    generic = 2 * GIB

    def charge(project: str) -> int:
        return decide(local_storage, recipe="generic", project=project, cuda="13.0",
                      recipe_per_thread=generic, nvcc_threads=1, archs=1,
                      available=64 * GIB, total=64 * GIB, cores=64).per_thread_bytes

    before = charge("project-b")
    assert before == generic
    record_peaks(local_storage, "generic", "project-a", "13.0", [int(3.6 * GIB)], 1, archs=1,
                 recipe_per_thread=generic)
    assert charge("project-a") > generic and charge("project-b") == before
    for _ in range(10):
        record_peaks(local_storage, "generic", "project-c", "13.0", [64 << 20], 1, archs=1,
                     recipe_per_thread=generic)
    assert charge("project-c") == generic and charge("project-b") == before


def test_what_one_build_can_move_a_figure_is_bounded(local_storage: LocalStorage) -> None:
    """At most twice the recipe's figure up (the sample is clamped as it is stored), never
    below it from small builds."""
    assert _record(local_storage, [100 * GIB], 1, 1) == 2 * RECIPE
    assert learned_job_peaks(local_storage, "flash-attn", "flash-attn", "13.0") == {
        1: [2 * RECIPE]}
    assert _decide(local_storage, 1).per_thread_bytes == 2 * RECIPE
    for _ in range(10):  # ten tiny builds push the big one out: the recipe's figure again
        _record(local_storage, [1 << 20], 1, 1)
    decision = _decide(local_storage, 1)
    assert decision.per_thread_bytes == RECIPE and not decision.learned


def test_an_older_stats_file_is_not_read(local_storage: LocalStorage) -> None:
    """Files of version 2 were per recipe (every project's builds in one figure): the key is
    per project now, and nothing reads the old ones."""
    local_storage.put_bytes("stats/flash-attn-cu130.json", json.dumps(
        {"version": 2, "job_peaks": {"4": [39 * GIB]}}).encode())
    assert not _decide(local_storage, 4).learned
    _record(local_storage, [30 * GIB], 4, 4)
    data = json.loads(local_storage.get_bytes(stats_key("flash-attn", "flash-attn", "13.0")))
    assert data == {"version": 3, "recipe": "flash-attn", "project": "flash-attn",
                    "cuda": "13.0", "job_peaks": {"4": [30 * GIB]}}


def test_damaged_stats_fall_back_to_the_recipe(storage: Storage) -> None:
    storage.put_bytes(stats_key("generic", "demo", "12.8"), b"{not json")
    decision = decide(storage, recipe="generic", project="demo", cuda="12.8",
                      recipe_per_thread=2 * GIB, nvcc_threads=1, archs=2, available=20 * GIB,
                      total=24 * GIB, cores=64)
    assert not decision.learned and decision.per_thread_bytes == 2 * GIB
    assert record_peaks(storage, "generic", "demo", "12.8", [], 1, archs=2,
                        recipe_per_thread=2 * GIB) is None
    assert record_peaks(storage, "generic", "demo", "12.8", [GIB], 1, archs=2,
                        recipe_per_thread=2 * GIB) == GIB


def test_without_storage_the_recipe_decides() -> None:
    decision = decide(None, recipe="generic", project="demo", cuda="12.8",
                      recipe_per_thread=2 * GIB, nvcc_threads=1, archs=2, available=20 * GIB,
                      total=24 * GIB, cores=64)
    assert not decision.learned and decision.effective_threads == 1
