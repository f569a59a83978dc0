"""Uploads with the standard tools (``twine upload``, ``uv publish``): the legacy upload API's
fields checked against the file, then the same publish path as ``wheelhouse publish``.

The legacy API (PyPI's, pypiserver's, devpi's) is a multipart POST with ``:action`` =
``file_upload``, the file as ``content``, and fields that describe it: ``name``, ``version``,
``filetype``, ``sha256_digest`` (and ``md5_digest``, ``blake2_256_digest``, metadata).
This module takes those fields and the stored file; the web turns the HTTP request into them.

Provenance (PEP 740): the index signs a publish attestation for every uploaded file (who sent
it, when; the file's sha256 is its subject). Attestations a client sends in the ``attestations``
field (a JSON list of attestation objects) must verify against the fleet CA and be about this
file, or the upload is refused; they are served beside the index's own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from wheelhouse.config import Config
from wheelhouse.errors import InvalidUpload, InvalidWheel, ProvenanceInvalid
from wheelhouse.index.catalog import Record
from wheelhouse.index.ownership import Publisher, admit
from wheelhouse.index.publish import Signer, publish
from wheelhouse.index.storage import Storage
from wheelhouse.index.uploadchecks import check_upload
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.variants import Variant
from wheelhouse.wheels import parse_name, sha256_file

#: The ``:action`` of an upload in the legacy API.
FILE_UPLOAD = "file_upload"
_DIGESTS = (("sha256_digest", "sha256"), ("md5_digest", "md5"),
            ("blake2_256_digest", "blake2b"))


def check_fields(fields: Mapping[str, str], filename: str) -> None:
    """Refuse an upload that is not a wheel upload, before its bytes are stored."""
    action = fields.get(":action", "")
    if action != FILE_UPLOAD:
        raise InvalidUpload(f"unsupported :action {action[:40]!r}: this index accepts "
                            f"{FILE_UPLOAD!r} (twine upload, uv publish)")
    filetype = fields.get("filetype", "bdist_wheel")
    if filetype == "sdist" or not filename.endswith(".whl"):
        raise InvalidUpload(f"{filename[:80]}: this index hosts wheels only; upload the wheels "
                            "built from it (dist/*.whl)")
    if filetype != "bdist_wheel":
        raise InvalidUpload(f"{filename[:80]}: filetype {filetype[:40]!r} is not bdist_wheel")


def check_digests(fields: Mapping[str, str], path: Path) -> None:
    """Every digest the client sent must match the bytes received (one at least)."""
    sent = [(field, algo, fields[field].strip().lower()) for field, algo in _DIGESTS
            if fields.get(field, "").strip()]
    if not sent:
        raise InvalidUpload("the upload carries no digest (sha256_digest): the bytes received "
                            "can't be checked against what was sent")
    hashers = {algo: hashlib.blake2b(digest_size=32) if algo == "blake2b" else
               hashlib.new(algo) for _, algo, _ in sent}
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            for h in hashers.values():
                h.update(chunk)
    for field, algo, value in sent:
        if not hmac.compare_digest(hashers[algo].hexdigest(), value):
            raise InvalidUpload(f"{path.name}: {field} does not match the bytes received "
                                "(the upload was damaged or cut short); upload it again")


#: The name the index signs with where the workspace's own CA issues its certificate.
INDEX_SIGNER = "index"


def client_attestations(fields: Mapping[str, str], path: Path,
                        config: Config) -> list[attest.Attestation]:
    """The attestations the client sent, each verified against the fleet CA and this file."""
    raw = fields.get("attestations", "").strip()
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except ValueError:
        raise InvalidUpload(f"{path.name}: the attestations field is not JSON") from None
    if not isinstance(items, list):
        raise InvalidUpload(f"{path.name}: the attestations field is not a JSON list")
    authority = ca.ca_cert_for(config)
    sha256 = sha256_file(path)
    out = []
    for item in items:
        try:
            att = attest.Attestation.from_dict(item)
            attest.verify(att, authority, path.name, sha256)
        except ProvenanceInvalid as exc:
            raise InvalidUpload(f"{path.name}: an attestation sent with it does not verify: "
                                f"{exc}") from None
        out.append(att)
    return out


def upload_signer(config: Config, publisher: Publisher,
                  sent: list[attest.Attestation], uploaded: str) -> Signer:
    """The index's publish attestation of each file, beside what the client sent for it."""
    identity = ca.signer_for(config, INDEX_SIGNER)

    def sign(filename: str, sha256: str) -> bytes:
        bundles = []
        if sent:
            if filename != uploaded:
                # Relabelled: what the client signed is not what is stored.
                raise InvalidUpload(f"{uploaded}: its attestations name the file as sent, but "
                                    f"this index relabels it to {filename}; upload it labelled")
            bundles.append(attest.Bundle({"kind": "client", "claims": {
                "uploader": str(publisher)}}, tuple(sent)))
        predicate = predicates.publish(publisher=publisher.name, index=identity.name,
                                       when=datetime.now(UTC))
        bundles.append(attest.Bundle({"kind": "wheelhouse-index", "claims": {
            "index": identity.name}}, (attest.sign(identity, filename, sha256,
                                                   predicates.PUBLISH, predicate),)))
        return attest.document(bundles)

    return sign


def _label_problem(name_version: Version, variant: Variant, filename: str) -> str:
    public = name_version.public
    wanted = f"{public}+{variant.local_label}"
    return (f"{filename}: version {name_version} lacks the local label +{variant.local_label} "
            f"of {variant.key}: build it as version {wanted}, or publish it with `wheelhouse "
            f"publish --variant {variant.key} --relabel`, or have the operator set "
            "WHEELHOUSE_UPLOAD_RELABEL=true")


def accept(storage: Storage, config: Config, variant: Variant, fields: Mapping[str, str],
           path: Path, *, publisher: Publisher,
           recipes: Collection[str] = frozenset()) -> Record:
    """Check an uploaded wheel (stored at ``path`` under its own name) and publish it into
    ``variant``'s root, as ``wheelhouse publish`` does, if ``publisher`` owns its project (or
    is its first publisher: :func:`wheelhouse.index.ownership.admit`; ``recipes`` are the projects
    only builds publish).

    The same bytes again return the published record (so a retried upload succeeds); other
    bytes under a published name raise :class:`AlreadyPublished` (a 409, which twine's
    ``--skip-existing`` takes as "already there")."""
    check_fields(fields, path.name)
    try:
        name = parse_name(path.name)
    except InvalidWheel as exc:
        raise InvalidUpload(str(exc)) from None
    sent_name = fields.get("name", "")
    if sent_name and canonicalize_name(sent_name) != name.project:
        raise InvalidUpload(f"{path.name}: the name field {sent_name[:80]!r} is not the wheel's "
                            f"project {name.project}")
    sent_version = fields.get("version", "")
    if sent_version:
        try:
            same = Version(sent_version).public == name.version.public
        except InvalidVersion:
            same = False
        if not same:
            raise InvalidUpload(f"{path.name}: the version field {sent_version[:40]!r} is not "
                                f"the wheel's version {name.version}")
    check_digests(fields, path)
    check_upload(fields, path, name, config)
    if name.version.local != variant.local_label and not config.upload_relabel:
        raise InvalidUpload(_label_problem(name.version, variant, path.name))
    sent = client_attestations(fields, path, config)
    admit(storage, config, name.project, publisher, variant, recipe=name.project in recipes)
    try:
        return publish(storage, path, variant, relabel_wheel=config.upload_relabel,
                       claim_timeout=config.publish_timeout, by=f"upload by {publisher}",
                       sign=upload_signer(config, publisher, sent, path.name))
    except InvalidWheel as exc:
        raise InvalidUpload(str(exc)) from None
