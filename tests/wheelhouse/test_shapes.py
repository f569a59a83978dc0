"""wheelhouse.shapes: every stored or advertised shape is read by an older release when a newer
one wrote it with fields the older one doesn't know (a rolling upgrade)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import make_wheel
from wheelhouse.builds.fanout import SplitRequest
from wheelhouse.builds.fleet import GpuInfo, ToolkitInfo, WorkerAd
from wheelhouse.builds.meta import JobMeta
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.index.layout import Record
from wheelhouse.index.ownership import Owners
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant

NEWER = {"field_from_the_future": {"nested": [1, 2]}, "another": "x"}


def _newer(document: dict[str, Any]) -> bytes:
    return json.dumps({**document, **NEWER}).encode()


def test_a_record_from_a_newer_release_is_read_and_listed(tmp_path: Path) -> None:
    variant = parse_variant("torch2.14-cu130")
    storage = open_storage(Config(storage=str(tmp_path / "data")))
    wheel = make_wheel(tmp_path, "demo", f"1.0+{variant.local_label}")
    record = publish(storage, wheel, variant)
    newer = _newer(json.loads(record.to_json()))
    assert Record.from_json(newer) == record


def test_an_advert_from_a_newer_worker_is_read() -> None:
    ad = WorkerAd(name="w", hostname="h", machine="x86_64", cores=2, memory_bytes=1,
                  toolkits=(ToolkitInfo(cuda="13.0", home="/c", nvcc="/c/bin/nvcc"),),
                  gpus=(GpuInfo(name="H200", arch="90"),))
    raw = json.loads(ad.to_json())
    raw["toolkits"] = [{**t, **NEWER} for t in raw["toolkits"]]
    raw["gpus"] = [{**g, **NEWER} for g in raw["gpus"]]
    assert WorkerAd.from_json(_newer(raw)) == ad


def test_a_split_request_of_a_newer_version_is_read() -> None:
    spec = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8",
                            archs=["sm80", "sm90"])
    request = SplitRequest.create(spec, ["80", "90"])
    raw = {**request.to_dict(), "version": request.to_dict()["version"] + 1, **NEWER}
    assert SplitRequest.from_dict(raw) == request


def test_job_meta_and_owner_records_of_a_newer_release_are_read() -> None:
    meta = JobMeta.from_meta({"version": 99, "phase": "compile", **NEWER})
    assert meta.phase == "compile"
    owners = Owners.from_json(_newer({"project": "x", "owners": ["alice"], "private": True,
                                      "created_at": 1.0}))
    assert owners.owners == ("alice",) and owners.private
