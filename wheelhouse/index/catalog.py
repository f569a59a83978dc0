"""The catalog: what is published, grouped for O(page) look-ups, cached in memory.

Storage layout: :mod:`wheelhouse.index.layout`. A record (``records/...json``, written last) *is*
the
publication: only files with a record are listed, and not while a ``quarantine/`` marker hides
it; a ``yanks/`` marker lists it as yanked; a ``proofs/`` marker holds its GPU proof
(:mod:`wheelhouse.index.proofs`); ``generation`` changes on every publication.

Each server process keeps the catalog in memory and re-reads ``generation`` at most every
``catalog_refresh_seconds``; when it changed, only records it hasn't seen yet are fetched.
So every gunicorn worker converges on the same catalog without talking to the others.
The marker is a hint, not a guarantee: a publication writes it last, but a restore from a
backup (a sync copies in its own order) may write it before the records it covers. So storage
is also listed whole every :data:`RECONCILE` seconds whatever the marker says; what that finds
changed gets a generation of its own, so that no page rendered from the old view is served again.
Nothing was published for that listing to show, so no reader waits for it; and only markers
whose stamp changed are read again.

Readers never wait on storage: the catalog they read is an immutable view, replaced whole by
one refresher at a time, in a thread of its own. A reader that finds a refresh due starts it
and waits for it only briefly (``wait``), and not at all while storage is failing; when a
refresh fails, readers keep the last good view, which :meth:`Catalog.state` then calls stale.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from packaging.utils import BuildTag, NormalizedName, parse_wheel_filename
from packaging.version import Version

from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import StorageError, StorageUnavailable
from wheelhouse.index.layout import (
    GENERATION_KEY,
    PRIVATE,
    PROOFS,
    QUARANTINE,
    RECORDS,
    UPSTREAM,
    YANKS,
    proved_record_key,
    quarantined_record_key,
    yanked_record_key,
)
from wheelhouse.index.layout import Record as Record  # re-exported: Record lived here
from wheelhouse.index.proofs import GpuProof, of_record
from wheelhouse.index.storage import Storage
from wheelhouse.variants import Variant
from wheelhouse.wheels import parse_name

log = logging.getLogger(__name__)

#: Seconds between refreshes that readers' misses may ask for (:meth:`Catalog.catch_up`).
CATCH_UP = 0.05
#: Seconds between whole listings under an unchanged generation marker (see above).
RECONCILE = 10.0


@dataclass(frozen=True)
class Listing:
    """What a project page needs, from one view of the catalog: the files the root lists, the
    roots that have the project, and whether it was published here and its upstream listed it
    then (``wheelhouse.index.ownership``: which decides if a root without it may send installers
    upstream)."""

    files: list[Record]
    elsewhere: list[Variant]
    published_here: bool
    upstream_listed: bool
    private: bool = False
    """Kept this index's own when first published (``private/<project>``): never upstream."""


_T = TypeVar("_T")

Stamp = tuple[float, int, str]
"""A listed object's time, size and ETag: what tells a marker rewritten in place."""


def yank_reason(raw: bytes) -> bool | str:
    """A yank marker's value for :attr:`Record.yanked`: its reason, or True without one."""
    try:
        reason = json.loads(raw).get("reason")
    except (ValueError, AttributeError):
        reason = None
    return reason if isinstance(reason, str) and reason else True


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


@dataclass(frozen=True)
class CatalogState:
    """What this process's catalog is worth now: for headers, readiness and metrics."""

    loaded: bool
    """A view was ever read; until then readers get :class:`StorageUnavailable`."""
    stale: bool
    """The last refresh failed, or one has waited on storage for longer than ``wait``: readers
    get the last good view."""
    age: float
    """Seconds since storage last confirmed the view (0 before the first)."""
    error: str | None
    """Why the last refresh failed; None after a success."""
    generation: str | None
    files: int
    """Records listed (quarantined ones not counted)."""


@dataclass(frozen=True)
class _View:
    """One immutable reading of storage; readers hold on to it, the refresher replaces it."""

    generation: str
    """This view's identity, for caches of what was rendered from it: the marker, or the marker
    and a suffix where a reconciling listing found storage changed under it."""
    records: Mapping[str, Record]
    """Every readable record by its key, quarantined ones included (so that lifting a
    quarantine needs no re-read)."""
    unreadable: frozenset[str]
    """Keys of records that did not parse: immutable, so never worth reading again."""
    quarantined: frozenset[str]
    # base variant key -> project -> listed records (all archs), by version
    by_base: Mapping[str, Mapping[NormalizedName, list[Record]]]
    variants: frozenset[Variant]
    by_file: Mapping[tuple[str, str], Record]
    # project -> listed variant wheels (``/simple/``), by version
    by_label: Mapping[NormalizedName, list[Record]]
    stamps: Mapping[str, float] = field(default_factory=dict)
    """Each record key's stored time, as listed: a changed one is read again."""
    on_upstream: frozenset[str] = frozenset()
    """Projects whose upstream listed them when they were published (``ownership``)."""
    private: frozenset[str] = frozenset()
    """Projects kept this index's own (``ownership``): never sent upstream, published or not."""
    proofs: Mapping[str, GpuProof] = field(default_factory=dict)
    """Record key -> its recorded GPU proof, as stored (checked against the record on use)."""
    proof_stamps: Mapping[str, Stamp] = field(default_factory=dict)
    """Each proof marker's stamp, as listed: a proof is replaced when the wheel is proved again
    (unlike a record), so any change of it reads the proof again."""
    marker: str = ""
    """The generation marker as stored when this view was read."""
    yanks: Mapping[str, bool | str] = field(default_factory=dict)
    """Record key -> the reason it is yanked (True without one)."""
    yank_stamps: Mapping[str, Stamp] = field(default_factory=dict)
    """Each yank marker's stamp, as listed (a yank's reason can be rewritten in place)."""

    def same_listing(self, other: _View) -> bool:
        """Whether ``other`` read the same storage: the same keys, times and markers."""
        return (self.stamps, self.unreadable, self.quarantined, self.yank_stamps,
                self.on_upstream, self.private, self.proof_stamps) == (
            other.stamps, other.unreadable, other.quarantined, other.yank_stamps,
            other.on_upstream, other.private, other.proof_stamps)

    @property
    def listed(self) -> int:
        return len(self.by_file)

    @classmethod
    def build(cls, generation: str, records: dict[str, Record], unreadable: frozenset[str],
              quarantined: frozenset[str],
              yanked: Mapping[str, bool | str] | None = None,
              stamps: Mapping[str, float] | None = None,
              on_upstream: frozenset[str] = frozenset(),
              private: frozenset[str] = frozenset(),
              proofs: Mapping[str, GpuProof] | None = None,
              proof_stamps: Mapping[str, Stamp] | None = None,
              yank_stamps: Mapping[str, Stamp] | None = None) -> _View:
        by_base: dict[str, dict[NormalizedName, list[Record]]] = {}
        by_label: dict[NormalizedName, list[Record]] = {}
        for key, rec in records.items():
            if key in quarantined:
                continue
            if yanked and key in yanked:
                rec = dataclasses.replace(rec, yanked=yanked[key])
            if rec.variant_label is not None:
                by_label.setdefault(rec.project, []).append(rec)
            else:
                by_base.setdefault(rec.variant.base.key, {}).setdefault(rec.project,
                                                                        []).append(rec)
        for rs in [*(rs for ps in by_base.values() for rs in ps.values()), *by_label.values()]:
            rs.sort(key=lambda r: (Version(r.version), r.filename))
        return cls(
            generation=generation,
            records=records,
            unreadable=unreadable,
            quarantined=quarantined,
            by_base=by_base,
            # Roots with something of their own to list: a base root holding only narrowed
            # builds would show an empty page.
            variants=frozenset(r.variant for ps in by_base.values() for rs in ps.values()
                               for r in rs),
            by_file={
                **{(b, r.filename): r for b, ps in by_base.items() for rs in ps.values()
                   for r in rs},
                **{(r.variant.base.key, r.filename): r for rs in by_label.values() for r in rs},
            },
            by_label=by_label,
            stamps=stamps or {},
            on_upstream=on_upstream,
            private=private,
            proofs=proofs or {},
            proof_stamps=proof_stamps or {},
            marker=generation,
            yanks=yanked or {},
            yank_stamps=yank_stamps or {},
        )


class Catalog:
    """In-memory view of storage's published records; thread-safe, refreshed lazily.

    ``wait`` bounds how long the reader that starts a refresh waits for it (while storage is
    healthy, so that a publication is visible to the next request); other readers never wait.
    The one exception is the very first read, which its reader waits for (bounded by
    storage's timeouts): there is nothing else to answer from.
    """

    def __init__(self, storage: Storage, refresh_seconds: float = 1.0, *,
                 wait: float = 2.0, reconcile_seconds: float = RECONCILE) -> None:
        self.storage = storage
        self.refresh_seconds = refresh_seconds
        self.wait = wait
        self.reconcile_seconds = reconcile_seconds
        # When storage was last listed whole, and how many listings found it changed under an
        # unchanged marker (the suffix of their views' generations).
        self._listed = -math.inf
        self._reconciled = 0
        self._view: _View | None = None
        # Held by the one refresher, never across a reader's wait: readers only try it.
        self._refreshing = threading.Lock()
        # Set when the reader that started the running refresh may stop waiting for it.
        self._waiting: threading.Event | None = None
        self._pid = os.getpid()
        self._checked = -math.inf
        self._started: float | None = None
        # When the running refresh last heard from storage: a big reload is slow, not hung.
        self._progress = 0.0
        self._confirmed: float | None = None
        self._error: str | None = None
        # Every project this process has seen published, in any variant; it only grows, so a
        # project whose records vanish (an emptied bucket) is still known to be hosted here.
        self._ever: set[NormalizedName] = set()

    @property
    def generation(self) -> str:
        return self._current().generation

    def maybe_refresh(self, *, due: float | None = None) -> None:
        """Start a refresh if one is due (the last started ``due`` seconds ago, by default
        ``refresh_seconds``); wait for it briefly if storage has been healthy."""
        now = time.monotonic()
        if now - self._checked < (self.refresh_seconds if due is None else due):
            return
        if self._pid != os.getpid():
            self._after_fork()
        if not self._refreshing.acquire(blocking=False):
            return  # someone is refreshing: read the current view
        self._checked = now
        first = self._view is None and self._error is None
        patient = self._view is None or self._error is None
        done = threading.Event()
        self._waiting = done
        try:
            threading.Thread(target=self._background, args=(done,), name="catalog-refresh",
                             daemon=True).start()
        except BaseException:
            self._refreshing.release()
            raise
        if first:
            # Nothing to serve without it: the very first read is waited for, which storage's
            # own timeouts bound.
            done.wait()
        elif patient:
            done.wait(self.wait)

    def catch_up(self) -> None:
        """For a reader that missed what another server process may have just listed (a file
        on a page it served): refresh unless one started in the last :data:`CATCH_UP`
        seconds. Bounded like any refresh: one at a time, at most that often."""
        self.maybe_refresh(due=min(self.refresh_seconds, CATCH_UP))

    def refresh(self) -> None:
        """Re-read now, whatever the clock says, and raise :class:`StorageError` if storage
        fails (the view and its state are kept as they were, marked stale)."""
        if self._pid != os.getpid():
            self._after_fork()
        with self._refreshing:  # this caller asked to wait, for a running refresh too
            self._checked = time.monotonic()
            self._waiting = None
            self._refresh()

    def state(self) -> CatalogState:
        now = time.monotonic()
        view, started, error = self._view, self._started, self._error
        hung = started is not None and now - max(started, self._progress) > self.wait
        return CatalogState(
            loaded=view is not None,
            stale=view is not None and (error is not None or hung),
            age=0.0 if self._confirmed is None else now - self._confirmed,
            error=error,
            generation=view.generation if view is not None else None,
            files=0 if view is None else view.listed,
        )

    def _after_fork(self) -> None:
        # A refresher thread of the parent does not exist here: its lock must not outlive it.
        self._pid = os.getpid()
        self._refreshing = threading.Lock()
        self._started = None

    def _background(self, done: threading.Event) -> None:
        try:
            self._refresh()
        except StorageError:
            pass  # recorded in the state and logged by _refresh; readers keep the last view
        except Exception:
            log.exception("catalog refresh failed unexpectedly")
        finally:
            self._refreshing.release()
            done.set()

    def _refresh(self) -> None:
        """One refresh; the caller holds ``_refreshing``."""
        self._started = time.monotonic()
        try:
            view = self._read(self._view)
        except Exception as exc:
            if self._error is None:  # once per outage, not once per second
                log.warning("catalog refresh failed; serving the last good catalog: %s", exc)
            self._error = str(exc) or type(exc).__name__
            raise
        finally:
            self._started = None
        self._ever.update(r.project for r in view.records.values())
        self._view = view
        self._confirmed = time.monotonic()
        if self._error is not None:
            log.warning("catalog refresh works again (generation %s)", view.generation)
            self._error = None

    def _read(self, previous: _View | None) -> _View:
        try:
            generation = self.storage.get_bytes(GENERATION_KEY).decode(errors="replace")
        except FileNotFoundError:
            if previous is not None and previous.marker != "empty":
                # The marker is never deleted: storage that had it and lost it was emptied,
                # replaced or not mounted. Keep serving what was published (stale) rather
                # than an empty index; a restarted server accepts an emptied storage.
                raise StorageUnavailable(
                    "the generation marker is gone from storage that had published files "
                    "(emptied, replaced or not mounted?); keeping the last good catalog") from None
            # Nothing published yet, or no storage at all (a local root that is a file, a
            # bucket gone): only the first is an empty catalog.
            self.storage.ping()
            generation = "empty"
        listed = time.monotonic()
        if previous is not None and generation == previous.marker:
            if listed - self._listed < self.reconcile_seconds:
                return previous
            # Nothing was published: what a whole listing may find is a restore's, which the
            # next reader sees. The reader that started it need not wait for it.
            if self._waiting is not None:
                self._waiting.set()
        self._progress = listed
        stamps = {o.key: o.mtime for o in self.storage.list(RECORDS) if o.key.endswith(".json")}
        keys = set(stamps)
        quarantined = frozenset(quarantined_record_key(o.key)
                                for o in self.storage.list(QUARANTINE)) & keys
        known = previous.records if previous is not None else {}
        # A record stored anew under a known key (deleted, then published again with other
        # bytes) has a new time: read it again.
        seen = previous.stamps if previous is not None else {}
        records = {k: known[k] for k in keys if k in known and seen.get(k) == stamps[k]}
        unreadable = set(previous.unreadable & keys) if previous is not None else set()
        for key in sorted(keys - records.keys() - unreadable):
            self._progress = time.monotonic()
            try:
                records[key] = Record.from_json(self.storage.get_bytes(key))
            except FileNotFoundError:
                continue  # removed since the listing
            except (ValueError, TypeError, KeyError) as exc:
                # Records are immutable, so a broken one stays broken: skip it (and remember
                # it, so it isn't re-read every refresh) rather than hide the whole catalog.
                log.warning("skipping unreadable record %s: %s", key, exc)
                unreadable.add(key)
        on_upstream = frozenset(o.key.removeprefix(UPSTREAM)
                                for o in self.storage.list(UPSTREAM))
        private = frozenset(o.key.removeprefix(PRIVATE) for o in self.storage.list(PRIVATE))
        proofs, proof_stamps = self._proofs(keys, previous)
        yanks, yank_stamps = self._yanks(keys, previous)
        view = _View.build(generation, records, frozenset(unreadable), quarantined,
                           yanks, stamps, on_upstream, private, proofs, proof_stamps,
                           yank_stamps)
        self._listed = listed
        if previous is None or generation != previous.marker:
            return view
        if view.same_listing(previous):
            return previous
        self._reconciled += 1
        log.warning("storage changed without a new generation marker (a restore?); "
                    "listing what it holds now")
        return dataclasses.replace(view, generation=f"{generation}+{self._reconciled}")

    def _proofs(self, keys: set[str], previous: _View | None
                ) -> tuple[dict[str, GpuProof], dict[str, Stamp]]:
        """Record key -> GPU proof, and each proof marker's stamp."""
        return self._markers(PROOFS, proved_record_key, keys, GpuProof.from_json, "GPU proof",
                             previous.proofs if previous is not None else {},
                             previous.proof_stamps if previous is not None else {})

    def _yanks(self, keys: set[str], previous: _View | None
               ) -> tuple[dict[str, bool | str], dict[str, Stamp]]:
        """Record key -> reason of every yank marker, and each yank marker's stamp."""
        return self._markers(YANKS, yanked_record_key, keys, yank_reason, "yank marker",
                             previous.yanks if previous is not None else {},
                             previous.yank_stamps if previous is not None else {})

    def _markers(self, prefix: str, record_key_of: Callable[[str], str], keys: set[str],
                 parse: Callable[[bytes], _T], what: str, known: Mapping[str, _T],
                 seen: Mapping[str, Stamp]) -> tuple[dict[str, _T], dict[str, Stamp]]:
        """Record key -> the parsed marker under ``prefix`` for each listed record, and each
        marker's stamp. Markers are rewritten in place (a wheel proved again, a yank's reason
        changed), so one is read again when any of its time, size and ETag changed; the others
        are the last view's, so a whole listing reads only what changed."""
        stamps = {o.key: (o.mtime, o.size, o.etag) for o in self.storage.list(prefix)
                  if record_key_of(o.key) in keys}
        out: dict[str, _T] = {}
        for marker, stamp in stamps.items():
            rkey = record_key_of(marker)
            if seen.get(marker) == stamp and rkey in known:
                out[rkey] = known[rkey]
                continue
            self._progress = time.monotonic()
            try:
                out[rkey] = parse(self.storage.get_bytes(marker))
            except FileNotFoundError:
                continue  # removed since the listing
            except (ValueError, TypeError) as exc:
                log.warning("skipping unreadable %s %s: %s", what, marker, exc)
        return out, stamps

    def _current(self) -> _View:
        self.maybe_refresh()
        view = self._view
        if view is None:
            raise StorageUnavailable(
                "the catalog has not been read from storage yet: "
                f"{self._error or 'the first read is under way'}")
        return view

    def variants(self) -> list[Variant]:
        """Every index root that has something to list: base variants and narrowed ones."""
        return sorted(self._current().variants)

    def projects(self, variant: Variant) -> list[NormalizedName]:
        view = self._current()
        projects = view.by_base.get(variant.base.key, {})
        if not variant.archs:
            return sorted(p for p, rs in projects.items() if any(r.variant == variant
                                                                   for r in rs))
        return sorted(p for p, rs in projects.items() if _select(rs, variant))

    def files(self, variant: Variant, project: NormalizedName) -> list[Record]:
        """The files an index root lists for a project: O(files of that project)."""
        return _select(self._current().by_base.get(variant.base.key, {}).get(project, []),
                       variant)

    def listing(self, variant: Variant | None, project: NormalizedName) -> Listing:
        """One project page's answer: ``variant``'s root, or the plain root ``/simple/`` of
        variant wheels when None."""
        view = self._current()
        files = (list(view.by_label.get(project, ())) if variant is None
                 else _select(view.by_base.get(variant.base.key, {}).get(project, []), variant))
        elsewhere = sorted({r.variant for ps in view.by_base.values()
                            for r in ps.get(project, ())})
        return Listing(files=files, elsewhere=elsewhere, published_here=project in self._ever,
                       upstream_listed=project in view.on_upstream,
                       private=project in view.private)

    def published_for(self, spec: BuildSpec) -> Record | None:
        """The published wheel that already serves ``spec``, if any."""
        return next((r for r in self.files(spec.variant, spec.project)
                     if spec.served_by(r.filename)), None)

    def variants_of(self, project: NormalizedName) -> list[Variant]:
        """Every index root ``project`` was published into, base and narrowed, any torch."""
        return sorted({r.variant for ps in self._current().by_base.values()
                       for r in ps.get(project, ())})

    def ever_published(self, project: NormalizedName) -> bool:
        """Whether this process has seen ``project`` published here, in any variant."""
        self._current()
        return project in self._ever

    def proof(self, record: Record) -> GpuProof | None:
        """The GPU proof recorded for ``record``'s bytes, or None. A variant form (``/simple/``)
        holds the same libraries as the wheel it was made from, relabelled: that wheel's proof
        is its proof."""
        view = self._current()
        found = of_record(view.proofs.get(record.key), record)
        if found is None and record.variant_of is not None:
            source = view.by_file.get((record.variant.base.key, record.variant_of))
            if source is not None:
                found = of_record(view.proofs.get(source.key), source)
        return found

    def find(self, base: Variant, project: NormalizedName, filename: str) -> Record | None:
        r = self._current().by_file.get((base.key, filename))
        return r if r is not None and r.project == project else None

    def on_upstream(self, project: NormalizedName) -> bool:
        """Whether ``project``'s upstream listed it when it was published here (so roots
        without it may send installers there)."""
        return project in self._current().on_upstream

    def variant_projects(self) -> list[NormalizedName]:
        """Projects the plain root ``/simple/`` lists: those with a variant wheel."""
        return sorted(self._current().by_label)

    def variant_files(self, project: NormalizedName) -> list[Record]:
        """The variant wheels of a project (``/simple/``), by version."""
        return list(self._current().by_label.get(project, ()))

    def all_records(self) -> Iterable[Record]:
        """Every listed record, variant wheels included."""
        view = self._current()
        for projects in view.by_base.values():
            for rs in projects.values():
                yield from rs
        for rs in view.by_label.values():
            yield from rs

    def quarantined(self) -> list[Record]:
        """Records that ``wheelhouse verify --quarantine`` took out of the listings."""
        view = self._current()
        return [view.records[k] for k in sorted(view.quarantined)]

    def __len__(self) -> int:
        """Records listed."""
        return self._current().listed


def _select(records: list[Record], variant: Variant) -> list[Record]:
    """What an index root lists of one project's records."""
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
