"""GPU proofs in the index (issue 27): what a proof that ran on a GPU found, kept beside the
record of the wheel it ran on.

A record is immutable, and a proof comes after publication (``wheelhouse prove --record`` on a
GPU host), so the proof is a marker of its own, ``proofs/<base>/<project>/<file>.json``
(:func:`wheelhouse.index.layout.proof_key`), that the catalog reads on every new generation as
it reads yank markers. A later proof of the same wheel replaces the earlier one. Only a proof
that ran is recorded: a result where no GPU was visible is refused (:class:`ProofDidNotRun`),
and so is one of other bytes than the published wheel's (:class:`ProofMismatch`). Deleting or
pruning the wheel removes its proof (:meth:`Record.keys` names it).

A proof says how it was made in a PEP 740 attestation of its own, signed under the fleet CA
(:func:`sign_proof`; ``wheelhouse prove --record`` signs every proof it records): an in-toto
Statement about the wheel's name and sha256 whose predicate
(:data:`~wheelhouse.provenance.predicates.GPU_PROOF_TYPE`) is the proof's own fields. The record's
``.provenance`` document is immutable, so the attestation lives in the proof, which the index
serves as ``<file>.proof`` (:data:`SUFFIX`); :func:`verify_proof` is the reader's check.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography import x509

from wheelhouse.errors import NothingPublished, ProofDidNotRun, ProofMismatch, ProvenanceInvalid
from wheelhouse.index.layout import Record
from wheelhouse.index.publish import bump_generation
from wheelhouse.index.storage import Storage
from wheelhouse.provenance import attest, predicates
from wheelhouse.provenance.ca import Identity
from wheelhouse.shapes import known_fields

#: The shape's version, written into each proof; readers ignore fields they don't know.
VERSION = 1
#: The suffix of a wheel's GPU proof where the index serves it, beside the wheel.
SUFFIX = ".proof"


@dataclass(frozen=True)
class GpuProof:
    """One run of a wheel's GPU proof (``worker.gpuproof``), as the index keeps it."""

    filename: str
    sha256: str
    """Of the wheel the proof ran on: it must be the published wheel's."""
    proven: bool
    """Whether a GPU ran it; a proof with False here is never recorded."""
    passed: bool
    reason: str = ""
    gpu: str = ""
    capability: str = ""
    """The GPU's compute capability as its SASS architecture number (``90`` for sm_90)."""
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    proof: str = ""
    """The recipe's named proof (``generic``, ``flash-attn``)."""
    seconds: float = 0.0
    proven_at: str = ""
    """When it was recorded (UTC, ISO 8601)."""
    host: str = ""
    """Who proved it: the host (and user) that ran ``wheelhouse prove``."""
    version: int = VERSION
    attestation: dict[str, Any] | None = None
    """The PEP 740 attestation of the fields above (:func:`sign_proof`), or None: unsigned."""

    def describe(self) -> str:
        """One line for a page: what ran where."""
        verdict = "proven" if self.passed else "failed"
        return f"{verdict} on {self.gpu or 'a GPU'} (sm_{self.capability or '?'})"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> GpuProof:
        """Raises ValueError for a document that is no proof; a newer writer's fields are
        ignored (``wheelhouse.shapes``)."""
        data: Any = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a GPU proof is a JSON object")
        for name in ("filename", "sha256"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"a GPU proof names its wheel's {name}")
        if not isinstance(data.get("proven"), bool) or not isinstance(data.get("passed"), bool):
            raise ValueError("a GPU proof says whether it ran and passed")
        if not isinstance(data.get("attestation"), dict | None):
            raise ValueError("a GPU proof's attestation is a JSON object")
        return cls(**known_fields(cls, data))


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def record_proof(storage: Storage, record: Record, proof: GpuProof) -> None:
    """Keep ``proof`` beside ``record`` (replacing an earlier proof) and tell the catalogs.

    Refused, with nothing written: a proof where no GPU ran (:class:`ProofDidNotRun`), one of
    another file or other bytes (:class:`ProofMismatch`), and one of a wheel no longer
    published under that record (:class:`NothingPublished`).
    """
    if not proof.proven:
        why = proof.reason or "no reason given"
        raise ProofDidNotRun(f"no GPU ran the proof of {proof.filename} ({why}): nothing is "
                             "recorded")
    try:
        stored = Record.from_json(storage.get_bytes(record.key))
    except FileNotFoundError:
        raise NothingPublished(f"{record.filename} is not published in "
                               f"{record.variant.key} (any more)") from None
    if proof.filename != stored.filename or proof.sha256 != stored.sha256:
        raise ProofMismatch(
            f"the proof ran on {proof.filename} with sha256 {proof.sha256}, but the published "
            f"{stored.filename} in {stored.variant.key} has sha256 {stored.sha256}: not "
            "recorded")
    storage.put_bytes(stored.proof_key, proof.to_json())
    bump_generation(storage)


def read_proof(storage: Storage, record: Record) -> GpuProof | None:
    """The recorded proof of ``record``'s wheel, or None: without one, or with one that is not
    of these bytes (left from a wheel of that name deleted and published again)."""
    try:
        raw = storage.get_bytes(record.proof_key)
    except FileNotFoundError:
        return None
    return of_record(GpuProof.from_json(raw), record)


def of_record(proof: GpuProof | None, record: Record) -> GpuProof | None:
    """``proof`` if it is of ``record``'s bytes, else None."""
    if proof is None or proof.filename != record.filename or proof.sha256 != record.sha256:
        return None
    return proof


#: GpuProof's fields that are not the proof's predicate: the subject names the file and its
#: sha256, and the format's version and the attestation itself are about the record.
_NOT_SIGNED = frozenset({"filename", "sha256", "version", "attestation"})


def _predicate(proof: GpuProof) -> dict[str, Any]:
    return predicates.gpu_proof(**{f.name: getattr(proof, f.name)
                                   for f in dataclasses.fields(proof)
                                   if f.name not in _NOT_SIGNED})


def sign_proof(proof: GpuProof, identity: Identity) -> GpuProof:
    """``proof`` with its attestation by ``identity``: a Statement about the wheel's name and
    sha256 whose predicate is the proof's fields. ``proven_at`` (now, where it is empty) is
    when the statement says it was signed, so ``identity``'s certificate must be valid then."""
    unsigned = dataclasses.replace(proof, proven_at=proof.proven_at or now(), attestation=None)
    signed = attest.sign(identity, proof.filename, proof.sha256, predicates.GPU_PROOF_TYPE,
                         _predicate(unsigned))
    return dataclasses.replace(unsigned, attestation=signed.to_dict())


def verify_proof(proof: GpuProof, ca: x509.Certificate) -> attest.Verified:
    """Check ``proof``'s attestation against the CA (certificate, signature, subject) and
    against the proof's own fields: a field changed after signing fails. Raises
    :class:`ProvenanceInvalid` with the reason in one line."""
    if proof.attestation is None:
        raise ProvenanceInvalid(f"the GPU proof of {proof.filename} is not signed (recorded "
                                "before proofs were attested)")
    verified = attest.verify(attest.Attestation.from_dict(proof.attestation), ca,
                             proof.filename, proof.sha256)
    if verified.predicate_type != predicates.GPU_PROOF_TYPE:
        raise ProvenanceInvalid(f"the GPU proof of {proof.filename} is attested by a "
                                f"{verified.predicate_type!r} statement, not a GPU proof")
    # Only the fields this reader knows: a newer signer's extra ones are not a difference.
    changed = [f"{name} is {mine!r} in the proof, {verified.predicate.get(name)!r} as signed"
               for name, mine in _predicate(proof).items()
               if verified.predicate.get(name) != mine]
    if changed:
        raise ProvenanceInvalid(f"the GPU proof of {proof.filename} was changed after "
                                f"{verified.signer!r} signed it: {'; '.join(changed)}")
    return verified
