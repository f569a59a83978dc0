"""RAM-aware MAX_JOBS: as many compile jobs as fit in (available memory - reserve).

flash-attn's own heuristic leaves no headroom (42 jobs on an 880 GB host, then a hard reboot).
Here each job is charged ``per-thread memory x NVCC_THREADS``; the per-thread figure starts from
the recipe and is then learned from the measured peaks of earlier builds of the same recipe and
CUDA version, kept in storage under ``stats/<recipe>-cu<XYZ>.json``. The decision carries its
reason, which goes into the build record.
"""

from __future__ import annotations

import json

from wheelhouse import layout
from wheelhouse.buildfacts import MaxJobs
from wheelhouse.storage import Storage

GIB = 1024**3
BIG_HOST_RESERVE = 8 * GIB
RESERVE_FRACTION = 0.15
SMALL_HOST_FRACTION = 0.25
MIN_RESERVE = 1 * GIB
#: Learned figures are the highest recent peak times this margin.
LEARNED_MARGIN = 1.2
#: How many recent builds the learned figure remembers.
LEARNED_SAMPLES = 10


def reserve_bytes(total: int) -> int:
    """Memory kept free for the host: max(8 GiB, 15 %) on big hosts.

    8 GiB would be a third of a 24 GiB box, so on small hosts the fixed part is capped at a
    quarter of the memory (never below 1 GiB): 24 GiB keeps 6 GiB, 64 GiB keeps 9.6 GiB,
    880 GiB keeps 132 GiB.
    """
    fixed = min(BIG_HOST_RESERVE, int(total * SMALL_HOST_FRACTION))
    return max(int(total * RESERVE_FRACTION), fixed, MIN_RESERVE)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def choose_max_jobs(
    *,
    available: int,
    total: int,
    cores: int,
    per_thread_bytes: int,
    nvcc_threads: int = 1,
    reserve: int | None = None,
    learned: bool = False,
) -> MaxJobs:
    """floor((available - reserve) / (per-thread x threads)), clamped to [1, cores]."""
    cores = max(1, cores)
    nvcc_threads = max(1, nvcc_threads)
    keep = reserve_bytes(total) if reserve is None else reserve
    per_job = max(1, per_thread_bytes) * nvcc_threads
    usable = max(0, available - keep)
    fit = usable // per_job
    jobs = int(min(max(fit, 1), cores))
    source = "learned from earlier builds" if learned else "from the recipe"
    why = (f"{_gib(available)} available - {_gib(keep)} reserve = {_gib(usable)}; "
           f"each job needs {_gib(per_job)} ({_gib(per_thread_bytes)} {source} x "
           f"{nvcc_threads} nvcc thread{'s' if nvcc_threads != 1 else ''}), so {fit} fit")
    if fit < 1:
        why += "; running 1 job anyway (the memory governor pauses it if memory runs short)"
    elif fit > cores:
        why += f"; capped at {cores} cores"
    return MaxJobs(jobs=jobs, reason=f"MAX_JOBS={jobs}: {why}", per_thread_bytes=per_thread_bytes,
                   nvcc_threads=nvcc_threads, available_bytes=available, reserve_bytes=keep,
                   cores=cores, learned=learned)


def stats_key(recipe: str, cuda: str) -> str:
    return layout.stats_key(recipe, cuda)


def learned_per_thread(storage: Storage, recipe: str, cuda: str) -> int | None:
    """The learned per-thread peak for this recipe and CUDA, or None before the first build."""
    try:
        data = json.loads(storage.get_bytes(stats_key(recipe, cuda)))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a damaged stats file only costs us the learned figure
    samples = [s for s in data.get("per_thread_peaks", []) if isinstance(s, int) and s > 0]
    if not samples:
        return None
    return int(max(samples) * LEARNED_MARGIN)


def record_peaks(
    storage: Storage, recipe: str, cuda: str, job_peaks: list[int], nvcc_threads: int
) -> int | None:
    """Remember the highest compile-job peak of a build; return the per-thread figure stored.

    Only the last :data:`LEARNED_SAMPLES` builds count, so a toolkit upgrade that changes the
    memory profile is picked up. Concurrent builds may drop each other's sample (last writer
    wins), which is harmless for an estimate.
    """
    peaks = [p for p in job_peaks if p > 0]
    if not peaks:
        return None
    per_thread = max(peaks) // max(1, nvcc_threads)
    key = stats_key(recipe, cuda)
    try:
        data = json.loads(storage.get_bytes(key))
        samples = [s for s in data.get("per_thread_peaks", []) if isinstance(s, int)]
    except (FileNotFoundError, ValueError):
        samples = []
    samples = [*samples, per_thread][-LEARNED_SAMPLES:]
    storage.put_bytes(key, json.dumps({"recipe": recipe, "cuda": cuda,
                                       "per_thread_peaks": samples}).encode())
    return per_thread


def decide(
    storage: Storage | None,
    *,
    recipe: str,
    cuda: str,
    recipe_per_thread: int,
    nvcc_threads: int,
    available: int,
    total: int,
    cores: int,
    reserve: int | None = None,
) -> MaxJobs:
    """Choose MAX_JOBS, preferring the learned per-thread figure over the recipe's."""
    learned = learned_per_thread(storage, recipe, cuda) if storage is not None else None
    return choose_max_jobs(
        available=available, total=total, cores=cores,
        per_thread_bytes=learned if learned is not None else recipe_per_thread,
        nvcc_threads=nvcc_threads, reserve=reserve, learned=learned is not None,
    )
