"""RQ job entry points. The web enqueues builds by dotted path (``worker.jobs.run_build``); a
build that published a wheel enqueues its GPU proofs (``worker.jobs.run_proof``)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from rq import get_current_job

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.builds.fleet import build_id_prefix
from wheelhouse.builds.job import JOB_FUNCTION, JobCall, ProveCall
from wheelhouse.builds.meta import Failure, JobMeta
from wheelhouse.builds.queue import PROVE_TIMEOUT, append_log, cancel_requested, enqueue_proofs
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.builds.stats import record_build
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index.storage import open_storage
from worker import build
from worker.events import BuildEvent, LogLines, Measured, PhaseBegan, Progress, Reporter
from worker.steps import prove
from worker.steps.publish import log_key
from worker.supervision.reaper import become_subreaper

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job

log = logging.getLogger(__name__)

#: Seconds between saves of the job's meta for progress alone (phases save at once).
PROGRESS_SAVE_INTERVAL = 1.0


class RedisReporter(Reporter):
    """Reports into the RQ job's meta (one :class:`JobMeta`) and the live log list; a Redis
    hiccup never fails a build."""

    def __init__(self, conn: Redis, job: Job) -> None:
        self.conn = conn
        self.job = job
        self.meta = JobMeta.from_meta(job.meta)
        self._saved_at = 0.0
        self._dirty = False

    def _save(self, force: bool = False) -> None:
        self.job.meta = self.meta.to_meta()
        now = time.monotonic()
        if not force and now - self._saved_at < PROGRESS_SAVE_INTERVAL:
            self._dirty = True
            return
        try:
            self.job.save_meta()  # type: ignore[no-untyped-call]
            self._saved_at = now
            self._dirty = False
        except RedisError as exc:
            log.warning("could not save progress of %s: %s", self.job.id, exc)

    def begin(self, spec: BuildSpec) -> None:
        """A new attempt of the job at ``spec``: what an earlier attempt reported goes."""
        self.finish(JobMeta(spec=spec, phase=self.meta.phase))

    def report(self, event: BuildEvent) -> None:
        match event:
            case PhaseBegan(name):
                self.meta = replace(self.meta, phase=name)
                self._save(force=True)
            case Progress(done, total):
                self.meta = replace(self.meta, progress=(done, total))
                self._save()
            case LogLines(lines):
                self._append_log(list(lines))
            case Measured(facts):
                self.meta = replace(self.meta, build=facts)
                self._save(force=True)

    def _append_log(self, lines: list[str]) -> None:
        try:
            append_log(self.conn, self.job.id, lines)
        except RedisError as exc:
            log.warning("could not append to the live log of %s: %s", self.job.id, exc)
        if self._dirty:
            self._save()

    def should_cancel(self) -> bool:
        try:
            return cancel_requested(self.conn, self.job.id)
        except RedisError:
            return False

    def finish(self, meta: JobMeta) -> None:
        """The job's meta from now on (its outcome), saved at once."""
        self.meta = meta
        self._save(force=True)


def _count(conn: Redis, state: str, facts: BuildFacts) -> None:
    """Fleet-wide counters for ``/metrics``; a Redis hiccup must not fail the build."""
    try:
        record_build(conn, state=state, seconds=facts.seconds or 0.0,
                     reaped=facts.reaped.processes if facts.reaped is not None else 0,
                     pauses=facts.governor_pauses or 0)
    except RedisError as exc:
        log.warning("could not count the build in Redis: %s", exc)


def run_build(spec_data: dict[str, Any], source: str | None = None,
              timeout: int | None = None) -> dict[str, Any]:
    """Build one spec inside an RQ work horse; the job's meta carries progress and the outcome.

    Its arguments are a :class:`JobCall`'s (:meth:`JobCall.to_args`), read back as one.
    """
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_build must run inside an RQ job")
    call = JobCall.parse(job.id, job.origin, JOB_FUNCTION, None, [spec_data, source, timeout],
                         {})
    # Orphans of the build re-parent to us, not to init, so that the reaper can collect them.
    become_subreaper()
    config = Config.from_env()
    spec = call.spec
    reporter = RedisReporter(job.connection, job)
    reporter.begin(spec)
    try:
        result = build.run_build(
            spec, config=config, storage=open_storage(config), reporter=reporter,
            source=Path(call.source) if call.source else None, timeout=call.timeout,
            build_id=build_id_prefix(job.connection) + job.id,
        )
    except BuildFailed as exc:
        facts = exc.facts or BuildFacts()
        reporter.finish(replace(reporter.meta, phase="failed",
                                failure=Failure(exc.kind, exc.reason), log_key=log_key(spec),
                                build=facts))
        _count(job.connection, exc.kind.value, facts)
        raise
    if not result.already_published:
        _count(job.connection, "built", result.build)
        _queue_proofs(job.connection, spec, result.record.filename, result.record.sha256,
                      result.build.sass_archs)
    summary = ("already published" if result.already_published
               else f"built in {result.seconds:.0f} s")
    reporter.finish(replace(reporter.meta, phase="published", wheel=result.record.filename,
                            summary=summary, log_key=result.log_key, build=result.build))
    return {"wheel": result.record.filename, "variant": result.record.variant.key,
            "sha256": result.record.sha256, "already_published": result.already_published,
            "seconds": round(result.seconds, 1)}


def _queue_proofs(conn: Redis, spec: BuildSpec, filename: str, sha256: str,
                  archs: list[str]) -> None:
    """The new wheel's GPU proofs, one per SASS arch it holds, for the fleet's GPU hosts; a
    Redis hiccup must not fail a build that published."""
    try:
        queued = enqueue_proofs(conn, spec, filename, sha256, archs)
    except RedisError as exc:
        log.warning("could not queue the GPU proofs of %s: %s", filename, exc)
        return
    if queued:
        log.info("queued the GPU proofs of %s: %s", filename, ", ".join(queued))


def run_proof(spec_data: dict[str, Any], filename: str, sha256: str,
              arch: str) -> dict[str, Any]:
    """Prove one published wheel on this host's GPU, inside an RQ work horse.

    Its arguments are a :class:`ProveCall`'s (:meth:`ProveCall.to_args`). Where no GPU ran
    the proof the job fails as ``infrastructure`` (RQ hands it to another worker once) and
    nothing is recorded; a proof that ran is recorded, passed or failed.
    """
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_proof must run inside an RQ job")
    call = ProveCall.parse(job.id, job.origin, [spec_data, filename, sha256, arch], {})
    become_subreaper()
    config = Config.from_env()
    reporter = RedisReporter(job.connection, job)
    reporter.begin(call.spec)
    try:
        outcome = prove.run_proof(call, config=config, storage=open_storage(config),
                                  reporter=reporter,
                                  build_id=build_id_prefix(job.connection) + job.id,
                                  timeout=PROVE_TIMEOUT)
        if not outcome.proof.proven:
            raise BuildFailed(FailureKind.INFRASTRUCTURE,
                              f"no GPU ran the proof on this host: {outcome.proof.reason}")
    except BuildFailed as exc:
        reporter.finish(replace(reporter.meta, phase="failed",
                                failure=Failure(exc.kind, exc.reason)))
        raise
    verdict = outcome.proof.line()
    reporter.finish(replace(reporter.meta, phase="published", wheel=filename, summary=verdict))
    return {"wheel": filename, "sha256": sha256, "arch": arch, "proven": outcome.proof.proven,
            "passed": outcome.proof.passed, "recorded": outcome.recorded,
            "already": outcome.already, "line": verdict}
