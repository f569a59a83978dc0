"""Publishing: put a wheel into storage so that the index lists it, atomically.

Order matters: the claim on the file name, the wheel, its ``.metadata`` and ``.provenance``
(where a signer signs it: :mod:`wheelhouse.provenance`), then the record
(create-if-absent), then the generation marker. A crash before the record leaves an unlisted
leftover for ``wheelhouse gc``; a reader never sees a record whose files are not all there.

Claims expire. A claim says who holds the name (host, pid) and since when; one older than the
publish timeout whose record was never written belongs to a publisher that died, and the next
publisher of any bytes takes it over by compare-and-swap (:meth:`Storage.replace_bytes`: S3's
``If-Match``, a file lock locally), so of two racing successors exactly one wins. A publisher
re-reads its claim before it writes the record and stops if it was taken over. What no claim
can prevent: a publisher stalled *inside* one upload for longer than the timeout can still
overwrite the wheel of the one that took over; ``wheelhouse verify`` finds that, and the
timeout (an hour by default) is far longer than any upload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.config import DEFAULT_PUBLISH_TIMEOUT
from wheelhouse.errors import AlreadyPublished, InvalidWheel, StorageError
from wheelhouse.index import variantwheels
from wheelhouse.index.layout import (
    GENERATION_KEY,
    Record,
    claim_key,
    yank_key,
)
from wheelhouse.index.storage import Storage
from wheelhouse.variants import Variant, variant_from_label
from wheelhouse.wheels import (
    CoreMetadata,
    WheelName,
    check_consistent,
    consistent_metadata,
    parse_metadata,
    parse_name,
    read_metadata,
    relabel,
    sha256_file,
)

log = logging.getLogger(__name__)

#: Signs a file's provenance: ``(file name, sha256) -> provenance document`` (PEP 740). Called
#: for the wheel and again for its variant form, each its own subject.
Signer = Callable[[str, str], bytes]


@dataclass(frozen=True)
class Claim:
    """Who publishes a file name, and since when: the content of ``claims/<base>/<file>``."""

    sha256: str
    """The bytes the name is reserved for."""
    id: str
    host: str
    pid: int
    claimed_at: float
    """Seconds since the epoch (wall clock: claims are compared across hosts)."""
    by: str | None = None
    """What published, where the caller says (a worker's name)."""

    @classmethod
    def new(cls, sha256: str, by: str | None = None) -> Claim:
        return cls(sha256=sha256, id=uuid.uuid4().hex, host=socket.gethostname(),
                   pid=os.getpid(), claimed_at=time.time(), by=by)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, mtime: float) -> Claim:
        """A stored claim; one written before claims said who and when (the bare sha256)
        is dated by its object's ``mtime``."""
        text = data.decode(errors="replace").strip()
        if not text.startswith("{"):
            return cls(sha256=text, id="", host="", pid=0, claimed_at=mtime)
        raw = json.loads(text)
        return cls(sha256=str(raw["sha256"]), id=str(raw.get("id", "")),
                   host=str(raw.get("host", "")), pid=int(raw.get("pid", 0)),
                   claimed_at=float(raw.get("claimed_at", mtime)), by=raw.get("by"))

    def gone(self) -> bool:
        """Whether the publisher is known to be dead: it ran on this host under a pid that
        no longer runs. (A pid reused since looks alive: the claim then waits to expire.)"""
        if not self.host or self.host != socket.gethostname() or self.pid <= 0:
            return False
        if self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, as another user
        return False

    def describe(self, now: float) -> str:
        who = f"{self.by} " if self.by else ""
        where = f"on {self.host} (pid {self.pid}), " if self.host else ""
        return f"{who}{where}claimed {now - self.claimed_at:.0f}s ago"


def read_claim(storage: Storage, key: str) -> tuple[Claim, str]:
    """The claim stored under ``key`` and its version's tag; ``FileNotFoundError`` if none."""
    tagged = storage.read_tagged(key)
    mtime = 0.0
    if not tagged.data.lstrip().startswith(b"{"):
        mtime = storage.stat(key).mtime
    try:
        return Claim.parse(tagged.data, mtime), tagged.tag
    except (ValueError, KeyError, TypeError):
        # Unreadable: nobody can tell whose it is, so it is as good as expired.
        return Claim(sha256="", id="", host="", pid=0, claimed_at=0.0), tagged.tag


def publish(
    storage: Storage,
    path: Path,
    variant: Variant,
    *,
    relabel_wheel: bool = False,
    archs: tuple[str, ...] | None = None,
    build: BuildFacts | None = None,
    claim_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
    by: str | None = None,
    variant_form: bool = True,
    sign: Signer | None = None,
) -> Record:
    """Validate ``path`` for ``variant`` and publish it; return its record.

    ``archs`` are the GPU architectures the wheel holds where known; a narrowed variant
    implies its own. Publishing the same bytes twice is a no-op (and repairs a copy that
    ``wheelhouse verify --quarantine`` took out); different bytes under a published name raise
    :class:`AlreadyPublished`, since published files are immutable. ``claim_timeout`` is the
    operator's ``Config.publish_timeout`` (callers with a configuration pass it); ``by`` names
    the publisher in its claim. With ``variant_form``, the wheel's variant form is published too
    (or repaired, for bytes published before), for the plain root ``/simple/``: see
    :func:`publish_variant_form`. ``sign``, where given, signs the provenance stored beside
    each file.
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
        _check_label(name, variant, "; publish with --relabel to rewrite it")
        metadata = read_metadata(path)
        record = _new_record(name.filename, path, metadata, meta, variant, archs, build)
        check_identity(storage, name, record)
        record, provenance = _signed(record, sign)
        published = _write(storage, record, path, metadata, claim_timeout, by, provenance)
        if published is record:
            bump_generation(storage)
        if variant_form:
            publish_variant_form(storage, path, published, claim_timeout=claim_timeout, by=by,
                                 sign=sign)
    return published


def check_identity(storage: Storage, name: WheelName, record: Record) -> None:
    """Refuse other bytes for a release file installers can't tell from a published one.

    What an installer sees is the normalised project, the version as ``packaging`` compares it
    (``1.0`` is ``1.0.0``) and the tags: a file name spelt in another case, with trailing zeros
    or with a build tag (which installers prefer) would otherwise list beside the published
    file, or hide it. A file of the same identity the owner yanked may be replaced (by a
    build-tagged file: the yanked name itself stays taken)."""
    prefix = record.key.rpartition("/")[0] + "/"
    for o in storage.list(prefix):
        other = o.key.rpartition("/")[2].removesuffix(".json")
        if other == record.filename or not o.key.endswith(".json"):
            continue  # the same name is _write's to decide
        try:
            oname = parse_name(other)
        except InvalidWheel:
            continue  # a variant form (its label after the tags) or a stray object
        if oname.version != name.version or not oname.tags & name.tags:
            continue
        existing = _read_record(storage, o.key)
        if (existing is None or existing.sha256 == record.sha256
                or existing.variant_of is not None or storage.exists(yank_key(o.key))):
            continue
        raise AlreadyPublished(
            f"{record.filename}: {existing.filename} is published with the same project, "
            f"version ({name.version}) and tags but other bytes (sha256 "
            f"{existing.sha256[:12]}…); installers can't tell them apart, so published "
            "releases are immutable whatever the file name spells (yank it first to publish "
            "a build-tagged replacement)")


def _check_label(name: WheelName, variant: Variant, advice: str = "") -> None:
    """Refuse a wheel whose version does not carry ``variant``'s local label."""
    label = name.version.local
    if label != variant.local_label:
        named = variant_from_label(label) if label else None
        hint = f" (it is labelled for {named.key})" if named else ""
        raise InvalidWheel(
            f"{name.filename}: version {name.version} does not carry the local label "
            f"+{variant.local_label} of variant {variant.key}{hint}{advice}")


def _new_record(filename: str, path: Path, metadata: bytes, meta: CoreMetadata,
                variant: Variant, archs: tuple[str, ...] | None,
                build: BuildFacts | None) -> Record:
    name = parse_name(filename)
    return Record(
        filename=name.filename,
        project=name.project,
        version=str(name.version),
        variant=variant,
        archs=variant.archs or _known_archs(variant, archs),
        sha256=sha256_file(path),
        size=path.stat().st_size,
        metadata_sha256=hashlib.sha256(metadata).hexdigest(),
        requires_python=meta.requires_python,
        upload_time=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        build=build if build is not None else BuildFacts(),
    )


@dataclass(frozen=True)
class Checked:
    """A wheel whose bytes were parsed elsewhere (in the build's sandbox): the file, and its
    METADATA as the check read it (what PEP 658 serves)."""

    path: Path
    metadata: bytes


@dataclass(frozen=True)
class CheckedVariant:
    """The variant form the build's check made of a :class:`Checked` wheel."""

    wheel: Checked
    label: str
    archs: tuple[str, ...]


def publish_checked(storage: Storage, wheel: Checked, variant: Variant, *,
                    archs: tuple[str, ...] | None = None, build: BuildFacts | None = None,
                    claim_timeout: float = DEFAULT_PUBLISH_TIMEOUT, by: str | None = None,
                    variant_form: CheckedVariant | None = None,
                    sign: Signer | None = None) -> Record:
    """:func:`publish` for a wheel the build's sandbox checked, without opening its zip here.

    The worker never parses a build's wheel itself (docs/security.md): the record comes from the
    file name, the METADATA the check handed back (parsed as headers; the caller caps its size)
    and the bytes' sha256 and size. Name and METADATA must agree and carry ``variant``'s label.
    ``variant_form``, where the check made one, is published after the wheel as
    :func:`publish_variant_form` would, and its failures likewise never undo the wheel.
    """
    name = parse_name(wheel.path.name)
    meta = consistent_metadata(wheel.metadata, name)
    _check_label(name, variant)
    record = _new_record(name.filename, wheel.path, wheel.metadata, meta, variant, archs, build)
    record, provenance = _signed(record, sign)
    published = _write(storage, record, wheel.path, wheel.metadata, claim_timeout, by,
                       provenance)
    if published is record:
        bump_generation(storage)
    if variant_form is not None:
        try:
            _publish_variant_file(storage, published, variant_form.wheel.path,
                                  variant_form.wheel.metadata, variant_form.label,
                                  variant_form.archs, claim_timeout=claim_timeout, by=by,
                                  sign=sign)
        except (ValueError, OSError) as exc:  # InvalidWheel, StorageError (unavailable) too
            log.warning("no variant form of %s: %s", published.filename, exc)
    return published


def _signed(record: Record, sign: Signer | None) -> tuple[Record, bytes | None]:
    """The record with the digest of its provenance, and that document (None: unsigned)."""
    if sign is None:
        return record, None
    document = sign(record.filename, record.sha256)
    return replace(record, provenance_sha256=hashlib.sha256(document).hexdigest()), document


def _write(storage: Storage, record: Record, path: Path, metadata: bytes, timeout: float,
           by: str | None, provenance: bytes | None = None) -> Record:
    """The protocol (claim, wheel, ``.metadata``, record) for one file; the record that is
    published now (``record`` itself when this call wrote it: the caller bumps the
    generation)."""
    rkey = record.key
    existing = _read_record(storage, rkey)
    if existing is not None:
        if existing.sha256 == record.sha256:
            _repair(storage, existing, path, metadata)
            return existing
        raise _published(record.filename, existing)
    ckey = claim_key(record.variant.base, record.filename)
    _claim(storage, ckey, rkey, Claim.new(record.sha256, by), timeout)
    storage.put_file(record.wheel_key, path)
    # Before each further write: a publisher whose claim was taken over stops at its next
    # step, so the window in which it can spoil the new holder's files is one write.
    _still_ours(storage, ckey, record.sha256, record.filename)
    storage.put_bytes(record.metadata_key, metadata)
    if provenance is not None:
        _still_ours(storage, ckey, record.sha256, record.filename)
        storage.put_bytes(record.provenance_key, provenance)
    _still_ours(storage, ckey, record.sha256, record.filename)
    try:
        storage.put_bytes(rkey, record.to_json(), exclusive=True)
    except FileExistsError:
        other = _read_record(storage, rkey)
        if other is not None and other.sha256 == record.sha256:
            return other  # the same bytes, published by someone else meanwhile
        raise AlreadyPublished(
            f"{record.filename} was published concurrently by someone else"
        ) from None
    return record


def publish_variant_form(storage: Storage, path: Path, source: Record, *,
                         claim_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
                         by: str | None = None, sign: Signer | None = None) -> Record | None:
    """Publish the variant form (:mod:`wheelhouse.index.variantwheels`) of the published wheel
    ``source`` whose bytes are at ``path``; its record, or None where there is none to make.

    None for a wheel without SASS (nothing to select a build by). A variant wheel of the same
    name made from another source (a fat wheel and a narrowed one holding the same archs)
    stands: the first keeps the name, this one is logged and left out. Failures never undo
    the source's publication: they are logged, and ``wheelhouse variants backfill`` retries.
    """
    try:
        archs = variantwheels.archs_of(path, source.build)
        if not archs:
            return None
        with tempfile.TemporaryDirectory(prefix="wheelhouse-variant-") as tmp:
            vpath, label = variantwheels.make_variant_wheel(path, source.variant, archs,
                                                            Path(tmp))
            return _publish_variant_file(storage, source, vpath, read_metadata(vpath), label,
                                         archs, claim_timeout=claim_timeout, by=by, sign=sign)
    except (ValueError, OSError) as exc:  # InvalidWheel, StorageError (unavailable) too
        log.warning("no variant form of %s: %s", source.filename, exc)
        return None


def _publish_variant_file(storage: Storage, source: Record, vpath: Path, metadata: bytes,
                          label: str, archs: tuple[str, ...], *, claim_timeout: float,
                          by: str | None, sign: Signer | None = None) -> Record | None:
    """Publish the variant form at ``vpath`` of the published ``source``; None where a
    variant wheel of that name made from another source stands."""
    meta = parse_metadata(metadata)
    record = replace(
        source, filename=vpath.name, version=str(meta.version), archs=archs,
        sha256=sha256_file(vpath), size=vpath.stat().st_size,
        metadata_sha256=hashlib.sha256(metadata).hexdigest(), yanked=False,
        variant_label=label, variant_of=source.filename, provenance_sha256=None)
    record, provenance = _signed(record, sign)
    try:
        published = _write(storage, record, vpath, metadata, claim_timeout, by, provenance)
    except AlreadyPublished as exc:
        log.info("variant form of %s left out: %s", source.filename, exc)
        return None
    if published is record:
        bump_generation(storage)
    return published


def _read_record(storage: Storage, rkey: str) -> Record | None:
    try:
        return Record.from_json(storage.get_bytes(rkey))
    except FileNotFoundError:
        return None


def _published(filename: str, existing: Record) -> AlreadyPublished:
    return AlreadyPublished(
        f"{filename} is already published with different contents "
        f"(sha256 {existing.sha256[:12]}…); published files are immutable"
    )


def _claim(storage: Storage, key: str, rkey: str, mine: Claim, timeout: float) -> None:
    """Reserve the file name for these bytes before uploading anything.

    Without a claim, a second publisher of *different* bytes could overwrite the wheel after
    the first wrote its record. The claim is create-if-absent; the same bytes may re-claim, so
    an interrupted publication can be retried; an expired claim of other bytes is taken over.
    """
    for _ in range(3):  # a claim deleted (by gc) between our two looks: look again
        try:
            storage.put_bytes(key, mine.to_json(), exclusive=True)
            return
        except FileExistsError:
            pass
        try:
            holder, tag = read_claim(storage, key)
        except FileNotFoundError:
            continue
        now = time.time()
        # A publisher that died on this host (a killed upload, a crashed CLI) is not waited
        # for: its claim is taken over at once.
        expired = now - holder.claimed_at >= timeout or holder.gone()
        if holder.sha256 == mine.sha256:
            if not expired:
                return
            # The same bytes, after the holder died: renew the claim, or a publisher of other
            # bytes would take it over while we upload.
            try:
                storage.replace_bytes(key, mine.to_json(), tag=tag)
                return
            except (FileExistsError, FileNotFoundError):
                continue  # changed meanwhile: look again
        filename = key.rpartition("/")[2]
        if not expired:
            left = timeout - (now - holder.claimed_at)
            recover = (f"if that publisher on {holder.host} is gone, run `wheelhouse gc --apply` "
                       "there to free the name at once, or " if holder.host
                       and holder.host != socket.gethostname() else "")
            raise AlreadyPublished(
                f"{filename} is being published with different contents "
                f"(sha256 {holder.sha256[:12]}…, {holder.describe(now)}); {recover}retry in "
                f"{left:.0f}s, when the claim expires (WHEELHOUSE_PUBLISH_TIMEOUT)")
        existing = _read_record(storage, rkey)
        if existing is not None:
            raise _published(filename, existing)
        try:
            storage.replace_bytes(key, mine.to_json(), tag=tag)
        except FileExistsError:
            raise AlreadyPublished(
                f"{filename}: another publisher took over its expired claim first") from None
        except FileNotFoundError:
            continue
        log.warning("took over the expired claim on %s (%s, sha256 %s…)", filename,
                    holder.describe(now), holder.sha256[:12])
        return
    raise AlreadyPublished(f"{key.rpartition('/')[2]}: its claim keeps changing; try again")


def _still_ours(storage: Storage, key: str, sha256: str, filename: str) -> None:
    """Refuse to write the record if our claim expired and was taken over meanwhile."""
    try:
        holder, _tag = read_claim(storage, key)
    except FileNotFoundError:
        holder = None
    if holder is None or holder.sha256 != sha256:
        raise AlreadyPublished(
            f"{filename}: this publication ran past the publish timeout and its claim was "
            "taken over (or removed); nothing was listed")


def _repair(storage: Storage, record: Record, path: Path, metadata: bytes) -> None:
    """Publishing the bytes of a published record again finishes what the first attempt may
    have left undone: the generation marker (a full disk or a storage outage right after the
    record) and, for a quarantined record, its files."""
    marker = record.quarantine_key
    if not storage.exists(marker):
        if _unannounced(storage, record):
            bump_generation(storage)
        return
    storage.put_file(record.wheel_key, path)
    storage.put_bytes(record.metadata_key, metadata)
    try:
        storage.delete(marker)
    except StorageError as exc:
        # A worker's S3 credentials may not delete (deploy/s3): the files are whole again,
        # and ``wheelhouse verify --quarantine`` (the operator's) lists them again.
        log.warning("stored %s again, but its quarantine marker stays until wheelhouse "
                    "verify --quarantine runs: %s", record.filename, exc)
        return
    bump_generation(storage)
    log.warning("republished quarantined %s", record.filename)


def _unannounced(storage: Storage, record: Record) -> bool:
    """Whether the generation marker is older than the record: its publisher failed between
    the two, so no server process has been told. (Both times come from the same storage's
    clock; on S3 to the second, so a bump lost within the record's second goes unseen.)"""
    try:
        told = storage.stat(GENERATION_KEY).mtime
    except FileNotFoundError:
        return True
    return told < storage.stat(record.key).mtime


def _known_archs(variant: Variant, archs: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Canonical spelling and order, as the catalog compares them with variant keys; an empty
    set says nothing, so it means unknown (a wheel with no archs would match no root)."""
    if not archs:
        return None
    return Variant.of(variant.torch, variant.cuda, archs, variant.cxx11abi).archs


def bump_generation(storage: Storage) -> None:
    """Tell every server process that the catalog changed."""
    storage.put_bytes(GENERATION_KEY, uuid.uuid4().hex.encode())
