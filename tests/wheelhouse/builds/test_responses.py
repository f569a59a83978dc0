"""The API's answers as typed values: each round-trips, a newer web's extra keys are ignored,
and a missing or mistyped required key is one clear InvalidResponse."""

from __future__ import annotations

from typing import Any

import pytest

from wheelhouse.builds.responses import (
    BuildsCreated,
    BuildView,
    CancelRequested,
    FleetView,
    LogPage,
    RequestPart,
    RequestView,
    SourceStored,
    SubmittedBuild,
    parse_view,
)
from wheelhouse.errors import InvalidResponse

PART = SubmittedBuild(id="build-a-sm80", python="3.11", variant="torch2.8-cu128-sm80",
                      state="queued", created=True, url="http://h/builds/build-a-sm80",
                      api="http://h/api/builds/build-a-sm80", arch="80")
SPLIT = SubmittedBuild(id="split-a", python="3.11", variant="torch2.8-cu128-sm80-sm90",
                       state="queued", created=True, parts=(PART,))
VIEW = BuildView(id="build-a", state="running", finished=False, phase="compile",
                 spec={"project": "flash-attn"}, progress={"done": 3, "total": 10,
                                                           "percent": 30.0},
                 urls={"page": "/builds/build-a"})
REQUEST = RequestView(id="split-a", state="queued", finished=False,
                      parts=(RequestPart(arch="80", id="build-a-sm80", state="queued",
                                         url="/builds/build-a-sm80"),),
                      archs=("80",), urls={"page": "/builds/split-a"})

ANSWERS: list[Any] = [
    BuildsCreated(builds=(SPLIT,), warnings=("torch was not checked",)),
    BuildsCreated(builds=(PART,)),
    VIEW,
    REQUEST,
    LogPage(lines=("[1/2] nvcc a.cu",), next=1, skipped=0),
    SourceStored(sha256="0" * 64, filename="vecadd-0.1.0.tar.gz", size=12),
    CancelRequested(id="build-a", state="cancelled"),
    CancelRequested(id="split-a", state="cancelled", parts=("build-a-sm80",)),
    FleetView(workers=({"name": "gpu-1", "cuda_versions": ["12.8"]},),
              servable=(("12.8", "x86_64"),), unavailable={"13.0": ["gpu-1: no toolkit"]}),
]


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: type(a).__name__)
def test_an_answer_round_trips(answer: Any) -> None:
    assert type(answer).from_json(answer.to_json()) == answer


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: type(a).__name__)
def test_a_newer_webs_extra_keys_are_ignored(answer: Any) -> None:
    assert type(answer).from_json(answer.to_json() | {"added_later": {"x": 1}}) == answer


def test_optional_keys_are_written_only_when_set_and_default_when_missing() -> None:
    assert "warnings" not in BuildsCreated(builds=(PART,)).to_json()
    assert "parts" not in PART.to_json() and "arch" not in SPLIT.to_json()
    assert "urls" not in BuildView(id="b", state="queued", finished=False).to_json()
    assert "url" not in RequestPart(arch="80", id="b", state="queued").to_json()
    assert LogPage.from_json({"lines": [], "next": 0}).skipped == 0
    assert BuildView.from_json({"id": "b", "state": "queued", "finished": False}).progress is None


def test_a_view_is_told_apart_by_its_kind() -> None:
    assert parse_view(REQUEST.to_json()) == REQUEST
    assert parse_view(VIEW.to_json()) == VIEW


@pytest.mark.parametrize(("reader", "data", "why"), [
    (BuildsCreated.from_json, {"warnings": []}, "no 'builds'"),
    (BuildsCreated.from_json, {"builds": [{"python": "3.11"}]}, "no 'id'"),
    (BuildView.from_json, {"id": "b", "state": "queued"}, "no 'finished'"),
    (BuildView.from_json, {"id": "b", "state": 3, "finished": False}, "'state' is int"),
    (RequestView.from_json, {"id": "s", "state": "queued", "finished": False,
                             "parts": [{"id": "b", "state": "queued"}]}, "no 'arch'"),
    (LogPage.from_json, {"lines": "not a list", "next": 0}, "'lines' is str"),
    (SourceStored.from_json, {"sha256": "0" * 64, "filename": "x.tar.gz"}, "no 'size'"),
    (CancelRequested.from_json, {"state": "cancelled"}, "no 'id'"),
    (FleetView.from_json, {"servable": []}, "no 'workers'"),
    (parse_view, ["not", "an", "object"], "expected a JSON object, got list"),
])
def test_a_missing_or_mistyped_required_key_is_one_clear_error(
        reader: Any, data: object, why: str) -> None:
    with pytest.raises(InvalidResponse, match=why):
        reader(data)
