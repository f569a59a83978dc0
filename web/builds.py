"""Build requests and build views, shared by the JSON API and the pages.

Validation here is per field, so that a form can show each message next to its field and the
API can name the field; :meth:`BuildSpec.create` validates again in the core.
"""

from __future__ import annotations

import json
import re
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from wheelhouse.buildspec import (
    KNOWN_MACHINES,
    KNOWN_PYTHONS,
    MAX_FIELD_LENGTH,
    BuildSpec,
    normalize_machine,
    normalize_python,
)
from wheelhouse.catalog import Catalog, Record
from wheelhouse.errors import InvalidBuildSpec, InvalidVariant
from wheelhouse.queue import BuildState, BuildStatus, enqueue_build
from wheelhouse.recipes import recipe_projects
from wheelhouse.variants import (
    KNOWN_ARCHS,
    KNOWN_CUDA,
    normalize_arch,
    normalize_cuda,
    normalize_torch,
)

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job

    from wheelhouse.config import Config

#: torch versions the form suggests (any valid major.minor is accepted).
SUGGESTED_TORCH: tuple[str, ...] = ("2.14", "2.10", "2.9", "2.8", "2.7", "2.6", "2.5")
JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
FIELDS = ("project", "version", "torch", "cuda", "python", "archs", "machine")
#: The most builds one request may create (all Pythons of one variant).
MAX_PYTHONS = len(KNOWN_PYTHONS)


def recipe_list(config: Config) -> list[str]:
    return recipe_projects([d for d in config.recipe_dirs.split(":") if d])


# -- validating a request --


@dataclass
class BuildRequest:
    """A validated request: one spec per Python, or the errors by field."""

    specs: list[BuildSpec] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    """What was submitted, normalized where it could be: refills the form."""


def _as_list(value: Any) -> list[Any]:
    if value is None or value == "":
        return []
    if isinstance(value, list | tuple):
        return [v for v in value if v != ""]
    return [value]


def _text(data: Mapping[str, Any], name: str, errors: dict[str, str]) -> str:
    value = data.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        errors[name] = f"{name} is required"
        return ""
    if not isinstance(value, str):
        errors[name] = f"{name} must be a string"
        return ""
    if len(value) > MAX_FIELD_LENGTH:
        errors[name] = f"{name} is too long ({len(value)} characters, at most {MAX_FIELD_LENGTH})"
        return ""
    return value.strip()


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_request(data: Mapping[str, Any], projects: Iterable[str]) -> BuildRequest:
    """Check every field of a build request against its allow-list; never raises."""
    req = BuildRequest()
    errors = req.errors
    allowed = set(projects)
    project = _text(data, "project", errors)
    if project and canonicalize_name(project) not in allowed:
        errors["project"] = (f"no recipe for project {_short(project)!r}; known: "
                             + (", ".join(sorted(allowed)) or "none"))
    version = _text(data, "version", errors)
    if version:
        try:
            v = Version(version)
            if v.local is not None:
                errors["version"] = "give the public version; the variant's label is added"
        except InvalidVersion:
            errors["version"] = f"{_short(version)!r} is not a PEP 440 version (e.g. 2.8.3)"
    torch = _text(data, "torch", errors)
    if torch:
        try:
            torch = normalize_torch(torch)
        except InvalidVariant as exc:
            errors["torch"] = str(exc)
    cuda = _text(data, "cuda", errors)
    if cuda:
        try:
            cuda = normalize_cuda(cuda)
        except InvalidVariant:
            errors["cuda"] = (f"unknown CUDA version {_short(cuda)!r}; known: "
                              + ", ".join(KNOWN_CUDA))
    pythons: list[str] = []
    raw_pythons = _as_list(data.get("python"))
    if not raw_pythons:
        errors["python"] = "choose at least one Python version"
    elif len(raw_pythons) > MAX_PYTHONS or not all(isinstance(p, str) for p in raw_pythons):
        errors["python"] = f"python must be a list of at most {MAX_PYTHONS} version strings"
    else:
        for p in raw_pythons:
            try:
                pythons.append(normalize_python(p))
            except InvalidBuildSpec:
                errors["python"] = (f"unsupported Python {_short(p)!r}; known: "
                                    + ", ".join(KNOWN_PYTHONS))
                break
    archs: list[str] = []
    raw_archs = _as_list(data.get("archs"))
    if len(raw_archs) > len(KNOWN_ARCHS) or not all(isinstance(a, str) for a in raw_archs):
        errors["archs"] = "archs must be a short list of architecture strings"
    else:
        for a in raw_archs:
            try:
                archs.append(normalize_arch(a))
            except InvalidVariant:
                errors["archs"] = (f"unknown GPU architecture {_short(a)!r}; known: "
                                   + ", ".join("sm" + k for k in KNOWN_ARCHS))
                break
    machine = data.get("machine") or "x86_64"
    if not isinstance(machine, str) or len(machine) > MAX_FIELD_LENGTH:
        errors["machine"] = "machine must be a short string"
        machine = "x86_64"
    else:
        try:
            machine = normalize_machine(machine)
        except InvalidBuildSpec:
            errors["machine"] = (f"unknown CPU architecture {_short(machine)!r}; known: "
                                 + ", ".join(KNOWN_MACHINES))
    unknown = [k for k in data if k not in FIELDS]
    if unknown:
        errors["_"] = "unknown fields: " + ", ".join(_short(k) for k in sorted(unknown)[:5])
    req.values = {"project": project, "version": version, "torch": torch, "cuda": cuda,
                  "python": pythons or [p for p in raw_pythons if isinstance(p, str)],
                  "archs": archs, "machine": machine}
    if errors:
        return req
    for python in dict.fromkeys(pythons):
        try:
            req.specs.append(BuildSpec.create(project, version, python=python, torch=torch,
                                              cuda=cuda, archs=archs, machine=machine))
        except InvalidBuildSpec as exc:  # the core's second opinion
            errors["_"] = str(exc)
            req.specs.clear()
            break
    return req


# -- submitting --


@dataclass(frozen=True)
class Submitted:
    spec: BuildSpec
    job_id: str
    state: str
    created: bool
    wheel: str | None = None
    """For a wheel already published: its file name (no job is made)."""


def published_for(catalog: Catalog, spec: BuildSpec) -> Record | None:
    """The published wheel that already serves ``spec``, if any."""
    for record in catalog.files(spec.variant, spec.project):
        try:
            _, version, _, tags = parse_wheel_filename(record.filename)
        except InvalidWheelFilename:
            continue
        if version.public == spec.version and spec.tags_match(tags):
            return record
    return None


def submit(conn: Redis, catalog: Catalog, specs: Iterable[BuildSpec], *,
           rerun_failed: bool = False) -> list[Submitted]:
    """Enqueue each spec unless its wheel is published or its job exists.

    Raises :class:`UnservableSpec` when no live worker serves them (all specs of one request
    share CUDA and CPU architecture, so that is all or none).
    """
    out = []
    for spec in specs:
        record = published_for(catalog, spec)
        if record is not None:
            out.append(Submitted(spec, spec.job_id, BuildState.BUILT.value, False, record.filename))
            continue
        done = enqueue_build(conn, spec, rerun_failed=rerun_failed)
        out.append(Submitted(spec, done.job_id, done.state.value, done.created))
    return out


# -- viewing a build --


def _aware(moment: datetime | None) -> datetime | None:
    if moment is None:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _iso(moment: datetime | None) -> str | None:
    m = _aware(moment)
    return m.isoformat() if m is not None else None


def peak_memory(meta: Mapping[str, Any]) -> int | None:
    """Peak memory of the build in bytes, under whichever name the worker records it."""
    for key in ("peak_tree_bytes", "peak_memory_bytes", "peak_rss_bytes", "peak_job_bytes"):
        value = meta.get(key)
        if isinstance(value, int | float) and value > 0:
            return int(value)
    return None


def spec_of(status: BuildStatus) -> BuildSpec | None:
    try:
        return BuildSpec.from_dict(status.spec)
    except InvalidBuildSpec:
        return None


def install_command(base_url: str, spec: BuildSpec) -> str:
    return (f"uv pip install --index-url {base_url}/{spec.variant.key}/simple "
            f"'{spec.project}=={spec.wheel_version}'")


def history_estimate(conn: Redis, status: BuildStatus) -> float | None:
    """Median duration in seconds of earlier successful builds of the same project and CUDA."""
    from rq.job import Job
    from rq.registry import FinishedJobRegistry

    spec = status.spec
    if not spec.get("project") or not spec.get("cuda"):
        return None
    queue = status.meta.get("queue") or _queue_of(spec)
    ids = FinishedJobRegistry(queue, connection=conn).get_job_ids(0, 199)
    ids = [i for i in ids if i != status.job_id][-50:]
    durations = []
    for job in Job.fetch_many(ids, connection=conn):
        if job is None or job.started_at is None or job.ended_at is None:
            continue
        other = job.meta.get("spec") or {}
        if other.get("project") == spec.get("project"):
            durations.append((_aware(job.ended_at) - _aware(job.started_at)).total_seconds())  # type: ignore[operator]
    return statistics.median(durations) if durations else None


def _queue_of(spec: Mapping[str, Any]) -> str:
    from wheelhouse.buildspec import queue_name

    return queue_name(str(spec.get("cuda", "")), str(spec.get("machine", "x86_64")))


def build_view(conn: Redis, status: BuildStatus, base_url: str,
               catalog: Catalog | None = None) -> dict[str, Any]:
    """The JSON form of a build, for the API and the build page's script.

    With ``catalog``, a built wheel's record fills in what the job's meta lacks (peak memory).
    """
    spec = spec_of(status)
    peak = peak_memory(status.meta)
    if peak is None and catalog is not None and spec is not None \
            and status.state is BuildState.BUILT:
        record = published_for(catalog, spec)
        peak = peak_memory(record.build) if record is not None else None
    now = datetime.now(UTC)
    started = _aware(status.started_at)
    ended = _aware(status.ended_at)
    elapsed = None
    if started is not None:
        elapsed = max(0.0, ((ended or now) - started).total_seconds())
    estimate = None
    remaining = None
    if not status.finished:
        estimate = history_estimate(conn, status)
        done_total = status.progress
        if elapsed and done_total and done_total[0] > 0:
            remaining = elapsed * (done_total[1] - done_total[0]) / done_total[0]
        elif estimate is not None and elapsed is not None:
            remaining = max(0.0, estimate - elapsed)
    progress = None
    if status.progress:
        done, total = status.progress
        progress = {"done": done, "total": total,
                    "percent": round(100.0 * done / total, 1) if total else 0.0}
    return {
        "id": status.job_id,
        "state": status.state.value,
        "finished": status.finished,
        "phase": status.phase,
        "spec": dict(status.spec),
        "description": spec.describe() if spec else None,
        "variant": spec.variant.key if spec else None,
        "progress": progress,
        "position": status.position,
        "failure_kind": status.failure_kind,
        "reason": status.reason,
        "max_jobs": status.max_jobs,
        "max_jobs_reason": status.max_jobs_reason,
        "peak_memory_bytes": peak,
        "wheel": status.wheel,
        "install": install_command(base_url, spec) if spec and status.state is BuildState.BUILT
        else None,
        "enqueued_at": _iso(status.enqueued_at),
        "started_at": _iso(status.started_at),
        "ended_at": _iso(status.ended_at),
        "elapsed_seconds": round(elapsed, 1) if elapsed is not None else None,
        "estimate_seconds": round(estimate, 1) if estimate is not None else None,
        "remaining_seconds": round(remaining, 1) if remaining is not None else None,
    }


# -- many builds at once (the matrix) --

def all_build_jobs(conn: Redis, *, finished_limit: int = 2000) -> list[Job]:
    """Every build job the queues and registries know, fetched in one pipeline."""
    from rq import Queue
    from rq.job import Job
    from rq.registry import (
        CanceledJobRegistry,
        FailedJobRegistry,
        FinishedJobRegistry,
        StartedJobRegistry,
    )

    ids: dict[str, None] = {}
    for queue in Queue.all(connection=conn):
        if not queue.name.startswith("build-"):
            continue
        for jid in queue.get_job_ids():
            ids[jid] = None
        for registry in (StartedJobRegistry, FailedJobRegistry, CanceledJobRegistry):
            for jid in registry(queue.name, connection=conn).get_job_ids():
                ids[jid] = None
        for jid in FinishedJobRegistry(queue.name, connection=conn).get_job_ids(
                -finished_limit, -1):
            ids[jid] = None
    return [j for j in Job.fetch_many(list(ids), connection=conn) if j is not None]


# -- upstream versions (PEP 691) --

VERSIONS_TTL = 300.0
VersionsCache = dict[str, tuple[float, "list[str] | None"]]


def upstream_versions(upstream_root: str | None, project: str, cache: VersionsCache, *,
                      timeout: float = 3.0) -> list[str] | None:
    """Released versions of ``project`` on the upstream index, newest first; None if unreachable.

    Asks for PEP 691 JSON; uses PEP 700 ``versions`` when given, else the file names. Answers
    (and failures) are kept in ``cache`` for :data:`VERSIONS_TTL` seconds.
    """
    if not upstream_root:
        return None
    url = f"{upstream_root.rstrip('/')}/{canonicalize_name(project)}/"
    cached = cache.get(url)
    if cached is not None and time.monotonic() - cached[0] < VERSIONS_TTL:
        return cached[1]
    result: list[str] | None
    try:
        req = urllib.request.Request(url, headers={  # noqa: S310 (URL comes from config)
            "Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            data = json.loads(resp.read(20_000_000))
        result = _versions_from(data)
    except (OSError, ValueError, urllib.error.URLError):
        result = None
    cache[url] = (time.monotonic(), result)
    return result


def _versions_from(data: Any) -> list[str]:
    found: set[Version] = set()
    if isinstance(data, dict) and isinstance(data.get("versions"), list):
        for v in data["versions"]:
            try:
                found.add(Version(str(v)))
            except InvalidVersion:
                continue
    elif isinstance(data, dict):
        for f in data.get("files") or []:
            name = f.get("filename", "") if isinstance(f, dict) else ""
            try:
                if name.endswith(".whl"):
                    found.add(parse_wheel_filename(name)[1])
                elif name.endswith((".tar.gz", ".zip")):
                    found.add(parse_sdist_filename(name)[1])
            except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
                continue
    return [str(v) for v in sorted(found, reverse=True) if not v.is_devrelease][:100]
