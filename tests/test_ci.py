"""``.ci/test``, the README's test command, is safe on a user's machine: the project and its
tools go into a virtual environment, and lint, types and tests run from there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _installed_from(python: str, cwd: Path) -> str | None:
    """Where ``python``'s ``wheelhouse`` distribution was installed from (its direct URL)."""
    code = ("import importlib.metadata as m\n"
            "try:\n    print(m.distribution('wheelhouse').read_text('direct_url.json') or '')\n"
            "except m.PackageNotFoundError:\n    print('')\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd,
                         env={"PATH": os.environ.get("PATH", "")}, check=True).stdout.strip()
    return str(json.loads(out).get("url")) if out else None


@pytest.mark.slow
def test_ci_test_installs_into_its_venv_and_runs_from_it(tmp_path: Path) -> None:
    git, uv = shutil.which("git"), shutil.which("uv")
    if git is None or uv is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout, git and uv")
    clone = tmp_path / "clone"
    subprocess.run([git, "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)],
                   check=True, capture_output=True)
    # The venv exists already (made quickly with uv from the same requirements), so what is
    # timed here is .ci/test's own work: its install, ruff, mypy and pytest.
    venv = tmp_path / "ci-venv"
    subprocess.run([uv, "venv", "-q", "--seed", "--python", sys.executable, str(venv)],
                   check=True)
    subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                    "-e", f"{clone}[test]"], check=True)
    if (ROOT / ".mypy_cache").is_dir():  # a warm cache; mypy re-checks whatever changed
        shutil.copytree(ROOT / ".mypy_cache", clone / ".mypy_cache")
    python3 = shutil.which("python3")
    assert python3 is not None
    before = _installed_from(python3, tmp_path)

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("WHEELHOUSE_") and k != "VIRTUAL_ENV"}
    env["WHEELHOUSE_CI_VENV"] = str(venv)
    done = subprocess.run([str(clone / ".ci" / "test"), "-q", "tests/test_imports.py"],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "All checks passed!" in done.stdout  # ruff
    assert "Success: no issues found" in done.stdout  # mypy, strict
    assert " passed" in done.stdout  # pytest
    # The project went into the venv, editable from the clone; not into the Python on PATH.
    assert _installed_from(str(venv / "bin" / "python"), tmp_path) == f"file://{clone}"
    assert _installed_from(python3, tmp_path) == before
    assert str(clone) not in (before or "")
