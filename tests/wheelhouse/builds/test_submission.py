"""Submitting builds against a real Redis and a real catalog: what is queued, with which
deadline, and what the live fleet is asked."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from tests.helpers import build_job, make_wheel
from wheelhouse.builds import fleet
from wheelhouse.builds.queue import RQ_TIMEOUT_MARGIN, get_build, requester_of
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.builds.submission import SubmittedSplit, split_archs_of, submit, submit_request
from wheelhouse.config import Config
from wheelhouse.errors import UnservableSpec
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import LocalStorage
from wheelhouse.recipes.book import Recipe


def _spec(python: str = "3.12", archs: tuple[str, ...] = ("80", "90")) -> BuildSpec:
    return BuildSpec.create("flash-attn", "2.8.3", python=python, torch="2.8", cuda="12.8",
                            archs=archs)


def advertise_worker(conn: Redis) -> None:
    """A live worker with CUDA 12.8 on x86_64, as ``wheelhouse worker`` advertises it."""
    toolkit = fleet.ToolkitInfo(cuda="12.8", home="/usr/local/cuda-12.8", nvcc="nvcc")
    fleet.advertise(conn, fleet.WorkerAd(name="gpu-1", hostname="gpu1", machine="x86_64",
                                         cores=64, memory_bytes=512 * 1024**3,
                                         toolkits=(toolkit,),
                                         queues=fleet.queues_for(["12.8"], "x86_64")), ttl=120)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config(storage=str(tmp_path / "data"), build_timeout=1234)


@pytest.fixture
def catalog(config: Config) -> Catalog:
    return Catalog(LocalStorage(Path(config.storage)), refresh_seconds=0)


@pytest.mark.parametrize("split", [False, True])
def test_every_job_gets_the_operators_deadline(conn: Redis, config: Config, catalog: Catalog,
                                               split: bool) -> None:
    """WHEELHOUSE_BUILD_TIMEOUT is read here, from the config, for each job queued."""
    advertise_worker(conn)
    [made] = submit_request(conn, catalog, config, [_spec()], Recipe("generic"), split=split)
    ids = [p.job_id for p in made.parts] if isinstance(made, SubmittedSplit) else [made.job_id]
    assert len(ids) == (2 if split else 1)
    for job_id in ids:
        job = build_job(conn, job_id)
        assert job.args[2] == 1234  # the worker's own deadline
        assert job.timeout == 1234 + RQ_TIMEOUT_MARGIN


def test_the_fleet_is_asked_once_per_request(conn: Redis, config: Config, catalog: Catalog,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every spec of one request is of one queue: one look at the live workers serves them all
    (the queue's own check is not repeated)."""
    advertise_worker(conn)
    asked = []
    real = fleet.live_workers

    def counted(c: Redis) -> list[fleet.WorkerAd]:
        asked.append(1)
        return real(c)

    monkeypatch.setattr(fleet, "live_workers", counted)
    made = submit_request(conn, catalog, config, [_spec("3.11"), _spec("3.12")],
                          Recipe("generic"), split=True)
    assert [len(m.parts) for m in made if isinstance(m, SubmittedSplit)] == [2, 2]
    assert len(asked) == 1


def test_no_live_worker_queues_nothing(conn: Redis, config: Config, catalog: Catalog) -> None:
    with pytest.raises(UnservableSpec, match="no build worker is running"):
        submit(conn, catalog, config, [_spec()])
    assert get_build(conn, _spec().job_id) is None


def test_a_published_wheel_needs_no_worker_and_makes_no_job(
        conn: Redis, config: Config, catalog: Catalog, tmp_path: Path) -> None:
    spec = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8")
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(spec.wheel_version),
                       tag="cp311-cp311-linux_x86_64")
    publish(catalog.storage, wheel, spec.variant)
    [done] = submit(conn, catalog, config, [spec])
    assert (done.state, done.created, done.wheel) == ("built", False, wheel.name)
    assert get_build(conn, spec.job_id) is None


def test_the_requester_is_kept_for_what_this_call_queued(
        conn: Redis, config: Config, catalog: Catalog) -> None:
    advertise_worker(conn)
    [first] = submit(conn, catalog, config, [_spec()], by="alice")
    [again] = submit(conn, catalog, config, [_spec()], by="mallory")
    assert first.created and not again.created and again.job_id == first.job_id
    assert requester_of(conn, first.job_id) == "alice"


def test_a_split_is_asked_for_or_the_recipes_and_needs_two_archs() -> None:
    two, one = _spec(archs=("80", "90")), _spec(archs=("90",))
    assert split_archs_of(two, Recipe("generic"), None) == ()
    assert split_archs_of(two, Recipe("generic", split_archs=True), None) == ("80", "90")
    assert split_archs_of(two, Recipe("generic", split_archs=True), False) == ()
    assert split_archs_of(two, Recipe("generic"), True) == ("80", "90")
    assert split_archs_of(one, Recipe("generic"), True) == ()
    # No archs asked for: the recipe's default ones.
    assert split_archs_of(_spec(archs=()), Recipe("generic", default_archs=("80", "90")),
                          True) == ("80", "90")
