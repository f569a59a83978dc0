"""The two multi-process shapes of issue 6, run for real on one machine.

Shape 2 (single GPU box): ``wheelhouse serve --with-worker`` starts a private Redis and a worker
beside the index; a build requested through the API is built and installed with uv; on
shutdown nothing is left. Shape 3 (fleet): Redis, the S3 API server, gunicorn with 4 workers and
two build workers with different capabilities as separate processes; each job lands on a worker
that can build it, and ``/api/workers`` and ``/metrics`` say so.
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
import requests

from tests.e2e.conftest import venv_with_torch
from tests.helpers import (
    build_job,
    clean_env,
    config_env,
    fake_cuda_toolkit,
    free_port,
    run_worker,
    start_index,
    wait_for_port,
)
from tests.worker.conftest import FIXTURE_RECIPES, TORCH_FIND_LINKS
from wheelhouse.config import Config
from wheelhouse.index.tokens import create_token
from wheelhouse.localredis import socket_path

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

REQUEST = {"project": "cudaext", "version": "0.1.0", "torch": "2.14", "cuda": "13.0",
           "python": ["3.11"], "archs": ["sm80"]}
ROOT = "torch2.14-cu130-sm80"
WHEEL = "cudaext-0.1.0+cu130torch2.14.sm80-cp311-cp311-linux_x86_64.whl"


def _config(tmp_path: Path, upstream: str, **kw: Any) -> Config:
    values: dict[str, Any] = dict(
        storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"), upstream=upstream,
        upstream_rules="", recipe_dirs=str(FIXTURE_RECIPES), torch_index_url="",
        torch_find_links=TORCH_FIND_LINKS, catalog_refresh_seconds=0.5,
        worker_heartbeat_seconds=1, build_timeout=1500)
    values.update(kw)
    return Config(**values)


def _env(config: Config, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    env.update(extra)
    return env


def _wait_built(url: str, build_id: str, headers: dict[str, str],
                timeout: float = 1200) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = requests.get(f"{url}/api/builds/{build_id}", headers=headers,
                                              timeout=10).json()
        if status["state"] in ("built", "failed", "cancelled"):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(1)


def _install_and_import(url: str, tmp_path: Path, torch_site: Path) -> str:
    """Install our wheel into a fresh venv that sees torch; return the installed version, after
    checking that the front page's snippet prints this index's URL for that torch."""
    python = venv_with_torch(tmp_path / "fresh", torch_site)
    env = clean_env(UV_CACHE_DIR=str(tmp_path / "uv-cache"))
    uv = shutil.which("uv") or "uv"
    subprocess.run([uv, "pip", "install", "--python", str(python), "--index-url",
                    f"{url}/{ROOT}/simple", "--no-deps", "cudaext"], env=env, check=True)
    home = requests.get(f"{url}/", timeout=10).text
    snippet = html.unescape(re.search(r'id="snippet">(.*?)</code>', home, re.S)[1])  # type: ignore[index]
    argv = shlex.split(snippet)
    assert argv[0] == "python"
    printed = subprocess.run([str(python), *argv[1:]], capture_output=True, text=True,
                             env=env, check=True).stdout.strip()
    assert printed == f"{url}/torch2.14-cu130/simple"
    return subprocess.run(
        [str(python), "-W", "ignore", "-c",
         "import importlib.metadata as m, cudaext; print(m.version('cudaext'))"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()


def test_single_box(tmp_path: Path, cudaext_upstream: str, torch_site: Path) -> None:
    config = _config(tmp_path, cudaext_upstream)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen(
            ["wheelhouse", "serve", "--with-worker", "--port", str(port), "--workers", "2"],
            env=_env(config), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    sock = socket_path(Path(config.workspace))
    started: list[psutil.Process] = []
    try:
        wait_for_port(port, timeout=60)
        deadline = time.monotonic() + 60
        # The first answer waits for a gunicorn worker to build the app (web.geventworker).
        while not requests.get(f"{url}/api/workers", timeout=60).json()["workers"]:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert sock.exists()
        started = psutil.Process(serve.pid).children(recursive=True)
        assert any(p.name() == "redis-server" for p in started)

        # The operator creates a token against the private Redis, as the server told them.
        token = subprocess.run(
            ["wheelhouse", "token", "create", "box"], capture_output=True, text=True,
            check=True, env=_env(config, WHEELHOUSE_REDIS_URL=f"unix://{sock}"),
        ).stdout.strip().splitlines()[-1].split()[-1]
        headers = {"Authorization": f"Bearer {token}"}
        resp = requests.post(f"{url}/api/builds", json=REQUEST, headers=headers, timeout=30)
        assert resp.status_code == 201, resp.text
        [build] = resp.json()["builds"]
        status = _wait_built(url, build["id"], headers)
        assert status["state"] == "built", (status, log.read_text()[-3000:])
        assert _install_and_import(url, tmp_path, torch_site) == "0.1.0+cu130torch2.14.sm80"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.pid, signal.SIGTERM)
        serve.wait(timeout=90)
    # Nothing is left: no process it started, no socket file, no listener.
    time.sleep(0.5)
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    assert not sock.exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_fleet(tmp_path: Path, cudaext_upstream: str, redis_url: str,
               s3_config: Config, torch_site: Path) -> None:
    config = _config(tmp_path, cudaext_upstream, redis_url=redis_url,
                     storage=s3_config.storage, s3_endpoint_url=s3_config.s3_endpoint_url)
    conn = redis.Redis.from_url(redis_url)
    token = create_token(conn, "fleet")
    headers = {"Authorization": f"Bearer {token}"}
    other = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-12.8", "12.8"))}
    with start_index(config, tmp_path, workers=4) as url, \
            run_worker(config, "gpu-a", tmp_path / "a.log", "--cuda", "13.0"), \
            run_worker(config, "gpu-b", tmp_path / "b.log", "--cuda", "12.8", extra_env=other):
        deadline = time.monotonic() + 60
        while len(requests.get(f"{url}/api/workers", timeout=5).json()["workers"]) < 2:
            assert time.monotonic() < deadline, (tmp_path / "b.log").read_text()
            time.sleep(0.5)
        fleet = {w["name"]: w for w in requests.get(f"{url}/api/workers", timeout=5)
                 .json()["workers"]}
        assert fleet["gpu-a"]["queues"] == ["build-cu130-x86_64"]
        assert fleet["gpu-b"]["queues"] == ["build-cu128-x86_64"]

        ours = requests.post(f"{url}/api/builds", json=REQUEST, headers=headers, timeout=30)
        theirs = requests.post(f"{url}/api/builds", headers=headers, timeout=30,
                               json={**REQUEST, "torch": "2.8", "cuda": "12.8"})
        assert ours.status_code == 201 and theirs.status_code == 201, theirs.text
        [a_build] = ours.json()["builds"]
        [b_build] = theirs.json()["builds"]

        # The 12.8 job is taken by gpu-b, the only worker with that toolkit; then cancel it.
        deadline = time.monotonic() + 120
        while build_job(conn, b_build["id"]).worker_name is None:
            assert time.monotonic() < deadline, (tmp_path / "b.log").read_text()[-2000:]
            time.sleep(0.5)
        assert build_job(conn, b_build["id"]).worker_name == "gpu-b"
        requests.post(f"{url}/api/builds/{b_build['id']}/cancel", headers=headers, timeout=10)

        status = _wait_built(url, a_build["id"], headers)
        assert status["state"] == "built", (status, (tmp_path / "a.log").read_text()[-3000:])
        assert build_job(conn, a_build["id"]).worker_name == "gpu-a"
        # The catalog refreshes in the background: the gauge follows within a refresh. Two
        # files: the wheel and its variant form for /simple/ (it holds sm_80 device code).
        deadline = time.monotonic() + 30
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        while "wheelhouse_catalog_files 2.0" not in metrics:
            assert time.monotonic() < deadline, metrics
            time.sleep(0.5)
            metrics = requests.get(f"{url}/metrics", timeout=10).text
        assert 'wheelhouse_builds_ended_total{state="built"} 1.0' in metrics
        assert 'wheelhouse_queue_depth{queue="build-cu130-x86_64"} 0.0' in metrics
        page = requests.get(f"{url}/{ROOT}/simple/cudaext/", timeout=10)
        assert WHEEL in page.text
        assert _install_and_import(url, tmp_path, torch_site) == "0.1.0+cu130torch2.14.sm80"
