"""A worker SIGKILLed mid-build: on restart its orphans are gone, the job runs again once, and
the index never lists a partial wheel (issue 4)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import redis
import requests

from tests.helpers import run_worker, start_index
from tests.worker.conftest import CUDAEXT, build_config, make_sdist, require_nvcc
from wheelhouse import queue as q
from wheelhouse.buildspec import BuildSpec
from wheelhouse.fleet import build_id_prefix, live_workers
from worker.reaper import BUILD_ID_ENV

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

SPEC = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}


@pytest.fixture(autouse=True)
def _nvcc() -> None:
    require_nvcc()


@pytest.fixture
def cudaext_sdist(tmp_path: Path) -> Path:
    return make_sdist(CUDAEXT, tmp_path / "sdist", "cudaext", "0.1.0")


def _carrying(cookie: str) -> list[psutil.Process]:
    """Processes whose environment carries this build's cookie (the test only looks)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(BUILD_ID_ENV) == cookie:
                out.append(p)
    return out


def _wait_for(what: str, check: object, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}; worker log:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def test_sigkilled_worker(tmp_path: Path, redis_url: str, cudaext_sdist: Path) -> None:
    config = replace(build_config(tmp_path), redis_url=redis_url, worker_heartbeat_seconds=1,
                     catalog_refresh_seconds=0.2)
    conn = redis.Redis.from_url(redis_url)
    log = tmp_path / "workers.log"
    anomalies: list[str] = []
    stop = threading.Event()

    with start_index(config, tmp_path) as url:
        def watch_index() -> None:
            """Whatever the index lists must be whole: size and sha256 as downloaded."""
            while not stop.is_set():
                page = requests.get(f"{url}/torch2.14-cu130-sm80/simple/cudaext/", headers=JSON,
                                    allow_redirects=False, timeout=10)
                if page.status_code == 200:
                    for f in page.json()["files"]:
                        body = requests.get(url + f["url"], timeout=30).content
                        if (len(body) != f["size"]
                                or hashlib.sha256(body).hexdigest() != f["hashes"]["sha256"]):
                            anomalies.append(f"partial or wrong file listed: {f['filename']}")
                    return
                time.sleep(0.5)

        watcher = threading.Thread(target=watch_index, daemon=True)
        watcher.start()
        with run_worker(config, "doomed", log) as first:
            _wait_for("the worker never advertised", lambda: live_workers(conn), 60, log)
            job = q.enqueue_build(conn, SPEC, source=str(cudaext_sdist), timeout=1500)
            cookie = build_id_prefix(conn) + job.job_id

            def compiling() -> bool:
                names = {p.name() for p in _carrying(cookie) if p.is_running()}
                return bool(names & {"nvcc", "cicc", "cudafe++", "ptxas", "cc1plus"})

            _wait_for("no compiler started", compiling, 600, log)
            orphans = _carrying(cookie)
            # The worker, its work horse and its scheduler die at once, as with a lost host.
            # (The build's own processes are left alone: they are what must be cleaned up.)
            worker_side = [p for p in psutil.Process(first.pid).children(recursive=True)
                           if p not in orphans]
            os.kill(first.pid, signal.SIGKILL)
            for p in worker_side:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            first.wait()
        time.sleep(1)
        survivors = [p for p in orphans if p.is_running()
                     and p.status() != psutil.STATUS_ZOMBIE]
        assert survivors, "the compilers should outlive a SIGKILLed worker (that's the problem)"
        assert q.get_build(conn, job.job_id).state is q.BuildState.BUILDING  # type: ignore[union-attr]

        with run_worker(config, "restarted", log):
            # Its start-up sweep kills the dead build's orphans...
            _wait_for("orphans survived the restart",
                      lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                      for p in survivors), 60, log)
            # ...and the abandoned job runs again, once, and is built.
            _wait_for("the abandoned job was not built on retry",
                      lambda: q.get_build(conn, job.job_id).finished, 1500, log)  # type: ignore[union-attr]
            status = q.get_build(conn, job.job_id)
            assert status is not None and status.state is q.BuildState.BUILT, status
            assert "job " + job.job_id + " was abandoned" in log.read_text()
            from rq.job import Job

            assert Job.fetch(job.job_id, connection=conn).retries_left == 0
        watcher.join(timeout=60)
        stop.set()
    assert not anomalies, anomalies
    sweeps = re.findall(r"swept (\d+) orphaned process", log.read_text())
    assert len(sweeps) == 2 and int(sweeps[1]) >= 1, sweeps
