"""``wheelhouse worker``, ``wheelhouse build`` and ``wheelhouse workers``."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from wheelhouse.buildspec import BuildSpec, FailureKind
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, InvalidBuildSpec, WheelhouseError
from wheelhouse.fleet import WorkerAd, advertise, build_id_prefix, live_workers, withdraw
from worker.build import Reporter

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job
    from rq.queue import Queue

    from worker.capabilities import Capabilities

log = logging.getLogger("wheelhouse.worker")


def _build_worker_class() -> type[Any]:
    from rq import Worker

    class BuildWorker(Worker):
        """An RQ worker that doesn't retry failures another attempt can't fix.

        Jobs are enqueued with one retry, for a job abandoned by a worker that died; a compile
        error, a timeout or an incompatible combination fails for good on the first attempt.
        """

        def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: Any = None,
                               exc_string: str = "") -> None:
            from redis.exceptions import RedisError
            from rq.exceptions import NoSuchJobError

            try:
                failure = job.get_meta(refresh=True).get("failure") or {}
            except (NoSuchJobError, RedisError):  # keep RQ's own behaviour then
                failure = {}
            kind = failure.get("kind")
            if kind is not None and kind != FailureKind.INFRASTRUCTURE.value:
                job.retries_left = 0
            super().handle_job_failure(job, queue, started_job_registry=started_job_registry,
                                       exc_string=exc_string)

    return BuildWorker


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_names(conn: Redis) -> set[str]:
    """Workers that are alive: a current advert, and on this host a running process."""
    host = socket.gethostname()
    names = set()
    for ad in live_workers(conn):
        pid = ad.extra.get("pid")
        if ad.hostname == host and isinstance(pid, int) and not _pid_alive(pid):
            continue
        names.add(ad.name)
    return names


def requeue_abandoned(conn: Redis, queues: tuple[str, ...], *, me: str) -> list[str]:
    """Hand the jobs of dead workers to RQ's own abandoned-job path now.

    RQ notices an abandoned job only when its heartbeat entry expires and a maintenance pass
    runs (minutes later). A worker that is gone (no advert, or its process is dead on this
    host) is known sooner: its started jobs are marked expired and RQ's cleanup then retries
    each once (``Retry(max=1)``) or fails it.
    """
    from rq.job import Job
    from rq.registry import StartedJobRegistry

    live = _live_names(conn) | {me}
    abandoned: list[str] = []
    for name in queues:
        registry = StartedJobRegistry(name, connection=conn)
        expired = {}
        for member in conn.zrange(registry.key, 0, -1):
            entry = member.decode() if isinstance(member, bytes) else str(member)
            job_id = registry.parse_job_id(entry)
            job = Job.fetch(job_id, connection=conn) if Job.exists(job_id, conn) else None
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
        if isinstance(pid, int) and not _pid_alive(pid):
            continue  # its advert hasn't expired yet, but the worker is gone
        live.add(ad.current_job)
    return live


def sweep_stale(conn: Redis, config: Config, *, name: str) -> str:
    """Kill orphans of dead builds on this host and remove their workspaces; say what was done."""
    from worker.reaper import sweep_orphans

    prefix = build_id_prefix(conn)
    live = {prefix + job_id for job_id in live_builds_on_host(conn, exclude=name)}
    report = sweep_orphans(live, id_prefix=prefix)
    removed = 0
    workspace = Path(config.workspace)
    if workspace.is_dir():
        for entry in workspace.iterdir():
            build_id = entry.name.rsplit("-", 1)[0]
            if entry.is_dir() and entry.name.startswith(prefix) and build_id not in live:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return (f"swept {report.processes} orphaned process(es) "
            f"({', '.join(report.signals) or 'no signals'}), removed {removed} stale workspace(s)")


class _Heartbeat(threading.Thread):
    def __init__(self, conn: Redis, ad: WorkerAd, interval: float,
                 current_job: Any) -> None:
        super().__init__(name="wheelhouse-heartbeat", daemon=True)
        self.conn = conn
        self.ad = ad
        self.interval = interval
        self.current_job = current_job
        self.stopped = threading.Event()

    def beat(self) -> None:
        from dataclasses import replace

        from redis.exceptions import RedisError

        try:
            job_id = self.current_job()
        except RedisError:  # the advert must keep flowing regardless
            job_id = None
        try:
            advertise(self.conn, replace(self.ad, current_job=job_id), ttl=self.interval * 4)
        except RedisError as exc:
            log.warning("heartbeat failed: %s", exc)

    def run(self) -> None:
        from redis.exceptions import RedisError

        while not self.stopped.wait(self.interval):
            self.beat()
            try:
                for job_id in requeue_abandoned(self.conn, self.ad.queues, me=self.ad.name):
                    log.warning("job %s was abandoned by a dead worker; handed to RQ to retry",
                                job_id)
            except RedisError as exc:
                log.warning("abandoned-job check failed: %s", exc)


@click.command("worker")
@click.option("--name", default=None, help="Worker name (default: host-pid).")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--cuda", "only_cuda", multiple=True,
              help="Serve only these CUDA versions (repeatable; default: all the toolkits allow).")
def worker_command(name: str | None, burst: bool, only_cuda: tuple[str, ...]) -> None:
    """Build wheels from the queues this host can serve (CUDA version x CPU architecture)."""
    import redis

    from worker.capabilities import discover
    from worker.reaper import become_subreaper

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = Config.from_env()
    if not config.redis_url:
        raise click.ClickException("WHEELHOUSE_REDIS_URL is not set; a worker needs Redis")
    caps = discover()
    queues = _select_queues(caps, only_cuda)
    if not queues:
        found = ", ".join(f"{t.cuda} ({t.home})" for t in caps.toolkits) or "none"
        raise click.ClickException(
            f"this host can serve no build queue: CUDA toolkits found: {found}")
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    conn = redis.Redis.from_url(config.redis_url)
    become_subreaper()
    click.echo(f"wheelhouse worker {name}: {caps.machine}, {caps.cores} cores, "
               f"{caps.memory_bytes / 1024**3:.1f} GiB, toolkits "
               f"{', '.join(t.release for t in caps.toolkits)}, GPUs "
               f"{', '.join(g.name for g in caps.gpus) or 'none'}")
    click.echo(sweep_stale(conn, config, name=name))
    click.echo(f"listening on {', '.join(queues)}")
    ad = caps.advert(name, started_at=time.time())
    from dataclasses import replace

    ad = replace(ad, queues=queues, extra={"pid": os.getpid()})
    worker_cls = _build_worker_class()
    rq_worker = worker_cls(list(queues), connection=conn, name=name)
    heartbeat = _Heartbeat(conn, ad, float(config.worker_heartbeat_seconds),
                           rq_worker.get_current_job_id)
    heartbeat.beat()
    for job_id in requeue_abandoned(conn, queues, me=name):
        click.echo(f"job {job_id} was abandoned by a dead worker; handed to RQ to retry")
    heartbeat.start()
    try:
        rq_worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
    finally:
        heartbeat.stopped.set()
        withdraw(conn, name)


def _select_queues(caps: Capabilities, only_cuda: tuple[str, ...]) -> tuple[str, ...]:
    from wheelhouse.buildspec import queue_name
    from wheelhouse.variants import normalize_cuda

    queues = caps.queues
    if only_cuda:
        wanted = {queue_name(normalize_cuda(c), caps.machine) for c in only_cuda}
        queues = tuple(q for q in queues if q in wanted)
    return queues


class _ConsoleReporter(Reporter):
    """Phases and a progress bar on stderr; the log too with ``--verbose``."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.tty = sys.stderr.isatty()
        self._last_shown = -1
        self._cancel = False

    def phase(self, name: str) -> None:
        self._newline()
        click.echo(f"==> {name}", err=True)

    def progress(self, done: int, total: int) -> None:
        if total <= 0:
            return
        width = 30
        filled = int(width * done / total)
        bar = "#" * filled + "-" * (width - filled)
        percent = int(100 * done / total)
        if self.tty and not self.verbose:
            click.echo(f"\r[{bar}] {done}/{total} {percent}%", nl=False, err=True)
            self._last_shown = 0
        elif percent // 10 != self._last_shown // 10 or done == total:
            click.echo(f"[{bar}] {done}/{total} {percent}%", err=True)
            self._last_shown = percent

    def lines(self, lines: list[str]) -> None:
        if self.verbose:
            for line in lines:
                click.echo(line, err=True)

    def note(self, **fields: Any) -> None:
        if "max_jobs_reason" in fields:
            self._newline()
            click.echo(str(fields["max_jobs_reason"]), err=True)

    def should_cancel(self) -> bool:
        return self._cancel

    def _newline(self) -> None:
        if self.tty and self._last_shown == 0:
            click.echo("", err=True)
            self._last_shown = -1


@contextmanager
def _cancel_on_interrupt(reporter: _ConsoleReporter) -> Iterator[None]:
    """Turn Ctrl-C into a cancel, so the build's whole tree is killed rather than orphaned."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        reporter._cancel = True

    previous = signal.signal(signal.SIGINT, handler)
    previous_term = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


def parse_target(target: str) -> tuple[str, str, Path | None]:
    """``flash-attn==2.8.3`` or a local sdist path → (project, version, path or None)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import InvalidSdistFilename, parse_sdist_filename

    path = Path(target)
    if path.exists():
        try:
            name, version = parse_sdist_filename(path.name)
        except InvalidSdistFilename:
            raise InvalidBuildSpec(
                f"{path.name} is not an sdist file name (name-version.tar.gz)") from None
        return str(name), str(version), path.resolve()
    try:
        req = Requirement(target)
    except InvalidRequirement:
        raise InvalidBuildSpec(
            f"{target!r} is neither an existing sdist nor a requirement like flash-attn==2.8.3"
        ) from None
    pins = [s for s in req.specifier if s.operator in ("==", "===")]
    if len(pins) != 1 or len(req.specifier) != 1 or "*" in pins[0].version:
        raise InvalidBuildSpec(f"{target!r} must pin one exact version, e.g. {req.name}==2.8.3")
    return req.name, pins[0].version, None


@click.command("build")
@click.argument("target")
@click.option("--torch", "torch_version", required=True, help="torch version, e.g. 2.8.")
@click.option("--cuda", required=True, help="CUDA version torch was built with, e.g. 12.8.")
@click.option("--python", "python_version", default=None,
              help="Python version (default: this interpreter's).")
@click.option("--arch", "archs", multiple=True,
              help="GPU architecture, e.g. sm90 (repeatable; default: the recipe's set).")
@click.option("--cxx11abi/--no-cxx11abi", default=None, help="C++ ABI (default: torch's).")
@click.option("--timeout", type=int, default=None, help="Build deadline in seconds.")
@click.option("--max-jobs", type=click.IntRange(min=1), default=None,
              help="Override the RAM-aware MAX_JOBS.")
@click.option("--keep-workspace", is_flag=True, help="Keep the venv and build tree.")
@click.option("-v", "--verbose", is_flag=True, help="Stream the build log.")
def build_command(target: str, torch_version: str, cuda: str, python_version: str | None,
                  archs: tuple[str, ...], cxx11abi: bool | None, timeout: int | None,
                  max_jobs: int | None, keep_workspace: bool, verbose: bool) -> None:
    """Build TARGET (``flash-attn==2.8.3`` or a local sdist) here, without Redis, and publish it."""
    from wheelhouse.storage import open_storage
    from worker import build
    from worker.reaper import become_subreaper

    config = Config.from_env()
    try:
        project, version, source = parse_target(target)
        spec = BuildSpec.create(
            project, version,
            python=python_version or f"{sys.version_info.major}.{sys.version_info.minor}",
            torch=torch_version, cuda=cuda, archs=archs, cxx11abi=cxx11abi)
    except WheelhouseError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"building {spec.describe()}", err=True)
    become_subreaper()
    reporter = _ConsoleReporter(verbose)
    try:
        with _cancel_on_interrupt(reporter):
            result = build.run_build(
                spec, config=config, storage=open_storage(config),
                reporter=reporter,
                source=source, timeout=timeout, max_jobs=max_jobs,
                keep_workspace=keep_workspace)
    except BuildFailed as exc:
        reporter._newline()
        raise click.ClickException(f"build failed [{exc.kind}]: {exc.reason}") from None
    reporter._newline()
    if result.already_published:
        click.echo(f"{result.record.filename} is already published in {result.record.variant}")
    else:
        click.echo(f"published {result.record.filename} to {result.record.variant} "
                   f"in {result.seconds:.0f} s")


@click.command("workers")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per worker.")
@click.option("--this-host", is_flag=True,
              help="Only this host's workers; exit 1 if there is none (for healthchecks).")
def workers_command(as_json: bool, this_host: bool) -> None:
    """List the live build workers and what they can build."""
    import redis

    config = Config.from_env()
    if not config.redis_url:
        raise click.ClickException("WHEELHOUSE_REDIS_URL is not set")
    conn = redis.Redis.from_url(config.redis_url, socket_timeout=5, socket_connect_timeout=5)
    ads = live_workers(conn)
    if this_host:
        # A container healthcheck: healthy while a worker of this host keeps its heartbeat.
        ads = [ad for ad in ads if ad.hostname == socket.gethostname()]
        if not ads:
            raise click.ClickException(f"no live worker on {socket.gethostname()}")
    if as_json:
        for ad in ads:
            click.echo(ad.to_json())
        return
    if not ads:
        click.echo("no live workers")
        return
    now = time.time()
    for ad in ads:
        toolkits = ", ".join(t.release for t in ad.toolkits)
        job = ad.current_job or "idle"
        click.echo(f"{ad.name}  {ad.hostname} {ad.machine}  {ad.cores} cores  "
                   f"{ad.memory_bytes / 1024**3:.0f} GiB  toolkits {toolkits}  "
                   f"queues {' '.join(ad.queues)}  {job}  beat {now - ad.heartbeat_at:.0f}s ago")
