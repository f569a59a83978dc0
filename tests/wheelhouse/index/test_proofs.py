"""GPU proofs in the index (issue 27): kept beside the record, read back by the catalog, refused
where no GPU ran or for other bytes, and gone with the wheel. On both storages. Signed under a
CA made in the test, checked by hand with ``cryptography`` and by ``verify_proof``, and every
part changed after signing refused."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from tests.helpers import make_wheel
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.errors import NothingPublished, ProofDidNotRun, ProofMismatch, ProvenanceInvalid
from wheelhouse.index import gc
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import PROOFS, Record
from wheelhouse.index.manage import Target, delete
from wheelhouse.index.proofs import (
    GpuProof,
    now,
    read_proof,
    record_proof,
    sign_proof,
    verify_proof,
)
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import Storage
from wheelhouse.provenance import ca, predicates
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


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[ca.Identity, ca.Identity]:
    authority = ca.init_ca(tmp_path / "ca")
    return authority, ca.issue(authority, "prover-gpu1")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def test_a_signed_proof_verifies_by_hand_and_by_verify_proof(
        storage: Storage, tmp_path: Path, fleet: tuple[ca.Identity, ca.Identity]) -> None:
    record = _publish(storage, tmp_path)
    signed = sign_proof(_proof(record), fleet[1])
    assert signed.attestation is not None and _proof(record).attestation is None
    record_proof(storage, record, signed)
    stored = read_proof(storage, record)
    assert stored == signed

    # By hand: PEP 740's object, the leaf issued by the CA, ECDSA over DSSE's PAE.
    assert stored is not None and stored.attestation is not None
    att = stored.attestation
    assert att["version"] == 1 and att["verification_material"]["transparency_entries"] == []
    cert = x509.load_der_x509_certificate(_unb64(att["verification_material"]["certificate"]))
    fleet[0].cert.public_key().verify(  # type: ignore[call-arg, union-attr]
        cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    body = _unb64(att["envelope"]["statement"])
    kind = b"application/vnd.in-toto+json"
    cert.public_key().verify(  # type: ignore[call-arg, union-attr]
        _unb64(att["envelope"]["signature"]),
        b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body), ec.ECDSA(hashes.SHA256()))
    statement = json.loads(body)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": record.filename,
                                     "digest": {"sha256": record.sha256}}]
    assert statement["predicateType"] == "urn:wheelhouse:gpu-proof:v1"
    assert statement["predicate"] == {
        "gpu": "NVIDIA H100 80GB HBM3", "capability": "90", "driver": "580.65", "cuda": "13.0",
        "torch": "2.8.0", "proof": "generic", "proven": True, "passed": True, "reason": "ok",
        "seconds": 4.2, "proven_at": stored.proven_at, "host": "ops@gpu1 (cli)"}

    # And the module's own verifier agrees, and says so in a line.
    verified = verify_proof(stored, fleet[0].cert)
    assert verified.signer == "prover-gpu1"
    (line,) = predicates.summary(verified.predicate_type, verified.predicate, verified.signer)
    assert line.startswith("proven on NVIDIA H100 80GB HBM3 (sm_90), driver 580.65, CUDA 13.0, "
                           "torch 2.8.0 (generic proof, 4.2 s, ")
    assert line.endswith("on ops@gpu1 (cli)), by prover-gpu1")
    failed = verify_proof(sign_proof(_proof(record, passed=False), fleet[1]), fleet[0].cert)
    (line,) = predicates.summary(failed.predicate_type, failed.predicate, failed.signer)
    assert line.startswith("FAILED on NVIDIA H100") and ": max error 0.3, by prover" in line


def test_an_unsigned_proof_is_not_verified(fleet: tuple[ca.Identity, ca.Identity]) -> None:
    proof = GpuProof(filename="demo-1.0-py3-none-any.whl", sha256="a" * 64, proven=True,
                     passed=True)
    with pytest.raises(ProvenanceInvalid, match="is not signed"):
        verify_proof(proof, fleet[0].cert)
    # An older proof file, without the field, still reads.
    older = {k: v for k, v in json.loads(proof.to_json()).items() if k != "attestation"}
    assert GpuProof.from_json(json.dumps(older).encode()) == proof


def _resigned_statement(att: dict[str, Any]) -> None:
    body = json.loads(_unb64(att["envelope"]["statement"]))
    body["predicate"]["gpu"] = "NVIDIA A100"
    att["envelope"]["statement"] = base64.b64encode(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).decode()


def _flipped_signature(att: dict[str, Any]) -> None:
    sig = bytearray(_unb64(att["envelope"]["signature"]))
    sig[-1] ^= 1
    att["envelope"]["signature"] = base64.b64encode(bytes(sig)).decode()


def _foreign_certificate(att: dict[str, Any], other: ca.Identity) -> None:
    # The whole attestation by a signer of another CA, over the same statement.
    from wheelhouse.provenance import attest
    statement = json.loads(_unb64(att["envelope"]["statement"]))
    mine = attest.sign(other, statement["subject"][0]["name"],
                       statement["subject"][0]["digest"]["sha256"],
                       statement["predicateType"], statement["predicate"]).to_dict()
    att.update(mine)


@pytest.mark.parametrize(("part", "reason"), [
    ("passed", "was changed after 'prover-gpu1' signed it: passed is False in the proof, "
               "True as signed"),
    ("gpu", "gpu is 'NVIDIA A100' in the proof, 'NVIDIA H100 80GB HBM3' as signed"),
    ("sha256", "the statement is about demo-1.0"),
    ("statement", "does not match the statement"),
    ("signature", "does not match the statement"),
    ("certificate", "not issued by the fleet CA 'wheelhouse fleet CA'"),
])
def test_a_proof_changed_after_signing_fails_in_one_line(
        storage: Storage, tmp_path: Path, fleet: tuple[ca.Identity, ca.Identity],
        part: str, reason: str) -> None:
    record = _publish(storage, tmp_path)
    record_proof(storage, record, sign_proof(_proof(record), fleet[1]))
    # Edited where it is kept, as someone with write access to storage would.
    data = json.loads(storage.get_bytes(record.proof_key))
    if part == "passed":
        data["passed"] = False
    elif part == "gpu":
        data["gpu"] = "NVIDIA A100"
    elif part == "sha256":
        data["sha256"] = "0" * 64
    elif part == "statement":
        _resigned_statement(data["attestation"])
    elif part == "signature":
        _flipped_signature(data["attestation"])
    else:
        _foreign_certificate(data["attestation"], ca.issue(ca.init_ca(tmp_path / "other",
                                                                      "another"), "prover"))
    tampered = GpuProof.from_json(json.dumps(data).encode())
    with pytest.raises(ProvenanceInvalid, match=reason) as caught:
        verify_proof(tampered, fleet[0].cert)
    assert "\n" not in str(caught.value)
