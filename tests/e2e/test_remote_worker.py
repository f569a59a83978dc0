"""A worker on "another host" joins the fleet as the README's Security section says: Redis over
TLS (``rediss://`` with the private CA) and the password from a file. A real ``wheelhouse
worker`` advertises itself, takes a build and reports its end, all through that connection."""

from __future__ import annotations

import time
from pathlib import Path

from tests.conftest import TLSRedis
from tests.helpers import fake_cuda_toolkit, run_console, run_worker
from wheelhouse.builds import queue as q
from wheelhouse.builds.fleet import live_workers
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import FailureKind
from wheelhouse.redisconn import connect

SPEC = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8")


def test_a_worker_joins_over_tls_with_the_password(tls_redis: TLSRedis, tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                    redis_url=tls_redis.url(db=3), redis_password_file=str(tls_redis.password_file),
                    upstream="off", worker_heartbeat_seconds=1)
    conn = connect(config, timeout=5)
    conn.flushdb()
    cuda = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-12.8", "12.8"))}
    log = tmp_path / "worker.log"
    with run_worker(config, "gpu-far", log, "--cuda", "12.8", extra_env=cuda):
        deadline = time.monotonic() + 60
        while not live_workers(conn):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        listed = run_console("workers", config=config)
        assert listed.returncode == 0 and "gpu-far" in listed.stdout, listed.stderr

        q.enqueue_build(conn, SPEC)
        # With no upstream index the build fails at its fetch: the job went there and back.
        while not ((status := q.get_build(conn, SPEC.job_id)) and status.finished):
            assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
            time.sleep(0.25)
    assert status.state is q.BuildState.FAILED
    assert status.failure_kind is FailureKind.INCOMPATIBLE, status
    job = q.fetch_job(conn, SPEC.job_id)
    assert job is not None and job.worker_name == "gpu-far"
    assert tls_redis.password not in log.read_text()
    conn.flushdb()
