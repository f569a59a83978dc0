"""What a build measured, in one type: carried by the wheel's record, the job's meta and a failure.

The worker fills a :class:`BuildFacts` step by step; it is stored as JSON in the published
record (``Record.build``), in the RQ job's meta (``JobMeta.build``) for the build page, and on a
:class:`~wheelhouse.errors.BuildFailed` for the fleet's counters. Records are immutable and
outlive the code that wrote them, so :meth:`BuildFacts.from_dict` accepts older and newer
records: a missing key is unknown, an unknown key is ignored, a mistyped value is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
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
    targets: int | None = None
    """Device targets each compile job was charged for (a ``-gencode`` pair each, PTX
    included); None in records from before targets were counted."""
    effective_threads: int | None = None
    """The nvcc threads each job was charged for: ``min(nvcc_threads, targets)``."""

    def to_dict(self) -> dict[str, Any]:
        """What is not known (targets in a decision from before they were counted) is left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def charge_summary(self) -> str | None:
        """``5.0 GiB per compile job: 1 device target on 1 nvcc thread (NVCC_THREADS=4)``;
        None for a record that did not count targets."""
        if self.targets is None or self.effective_threads is None:
            return None
        targets = f"{self.targets} device target{'s' if self.targets != 1 else ''}"
        threads = (f"{self.effective_threads} nvcc thread"
                   f"{'s' if self.effective_threads != 1 else ''}")
        job = self.per_thread_bytes * self.effective_threads / 1024**3
        return (f"{job:.1f} GiB per compile job: {targets} on {threads} "
                f"(NVCC_THREADS={self.nvcc_threads})")


@dataclass(frozen=True)
class Reaped:
    """What killing the build's leftover processes took
    (``worker.supervision.reaper.ReapReport``)."""

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


@dataclass(frozen=True)
class AppliedPatch:
    """One recipe patch applied to the sdist (``wheelhouse.recipes.patches``): what the build
    record,
    the build page and the wheel's METADATA say about it."""

    recipe: str
    id: str
    description: str
    sha256: str
    """Of the diff's bytes, or of the replacements as canonical JSON: the same change, the same
    digest, whatever its description says."""

    @property
    def ref(self) -> str:
        return f"{self.recipe}/{self.id}"

    def to_dict(self) -> dict[str, str]:
        return {"recipe": self.recipe, "id": self.id, "description": self.description,
                "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> AppliedPatch:
        return cls(recipe=str(data["recipe"]), id=str(data["id"]),
                   description=str(data["description"]), sha256=str(data["sha256"]))


@dataclass(frozen=True)
class CompileCacheStats:
    """What one build's compile cache (sccache) counted, for the build record.

    ``requests`` counts every compiler invocation passed on (links included); hits and misses
    count cache look-ups, and nvcc makes several per ``.cu`` file (host side, device
    preprocessing, PTX, each cubin), so they are also kept per language.
    """

    requests: int = 0
    hits: int = 0
    misses: int = 0
    not_cacheable: int = 0
    """Links, preprocessing-only calls and other invocations passed straight through."""
    errors: int = 0
    hits_by_language: dict[str, int] = field(default_factory=dict)
    misses_by_language: dict[str, int] = field(default_factory=dict)
    location: str = ""
    fetched: int = 0
    """Entries fetched from storage before the compile: what other builds of the project and
    CUDA line, and this build's earlier attempts, stored (a resumed build's head start)."""

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "hits": self.hits, "misses": self.misses,
                "not_cacheable": self.not_cacheable, "errors": self.errors,
                "hit_rate": round(self.hit_rate, 3), "hits_by_language": self.hits_by_language,
                "misses_by_language": self.misses_by_language, "location": self.location,
                "fetched": self.fetched}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileCacheStats:
        return cls(
            requests=_int(data.get("requests")) or 0,
            hits=_int(data.get("hits")) or 0,
            misses=_int(data.get("misses")) or 0,
            not_cacheable=_int(data.get("not_cacheable")) or 0,
            errors=_int(data.get("errors")) or 0,
            hits_by_language=_counts(data.get("hits_by_language")),
            misses_by_language=_counts(data.get("misses_by_language")),
            location=_str(data.get("location")) or "",
            fetched=_int(data.get("fetched")) or 0,
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
    """The sdist's sha256: verified against the upstream's or the upload's, or of a local file."""
    sdist_url: str | None = None
    """Where the sdist came from: the upstream's link, the uploaded sdist's storage key, or a
    local ``file:`` URL (signed into the wheel's provenance)."""
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
    """How the build was sandboxed (``worker.sandbox.wrapper.Sandbox.describe``), or ``off
    (unsafe)…``."""

    patches: tuple[AppliedPatch, ...] | None = None
    """The recipe patches applied to the sdist, in order (empty: none applied)."""
    device_code: dict[str, dict[str, list[str]]] | None = None
    """GPU code per shared library of the wheel: ``{"pkg/_C…so": {"sass": ["80"], "ptx": []}}``."""
    compile_cache: CompileCacheStats | None = None
    """Hits and misses of the compile cache, when one was used."""
    step_seconds: dict[str, float] | None = None
    """Wall-clock seconds of each step that has ended, in the order they ran (``toolkit``,
    ``fetch``, ``venv``, ``compile``, ``check``, ``publish``): where a build's time went."""

    @property
    def sass_archs(self) -> list[str]:
        """Every architecture some library holds SASS for (``["80", "90a"]``)."""
        found = {a for code in (self.device_code or {}).values() for a in code.get("sass", [])}
        return sorted(found, key=_arch_key)

    @property
    def ptx_archs(self) -> list[str]:
        found = {a for code in (self.device_code or {}).values() for a in code.get("ptx", [])}
        return sorted(found, key=_arch_key)

    def steps_summary(self) -> str | None:
        """``venv 12.3 s, compile 101.0 s, check 9.2 s``; None before a step has ended."""
        if not self.step_seconds:
            return None
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.step_seconds.items())

    def device_code_summary(self) -> str | None:
        """``sm_80, sm_90 (+PTX compute_90)``; None when the wheel was not read."""
        if self.device_code is None:
            return None
        sass = ", ".join(f"sm_{a}" for a in self.sass_archs) or "no SASS"
        ptx = ", ".join(f"compute_{a}" for a in self.ptx_archs)
        return f"{sass} (+PTX {ptx})" if ptx else sass

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable; what is not known (None, or an empty name) is left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == "":
                continue
            if isinstance(value, MaxJobs | Reaped | CompileCacheStats):
                value = value.to_dict()
            elif f.name == "patches":
                value = [p.to_dict() for p in value]
            elif f.name == "step_seconds":  # pairs: records are written with sorted keys
                value = [[name, seconds] for name, seconds in value.items()]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> BuildFacts:
        """Read what :meth:`to_dict` wrote, by this version or another; never raises."""
        if not isinstance(data, Mapping):
            return cls()
        reaped = data.get("reaped")
        cache = data.get("compile_cache")
        return cls(
            build_id=_str(data.get("build_id")) or "",
            recipe=_str(data.get("recipe")) or "",
            host=_str(data.get("host")) or "",
            toolkit=_str(data.get("toolkit")),
            torch=_str(data.get("torch")),
            sdist=_str(data.get("sdist")),
            sdist_sha256=_str(data.get("sdist_sha256")),
            sdist_url=_str(data.get("sdist_url")),
            max_jobs=_max_jobs(data.get("max_jobs")),
            peak_tree_bytes=_int(data.get("peak_tree_bytes")),
            peak_job_bytes=_int(data.get("peak_job_bytes")),
            governor_pauses=_int(data.get("governor_pauses")),
            reaped=Reaped.from_dict(reaped) if isinstance(reaped, Mapping) else None,
            seconds=_float(data.get("seconds")),
            log_key=_str(data.get("log_key")),
            sandbox=_str(data.get("sandbox")),

            patches=_patches(data.get("patches")),
            device_code=_device_code(data.get("device_code")),
            compile_cache=CompileCacheStats.from_dict(cache) if isinstance(cache, Mapping)
            else None,
            step_seconds=_seconds(data.get("step_seconds")),
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


def _seconds(value: object) -> dict[str, float] | None:
    """``[[step, seconds], ...]`` in the order the steps ran; what is not such a pair is dropped."""
    if not isinstance(value, list):
        return None
    found = {name: seconds for pair in value
             if isinstance(pair, list) and len(pair) == 2
             and isinstance(name := pair[0], str) and (seconds := _float(pair[1])) is not None}
    return found or None


def _max_jobs(value: object) -> MaxJobs | None:
    if not isinstance(value, Mapping):
        return None
    known = {f.name for f in fields(MaxJobs)}
    found = {k: v for k, v in value.items() if k in known}
    for name in ("targets", "effective_threads"):  # added later: unknown unless a count
        found[name] = _int(found.get(name))
    try:
        return MaxJobs(**found)
    except TypeError:  # a field missing: an older decision this version can't stand behind
        return None


def _counts(value: object) -> dict[str, int]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if _int(v) is not None}


def _arch_key(arch: str) -> tuple[int, str]:
    digits = arch.rstrip("af")
    return (int(digits) if digits.isdigit() else 0, arch)


def _patches(value: object) -> tuple[AppliedPatch, ...] | None:
    if not isinstance(value, list):
        return None
    out = []
    for item in value:
        if isinstance(item, Mapping) and all(isinstance(item.get(k), str)
                                             for k in ("recipe", "id", "description", "sha256")):
            out.append(AppliedPatch.from_dict(item))
    return tuple(out)


def _device_code(value: object) -> dict[str, dict[str, list[str]]] | None:
    if not isinstance(value, Mapping):
        return None
    out: dict[str, dict[str, list[str]]] = {}
    for library, code in value.items():
        if not isinstance(code, Mapping):
            continue
        out[str(library)] = {kind: [str(a) for a in code.get(kind, [])
                                    if isinstance(a, str)]
                             if isinstance(code.get(kind), list) else []
                             for kind in ("sass", "ptx")}
    return out
