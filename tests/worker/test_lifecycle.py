"""A real ``wheelhouse worker`` as an operator meets it: against jobs planted in Redis by hand,
as someone holding the Redis password could (it runs build requests only, and nothing else a
job names is imported), and started by its path with a minimal ``PATH``, as a unit file starts
it (what it logs when a build fails)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any, ClassVar

import pytest
from redis import Redis

from tests.helpers import (
    MINIMAL_PATH,
    QuietHandler,
    fake_cuda_toolkit,
    plant_job,
    run_worker,
    serve_http,
)
from tests.worker.conftest import CUDAEXT, make_sdist
from wheelhouse.builds import queue as q
from wheelhouse.builds.fleet import ToolkitInfo, WorkerAd, advertise, live_workers, queues_for
from wheelhouse.builds.job import JOB_FUNCTION
from wheelhouse.builds.queue import BuildState, enqueue_build, get_build
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import FailureKind

CANARY = textwrap.dedent("""\
    # Importing this module, or calling hook(), leaves a file behind: proof that it ran.
    import os
    from pathlib import Path

    Path(os.environ["CANARY_DIR"], "imported").touch()

    def hook(*args, **kwargs):
        Path(os.environ["CANARY_DIR"], "called").touch()
""")


def _spec(python: str) -> BuildSpec:
    return BuildSpec.create("flash-attn", "2.8.3", python=python, torch="2.8", cuda="12.8")


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("python3 -c 'import wheelhouse_canary'",))


def _call(func: str, *args: Any) -> bytes:
    return zlib.compress(json.dumps([func, None, list(args), {}]).encode())


class _Hooks(QuietHandler):
    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        _Hooks.hits.append(self.path)
        self.send_body(b"ok", "text/plain")


def test_planted_jobs_run_nothing_they_name(redis_url: str, tmp_path: Path) -> None:
    conn = Redis.from_url(redis_url)
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "wheelhouse_canary.py").write_text(CANARY)
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    calls = _spec("3.10")
    pickled = _spec("3.11")
    build = _spec("3.12")
    outside = _spec("3.13")
    queue = build.queue_name
    with serve_http(_Hooks) as hooks:
        # First a hash RQ itself can't read: the worker drops it and goes on.
        plant_job(conn, "build-malformed", queue, _call(JOB_FUNCTION), created_at="never")
        plant_job(conn, calls.job_id, queue, _call("wheelhouse_canary.hook", "x"),
                  retries_left="3")
        plant_job(conn, pickled.job_id, queue, zlib.compress(pickle.dumps(Evil())))
        # A real build request, dressed with every hook RQ offers: the build runs, no hook does.
        plant_job(conn, build.job_id, queue, _call(JOB_FUNCTION, build.to_dict(), None, 600),
                  success_callback_name="wheelhouse_canary.hook",
                  failure_callback_name="wheelhouse_canary.hook",
                  stopped_callback_name="wheelhouse_canary.hook",
                  webhooks=json.dumps([{"url": f"{hooks}/hook", "events": ["failed"]}]))
        plant_job(conn, outside.job_id, queue,
                  _call(JOB_FUNCTION, outside.to_dict(), "/etc/passwd", 600))

        config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                        redis_url=redis_url, upstream="off", worker_heartbeat_seconds=1)
        env = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-12.8", "12.8")),
               "PYTHONPATH": str(canary), "CANARY_DIR": str(marker_dir)}
        log = tmp_path / "worker.log"
        with run_worker(config, "w", log, "--burst", "--cuda", "12.8", extra_env=env) as proc:
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                pytest.fail("the burst worker did not finish: " + log.read_text()[-3000:])
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]

    for spec, why in ((calls, "calls 'wheelhouse_canary.hook'"), (pickled, "not JSON"),
                      (outside, "source '/etc/passwd' is not an sdist")):
        status = q.get_build(conn, spec.job_id)
        assert status is not None, text[-3000:]
        assert status.state is q.BuildState.FAILED, (status, text[-3000:])
        assert status.failure_kind is FailureKind.REFUSED_JOB and why in (status.reason or "")
    # Refused for good: the retries a planted job asked for are not granted.
    job = q.fetch_job(conn, calls.job_id)
    assert job is not None and job.retries_left == 0

    built = q.get_build(conn, build.job_id)
    assert built is not None and built.state is q.BuildState.FAILED, text[-3000:]
    assert built.failure_kind is not FailureKind.REFUSED_JOB, built
    assert q.get_build(conn, "build-malformed") is None

    assert sorted(p.name for p in marker_dir.iterdir()) == [], text[-3000:]
    assert _Hooks.hits == []


def _wait(check: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def test_an_unverified_sdist_fails_in_one_line(redis_url: str, tmp_path: Path) -> None:
    """An upstream that publishes no sha256 (a PEP 503 link without ``#sha256=``): the build
    fails as ``unverified-source``, and the worker logs one line, not a traceback."""
    sdist = make_sdist(CUDAEXT, tmp_path / "sdist", "cudaext", "0.1.0")

    class NoHashes(QuietHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/simple/cudaext":
                link = f'<a href="/files/{sdist.name}">{sdist.name}</a>'
                self.send_body(f"<html><body>{link}</body></html>".encode(), "text/html")
            elif self.path == f"/files/{sdist.name}":
                self.send_body(sdist.read_bytes(), "application/gzip")
            else:
                self.send_error(404)

    conn = Redis.from_url(redis_url)
    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.8", cuda="12.8")
    log = tmp_path / "worker.log"
    with serve_http(NoHashes) as upstream:
        config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                        redis_url=redis_url, upstream=f"{upstream}/simple/",
                        worker_heartbeat_seconds=1)
        env = {"PATH": MINIMAL_PATH,
               "CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-12.8", "12.8"))}
        # A worker elsewhere, advertised by hand (it runs no builds: its queue is CUDA 13.0's).
        toolkit = ToolkitInfo(cuda="13.0", home="/usr/local/cuda-13.0", nvcc="nvcc")
        advertise(conn, WorkerAd(name="gpu-elsewhere", hostname="elsewhere", machine="x86_64",
                                 cores=16, memory_bytes=1 << 37, toolkits=(toolkit,),
                                 queues=queues_for(["13.0"], "x86_64"),
                                 extra={"source_path": "/elsewhere/work/src"}), ttl=120)
        with run_worker(config, "nohash", log, "--cuda", "12.8", extra_env=env):
            _wait(lambda: "nohash" in {w.name for w in live_workers(conn)},
                  "the worker never advertised itself")
            # Where its (sandboxed) builds see their sources, for `wheelhouse workers` to
            # compare across the fleet, and a warning at start: another live worker's (an
            # unsandboxed one's) builds see theirs elsewhere.
            [ad] = [w for w in live_workers(conn) if w.name == "nohash"]
            assert ad.extra["source_path"] == "/wheelhouse/src"
            _wait(lambda: "warning: workers' builds see their sources at different paths" in
                  log.read_text(), "no warning about the other worker's source path")
            assert "/elsewhere/work/src: gpu-elsewhere" in log.read_text()
            job_id = enqueue_build(conn, spec).job_id
            _wait(lambda: (s := get_build(conn, job_id)) is not None and s.finished,
                  "the build never ended")
    status = get_build(conn, job_id)
    assert status is not None and status.state is BuildState.FAILED
    assert status.failure_kind is FailureKind.UNVERIFIED_SOURCE, status.reason
    assert status.reason == (
        "the upstream index publishes no sha256 for cudaext-0.1.0.tar.gz; wheelhouse builds "
        "only source it can verify (WHEELHOUSE_UPSTREAM)")
    text = log.read_text()
    assert f"build {job_id} failed [unverified-source]: the upstream index publishes" in text
    assert "Traceback" not in text
