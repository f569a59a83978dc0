"""The API's answers as typed values: the web builds them and serialises ``to_json()``; the CLI
reads them back with ``from_json()`` (``web/static/openapi.json`` stays their description).

Readers follow ``wheelhouse.shapes``: keys this release doesn't know are ignored (a newer web),
optional keys that are missing take their defaults, and a missing or mistyped required key is
:class:`~wheelhouse.errors.InvalidResponse`, one line saying which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from wheelhouse.errors import InvalidResponse
from wheelhouse.shapes import known_fields


def _object(data: object, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InvalidResponse(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _require(data: dict[str, Any], what: str, **types: type | tuple[type, ...]) -> None:
    for name, kind in types.items():
        if name not in data:
            raise InvalidResponse(f"{what}: the answer has no {name!r}")
        if not isinstance(data[name], kind):
            raise InvalidResponse(f"{what}: {name!r} is {type(data[name]).__name__}, "
                                  "not of the expected type")


def _fields_json(value: Any, *, omit_none: tuple[str, ...] = ()) -> dict[str, Any]:
    """A flat dataclass as JSON, field by field; the fields named in ``omit_none`` left out
    where they are None (links the API adds and the page lacks)."""
    out = {f.name: getattr(value, f.name) for f in dataclass_fields(value)}
    for name in omit_none:
        if out[name] is None:
            del out[name]
    return out


def _list(data: dict[str, Any], name: str, what: str) -> list[Any]:
    value = data.get(name, [])
    if not isinstance(value, list):
        raise InvalidResponse(f"{what}: {name!r} is not a list")
    return value


# -- POST /api/builds --


@dataclass(frozen=True)
class SubmittedBuild:
    """One build a submission asked for; a split request's ``parts`` are builds of their own,
    each with its ``arch``."""

    id: str
    python: str | None = None
    variant: str | None = None
    state: str | None = None
    created: bool = False
    wheel: str | None = None
    url: str | None = None
    api: str | None = None
    arch: str | None = None  # only on a part of a split request
    parts: tuple[SubmittedBuild, ...] | None = None  # only on a split request

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "python": self.python, "variant": self.variant,
                               "state": self.state, "created": self.created,
                               "wheel": self.wheel, "url": self.url, "api": self.api}
        if self.arch is not None:
            out["arch"] = self.arch
        if self.parts is not None:
            out["parts"] = [p.to_json() for p in self.parts]
        return out

    @classmethod
    def from_json(cls, data: object) -> SubmittedBuild:
        what = "a submitted build"
        d = _object(data, what)
        _require(d, what, id=str)
        fields = known_fields(cls, d)
        if "parts" in d:
            fields["parts"] = tuple(cls.from_json(p) for p in _list(d, "parts", what))
        fields["created"] = d.get("created") is True
        return cls(**fields)


@dataclass(frozen=True)
class BuildsCreated:
    """The answer to a build submission: one entry per Python version, and any warnings."""

    builds: tuple[SubmittedBuild, ...]
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"builds": [b.to_json() for b in self.builds]}
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out

    @classmethod
    def from_json(cls, data: object) -> BuildsCreated:
        what = "the build submission's answer"
        d = _object(data, what)
        _require(d, what, builds=list)
        return cls(builds=tuple(SubmittedBuild.from_json(b) for b in d["builds"]),
                   warnings=tuple(str(w) for w in _list(d, "warnings", what)))


# -- GET /api/builds/<id> --


@dataclass(frozen=True)
class BuildView:
    """One build as the API and its page show it. The nested parts (``spec``, ``progress``,
    ``patches``, ``compile_cache``, ``source``, ``urls``) stay JSON objects: the web writes
    them, the CLI prints a few of their fields."""

    id: str
    state: str
    finished: bool
    phase: str | None = None
    attempt: int = 1
    """Above 1: a worker died mid-build and this run resumed from the compile cache."""
    spec: dict[str, Any] = field(default_factory=dict)
    description: str | None = None
    variant: str | None = None
    progress: dict[str, Any] | None = None
    position: int | None = None
    failure_kind: str | None = None
    reason: str | None = None
    max_jobs: int | None = None
    max_jobs_reason: str | None = None
    max_jobs_charge: Any = None
    peak_memory_bytes: int | None = None
    sandbox: str | None = None
    patches: list[dict[str, Any]] | None = None
    device_code: Any = None
    compile_cache: dict[str, Any] | None = None
    steps: str | None = None
    """Seconds of each step that has ended, e.g. ``venv 3.1 s, compile 101.0 s``."""
    toolkit: Any = None
    source: dict[str, Any] | None = None
    provenance: str | None = None
    wheel: str | None = None
    install: str | None = None
    enqueued_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    elapsed_seconds: float | None = None
    estimate_seconds: float | None = None
    remaining_seconds: float | None = None
    finishing: bool = False
    urls: dict[str, str] | None = None  # the API's links; the page has no use for them

    def to_json(self) -> dict[str, Any]:
        return _fields_json(self, omit_none=("urls",))

    @classmethod
    def from_json(cls, data: object) -> BuildView:
        what = "a build's view"
        d = _object(data, what)
        _require(d, what, id=str, state=str, finished=bool)
        return cls(**known_fields(cls, d))


@dataclass(frozen=True)
class RequestPart:
    """One architecture's build within a split request's view."""

    arch: str
    id: str
    state: str
    job: bool = False
    finished: bool = False
    variant: str | None = None
    wheel: str | None = None
    progress: dict[str, Any] | None = None
    phase: str | None = None
    reason: str | None = None
    failure_kind: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    install: str | None = None
    url: str | None = None  # the API's links to the part; absent on the page
    api: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _fields_json(self, omit_none=("url", "api"))

    @classmethod
    def from_json(cls, data: object) -> RequestPart:
        what = "a split request's part"
        d = _object(data, what)
        _require(d, what, arch=str, id=str, state=str)
        return cls(**known_fields(cls, d))


@dataclass(frozen=True)
class RequestView:
    """A split request: its state from its parts', and each part's."""

    id: str
    state: str
    finished: bool
    parts: tuple[RequestPart, ...]
    kind: str = "split"
    spec: dict[str, Any] = field(default_factory=dict)
    description: str | None = None
    variant: str | None = None
    archs: tuple[str, ...] = ()
    enqueued_at: str | None = None
    urls: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "kind": self.kind, "state": self.state, "finished": self.finished,
            "spec": self.spec, "description": self.description, "variant": self.variant,
            "archs": list(self.archs), "parts": [p.to_json() for p in self.parts],
            "enqueued_at": self.enqueued_at}
        if self.urls is not None:
            out["urls"] = self.urls
        return out

    @classmethod
    def from_json(cls, data: object) -> RequestView:
        what = "a split request's view"
        d = _object(data, what)
        _require(d, what, id=str, state=str, finished=bool, parts=list)
        fields = known_fields(cls, d)
        fields["parts"] = tuple(RequestPart.from_json(p) for p in d["parts"])
        fields["archs"] = tuple(str(a) for a in _list(d, "archs", what))
        return cls(**fields)


def parse_view(data: object) -> BuildView | RequestView:
    """``GET /api/builds/<id>``'s answer: a split request's view, or one build's."""
    if isinstance(data, dict) and data.get("kind") == "split":
        return RequestView.from_json(data)
    return BuildView.from_json(data)


# -- GET /api/workers --


@dataclass(frozen=True)
class FleetView:
    """The live fleet: each worker's advert (``wheelhouse.builds.fleet.WorkerAd`` as JSON),
    the (CUDA, machine) pairs it can build, and why versions no worker offers are missing."""

    workers: tuple[dict[str, Any], ...]
    servable: tuple[tuple[str, str], ...] = ()
    unavailable: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"workers": list(self.workers),
                "servable": [{"cuda": c, "machine": m} for c, m in self.servable],
                "unavailable": self.unavailable}

    @classmethod
    def from_json(cls, data: object) -> FleetView:
        what = "the fleet listing"
        d = _object(data, what)
        _require(d, what, workers=list)
        pairs = [_object(p, what) for p in _list(d, "servable", what)]
        unavailable = d.get("unavailable", {})
        return cls(workers=tuple(_object(w, what) for w in d["workers"]),
                   servable=tuple((str(p.get("cuda")), str(p.get("machine"))) for p in pairs),
                   unavailable=unavailable if isinstance(unavailable, dict) else {})


# -- the log, sources and cancel --


@dataclass(frozen=True)
class LogPage:
    """Live log lines; ``next`` is the offset to ask for next, ``skipped`` the lines dropped
    from the front of an over-long page."""

    lines: tuple[str, ...]
    next: int
    skipped: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"lines": list(self.lines), "next": self.next, "skipped": self.skipped}

    @classmethod
    def from_json(cls, data: object) -> LogPage:
        what = "a log page"
        d = _object(data, what)
        _require(d, what, lines=list, next=int)
        skipped = d.get("skipped", 0)
        return cls(lines=tuple(str(line) for line in d["lines"]), next=d["next"],
                   skipped=skipped if isinstance(skipped, int) else 0)


@dataclass(frozen=True)
class SourceStored:
    """An uploaded sdist, stored under its sha256 (the build request's ``source``)."""

    sha256: str
    filename: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "filename": self.filename, "size": self.size}

    @classmethod
    def from_json(cls, data: object) -> SourceStored:
        what = "the sdist upload's answer"
        d = _object(data, what)
        _require(d, what, sha256=str, filename=str, size=int)
        return cls(**known_fields(cls, d))


@dataclass(frozen=True)
class CancelRequested:
    """A cancel asked for: the build's (or request's) state now, and a request's parts told
    to stop."""

    id: str
    state: str | None
    cancel_requested: bool = True
    parts: tuple[str, ...] | None = None  # only for a split request

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "cancel_requested": self.cancel_requested,
                               "state": self.state}
        if self.parts is not None:
            out["parts"] = list(self.parts)
        return out

    @classmethod
    def from_json(cls, data: object) -> CancelRequested:
        what = "the cancel's answer"
        d = _object(data, what)
        _require(d, what, id=str)
        fields = known_fields(cls, d)
        fields.setdefault("state", None)
        if "parts" in d:
            fields["parts"] = tuple(str(p) for p in _list(d, "parts", what))
        return cls(**fields)
