"""The catalog: what is published, grouped for O(page) look-ups, cached in memory.

Storage layout (every key below the storage root):

- ``wheels/<base variant>/<project>/<file>``           the wheel
- ``wheels/<base variant>/<project>/<file>.metadata``  its METADATA (PEP 658)
- ``records/<base variant>/<project>/<file>.json``     the record; written last, so it *is*
  the publication: only files with a record are listed
- ``generation``                                       changes on every publication

Each server process keeps the catalog in memory and re-reads ``generation`` at most every
``catalog_refresh_seconds``; when it changed, only records it hasn't seen yet are fetched.
So every gunicorn worker converges on the same catalog without talking to the others.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from packaging.utils import BuildTag, NormalizedName, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from wheelhouse.buildfacts import BuildFacts
from wheelhouse.storage import Storage
from wheelhouse.variants import Variant, parse_variant
from wheelhouse.wheels import parse_name

log = logging.getLogger(__name__)

GENERATION_KEY = "generation"
RECORDS = "records/"
WHEELS = "wheels/"
CLAIMS = "claims/"


def wheel_key(base: Variant, project: str, filename: str) -> str:
    return f"{WHEELS}{base.key}/{project}/{filename}"


def record_key(base: Variant, project: str, filename: str) -> str:
    return f"{RECORDS}{base.key}/{project}/{filename}.json"


@dataclass(frozen=True)
class Record:
    """What publishing a wheel promises about it; serialized as the ``.json`` record.

    In JSON the variant is its key and the build facts a plain object, so records written by
    older versions read back unchanged.
    """

    filename: str
    project: NormalizedName
    version: str
    variant: Variant
    archs: tuple[str, ...] | None
    sha256: str
    size: int
    metadata_sha256: str
    requires_python: str | None
    upload_time: str
    yanked: bool | str = False
    build: BuildFacts = field(default_factory=BuildFacts)

    @property
    def wheel_key(self) -> str:
        return wheel_key(self.variant.base, self.project, self.filename)

    @property
    def metadata_key(self) -> str:
        return self.wheel_key + ".metadata"

    def to_json(self) -> bytes:
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["variant"] = self.variant.key
        data["archs"] = None if self.archs is None else list(self.archs)
        data["build"] = self.build.to_dict()
        return json.dumps(data, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        data = json.loads(raw)
        archs = data.get("archs")
        data["archs"] = None if archs is None else tuple(archs)
        data["project"] = canonicalize_name(data["project"])
        data["variant"] = parse_variant(data["variant"])
        data["build"] = BuildFacts.from_dict(data.get("build"))
        return cls(**data)


def _dedupe_key(r: Record) -> tuple[str, frozenset[Any]]:
    name = parse_name(r.filename)
    return (name.version.public, name.tags)


def _arch_rank(record: Record, wanted: tuple[str, ...]) -> int | None:
    """0 for a wheel built for exactly ``wanted``, 1 for a fat wheel that holds them, else None."""
    if record.archs is None:
        return 2  # built with the recipe's default set; assumed to hold every default arch
    have = set(record.archs)
    if have == set(wanted):
        return 0
    if have.issuperset(wanted):
        return 1
    return None


class Catalog:
    """In-memory view of storage's published records; thread-safe, refreshed lazily."""

    def __init__(self, storage: Storage, refresh_seconds: float = 1.0) -> None:
        self.storage = storage
        self.refresh_seconds = refresh_seconds
        self._lock = threading.Lock()
        self._checked = 0.0
        self._generation: str | None = None
        self._keys: set[str] = set()
        # base variant key -> project -> records (all archs)
        self._by_base: dict[str, dict[NormalizedName, list[Record]]] = {}
        self._variants: frozenset[Variant] = frozenset()
        self._by_file: dict[tuple[str, str], Record] = {}

    @property
    def generation(self) -> str:
        self.maybe_refresh()
        return self._generation or "empty"

    def maybe_refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.refresh_seconds:
            return
        with self._lock:
            if now - self._checked < self.refresh_seconds:
                return
            self._checked = now
            try:
                gen = self.storage.get_bytes(GENERATION_KEY).decode()
            except FileNotFoundError:
                gen = "empty"
            if gen != self._generation:
                self._reload()
                self._generation = gen

    def refresh(self) -> None:
        """Re-read now, whatever the clock says."""
        self._checked = 0.0
        self.maybe_refresh()

    def _reload(self) -> None:
        keys = {o.key for o in self.storage.list(RECORDS) if o.key.endswith(".json")}
        new = keys - self._keys
        gone = self._keys - keys
        by_base = {b: {p: list(rs) for p, rs in projects.items()}
                   for b, projects in self._by_base.items()}
        if gone:
            for projects in by_base.values():
                for p, rs in projects.items():
                    projects[p] = [r for r in rs if record_key(r.variant.base, r.project,
                                                               r.filename) not in gone]
        for key in sorted(new):
            try:
                rec = Record.from_json(self.storage.get_bytes(key))
            except FileNotFoundError:
                keys.discard(key)
                continue
            except (ValueError, TypeError, KeyError) as exc:
                # Records are immutable, so a broken one stays broken: skip it (and keep its
                # key, so it isn't re-read every refresh) rather than hide the whole catalog.
                log.warning("skipping unreadable record %s: %s", key, exc)
                continue
            base = rec.variant.base.key
            by_base.setdefault(base, {}).setdefault(rec.project, []).append(rec)
        for projects in by_base.values():
            for rs in projects.values():
                rs.sort(key=lambda r: (Version(r.version), r.filename))
        self._by_base = {b: {p: rs for p, rs in ps.items() if rs}
                         for b, ps in by_base.items()}
        # Roots with something of their own to list: a base root holding only narrowed builds
        # would show an empty page.
        self._variants = frozenset(
            r.variant for ps in self._by_base.values() for rs in ps.values() for r in rs
        )
        self._by_file = {(b, r.filename): r for b, ps in self._by_base.items()
                         for rs in ps.values() for r in rs}
        self._keys = keys

    def variants(self) -> list[Variant]:
        """Every index root that has something to list: base variants and narrowed ones."""
        self.maybe_refresh()
        return sorted(self._variants)

    def projects(self, variant: Variant) -> list[NormalizedName]:
        self.maybe_refresh()
        projects = self._by_base.get(variant.base.key, {})
        if not variant.archs:
            return sorted(p for p, rs in projects.items() if any(r.variant == variant
                                                                   for r in rs))
        return sorted(p for p in projects if self.files(variant, p))

    def files(self, variant: Variant, project: NormalizedName) -> list[Record]:
        """The files an index root lists for a project: O(files of that project)."""
        self.maybe_refresh()
        records = self._by_base.get(variant.base.key, {}).get(project, [])
        # Even a base root can hold two files with the same version and tags (build tags),
        # so every root goes through the same de-duplication.
        best: dict[tuple[str, frozenset[Any]], tuple[int, BuildTag, Record]] = {}
        for r in records:
            if variant.archs:
                rank = _arch_rank(r, variant.archs)
                if rank is None:
                    continue
            elif r.variant == variant:
                rank = 0
            else:
                continue
            k = _dedupe_key(r)
            build = parse_wheel_filename(r.filename)[2]
            # Lower rank first; then the higher build tag, as the wheel spec's tie-breaker.
            if k not in best or (rank, best[k][1]) < (best[k][0], build):
                best[k] = (rank, build, r)
        return sorted((r for _, _, r in best.values()),
                      key=lambda r: (Version(r.version), r.filename))

    def find(self, base: Variant, project: NormalizedName, filename: str) -> Record | None:
        self.maybe_refresh()
        r = self._by_file.get((base.key, filename))
        return r if r is not None and r.project == project else None

    def all_records(self) -> Iterable[Record]:
        self.maybe_refresh()
        for projects in self._by_base.values():
            for rs in projects.values():
                yield from rs

    def __len__(self) -> int:
        self.maybe_refresh()
        return len(self._keys)
