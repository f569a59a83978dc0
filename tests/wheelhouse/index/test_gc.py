"""wheelhouse gc: leftovers, orphan claims and pruning, dry run first, on both storages."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.helpers import config_env, make_wheel
from wheelhouse.config import Config
from wheelhouse.index import gc, verify
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import claim_key, wheel_key
from wheelhouse.index.manage import Target, yank
from wheelhouse.index.proofs import GpuProof, record_proof
from wheelhouse.index.publish import Claim, Signer, publish
from wheelhouse.index.storage import S3Storage, Storage
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.variants import parse_variant

V = parse_variant("torch2.8-cu128")


def _publish(storage: Storage, tmp_path: Path, version: str, *, signed: bool = False) -> None:
    w = make_wheel(tmp_path / version, "demo", f"{version}+{V.local_label}")
    publish(storage, w, V, sign=_signer(tmp_path) if signed else None)


def _signer(tmp_path: Path) -> Signer:
    identity = ca.local_identity(tmp_path / "ca", "index")

    def sign(filename: str, sha256: str) -> bytes:
        predicate = predicates.publish(publisher="t", index="index", when=datetime.now(UTC))
        return attest.document([attest.Bundle({}, (attest.sign(
            identity, filename, sha256, predicates.PUBLISH, predicate),))])
    return sign


def test_leftovers_only_after_their_age(storage: Storage, tmp_path: Path) -> None:
    _publish(storage, tmp_path, "1.0")
    orphan = make_wheel(tmp_path / "o", "demo", f"9.0+{V.local_label}")
    storage.put_file(wheel_key(V, "demo", orphan.name), orphan)
    assert gc.plan(storage) == []  # young: may be a publication in progress
    later = time.time() + 2 * 24 * 3600
    doomed = gc.plan(storage, now=later)
    assert [d.key for d in doomed] == [wheel_key(V, "demo", orphan.name)]
    gc.apply(storage, doomed)
    assert not storage.exists(wheel_key(V, "demo", orphan.name))
    cat = Catalog(storage, 0)
    assert [r.version for r in cat.files(V, "demo")] == ["1.0+cu128torch2.8"]  # type: ignore[arg-type]


def test_uploaded_sdists_go_after_their_age(storage: Storage, tmp_path: Path) -> None:
    key = "sources/" + "a" * 64 + "/demo-1.0.tar.gz"
    storage.put_bytes(key, b"an sdist a build was requested from")
    assert gc.plan(storage, now=time.time() + 6 * 24 * 3600) == []
    doomed = gc.plan(storage, now=time.time() + 8 * 24 * 3600)
    assert [(d.key, d.why) for d in doomed] == [(key, "uploaded sdist, built from or expired")]
    gc.apply(storage, doomed)
    assert not storage.exists(key)


def test_prune_keeps_newest(storage: Storage, tmp_path: Path) -> None:
    for v in ("1.0", "1.1", "2.0"):
        _publish(storage, tmp_path, v)
    doomed = gc.plan(storage, keep_versions=2)
    assert sorted(d.key.split("/", 1)[0] for d in doomed) == [
        "claims", "records", "wheels", "wheels"]
    assert {d.key.rsplit("/", 1)[1] for d in doomed} == {
        "demo-1.0+cu128torch2.8-py3-none-any.whl",
        "demo-1.0+cu128torch2.8-py3-none-any.whl.metadata",
        "demo-1.0+cu128torch2.8-py3-none-any.whl.json",
    }
    # Planning deleted nothing.
    assert len(Catalog(storage, 0)) == 3
    gc.apply(storage, doomed)
    cat = Catalog(storage, 0)
    assert [r.version for r in cat.files(V, "demo")] == [  # type: ignore[arg-type]
        "1.1+cu128torch2.8", "2.0+cu128torch2.8"]
    assert gc.plan(storage, keep_versions=2, now=time.time() + 3 * 24 * 3600) == []


def test_prune_takes_the_logs_and_quarantine_markers_too(storage: Storage,
                                                         tmp_path: Path) -> None:
    """Every key a pruned wheel owns goes, not only its record, files and claim (its log,
    quarantine marker, yank marker, GPU proof and provenance too)."""
    for v in ("1.0", "2.0", "3.0"):
        _publish(storage, tmp_path, v, signed=True)
    old, kept = (next(r for r in Catalog(storage, 0).all_records() if r.version.startswith(v))
                 for v in ("1.0", "3.0"))
    for r in (old, kept):
        storage.put_bytes(r.log_key, b"the build's log\n")
        record_proof(storage, r, GpuProof(filename=r.filename, sha256=r.sha256, proven=True,
                                          passed=True, gpu="NVIDIA H100", capability="90"))
    storage.put_bytes(old.wheel_key, storage.get_bytes(old.wheel_key)[:-10])
    assert verify.quarantine(storage, verify.verify(storage)) == (1, 0)
    assert storage.exists(old.quarantine_key)
    yank(storage, Target.parse(old.filename), who="test")
    assert storage.exists(old.yank_key)
    before = {o.key for o in storage.list("")}
    doomed = gc.plan(storage, keep_versions=2)
    assert doomed[0].key == old.key  # unlisted first
    assert {d.key for d in doomed} == set(old.keys())
    gc.apply(storage, doomed)
    left = {o.key for o in storage.list("")}
    assert [k for k in left if old.filename in k] == []
    assert before - left == set(old.keys())
    assert old.provenance_key in before
    assert storage.exists(kept.log_key) and storage.exists(kept.proof_key)


def test_cli_dry_runs_first(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"))
    from wheelhouse.index.storage import open_storage

    storage = open_storage(config)
    for v in ("1.0", "2.0"):
        _publish(storage, tmp_path, v)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    dry = subprocess.run(["wheelhouse", "gc", "--keep-versions", "1"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "would delete records/torch2.8-cu128/demo/demo-1.0+cu128torch2.8" in dry
    assert len(Catalog(storage, 0)) == 2
    done = subprocess.run(["wheelhouse", "gc", "--keep-versions", "1", "--apply"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert "deleted 4 objects" in done
    assert len(Catalog(storage, 0)) == 1


def _claim(storage: Storage, filename: str, age: float, sha: str = "0" * 64) -> str:
    key = claim_key(V, filename)
    claim = Claim(sha256=sha, id="x", host="gone-host", pid=7, claimed_at=time.time() - age)
    storage.put_bytes(key, claim.to_json())
    return key


def test_orphan_claims_after_the_publish_timeout(storage: Storage, tmp_path: Path) -> None:
    _publish(storage, tmp_path, "1.0")  # its claim has a record: never an orphan
    young = _claim(storage, "demo-2.0+cu128torch2.8-py3-none-any.whl", age=60)
    old = _claim(storage, "demo-3.0+cu128torch2.8-py3-none-any.whl", age=7200)
    doomed = gc.plan(storage, claim_timeout=3600)
    assert [(d.key, d.why.split(" (")[0]) for d in doomed] == [(old, "orphan claim")]
    assert "gone-host (pid 7), claimed 720" in doomed[0].why
    assert gc.apply(storage, doomed) == 1
    assert not storage.exists(old) and storage.exists(young)
    assert len(Catalog(storage, 0)) == 1


def test_a_claim_taken_over_after_planning_is_not_deleted(storage: Storage,
                                                          tmp_path: Path) -> None:
    name = "demo-3.0+cu128torch2.8-py3-none-any.whl"
    key = _claim(storage, name, age=7200)
    doomed = gc.plan(storage, claim_timeout=3600)
    assert [d.key for d in doomed] == [key]
    # A publisher takes the orphan over between plan and apply.
    w = make_wheel(tmp_path / "w", "demo", f"3.0+{V.local_label}")
    record = publish(storage, w, V, claim_timeout=3600)
    assert gc.apply(storage, doomed) == 0
    assert Claim.parse(storage.get_bytes(key), 0.0).sha256 == record.sha256


def test_abandoned_multipart_uploads_are_listed(s3_storage: S3Storage) -> None:
    up = s3_storage.client.create_multipart_upload(
        Bucket=s3_storage.bucket, Key=s3_storage.prefix + f"wheels/{V.key}/demo/demo.whl")
    # (moto dates every upload 2010-11-10, so "too young to collect" can't be shown here; the
    # age rule is the one local partial writes follow, tested above.)
    doomed = gc.plan(s3_storage, now=time.time() + 2 * 24 * 3600)
    assert [(d.key, d.why, d.partial) for d in doomed] == [
        (f"wheels/{V.key}/demo/demo.whl?uploadId={up['UploadId']}",
         "abandoned multipart upload", True)]
    gc.apply(s3_storage, doomed)
    assert list(s3_storage.list_partials()) == []


def test_cli_lists_orphan_claims(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), publish_timeout=60)
    from wheelhouse.index.storage import open_storage

    key = _claim(open_storage(config), "demo-3.0+cu128torch2.8-py3-none-any.whl", age=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    dry = subprocess.run(["wheelhouse", "gc"], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert f"would delete {key} (" in dry and "orphan claim" in dry
