"""The build queue as the web and the CLI use it: enqueue idempotently, look up, cancel, tail,
and scan RQ's registries (every build job at once; durations of finished builds).

Jobs are JSON naming ``worker.jobs.run_build`` by path (``wheelhouse.builds.job``), so the web
never imports the worker and a job is data, never code. One spec has one deterministic job id:
a second request finds the queued, running or finished job; a failed one is only re-run when
asked to. The worker reports through the job's meta, one :class:`~wheelhouse.builds.meta.JobMeta`
(phase, progress, the build's facts, the outcome), and a capped Redis list (the live log).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, cast, overload

from rq import Queue, Retry
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)

from wheelhouse import keys
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.builds.fleet import explain_unservable
from wheelhouse.builds.job import (
    JOB_FUNCTION,
    PROVE_FUNCTION,
    SERIALIZER,
    BuildJob,
    JobCall,
    ProveCall,
)
from wheelhouse.builds.meta import JobMeta
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import FailureKind, UnservableSpec
from wheelhouse.retry import ABANDONED_JOBS

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job

#: Lines of live log kept in Redis per build; the full log goes to storage.
LOG_KEEP = 2000
#: How long results, failures and logs stay in Redis.
KEEP_SECONDS = 30 * 24 * 3600
#: The RQ timeout exceeds the worker's own build deadline by this much, so that the worker's
#: deadline (which kills the whole tree) always fires first.
RQ_TIMEOUT_MARGIN = 1800
#: How long a proof waits for a GPU host of its arch before it is dropped (a fleet with no
#: such GPU never proves it; the project page then says "not proven").
PROVE_WAIT_SECONDS = 7 * 24 * 3600
#: The deadline of one proof job: a venv with torch, the wheel, and the proof itself.
PROVE_TIMEOUT = 3600


class BuildState(StrEnum):
    QUEUED = "queued"
    BUILDING = "building"
    BUILT = "built"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """Built, failed or cancelled: nothing more will happen to the build."""
        return self in (BuildState.BUILT, BuildState.FAILED, BuildState.CANCELLED)


_STATES = {
    "queued": BuildState.QUEUED, "deferred": BuildState.QUEUED,
    "scheduled": BuildState.QUEUED, "started": BuildState.BUILDING,
    "finished": BuildState.BUILT, "failed": BuildState.FAILED, "stopped": BuildState.FAILED,
    "canceled": BuildState.CANCELLED,
}


#: Every build queue's name starts so (``build-cu128-x86_64``); RQ's other queues are not ours.
QUEUE_PREFIX = "build-"


@dataclass(frozen=True)
class BuildQueues:
    """RQ's build queues and registries, opened one way for the web, the CLI and the workers.

    Each is opened on one connection with :class:`BuildJob` as its job class and
    :data:`SERIALIZER`, so that no reader, RQ's own cleanup included, loads a job otherwise:
    nobody passes the connection and the serializer into every call.
    """

    conn: Redis

    def queue(self, name: str) -> Queue:
        return Queue(name, connection=self.conn, job_class=BuildJob, serializer=SERIALIZER)

    def names(self) -> list[str]:
        """The build queues Redis knows (any that ever had a job)."""
        return sorted(q.name for q in Queue.all(connection=self.conn, serializer=SERIALIZER)
                      if q.name.startswith(QUEUE_PREFIX))

    def started(self, name: str) -> StartedJobRegistry:
        return StartedJobRegistry(name, connection=self.conn, job_class=BuildJob,
                                  serializer=SERIALIZER)

    def finished(self, name: str) -> FinishedJobRegistry:
        return FinishedJobRegistry(name, connection=self.conn, job_class=BuildJob,
                                   serializer=SERIALIZER)

    def ended(self, name: str) -> tuple[FailedJobRegistry, CanceledJobRegistry]:
        """The failed and the cancelled builds' registries of queue ``name``."""
        return (FailedJobRegistry(name, connection=self.conn, job_class=BuildJob,
                                  serializer=SERIALIZER),
                CanceledJobRegistry(name, connection=self.conn, job_class=BuildJob,
                                    serializer=SERIALIZER))

    def fetch(self, job_id: str) -> BuildJob | None:
        """The build job ``job_id`` (read as JSON, never unpickled), or None if there is none."""
        try:
            return cast("BuildJob", BuildJob.fetch(job_id, connection=self.conn,
                                                   serializer=SERIALIZER))
        except NoSuchJobError:
            return None

    def fetch_many(self, job_ids: list[str]) -> list[BuildJob]:
        """The jobs of ``job_ids`` that exist, in one pipeline."""
        jobs = BuildJob.fetch_many(job_ids, connection=self.conn, serializer=SERIALIZER)
        return [cast("BuildJob", j) for j in jobs if j is not None]

    def worker_kwargs(self) -> dict[str, Any]:
        """What an RQ worker of these queues is made with, besides its queues and name."""
        return {"connection": self.conn, "job_class": BuildJob, "serializer": SERIALIZER}


@dataclass(frozen=True)
class BuildStatus:
    """Everything a page or the API shows about one build."""

    job_id: str
    state: BuildState
    spec: BuildSpec | None
    """None where the job's meta holds no spec this version reads."""
    phase: str | None = None
    progress: tuple[int, int] | None = None
    """Ninja's ``[N/M]``: (done, total)."""
    failure_kind: FailureKind | None = None
    reason: str | None = None
    """One line: why it failed (or what it built)."""
    wheel: str | None = None
    log_key: str | None = None
    """Storage key of the full log, once the build ended."""
    position: int | None = None
    """Place in its queue (0 = next), while queued."""
    enqueued_at: datetime | None = None
    """Times are timezone-aware (UTC), whichever way RQ returned them."""
    started_at: datetime | None = None
    ended_at: datetime | None = None
    build: BuildFacts = field(default_factory=BuildFacts)
    """What the build has measured so far (``JobMeta.build``)."""
    attempt: int = 1
    """Which run of the job this is: above 1 once a worker that died left it to another
    (RQ's retry of an abandoned job), which resumes from the compile cache its earlier
    attempts pushed as they went."""

    @property
    def finished(self) -> bool:
        return self.state.ended

    @property
    def max_jobs(self) -> int | None:
        return self.build.max_jobs.jobs if self.build.max_jobs is not None else None

    @property
    def max_jobs_reason(self) -> str | None:
        return self.build.max_jobs.reason if self.build.max_jobs is not None else None


@dataclass(frozen=True)
class Enqueued:
    job_id: str
    state: BuildState
    created: bool
    """False when an existing job was returned instead of a new one."""


def fetch_job(conn: Redis, job_id: str) -> BuildJob | None:
    """The build job ``job_id`` (read as JSON, never unpickled), or None if there is none."""
    return BuildQueues(conn).fetch(job_id)


def state_of(job: Job) -> BuildState:
    """A job's build state; for jobs fetched in bulk as much as one by one."""
    status = job.get_status(refresh=False)
    state = _STATES.get(str(getattr(status, "value", status)), BuildState.QUEUED)
    failure = JobMeta.from_meta(job.meta).failure
    if state is BuildState.FAILED and failure is not None \
            and failure.kind is FailureKind.CANCELLED:
        return BuildState.CANCELLED
    return state


def enqueue_build(
    conn: Redis,
    spec: BuildSpec,
    *,
    source: str | None = None,
    rerun_failed: bool = False,
    require_worker: bool = True,
    timeout: int = 4 * 3600,
) -> Enqueued:
    """Enqueue ``spec`` unless it is already queued, building or built; return its job.

    ``source`` is a local sdist path the worker reads instead of the upstream index (single-box
    mode and tests). With ``require_worker``, a spec no live worker serves raises
    :class:`UnservableSpec` with a one-line explanation instead of waiting forever.
    """
    if require_worker:
        why = explain_unservable(conn, spec)
        if why is not None:
            raise UnservableSpec(why)
    job_id = spec.job_id
    existing = fetch_job(conn, job_id)
    if existing is not None:
        state = state_of(existing)
        if not (rerun_failed and state in (BuildState.FAILED, BuildState.CANCELLED)):
            return Enqueued(job_id, state, created=False)
        existing.delete()
        conn.delete(keys.log(job_id), keys.log_count(job_id), keys.cancel(job_id),
                    keys.requester(job_id))
    queue = BuildQueues(conn).queue(spec.queue_name)
    try:
        queue.enqueue(
            JOB_FUNCTION, *JobCall(spec, source, timeout).to_args(),
            job_id=job_id, unique=True, description=spec.describe(),
            job_timeout=timeout + RQ_TIMEOUT_MARGIN, result_ttl=KEEP_SECONDS,
            failure_ttl=KEEP_SECONDS,
            # For a job abandoned by a worker that died; the worker refuses the retry for
            # failures that another attempt can't fix (see worker.lifecycle.BuildWorker).
            retry=Retry(max=ABANDONED_JOBS.retries,
                        interval=[int(ABANDONED_JOBS.delay(i))
                                  for i in range(ABANDONED_JOBS.retries)]),
            meta=JobMeta(spec=spec, phase="queued").to_meta(),
        )
    except DuplicateJobError:
        job = fetch_job(conn, job_id)
        return Enqueued(job_id, state_of(job) if job else BuildState.QUEUED, created=False)
    return Enqueued(job_id, BuildState.QUEUED, created=True)


def get_build(conn: Redis, job_id: str) -> BuildStatus | None:
    """The build's state and progress, or None for an unknown id."""
    job = fetch_job(conn, job_id)
    if job is None:
        return None
    meta = JobMeta.from_meta(job.meta)
    state = state_of(job)
    position = None
    if state is BuildState.QUEUED:
        position = BuildQueues(conn).queue(job.origin).get_job_position(job_id)
    reason = meta.failure.reason if meta.failure is not None else None
    if state is BuildState.FAILED and not reason:
        latest = job.latest_result()
        reason = _last_line(latest.exc_string if latest is not None else None)
    return BuildStatus(
        job_id=job_id, state=state, spec=meta.spec, phase=meta.phase,
        progress=meta.progress,
        failure_kind=meta.failure.kind if meta.failure is not None else None,
        reason=reason or meta.summary, wheel=meta.wheel, log_key=meta.log_key,
        position=position, enqueued_at=_utc(job.enqueued_at), started_at=_utc(job.started_at),
        ended_at=_utc(job.ended_at), build=meta.build, attempt=attempt_of(job),
    )


def attempt_of(job: Job) -> int:
    """1 for a job's first run, 2 for its first retry, ...: from what RQ's retry has left."""
    left = job.retries_left
    if not isinstance(left, int) or isinstance(left, bool):
        return 1
    return max(1, 1 + ABANDONED_JOBS.retries - left)


def _last_line(text: str | None) -> str | None:
    if not text:
        return None
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else None


def cancel_build(conn: Redis, job_id: str) -> bool:
    """Cancel a queued build, or ask a running one to stop; False if it already ended."""
    job = fetch_job(conn, job_id)
    if job is None:
        return False
    state = state_of(job)
    if state is BuildState.QUEUED:
        job.cancel()
        return True
    if state is BuildState.BUILDING:
        # The worker polls this flag and kills the build's whole tree itself; RQ's own stop
        # command would kill only the work horse and leave the compilers running.
        conn.set(keys.cancel(job_id), str(time.time()), ex=KEEP_SECONDS)
        return True
    return False


def record_requester(conn: Redis, build_id: str, name: str) -> None:
    """Keep who requested the build (or split request) ``build_id``, as long as the build is
    kept; the first requester stays (a later request of the same spec joins that build)."""
    conn.set(keys.requester(build_id), name, nx=True, ex=KEEP_SECONDS)


def requester_of(conn: Redis, build_id: str) -> str | None:
    """The token name that requested ``build_id``; None where none was recorded (a build made
    on a miss, or before requesters were kept)."""
    raw = conn.get(keys.requester(build_id))
    if raw is None:
        return None
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def cancel_requested(conn: Redis, job_id: str) -> bool:
    return bool(conn.exists(keys.cancel(job_id)))


def append_log(conn: Redis, job_id: str, lines: list[str]) -> None:
    """Add lines to the live log (capped at :data:`LOG_KEEP`)."""
    if not lines:
        return
    key = keys.log(job_id)
    with conn.pipeline() as pipe:
        pipe.rpush(key, *lines)
        pipe.ltrim(key, -LOG_KEEP, -1)
        pipe.incrby(keys.log_count(job_id), len(lines))
        pipe.expire(key, KEEP_SECONDS)
        pipe.expire(keys.log_count(job_id), KEEP_SECONDS)
        pipe.execute()


def log_since(conn: Redis, job_id: str, offset: int = 0) -> tuple[list[str], int]:
    """Live log lines from line number ``offset`` on, and the offset to ask for next.

    Lines older than the last :data:`LOG_KEEP` are gone from Redis (the full log is in storage
    once the build ends); asking for them returns what is still there.
    """
    with conn.pipeline() as pipe:
        pipe.get(keys.log_count(job_id))
        pipe.lrange(keys.log(job_id), 0, -1)
        raw_total, raw_lines = pipe.execute()
    total = int(raw_total or 0)
    lines = [b.decode(errors="replace") if isinstance(b, bytes) else str(b) for b in raw_lines]
    first = total - len(lines)
    start = max(0, offset - first)
    return lines[start:], total


def log_tail(conn: Redis, job_id: str, lines: int = 200) -> list[str]:
    raw = conn.lrange(keys.log(job_id), -lines, -1)
    return [b.decode(errors="replace") if isinstance(b, bytes) else str(b) for b in raw]


# -- scans of RQ's registries --


def all_build_jobs(conn: Redis, *, finished_limit: int = 2000) -> list[BuildJob]:
    """Every build job the queues and registries know, fetched in one pipeline."""
    queues = BuildQueues(conn)
    ids: dict[str, None] = {}
    for name in queues.names():
        for jid in queues.queue(name).get_job_ids():
            ids[jid] = None
        for registry in (queues.started(name), *queues.ended(name)):
            for jid in registry.get_job_ids():
                ids[jid] = None
        for jid in queues.finished(name).get_job_ids(-finished_limit, -1):
            ids[jid] = None
    return queues.fetch_many(list(ids))


def finished_durations(conn: Redis, queue: str, project: str, *, exclude: str | None = None,
                       scan: int = 200, keep: int = 50) -> list[float]:
    """Wall-clock seconds of the latest successful builds of ``project`` on ``queue``.

    Looks at the ``scan`` oldest entries of the finished registry, of which the last ``keep``
    (other than ``exclude``) are fetched in one pipeline.
    """
    queues = BuildQueues(conn)
    ids = queues.finished(queue).get_job_ids(0, scan - 1)
    ids = [i for i in ids if i != exclude][-keep:]
    durations = []
    for job in queues.fetch_many(ids):
        if job.started_at is None or job.ended_at is None:
            continue
        if JobMeta.from_meta(job.meta).project == project:
            durations.append((_utc(job.ended_at) - _utc(job.started_at)).total_seconds())
    return durations


@overload
def _utc(moment: datetime) -> datetime: ...
@overload
def _utc(moment: None) -> None: ...
def _utc(moment: datetime | None) -> datetime | None:
    """RQ versions differ in whether they return aware datetimes: make them aware (UTC)."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def enqueue_proofs(conn: Redis, spec: BuildSpec, filename: str, sha256: str,
                   archs: Iterable[str]) -> list[str]:
    """Queue the GPU proof of a published wheel on ``prove-sm<arch>`` for each of ``archs``
    (the SASS it holds): a worker with a GPU of that arch takes it, wherever the wheel was
    built. Once per wheel and arch (the job id is the bytes' and the arch's); return the ids
    of the jobs queued now."""
    queues = BuildQueues(conn)
    queued = []
    # sm_90a code runs on an sm_90 GPU, which is the queue its hosts take.
    for arch in sorted({a.rstrip("af") for a in archs}):
        call = ProveCall(spec, filename, sha256, arch)
        try:
            queues.queue(call.queue_name).enqueue(
                PROVE_FUNCTION, *call.to_args(), job_id=call.job_id, unique=True,
                description=f"GPU proof of {filename} on sm_{arch}",
                job_timeout=PROVE_TIMEOUT + RQ_TIMEOUT_MARGIN, ttl=PROVE_WAIT_SECONDS,
                result_ttl=KEEP_SECONDS, failure_ttl=KEEP_SECONDS,
                retry=Retry(max=ABANDONED_JOBS.retries,
                            interval=[int(ABANDONED_JOBS.delay(i))
                                      for i in range(ABANDONED_JOBS.retries)]),
                meta=JobMeta(spec=spec, phase="queued").to_meta())
        except DuplicateJobError:
            continue
        queued.append(call.job_id)
    return queued
