"""A worker SIGKILLed mid-build: on restart its orphans are gone, the job runs again once, and
the index never lists a partial wheel (issue 4). The worker that takes the job over has a
workspace of its own, empty (at another path when sandboxed, at the same path unsandboxed),
and S3 storage in common: what the dead one compiled and pushed while compiling comes back as cache
hits, so the retry compiles only the rest (issue 31).

Sandboxed, the build dies with the worker (bubblewrap's ``--die-with-parent`` ends the sandbox's
PID namespace, and the kernel everything in it). Unsandboxed, what writes to the build's output
dies of SIGPIPE once the worker that drained it is gone, and whatever does not write (a compiler
mid-file) lives on until the restarted worker's sweep kills it.
"""

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

from tests.helpers import build_job, run_worker, start_index
from tests.worker.conftest import build_config
from wheelhouse.builds import queue as q
from wheelhouse.builds.fleet import build_id_prefix, live_workers
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.index.storage import open_storage
from worker.supervision.reaper import BUILD_ID_ENV, build_id_base

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

SPEC = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}


def _carrying(cookie: str) -> list[psutil.Process]:
    """Processes whose environment carries this build's cookie, the fleet's prefix and the job
    id plus a suffix of the build's own (the test only looks)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if build_id_base(p.environ().get(BUILD_ID_ENV, "")) == cookie:
                out.append(p)
    return out


def _wait_for(what: str, check: object, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}; worker log:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


@pytest.mark.parametrize("sandbox", ["on", "off"])
def test_sigkilled_worker(tmp_path: Path, redis_url: str, cudaext_sdist: Path,
                          sandbox: str, s3_config: Config) -> None:
    config = replace(build_config(tmp_path), redis_url=redis_url, worker_heartbeat_seconds=1,
                     catalog_refresh_seconds=0.2, build_sandbox=sandbox,
                     storage=s3_config.storage, s3_endpoint_url=s3_config.s3_endpoint_url)
    conn = redis.Redis.from_url(redis_url)
    log = tmp_path / "workers.log"
    anomalies: list[str] = []
    stop = threading.Event()

    with start_index(config, tmp_path) as url:
        def watch_index() -> None:
            """Whatever the index lists must be whole: size and sha256 as downloaded."""
            while not stop.wait(0.5):
                try:
                    page = requests.get(f"{url}/torch2.14-cu130-sm80/simple/cudaext/",
                                        headers=JSON, allow_redirects=False, timeout=10)
                    if page.status_code != 200:
                        continue
                    for f in page.json()["files"]:
                        body = requests.get(url + f["url"], timeout=30).content
                        if (len(body) != f["size"]
                                or hashlib.sha256(body).hexdigest() != f["hashes"]["sha256"]):
                            anomalies.append(f"partial or wrong file listed: {f['filename']}")
                    return
                except requests.RequestException:
                    continue  # a slow moment on a loaded machine; ask again

        watcher = threading.Thread(target=watch_index, daemon=True)
        watcher.start()
        try:
            _kill_and_restart(config, conn, log, cudaext_sdist)
            watcher.join(timeout=60)  # it saw the finished wheel (or the test fails below)
        finally:
            stop.set()
            watcher.join(timeout=30)
    assert not anomalies, anomalies
    sweeps = re.findall(r"swept (\d+) orphaned process", log.read_text())
    assert len(sweeps) == 2, sweeps


def _kill_and_restart(config: Config, conn: redis.Redis, log: Path, sdist: Path) -> None:
    with run_worker(config, "doomed", log) as first:
        _wait_for("the worker never advertised", lambda: live_workers(conn), 60, log)
        job = q.enqueue_build(conn, SPEC, source=str(sdist), timeout=1500)
        cookie = build_id_prefix(conn) + job.job_id

        def compiling() -> bool:
            # The full compile (ninja's [N/M] seen), not the one-file probe, which may end
            # before the kill lands.
            status = q.get_build(conn, job.job_id)
            if status is None or status.progress is None:
                return False
            names = {p.name() for p in _carrying(cookie) if p.is_running()}
            return bool(names & {"nvcc", "cicc", "cudafe++", "ptxas", "cc1plus"})

        _wait_for("no compiler started", compiling, 900, log)
        # Killed once the compile pushed some of its cache entries (every 10 s), and before it
        # ended (the build is still running when the kill lands: asserted below). Six of the
        # ten entries its whole compile stores: bindings.cpp's is one, so nvcc's steps are in.
        storage = open_storage(config)
        _wait_for("no compile cache entries of nvcc's reached storage while compiling",
                  lambda: sum(1 for _ in storage.list("sccache/cudaext/")) >= 6, 300, log)
        # The worker, its work horse and its scheduler die at once, as with a lost host. The
        # build's own processes (those carrying its cookie) are what must be cleaned up.
        orphans = _carrying(cookie)
        worker_side = []
        for p in psutil.Process(first.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.environ().get(BUILD_ID_ENV) != cookie:
                    worker_side.append(p)
        os.kill(first.pid, signal.SIGKILL)
        for p in worker_side:
            with contextlib.suppress(psutil.Error):
                p.kill()
        first.wait()
    def alive() -> list[psutil.Process]:
        out = []
        for p in orphans:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    time.sleep(1)
    survivors = alive()
    if config.build_sandbox == "on":
        _wait_for("the sandboxed build outlived its worker", lambda: not alive(), 30, log)
    status = q.get_build(conn, job.job_id)
    assert status is not None and status.state is q.BuildState.BUILDING

    # Another worker, as on another host of the same fleet: its own empty workspace, the same
    # Redis and S3. Sandboxed, at another path: every sandboxed build sees its source at one
    # path (SOURCE_INSIDE), which nvcc's cache keys hold. Unsandboxed, the source lies in the
    # workspace, so nvcc's entries hit only at the same path: the dead worker's workspace
    # moves aside, its orphans still in it.
    workspace = Path(config.workspace)
    if config.build_sandbox == "on":
        config = replace(config, workspace=str(workspace.with_name("work-other-host")))
    else:
        workspace.rename(workspace.with_name("work-dead-host"))
    with run_worker(config, "restarted", log):
        # Its start-up sweep kills the dead build's orphans...
        _wait_for("orphans survived the restart",
                  lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                  for p in survivors), 60, log)

        # ...and the abandoned job runs again, once, and is built.
        def finished() -> bool:
            status = q.get_build(conn, job.job_id)
            return status is not None and status.finished

        _wait_for("the abandoned job was not built on retry", finished, 1500, log)
        status = q.get_build(conn, job.job_id)
        assert status is not None and status.state is q.BuildState.BUILT, status
        assert "job " + job.job_id + " was abandoned" in log.read_text()
        assert build_job(conn, job.job_id).retries_left == 0
        # The retry compiled only what the dead attempt had not pushed: its hits can only be
        # those entries (a fresh bucket, an empty workspace).
        cache = status.build.compile_cache
        assert cache is not None and cache.hits > 0, (cache, log.read_text()[-3000:])
        # nvcc's steps among them: both builds saw the source at one path (where they saw it
        # at different paths, sccache 0.16.0 missed every one of them).
        assert cache.hits_by_language.get("PTX", 0) > 0, cache
        # What its page shows (issue 31): the second attempt, with what it fetched first.
        assert status.attempt == 2 and cache.fetched > 0, (status.attempt, cache)
