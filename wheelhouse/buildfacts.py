"""What a build measured, in one type: carried by the wheel's record, the job's meta and a failure.

The worker fills a :class:`BuildFacts` step by step; it is stored as JSON in the published
record (``Record.build``), in the RQ job's meta (``meta["build"]``) for the build page, and on a
:class:`~wheelhouse.errors.BuildFailed` for the fleet's counters. Records are immutable and
outlive the code that wrote them, so :meth:`BuildFacts.from_dict` accepts older and newer
records: a missing key is unknown, an unknown key is ignored, a mistyped value is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MaxJobs:
    """How many jobs, and why; serialized into the build record."""

    jobs: int
    reason: str
    per_thread_bytes: int
    nvcc_threads: int
    available_bytes: int
    reserve_bytes: int
    cores: int
    learned: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Reaped:
    """What killing the build's leftover processes took (``worker.reaper.ReapReport``)."""

    processes: int = 0
    signals: tuple[str, ...] = ()
    seconds: float = 0.0
    survivors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"processes": self.processes, "signals": list(self.signals),
                "seconds": self.seconds, "survivors": self.survivors}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Reaped:
        signals = data.get("signals")
        return cls(
            processes=_int(data.get("processes")) or 0,
            signals=tuple(str(s) for s in signals) if isinstance(signals, list | tuple) else (),
            seconds=_float(data.get("seconds")) or 0.0,
            survivors=_int(data.get("survivors")) or 0,
        )


@dataclass
class BuildFacts:
    """What one build measured. Mutable: the builder adds to it as the steps run.

    Every field but the identity ones is None until the step that measures it has run.
    """

    build_id: str = ""
    """The cookie every process of the build carries (the RQ job id in the worker)."""
    recipe: str = ""
    host: str = ""
    toolkit: str | None = None
    """The CUDA toolkit release that compiled, e.g. ``V13.0.48``."""
    torch: str | None = None
    """The torch version installed into the build venv, e.g. ``2.14.1+cu130``."""
    sdist: str | None = None
    sdist_sha256: str | None = None
    """Where the sdist came from the upstream index: its verified hash."""
    max_jobs: MaxJobs | None = None
    peak_tree_bytes: int | None = None
    """Peak memory of the build's whole process tree: the build's peak memory."""
    peak_job_bytes: int | None = None
    """Peak memory of the largest single compile job."""
    governor_pauses: int | None = None
    """How often the memory governor paused compile jobs."""
    reaped: Reaped | None = None
    seconds: float | None = None
    """Wall-clock seconds of the build (to publication, or to the failure)."""
    log_key: str | None = None
    """Storage key of the build's full log."""
    sandbox: str | None = None
    """How the build was sandboxed (``worker.sandbox.Sandbox.describe``), or ``off (unsafe)…``."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable; what is not known (None, or an empty name) is left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == "":
                continue
            out[f.name] = value.to_dict() if isinstance(value, MaxJobs | Reaped) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> BuildFacts:
        """Read what :meth:`to_dict` wrote, by this version or another; never raises."""
        if not isinstance(data, Mapping):
            return cls()
        reaped = data.get("reaped")
        return cls(
            build_id=_str(data.get("build_id")) or "",
            recipe=_str(data.get("recipe")) or "",
            host=_str(data.get("host")) or "",
            toolkit=_str(data.get("toolkit")),
            torch=_str(data.get("torch")),
            sdist=_str(data.get("sdist")),
            sdist_sha256=_str(data.get("sdist_sha256")),
            max_jobs=_max_jobs(data.get("max_jobs")),
            peak_tree_bytes=_int(data.get("peak_tree_bytes")),
            peak_job_bytes=_int(data.get("peak_job_bytes")),
            governor_pauses=_int(data.get("governor_pauses")),
            reaped=Reaped.from_dict(reaped) if isinstance(reaped, Mapping) else None,
            seconds=_float(data.get("seconds")),
            log_key=_str(data.get("log_key")),
            sandbox=_str(data.get("sandbox")),
        )


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    # bool is an int to Python, but never a count or a size.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _max_jobs(value: object) -> MaxJobs | None:
    if not isinstance(value, Mapping):
        return None
    known = {f.name for f in fields(MaxJobs)}
    try:
        return MaxJobs(**{k: v for k, v in value.items() if k in known})
    except TypeError:  # a field missing: an older decision this version can't stand behind
        return None
