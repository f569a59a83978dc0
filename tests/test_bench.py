"""The benches run (their ``--help`` at least, from a clean interpreter) and start and stop
processes through the tests' helpers instead of keeping copies of their own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
BENCHES = sorted(p for p in BENCH.glob("*.py"))


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.stem)
def test_a_bench_starts_and_explains_itself(bench: Path) -> None:
    done = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.stem)
def test_a_bench_stops_processes_with_the_tests_helpers(bench: Path) -> None:
    tree = ast.parse(bench.read_text())
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert not own & {"free_port", "_free_port", "wait_for_port", "_wait_port", "stop_group"}
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert "os.killpg" not in calls, "stop process groups with tests.helpers.stop_group"


KERNEL = ("__global__ void add(float* a, const float* b, int n) {\n"
          "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) a[i] += b[i];\n}\n")


@pytest.mark.nvcc
def test_the_cold_cache_split_reads_what_a_real_sccache_logs(tmp_path: Path) -> None:
    """One real nvcc compile through the build's wrapper with the server at debug level (as the
    cold-cache benches run it): the split finds the hash keys, the cacheable steps and the
    outer nvcc call; at the builds' level ("warn") the log holds no timings to split."""
    from bench.cold_cache_bench import split
    from worker.capabilities import discover_toolkits
    from worker.compilecache import CompileCache, DiskBackend, find_sccache

    sccache = find_sccache()
    toolkit = next(t for t in discover_toolkits() if t.cuda.startswith("13."))
    (tmp_path / "k.cu").write_text(KERNEL)
    compile_ = '$PYTORCH_NVCC -c k.cu -o k.o -gencode arch=compute_80,code=sm_80'
    assert sccache is not None
    found = {}
    for level in ("debug", "warn"):
        cache = CompileCache(sccache, DiskBackend(tmp_path / f"cache-{level}"), "demo/cu130",
                             tmp_path / f"run-{level}", log_level=level)
        done = subprocess.run(cache.wrap(sys.executable, ["sh", "-c", compile_],
                                         nvcc=Path(toolkit.nvcc)),
                              cwd=tmp_path, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        stats = cache.read_stats()
        assert stats is not None and stats.misses_by_language.get("CUDA") == 1, stats
        found[level] = split(cache.log)
    timings = found["debug"]
    assert {"hash_keys", "steps", "nvcc_calls", "writes"} <= timings.keys(), timings
    # The outer nvcc call runs its steps one after another: it lasts at least as long.
    assert timings["nvcc_calls"] >= timings["steps"] > 0, timings
    assert found["warn"] == {}
