"""GPU proofs in the index (issue 27): kept beside the record, read back by the catalog, refused
where no GPU ran or for other bytes, and gone with the wheel. On both storages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.helpers import make_wheel
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.errors import NothingPublished, ProofDidNotRun, ProofMismatch
from wheelhouse.index import gc
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import PROOFS, Record
from wheelhouse.index.manage import Target, delete
from wheelhouse.index.proofs import GpuProof, now, read_proof, record_proof
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import Storage
from wheelhouse.variants import parse_variant

V = parse_variant("torch2.8-cu128")


def _publish(storage: Storage, tmp_path: Path, version: str = "1.0",
             body: str = "", gpu_code: bool = False) -> Record:
    wheel = make_wheel(tmp_path / version, "demo", f"{version}+{V.local_label}",
                       module_body=body)
    build = (BuildFacts(device_code={"demo/_C.so": {"sass": ["90"], "ptx": []}})
             if gpu_code else None)
    return publish(storage, wheel, V, build=build)


def _proof(record: Record, *, passed: bool = True, proven: bool = True) -> GpuProof:
    return GpuProof(filename=record.filename, sha256=record.sha256, proven=proven,
                    passed=passed, reason="ok" if passed else "max error 0.3",
                    gpu="NVIDIA H100 80GB HBM3" if proven else "", capability="90",
                    driver="580.65", cuda="13.0", torch="2.8.0", proof="generic", seconds=4.2,
                    proven_at=now(), host="ops@gpu1 (cli)")


def test_a_recorded_proof_reads_back_and_the_catalog_sees_it(storage: Storage,
                                                             tmp_path: Path) -> None:
    record = _publish(storage, tmp_path)
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.proof(record) is None and read_proof(storage, record) is None
    proof = _proof(record)
    record_proof(storage, record, proof)
    assert read_proof(storage, record) == proof
    assert catalog.proof(record) == proof  # a new generation: the catalog re-read
    assert storage.exists(record.proof_key) and record.proof_key.startswith(PROOFS)
    failed = _proof(record, passed=False)
    record_proof(storage, record, failed)  # proved again: the later result replaces it
    assert catalog.proof(record) == failed and read_proof(storage, record) == failed


def test_the_shape_ignores_fields_it_does_not_know() -> None:
    proof = GpuProof(filename="demo-1.0-py3-none-any.whl", sha256="a" * 64, proven=True,
                     passed=True, gpu="g", capability="90")
    data = json.loads(proof.to_json())
    assert data["version"] == 1
    newer = json.dumps({**data, "memory_gib": 80, "version": 2}).encode()
    assert GpuProof.from_json(newer) == dataclasses.replace(proof, version=2)
    with pytest.raises(ValueError, match="whether it ran"):
        GpuProof.from_json(json.dumps({"filename": "x", "sha256": "y"}).encode())


def test_a_proof_that_did_not_run_is_refused(storage: Storage, tmp_path: Path) -> None:
    record = _publish(storage, tmp_path)
    with pytest.raises(ProofDidNotRun, match="nothing is recorded"):
        record_proof(storage, record, _proof(record, passed=False, proven=False))
    assert not storage.exists(record.proof_key)
    assert read_proof(storage, record) is None


def test_a_proof_of_other_bytes_is_refused(storage: Storage, tmp_path: Path) -> None:
    record = _publish(storage, tmp_path)
    with pytest.raises(ProofMismatch, match=record.sha256):
        record_proof(storage, record, dataclasses.replace(_proof(record), sha256="0" * 64))
    assert not storage.exists(record.proof_key)


def test_a_proof_of_a_deleted_wheel_is_refused(storage: Storage, tmp_path: Path) -> None:
    record = _publish(storage, tmp_path)
    delete(storage, Target.parse(record.filename), who="t")
    with pytest.raises(NothingPublished):
        record_proof(storage, record, _proof(record))
    assert not storage.exists(record.proof_key)


def test_delete_removes_the_proof_and_a_republished_wheel_is_unproven(
        storage: Storage, tmp_path: Path) -> None:
    record = _publish(storage, tmp_path)
    record_proof(storage, record, _proof(record))
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.proof(record) is not None
    delete(storage, Target.parse(record.filename), who="t")
    assert not storage.exists(record.proof_key)
    again = _publish(storage, tmp_path / "again", body="X = 2\n")
    assert again.filename == record.filename and again.sha256 != record.sha256
    assert catalog.proof(again) is None
    # A proof left by the earlier bytes (a deletion cut short) is no proof of these.
    storage.put_bytes(again.proof_key, _proof(record).to_json())
    assert read_proof(storage, again) is None


def test_gc_prunes_the_proof_with_its_wheel(storage: Storage, tmp_path: Path) -> None:
    old, kept = _publish(storage, tmp_path, "1.0"), _publish(storage, tmp_path, "2.0")
    for r in (old, kept):
        record_proof(storage, r, _proof(r))
    doomed = gc.plan(storage, keep_versions=1)
    assert old.proof_key in {d.key for d in doomed}
    assert kept.proof_key not in {d.key for d in doomed}
    gc.apply(storage, doomed)
    assert not storage.exists(old.proof_key) and storage.exists(kept.proof_key)


def test_a_variant_form_carries_the_proof_of_its_wheel(storage: Storage,
                                                       tmp_path: Path) -> None:
    source = _publish(storage, tmp_path, gpu_code=True)
    catalog = Catalog(storage, refresh_seconds=0)
    [form] = catalog.variant_files(source.project)
    assert catalog.proof(form) is None
    proof = _proof(source)
    record_proof(storage, source, proof)
    assert catalog.proof(form) == proof == catalog.proof(source)
