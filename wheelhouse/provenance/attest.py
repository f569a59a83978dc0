"""PEP 740 attestations and provenance documents, signed and verified under the fleet CA.

An attestation is PEP 740's object: ``verification_material.certificate`` (base64 DER of the
signer's certificate) and ``envelope`` (``statement``: the in-toto v1 Statement's bytes,
``signature``: ECDSA P-256 / SHA-256 over the DSSE pre-authentication encoding of those bytes,
as in-toto's DSSE envelopes sign). ``transparency_entries`` is empty: trust here is the fleet CA,
not Sigstore's log. A provenance document (``<file>.provenance``) is PEP 740's provenance
object: ``{"version": 1, "attestation_bundles": [{"publisher": ..., "attestations": [...]}]}``.

Verification is the reader's side: the certificate must be issued directly by the CA and be
valid when the statement says it was signed, the signature must hold over the statement, and
the statement's one subject must be the file's name and sha256. Readers ignore keys they don't
know.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from wheelhouse.errors import ProvenanceInvalid
from wheelhouse.provenance.ca import Identity, common_name
from wheelhouse.provenance.predicates import signed_at

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
#: The suffix of a file's provenance document, beside the file (PEP 740).
SUFFIX = ".provenance"


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, so a payload can't be replayed as
    another type."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def statement(filename: str, sha256: str, predicate_type: str,
              predicate: Mapping[str, Any]) -> bytes:
    """An in-toto v1 Statement about one file, as canonical JSON bytes."""
    return json.dumps({"_type": STATEMENT_TYPE,
                       "subject": [{"name": filename, "digest": {"sha256": sha256}}],
                       "predicateType": predicate_type, "predicate": predicate},
                      sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Attestation:
    """One signed statement, with the certificate of its signer."""

    certificate: bytes
    """DER."""
    statement: bytes
    signature: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1,
                "verification_material": {"certificate": _b64(self.certificate),
                                          "transparency_entries": []},
                "envelope": {"statement": _b64(self.statement),
                             "signature": _b64(self.signature)}}

    @classmethod
    def from_dict(cls, data: object) -> Attestation:
        try:
            if not isinstance(data, Mapping) or data.get("version") != 1:
                raise ProvenanceInvalid("not a version 1 attestation object")
            material, envelope = data["verification_material"], data["envelope"]
            return cls(certificate=_unb64(material["certificate"]),
                       statement=_unb64(envelope["statement"]),
                       signature=_unb64(envelope["signature"]))
        except (KeyError, TypeError) as exc:
            raise ProvenanceInvalid(f"attestation object lacks {exc}") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ProvenanceInvalid("attestation field is not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ProvenanceInvalid("attestation field is not valid base64") from None


def sign(identity: Identity, filename: str, sha256: str, predicate_type: str,
         predicate: Mapping[str, Any]) -> Attestation:
    body = statement(filename, sha256, predicate_type, predicate)
    signature = identity.key.sign(pae(PAYLOAD_TYPE, body), ec.ECDSA(hashes.SHA256()))
    return Attestation(identity.cert.public_bytes(serialization.Encoding.DER), body, signature)


@dataclass(frozen=True)
class Bundle:
    """Attestations by one publisher (PEP 740's ``AttestationBundle``)."""

    publisher: Mapping[str, Any]
    attestations: tuple[Attestation, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"publisher": dict(self.publisher),
                "attestations": [a.to_dict() for a in self.attestations]}


@dataclass(frozen=True)
class Provenance:
    """PEP 740's provenance object: what ``<file>.provenance`` holds."""

    bundles: tuple[Bundle, ...]

    def to_json(self) -> bytes:
        return json.dumps({"version": 1,
                           "attestation_bundles": [b.to_dict() for b in self.bundles]},
                          sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Provenance:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ProvenanceInvalid("the provenance document is not JSON") from None
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ProvenanceInvalid("not a version 1 provenance object")
        bundles = data.get("attestation_bundles")
        if not isinstance(bundles, list) or not bundles:
            raise ProvenanceInvalid("the provenance object holds no attestation bundles")
        out = []
        for b in bundles:
            if not isinstance(b, dict) or not isinstance(b.get("attestations"), list):
                raise ProvenanceInvalid("an attestation bundle lacks its attestations")
            publisher = b.get("publisher")
            out.append(Bundle(publisher if isinstance(publisher, dict) else {},
                              tuple(Attestation.from_dict(a) for a in b["attestations"])))
        return cls(tuple(out))


def document(bundles: list[Bundle]) -> bytes:
    return Provenance(tuple(bundles)).to_json()


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class Verified:
    """What a verified attestation says, and who signed it."""

    signer: str
    """The certificate's common name (a worker's, or the index's)."""
    predicate_type: str
    predicate: Mapping[str, Any]


def verify(att: Attestation, ca: x509.Certificate, filename: str, sha256: str) -> Verified:
    """Check one attestation against the CA and the file; the reason why not, in one line."""
    try:
        cert = x509.load_der_x509_certificate(att.certificate)
    except ValueError:
        raise ProvenanceInvalid("the attestation's certificate is not a DER certificate") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ProvenanceInvalid(f"the certificate of {common_name(cert)!r} is not issued by "
                                f"the fleet CA {common_name(ca)!r}") from None
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ProvenanceInvalid("the attestation is signed by a CA certificate, not a signer's")
    except x509.ExtensionNotFound:
        raise ProvenanceInvalid("the signer's certificate has no basic constraints") from None
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ProvenanceInvalid("the signer's certificate holds no ECDSA key")
    try:
        key.verify(att.signature, pae(PAYLOAD_TYPE, att.statement), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise ProvenanceInvalid(f"the signature of {common_name(cert)!r} does not match the "
                                "statement") from None
    try:
        body = json.loads(att.statement)
        subjects = body["subject"]
        predicate_type, predicate = str(body["predicateType"]), body["predicate"]
    except (ValueError, KeyError, TypeError):
        raise ProvenanceInvalid("the statement is not an in-toto v1 Statement") from None
    if body.get("_type") != STATEMENT_TYPE or not isinstance(predicate, dict):
        raise ProvenanceInvalid("the statement is not an in-toto v1 Statement")
    wanted = [{"name": filename, "digest": {"sha256": sha256}}]
    if not isinstance(subjects, list) or [_subject(s) for s in subjects] != wanted:
        named = ", ".join(f"{_subject(s)['name']}" for s in subjects) if isinstance(
            subjects, list) else "?"
        raise ProvenanceInvalid(f"the statement is about {named or 'nothing'}, not {filename} "
                                f"with sha256 {sha256[:12]}…")
    when = signed_at(predicate_type, predicate)
    if when is None or not (cert.not_valid_before_utc <= when <= cert.not_valid_after_utc):
        raise ProvenanceInvalid(f"the certificate of {common_name(cert)!r} was not valid when "
                                f"the statement says it was signed ({when})")
    return Verified(common_name(cert), predicate_type, predicate)


def _subject(s: object) -> dict[str, Any]:
    if not isinstance(s, dict):
        return {"name": "?", "digest": {}}
    digest_ = s.get("digest")
    return {"name": str(s.get("name")),
            "digest": {"sha256": digest_.get("sha256")} if isinstance(digest_, dict) else {}}


def verify_document(raw: bytes, ca: x509.Certificate, filename: str,
                    sha256: str) -> list[Verified]:
    """Every attestation of a provenance document, verified; any failure raises."""
    provenance = Provenance.from_json(raw)
    out = [verify(a, ca, filename, sha256) for b in provenance.bundles for a in b.attestations]
    if not out:
        raise ProvenanceInvalid("the provenance document holds no attestation")
    return out

