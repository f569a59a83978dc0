"""Garbage collection: unpublished leftovers, and old versions by policy.

Always planned first (:func:`plan`), so that the CLI can print what it would delete before it
deletes anything (:func:`apply`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from packaging.version import Version

from wheelhouse.catalog import CLAIMS, RECORDS, WHEELS, Catalog, Record, record_key
from wheelhouse.publish import bump_generation
from wheelhouse.storage import Storage
from wheelhouse.variants import Variant


@dataclass(frozen=True)
class Deletion:
    key: str
    size: int
    why: str
    partial: bool = False
    """A leftover of an interrupted write (``Storage.list_partials``), not an object."""


def plan(
    storage: Storage,
    *,
    leftover_age: float = 24 * 3600,
    keep_versions: int | None = None,
    now: float | None = None,
) -> list[Deletion]:
    """What :func:`apply` would delete.

    - files under ``wheels/`` that no record names, older than ``leftover_age`` seconds
      (younger ones may belong to a publication in progress);
    - interrupted writes (temporary files, unfinished multipart uploads) as old;
    - with ``keep_versions``, every file of versions older than the newest N per variant root
      and project (record first, so the index stops listing before the files go).
    """
    now = time.time() if now is None else now
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    records = list(catalog.all_records())
    published = {r.wheel_key for r in records} | {r.metadata_key for r in records}
    out: list[Deletion] = []
    for obj in storage.list(WHEELS):
        if obj.key not in published and now - obj.mtime > leftover_age:
            out.append(Deletion(obj.key, obj.size, "unpublished leftover"))
    for obj in storage.list_partials():
        if now - obj.mtime > leftover_age:
            out.append(Deletion(obj.key, obj.size, "interrupted upload", partial=True))
    if keep_versions is not None:
        out.extend(_prune(records, keep_versions))
    return out


def _prune(records: list[Record], keep: int) -> list[Deletion]:
    groups: dict[tuple[Variant, str], list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.variant, r.project)].append(r)
    out = []
    for rs in groups.values():
        versions = sorted({Version(r.version).public for r in rs}, key=Version, reverse=True)
        doomed = set(versions[keep:])
        for r in rs:
            if Version(r.version).public in doomed:
                base = r.variant.base
                out.append(Deletion(record_key(base, r.project, r.filename), 0,
                                    f"older than the newest {keep} versions"))
                out.append(Deletion(r.metadata_key, 0, f"metadata of pruned {r.filename}"))
                out.append(Deletion(r.wheel_key, r.size, f"pruned {r.filename}"))
                out.append(Deletion(f"{CLAIMS}{base.key}/{r.filename}", 0,
                                    f"claim of pruned {r.filename}"))
    return out


def apply(storage: Storage, deletions: list[Deletion]) -> int:
    """Delete what :func:`plan` listed; records go first. Returns the number deleted."""
    ordered = sorted(deletions, key=lambda d: not d.key.startswith(RECORDS))
    for d in ordered:
        if d.partial:
            storage.delete_partial(d.key)
        else:
            storage.delete(d.key)
    if any(d.key.startswith(RECORDS) for d in ordered):
        bump_generation(storage)
    return len(ordered)

