"""BuildFacts: what a build measured, the same in the record, the job's meta and a failure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from wheelhouse.builds.facts import AppliedPatch, BuildFacts, CompileCacheStats, MaxJobs, Reaped

#: A decision from before targets were counted.
OLD_JOBS = MaxJobs(jobs=6, reason="MAX_JOBS=6: 6 jobs of 5.0 GiB fit",
                   per_thread_bytes=5 * 2**30, nvcc_threads=2, available_bytes=40 * 2**30,
                   reserve_bytes=8 * 2**30, cores=32, learned=True)
JOBS = MaxJobs(jobs=3, reason="MAX_JOBS=3: 3 jobs of 10.0 GiB fit", per_thread_bytes=5 * 2**30,
               nvcc_threads=4, available_bytes=40 * 2**30, reserve_bytes=8 * 2**30, cores=32,
               learned=False, targets=2, effective_threads=2)
FULL = BuildFacts(
    build_id="wh1a2b3c4d-build-x", recipe="flash-attn", host="gpu-1", toolkit="V13.0.88",
    torch="2.14.1+cu130", sdist="flash_attn-2.8.3.tar.gz", sdist_sha256="ab" * 32,
    max_jobs=JOBS, peak_tree_bytes=3 * 2**30, peak_job_bytes=2**30, governor_pauses=2,
    reaped=Reaped(processes=3, signals=("SIGTERM", "SIGKILL"), seconds=5.2, survivors=0),
    seconds=812.4, log_key="logs/torch2.14-cu130/flash-attn/x.whl.log",
    patches=(AppliedPatch(recipe="flash-attn", id="cxx20", description="C++20", sha256="cd" * 32),),
    device_code={"flash_attn_2_cuda.so": {"sass": ["80", "90a"], "ptx": ["90"]},
                 "helper.so": {"sass": [], "ptx": []}},
    compile_cache=CompileCacheStats(requests=300, hits=280, misses=4, not_cacheable=16,
                                    hits_by_language={"CUDA": 280},
                                    misses_by_language={"C++": 4}, location="Local disk"),
    step_seconds={"toolkit": 0.1, "fetch": 2.5, "venv": 8.0, "compile": 780.2, "check": 20.0},
)

#: What the worker wrote into records before BuildFacts existed (a dict it built step by step).
OLD_RECORD_BUILD: dict[str, Any] = {
    "build_id": "build-x", "recipe": "cudaext", "host": "box", "toolkit": "V13.0.88",
    "torch": "2.14.1+cu130", "sdist": "cudaext-0.1.0.tar.gz",
    "max_jobs": {**OLD_JOBS.to_dict()}, "peak_tree_bytes": 123, "governor_pauses": 0,
    "reaped": {"processes": 1, "signals": ["SIGTERM"], "seconds": 0.01, "survivors": 0},
    "peak_job_bytes": 45, "seconds": 61.2, "log_key": "logs/x.log",
}


def test_round_trip_through_json() -> None:
    data = json.loads(json.dumps(FULL.to_dict()))
    assert BuildFacts.from_dict(data) == FULL
    assert data["reaped"]["signals"] == ["SIGTERM", "SIGKILL"]
    assert data["max_jobs"]["reason"] == JOBS.reason


def test_what_is_not_known_is_left_out() -> None:
    assert BuildFacts().to_dict() == {}
    assert BuildFacts(build_id="b", seconds=1.5).to_dict() == {"build_id": "b", "seconds": 1.5}
    assert BuildFacts.from_dict({}) == BuildFacts()


def test_older_records_read_back() -> None:
    facts = BuildFacts.from_dict(OLD_RECORD_BUILD)
    assert facts.max_jobs == OLD_JOBS and facts.peak_tree_bytes == 123
    assert "targets" not in OLD_RECORD_BUILD["max_jobs"]
    assert facts.reaped == Reaped(processes=1, signals=("SIGTERM",), seconds=0.01, survivors=0)
    assert facts.to_dict() == OLD_RECORD_BUILD


@pytest.mark.parametrize("data", [None, [], "x", 3])
def test_no_facts_at_all(data: Any) -> None:
    assert BuildFacts.from_dict(data) == BuildFacts()


def test_unknown_keys_are_ignored_and_mistyped_values_dropped() -> None:
    facts = BuildFacts.from_dict({
        "build_id": "b", "from_the_future": {"x": 1}, "peak_tree_bytes": "3 GiB",
        "governor_pauses": True, "seconds": 2, "toolkit": 13, "reaped": "none",
        "max_jobs": {"jobs": 2, "reason": "r"},  # fields missing: not a decision to stand by
    })
    assert facts == BuildFacts(build_id="b", seconds=2.0)
    assert isinstance(facts.seconds, float)


def test_issue_13_facts_read_back_and_summarize() -> None:
    data = json.loads(json.dumps(FULL.to_dict()))
    assert data["patches"] == [{"recipe": "flash-attn", "id": "cxx20", "description": "C++20",
                                "sha256": "cd" * 32}]
    assert data["compile_cache"]["hit_rate"] == 0.986
    facts = BuildFacts.from_dict(data)
    assert facts.sass_archs == ["80", "90a"] and facts.ptx_archs == ["90"]
    assert facts.device_code_summary() == "sm_80, sm_90a (+PTX compute_90)"
    assert BuildFacts().device_code_summary() is None
    assert BuildFacts(device_code={}).device_code_summary() == "no SASS"
    # No patches applied is a fact too, unlike not knowing.
    assert BuildFacts.from_dict({"patches": []}).patches == ()
    assert BuildFacts.from_dict({}).patches is None


def test_mistyped_issue_13_facts_are_dropped() -> None:
    facts = BuildFacts.from_dict({
        "patches": [{"recipe": "x", "id": 3}, "nope",
                    {"recipe": "r", "id": "i", "description": "d", "sha256": "s"}],
        "device_code": {"a.so": {"sass": ["80", 90], "ptx": "90"}, "b.so": "x"},
        "compile_cache": {"hits": "many", "misses": 2, "hits_by_language": {"CUDA": "1"}},
    })
    assert facts.patches == (AppliedPatch("r", "i", "d", "s"),)
    assert facts.device_code == {"a.so": {"sass": ["80"], "ptx": []}}
    assert facts.compile_cache == CompileCacheStats(misses=2)


def test_the_record_says_what_each_job_was_charged_for() -> None:
    data = json.loads(json.dumps(FULL.to_dict()))
    assert data["max_jobs"]["targets"] == 2 and data["max_jobs"]["effective_threads"] == 2
    facts = BuildFacts.from_dict(data)
    assert facts.max_jobs is not None
    assert facts.max_jobs.charge_summary() == (
        "10.0 GiB per compile job: 2 device targets on 2 nvcc threads (NVCC_THREADS=4)")
    assert OLD_JOBS.charge_summary() is None  # an older record did not count targets
    mistyped = BuildFacts.from_dict({"max_jobs": {**JOBS.to_dict(), "targets": "2",
                                                  "effective_threads": True}})
    assert mistyped.max_jobs is not None and mistyped.max_jobs.targets is None
    assert mistyped.max_jobs.effective_threads is None


def test_each_steps_seconds_read_back_in_order_and_summarize() -> None:
    # Pairs, not an object: records are written with sorted keys, which would lose the order.
    data = json.loads(json.dumps(FULL.to_dict(), sort_keys=True))
    assert [name for name, _ in data["step_seconds"]] == [
        "toolkit", "fetch", "venv", "compile", "check"]
    assert BuildFacts.from_dict(data).steps_summary() == (
        "toolkit 0.1 s, fetch 2.5 s, venv 8.0 s, compile 780.2 s, check 20.0 s")
    assert BuildFacts().steps_summary() is None
    # What is not a number of seconds is dropped; nothing at all is not known.
    assert BuildFacts.from_dict({"step_seconds": [["venv", "8 s"], ["compile", 3],
                                                   ["check", True], [4, 1.0], ["x"], "y"]}
                                ).step_seconds == {"compile": 3.0}
    assert BuildFacts.from_dict({"step_seconds": [["venv", None]]}).step_seconds is None
    assert BuildFacts.from_dict({"step_seconds": {"venv": 1.0}}).step_seconds is None
