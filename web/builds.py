"""Builds as the API and the pages show them: one build's view, one split request's.

Submitting builds is the core's (``wheelhouse.builds.submission``)."""

from __future__ import annotations

import re
import statistics
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from wheelhouse.builds.fanout import RequestStatus, part_spec
from wheelhouse.builds.queue import BuildState, BuildStatus, finished_durations
from wheelhouse.builds.responses import BuildView, RequestPart, RequestView
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import PROVENANCE_SUFFIX

if TYPE_CHECKING:
    from redis import Redis

JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


# -- viewing a build --


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def install_command(base_url: str, spec: BuildSpec) -> str:
    """The built wheel's install line, with the torch it needs (its METADATA says so too)."""
    return (f"uv pip install --index-url {base_url}/{spec.variant.key}/simple "
            f"'{spec.project}=={spec.wheel_version}' 'torch=={spec.torch}.*'")


def history_estimate(conn: Redis, status: BuildStatus) -> float | None:
    """Median duration in seconds of earlier successful builds of the same project and CUDA."""
    spec = status.spec
    if spec is None:
        return None
    durations = finished_durations(conn, spec.queue_name, spec.project, exclude=status.job_id)
    return statistics.median(durations) if durations else None


def build_view(conn: Redis, status: BuildStatus, base_url: str,
               catalog: Catalog | None = None) -> BuildView:
    """A build as the API and the build page's script show it.

    With ``catalog``, a built wheel's record fills in what the job's meta lacks (peak memory,
    patches, device code, compile cache).
    """
    spec = status.spec
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
    return BuildView(
        id=status.job_id,
        state=status.state.value,
        finished=status.finished,
        phase=status.phase,
        # Above 1: a worker died mid-build and this run resumed from the compile cache.
        attempt=status.attempt,
        spec=spec.to_dict() if spec is not None else {},
        description=spec.describe() if spec else None,
        variant=spec.variant.key if spec else None,
        progress=progress,
        position=status.position,
        failure_kind=status.failure_kind.value if status.failure_kind else None,
        reason=status.reason,
        max_jobs=status.max_jobs,
        max_jobs_reason=status.max_jobs_reason,
        # What each compile job was charged for: its device targets and effective nvcc threads.
        max_jobs_charge=facts.max_jobs.charge_summary() if facts.max_jobs else None,
        peak_memory_bytes=peak,
        # How the build was sandboxed; "off (unsafe)…" where the worker ran it unsandboxed.
        sandbox=status.build.sandbox,

        patches=[p.to_dict() | {"ref": p.ref} for p in facts.patches]
        if facts.patches is not None else None,
        device_code=facts.device_code_summary(),
        compile_cache={"hits": facts.compile_cache.hits, "misses": facts.compile_cache.misses,
                       "hit_rate": round(facts.compile_cache.hit_rate, 3),
                       "fetched": facts.compile_cache.fetched}
        if facts.compile_cache is not None else None,
        steps=facts.steps_summary(),
        toolkit=facts.toolkit,
        # What it was built from, and where the signed statement of it is (PEP 740).
        source={"url": facts.sdist_url or facts.sdist, "sha256": facts.sdist_sha256}
        if facts.sdist_url or facts.sdist else None,
        provenance=f"{base_url.rstrip('/')}/files/{record.variant.base.key}/{record.project}/"
                   f"{record.filename}{PROVENANCE_SUFFIX}"
        if record is not None and record.provenance_sha256 is not None else None,
        wheel=status.wheel,
        install=install_command(base_url, spec) if spec and status.state is BuildState.BUILT
        else None,
        enqueued_at=_iso(status.enqueued_at),
        started_at=_iso(status.started_at),
        ended_at=_iso(status.ended_at),
        elapsed_seconds=round(elapsed, 1) if elapsed is not None else None,
        estimate_seconds=round(estimate, 1) if estimate is not None else None,
        remaining_seconds=round(remaining, 1) if remaining is not None else None,
        finishing=finishing,
    )


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
                 catalog: Catalog | None = None) -> RequestView:
    """A split request: its state from its parts', and each part's view."""
    request = status.request
    parts = []
    for part in status.parts:
        view = build_view(conn, part.build, base_url, catalog) if part.build is not None \
            else None
        pspec = part_spec(request.spec, part.arch)
        parts.append(RequestPart(
            arch=part.arch, id=part.job_id, state=part.state.value,
            job=part.build is not None,
            finished=part.finished, variant=pspec.variant.key, wheel=part.wheel,
            progress=view.progress if view else None,
            phase=view.phase if view else None,
            reason=view.reason if view else None,
            failure_kind=view.failure_kind if view else None,
            started_at=view.started_at if view else None,
            ended_at=view.ended_at if view else None,
            install=install_command(base_url, pspec)
            if part.state is BuildState.BUILT else None,
        ))
    return RequestView(
        id=request.id,
        kind="split",
        state=status.state.value,
        finished=status.finished,
        spec=request.spec.to_dict(),
        description=request.describe(),
        variant=request.spec.variant.key,
        archs=tuple(request.archs),
        parts=tuple(parts),
        enqueued_at=datetime.fromtimestamp(request.created_at, UTC).isoformat(),
    )
