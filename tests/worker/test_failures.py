"""What a failed installer step is: a resolver's "no" is deterministic, never infrastructure."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from wheelhouse.errors import FailureKind
from worker.failures import classify_install


def test_an_unsatisfiable_requirement_is_incompatible_in_one_line(tmp_path: Path) -> None:
    # Real uv, resolving against an empty find-links directory: its own words.
    done = subprocess.run([shutil.which("uv") or "uv", "pip", "install", "--dry-run",
                           "--python", sys.executable, "--no-index", "--find-links",
                           str(tmp_path), "torch==2.88.*"],
                          capture_output=True, text=True, check=False)
    assert done.returncode != 0
    found = classify_install(done.stdout + done.stderr, "installing torch")
    assert found is not None and found.kind is FailureKind.INCOMPATIBLE
    assert "\n" not in found.reason
    assert found.reason.startswith("installing torch: no version satisfies the requirements at "
                                   "the configured indexes (WHEELHOUSE_BUILD_INDEX_URL, ")
    assert "torch==2.88.*" in found.reason


def test_network_trouble_is_left_to_the_retries() -> None:
    log = "error: Failed to fetch: `https://pypi.org/simple/torch/`\n  Caused by: dns error"
    assert classify_install(log, "installing torch") is None
