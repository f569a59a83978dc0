"""Build benchmark: automatic MAX_JOBS + memory governor against fixed MAX_JOBS, under a budget.

The build is the test CUDA extension's kernel (tests/fixtures/cudaext's ``add``), replicated into
``--kernels`` translation units with template instantiations; every third one is heavy, as
flash-attn mixes cheap forward and expensive backward kernels. A ``build.ninja`` drives nvcc the
way ``torch.utils.cpp_extension`` does (``ninja -v -j MAX_JOBS``), so each compile runs in its
own process group. Every run goes through ``worker.supervision.reaper.BuildProcess``; the tree's
memory is
sampled ten times a second by a ``MemoryGovernor`` (which only pauses in the governed runs).

Runs, in order:
  0. MAX_JOBS=1, untimed: warms the caches, and is the "earlier build" whose job peaks are
     learned (as the worker learns them per recipe and CUDA).
  1. MAX_JOBS=k for k = 1..cores (k = cores is the naive setting).
  3. automatic MAX_JOBS (wheelhouse.builds.maxjobs.choose_max_jobs on the learned peak) + governor.
  4. MAX_JOBS=cores + governor.
A run fails if the build fails or its peak tree memory exceeds the budget (where the kernel's
OOM killer would strike). Default budget: 1.5 x the peak of the MAX_JOBS=1 run.

    python bench/build_bench.py [--kernels 6] [--budget-mb N] [--arch 80] [--json out.json]
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

from wheelhouse.builds.maxjobs import LEARNED_MARGIN, choose_max_jobs
from worker.supervision.governor import MemoryGovernor
from worker.supervision.reaper import BuildProcess

MiB = 1 << 20
NEVER = -(1 << 62)

KERNEL = """\
// Generated from tests/fixtures/cudaext/csrc/add.cu by bench/build_bench.py
#include <cstdint>
#include <cuda_runtime.h>

template <int N, int M>
__global__ void add_kernel_{i}(const float* a, const float* b, float* out, int64_t n) {{
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) acc += a[(i + k * M) % n] * b[(i + k) % n];
  if (i < n) out[i] = acc;
}}
{instantiations}
"""


def _source(i: int, heavy: bool) -> str:
    sizes = (64, 96, 128, 160) if heavy else (64,)
    lines = [
        f"template __global__ void add_kernel_{i}<{n}, {m}>"
        "(const float*, const float*, float*, int64_t);"
        for n in sizes for m in (1, 2, 3)
    ]
    return KERNEL.format(i=i, instantiations="\n".join(lines))


def write_project(root: Path, kernels: int, arch: str) -> None:
    nvcc = shutil.which("nvcc") or "/usr/local/bin/nvcc"
    lines = [
        f"nvcc = {nvcc}",
        "rule cuda_compile",
        f"  command = $nvcc -c $in -o $out -O2 -gencode arch=compute_{arch},code=sm_{arch}",
        "",
    ]
    for i in range(kernels):
        (root / f"k{i}.cu").write_text(_source(i, heavy=i % 3 == 0))
        lines.append(f"build k{i}.o: cuda_compile k{i}.cu")
    (root / "build.ninja").write_text("\n".join(lines) + "\n")


@dataclass
class Run:
    name: str
    max_jobs: int
    governed: bool
    makespan_s: float
    peak_tree_mb: float
    returncode: int | None
    over_budget: bool
    failed: bool
    pauses: int
    job_peaks_mb: list[float]


def run_build(root: Path, name: str, jobs: int, *, budget: int | None, governed: bool,
              low: int, high: int) -> Run:
    for obj in root.glob("*.o"):
        obj.unlink()
    build = BuildProcess.start(
        ["ninja", "-j", str(jobs)], build_id=f"bench-{os.getpid()}-{name.replace(' ', '_')}",
        env=dict(os.environ), cwd=root, log_path=root / "build.log",
    )
    governor = MemoryGovernor(
        build, budget_bytes=budget,
        low_watermark=low if governed else NEVER, high_watermark=high if governed else NEVER,
    )
    start = time.monotonic()
    outcome = build.wait(deadline=start + 3600, on_tick=governor.tick, tick=0.1)
    makespan = time.monotonic() - start
    over = budget is not None and governor.peak_tree_rss > budget
    run = Run(
        name=name, max_jobs=jobs, governed=governed, makespan_s=round(makespan, 1),
        peak_tree_mb=round(governor.peak_tree_rss / MiB, 1), returncode=outcome.returncode,
        over_budget=over, failed=over or outcome.returncode != 0, pauses=governor.pauses,
        job_peaks_mb=[round(p / MiB, 1) for p in governor.compile_peaks],
    )
    print(json.dumps(asdict(run)), file=sys.stderr, flush=True)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=6)
    parser.add_argument("--budget-mb", type=int, default=0, help="0: 1.5 x the MAX_JOBS=1 peak")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--arch", default="80")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("ninja") is None or shutil.which("nvcc") is None:
        print("needs ninja and nvcc on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="build-bench-") as tmp:
        root = Path(tmp)
        write_project(root, args.kernels, args.arch)
        warm = run_build(root, "learning run", 1, budget=None, governed=False, low=0, high=0)
        learned = int(max(warm.job_peaks_mb) * MiB * LEARNED_MARGIN)
        budget = args.budget_mb * MiB or int(warm.peak_tree_mb * MiB * 1.5)
        # Watermarks as the worker derives them from its reserve: pause at 1/8, resume at 1/4.
        low, high = budget // 8, budget // 4
        runs: list[Run] = []
        for k in range(1, args.cores + 1):
            runs.append(run_build(root, f"MAX_JOBS={k}", k, budget=budget, governed=False,
                                  low=low, high=high))
        auto = choose_max_jobs(available=budget, total=budget, cores=args.cores,
                               per_thread_bytes=learned, archs=1, reserve=0,
                               learned=True)
        runs.append(run_build(root, f"auto MAX_JOBS={auto.jobs} + governor", auto.jobs,
                              budget=budget, governed=True, low=low, high=high))
        runs.append(run_build(root, f"MAX_JOBS={args.cores} + governor", args.cores,
                              budget=budget, governed=True, low=low, high=high))
    fixed_ok = [r for r in runs if not r.governed and not r.failed]
    best = min(fixed_ok, key=lambda r: r.makespan_s) if fixed_ok else None
    print(f"budget {budget / MiB:.0f} MiB, learned per-job peak {learned / MiB:.0f} MiB, "
          f"{args.kernels} kernels, {args.cores} cores; {auto.reason}")
    print(f"{'run':32} {'makespan s':>10} {'peak MiB':>9} {'pauses':>6}  result")
    for r in runs:
        verdict = "FAILED (over budget)" if r.over_budget else (
            "FAILED" if r.failed else "ok")
        if best is not None and not r.failed and r is not best:
            verdict += f", {100 * (r.makespan_s / best.makespan_s - 1):+.0f}% vs best fixed"
        elif r is best:
            verdict += ", best fixed"
        print(f"{r.name:32} {r.makespan_s:>10.1f} {r.peak_tree_mb:>9.0f} {r.pauses:>6}  {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"budget_mb": budget / MiB, "runs": [asdict(r)
                                         for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
