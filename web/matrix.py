"""The build matrix: project x version x variant x Python, from the catalog and the queue.

Built from two bulk reads: the catalog (in memory) and every build job fetched in one Redis
pipeline, so the page costs O(wheels + jobs), never a request per cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from wheelhouse.builds.fanout import RequestStatus, part_status, recent_requests
from wheelhouse.builds.meta import JobMeta
from wheelhouse.builds.queue import BuildState, all_build_jobs, state_of
from wheelhouse.builds.spec import KNOWN_MACHINES, KNOWN_PYTHONS, tags_serve
from wheelhouse.errors import InvalidVariant
from wheelhouse.index.catalog import Catalog
from wheelhouse.variants import Variant, parse_variant
from wheelhouse.wheels import split_variant_label

if TYPE_CHECKING:
    from redis import Redis

    from wheelhouse.builds.job import BuildJob

#: When a wheel and jobs meet in one cell, the first state here wins.
_PRIORITY = {BuildState.BUILT: 0, BuildState.BUILDING: 1, BuildState.QUEUED: 2,
             BuildState.FAILED: 3, BuildState.CANCELLED: 4}


@dataclass
class Cell:
    state: str
    job_id: str | None = None
    progress: tuple[int, int] | None = None
    reason: str | None = None
    wheel: str | None = None
    device_code: str | None = None
    """For a built wheel: the GPU code its libraries hold (``sm_80, sm_90``), when recorded."""
    label: str | None = None
    """For a built wheel: the label of its variant form at ``/simple/`` (``cu130sm90``)."""

    @property
    def percent(self) -> int | None:
        if not self.progress or not self.progress[1]:
            return None
        return int(100 * self.progress[0] / self.progress[1])


@dataclass
class ProjectMatrix:
    project: str
    versions: list[str] = field(default_factory=list)
    columns: list[tuple[str, str]] = field(default_factory=list)
    """(variant key, Python) pairs, sorted."""
    cells: dict[tuple[str, str, str], Cell] = field(default_factory=dict)

    def cell(self, version: str, variant: str, python: str) -> Cell:
        return self.cells.get((version, variant, python), Cell("missing"))

    def variants(self) -> list[tuple[str, int]]:
        """Variant keys with how many Python columns each spans (for the grouped header)."""
        out: list[tuple[str, int]] = []
        for variant, _ in self.columns:
            if out and out[-1][0] == variant:
                out[-1] = (variant, out[-1][1] + 1)
            else:
                out.append((variant, 1))
        return out


def pythons_served(tags: frozenset[Tag]) -> list[str]:
    """The Pythons a published wheel installs into, on any CPU (the core's one tag rule)."""
    return [python for python in KNOWN_PYTHONS
            if any(tags_serve(tags, python, machine) for machine in KNOWN_MACHINES)]


def _version_key(v: str) -> tuple[int, Version | str]:
    try:
        return (1, Version(v))
    except InvalidVersion:
        return (0, v)


def _variant_sort(key: str) -> tuple[int, Variant | str]:
    try:
        return (1, parse_variant(key))
    except InvalidVariant:
        return (0, key)


def build_matrix(catalog: Catalog, conn: Redis | None, *, project: str | None = None,
                 jobs: list[BuildJob] | None = None) -> list[ProjectMatrix]:
    """Every project's matrix (or one project's), wheels first, then jobs on top: columns for
    the variants that have a wheel or a build of the project."""
    by_project: dict[str, ProjectMatrix] = {}

    def place(proj: str, version: str, variant: str, python: str, cell: Cell) -> None:
        if project is not None and proj != project:
            return
        pm = by_project.setdefault(proj, ProjectMatrix(proj))
        key = (version, variant, python)
        old = pm.cells.get(key)
        if old is None or _PRIORITY[BuildState(cell.state)] < _PRIORITY[BuildState(old.state)]:
            pm.cells[key] = cell

    # Few distinct tag sets recur over many wheels: ask about each (variant, tags) once.
    served: dict[frozenset[Tag], list[str]] = {}
    records = [r for r in catalog.all_records() if project is None or r.project == project]
    # A wheel and its variant form share variant, public version and tags.
    labels: dict[tuple[str, str, str, frozenset[Tag]], str] = {}
    for record in records:
        if record.variant_label is not None:
            try:
                _, version, _, tags = parse_wheel_filename(split_variant_label(record.filename)[0])
            except InvalidWheelFilename:
                continue
            labels[(record.project, version.public, record.variant.key, tags)] = \
                record.variant_label
    for record in records:
        if record.variant_label is not None:
            continue
        try:
            _, version, _, tags = parse_wheel_filename(record.filename)
        except InvalidWheelFilename:
            continue
        pythons = served.get(tags)
        if pythons is None:
            pythons = served[tags] = pythons_served(tags)
        label = labels.get((record.project, version.public, record.variant.key, tags))
        for python in pythons:
            place(record.project, str(version.public), record.variant.key, python,
                  Cell(BuildState.BUILT.value, wheel=record.filename,
                       device_code=record.build.device_code_summary(), label=label))
    if conn is not None:
        for job in jobs if jobs is not None else all_build_jobs(conn):
            meta = JobMeta.from_meta(job.meta)
            spec = meta.spec
            if spec is None:
                continue  # not one of ours
            state = state_of(job)
            failed = meta.failure if state is BuildState.FAILED else None
            place(spec.project, spec.version, spec.variant.key, spec.python, Cell(
                state.value, job_id=job.id, progress=meta.progress,
                reason=(failed.reason or None) if failed is not None else None))
    for pm in by_project.values():
        versions = {k[0] for k in pm.cells}
        pm.versions = sorted(versions, key=_version_key, reverse=True)
        # Every variant the project has a wheel or a build of, by every Python seen: the holes
        # are what can be requested. Not each torch by each CUDA line the fleet builds (issue
        # 30): columns of nothing but "missing" cells; the request form offers those.
        variants = {k[1] for k in pm.cells}
        columns = {(v, p) for v in variants for p in {k[2] for k in pm.cells}}
        pm.columns = sorted(columns, key=lambda c: (_variant_sort(c[0]),
                                                    tuple(int(p) for p in c[1].split("."))))
    return [by_project[p] for p in sorted(by_project)]


def split_requests(catalog: Catalog, conn: Redis, jobs: list[BuildJob], *,
                   project: str | None = None, limit: int = 20) -> list[RequestStatus]:
    """The newest split requests (``wheelhouse.builds.fanout``), each with its parts' states, from
    the jobs already fetched in bulk: one Redis read for the records, none per part."""
    states = {job.id: state_of(job) for job in jobs}
    out = []
    for request in recent_requests(conn, limit):
        if project is not None and request.spec.project != project:
            continue
        parts = []
        for part, spec in zip(request.parts, request.part_specs(), strict=True):
            state = states.get(part.job_id)
            record = catalog.published_for(spec) if state is None else None  # no job was made
            parts.append(part_status(part, state, record.filename if record else None))
        out.append(RequestStatus(request, tuple(parts)))
    return out
