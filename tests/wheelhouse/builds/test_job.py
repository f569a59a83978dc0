"""Build jobs are data: JSON on the wire, one function, arguments checked like an API request,
and nothing a planted job names is loaded, imported or called (against a real Redis)."""

from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.helpers import plant_job
from wheelhouse.builds import queue as q
from wheelhouse.builds.job import JOB_FUNCTION, PROVE_FUNCTION, REFUSED_CALL, JobCall, ProveCall
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import RefusedJob

SPEC = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8")
GOOD_ARGS = [SPEC.to_dict(), None, 3600]


class Evil:
    """A pickle that runs a command when loaded, as a pickled RQ job could."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_job_is_json_naming_the_build_function(conn: redis.Redis) -> None:
    q.enqueue_build(conn, SPEC, require_worker=False, timeout=3600)
    raw = conn.hget(f"rq:job:{SPEC.job_id}", "data")
    assert raw is not None
    assert json.loads(zlib.decompress(raw)) == [JOB_FUNCTION, None, GOOD_ARGS, {}]
    meta = conn.hget(f"rq:job:{SPEC.job_id}", "meta")
    assert meta is not None and json.loads(meta)["spec"] == SPEC.to_dict()
    job = q.fetch_job(conn, SPEC.job_id)
    assert job is not None and job.refusal is None


def _args(**changes: Any) -> list[Any]:
    spec = {**SPEC.to_dict(), **changes.pop("spec", {})}
    args: list[Any] = [spec, changes.pop("source", None), changes.pop("timeout", 3600)]
    return args


@pytest.mark.parametrize(
    ("func", "args", "kwargs", "why"),
    [
        ("os.system", ["touch /tmp/x"], {}, "calls 'os.system', not worker.jobs.run_build"),
        ("worker.jobs.run_build.__globals__", GOOD_ARGS, {}, "not worker.jobs.run_build"),
        (JOB_FUNCTION, GOOD_ARGS, {"source": "/etc"}, "not (spec, source, timeout)"),
        (JOB_FUNCTION, [], {}, "not (spec, source, timeout)"),
        (JOB_FUNCTION, [*GOOD_ARGS, "extra"], {}, "not (spec, source, timeout)"),
        (JOB_FUNCTION, "abc", {}, "not (spec, source, timeout)"),
        (JOB_FUNCTION, ["{}"], {}, "spec is not a JSON object"),
        (JOB_FUNCTION, _args(spec={"python": "3.11; rm -rf /"}), {}, "spec is invalid"),
        (JOB_FUNCTION, _args(spec={"project": "../../etc"}), {}, "spec is invalid"),
        (JOB_FUNCTION, _args(spec={"cuda": None}), {}, "spec is invalid"),
        (JOB_FUNCTION, _args(spec={"version": "2.8.4"}), {}, "is not its spec's"),
        (JOB_FUNCTION, _args(source="relative/flash_attn-2.8.3.tar.gz"), {}, "absolute path"),
        (JOB_FUNCTION, _args(source="/root/.aws/credentials"), {}, "not an sdist"),
        (JOB_FUNCTION, _args(source="/tmp/flash_attn-2.8.4.tar.gz"), {},
         "not an sdist of flash-attn 2.8.3"),
        (JOB_FUNCTION, _args(source=["/tmp/flash_attn-2.8.3.tar.gz"]), {}, "absolute path"),
        (JOB_FUNCTION, _args(timeout=0), {}, "timeout 0 is not a positive"),
        (JOB_FUNCTION, _args(timeout=True), {}, "timeout True is not a positive"),
        (JOB_FUNCTION, _args(timeout="3600"), {}, "timeout '3600' is not a positive"),
    ],
)
def test_only_build_requests_pass(func: str, args: Any, kwargs: Any, why: str) -> None:
    with pytest.raises(RefusedJob, match=why.replace("(", r"\(").replace(")", r"\)")):
        JobCall.parse(SPEC.job_id, SPEC.queue_name, func, None, args, kwargs)


def test_the_job_id_and_queue_are_the_specs() -> None:
    parse = JobCall.parse
    assert parse(SPEC.job_id, SPEC.queue_name, JOB_FUNCTION, None, GOOD_ARGS, {}) \
        == JobCall(SPEC, None, 3600)
    assert parse(SPEC.job_id, SPEC.queue_name, JOB_FUNCTION, None,
                 [SPEC.to_dict(), "/tmp/flash_attn-2.8.3.tar.gz"], {}) \
        == JobCall(SPEC, "/tmp/flash_attn-2.8.3.tar.gz", None)
    with pytest.raises(RefusedJob, match="is not its spec's"):
        parse("../../escape", SPEC.queue_name, JOB_FUNCTION, None, GOOD_ARGS, {})
    with pytest.raises(RefusedJob, match="is not its spec's"):
        parse(SPEC.job_id, "build-cu130-x86_64", JOB_FUNCTION, None, GOOD_ARGS, {})
    with pytest.raises(RefusedJob, match="calls"):
        parse(SPEC.job_id, SPEC.queue_name, JOB_FUNCTION, "an instance", GOOD_ARGS, {})


WHEEL = "flash_attn-2.8.3+cu128torch2.8-cp311-cp311-linux_x86_64.whl"
SHA = "ab" * 32
PROOF = ProveCall(SPEC, WHEEL, SHA, "90")


def _proof_args(**changes: Any) -> list[Any]:
    spec = {**SPEC.to_dict(), **changes.pop("spec", {})}
    return [spec, changes.pop("filename", WHEEL), changes.pop("sha256", SHA),
            changes.pop("arch", "90")]


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        (_proof_args(), {"arch": "90"}, "not (spec, filename, sha256, arch)"),
        (_proof_args()[:3], {}, "not (spec, filename, sha256, arch)"),
        ([*_proof_args(), "extra"], {}, "not (spec, filename, sha256, arch)"),
        (["{}", WHEEL, SHA, "90"], {}, "spec is not a JSON object"),
        (_proof_args(spec={"project": "../../etc"}), {}, "spec is invalid"),
        (_proof_args(sha256="AB" * 32), {}, "is not a sha256"),
        (_proof_args(sha256=None), {}, "is not a sha256"),
        (_proof_args(arch="90; rm -rf /"), {}, "is not a GPU architecture"),
        (_proof_args(arch=90), {}, "is not a GPU architecture"),
        (_proof_args(filename="../../etc/passwd"), {}, "is not a file name"),
        (_proof_args(filename="/etc/" + WHEEL), {}, "is not a file name"),
        (_proof_args(filename="flash_attn-2.8.3.tar.gz"), {}, "is not a wheel"),
        (_proof_args(filename="torch-2.8.0-cp311-cp311-linux_x86_64.whl"), {},
         "is not of flash-attn"),
    ],
)
def test_only_proofs_of_a_wheel_pass_as_proof_jobs(args: Any, kwargs: Any, why: str) -> None:
    with pytest.raises(RefusedJob, match=why.replace("(", r"\(").replace(")", r"\)")):
        ProveCall.parse(PROOF.job_id, PROOF.queue_name, args, kwargs)


def test_a_proof_job_is_on_its_own_queue_and_a_build_is_not_on_one() -> None:
    """Each call is refused on the other's queue and under the other's id: a planted job can't
    turn a build queue's worker into a prover, nor a GPU host's proof queue into builds."""
    assert PROOF.job_id == f"prove-sm90-{SHA}" and PROOF.queue_name == "prove-sm90-x86_64"
    assert ProveCall.parse(PROOF.job_id, PROOF.queue_name, _proof_args(), {}) == PROOF
    with pytest.raises(RefusedJob, match="is not its call's"):
        ProveCall.parse(PROOF.job_id, SPEC.queue_name, _proof_args(), {})
    with pytest.raises(RefusedJob, match="is not its call's"):
        ProveCall.parse(PROOF.job_id, "prove-sm80-x86_64", _proof_args(), {})
    with pytest.raises(RefusedJob, match="is not its call's"):
        ProveCall.parse(f"prove-sm90-{'cd' * 32}", PROOF.queue_name, _proof_args(), {})
    with pytest.raises(RefusedJob, match="is not its spec's"):
        JobCall.parse(SPEC.job_id, PROOF.queue_name, JOB_FUNCTION, None, GOOD_ARGS, {})


def test_a_proof_job_runs_the_proof_function_only(conn: redis.Redis) -> None:
    """Enqueued as the fleet does, a proof job reads back as the same call, and the function
    it resolves to is the checked call's, never the one the job's data names."""
    assert q.enqueue_proofs(conn, SPEC, WHEEL, SHA, ["90a", "90", "80"]) \
        == [f"prove-sm80-{SHA}", PROOF.job_id]
    assert q.enqueue_proofs(conn, SPEC, WHEEL, SHA, ["90"]) == []  # once per wheel and arch
    job = q.fetch_job(conn, PROOF.job_id)
    assert job is not None and job.refusal is None and job.is_proof
    assert job.origin == PROOF.queue_name and list(job.args) == list(PROOF.to_args())
    assert job.func_name == PROVE_FUNCTION
    with pytest.raises(RefusedJob, match="not a build request"):
        _ = job.call
    plant_job(conn, PROOF.job_id + "x", PROOF.queue_name,
              zlib.compress(json.dumps([PROVE_FUNCTION, None, _proof_args(), {}]).encode()))
    planted = q.fetch_job(conn, PROOF.job_id + "x")
    assert planted is not None and not planted.is_proof
    assert planted.refusal is not None and "is not its call's" in planted.refusal


def test_the_call_the_queue_writes_is_the_call_the_worker_reads(conn: redis.Redis) -> None:
    """One type on both sides: what enqueue writes, the job (as a worker fetches it) reads."""
    q.enqueue_build(conn, SPEC, source="/tmp/flash_attn-2.8.3.tar.gz", require_worker=False,
                    timeout=1234)
    job = q.fetch_job(conn, SPEC.job_id)
    assert job is not None
    assert job.call == JobCall(SPEC, "/tmp/flash_attn-2.8.3.tar.gz", 1234)
    assert list(job.args) == list(job.call.to_args())


def test_a_planted_pickle_is_never_loaded(conn: redis.Redis, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Evil(marker))
    plant_job(conn, SPEC.job_id, SPEC.queue_name, zlib.compress(payload), meta=payload)
    # The web's and the worker's reads: the job, its status, every job in the registries.
    job = q.fetch_job(conn, SPEC.job_id)
    assert job is not None
    assert job.refusal is not None and "not JSON" in job.refusal
    assert job.func_name == REFUSED_CALL and job.args == [job.refusal]
    with pytest.raises(RefusedJob):
        job.func  # noqa: B018 (the property is what RQ calls)
    status = q.get_build(conn, SPEC.job_id)
    assert status is not None and status.state is q.BuildState.QUEUED
    assert [j.id for j in q.all_build_jobs(conn)] == [SPEC.job_id]
    assert not marker.exists()
    # The same payload through pickle (RQ's default) would have run it: the test is armed.
    pickle.loads(payload)
    assert marker.exists()


def test_a_planted_json_job_naming_other_code_is_refused(conn: redis.Redis) -> None:
    call = ["os.system", None, ["id"], {}]
    plant_job(conn, SPEC.job_id, SPEC.queue_name, json.dumps(call).encode(),
              failure_callback_name="os.system", success_callback_name="os.system",
              stopped_callback_name="os.system",
              webhooks=json.dumps([{"url": "http://169.254.169.254/", "events": ["failed"]}]))
    job = q.fetch_job(conn, SPEC.job_id)
    assert job is not None
    assert job.refusal == ("the job calls 'os.system', not worker.jobs.run_build (nor "
                           "worker.jobs.run_proof)")
    assert job.success_callback is None and job.failure_callback is None
    assert job.stopped_callback is None and job.webhooks == []
    with pytest.raises(RefusedJob, match=r"os\.system"):
        job.func  # noqa: B018


def test_a_malformed_job_is_no_job(conn: redis.Redis) -> None:
    call = [JOB_FUNCTION, None, GOOD_ARGS, {}]
    plant_job(conn, SPEC.job_id, SPEC.queue_name, json.dumps(call).encode(),
              created_at="yesterday")
    assert q.fetch_job(conn, SPEC.job_id) is None
    assert q.get_build(conn, SPEC.job_id) is None
