"""The job's meta, the one contract between worker and web: written and read as ``JobMeta``,
read leniently whatever release of the worker wrote it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from rq.job import JobStatus

from tests.helpers import build_job
from wheelhouse.builds import queue as q
from wheelhouse.builds.facts import BuildFacts, MaxJobs
from wheelhouse.builds.meta import VERSION, Failure, JobMeta
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import FailureKind

SPEC = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.14", cuda="13.0",
                        archs=["80"])
JOBS = MaxJobs(jobs=6, reason="MAX_JOBS=6: 6 jobs of 5.0 GiB fit", per_thread_bytes=5 * 2**30,
               nvcc_threads=1, available_bytes=31 * 2**30, reserve_bytes=2**30, cores=16,
               learned=True)

#: What the worker of the release before JobMeta wrote while compiling, then on failure.
PREVIOUS_RELEASE_COMPILING = {
    "spec": SPEC.to_dict(), "phase": "compile", "failure": None, "started": 1.7e9,
    "progress": [12, 96], "max_jobs": 6, "max_jobs_reason": JOBS.reason,
    "toolkit": "V13.0.88", "torch": "2.14.1+cu130",
    "build": {"build_id": "b1", "toolkit": "V13.0.88", "torch": "2.14.1+cu130",
              "sandbox": "bubblewrap"},
}
PREVIOUS_RELEASE_FAILED = {
    **PREVIOUS_RELEASE_COMPILING, "phase": "failed",
    "failure": {"kind": "compile-error", "reason": "add.cu(7): error: oops"},
    "log_key": "logs/x.log",
    "build": {**PREVIOUS_RELEASE_COMPILING["build"], "max_jobs": JOBS.to_dict(), "seconds": 61.5},
}


@pytest.fixture
def conn(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_what_is_written_reads_back_the_same() -> None:
    meta = JobMeta(spec=SPEC, phase="failed", progress=(96, 96),
                   build=BuildFacts(build_id="b1", max_jobs=JOBS, seconds=3.5),
                   failure=Failure(FailureKind.OOM, "killed for lack of memory"),
                   wheel="w.whl", summary="built in 3 s", log_key="logs/w.whl.log")
    data = json.loads(json.dumps(meta.to_meta()))  # RQ stores the meta as JSON
    assert data["version"] == VERSION == 1
    assert JobMeta.from_meta(data) == meta
    # Unknown values are left out, not written as nulls.
    assert JobMeta(spec=SPEC, phase="queued").to_meta() == {
        "version": VERSION, "spec": SPEC.to_dict(), "phase": "queued"}


def test_the_previous_release_s_meta_reads_gracefully() -> None:
    """A web of this release reads a worker of the previous one: the same keys, no version;
    the fields nobody reads any more are ignored, and MAX_JOBS comes from the build's facts
    (so, from that worker, once its compile step has ended)."""
    compiling = JobMeta.from_meta(PREVIOUS_RELEASE_COMPILING)
    assert compiling.version == 0
    assert (compiling.phase, compiling.progress, compiling.failure) == ("compile", (12, 96), None)
    assert compiling.build == BuildFacts(build_id="b1", toolkit="V13.0.88",
                                         torch="2.14.1+cu130", sandbox="bubblewrap")
    assert compiling.project == "flash-attn"
    failed = JobMeta.from_meta(PREVIOUS_RELEASE_FAILED)
    assert failed.failure == Failure(FailureKind.COMPILE_ERROR, "add.cu(7): error: oops")
    assert failed.build.max_jobs == JOBS and failed.log_key == "logs/x.log"
    # Re-written, it is this release's layout: nothing of what was dropped comes back.
    assert set(failed.to_meta()) == {"version", "spec", "phase", "progress", "build", "failure",
                                     "log_key"}


@pytest.mark.parametrize(("data", "expected"), [
    (None, JobMeta(version=0)),
    ("not a mapping", JobMeta(version=0)),
    ({}, JobMeta(version=0)),
    # A later release: unknown keys ignored, a failure kind this one doesn't know kept as
    # a failure of unknown kind (never retried as infrastructure).
    ({"version": 7, "phase": "signing", "new": {"x": 1},
      "failure": {"kind": "quantum-flux", "reason": "r"}},
     JobMeta(phase="signing", failure=Failure(None, "r"), version=7)),
    # Mistyped values are dropped, the rest is read.
    ({"version": True, "spec": ["x"], "phase": 3, "progress": [1, "2"], "build": "x",
      "failure": "boom", "wheel": 5, "summary": "ok"},
     JobMeta(summary="ok", version=0)),
    ({"progress": [1, 2, 3]}, JobMeta(version=0)),
    ({"progress": [True, 2]}, JobMeta(version=0)),
    ({"failure": {"kind": "oom"}}, JobMeta(failure=Failure(FailureKind.OOM, ""), version=0)),
])
def test_from_meta_never_raises(data: Any, expected: JobMeta) -> None:
    assert JobMeta.from_meta(data) == expected


def test_the_spec_is_a_build_spec_or_none() -> None:
    """The spec is read as a :class:`BuildSpec`: keys a newer release adds are ignored (a
    rolling upgrade), a spec that doesn't parse is no spec (the pages skip the job)."""
    newer = {"version": 2, "spec": SPEC.to_dict() | {"priority": "high"}, "phase": "queued"}
    assert JobMeta.from_meta(newer).spec == SPEC
    broken = {"version": 1, "spec": SPEC.to_dict() | {"python": "3.11; rm -rf /"}}
    meta = JobMeta.from_meta(broken)
    assert meta.spec is None and meta.project is None
    assert "spec" not in meta.to_meta()


def test_the_queue_writes_it_and_reads_a_previous_release_s_job(conn: redis.Redis) -> None:
    """Through a real Redis and RQ: the queue writes a new job's meta as ``JobMeta``; a job a
    worker of the previous release reported on reads back through ``get_build``."""
    q.enqueue_build(conn, SPEC, require_worker=False)
    job = build_job(conn, SPEC.job_id)
    assert job.meta == {"version": VERSION, "spec": SPEC.to_dict(), "phase": "queued"}

    job.meta = dict(PREVIOUS_RELEASE_FAILED)
    job.save_meta()
    job.set_status(JobStatus.FAILED)
    status = q.get_build(conn, SPEC.job_id)
    assert status is not None and status.state is q.BuildState.FAILED
    assert status.failure_kind is FailureKind.COMPILE_ERROR
    assert status.reason == "add.cu(7): error: oops" and status.progress == (12, 96)
    assert (status.max_jobs, status.max_jobs_reason) == (6, JOBS.reason)
    assert status.log_key == "logs/x.log" and status.build.seconds == 61.5
