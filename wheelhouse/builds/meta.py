"""The contract between the worker and the web: what a build job's RQ meta holds, in one type.

The queue writes a new job's :class:`JobMeta` (its spec, queued), the worker replaces it as the
build goes (phase, progress, the facts measured so far, then the outcome), and the web, the
CLI and the worker's own retry policy read it back; nobody reads or writes the meta as a dict.

A fleet is upgraded one process at a time, so a web of one release reads what a worker of the
previous one wrote (and the other way round): :meth:`JobMeta.from_meta` never raises. The
dict carries :data:`VERSION`; a missing key is unknown, an unknown key is ignored, a mistyped
value is dropped. Version 0 is the meta before this type (no ``version`` key): the same keys,
plus ``max_jobs``/``max_jobs_reason``/``toolkit``/``torch``/``started`` that repeated the
build's facts or that nobody read; its MAX_JOBS shows once the build's facts carry it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import FailureKind, InvalidBuildSpec

#: The layout :meth:`JobMeta.to_meta` writes. 1: this type; 0: the dict before it.
VERSION = 1


@dataclass(frozen=True)
class Failure:
    """Why a build failed, in one line."""

    kind: FailureKind | None
    """None: a kind this version does not know (a newer worker's)."""
    reason: str

    def to_dict(self) -> dict[str, str | None]:
        return {"kind": self.kind.value if self.kind is not None else None,
                "reason": self.reason}


@dataclass(frozen=True)
class JobMeta:
    """What one build job says about itself, for the web, the CLI and the worker."""

    spec: BuildSpec | None = None
    """The build request; None where the meta holds none that parses (a job that is not one of
    ours, or a spec this version can't read: pages skip it)."""
    phase: str | None = None
    """queued, toolkit, fetch, venv, compile, check, publish, published or failed."""
    progress: tuple[int, int] | None = None
    """Ninja's ``[N/M]``: (done, total)."""
    build: BuildFacts = field(default_factory=BuildFacts)
    """What the build has measured so far; MAX_JOBS and why are ``build.max_jobs``."""
    failure: Failure | None = None
    wheel: str | None = None
    """The published wheel's file name."""
    summary: str | None = None
    """One line on what a successful build did (``built in 312 s``, ``already published``)."""
    log_key: str | None = None
    """Storage key of the full log, once the build ended."""
    version: int = VERSION
    """The layout the writer used (what :meth:`from_meta` read); :meth:`to_meta` writes
    :data:`VERSION`."""

    def to_meta(self) -> dict[str, Any]:
        """The RQ job's ``meta``: JSON, unknown values left out."""
        out: dict[str, Any] = {"version": VERSION}
        if self.spec is not None:
            out["spec"] = self.spec.to_dict()
        if self.phase is not None:
            out["phase"] = self.phase
        if self.progress is not None:
            out["progress"] = list(self.progress)
        build = self.build.to_dict()
        if build:
            out["build"] = build
        if self.failure is not None:
            out["failure"] = self.failure.to_dict()
        for name in ("wheel", "summary", "log_key"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_meta(cls, data: object) -> JobMeta:
        """Read a job's ``meta`` as any version wrote it; never raises."""
        if not isinstance(data, Mapping):
            return cls(version=0)
        version = data.get("version")
        return cls(
            spec=_spec(data.get("spec")),
            phase=_str(data.get("phase")),
            progress=_progress(data.get("progress")),
            build=BuildFacts.from_dict(data.get("build")),
            failure=_failure(data.get("failure")),
            wheel=_str(data.get("wheel")),
            summary=_str(data.get("summary")),
            log_key=_str(data.get("log_key")),
            version=version if isinstance(version, int) and not isinstance(version, bool)
            else 0,
        )

    @property
    def project(self) -> str | None:
        return self.spec.project if self.spec is not None else None


def _spec(value: object) -> BuildSpec | None:
    """The spec as :meth:`BuildSpec.from_dict` reads it (keys it doesn't know are ignored)."""
    if not isinstance(value, Mapping):
        return None
    try:
        return BuildSpec.from_dict(value)
    except InvalidBuildSpec:
        return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _progress(value: object) -> tuple[int, int] | None:
    if not isinstance(value, list | tuple) or len(value) != 2:
        return None
    done, total = value
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (done, total)):
        return None
    return (done, total)


def _failure(value: object) -> Failure | None:
    if not isinstance(value, Mapping):
        return None
    reason = value.get("reason")
    return Failure(FailureKind.parse(value.get("kind")),
                   reason if isinstance(reason, str) else "")
