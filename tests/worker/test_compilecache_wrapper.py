"""The compile's wrapper is a real module: what a build runs is its source, byte for byte, and
that source runs in any build Python from 3.9, isolated (standard library only)."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from worker import compilecache_wrapper
from worker.compilecache import WRAPPER, CompileCache, DiskBackend

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(compilecache_wrapper.__file__)


def test_a_build_runs_the_module_as_written(tmp_path: Path) -> None:
    cache = CompileCache(Path("/opt/sccache"), DiskBackend(tmp_path / "cache"), "demo/cu130",
                         tmp_path / "run")
    argv = cache.wrap("/venv/bin/python", ["true"], nvcc=None)
    assert argv[:3] == ["/venv/bin/python", "-I", "-c"]
    assert argv[3].encode() == WRAPPER.encode() == SOURCE.read_bytes()


def test_it_imports_the_standard_library_only() -> None:
    tree = ast.parse(SOURCE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            imported.add(node.module.split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_it_is_python_3_9() -> None:
    ast.parse(SOURCE.read_text(), feature_version=(3, 9))
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["per-file-target-version"]["worker/compilecache_wrapper.py"] == "py39"
