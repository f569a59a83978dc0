"""A real ``wheelhouse worker`` against jobs planted in Redis by hand, as someone holding the
Redis password could: it runs build requests only, and nothing else a job names is imported."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import textwrap
import zlib
from pathlib import Path
from typing import Any, ClassVar

import pytest
from redis import Redis

from tests.helpers import QuietHandler, fake_cuda_toolkit, plant_job, run_worker, serve_http
from wheelhouse import queue as q
from wheelhouse.buildjob import JOB_FUNCTION
from wheelhouse.buildspec import BuildSpec
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
