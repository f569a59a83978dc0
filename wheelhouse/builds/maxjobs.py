"""RAM-aware MAX_JOBS: as many compile jobs as fit in (available memory - reserve).

flash-attn's own heuristic leaves no headroom (42 jobs on an 880 GB host, then a hard reboot).
Here each job is charged ``per-thread memory x effective nvcc threads``. nvcc's ``--threads`` only
runs the per-target steps in parallel (a target is a ``-gencode`` pair, PTX included), so a job's
effective threads are ``min(NVCC_THREADS, device targets)``: a job compiling for one architecture
peaks at about one thread's memory whatever ``--threads`` says (docs/maxjobs.md has the figures).
The figure starts from the recipe and is then learned from the measured peaks of earlier builds
of the same project, recipe, CUDA version and effective thread count, kept in storage under
``stats/<recipe>/<project>-cu<XYZ>.json``: one project's builds (a generic recipe serves many)
never move another's figure. What a build can teach is bounded by the recipe's own figure: a
learned charge is never below it (a small build does not make the next one over-commit) and
never above :data:`MAX_LEARNED_FACTOR` times it (a build that parks a big process does not
starve its project's later builds). The decision carries its reason, which goes into the build
record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from wheelhouse.builds.facts import MaxJobs
from wheelhouse.index import layout
from wheelhouse.index.storage import Storage

GIB = 1024**3
BIG_HOST_RESERVE = 8 * GIB
RESERVE_FRACTION = 0.15
SMALL_HOST_FRACTION = 0.25
MIN_RESERVE = 1 * GIB
#: Learned figures are the highest recent peak times this margin.
LEARNED_MARGIN = 1.2
#: How many recent builds the learned figure remembers, per effective thread count.
LEARNED_SAMPLES = 10
#: The most a learned charge may be, in times the recipe's figure (and what a sample is
#: clamped to when it is recorded).
MAX_LEARNED_FACTOR = 2
#: The stats file's format: job peaks per effective thread count, per project (2: per recipe;
#: 1: per-thread figures). Older files lie under other keys and are never read.
STATS_VERSION = 3


def reserve_bytes(total: int) -> int:
    """Memory kept free for the host: max(8 GiB, 15 %) on big hosts.

    8 GiB would be a third of a 24 GiB box, so on small hosts the fixed part is capped at a
    quarter of the memory (never below 1 GiB): 24 GiB keeps 6 GiB, 64 GiB keeps 9.6 GiB,
    880 GiB keeps 132 GiB.
    """
    fixed = min(BIG_HOST_RESERVE, int(total * SMALL_HOST_FRACTION))
    return max(int(total * RESERVE_FRACTION), fixed, MIN_RESERVE)


def effective_threads(nvcc_threads: int, archs: int) -> int:
    """The threads one compile job really runs: nvcc gives each device target at most one."""
    return max(1, min(nvcc_threads, archs))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def choose_max_jobs(
    *,
    available: int,
    total: int,
    cores: int,
    per_thread_bytes: int,
    archs: int,
    nvcc_threads: int = 1,
    reserve: int | None = None,
    learned: bool = False,
    source: str | None = None,
) -> MaxJobs:
    """floor((available - reserve) / (per-thread x effective threads)), clamped to [1, cores].

    ``archs`` is the number of device targets each compile job compiles; ``source`` says where
    the per-thread figure came from (default: the recipe, or earlier builds when ``learned``).
    """
    cores = max(1, cores)
    nvcc_threads = max(1, nvcc_threads)
    archs = max(1, archs)
    threads = effective_threads(nvcc_threads, archs)
    keep = reserve_bytes(total) if reserve is None else reserve
    per_job = max(1, per_thread_bytes) * threads
    usable = max(0, available - keep)
    fit = usable // per_job
    jobs = int(min(max(fit, 1), cores))
    source = source or ("learned from earlier builds" if learned else "from the recipe")
    why = (f"{_gib(available)} available - {_gib(keep)} reserve = {_gib(usable)}; "
           f"each job needs {_gib(per_job)} ({_gib(per_thread_bytes)} per thread {source} x "
           f"{_plural(threads, 'nvcc thread')}: {_plural(archs, 'device target')}, "
           f"NVCC_THREADS={nvcc_threads}), so {fit} fit")
    if fit < 1:
        why += "; running 1 job anyway (the memory governor pauses it if memory runs short)"
    elif fit > cores:
        why += f"; capped at {cores} cores"
    return MaxJobs(jobs=jobs, reason=f"MAX_JOBS={jobs}: {why}", per_thread_bytes=per_thread_bytes,
                   nvcc_threads=nvcc_threads, available_bytes=available, reserve_bytes=keep,
                   cores=cores, learned=learned, targets=archs, effective_threads=threads)


def stats_key(recipe: str, project: str, cuda: str) -> str:
    return layout.stats_key(recipe, project, cuda)


def _read_stats(storage: Storage, key: str) -> dict[str, Any]:
    try:
        data = json.loads(storage.get_bytes(key))
    except (FileNotFoundError, ValueError):
        return {}  # none yet, or damaged: that only costs us the learned figures
    return data if isinstance(data, dict) else {}


def _peaks(value: object) -> list[int]:
    if not isinstance(value, list):
        return []
    return [s for s in value if isinstance(s, int) and not isinstance(s, bool) and s > 0]


def _samples(data: dict[str, Any]) -> dict[int, list[int]]:
    """Job peaks by effective thread count."""
    out: dict[int, list[int]] = {}
    by_threads = data.get("job_peaks")
    if isinstance(by_threads, dict):
        for count, peaks in by_threads.items():
            if isinstance(count, str) and count.isdigit() and int(count) > 0 and _peaks(peaks):
                out[int(count)] = _peaks(peaks)[-LEARNED_SAMPLES:]
    return out


def learned_job_peaks(storage: Storage, recipe: str, project: str,
                      cuda: str) -> dict[int, list[int]]:
    """The recent job peaks of this project, recipe and CUDA, by effective thread count
    (``{1: [...]}``)."""
    return _samples(_read_stats(storage, stats_key(recipe, project, cuda)))


@dataclass(frozen=True)
class _Charge:
    job_bytes: int
    source: str
    learned: bool


def _charge(samples: dict[int, list[int]], threads: int, recipe_per_thread: int) -> _Charge:
    """What one job of ``threads`` effective threads is charged.

    What was measured at that count, else the recipe's figure times the threads; raised, either
    way, to what jobs with fewer threads were measured at (more threads never need less). A
    figure measured with more threads is never used: it says nothing of what fewer threads need
    beyond an upper bound, and nothing at all of what more need. Then bounded by the recipe's
    figure: never below it, never above :data:`MAX_LEARNED_FACTOR` times it.
    """
    recipe = recipe_per_thread * threads
    exact = max(samples.get(threads, []), default=0)
    fewer = max((p for count, peaks in samples.items() if count < threads for p in peaks),
                default=0)
    learned = max(int(exact * LEARNED_MARGIN), int(fewer * LEARNED_MARGIN))
    if learned <= recipe:
        return _Charge(recipe, "from the recipe", learned=False)
    if learned > recipe * MAX_LEARNED_FACTOR:
        return _Charge(recipe * MAX_LEARNED_FACTOR,
                       f"learned from earlier builds, capped at {MAX_LEARNED_FACTOR}x the "
                       "recipe's", learned=True)
    if int(exact * LEARNED_MARGIN) >= int(fewer * LEARNED_MARGIN):
        return _Charge(learned,
                       f"learned from earlier builds with {_plural(threads, 'nvcc thread')}",
                       learned=True)
    return _Charge(learned, "raised to the peak of earlier builds with fewer threads",
                   learned=True)


def learned_per_thread(storage: Storage, recipe: str, project: str, cuda: str, *,
                       nvcc_threads: int, archs: int, recipe_per_thread: int) -> int | None:
    """The learned per-thread figure for jobs with ``archs`` targets, or None where nothing
    learned applies (the recipe's figure stands)."""
    threads = effective_threads(nvcc_threads, archs)
    charge = _charge(learned_job_peaks(storage, recipe, project, cuda), threads,
                     recipe_per_thread)
    return charge.job_bytes // threads if charge.learned else None


def record_peaks(
    storage: Storage, recipe: str, project: str, cuda: str, job_peaks: list[int],
    nvcc_threads: int, *, archs: int, recipe_per_thread: int,
) -> int | None:
    """Remember the highest compile-job peak of a build under its project and effective thread
    count; return its per-thread figure.

    The sample is clamped to :data:`MAX_LEARNED_FACTOR` times the recipe's figure, so one
    build cannot push a figure further than a charge may go. Only the last
    :data:`LEARNED_SAMPLES` builds of each count count, so a toolkit upgrade that changes the
    memory profile is picked up. Concurrent builds may drop each other's sample (last writer
    wins), which is harmless for an estimate.
    """
    peaks = [p for p in job_peaks if p > 0]
    if not peaks:
        return None
    threads = effective_threads(nvcc_threads, archs)
    sample = min(max(peaks), max(1, recipe_per_thread) * threads * MAX_LEARNED_FACTOR)
    key = stats_key(recipe, project, cuda)
    samples = _samples(_read_stats(storage, key))
    samples[threads] = [*samples.get(threads, []), sample][-LEARNED_SAMPLES:]
    storage.put_bytes(key, json.dumps({
        "version": STATS_VERSION, "recipe": recipe, "project": project, "cuda": cuda,
        "job_peaks": {str(count): samples[count] for count in sorted(samples)},
    }).encode())
    return sample // threads


def decide(
    storage: Storage | None,
    *,
    recipe: str,
    project: str,
    cuda: str,
    recipe_per_thread: int,
    nvcc_threads: int,
    archs: int,
    available: int,
    total: int,
    cores: int,
    reserve: int | None = None,
) -> MaxJobs:
    """Choose MAX_JOBS for jobs of ``archs`` device targets, preferring what earlier builds of
    ``project`` with as many effective threads measured over the recipe's figure, within the
    bounds of :func:`_charge`."""
    threads = effective_threads(nvcc_threads, archs)
    samples = (learned_job_peaks(storage, recipe, project, cuda)
               if storage is not None else {})
    charge = _charge(samples, threads, recipe_per_thread)
    return choose_max_jobs(
        available=available, total=total, cores=cores,
        per_thread_bytes=charge.job_bytes // threads, nvcc_threads=nvcc_threads, archs=archs,
        reserve=reserve, learned=charge.learned, source=charge.source,
    )
