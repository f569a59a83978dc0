"""Garbage collection: unpublished leftovers, orphan claims, and old versions by policy.

Always planned first (:func:`plan`), so that the CLI can print what it would delete before it
deletes anything (:func:`apply`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

from packaging.version import Version

from wheelhouse.config import DEFAULT_PUBLISH_TIMEOUT
from wheelhouse.errors import InvalidWheel
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import (
    CLAIMS,
    LOGS,
    PROOFS,
    QUARANTINE,
    RECORDS,
    SOURCES,
    WHEELS,
    YANKS,
    Record,
    record_key,
)
from wheelhouse.index.publish import bump_generation, read_claim
from wheelhouse.index.storage import LocalStorage, Storage
from wheelhouse.variants import Variant
from wheelhouse.wheels import parse_name, split_variant_label


@dataclass(frozen=True)
class Deletion:
    key: str
    size: int
    why: str
    partial: bool = False
    """A leftover of an interrupted write (``Storage.list_partials``), not an object."""
    tag: str | None = None
    """Delete only this version of the object (a claim someone may take over meanwhile)."""


def plan(
    storage: Storage,
    *,
    leftover_age: float = 24 * 3600,
    source_age: float = 7 * 24 * 3600,
    keep_versions: int | None = None,
    claim_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
    now: float | None = None,
) -> list[Deletion]:
    """What :func:`apply` would delete.

    - files under ``wheels/`` that no record names, older than ``leftover_age`` seconds
      (younger ones may belong to a publication in progress);
    - interrupted writes (temporary files, unfinished multipart uploads) as old;
    - sdists uploaded for builds (``wheelhouse request PATH``) older than ``source_age``: a build
      copies its sdist out of storage when it starts, and a request made again uploads it again;
    - orphan claims: a claim with no record, older than the publish timeout
      (``claim_timeout``: the operator's ``Config.publish_timeout``), whose publisher died; at
      once when its publisher ran on this host and no longer runs;
    - with ``keep_versions``, every file of versions older than the newest N per variant root
      and project (record first, so the index stops listing before the files go).
    """
    now = time.time() if now is None else now
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    records = [*catalog.all_records(), *catalog.quarantined()]
    published = ({r.wheel_key for r in records} | {r.metadata_key for r in records}
                 | {r.provenance_key for r in records if r.provenance_sha256 is not None})
    out: list[Deletion] = []
    for obj in storage.list(WHEELS):
        if obj.key not in published and now - obj.mtime > leftover_age:
            out.append(Deletion(obj.key, obj.size, "unpublished leftover"))
    upload = "abandoned multipart upload" if not isinstance(storage, LocalStorage) \
        else "interrupted write"
    for obj in storage.list_partials():
        if now - obj.mtime > leftover_age:
            out.append(Deletion(obj.key, obj.size, upload, partial=True))
    for obj in storage.list(SOURCES):
        if now - obj.mtime > source_age:
            out.append(Deletion(obj.key, obj.size, "uploaded sdist, built from or expired"))
    out.extend(_orphan_claims(storage, {r.key for r in records}, claim_timeout, now))
    if keep_versions is not None:
        # Logs, quarantine and yank markers and GPU proofs exist for some wheels only: list
        # what is there.
        sometimes = {o.key: o.size for prefix in _SOMETIMES
                     for o in storage.list(prefix)}
        out.extend(_prune(records, keep_versions, sometimes))
    return out


#: Where the keys live that only some publications have.
_SOMETIMES = (LOGS, QUARANTINE, YANKS, PROOFS)


def _orphan_claims(storage: Storage, recorded: set[str], timeout: float,
                   now: float) -> list[Deletion]:
    """Claims without a record whose publisher has had the whole publish timeout."""
    out = []
    for obj in storage.list(CLAIMS):
        base, _, filename = obj.key.removeprefix(CLAIMS).rpartition("/")
        try:
            # A variant wheel's name (``…-cu130sm90.whl``) names its project the same way.
            project = parse_name(split_variant_label(filename)[0]).project
        except InvalidWheel:
            project = None
        if project is not None and record_key(base, project, filename) in recorded:
            continue
        if project is not None and storage.exists(record_key(base, project, filename)):
            continue  # an unreadable record still holds its name
        with contextlib.suppress(FileNotFoundError):
            claim, tag = read_claim(storage, obj.key)
            age = now - claim.claimed_at
            if age > timeout or claim.gone():
                dead = ", its publisher no longer runs" if age <= timeout else ""
                out.append(Deletion(obj.key, obj.size,
                                    f"orphan claim ({claim.describe(now)}{dead}, no record)",
                                    tag=tag))
    return out


def _prune(records: list[Record], keep: int, sometimes: dict[str, int]) -> list[Deletion]:
    """Every key of the records of versions older than the newest ``keep``
    (:meth:`Record.keys`, record first); of ``sometimes`` only what is there."""
    groups: dict[tuple[Variant, str], list[Record]] = defaultdict(list)
    for r in records:
        # A variant wheel (``+pt214``) goes with the wheel it was made from: the same variant
        # and public version.
        groups[(r.variant, r.project)].append(r)
    out = []
    for rs in groups.values():
        versions = sorted({Version(r.version).public for r in rs}, key=Version, reverse=True)
        doomed = set(versions[keep:])
        for r in rs:
            if Version(r.version).public not in doomed:
                continue
            for key, what in r.keys().items():
                if key.startswith(_SOMETIMES) and key not in sometimes:
                    continue
                if key == r.provenance_key and r.provenance_sha256 is None:
                    continue  # published before provenance, or without a signer
                size = r.size if key == r.wheel_key else sometimes.get(key, 0)
                why = (f"older than the newest {keep} versions" if key == r.key
                       else f"{what} of pruned {r.filename}")
                out.append(Deletion(key, size, why))
    return out


def apply(storage: Storage, deletions: list[Deletion]) -> int:
    """Delete what :func:`plan` listed; records go first. Returns the number deleted."""
    ordered = sorted(deletions, key=lambda d: not d.key.startswith(RECORDS))
    deleted = 0
    for d in ordered:
        if d.partial:
            storage.delete_partial(d.key)
        else:
            try:
                storage.delete(d.key, tag=d.tag)
            except FileExistsError:
                continue  # changed since planned (a claim taken over): no longer an orphan
        deleted += 1
    if any(d.key.startswith(RECORDS) for d in ordered):
        bump_generation(storage)
    return deleted

