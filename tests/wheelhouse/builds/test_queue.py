"""The build queue against a real Redis: idempotent enqueue, fleet adverts, cancel, live log."""

from __future__ import annotations

import pytest
import redis
from rq import Queue
from rq.job import JobStatus

from tests.helpers import build_job, wait_until
from wheelhouse.builds import queue as q
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.builds.fleet import (
    ToolkitInfo,
    WorkerAd,
    advertise,
    live_workers,
    pick_toolkit,
    servable,
    servable_cuda,
)
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import FailureKind, UnservableSpec
from wheelhouse.retry import ABANDONED_JOBS


def ad(name: str, cuda: str = "13.0", machine: str = "x86_64") -> WorkerAd:
    from wheelhouse.builds.fleet import queues_for

    toolkit = ToolkitInfo(cuda=cuda, home=f"/usr/local/cuda-{cuda}", nvcc="nvcc")
    return WorkerAd(name=name, hostname="gpu1", machine=machine, cores=64,
                    memory_bytes=512 * 1024**3, toolkits=(toolkit,),
                    queues=queues_for([cuda], machine))


SPEC = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.14", cuda="13.0",
                        archs=["80"])


def test_same_spec_twice_gives_one_job(conn: redis.Redis) -> None:
    advertise(conn, ad("w1"), ttl=30)
    first = q.enqueue_build(conn, SPEC)
    second = q.enqueue_build(conn, BuildSpec.from_dict(SPEC.to_dict()))
    assert first.created and not second.created
    assert first.job_id == second.job_id == SPEC.job_id
    assert second.state is q.BuildState.QUEUED
    rq_queue = Queue(SPEC.queue_name, connection=conn)
    assert rq_queue.job_ids == [SPEC.job_id]
    job = build_job(conn, SPEC.job_id)
    assert job.func_name == "worker.jobs.run_build"  # by path: the web never imports the worker
    assert job.args[0] == SPEC.to_dict()

    status = q.get_build(conn, SPEC.job_id)
    assert status is not None
    assert status.state is q.BuildState.QUEUED and status.position == 0
    assert status.spec == SPEC and status.phase == "queued"
    assert q.get_build(conn, "build-nope") is None


def test_a_spec_no_worker_serves_gets_a_clear_answer(conn: redis.Redis) -> None:
    with pytest.raises(UnservableSpec, match="no build worker is running"):
        q.enqueue_build(conn, SPEC)
    advertise(conn, ad("w128", cuda="12.8"), ttl=30)
    with pytest.raises(UnservableSpec) as err:
        q.enqueue_build(conn, SPEC)
    assert "CUDA 13.0 on x86_64" in str(err.value)
    assert "the fleet offers: CUDA 11.8 on x86_64" not in str(err.value)  # different major
    assert "CUDA 12.8 on x86_64" in str(err.value)
    assert Queue(SPEC.queue_name, connection=conn).count == 0
    # Without the check (single-box mode before the worker starts) it is queued anyway.
    assert q.enqueue_build(conn, SPEC, require_worker=False).created


def test_adverts_expire_without_heartbeat(conn: redis.Redis) -> None:
    advertise(conn, ad("short"), ttl=0.3)
    advertise(conn, ad("arm", machine="aarch64"), ttl=30)
    assert [a.name for a in live_workers(conn)] == ["arm", "short"]
    assert ("13.0", "aarch64") in servable(conn) and ("12.8", "x86_64") not in servable(conn)
    wait_until(lambda: [a.name for a in live_workers(conn)] == ["arm"], "the advert to expire")
    conn.set("wheelhouse:worker:garbage", b"{not json")
    assert [a.name for a in live_workers(conn)] == ["arm"]


def test_failed_builds_rerun_only_when_asked(conn: redis.Redis) -> None:
    advertise(conn, ad("w1"), ttl=30)
    q.enqueue_build(conn, SPEC)
    job = build_job(conn, SPEC.job_id)
    job.meta["failure"] = {"kind": "compile_error", "reason": "csrc/x.cu(3): error: boom"}
    job.meta["build"] = {"build_id": SPEC.job_id, "seconds": 12.5, "peak_tree_bytes": 2**30}
    job.save_meta()
    job.set_status(JobStatus.FAILED)
    q.append_log(conn, SPEC.job_id, ["old line"])

    again = q.enqueue_build(conn, SPEC)
    assert not again.created and again.state is q.BuildState.FAILED
    status = q.get_build(conn, SPEC.job_id)
    assert status is not None and status.failure_kind is FailureKind.COMPILE_ERROR
    assert status.reason == "csrc/x.cu(3): error: boom"
    assert status.build == BuildFacts(build_id=SPEC.job_id, seconds=12.5, peak_tree_bytes=2**30)

    rerun = q.enqueue_build(conn, SPEC, rerun_failed=True)
    assert rerun.created and rerun.state is q.BuildState.QUEUED
    assert q.log_since(conn, SPEC.job_id) == ([], 0)  # the old attempt's live log is gone


def test_an_abandoned_job_is_retried_as_the_policy_says(conn: redis.Redis) -> None:
    q.enqueue_build(conn, SPEC, require_worker=False)
    job = build_job(conn, SPEC.job_id)
    assert job.retries_left == ABANDONED_JOBS.retries == 1
    assert job.retry_intervals == [0]


def test_cancel_queued_and_running(conn: redis.Redis) -> None:
    advertise(conn, ad("w1"), ttl=30)
    q.enqueue_build(conn, SPEC)
    assert q.cancel_build(conn, SPEC.job_id)
    status = q.get_build(conn, SPEC.job_id)
    assert status is not None and status.state is q.BuildState.CANCELLED
    assert Queue(SPEC.queue_name, connection=conn).count == 0
    assert not q.cancel_build(conn, SPEC.job_id)  # already over

    q.enqueue_build(conn, SPEC, rerun_failed=True)
    build_job(conn, SPEC.job_id).set_status(JobStatus.STARTED)
    assert not q.cancel_requested(conn, SPEC.job_id)
    assert q.cancel_build(conn, SPEC.job_id)
    assert q.cancel_requested(conn, SPEC.job_id)  # the worker polls this and kills the tree


def test_live_log_offsets_survive_trimming(conn: redis.Redis, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setattr(q, "LOG_KEEP", 5)
    q.append_log(conn, "build-x", [f"line {i}" for i in range(3)])
    lines, offset = q.log_since(conn, "build-x")
    assert lines == ["line 0", "line 1", "line 2"] and offset == 3
    q.append_log(conn, "build-x", [f"line {i}" for i in range(3, 10)])
    lines, offset = q.log_since(conn, "build-x", offset)
    assert offset == 10
    assert lines == [f"line {i}" for i in range(5, 10)]  # 3 and 4 were trimmed away
    assert q.log_since(conn, "build-x", 8) == (["line 8", "line 9"], 10)
    assert q.log_tail(conn, "build-x", 2) == ["line 8", "line 9"]


@pytest.mark.parametrize(
    ("toolkits", "cuda", "picked"),
    [
        (["13.0", "12.8", "12.4"], "12.6", "12.8"),  # nearest newer minor of the same major
        (["13.0", "12.8"], "12.8", "12.8"),
        (["13.0"], "12.8", None),  # never another major: torch refuses it
        (["12.4"], "12.8", None),  # an older minor lacks what torch's headers need
        (["13.2", "13.0"], "13.0", "13.0"),
    ],
)
def test_pick_toolkit(toolkits: list[str], cuda: str, picked: str | None) -> None:
    infos = [ToolkitInfo(cuda=c, home=f"/cuda-{c}", nvcc="nvcc") for c in toolkits]
    chosen = pick_toolkit(infos, cuda)
    assert (chosen.cuda if chosen else None) == picked
    if picked:
        assert cuda in servable_cuda(toolkits)


def _move(conn: redis.Redis, spec: BuildSpec, status: JobStatus, seconds: float = 0.0) -> str:
    """Put a queued job where a worker would leave it: its status and registry."""
    from datetime import UTC, datetime, timedelta

    from rq.executions import Execution
    from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry

    job_id = q.enqueue_build(conn, spec, require_worker=False).job_id
    job = build_job(conn, job_id)
    Queue(spec.queue_name, connection=conn).remove(job_id)
    job.started_at = datetime(2025, 1, 1, tzinfo=UTC)
    job.ended_at = job.started_at + timedelta(seconds=seconds)
    job.save()
    job.set_status(status)
    if status is JobStatus.STARTED:  # RQ 2 keeps executions, not jobs, in the started registry
        with conn.pipeline() as pipe:
            Execution.create(job, ttl=600, pipeline=pipe)
            pipe.execute()
    else:
        registry = {JobStatus.FINISHED: FinishedJobRegistry, JobStatus.FAILED: FailedJobRegistry,
                    JobStatus.CANCELED: CanceledJobRegistry}[status]
        registry(spec.queue_name, connection=conn).add(job, -1)
    return job_id


def _spec(python: str, project: str = "flash-attn", cuda: str = "13.0") -> BuildSpec:
    return BuildSpec.create(project, "2.8.3", python=python, torch="2.14", cuda=cuda)


def test_all_build_jobs_scans_every_queue_and_registry(conn: redis.Redis) -> None:
    queued = q.enqueue_build(conn, _spec("3.9"), require_worker=False).job_id
    other_cuda = q.enqueue_build(conn, _spec("3.9", cuda="12.8"), require_worker=False).job_id
    moved = {_move(conn, _spec(p), s) for p, s in (
        ("3.10", JobStatus.STARTED), ("3.11", JobStatus.FINISHED),
        ("3.12", JobStatus.FAILED), ("3.13", JobStatus.CANCELED))}
    Queue("default", connection=conn).enqueue("os.getcwd")  # not a build queue
    found = {job.id for job in q.all_build_jobs(conn)}
    assert found == {queued, other_cuda} | moved


def test_finished_durations_of_one_project(conn: redis.Redis) -> None:
    first = _move(conn, _spec("3.10"), JobStatus.FINISHED, seconds=60)
    _move(conn, _spec("3.11"), JobStatus.FINISHED, seconds=90)
    _move(conn, _spec("3.11", project="demo-ext"), JobStatus.FINISHED, seconds=5)
    _move(conn, _spec("3.12"), JobStatus.FAILED, seconds=1)
    queue = _spec("3.10").queue_name
    assert sorted(q.finished_durations(conn, queue, "flash-attn")) == [60.0, 90.0]
    assert q.finished_durations(conn, queue, "flash-attn", exclude=first) == [90.0]
    assert q.finished_durations(conn, queue, "demo-ext") == [5.0]
    assert q.finished_durations(conn, "build-cu128-x86_64", "flash-attn") == []
