"""End-to-end fixtures: a published catalog, a second index acting as the upstream."""

from __future__ import annotations

import html
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, make_wheel, wait_for_port


@pytest.fixture
def upstream_index(tmp_path: Path) -> Iterator[str]:
    """A static PEP 503 index on a real HTTP server, hosting ``helperdep`` (the upstream)."""
    root = tmp_path / "upstream"
    project_dir = root / "simple" / "helperdep"
    wheel = make_wheel(project_dir, "helperdep", "1.0", module_body="ANSWER = 42\n")
    (project_dir / "index.html").write_text(
        f'<html><body><a href="{html.escape(wheel.name)}">{html.escape(wheel.name)}</a>'
        "</body></html>"
    )
    (root / "simple" / "index.html").write_text(
        '<html><body><a href="helperdep/">helperdep</a></body></html>'
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}/simple/"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
