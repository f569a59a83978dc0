"""End-to-end fixtures: a published catalog, a second index acting as the upstream."""

from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.helpers import (
    QuietHandler,
    clean_env,
    free_port,
    make_venv,
    make_wheel,
    serve_http,
    wait_for_port,
)
from tests.worker.conftest import CUDAEXT, TORCH_FIND_LINKS, make_sdist


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


def _upstream_handler(sdist: Path) -> type[BaseHTTPRequestHandler]:
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()

    class Handler(QuietHandler):
        """A PEP 691 upstream index with one project: the fixture extension's sdist."""

        def do_GET(self) -> None:
            if self.path == f"/files/{sdist.name}":
                self.send_body(sdist.read_bytes(), "application/gzip")
            elif self.path.rstrip("/") == "/simple/cudaext":
                page = {"meta": {"api-version": "1.1"}, "name": "cudaext", "versions": ["0.1.0"],
                        "files": [{"filename": sdist.name, "url": f"/files/{sdist.name}",
                                   "hashes": {"sha256": sha}}]}
                self.send_body(json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json")
            else:
                self.send_error(404)


    return Handler


@pytest.fixture
def cudaext_sdist(tmp_path: Path) -> Path:
    """The fixture CUDA extension as an sdist, as a worker would get it."""
    return make_sdist(CUDAEXT, tmp_path / "sdist", "cudaext", "0.1.0")


@pytest.fixture
def cudaext_upstream(tmp_path: Path) -> Iterator[str]:
    """A PEP 691 upstream index on a real HTTP server, serving the fixture extension's sdist."""
    sdist = make_sdist(CUDAEXT, tmp_path / "sdist", "cudaext", "0.1.0")
    with serve_http(_upstream_handler(sdist)) as url:
        yield f"{url}/simple/"


@pytest.fixture(scope="session")
def torch_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch 2.14.1 (CUDA 13.0) installed once per test run, by uv, into a venv of its own;
    the site-packages directory that holds it. Tests never install into it: see
    :func:`venv_with_torch`."""
    venv = tmp_path_factory.mktemp("torch-env") / "venv"
    python = make_venv(venv)
    uv = shutil.which("uv") or "uv"
    subprocess.run([uv, "pip", "install", "-q", "--python", str(python), "--index-url",
                    "https://pypi.org/simple", "--find-links", TORCH_FIND_LINKS,
                    "torch==2.14.1"], env=clean_env(), check=True)
    return _site_packages(python)


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def venv_with_torch(path: Path, torch_site: Path) -> Path:
    """A fresh venv (its python) that sees the shared torch through a ``.pth`` file: what the
    test installs goes into the venv itself, and the torch installation is never changed."""
    python = make_venv(path)
    (_site_packages(python) / "wheelhouse_tests_torch.pth").write_text(f"{torch_site}\n")
    return python
