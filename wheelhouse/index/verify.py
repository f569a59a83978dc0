"""``wheelhouse verify``: every stored file read back and checked against its record.

A record promises a wheel's size and sha256 and its ``.metadata``'s sha256. :func:`verify`
reads each stored file and reports those that break the promise: missing, truncated (shorter
than the record says) or mismatched (other bytes: a flipped bit, a longer file).
:func:`quarantine` then writes a marker under ``quarantine/`` for each damaged record, which the
catalog honours: the file drops out of every listing, so installers stop getting it, until the
same bytes are published again (``wheelhouse publish`` stores them anew and lifts the marker).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import Record
from wheelhouse.index.publish import bump_generation
from wheelhouse.index.storage import Storage


class Damage(StrEnum):
    """What is wrong with a stored file."""

    MISSING = "missing"
    """Not in storage at all."""
    TRUNCATED = "truncated"
    """Shorter than its record says: an interrupted copy, a full disk."""
    MISMATCHED = "mismatched"
    """Other bytes than its record's sha256 (or longer than its size)."""


@dataclass(frozen=True)
class Problem:
    """One damaged file of a published record."""

    record: Record
    key: str
    damage: Damage
    detail: str
    quarantined: bool = False
    """The record was already out of the listings when this run found it."""


@dataclass
class Report:
    checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    repaired: list[Record] = field(default_factory=list)
    """Quarantined records whose files match again (restored behind wheelhouse's back)."""

    @property
    def damaged(self) -> list[Record]:
        seen: dict[str, Record] = {}
        for p in self.problems:
            seen.setdefault(p.record.key, p.record)
        return list(seen.values())


def check(storage: Storage, record: Record, *, quarantined: bool = False) -> list[Problem]:
    """The problems of one record's wheel and ``.metadata``; empty when both are whole."""
    out: list[Problem] = []
    wheel = _check_wheel(storage, record)
    if wheel is not None:
        out.append(Problem(record, record.wheel_key, *wheel, quarantined=quarantined))
    try:
        body = storage.get_bytes(record.metadata_key)
    except FileNotFoundError:
        out.append(Problem(record, record.metadata_key, Damage.MISSING, "no such object",
                           quarantined))
        return out
    digest = hashlib.sha256(body).hexdigest()
    if digest != record.metadata_sha256:
        out.append(Problem(record, record.metadata_key, Damage.MISMATCHED,
                           f"sha256 {digest[:12]}…, the record says "
                           f"{record.metadata_sha256[:12]}…", quarantined))
    return out


def _check_wheel(storage: Storage, record: Record) -> tuple[Damage, str] | None:
    try:
        stream = storage.open_range(record.wheel_key, 0, record.size)
    except FileNotFoundError:
        return Damage.MISSING, "no such object"
    with stream:
        if stream.size < record.size:
            return Damage.TRUNCATED, f"{stream.size} bytes, the record says {record.size}"
        if stream.size > record.size:
            return Damage.MISMATCHED, f"{stream.size} bytes, the record says {record.size}"
        h = hashlib.sha256()
        for chunk in stream:
            h.update(chunk)
    digest = h.hexdigest()
    if digest != record.sha256:
        return Damage.MISMATCHED, f"sha256 {digest[:12]}…, the record says {record.sha256[:12]}…"
    return None


def verify(storage: Storage, *,
           progress: Callable[[Record], None] | None = None) -> Report:
    """Check every published record, quarantined ones included."""
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    report = Report()
    listed: Iterable[Record] = catalog.all_records()
    for quarantined, records in ((False, listed), (True, catalog.quarantined())):
        for record in records:
            problems = check(storage, record, quarantined=quarantined)
            report.checked += 1
            report.problems.extend(problems)
            if quarantined and not problems:
                report.repaired.append(record)
            if progress is not None:
                progress(record)
    return report


def quarantine(storage: Storage, report: Report) -> tuple[int, int]:
    """Take the damaged records out of the listings, and put repaired ones back.

    Returns (quarantined now, lifted). The generation changes once if anything did, so that
    every server process re-reads the catalog.
    """
    now = datetime.now(UTC).isoformat(timespec="seconds")
    added = 0
    for record in report.damaged:
        if any(p.quarantined for p in report.problems if p.record.key == record.key):
            continue
        found = [{"key": p.key, "damage": p.damage.value, "detail": p.detail}
                 for p in report.problems if p.record.key == record.key]
        marker = {"record": record.key, "sha256": record.sha256, "found_at": now,
                  "problems": found}
        storage.put_bytes(record.quarantine_key, json.dumps(marker, indent=1).encode())
        added += 1
    for record in report.repaired:
        storage.delete(record.quarantine_key)
    if added or report.repaired:
        bump_generation(storage)
    return added, len(report.repaired)
