"""Issue 21: ``wheelhouse request PATH`` uploads a local sdist and the fleet builds that one.

End to end in two halves, each with real parts, so that no nvcc compile is needed: a real
``wheelhouse serve`` (gunicorn) over real Redis and storage (a directory, and a moto S3 server)
takes the upload from the real console script and queues a job that names the sdist by its
sha256; then the worker's source step, as ``worker.build`` runs it, fetches that sdist from the
same storage, checks its sha256 and unpacks it; stored bytes that were changed since fail as
``unverified-source``. (The compile that follows is the same as for any sdist:
``tests/e2e/test_build_e2e.py``.)
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path

import pytest
from redis import Redis

from tests.helpers import run_console, start_index
from tests.web.buildhelpers import advertise_worker, token
from tests.worker.conftest import CUDAEXT, build_config, make_sdist
from wheelhouse.builds.queue import fetch_job, get_build
from wheelhouse.builds.spec import BuildSpec, SourceRef
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index.layout import source_key
from wheelhouse.index.storage import open_storage
from wheelhouse.retry import BUILD_STEPS
from worker.events import Reporter
from worker.steps.context import BuildContext
from worker.steps.source import unpacked
from worker.supervision.runner import Runner

REQUEST = ("--torch", "2.14", "--cuda", "13.0", "--python", "3.11")


def _source_step(config: Config, spec: BuildSpec) -> tuple[BuildContext, Runner]:
    storage = open_storage(config)
    ctx = BuildContext.create(spec, config=config, storage=storage, reporter=Reporter(),
                              build_id="upload-test", retry=BUILD_STEPS, keep_workspace=False)
    return ctx, Runner.start(ctx, deadline=time.monotonic() + 600, timeout=600)


def test_a_requested_local_sdist_is_uploaded_queued_by_sha256_and_verified_by_the_worker(
        any_config: Config, redis_url: str, conn: Redis, tmp_path: Path) -> None:
    config = replace(any_config, redis_url=redis_url, upstream="off", torch_check=False)
    sdist = make_sdist(CUDAEXT, tmp_path / "dist", "cudaext", "0.1.0")
    sha256 = hashlib.sha256(sdist.read_bytes()).hexdigest()
    advertise_worker(conn, cuda="13.0")
    env = {"WHEELHOUSE_TOKEN": token(conn)}

    with start_index(config, tmp_path, workers=1) as url:
        done = run_console("request", str(sdist), *REQUEST, "--server", url, env=env)
        assert done.returncode == 0, done.stderr
        assert f"uploaded cudaext-0.1.0.tar.gz (sha256 {sha256})" in done.stderr
        # The same bytes again: found, not stored or queued twice.
        again = run_console("request", str(sdist), *REQUEST, "--server", url, env=env)
        assert again.returncode == 0 and "exists, queued" in again.stdout, again.stdout

    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                            source={"sha256": sha256, "filename": sdist.name})
    assert spec.job_id in done.stdout and "created, queued" in done.stdout
    status, job = get_build(conn, spec.job_id), fetch_job(conn, spec.job_id)
    assert status is not None and job is not None
    assert status.spec is not None
    assert status.spec.source == SourceRef(sha256, "cudaext-0.1.0.tar.gz")
    assert job.args[1] is None  # no path: the worker finds the sdist by its sha256
    storage = open_storage(config)
    key = source_key(sha256, sdist.name)
    assert storage.get_bytes(key) == sdist.read_bytes()

    worker_config = replace(build_config(tmp_path), storage=config.storage,
                            s3_endpoint_url=config.s3_endpoint_url)
    ctx, run = _source_step(worker_config, spec)
    with unpacked(ctx, run, None) as src:
        assert (src.path / "setup.py").is_file() and (src.path / "PKG-INFO").is_file()
    assert ctx.journal.facts.sdist == sdist.name

    changed = bytearray(sdist.read_bytes())
    changed[len(changed) // 2] ^= 0xFF
    storage.put_bytes(key, bytes(changed))  # changed in storage since it was uploaded
    ctx, run = _source_step(worker_config, spec)
    with pytest.raises(BuildFailed) as failed, unpacked(ctx, run, None):
        pytest.fail("a changed sdist was unpacked")
    assert failed.value.kind is FailureKind.UNVERIFIED_SOURCE
    assert f"not the {sha256[:16]}… it was uploaded as" in failed.value.reason
    assert not ctx.source_root.exists()
