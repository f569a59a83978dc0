"""The compile step: MAX_JOBS, the compile cache, the compile in the sandbox under the memory
governor (halving MAX_JOBS once after an out-of-memory kill), the learned memory peaks, and the
one wheel taken out of what the build left.

What the build wrote is hostile input to the worker. The places here that read or write where
a build could write are single functions, called while none of its processes runs:
:func:`read_cache_stats`, :func:`push_cache_entries`, :func:`prepare_attempt` (what the worker
writes before an attempt, a retry's too) and :func:`take_wheel_out`; each goes through
:mod:`worker.sandbox.safefs` (by descriptor, never by path; docs/security.md, "The sandbox's edge").
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from wheelhouse.builds.facts import CompileCacheStats, MaxJobs
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.builds.maxjobs import GIB, decide, record_peaks, reserve_bytes
from wheelhouse.errors import BuildFailed, FailureKind, WheelhouseError
from wheelhouse.index import layout
from wheelhouse.index.storage import LocalStorage
from wheelhouse.retry import OOM_COMPILE
from worker import compilecache
from worker.buildenv import compile_env
from worker.capabilities import nvcc_version, usable_cores
from worker.failures import classify_log
from worker.sandbox import safefs
from worker.sandbox.takeout import take_wheel
from worker.steps.context import BuildContext
from worker.steps.venv import BuildVenv
from worker.supervision.governor import was_oom_killed
from worker.supervision.runner import Periodic, Runner


def choose_max_jobs(ctx: BuildContext, override: int | None) -> MaxJobs:
    """RAM-aware MAX_JOBS (:func:`wheelhouse.builds.maxjobs.decide`), or the caller's
    ``override``."""
    mem = psutil.virtual_memory()
    reserve = int(ctx.config.build_reserve_gib * GIB) or None
    jobs = decide(ctx.storage, recipe=ctx.recipe.name, project=ctx.spec.project,
                  cuda=ctx.spec.cuda,
                  recipe_per_thread=ctx.recipe.job_memory_bytes,
                  nvcc_threads=ctx.recipe.nvcc_threads, available=int(mem.available),
                  archs=ctx.recipe.targets_for(ctx.spec.variant),
                  total=int(mem.total), cores=usable_cores(), reserve=reserve)
    if override is not None:
        jobs = replace(jobs, jobs=override, reason=f"MAX_JOBS={override}: set by the caller")
    return jobs


def compile_wheel(ctx: BuildContext, run: Runner, src: Path, venv: BuildVenv,
                  toolkit: ToolkitInfo, jobs: MaxJobs) -> Path:
    """Compile ``src`` into one wheel; return the worker's copy of it.

    A compile killed for lack of memory is tried once more with half the jobs; any other
    failure is classified from the log (:func:`worker.failures.classify_log`).
    """
    cache = open_cache(ctx, run, toolkit)
    try:
        return _compile(ctx, run, src, venv, toolkit, jobs, cache)
    finally:
        if cache is not None:
            os.close(cache.lock)  # the project's cache directory is the next build's again


def _compile(ctx: BuildContext, run: Runner, src: Path, venv: BuildVenv, toolkit: ToolkitInfo,
             jobs: MaxJobs, cache: SharedCache | None) -> Path:
    attempt = 1
    while True:
        ctx.journal.phase("compile")
        ctx.say(jobs.reason)
        ctx.journal.measured(max_jobs=jobs)
        dist = ctx.workspace / "dist"
        # The compile sees its source at one path on every host (SOURCE_INSIDE, sandboxed):
        # nvcc's cache keys hold it.
        argv, env, cache = prepare_attempt(ctx, run.seen(src), venv, toolkit, jobs, cache,
                                           dist)
        began = ctx.log.size()  # this attempt's output is classified, never an earlier one's
        reserve = jobs.reserve_bytes or reserve_bytes(int(psutil.virtual_memory().total))
        # The compile writes the source tree, dist/ and, with the compile cache, the
        # server's runtime directory and the project's cache directory (docs/compiling.md).
        writable = [ctx.source_root, dist]
        read_only = [*venv.read_only, Path(toolkit.home), ctx.workspace / "probe-bin"]
        if cache is not None:
            writable.append(cache.cache.runtime_dir)
            read_only.append(cache.cache.tools)  # launchers and sccache: never the build's
        try:
            ran = run.sandboxed(
                argv, env=env, cwd=src, what="the compile", read_only=read_only,
                writable=writable, governor_reserve=reserve,
                shared=[cache.cache.directory] if cache is not None else [],
                periodic=pushing(ctx, cache))
            output = ctx.log.since(began, limit=400_000)  # the compile's, not the sync's
        finally:
            sync_cache(ctx, cache)
        if ran.returncode == 0:
            learn_peaks(ctx, ran.job_peaks)
            return take_wheel_out(ctx, dist)
        found = classify_log(output, ctx.spec,
                             oom=was_oom_killed(ran.returncode, output[-20_000:]))
        if found.kind is FailureKind.OOM:
            learn_peaks(ctx, ran.job_peaks)
            if attempt < OOM_COMPILE.attempts and jobs.jobs > 1:
                half = max(1, jobs.jobs // 2)
                ctx.say(f"{found.reason}; retrying once with MAX_JOBS={half}")
                jobs = replace(jobs, jobs=half, reason=f"MAX_JOBS={half}: halved after an "
                                                       f"out-of-memory kill ({jobs.reason})")
                attempt += 1
                continue
        raise found.error()


def prepare_attempt(ctx: BuildContext, src: Path, venv: BuildVenv, toolkit: ToolkitInfo,
                    jobs: MaxJobs, cache: SharedCache | None, dist: Path,
                    ) -> tuple[list[str], dict[str, str], SharedCache | None]:
    """Everything the worker writes before a compile attempt (an out-of-memory retry's too):
    the probe wrapper and TMPDIR (:func:`worker.buildenv.compile_env`), an empty ``dist``, the
    compile cache's launchers. An earlier attempt's build could write some of these places.
    ``src`` is the source where the compile sees it (:meth:`Runner.seen`). Return the
    compile's argv and environment, and the cache (None once it can't be used)."""
    env = compile_env(ctx.workspace, venv.python, toolkit, jobs, ctx.recipe, ctx.spec.variant,
                      seen_python=venv.seen)
    safefs.discard_tree(dist)  # an earlier attempt's, by descriptor
    argv = [str(venv.seen), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
            "--no-index", "-v", "-w", str(dist), str(src)]
    if cache is not None:
        try:
            argv = cache.cache.wrap(venv.seen, argv, nvcc=cache.nvcc, path=env["PATH"])
        except FileNotFoundError as exc:  # no host compiler to put it in front of
            ctx.say(f"compile cache off: {exc}")
            cache = None
    return argv, env, cache


def take_wheel_out(ctx: BuildContext, dist: Path) -> Path:
    """Copy the one wheel the compile left in ``dist`` to where the worker owns it.

    The sandbox's processes are all dead: only now is what it left read, and only a copy of
    one regular file leaves (:func:`worker.sandbox.takeout.take_wheel`).
    """
    return take_wheel(dist, ctx.workspace / "out")


def learn_peaks(ctx: BuildContext, peaks: tuple[int, ...]) -> None:
    """Store the compile jobs' peak memory, so the next MAX_JOBS for this project knows it
    (``peaks``: the compilers' own,
    :attr:`worker.supervision.governor.MemoryGovernor.compile_peaks`)."""
    if not peaks:
        return
    try:
        per_thread = record_peaks(ctx.storage, ctx.recipe.name, ctx.spec.project,
                                  ctx.spec.cuda, list(peaks), ctx.recipe.nvcc_threads,
                                  archs=ctx.recipe.targets_for(ctx.spec.variant),
                                  recipe_per_thread=ctx.recipe.job_memory_bytes)
    except (OSError, WheelhouseError) as exc:
        ctx.say(f"could not record memory statistics: {exc}")
        return
    ctx.journal.measured(peak_job_bytes=max(peaks))
    ctx.say(f"peak compile job: {max(peaks) / GIB:.2f} GiB "
            f"({(per_thread or 0) / GIB:.2f} GiB per nvcc thread)")


# -- the compile cache ---------------------------------------------------------------------


@dataclass(frozen=True)
class SharedCache:
    """This build's compile cache, and what it shares through storage."""

    cache: compilecache.CompileCache
    lock: int
    """This host's lock on the project's cache directory, held until the compile step ends."""
    nvcc: Path | None
    """The nvcc it caches (None: only the host compiler)."""
    known: set[str] | None
    """The entries storage holds (None: nothing is shared through storage); an out-of-memory
    retry pushes only what it adds."""
    fetched: int = 0
    """How many entries were fetched from storage before the compile."""


def open_cache(ctx: BuildContext, run: Runner, toolkit: ToolkitInfo) -> SharedCache | None:
    """This build's compile cache, its entries pulled from storage; None when off, or when
    another build on this host uses the project's cache directory now (builds have their own
    uids, so one build at a time writes it)."""
    if not ctx.config.compile_cache:
        return None
    sccache = compilecache.find_sccache()
    version = compilecache.sccache_version(sccache) if sccache is not None else None
    if sccache is None or version is None:
        ctx.say("compile cache off: sccache is not installed on the worker")
        return None
    space = compilecache.namespace(ctx.spec.project, ctx.spec.cuda)
    limit = int(ctx.config.compile_cache_max_gib * GIB)
    backend = compilecache.DiskBackend(Path(ctx.config.workspace).resolve() / "sccache",
                                       size=f"{max(1, limit // (1024 ** 2))}M")
    lock = _lock_cache(backend.path(space))
    if lock is None:
        ctx.say(f"compile cache off: another build on this host uses {space}'s cache now")
        return None
    # The build's tools directory (launchers, sccache), which the sandbox mounts read-only:
    # sccache is a copy there, as a hard link would share the worker's own binary.
    tools = ctx.workspace / "sccache-tools"
    tools.mkdir(exist_ok=True)
    inside = tools / "sccache"
    shutil.copy2(sccache, inside)
    cache = compilecache.CompileCache(
        inside, backend, space, ctx.workspace / "sccache",
        basedirs=[ctx.workspace, run.seen(ctx.source_root)], tools_dir=tools,
        log_level=ctx.config.compile_cache_log_level)
    sandbox = run.sandbox
    owner = (sandbox.uid, sandbox.gid) if sandbox is not None and sandbox.as_root else None
    fetched, known = pull_cache_entries(ctx, cache, owner=owner, max_bytes=limit)
    nvcc = nvcc_version(Path(toolkit.nvcc))
    mm = tuple(int(p) for p in nvcc[0].split(".")) if nvcc else (0, 0)
    cacheable, line = compilecache.nvcc_cacheable(version, (mm[0], mm[1]))
    ctx.say(f"compile cache: {line}")
    return SharedCache(cache, lock, Path(toolkit.nvcc) if cacheable else None, known, fetched)


def _lock_cache(directory: Path) -> int | None:
    """This host's lock on a project's cache directory, or None while another build holds it."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory.with_name(directory.name + ".lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def pull_cache_entries(ctx: BuildContext, cache: compilecache.CompileCache, *,
                       owner: tuple[int, int] | None, max_bytes: int,
                       ) -> tuple[int, set[str] | None]:
    """Fetch the namespace's entries from storage (not with local storage: the host's cache
    is the cache); return how many were fetched and the names storage holds (None when
    nothing is shared)."""
    if isinstance(ctx.storage, LocalStorage):
        return 0, None
    try:
        fetched, known = ctx.retried(
            "fetching the compile cache",
            lambda: compilecache.pull(ctx.storage, cache.space, cache.directory, owner=owner,
                                      max_bytes=max_bytes))
    except BuildFailed as exc:  # the cache is an optimization: build without the pull
        ctx.say(f"compile cache not fetched from storage: {exc.reason}")
        return 0, None
    ctx.say(f"compile cache: {fetched} of {len(known)} entries fetched from storage "
            f"({layout.compile_cache_prefix(cache.space)})")
    return fetched, known


def sync_cache(ctx: BuildContext, shared: SharedCache | None) -> None:
    """After a compile: record the cache's statistics; share its new entries through storage."""
    if shared is None:
        return
    tidied = compilecache.tidy(shared.cache.directory,
                               max_bytes=int(ctx.config.compile_cache_max_gib * GIB))
    if tidied.dropped or tidied.stripped or tidied.evicted:
        ctx.say(f"compile cache on this host: {tidied.dropped} things not of sccache's layout "
                f"removed, {tidied.stripped} setuid/setgid bits cleared, {tidied.evicted} oldest "
                "entries evicted (WHEELHOUSE_COMPILE_CACHE_MAX_GIB)")
    stats = read_cache_stats(shared.cache)
    if stats is not None:
        stats = replace(stats, fetched=shared.fetched)
        ctx.journal.measured(compile_cache=stats)
        ctx.say(f"compile cache: {stats.hits} hits, {stats.misses} misses "
                f"({stats.hit_rate:.0%}), {stats.errors} errors")
    if shared.known is not None:
        push_cache_entries(ctx, shared.cache, shared.known)


#: How often the compile cache's new entries go to storage while the compile runs, and how
#: long an entry must have been left alone to go: a worker that dies mid-compile (killed,
#: its host lost) leaves what it finished to the build's next attempt, on any worker.
#: sccache's disk cache writes an entry in place, from memory, in one ``write_all``
#: (``LruDiskCache::insert_bytes``, read in an older revision of its source, not checked
#: against 0.16.0): an entry left alone for 2 s should be whole. By design (not measured), a
#: SIGKILL loses at most the last ~12 s of finished compiles (30 s and 5 s until 2026-12-07).
PUSH_EVERY = 10.0
PUSH_SETTLED = 2.0


def pushing(ctx: BuildContext, shared: SharedCache | None) -> Periodic | None:
    """The push of new cache entries during the compile (issue 31), or None without a shared
    cache."""
    if shared is None or shared.known is None:
        return None
    known = shared.known
    return Periodic(PUSH_EVERY, lambda: push_cache_entries(ctx, shared.cache, known,
                                                           settled=PUSH_SETTLED, quiet=True))


def read_cache_stats(cache: compilecache.CompileCache) -> CompileCacheStats | None:
    """The statistics the cache's wrapper wrote in the build's runtime directory, or None."""
    return cache.read_stats()


def push_cache_entries(ctx: BuildContext, cache: compilecache.CompileCache,
                       known: set[str], *, settled: float = 0.0, quiet: bool = False) -> None:
    """Upload the entries the compile added (not in ``known``, which grows by them); with
    ``quiet`` (a push while the compile runs) said only when it stored some, and not evicted."""
    limit = int(ctx.config.compile_cache_max_gib * GIB)
    try:
        sent = ctx.retried("storing the compile cache",
                           lambda: compilecache.push(ctx.storage, cache.space, cache.directory,
                                                     known, scratch=ctx.workspace / "sccache-push",
                                                     max_bytes=limit, settled=settled))
    except BuildFailed as exc:
        ctx.say(f"compile cache not stored: {exc.reason}")
        return
    known |= sent
    if quiet:
        if sent:
            ctx.say(f"compile cache: {len(sent)} entries stored while compiling")
        return
    ctx.say(f"compile cache: {len(sent)} new entries stored")
    try:
        evicted = compilecache.evict(ctx.storage, cache.space, limit)
    except (OSError, WheelhouseError) as exc:  # e.g. worker credentials that can't delete
        ctx.say(f"compile cache not evicted in storage: {exc}")
        return
    if evicted:
        ctx.say(f"compile cache: {evicted} oldest entries evicted from storage "
                "(WHEELHOUSE_COMPILE_CACHE_MAX_GIB)")
