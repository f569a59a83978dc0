"""RAM-aware MAX_JOBS: the reserve rule, the clamp, and per-job memory learned across builds."""

from __future__ import annotations

import pytest

from wheelhouse.maxjobs import (
    GIB,
    choose_max_jobs,
    decide,
    learned_per_thread,
    record_peaks,
    reserve_bytes,
    stats_key,
)
from wheelhouse.storage import Storage


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


@pytest.mark.parametrize(
    ("available", "total", "cores", "per_thread", "threads", "jobs"),
    [
        # The host of flash-attn issue #2493: its own heuristic picked 42 jobs, then rebooted.
        (860, 880, 96, 5.0, 4, 36),
        (22, 24, 2, 5.0, 4, 1),  # nothing fits: one job, the governor guards it
        (22, 24, 2, 1.0, 1, 2),  # 16 fit, capped at the cores
        (100, 128, 64, 2.0, 1, 40),  # (100 - 19.2) / 2 = 40
        (5, 128, 64, 2.0, 1, 1),  # available below the reserve
    ],
)
def test_choose(available: float, total: float, cores: int, per_thread: float, threads: int,
                jobs: int) -> None:
    decision = choose_max_jobs(available=int(available * GIB), total=int(total * GIB),
                               cores=cores, per_thread_bytes=int(per_thread * GIB),
                               nvcc_threads=threads)
    assert decision.jobs == jobs
    assert decision.reason.startswith(f"MAX_JOBS={jobs}: ")
    assert "reserve" in decision.reason and "from the recipe" in decision.reason
    # The promise behind the number: the chosen jobs fit beside the reserve, unless only one runs.
    if jobs > 1:
        used = jobs * per_thread * threads * GIB
        assert used + decision.reserve_bytes <= available * GIB


def test_reason_says_why_when_clamped() -> None:
    assert "capped at 2 cores" in choose_max_jobs(
        available=22 * GIB, total=24 * GIB, cores=2, per_thread_bytes=GIB).reason
    assert "running 1 job anyway" in choose_max_jobs(
        available=8 * GIB, total=24 * GIB, cores=2, per_thread_bytes=5 * GIB,
        nvcc_threads=4).reason


def test_learned_figure_replaces_the_recipe_and_tracks_recent_builds(storage: Storage) -> None:
    assert learned_per_thread(storage, "flash-attn", "13.0") is None
    before = decide(storage, recipe="flash-attn", cuda="13.0", recipe_per_thread=5 * GIB,
                    nvcc_threads=4, available=860 * GIB, total=880 * GIB, cores=96)
    assert not before.learned and before.jobs == 36

    # Builds measured 6 GiB per compile job at 2 nvcc threads: 3 GiB per thread, +20 % margin.
    assert record_peaks(storage, "flash-attn", "13.0", [2 * GIB, 6 * GIB, 5 * GIB], 2) == 3 * GIB
    assert learned_per_thread(storage, "flash-attn", "13.0") == int(3.6 * GIB)
    after = decide(storage, recipe="flash-attn", cuda="13.0", recipe_per_thread=5 * GIB,
                   nvcc_threads=4, available=860 * GIB, total=880 * GIB, cores=96)
    assert after.learned and "learned from earlier builds" in after.reason
    assert after.jobs == int((860 - 132) / (3.6 * 4))

    # Per recipe and CUDA version; other CUDA versions keep their own figure.
    assert learned_per_thread(storage, "flash-attn", "12.8") is None
    assert storage.exists(stats_key("flash-attn", "13.0"))

    # Only the recent builds count: after ten smaller builds the old peak is forgotten.
    for _ in range(10):
        record_peaks(storage, "flash-attn", "13.0", [GIB], 1)
    assert learned_per_thread(storage, "flash-attn", "13.0") == int(1.2 * GIB)


def test_damaged_stats_fall_back_to_the_recipe(storage: Storage) -> None:
    storage.put_bytes(stats_key("generic", "12.8"), b"{not json")
    decision = decide(storage, recipe="generic", cuda="12.8", recipe_per_thread=2 * GIB,
                      nvcc_threads=1, available=20 * GIB, total=24 * GIB, cores=64)
    assert not decision.learned and decision.per_thread_bytes == 2 * GIB
    assert record_peaks(storage, "generic", "12.8", [], 1) is None
    assert record_peaks(storage, "generic", "12.8", [GIB], 1) == GIB
