"""A build worker's life cycle: start-up sweep, heartbeat, abandoned jobs, and RQ's work loop.

``wheelhouse worker`` (``worker.cli``) discovers what the host can build and calls
:func:`run_worker`; everything from then until the worker exits lives here.

Redis going away is survived, not fatal: redis-py re-makes broken connections on the next
command, and RQ's loop retries a lost connection while it waits for a job, but it quits on one
lost elsewhere (a heartbeat, its maintenance pass). So when RQ's loop ends without a stop
having been asked for, the worker waits for Redis (``retry.WORKER_RECONNECT``) and runs a
fresh loop under the same name; only a stop signal, ``--burst``, or Redis staying away past
that policy ends it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from rq import Worker
from rq.exceptions import NoSuchJobError

from wheelhouse.builds.fleet import (
    WorkerAd,
    advertise,
    build_id_prefix,
    live_workers,
    source_paths_differ,
    withdraw,
)
from wheelhouse.builds.job import BuildJob
from wheelhouse.builds.meta import JobMeta
from wheelhouse.builds.queue import BuildQueues, fetch_job
from wheelhouse.builds.spec import prove_queue_name, queue_name
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.redisconn import connect
from wheelhouse.retry import WORKER_RECONNECT
from wheelhouse.variants import normalize_cuda
from worker.errors import SandboxUnavailable
from worker.sandbox.wrapper import Sandbox, source_path, startup_check
from worker.supervision.reaper import become_subreaper, build_id_base, pid_alive, sweep_orphans

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job
    from rq.queue import Queue

    from worker.capabilities import Capabilities

log = logging.getLogger("wheelhouse.worker")


class BuildWorker(Worker):
    """An RQ worker that runs build requests only, doesn't retry failures another attempt
    can't fix, and says whether its loop ended because it was asked to stop.

    Its jobs are :class:`~wheelhouse.builds.job.BuildJob` read as JSON: a job that names
    another function, or whose arguments aren't a valid build request, fails as
    ``refused-job`` without anything it names being imported. Jobs are enqueued with one
    retry, for a job abandoned by a worker that died; a compile error, a timeout or an
    incompatible combination fails for good on the first attempt.
    """

    #: Set by SIGTERM/SIGINT: RQ's loop then ends for good, not because Redis went away.
    stop_requested = False

    def request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]

    def execute_job(self, job: Job, queue: Queue) -> None:
        # Checked here, before the work horse forks: RQ's bookkeeping in the horse reads
        # the job's call, which for a refused job is then the refusal, never its data.
        if not isinstance(job, BuildJob):  # run_worker makes it with job_class=BuildJob
            raise TypeError(f"job {job.id} is a {type(job).__name__}, not a BuildJob")
        if job.refusal is not None:
            log.warning("refusing job %s: %s", job.id, job.refusal)
        super().execute_job(job, queue)

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: Any = None,
                           exc_string: str = "") -> None:
        try:
            failure = JobMeta.from_meta(job.get_meta(refresh=True)).failure
        except (NoSuchJobError, RedisError):  # keep RQ's own behaviour then
            failure = None
        if failure is not None and failure.kind is not FailureKind.INFRASTRUCTURE:
            job.retries_left = 0
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry,
                                   exc_string=exc_string)

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        # A classified failure is one line: its kind and reason say it all, and the build
        # log holds the detail. Anything else is unexpected and keeps RQ's traceback.
        exc = exc_info[1] if len(exc_info) > 1 else None
        if isinstance(exc, BuildFailed):
            log.error("build %s failed [%s]: %s", job.id, exc.kind.value, exc.reason)
            return
        super().handle_exception(job, *exc_info)


def _live_names(conn: Redis) -> set[str]:
    """Workers that are alive: a current advert, and on this host a running process."""
    host = socket.gethostname()
    names = set()
    for ad in live_workers(conn):
        pid = ad.extra.get("pid")
        if ad.hostname == host and isinstance(pid, int) and not pid_alive(pid):
            continue
        names.add(ad.name)
    return names


def requeue_abandoned(conn: Redis, queues: tuple[str, ...], *, me: str,
                      mine_too: bool = False) -> list[str]:
    """Hand the jobs of dead workers to RQ's own abandoned-job path now.

    RQ notices an abandoned job only when its heartbeat entry expires and a maintenance pass
    runs (minutes later). A worker that is gone (no advert, or its process is dead on this
    host) is known sooner: its started jobs are marked expired and RQ's cleanup then retries
    each once more (``wheelhouse.retry.ABANDONED_JOBS``) or fails it. With ``mine_too``, so
    are the started jobs of ``me`` itself: a worker whose Redis went away while a build ended
    lost that build's outcome, and nothing of it runs any more.
    """
    live = _live_names(conn) - {me} if mine_too else _live_names(conn) | {me}
    abandoned: list[str] = []
    for name in queues:
        # RQ's cleanup fetches these jobs too: as build jobs, which run no callbacks.
        registry = BuildQueues(conn).started(name)
        expired = {}
        for member in conn.zrange(registry.key, 0, -1):
            entry = member.decode() if isinstance(member, bytes) else str(member)
            job_id = registry.parse_job_id(entry)
            job = fetch_job(conn, job_id)
            if job is not None and job.worker_name and job.worker_name not in live:
                expired[entry] = 0
                abandoned.append(job_id)
        if expired:
            conn.zadd(registry.key, expired)
            registry.cleanup()
    return abandoned


def live_builds_on_host(conn: Redis, *, exclude: str) -> set[str]:
    """Job ids that other live workers on this host are running (never swept)."""
    host = socket.gethostname()
    live = set()
    for ad in live_workers(conn):
        if ad.name == exclude or ad.hostname != host or not ad.current_job:
            continue
        pid = ad.extra.get("pid")
        if isinstance(pid, int) and not pid_alive(pid):
            continue  # its advert hasn't expired yet, but the worker is gone
        live.add(ad.current_job)
    return live


def check_sandbox(config: Config, say: Callable[[str], None]) -> None:
    """Fail closed: raise :class:`SandboxUnavailable` (one line) unless builds can be sandboxed.

    A worker calls it before it listens on a build queue, so a host that cannot sandbox builds
    takes none. With ``WHEELHOUSE_BUILD_SANDBOX=off`` it warns instead.
    """
    why = startup_check(config)
    if why is not None:
        raise SandboxUnavailable(f"refusing to build: {why}")
    sandbox = Sandbox.from_config(config)
    if sandbox is None:
        say("WARNING: WHEELHOUSE_BUILD_SANDBOX=off: builds run unsandboxed, as this worker's "
            "user, with its files, processes and network (unsafe)")
    else:
        say(f"build sandbox: {sandbox.describe()}")


def sweep_stale(conn: Redis, config: Config, *, name: str) -> str:
    """Kill orphans of dead builds on this host and remove their workspaces; say what was done."""
    prefix = build_id_prefix(conn)
    live = {prefix + job_id for job_id in live_builds_on_host(conn, exclude=name)}
    sandbox = Sandbox.from_config(config)
    report = sweep_orphans(live, id_prefix=prefix,
                           uids=sandbox.range_uids if sandbox is not None else ())
    removed = 0
    workspace = Path(config.workspace)
    if workspace.is_dir():
        for entry in workspace.iterdir():
            # A workspace is named by its build id (older workers added "-<hex>" to it).
            owners = {build_id_base(entry.name), entry.name.rsplit("-", 1)[0]}
            if entry.is_dir() and entry.name.startswith(prefix) and not owners & live:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return (f"swept {report.processes} orphaned process(es) "
            f"({', '.join(report.signals) or 'no signals'}), removed {removed} stale workspace(s)")


class _Heartbeat(threading.Thread):
    def __init__(self, conn: Redis, ad: WorkerAd, interval: float,
                 current_job: Callable[[], str | None]) -> None:
        super().__init__(name="wheelhouse-heartbeat", daemon=True)
        self.conn = conn
        self.ad = ad
        self.interval = interval
        self.current_job = current_job
        self.stopped = threading.Event()

    def beat(self) -> None:
        try:
            job_id = self.current_job()
        except RedisError:  # the advert must keep flowing regardless
            job_id = None
        try:
            advertise(self.conn, replace(self.ad, current_job=job_id), ttl=self.interval * 4)
        except RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.beat()
            try:
                for job_id in requeue_abandoned(self.conn, self.ad.queues, me=self.ad.name):
                    log.warning("job %s was abandoned by a dead worker; handed to RQ to retry",
                                job_id)
            except RedisError as exc:
                log.warning("abandoned-job check failed: %s", exc)


def select_queues(caps: Capabilities, only_cuda: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The build queues this host serves, narrowed to the CUDA versions in ``only_cuda``."""
    queues = caps.queues
    if only_cuda:
        wanted = {queue_name(normalize_cuda(c), caps.machine) for c in only_cuda}
        queues = tuple(q for q in queues if q in wanted)
    return queues


def prove_queues(caps: Capabilities, config: Config) -> tuple[str, ...]:
    """The ``prove-sm<arch>`` queues this host takes GPU proofs from: one per arch of the GPUs
    ``nvidia-smi`` lists, or those ``WHEELHOUSE_PROVE_ARCHS`` names. A host without a GPU
    takes none: it never runs a proof job, so it never has a proof to claim."""
    archs = config.prove_arch_list
    if archs is None:
        archs = tuple(dict.fromkeys(g.arch for g in caps.gpus))
    return tuple(prove_queue_name(a, caps.machine) for a in archs)


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def run_worker(config: Config, caps: Capabilities, queues: tuple[str, ...], *,
               name: str | None = None, burst: bool = False,
               say: Callable[[str], None] = log.info) -> None:
    """Serve ``queues`` until stopped (or, with ``burst``, until they are empty).

    First check that builds can be sandboxed (else raise :class:`SandboxUnavailable` before
    listening on anything), sweep what dead builds of this host left, then advertise ``caps``
    every ``config.worker_heartbeat_seconds`` and hand dead workers' jobs to RQ's retry while
    RQ's work loop runs; withdraw the advert on the way out. ``say`` gets one line for each
    thing an operator should see.
    """
    if not config.redis_url:
        raise ValueError("a worker needs Redis: the configuration has no redis_url")
    check_sandbox(config, say)
    name = name or default_name()
    conn = connect(config)
    # Orphans of a build re-parent to this process, not to init, so that they can be reaped.
    become_subreaper()
    say(sweep_stale(conn, config, name=name))
    say(f"listening on {', '.join(queues)}")
    ad = replace(caps.advert(name, started_at=time.time()), queues=queues,
                 extra={"pid": os.getpid(), "source_path": str(source_path(config))})

    def new_worker() -> BuildWorker:
        return BuildWorker(list(queues), name=name, **BuildQueues(conn).worker_kwargs())

    current: list[Any] = [new_worker()]
    heartbeat = _Heartbeat(conn, ad, float(config.worker_heartbeat_seconds),
                           lambda: current[0].get_current_job_id())
    heartbeat.beat()
    try:
        for job_id in requeue_abandoned(conn, queues, me=name):
            say(f"job {job_id} was abandoned by a dead worker; handed to RQ to retry")
    except RedisError as exc:  # the heartbeat looks again at every beat
        say(f"abandoned-job check failed: {exc}")
    try:
        if note := source_paths_differ(live_workers(conn)):
            say(f"warning: {note}")
    except RedisError as exc:  # only a warning: the worker works without it
        say(f"source path check failed: {exc}")
    heartbeat.start()
    try:
        while True:
            rq_worker = current[0]
            try:
                rq_worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
            except RedisError as exc:  # RQ's teardown, against the Redis it lost
                say(f"RQ's work loop ended on a Redis error: {exc}")
            if burst or rq_worker.stop_requested:
                break
            say("RQ's work loop ended without a stop request; waiting for Redis to answer")
            _wait_for_horse(rq_worker, say)
            while True:
                _await_redis(conn, say)
                try:
                    # RQ refuses a second live worker of one name: mark the old one dead.
                    rq_worker.register_death()
                    for job_id in requeue_abandoned(conn, queues, me=name, mine_too=True):
                        say(f"job {job_id} ended while Redis was away; handed to RQ to retry")
                    break
                except RedisError as exc:
                    say(f"Redis went away again: {exc}")
            current[0] = new_worker()
            say("Redis answers again; serving " + ", ".join(queues))
    finally:
        heartbeat.stopped.set()
        try:
            withdraw(conn, name)
        except RedisError as exc:  # it expires by itself
            log.warning("could not withdraw the advert: %s", exc)


def _wait_for_horse(rq_worker: Any, say: Callable[[str], None]) -> None:
    """Let a build RQ's loop left running finish first: this host runs one build at a time."""
    pid = int(rq_worker.horse_pid or 0)
    if pid and pid_alive(pid):
        say(f"waiting for the build still running in process {pid}")
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # RQ reaped it already
            pass


class _Stop(Exception):
    """A stop signal arrived while the worker waited for Redis."""


def _await_redis(conn: Redis, say: Callable[[str], None]) -> None:
    """Ping Redis under ``retry.WORKER_RECONNECT`` until it answers; a stop signal meanwhile
    ends the worker (SystemExit), and so does Redis staying away past the policy."""
    def stop(signum: int, _frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        WORKER_RECONNECT.run("ping Redis", conn.ping, say=say)
    except _Stop as exc:
        say(f"stopped by {exc} while waiting for Redis")
        raise SystemExit(0) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
