"""Builds as the API and the pages show them: submitting specs, and one build's view."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from wheelhouse.builds.fanout import (
    RequestStatus,
    SplitRequest,
    load_request,
    part_spec,
    record_request,
    request_id,
    request_state,
)
from wheelhouse.builds.fleet import explain_unservable
from wheelhouse.builds.queue import (
    BuildState,
    BuildStatus,
    enqueue_build,
    finished_durations,
    get_build,
    record_requester,
)
from wheelhouse.builds.spec import BuildSpec, queue_name
from wheelhouse.builds.torchindex import TorchIndex
from wheelhouse.errors import InvalidBuildSpec, UnservableSpec
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import PROVENANCE_SUFFIX
from wheelhouse.recipes.book import Recipe

if TYPE_CHECKING:
    from redis import Redis

JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


# -- submitting --


@dataclass(frozen=True)
class Submitted:
    spec: BuildSpec
    job_id: str
    state: str
    created: bool
    wheel: str | None = None
    """For a wheel already published: its file name (no job is made)."""
    warning: str | None = None
    """Set when the torch index could not be asked (the build was queued unchecked)."""


def submit(conn: Redis, catalog: Catalog, specs: Iterable[BuildSpec], *, timeout: int,
           rerun_failed: bool = False, torch: TorchIndex | None = None,
           by: str | None = None) -> list[Submitted]:
    """Enqueue each spec unless its wheel is published or its job exists; ``by`` (a token
    name) is kept as the requester of each build this call queues (``web.auth.may_cancel``);
    ``timeout`` is the build's deadline, the operator's ``WHEELHOUSE_BUILD_TIMEOUT``.

    Raises :class:`UnservableSpec` when no live worker serves them (all specs of one request
    share CUDA and CPU architecture, so that is all or none), and :class:`TorchUnavailable` when
    ``torch`` (the torch index check) answers that torch and CUDA does not exist.
    """
    out = []
    for spec in specs:
        record = catalog.published_for(spec)
        if record is not None:
            out.append(Submitted(spec, spec.job_id, BuildState.BUILT.value, False, record.filename))
            continue
        warning = None
        known = get_build(conn, spec.job_id) if torch is not None else None
        again = known is None or (rerun_failed and known.state in (BuildState.FAILED,
                                                                   BuildState.CANCELLED))
        if torch is not None and again:  # only what would be queued
            # After the fleet (cheap, and it names what would serve); before anything queues.
            why = explain_unservable(conn, spec)
            if why is not None:
                raise UnservableSpec(why)
            warning = torch.check(spec.torch, spec.cuda)
        done = enqueue_build(conn, spec, rerun_failed=rerun_failed, timeout=timeout)
        if done.created and by is not None:
            record_requester(conn, done.job_id, by)
        out.append(Submitted(spec, done.job_id, done.state.value, done.created, warning=warning))
    return out


@dataclass(frozen=True)
class SubmittedSplit:
    """A request split into one build per architecture (``wheelhouse.builds.fanout``)."""

    request: SplitRequest
    parts: list[Submitted]
    recorded: bool
    """False when the request existed already."""

    @property
    def job_id(self) -> str:
        return self.request.id

    @property
    def spec(self) -> BuildSpec:
        return self.request.spec

    @property
    def state(self) -> str:
        return request_state(BuildState(p.state) for p in self.parts).value

    @property
    def created(self) -> bool:
        return any(p.created for p in self.parts)

    @property
    def warning(self) -> str | None:
        return next((p.warning for p in self.parts if p.warning), None)

    @property
    def wheel(self) -> None:
        """A request has no one wheel: each part has its own."""
        return None


def split_archs_of(spec: BuildSpec, recipe: Recipe, split: bool | None) -> tuple[str, ...]:
    """The architectures to split ``spec`` into, or ``()`` to build it as one job: a split
    (asked for, else the recipe's ``split_archs``) of at least two architectures (the spec's,
    else the recipe's default)."""
    if not (recipe.split_archs if split is None else split):
        return ()
    archs = recipe.archs_for(spec.variant)
    return archs if len(archs) > 1 else ()


def submit_request(conn: Redis, catalog: Catalog, specs: Iterable[BuildSpec], recipe: Recipe,
                   *, timeout: int, split: bool | None = None, rerun_failed: bool = False,
                   torch: TorchIndex | None = None,
                   by: str | None = None) -> list[Submitted | SubmittedSplit]:
    """:func:`submit` each spec, or, where it splits (:func:`split_archs_of`), each of its
    single-arch parts, and keep the request that ties them together."""
    out: list[Submitted | SubmittedSplit] = []
    for spec in specs:
        archs = split_archs_of(spec, recipe, split)
        if not archs:
            out.extend(submit(conn, catalog, [spec], timeout=timeout, rerun_failed=rerun_failed,
                              torch=torch, by=by))
            continue
        # A request made before keeps its parts, whatever the recipe's default is now.
        request = load_request(conn, request_id(spec)) or SplitRequest.create(spec, archs)
        parts = submit(conn, catalog, request.part_specs(), timeout=timeout,
                       rerun_failed=rerun_failed, torch=torch, by=by)
        kept, recorded = record_request(conn, request)
        if recorded and by is not None:
            record_requester(conn, kept.id, by)
        out.append(SubmittedSplit(kept, parts, recorded))
    return out


# -- viewing a build --


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def spec_of(status: BuildStatus) -> BuildSpec | None:
    try:
        return BuildSpec.from_dict(status.spec)
    except InvalidBuildSpec:
        return None


def install_command(base_url: str, spec: BuildSpec) -> str:
    """The built wheel's install line, with the torch it needs (its METADATA says so too)."""
    return (f"uv pip install --index-url {base_url}/{spec.variant.key}/simple "
            f"'{spec.project}=={spec.wheel_version}' 'torch=={spec.torch}.*'")


def history_estimate(conn: Redis, status: BuildStatus) -> float | None:
    """Median duration in seconds of earlier successful builds of the same project and CUDA."""
    spec = status.spec
    if not spec.get("project") or not spec.get("cuda"):
        return None
    queue = queue_name(str(spec["cuda"]), str(spec.get("machine", "x86_64")))
    durations = finished_durations(conn, queue, str(spec["project"]), exclude=status.job_id)
    return statistics.median(durations) if durations else None


def build_view(conn: Redis, status: BuildStatus, base_url: str,
               catalog: Catalog | None = None) -> dict[str, Any]:
    """The JSON form of a build, for the API and the build page's script.

    With ``catalog``, a built wheel's record fills in what the job's meta lacks (peak memory,
    patches, device code, compile cache).
    """
    spec = spec_of(status)
    facts = status.build
    record = None
    if catalog is not None and spec is not None and status.state is BuildState.BUILT:
        record = catalog.published_for(spec)
        if record is not None and (facts.peak_tree_bytes is None or facts.device_code is None):
            facts = record.build  # the job's meta expired or predates these facts
    peak = facts.peak_tree_bytes
    now = datetime.now(UTC)
    started = status.started_at
    ended = status.ended_at
    elapsed = None
    if started is not None:
        elapsed = max(0.0, ((ended or now) - started).total_seconds())
    estimate = None
    remaining = None
    finishing = False
    if not status.finished:
        estimate = history_estimate(conn, status)
        finishing = _finishing(status)
        done_total = status.progress
        if finishing:
            pass  # what is left (link, pack, check, upload) has no count to extrapolate from
        elif elapsed and done_total and done_total[0] > 0:
            # At least a second: "about 0 s left" would claim the end before it comes.
            remaining = max(1.0, elapsed * (done_total[1] - done_total[0]) / done_total[0])
        elif estimate is not None and elapsed is not None and estimate > elapsed:
            remaining = estimate - elapsed
    progress = None
    if status.progress:
        done, total = status.progress
        percent = round(100.0 * done / total, 1) if total else 0.0
        if not status.finished:
            percent = min(percent, _RUNNING_MAX_PERCENT)  # 100% is for a build that ended
        progress = {"done": done, "total": total, "percent": percent}
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
        "failure_kind": status.failure_kind.value if status.failure_kind else None,
        "reason": status.reason,
        "max_jobs": status.max_jobs,
        "max_jobs_reason": status.max_jobs_reason,
        # What each compile job was charged for: its device targets and effective nvcc threads.
        "max_jobs_charge": facts.max_jobs.charge_summary() if facts.max_jobs else None,
        "peak_memory_bytes": peak,
        # How the build was sandboxed; "off (unsafe)…" where the worker ran it unsandboxed.
        "sandbox": status.build.sandbox,

        "patches": [p.to_dict() | {"ref": p.ref} for p in facts.patches]
        if facts.patches is not None else None,
        "device_code": facts.device_code_summary(),
        "compile_cache": {"hits": facts.compile_cache.hits, "misses": facts.compile_cache.misses,
                          "hit_rate": round(facts.compile_cache.hit_rate, 3)}
        if facts.compile_cache is not None else None,
        "toolkit": facts.toolkit,
        # What it was built from, and where the signed statement of it is (PEP 740).
        "source": {"url": facts.sdist_url or facts.sdist, "sha256": facts.sdist_sha256}
        if facts.sdist_url or facts.sdist else None,
        "provenance": f"{base_url.rstrip('/')}/files/{record.variant.base.key}/{record.project}/"
                      f"{record.filename}{PROVENANCE_SUFFIX}"
        if record is not None and record.provenance_sha256 is not None else None,
        "wheel": status.wheel,
        "install": install_command(base_url, spec) if spec and status.state is BuildState.BUILT
        else None,
        "enqueued_at": _iso(status.enqueued_at),
        "started_at": _iso(status.started_at),
        "ended_at": _iso(status.ended_at),
        "elapsed_seconds": round(elapsed, 1) if elapsed is not None else None,
        "estimate_seconds": round(estimate, 1) if estimate is not None else None,
        "remaining_seconds": round(remaining, 1) if remaining is not None else None,
        "finishing": finishing,
    }


#: The most a running build's progress shows: its last compile step done is not the end.
_RUNNING_MAX_PERCENT = 99.0
#: Steps after the compile: checking the wheel and publishing it.
_AFTER_COMPILE = frozenset({"check", "publish"})


def _finishing(status: BuildStatus) -> bool:
    """Whether a running build is past its last compile step: linking, packing the wheel,
    checking and uploading it, none of which ninja's ``[N/M]`` counts."""
    if status.phase in _AFTER_COMPILE:
        return True
    progress = status.progress
    return progress is not None and progress[0] >= progress[1] > 0


# -- viewing a split request --


def request_view(conn: Redis, status: RequestStatus, base_url: str,
                 catalog: Catalog | None = None) -> dict[str, Any]:
    """The JSON form of a split request: its state from its parts', and each part's view."""
    request = status.request
    parts = []
    for part in status.parts:
        view = build_view(conn, part.build, base_url, catalog) if part.build is not None \
            else None
        pspec = part_spec(request.spec, part.arch)
        parts.append({
            "arch": part.arch, "id": part.job_id, "state": part.state.value,
            "job": part.build is not None,
            "finished": part.finished, "variant": pspec.variant.key, "wheel": part.wheel,
            "progress": view["progress"] if view else None,
            "phase": view["phase"] if view else None,
            "reason": view["reason"] if view else None,
            "failure_kind": view["failure_kind"] if view else None,
            "started_at": view["started_at"] if view else None,
            "ended_at": view["ended_at"] if view else None,
            "install": install_command(base_url, pspec)
            if part.state is BuildState.BUILT else None,
        })
    return {
        "id": request.id,
        "kind": "split",
        "state": status.state.value,
        "finished": status.finished,
        "spec": request.spec.to_dict(),
        "description": request.describe(),
        "variant": request.spec.variant.key,
        "archs": list(request.archs),
        "parts": parts,
        "enqueued_at": datetime.fromtimestamp(request.created_at, UTC).isoformat(),
    }
