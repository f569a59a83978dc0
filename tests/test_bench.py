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
