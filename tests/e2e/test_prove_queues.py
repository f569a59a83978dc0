"""Issue 27: the fleet's GPU proofs go through ``prove-sm<arch>`` queues, and only a host with
that GPU takes them.

Real parts throughout: Redis, ``wheelhouse worker`` processes in burst mode (each its own
workspace, as two hosts would have) and a sandboxed build of the C extension fixture, which
holds sm_80 device code as the recipe's ``TORCH_CUDA_ARCH_LIST`` asks (no nvcc: seconds). A
build that publishes queues the wheel's proof; a CPU-only worker drains its queues and leaves
the proof alone; a worker told it has an sm_80 GPU (``WHEELHOUSE_PROVE_ARCHS=80``, as a GPU
host's ``nvidia-smi`` would) takes it, runs the proof in the sandbox, finds no GPU (this
machine has none) and records nothing.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import redis

from tests.helpers import build_job, fake_cuda_toolkit, run_worker
from tests.worker.conftest import FIXTURES, SANDBOXED_BUILDS, build_config, make_sdist
from wheelhouse.builds import queue as q
from wheelhouse.builds.job import ProveCall
from wheelhouse.builds.meta import JobMeta
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import FailureKind
from wheelhouse.index import layout
from wheelhouse.index.layout import Record
from wheelhouse.index.proofs import read_proof
from wheelhouse.index.storage import open_storage

pytestmark = SANDBOXED_BUILDS

SPEC = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])


def _burst(config: Config, name: str, log: Path, *args: str, env: dict[str, str]) -> str:
    """Run one worker until its queues are empty; return its log."""
    with run_worker(config, name, log, "--burst", *args, extra_env=env) as proc:
        proc.wait(timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def test_a_published_wheel_is_proven_only_by_a_worker_with_its_gpu(
        tmp_path: Path, redis_url: str) -> None:
    config = replace(build_config(tmp_path), redis_url=redis_url, upstream="off",
                     torch_check=False, worker_heartbeat_seconds=1)
    conn = redis.Redis.from_url(redis_url)
    env = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")),
           "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))}
    sdist = make_sdist(FIXTURES / "cext", tmp_path / "sdist", "cext", "0.1.0")
    q.enqueue_build(conn, SPEC, source=str(sdist), require_worker=False, timeout=1800)

    # A CPU-only host: builds, and never takes a proof (burst mode ends once its queues are
    # empty, so had it listened on prove-sm80 it would have run the proof).
    cpu_log = _burst(replace(config, workspace=str(tmp_path / "work-cpu")), "cpu-only",
                     tmp_path / "cpu.log", "--cuda", "13.0", env=env)
    built = build_job(conn, SPEC.job_id)
    assert built.get_status(refresh=True) == "finished", cpu_log[-4000:]
    storage = open_storage(config)
    record = Record.from_json(storage.get_bytes(layout.record_key(
        SPEC.variant.base, "cext", SPEC.expected_wheel_name)))
    call = ProveCall(SPEC, record.filename, record.sha256, "80")
    assert call.queue_name == "prove-sm80-x86_64"
    proof_job = build_job(conn, call.job_id)
    assert proof_job.get_status(refresh=True) == "queued"
    assert proof_job.origin == call.queue_name and proof_job.worker_name is None
    assert call.job_id in q.BuildQueues(conn).queue(call.queue_name).job_ids
    [listening] = [ln for ln in cpu_log.splitlines() if ln.startswith("listening on ")]
    assert "prove-" not in listening and "build-cu130-x86_64" in listening

    # A host that says it has an sm_80 GPU takes the proof; with no GPU there, nothing is
    # recorded and the job fails as infrastructure (worth another host's try).
    prover_log = _burst(replace(config, workspace=str(tmp_path / "work-gpu"), prove_archs="80"),
                        "sm80-host", tmp_path / "prover.log", "--cuda", "13.0", env=env)
    assert "listening on prove-sm80-x86_64, build-cu130-x86_64" in prover_log  # proofs first
    proof_job = build_job(conn, call.job_id)
    assert proof_job.worker_name == "sm80-host", prover_log[-4000:]
    assert proof_job.get_status(refresh=True) in ("failed", "scheduled"), prover_log[-4000:]
    meta = JobMeta.from_meta(proof_job.get_meta(refresh=True))
    assert meta.failure is not None, prover_log[-4000:]
    assert meta.failure.kind is FailureKind.INFRASTRUCTURE, meta.failure
    assert "no GPU ran the proof" in meta.failure.reason
    # Its steps' seconds: "prove" counts both its parts, the checks' sandboxed runs included
    # (the first part, copying the wheel from local storage, takes milliseconds).
    assert meta.build.step_seconds is not None, meta
    assert list(meta.build.step_seconds) == ["prove", "venv"], meta.build.step_seconds
    assert meta.build.step_seconds["prove"] >= 1.0, meta.build.step_seconds
    assert read_proof(storage, record) is None
    assert not [o.key for o in storage.list("") if "proof" in o.key]  # nothing half-written
    # The build job is untouched by the proof, and no second build ran.
    assert build_job(conn, SPEC.job_id).worker_name == "cpu-only"
