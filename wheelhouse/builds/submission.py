"""Submitting builds: the one way a spec becomes a queued job, for the API, the request form
and builds on a miss alike.

A published wheel is answered with its file name (no job is made), an existing job is joined,
and what would be queued is first checked against the live fleet (once per queue per call) and,
where asked, against the torch index. The build's deadline is the operator's
``WHEELHOUSE_BUILD_TIMEOUT`` (``Config.build_timeout``), read here and nowhere else. Refusals are
core errors (:class:`UnservableSpec`, :class:`TorchUnavailable`); the web decides how they read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wheelhouse.builds.fanout import (
    SplitRequest,
    load_request,
    record_request,
    request_id,
    request_state,
)
from wheelhouse.builds.fleet import explain_unservable
from wheelhouse.builds.queue import BuildState, enqueue_build, get_build, record_requester
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import UnservableSpec

if TYPE_CHECKING:
    from redis import Redis

    from wheelhouse.builds.torchindex import TorchIndex
    from wheelhouse.config import Config
    from wheelhouse.index.catalog import Catalog
    from wheelhouse.recipes.book import Recipe


@dataclass(frozen=True)
class Submitted:
    """One spec as submitted: its job (new or joined), or the wheel already published."""

    spec: BuildSpec
    job_id: str
    state: str
    created: bool
    wheel: str | None = None
    """For a wheel already published: its file name (no job is made)."""
    warning: str | None = None
    """Set when the torch index could not be asked (the build was queued unchecked)."""


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


@dataclass
class _Fleet:
    """The live-worker check of one call: the fleet is read once per queue, not per spec."""

    conn: Redis
    served: set[str] = field(default_factory=set)

    def require(self, spec: BuildSpec) -> None:
        if spec.queue_name in self.served:
            return
        why = explain_unservable(self.conn, spec)
        if why is not None:
            raise UnservableSpec(why)
        self.served.add(spec.queue_name)


def submit(conn: Redis, catalog: Catalog, config: Config, specs: Iterable[BuildSpec], *,
           rerun_failed: bool = False, torch: TorchIndex | None = None,
           by: str | None = None) -> list[Submitted]:
    """Enqueue each spec unless its wheel is published or its job exists; ``by`` (a token
    name) is kept as the requester of each build this call queues (``web.auth.may_cancel``).

    Raises :class:`UnservableSpec` when no live worker serves a spec that isn't published (all
    specs of one request share CUDA and CPU architecture, so that is all or none), and
    :class:`TorchUnavailable` when ``torch`` (the torch index check) answers that torch and
    CUDA does not exist.
    """
    return _submit(conn, catalog, config, specs, _Fleet(conn), rerun_failed=rerun_failed,
                   torch=torch, by=by)


def _submit(conn: Redis, catalog: Catalog, config: Config, specs: Iterable[BuildSpec],
            fleet: _Fleet, *, rerun_failed: bool, torch: TorchIndex | None,
            by: str | None) -> list[Submitted]:
    out = []
    for spec in specs:
        record = catalog.published_for(spec)
        if record is not None:
            out.append(Submitted(spec, spec.job_id, BuildState.BUILT.value, False, record.filename))
            continue
        # After the catalog, before anything queues: cheap, and it names what would serve.
        fleet.require(spec)
        warning = None
        if torch is not None:
            known = get_build(conn, spec.job_id)
            if known is None or (rerun_failed and known.state in (BuildState.FAILED,
                                                                  BuildState.CANCELLED)):
                warning = torch.check(spec.torch, spec.cuda)  # only what would be queued
        done = enqueue_build(conn, spec, rerun_failed=rerun_failed, require_worker=False,
                             timeout=config.build_timeout)
        if done.created and by is not None:
            record_requester(conn, done.job_id, by)
        out.append(Submitted(spec, done.job_id, done.state.value, done.created, warning=warning))
    return out


def split_archs_of(spec: BuildSpec, recipe: Recipe, split: bool | None) -> tuple[str, ...]:
    """The architectures to split ``spec`` into, or ``()`` to build it as one job: a split
    (asked for, else the recipe's ``split_archs``) of at least two architectures (the spec's,
    else the recipe's default)."""
    if not (recipe.split_archs if split is None else split):
        return ()
    archs = recipe.archs_for(spec.variant)
    return archs if len(archs) > 1 else ()


def submit_request(conn: Redis, catalog: Catalog, config: Config, specs: Iterable[BuildSpec],
                   recipe: Recipe, *, split: bool | None = None, rerun_failed: bool = False,
                   torch: TorchIndex | None = None,
                   by: str | None = None) -> list[Submitted | SubmittedSplit]:
    """:func:`submit` each spec, or, where it splits (:func:`split_archs_of`), each of its
    single-arch parts, and keep the request that ties them together."""
    fleet = _Fleet(conn)
    out: list[Submitted | SubmittedSplit] = []
    for spec in specs:
        archs = split_archs_of(spec, recipe, split)
        if not archs:
            out.extend(_submit(conn, catalog, config, [spec], fleet, rerun_failed=rerun_failed,
                               torch=torch, by=by))
            continue
        # A request made before keeps its parts, whatever the recipe's default is now.
        request = load_request(conn, request_id(spec)) or SplitRequest.create(spec, archs)
        parts = _submit(conn, catalog, config, request.part_specs(), fleet,
                        rerun_failed=rerun_failed, torch=torch, by=by)
        kept, recorded = record_request(conn, request)
        if recorded and by is not None:
            record_requester(conn, kept.id, by)
        out.append(SubmittedSplit(kept, parts, recorded))
    return out
