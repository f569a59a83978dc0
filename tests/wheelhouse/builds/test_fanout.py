"""Split requests (``wheelhouse.builds.fanout``) against a real Redis: the record, its parts' job
ids,
the state derived from the parts', cancelling every part."""

from __future__ import annotations

import json

import pytest
from redis import Redis

from wheelhouse import keys
from wheelhouse.builds.fanout import (
    SplitRequest,
    cancel_request,
    is_request_id,
    load_request,
    recent_requests,
    record_request,
    request_id,
    request_state,
    request_status,
)
from wheelhouse.builds.queue import BuildState, enqueue_build, get_build
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import InvalidBuildSpec

SPEC = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80", "sm90"])
Q, B, OK, F, C = (BuildState.QUEUED, BuildState.BUILDING, BuildState.BUILT, BuildState.FAILED,
                  BuildState.CANCELLED)


def test_a_request_names_one_single_arch_part_per_arch_deterministically() -> None:
    request = SplitRequest.create(SPEC, SPEC.archs)
    assert request.id == request_id(SPEC) and is_request_id(request.id)
    assert not is_request_id(SPEC.job_id)
    assert request.archs == ("80", "90")
    specs = request.part_specs()
    assert [s.variant.key for s in specs] == ["torch2.14-cu130-sm80", "torch2.14-cu130-sm90"]
    assert [p.job_id for p in request.parts] == [s.job_id for s in specs]
    assert {s.python for s in specs} == {"3.11"} and SPEC.job_id not in [s.job_id for s in specs]
    assert SplitRequest.create(SPEC, SPEC.archs).parts == request.parts
    assert request.describe().endswith("one job per architecture: sm80, sm90")
    assert SplitRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request
    with pytest.raises(InvalidBuildSpec, match="at least two"):
        SplitRequest.create(SPEC, ["80", "80"])
    # A newer release's record is read by the fields this one knows (wheelhouse.shapes); a
    # record without a version is not one of ours.
    assert SplitRequest.from_dict({**request.to_dict(), "version": 99}) == request
    with pytest.raises(InvalidBuildSpec):
        SplitRequest.from_dict({**request.to_dict(), "version": None})


@pytest.mark.parametrize(("parts", "state"), [
    ([Q, Q], Q),
    ([OK, Q], Q),  # one published or built, the other waiting for a worker
    ([B, Q], B),
    ([OK, B], B),
    ([OK, OK], OK),
    ([F, B], F),  # failed as soon as any part failed; the request is not finished yet
    ([C, OK], C),
    ([C, F], F),
])
def test_the_requests_state_comes_from_its_parts(parts: list[BuildState],
                                                  state: BuildState) -> None:
    assert request_state(parts) is state


def test_the_record_is_kept_once_and_read_back(conn: Redis) -> None:
    first, created = record_request(conn, SplitRequest.create(SPEC, SPEC.archs))
    assert created
    # Asked again (even with other archs, as a changed recipe default would): the first stays.
    again, created = record_request(conn, SplitRequest.create(SPEC, ["80", "90", "100"]))
    assert not created and again == first
    assert load_request(conn, first.id) == first
    assert load_request(conn, "split-nope") is None
    assert [r.id for r in recent_requests(conn)] == [first.id]
    assert 0 < conn.ttl(keys.split(first.id)) <= 30 * 24 * 3600
    conn.set(keys.split("split-bad"), b"{not json")
    assert load_request(conn, "split-bad") is None


def test_cancelling_a_request_cancels_each_part_still_queued(conn: Redis) -> None:
    request, _ = record_request(conn, SplitRequest.create(SPEC, SPEC.archs))
    for spec in request.part_specs():
        enqueue_build(conn, spec, require_worker=False)
    status = request_status(conn, request)
    assert status.state is Q and not status.finished
    assert [p.state for p in status.parts] == [Q, Q]
    assert cancel_request(conn, request) == [p.job_id for p in request.parts]
    assert all(get_build(conn, p.job_id).state is C for p in request.parts)  # type: ignore[union-attr]
    status = request_status(conn, request)
    assert status.state is C and status.finished
    assert cancel_request(conn, request) == []  # nothing left to cancel
