"""Split requests: one build request for several GPU architectures as one job per architecture.

A request for ``sm80`` and ``sm90`` split this way becomes two single-arch build specs
(``torch2.14-cu130-sm80`` and ``-sm90``), each an ordinary build job that any capable worker
takes and that publishes its own wheel, so a fleet builds the architectures side by side. What
ties the parts together is one small record in Redis, :class:`SplitRequest`: the request as
asked and its parts' job ids. Its id is deterministic (``split-`` + the unsplit spec's job id
without ``build-``), so asking twice finds the same request, as :func:`queue.enqueue_build`
finds the same job. The request's state is derived from its parts' (:func:`request_state`).

The parts are queued by ``wheelhouse.builds.submission``; this module only names them,
keeps the record and reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wheelhouse import keys
from wheelhouse.builds.queue import KEEP_SECONDS, BuildState, BuildStatus, cancel_build, get_build
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import InvalidBuildSpec
from wheelhouse.variants import Variant

if TYPE_CHECKING:
    from redis import Redis

    from wheelhouse.index.catalog import Catalog

#: Every split request's id starts with this; build job ids start with ``build-``.
PREFIX = "split-"
RECORD_VERSION = 1


def request_id(spec: BuildSpec) -> str:
    """The split request's id for ``spec`` (the request as asked, every architecture)."""
    return PREFIX + spec.job_id.removeprefix("build-")


def is_request_id(build_id: str) -> bool:
    return build_id.startswith(PREFIX)


def part_spec(spec: BuildSpec, arch: str) -> BuildSpec:
    """``spec`` narrowed to the one architecture ``arch``: its own variant, wheel and job."""
    variant = Variant.of(spec.torch, spec.cuda, [arch], spec.cxx11abi)
    return dataclasses.replace(spec, variant=variant)


@dataclass(frozen=True)
class Part:
    arch: str
    job_id: str


@dataclass(frozen=True)
class SplitRequest:
    """The contract between whoever splits a request and whoever shows it: versioned JSON."""

    id: str
    spec: BuildSpec
    """The request as asked: its architectures, or none for the recipe's default."""
    parts: tuple[Part, ...]
    created_at: float

    @classmethod
    def create(cls, spec: BuildSpec, archs: Iterable[str]) -> SplitRequest:
        """The request for ``spec`` split into one part per architecture of ``archs`` (the
        spec's own, or the recipe's default when the spec names none)."""
        wanted = tuple(dict.fromkeys(archs))
        if len(wanted) < 2:
            raise InvalidBuildSpec("a split request needs at least two GPU architectures")
        return cls(request_id(spec), spec,
                   tuple(Part(a, part_spec(spec, a).job_id) for a in wanted), time.time())

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(p.arch for p in self.parts)

    def part_specs(self) -> list[BuildSpec]:
        return [part_spec(self.spec, p.arch) for p in self.parts]

    def describe(self) -> str:
        """``flash-attn 2.8.3 for Python 3.11, torch2.8-cu128 (x86_64), one job per
        architecture: sm80, sm90``."""
        return (f"{self.spec.describe()}, one job per architecture: "
                + ", ".join(f"sm{a}" for a in self.archs))

    def to_dict(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "id": self.id, "spec": self.spec.to_dict(),
                "parts": [{"arch": p.arch, "job_id": p.job_id} for p in self.parts],
                "created_at": self.created_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitRequest:
        """Read a record; :class:`InvalidBuildSpec` for one this release can't read."""
        try:
            # A newer writer's record is read by the fields this release knows (shapes).
            if not isinstance(data["version"], int) or data["version"] < RECORD_VERSION:
                raise InvalidBuildSpec(f"split request record version {data['version']!r}")
            parts = tuple(Part(str(p["arch"]), str(p["job_id"])) for p in data["parts"])
            return cls(str(data["id"]), BuildSpec.from_dict(data["spec"]), parts,
                       float(data["created_at"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidBuildSpec):
                raise
            raise InvalidBuildSpec(f"split request record is malformed: {exc}") from None


def record_request(conn: Redis, request: SplitRequest) -> tuple[SplitRequest, bool]:
    """Keep ``request`` unless a request of that id exists; return the kept one and whether
    it is new (idempotent: the first record's parts stay, whatever a recipe says later)."""
    key = keys.split(request.id)
    created = bool(conn.set(key, json.dumps(request.to_dict()), nx=True, ex=KEEP_SECONDS))
    if created:
        with conn.pipeline() as pipe:
            pipe.zadd(keys.SPLITS, {request.id: request.created_at})
            pipe.zremrangebyscore(keys.SPLITS, "-inf", time.time() - KEEP_SECONDS)
            pipe.execute()
        return request, True
    existing = load_request(conn, request.id)
    return (existing, False) if existing is not None else (request, False)


def load_request(conn: Redis, request_id: str) -> SplitRequest | None:
    """The split request ``request_id``, or None if there is none (or none readable)."""
    raw = conn.get(keys.split(request_id))
    if raw is None:
        return None
    try:
        return SplitRequest.from_dict(json.loads(raw))
    except (ValueError, InvalidBuildSpec):
        return None


def recent_requests(conn: Redis, limit: int = 50) -> list[SplitRequest]:
    """The newest split requests first, at most ``limit``; expired ones are dropped."""
    ids = [i.decode() if isinstance(i, bytes) else str(i)
           for i in conn.zrevrange(keys.SPLITS, 0, limit - 1)]
    if not ids:
        return []
    raws = conn.mget([keys.split(i) for i in ids])
    out = []
    for rid, raw in zip(ids, raws, strict=True):
        if raw is None:
            conn.zrem(keys.SPLITS, rid)
            continue
        try:
            out.append(SplitRequest.from_dict(json.loads(raw)))
        except (ValueError, InvalidBuildSpec):
            continue
    return out


# -- state --


@dataclass(frozen=True)
class PartStatus:
    arch: str
    job_id: str
    state: BuildState
    build: BuildStatus | None = None
    """The part's build job, when it has one (a part already published had none)."""
    wheel: str | None = None

    @property
    def finished(self) -> bool:
        return self.state.ended


def request_state(states: Iterable[BuildState]) -> BuildState:
    """A split request's state from its parts': failed if any failed, else cancelled if any
    was cancelled, built when all are built, building while any part builds, else queued
    (parts built and parts waiting for a worker)."""
    seen = list(states)
    if BuildState.FAILED in seen:
        return BuildState.FAILED
    if BuildState.CANCELLED in seen:
        return BuildState.CANCELLED
    if seen and all(s is BuildState.BUILT for s in seen):
        return BuildState.BUILT
    if BuildState.BUILDING in seen:
        return BuildState.BUILDING
    return BuildState.QUEUED


@dataclass(frozen=True)
class RequestStatus:
    request: SplitRequest
    parts: tuple[PartStatus, ...]

    @property
    def state(self) -> BuildState:
        return request_state(p.state for p in self.parts)

    @property
    def finished(self) -> bool:
        """Every part ended (a request that failed may still have parts running)."""
        return all(p.finished for p in self.parts)


def part_status(part: Part, state: BuildState | None, published: str | None,
                build: BuildStatus | None = None) -> PartStatus:
    """A part's status from its job's state (if it has a job; ``build``: the job's status,
    when read) and the wheel published for it (if any). A part with neither was never queued
    or has expired: it shows as cancelled."""
    if state is not None:
        wheel = (build.wheel if build is not None else None) or published
        return PartStatus(part.arch, part.job_id, state, build, wheel)
    if published is not None:
        return PartStatus(part.arch, part.job_id, BuildState.BUILT, None, published)
    return PartStatus(part.arch, part.job_id, BuildState.CANCELLED)


def request_status(conn: Redis, request: SplitRequest,
                   catalog: Catalog | None = None) -> RequestStatus:
    """Each part's build, and with ``catalog`` the wheel of a part that needed no job."""
    parts = []
    for part, spec in zip(request.parts, request.part_specs(), strict=True):
        build = get_build(conn, part.job_id)
        published = None
        if catalog is not None and (build is None or build.state is BuildState.BUILT):
            record = catalog.published_for(spec)
            published = record.filename if record is not None else None
        parts.append(part_status(part, build.state if build is not None else None, published,
                                 build))
    return RequestStatus(request, tuple(parts))


def cancel_request(conn: Redis, request: SplitRequest) -> list[str]:
    """Cancel every part still queued or building; the job ids of those asked to stop."""
    return [p.job_id for p in request.parts if cancel_build(conn, p.job_id)]
