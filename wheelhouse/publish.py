"""Publishing: put a wheel into storage so that the index lists it, atomically.

Order matters: wheel, then ``.metadata``, then the record (create-if-absent), then the
generation marker. A crash before the record leaves an unlisted leftover for ``wheelhouse gc``;
a reader never sees a record whose files are not all there.
"""

from __future__ import annotations

import hashlib
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path

from wheelhouse.buildfacts import BuildFacts
from wheelhouse.catalog import CLAIMS, GENERATION_KEY, Record, record_key, wheel_key
from wheelhouse.errors import AlreadyPublished, InvalidWheel
from wheelhouse.storage import Storage
from wheelhouse.variants import Variant, variant_from_label
from wheelhouse.wheels import (
    check_consistent,
    parse_metadata,
    parse_name,
    read_metadata,
    relabel,
    sha256_file,
)


def publish(
    storage: Storage,
    path: Path,
    variant: Variant,
    *,
    relabel_wheel: bool = False,
    archs: tuple[str, ...] | None = None,
    build: BuildFacts | None = None,
) -> Record:
    """Validate ``path`` for ``variant`` and publish it; return its record.

    ``archs`` are the GPU architectures the wheel holds where known; a narrowed variant
    implies its own. Publishing the same bytes twice is a no-op; different bytes under a
    published name raise :class:`AlreadyPublished`, since published files are immutable.
    """
    name = parse_name(path.name)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-publish-") as tmp:
        if relabel_wheel and (
            name.version.local != variant.local_label
            # A file name that already carries the label over a METADATA that does not (the
            # upstream flash-attn defect, once renamed) needs relabelling just as much.
            or parse_metadata(read_metadata(path)).version != name.version
        ):
            path = relabel(path, variant.local_label, Path(tmp))
            name = parse_name(path.name)
        meta = check_consistent(path, name)
        label = name.version.local
        if label != variant.local_label:
            named = variant_from_label(label) if label else None
            hint = f" (it is labelled for {named.key})" if named else ""
            raise InvalidWheel(
                f"{name.filename}: version {name.version} does not carry the local label "
                f"+{variant.local_label} of variant {variant.key}{hint}; "
                "publish with --relabel to rewrite it"
            )
        metadata = read_metadata(path)
        record = Record(
            filename=name.filename,
            project=name.project,
            version=str(name.version),
            variant=variant,
            archs=variant.archs or _known_archs(variant, archs),
            sha256=sha256_file(path),
            size=path.stat().st_size,
            metadata_sha256=hashlib.sha256(metadata).hexdigest(),
            requires_python=meta.requires_python,
            upload_time=datetime.now(UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            build=build if build is not None else BuildFacts(),
        )
        rkey = record_key(variant.base, name.project, name.filename)
        try:
            existing = Record.from_json(storage.get_bytes(rkey))
        except FileNotFoundError:
            existing = None
        if existing is not None:
            if existing.sha256 == record.sha256:
                return existing
            raise AlreadyPublished(
                f"{name.filename} is already published with different contents "
                f"(sha256 {existing.sha256[:12]}…); published files are immutable"
            )
        wkey = wheel_key(variant.base, name.project, name.filename)
        _claim(storage, variant, name.filename, record.sha256)
        storage.put_file(wkey, path)
        storage.put_bytes(wkey + ".metadata", metadata)
        try:
            storage.put_bytes(rkey, record.to_json(), exclusive=True)
        except FileExistsError:
            raise AlreadyPublished(
                f"{name.filename} was published concurrently by someone else"
            ) from None
    bump_generation(storage)
    return record


def _claim(storage: Storage, variant: Variant, filename: str, sha256: str) -> None:
    """Reserve ``filename`` for these bytes before uploading anything.

    Without a claim, a second publisher of *different* bytes could overwrite the wheel after the
    first wrote its record. The claim is create-if-absent; the same bytes may re-claim, so an
    interrupted publication can be retried.
    """
    key = f"{CLAIMS}{variant.base.key}/{filename}"
    try:
        storage.put_bytes(key, sha256.encode(), exclusive=True)
    except FileExistsError:
        holder = storage.get_bytes(key).decode()
        if holder != sha256:
            raise AlreadyPublished(
                f"{filename} is being (or was) published with different contents "
                f"(sha256 {holder[:12]}…); published files are immutable"
            ) from None


def _known_archs(variant: Variant, archs: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Canonical spelling and order, as the catalog compares them with variant keys; an empty
    set says nothing, so it means unknown (a wheel with no archs would match no root)."""
    if not archs:
        return None
    return Variant.of(variant.torch, variant.cuda, archs, variant.cxx11abi).archs


def bump_generation(storage: Storage) -> None:
    """Tell every server process that the catalog changed."""
    storage.put_bytes(GENERATION_KEY, uuid.uuid4().hex.encode())
