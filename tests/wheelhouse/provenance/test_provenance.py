"""Provenance signed at publish under a CA made in the test, checked by code that shares nothing
with the signer (``cryptography`` and the specs by hand), and every tampered part refused."""

from __future__ import annotations

import base64
import json
import stat
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.helpers import make_wheel
from wheelhouse.builds.facts import AppliedPatch, BuildFacts, MaxJobs
from wheelhouse.errors import ProvenanceInvalid
from wheelhouse.index.layout import Record
from wheelhouse.index.manage import Target, delete
from wheelhouse.index.publish import Checked, publish, publish_checked
from wheelhouse.index.storage import LocalStorage
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import read_metadata, sha256_file

V = parse_variant("torch2.14-cu130")
SDIST_SHA = "ab" * 32
PATCH_SHA = "cd" * 32


def _facts() -> BuildFacts:
    return BuildFacts(
        build_id="job-42", recipe="generic", host="builder-1", toolkit="V13.0.48",
        torch="2.14.1+cu130", sdist="https://files.example/demo-1.0.tar.gz",
        sdist_sha256=SDIST_SHA, seconds=61.5, sandbox="bwrap",
        max_jobs=MaxJobs(jobs=3, reason="memory", per_thread_bytes=1, nvcc_threads=1,
                         available_bytes=1, reserve_bytes=1, cores=4, learned=False),
        patches=(AppliedPatch("generic", "fix-1", "a fix", PATCH_SHA),),
        device_code={"demo/_C.so": {"sass": ["80", "90"], "ptx": ["90"]}})


def _sign_for(identity: ca.Identity, facts: BuildFacts) -> Any:
    def sign(filename: str, sha256: str) -> bytes:
        predicate = predicates.build(project="demo", version="1.0", python="3.12",
                                     machine="x86_64", variant=V, archs=("80", "90"),
                                     facts=facts, signer=identity.name,
                                     finished=datetime.now(UTC))
        return attest.document([attest.Bundle({"kind": "wheelhouse-worker"}, (
            attest.sign(identity, filename, sha256, predicates.SLSA_PROVENANCE, predicate),))])
    return sign


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[ca.Identity, ca.Identity]:
    authority = ca.init_ca(tmp_path / "ca")
    return authority, ca.issue(authority, "worker-a")


@pytest.fixture
def built(tmp_path: Path, fleet: tuple[ca.Identity, ca.Identity]
          ) -> tuple[LocalStorage, Record, Path]:
    storage = LocalStorage(tmp_path / "data")
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}",
                       tag="cp312-cp312-linux_x86_64")
    record = publish_checked(storage, Checked(wheel, read_metadata(wheel)), V,
                             build=_facts(), sign=_sign_for(fleet[1], _facts()))
    return storage, record, wheel


def _b64(text: str) -> bytes:
    return base64.b64decode(text)


def test_ca_init_writes_a_private_key_and_a_ca_certificate(tmp_path: Path) -> None:
    made = ca.init_ca(tmp_path / "ca")
    key = tmp_path / "ca" / ca.CA_KEY
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((tmp_path / "ca" / ca.CA_CERT).read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert made.cert == cert
    with pytest.raises(FileExistsError):
        ca.init_ca(tmp_path / "ca")
    assert key.read_bytes() == made.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption())  # not replaced


def test_issued_certificates_are_short_lived_leaves_signed_by_the_ca(tmp_path: Path) -> None:
    authority = ca.init_ca(tmp_path / "ca")
    leaf = ca.issue(authority, "worker-a", days=2)
    cert_path, key_path = ca.write_identity(leaf, tmp_path / "out")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    authority.cert.public_key().verify(  # type: ignore[call-arg, union-attr]
        cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life.days <= 2
    assert ca.common_name(cert) == "worker-a"


def test_the_workspace_ca_is_made_once_and_reused(tmp_path: Path) -> None:
    directory = tmp_path / "ws" / "provenance"
    first = ca.local_identity(directory, "worker")
    again = ca.local_identity(directory, "worker")
    index = ca.local_identity(directory, "index")
    assert first.cert == again.cert
    assert index.cert.issuer == first.cert.issuer == ca.load_ca(directory).cert.subject
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_published_build_has_provenance_that_verifies_independently(
        built: tuple[LocalStorage, Record, Path], fleet: tuple[ca.Identity, ca.Identity]) -> None:
    storage, record, wheel = built
    raw = storage.get_bytes(record.provenance_key)
    assert record.provenance_sha256 == attest.digest(raw)
    stored = Record.from_json(storage.get_bytes(record.key))
    assert stored.provenance_sha256 == record.provenance_sha256

    # By hand, from the specs: PEP 740's objects, DSSE's PAE, in-toto's Statement.
    doc = json.loads(raw)
    assert doc["version"] == 1
    (att,) = doc["attestation_bundles"][0]["attestations"]
    cert = x509.load_der_x509_certificate(_b64(att["verification_material"]["certificate"]))
    fleet[0].cert.public_key().verify(  # type: ignore[call-arg, union-attr]
        cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    body = _b64(att["envelope"]["statement"])
    kind = b"application/vnd.in-toto+json"
    signed = b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)
    cert.public_key().verify(_b64(att["envelope"]["signature"]), signed,  # type: ignore[call-arg, union-attr]
                             ec.ECDSA(hashes.SHA256()))
    statement = json.loads(body)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": wheel.name, "digest": {"sha256": sha256_file(wheel)}}]
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    definition = statement["predicate"]["buildDefinition"]
    assert definition["externalParameters"] | {} == {
        "project": "demo", "version": "1.0", "python": "3.12", "machine": "x86_64",
        "torch": V.torch, "cuda": V.cuda, "archs": ["80", "90"], "variant": V.key}
    deps = {d["name"]: d for d in definition["resolvedDependencies"]}
    assert deps["sdist"] == {"name": "sdist", "uri": "https://files.example/demo-1.0.tar.gz",
                             "digest": {"sha256": SDIST_SHA}}
    assert deps["torch"]["uri"] == "pkg:pypi/torch@2.14.1+cu130"
    assert deps["cuda-toolkit"]["uri"] == "pkg:generic/cuda-toolkit@V13.0.48"
    assert deps["patch generic/fix-1"]["digest"] == {"sha256": PATCH_SHA}
    assert definition["internalParameters"]["max_jobs"] == 3
    run = statement["predicate"]["runDetails"]
    assert run["metadata"]["invocationId"] == "job-42"
    assert run["byproducts"][0]["annotations"]["sass"] == ["80", "90"]

    # And the module's own verifier agrees.
    (verified,) = attest.verify_document(raw, fleet[0].cert, wheel.name, sha256_file(wheel))
    assert verified.signer == "worker-a"


def _tampered(raw: bytes, part: str) -> bytes:
    doc = json.loads(raw)
    att = doc["attestation_bundles"][0]["attestations"][0]
    if part == "statement":
        body = json.loads(_b64(att["envelope"]["statement"]))
        body["predicate"]["buildDefinition"]["internalParameters"]["host"] = "elsewhere"
        att["envelope"]["statement"] = base64.b64encode(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).decode()
    elif part == "signature":
        sig = bytearray(_b64(att["envelope"]["signature"]))
        sig[-1] ^= 1
        att["envelope"]["signature"] = base64.b64encode(bytes(sig)).decode()
    elif part == "certificate":
        der = bytearray(_b64(att["verification_material"]["certificate"]))
        der[len(der) // 2] ^= 1
        att["verification_material"]["certificate"] = base64.b64encode(bytes(der)).decode()
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("part", "reason"), [
    ("statement", "does not match the statement"),
    ("signature", "does not match the statement"),
    ("certificate", "certificate"),
])
def test_tampering_with_any_part_fails_in_one_line(
        built: tuple[LocalStorage, Record, Path], fleet: tuple[ca.Identity, ca.Identity],
        part: str, reason: str) -> None:
    storage, record, wheel = built
    raw = _tampered(storage.get_bytes(record.provenance_key), part)
    with pytest.raises(ProvenanceInvalid, match=reason) as caught:
        attest.verify_document(raw, fleet[0].cert, wheel.name, sha256_file(wheel))
    assert "\n" not in str(caught.value)


def test_a_changed_wheel_fails(built: tuple[LocalStorage, Record, Path],
                               fleet: tuple[ca.Identity, ca.Identity]) -> None:
    storage, record, wheel = built
    raw = storage.get_bytes(record.provenance_key)
    with pytest.raises(ProvenanceInvalid, match=r"not .* with sha256"):
        attest.verify_document(raw, fleet[0].cert, wheel.name, "00" * 32)


def test_a_signer_of_another_ca_fails(built: tuple[LocalStorage, Record, Path],
                                      tmp_path: Path) -> None:
    storage, record, wheel = built
    other = ca.init_ca(tmp_path / "other", "someone else")
    with pytest.raises(ProvenanceInvalid, match="not issued by the fleet CA"):
        attest.verify_document(storage.get_bytes(record.provenance_key), other.cert,
                               wheel.name, sha256_file(wheel))
    with pytest.raises(InvalidSignature):  # and cryptography itself says so
        cert = x509.load_der_x509_certificate(attest.Provenance.from_json(
            storage.get_bytes(record.provenance_key)).bundles[0].attestations[0].certificate)
        other.cert.public_key().verify(  # type: ignore[call-arg, union-attr]
            cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))


def test_the_variant_form_gets_its_own_attestation(tmp_path: Path,
                                                   fleet: tuple[ca.Identity, ca.Identity]) -> None:
    storage = LocalStorage(tmp_path / "data")
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}",
                       tag="cp312-cp312-linux_x86_64")
    facts = _facts()
    record = publish(storage, wheel, V, build=facts, sign=_sign_for(fleet[1], facts))
    variants = [Record.from_json(storage.get_bytes(o.key)) for o in storage.list("records/")
                if o.key != record.key]
    assert [v.variant_of for v in variants] == [record.filename]
    (form,) = variants
    assert form.provenance_sha256 is not None
    (verified,) = attest.verify_document(storage.get_bytes(form.provenance_key), fleet[0].cert,
                                         form.filename, form.sha256)
    assert verified.signer == "worker-a"
    with pytest.raises(ProvenanceInvalid):  # not the source wheel's document
        attest.verify_document(storage.get_bytes(record.provenance_key), fleet[0].cert,
                               form.filename, form.sha256)


def test_the_record_owns_its_provenance(built: tuple[LocalStorage, Record, Path]) -> None:
    storage, record, _wheel = built
    assert record.keys()[record.provenance_key] == "provenance"
    assert storage.exists(record.provenance_key)
    stored = json.loads(record.to_json())
    # A reader older than provenance takes each top-level key as a field: none is added.
    assert set(stored) <= {f.name for f in fields(Record)} - {"provenance_sha256"}
    assert stored["build"]["provenance_sha256"] == record.provenance_sha256
    older = json.loads(record.to_json())
    del older["build"]["provenance_sha256"]
    assert Record.from_json(json.dumps(older).encode()).provenance_sha256 is None
    assert BuildFacts.from_dict(stored["build"]) == record.build
    newer = older | {"a_field_from_the_future": 1}
    assert Record.from_json(json.dumps(newer).encode()).filename == record.filename
    delete(storage, Target.parse(record.filename), who="test")
    assert not storage.exists(record.provenance_key)
    assert not storage.exists(record.wheel_key)


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path) -> None:
    """A signer whose key and certificate don't belong together (a file swapped, or a renewal
    read half-way for longer than it takes) signs nothing that would fail to verify."""
    authority = ca.init_ca(tmp_path / "ca")
    one, two = ca.issue(authority, "worker-1"), ca.issue(authority, "worker-1")
    cert_path, key_path = ca.write_identity(one, tmp_path / "w")
    ca.write_identity(two, tmp_path / "other")
    key_path.write_bytes((tmp_path / "other" / "worker-1.key").read_bytes())
    with pytest.raises(ProvenanceInvalid, match="is not the key of"):
        ca.load_identity(cert_path, key_path)
