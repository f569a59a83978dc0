"""The build pipeline: sdist → patches → fresh venv → compile (cached) under supervision →
checked wheel (device code, load check) → published.

This module is the spine: :func:`run_build` tells the build as its steps
(:mod:`worker.steps`), each a function over the build's
:class:`~worker.steps.context.BuildContext` that returns what it made. Every program a step
runs goes through :class:`worker.supervision.runner.Runner` (deadline, cancel, memory governor,
disk cap,
sandbox); what the build reports goes through one stream of events (:mod:`worker.events`).

Who runs what: the worker, with its network and identity, fetches the sdist (hashed,
size-capped: opaque bytes) and installs the build venv from wheels only (``--no-build``: no sdist
is ever built out here). Every parse of the attacker's bytes (unpacking the sdist, applying the
recipe's patches, reading and rewriting the wheel, its ELF sections, installing it for the load
check) runs in the build sandbox as the build's uid (:mod:`worker.sandbox.untrusted`), and so does
everything that executes code the sdist wrote or chose (its build requirements' ``.pth`` files
run at every interpreter start): the torch check, the compile and the load check. What leaves a
sandbox is a JSON report and files copied out by descriptor (:mod:`worker.sandbox.safefs`), which
the
worker re-checks before publishing them (:mod:`worker.steps.checks`).
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from wheelhouse.builds.facts import BuildFacts, MaxJobs
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind, InfrastructureError, StorageError
from wheelhouse.index.catalog import Record
from wheelhouse.index.storage import Storage
from wheelhouse.retry import BUILD_STEPS, RetryPolicy
from worker.errors import SandboxUnavailable
from worker.events import Reporter
from worker.sandbox import safefs
from worker.steps.checks import check_wheel
from worker.steps.compile import choose_max_jobs, compile_wheel
from worker.steps.context import BuildContext
from worker.steps.publish import already_published, log_key, publish_wheel, store_log
from worker.steps.source import unpacked
from worker.steps.toolkit import choose_toolkit
from worker.steps.venv import create_venv
from worker.supervision.reaper import unique_build_id
from worker.supervision.runner import Runner


@dataclass(frozen=True)
class BuildResult:
    spec: BuildSpec
    record: Record
    already_published: bool = False
    max_jobs: MaxJobs | None = None
    log_key: str | None = None
    seconds: float = 0.0
    build: BuildFacts = field(default_factory=BuildFacts)


def run_build(
    spec: BuildSpec,
    *,
    config: Config,
    storage: Storage,
    reporter: Reporter | None = None,
    source: Path | None = None,
    timeout: float | None = None,
    build_id: str | None = None,
    max_jobs: int | None = None,
    toolkits: list[ToolkitInfo] | None = None,
    keep_workspace: bool = False,
    retry: RetryPolicy = BUILD_STEPS,
) -> BuildResult:
    """Build ``spec`` and publish it; raise :class:`BuildFailed` with a classified reason.

    ``build_id`` names the build (the fleet's prefix and the RQ job id in the worker, the
    spec's job id by default); a random suffix makes the cookie every process of the build
    carries unique (:func:`worker.supervision.reaper.unique_build_id`), so two builds of one spec
    on one
    host never take each other's processes for strays. ``toolkits`` defaults to what this host
    has; ``retry`` is the policy of the steps that talk to the network and storage.
    """
    ctx = BuildContext.create(spec, config=config, storage=storage,
                              reporter=reporter or Reporter(),
                              build_id=unique_build_id(build_id or spec.job_id), retry=retry,
                              keep_workspace=keep_workspace)
    started = time.monotonic()
    try:
        return _build(ctx, started=started,
                      timeout=float(timeout if timeout is not None else config.build_timeout),
                      source=source, max_jobs=max_jobs, toolkits=toolkits)
    except SandboxUnavailable as exc:
        raise _failed(ctx, BuildFailed(FailureKind.SANDBOX_UNAVAILABLE, str(exc)),
                      started) from exc
    except (StorageError, InfrastructureError) as exc:
        # Storage trouble outside a retried step (e.g. the learned memory figures): the
        # same class of failure as a retried step that ran out of attempts.
        raise _failed(ctx, BuildFailed(FailureKind.INFRASTRUCTURE, str(exc)), started) from exc
    except BuildFailed as exc:
        _failed(ctx, exc, started)
        raise
    finally:
        if not keep_workspace:
            safefs.discard_tree(ctx.workspace)  # the build wrote in it: by descriptor


def _build(ctx: BuildContext, *, started: float, timeout: float, source: Path | None,
           max_jobs: int | None, toolkits: list[ToolkitInfo] | None) -> BuildResult:
    """The build's story, step by step."""
    existing = already_published(ctx)
    if existing is not None:
        ctx.journal.phase("published")
        return BuildResult(ctx.spec, existing, already_published=True)
    ctx.say(f"building {ctx.spec.describe()} with recipe {ctx.recipe.name}")
    # The runner holds the build's uid until the build's processes are all gone.
    with closing(Runner.start(ctx, deadline=started + timeout, timeout=timeout)) as run:
        toolkit = choose_toolkit(ctx, toolkits)
        with unpacked(ctx, run, source) as src:
            venv = create_venv(ctx, run, src.path)
            jobs = choose_max_jobs(ctx, max_jobs)
            wheel = compile_wheel(ctx, run, src.path, venv, toolkit, jobs)
            checked = check_wheel(ctx, run, wheel, venv, src.patches)
            record = publish_wheel(ctx, checked, seconds=time.monotonic() - started)
    ctx.journal.end_step()
    ctx.journal.measured(seconds=round(time.monotonic() - started, 1))
    store_log(ctx)
    return BuildResult(ctx.spec, record, max_jobs=jobs, log_key=log_key(ctx.spec),
                       seconds=time.monotonic() - started, build=ctx.journal.facts)


def _failed(ctx: BuildContext, exc: BuildFailed, started: float) -> BuildFailed:
    """Say why in the log, store it, and give the failure what the build measured."""
    ctx.say(f"FAILED [{exc.kind.value}]: {exc.reason}")
    store_log(ctx)
    ctx.journal.end_step()
    ctx.journal.measured(seconds=round(time.monotonic() - started, 1))
    exc.facts = ctx.journal.facts
    return exc
