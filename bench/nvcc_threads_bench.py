"""nvcc --threads bench: does a compile job's memory follow NVCC_THREADS, or its device targets?

One templated kernel file (tests/fixtures/cudaext's ``add``, instantiated 24 times so that a
compile is heavy enough to measure) is compiled once per case, each as the single job of a
``build.ninja`` run through ``worker.supervision.reaper.BuildProcess``, and the job's whole process
tree
(nvcc, cicc, ptxas, fatbinary...) is sampled ten times a second by a ``MemoryGovernor`` that
never pauses, as bench/build_bench.py and the worker measure job peaks. Cases:

  1 arch, --threads 3           sm_80
  3 archs, --threads 3          sm_80, sm_90, sm_120
  3 archs, --threads 1
  1 arch + PTX, --threads 2     sm_90 and compute_90 (does a PTX target take a thread?)

For each: the job's peak against what ``wheelhouse.builds.maxjobs`` charges once that peak is
learned
(peak x margin, for its effective threads = min(--threads, targets)), and the MAX_JOBS that
charge gives on a 128-core, 512 GiB host (with how many would fit before the cap at the cores).
Then the cross case the old model got wrong: a figure learned from the 1-arch build charging the
3-arch build, old model (per-thread = peak / NVCC_THREADS) against the new one (the recipe's
figure, here the 3-arch --threads 1 peak, as recipes measure one thread).

    python bench/nvcc_threads_bench.py [--repeat 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from wheelhouse.builds.maxjobs import (
    GIB,
    LEARNED_MARGIN,
    decide,
    effective_threads,
    record_peaks,
    reserve_bytes,
)
from wheelhouse.index.storage import LocalStorage
from worker.supervision.governor import MemoryGovernor
from worker.supervision.reaper import BuildProcess

MiB = 1 << 20
NEVER = -(1 << 62)
HOST_MEMORY = 512 * GIB
HOST_CORES = 128

KERNEL = """\
// Generated from tests/fixtures/cudaext/csrc/add.cu by bench/nvcc_threads_bench.py
#include <cstdint>
#include <cuda_runtime.h>

template <int N, int M>
__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) acc += a[(i + k * M) % n] * b[(i + k) % n];
  if (i < n) out[i] = acc;
}
"""


@dataclass(frozen=True)
class Case:
    name: str
    gencode: tuple[str, ...]
    """One ``-gencode`` value per device target."""
    threads: int

    @property
    def targets(self) -> int:
        return len(self.gencode)

    @property
    def effective(self) -> int:
        return effective_threads(self.threads, self.targets)


SASS = {a: f"arch=compute_{a},code=sm_{a}" for a in ("80", "90", "120")}
CASES = (
    Case("1 arch, --threads 3", (SASS["80"],), 3),
    Case("3 archs, --threads 3", (SASS["80"], SASS["90"], SASS["120"]), 3),
    Case("3 archs, --threads 1", (SASS["80"], SASS["90"], SASS["120"]), 1),
    Case("1 arch + PTX, --threads 2", (SASS["90"], "arch=compute_90,code=compute_90"), 2),
)


@dataclass
class Measured:
    case: str
    targets: int
    threads: int
    effective_threads: int
    seconds: float
    peak_job_mib: float
    peak_per_effective_thread_mib: float
    charge_mib: float
    max_jobs: int
    fit: int


def write_kernel(root: Path) -> Path:
    lines = [f"template __global__ void add_kernel<{n}, {m}>"
             "(const float*, const float*, float*, int64_t);"
             for n in (64, 96, 128, 160, 192, 256) for m in (1, 2, 3, 4)]
    path = root / "k.cu"
    path.write_text(KERNEL + "\n".join(lines) + "\n")
    return path


def compile_once(root: Path, case: Case, run: int) -> tuple[int, float]:
    """The job's peak (bytes) and its wall seconds."""
    nvcc = shutil.which("nvcc") or "/usr/local/bin/nvcc"
    gencode = " ".join(f"-gencode {g}" for g in case.gencode)
    (root / "build.ninja").write_text(
        f"rule nvcc\n  command = {nvcc} -c $in -o $out -O2 {gencode} --threads {case.threads}\n"
        "build k.o: nvcc k.cu\n")
    (root / "k.o").unlink(missing_ok=True)
    build = BuildProcess.start(["ninja", "-j", "1"], build_id=f"nvcc-threads-{os.getpid()}-{run}",
                               env=dict(os.environ), cwd=root, log_path=root / "build.log")
    governor = MemoryGovernor(build, low_watermark=NEVER, high_watermark=NEVER)
    start = time.monotonic()
    outcome = build.wait(deadline=start + 3600, on_tick=governor.tick, tick=0.1)
    seconds = time.monotonic() - start
    if outcome.returncode != 0 or not governor.compile_peaks:
        raise SystemExit(f"{case.name}: nvcc failed ({outcome.returncode}); see "
                         f"{(root / 'build.log').read_text()[-2000:]}")
    return max(governor.compile_peaks), seconds


def charge(peak: int, case: Case, root: Path, *, recipe_per_thread: int) -> tuple[int, int, int]:
    """(per-job charge, MAX_JOBS, jobs that fit) on the big host, once ``peak`` is learned."""
    storage = LocalStorage(root / f"stats-{case.threads}-{case.targets}")
    record_peaks(storage, "bench", "bench", "13.0", [peak], case.threads, archs=case.targets,
                 recipe_per_thread=recipe_per_thread)
    decision = decide(storage, recipe="bench", project="bench", cuda="13.0",
                      recipe_per_thread=recipe_per_thread,
                      nvcc_threads=case.threads, archs=case.targets, available=HOST_MEMORY,
                      total=HOST_MEMORY, cores=HOST_CORES)
    job = decision.per_thread_bytes * case.effective
    return job, decision.jobs, _fit(job)


def _fit(job: int) -> int:
    return (HOST_MEMORY - reserve_bytes(HOST_MEMORY)) // max(1, job)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="compiles per case (highest peak)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("ninja") is None or shutil.which("nvcc") is None:
        print("needs ninja and nvcc on PATH", file=sys.stderr)
        return 2
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="nvcc-threads-bench-") as tmp:
        root = Path(tmp)
        write_kernel(root)
        peaks: dict[str, tuple[int, float]] = {}
        for case in CASES:
            runs = [compile_once(root, case, i) for i in range(args.repeat)]
            peaks[case.name] = max(r[0] for r in runs), max(r[1] for r in runs)
            print(f"{case.name}: peak {peaks[case.name][0] / MiB:.0f} MiB, "
                  f"{peaks[case.name][1]:.0f} s", file=sys.stderr, flush=True)
        one_thread = peaks["3 archs, --threads 1"][0]  # the recipe's figure: one thread measured
        results: list[Measured] = []
        for case in CASES:
            peak, seconds = peaks[case.name]
            job, jobs, fit = charge(peak, case, root, recipe_per_thread=one_thread)
            results.append(Measured(
                case=case.name, targets=case.targets, threads=case.threads,
                effective_threads=case.effective, seconds=round(seconds, 1),
                peak_job_mib=round(peak / MiB, 1),
                peak_per_effective_thread_mib=round(peak / case.effective / MiB, 1),
                charge_mib=round(job / MiB, 1), max_jobs=jobs, fit=fit))
        # Learned from the 1-arch build, charging the 3-arch --threads 3 build.
        single, multi = peaks["1 arch, --threads 3"][0], peaks["3 archs, --threads 3"][0]
        old_job = int(single // 3 * LEARNED_MARGIN) * 3  # the old per-thread x NVCC_THREADS
        storage = LocalStorage(root / "cross")
        record_peaks(storage, "bench", "bench", "13.0", [single], 3, archs=1,
                     recipe_per_thread=one_thread)
        new = decide(storage, recipe="bench", project="bench", cuda="13.0",
                     recipe_per_thread=one_thread,
                     nvcc_threads=3, archs=3, available=HOST_MEMORY, total=HOST_MEMORY,
                     cores=HOST_CORES)
        new_job = new.per_thread_bytes * 3
    after = os.getloadavg()
    print(f"nvcc 13.0, {os.cpu_count()} cores; load average before {load[0]:.2f}, "
          f"after {after[0]:.2f}; host for MAX_JOBS: {HOST_CORES} cores, "
          f"{HOST_MEMORY // GIB} GiB (reserve {reserve_bytes(HOST_MEMORY) / GIB:.1f} GiB)")
    print(f"{'case':28} {'targets':>7} {'eff.thr':>7} {'seconds':>7} {'peak MiB':>8} "
          f"{'MiB/thr':>7} {'charge MiB':>10} {'MAX_JOBS':>8} {'fit':>5}")
    for r in results:
        print(f"{r.case:28} {r.targets:>7} {r.effective_threads:>7} {r.seconds:>7.0f} "
              f"{r.peak_job_mib:>8.0f} {r.peak_per_effective_thread_mib:>7.0f} "
              f"{r.charge_mib:>10.0f} {r.max_jobs:>8} {r.fit:>5}")
    print(f"learned from '1 arch, --threads 3', charging '3 archs, --threads 3' "
          f"(real peak {multi / MiB:.0f} MiB):")
    print(f"  old model (peak / NVCC_THREADS per thread): {old_job / MiB:.0f} MiB per job, "
          f"{_fit(old_job)} fit")
    print(f"  new model ({new.reason.split('(')[1].split(')')[0]}): {new_job / MiB:.0f} MiB per "
          f"job, {_fit(new_job)} fit")
    if args.json:
        args.json.write_text(json.dumps({
            "load_before": load[0], "load_after": after[0],
            "cases": [asdict(r) for r in results],
            "cross": {"real_peak_mib": multi / MiB, "old_charge_mib": old_job / MiB,
                      "new_charge_mib": new_job / MiB}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
