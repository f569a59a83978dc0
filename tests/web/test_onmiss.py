"""Build on miss: an installer whose Python has no wheel gets one enqueued, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis

from tests.helpers import build_job, make_wheel
from tests.web.buildhelpers import advertise_worker, make_app
from tests.worker.conftest import FIXTURE_RECIPES
from web.onmiss import installer_python
from wheelhouse.builds import queue as q
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"


def _agent(python: str, name: str = "uv/0.13.9", cpu: str = "x86_64") -> str:
    return name + " " + json.dumps({"installer": {"name": name.split("/")[0]},
                                    "python": python, "cpu": cpu})


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        (_agent("3.11.7"), ("3.11", "x86_64")),
        (_agent("3.12.1", "pip/23.2"), ("3.12", "x86_64")),
        ("curl/7.88.1", None),
        ("uv/0.13.9 {not json", None),
        ("pip/23.2 " + json.dumps({"python": "three"}), None),
        ("pip/23.2 {" + "x" * 5000 + "}", None),
    ],
)
def test_installer_python(agent: str, expected: tuple[str, str] | None) -> None:
    assert installer_python(agent) == expected


def _publish_cp312(config_storage: str, tmp_path: Path,
                   tag: str = "cp312-cp312-linux_x86_64") -> None:
    variant = parse_variant(VARIANT)
    w = make_wheel(tmp_path / "w", "cudaext", f"0.1.0+{variant.local_label}", tag=tag)
    from wheelhouse.config import Config

    publish(open_storage(Config(storage=config_storage)), w, variant)


def test_missing_python_is_enqueued_once(redis_url: str, conn: Redis, tmp_path: Path) -> None:
    """Enqueued as every other build is (``wheelhouse.builds.submission``): with the operator's
    WHEELHOUSE_BUILD_TIMEOUT as its deadline."""
    app = make_app(redis_url, tmp_path, build_on_miss=True, recipe_dirs=str(FIXTURE_RECIPES),
                   build_timeout=1234)
    _publish_cp312(str(tmp_path / "data"), tmp_path)
    advertise_worker(conn, cuda="12.8")
    client = app.test_client()
    page = f"/{VARIANT}/simple/cudaext/"
    for _ in range(3):  # the page answers at once, every time
        resp = client.get(page, headers={"User-Agent": _agent("3.11.7")})
        assert resp.status_code == 200
        assert "cudaext-0.1.0+cu128torch2.8-cp312" in resp.get_data(as_text=True)
    jobs = [k.decode() for k in conn.keys("rq:job:*")]
    assert len(jobs) == 1, jobs
    status = q.get_build(conn, jobs[0].removeprefix("rq:job:"))
    assert status is not None and status.state is q.BuildState.QUEUED
    assert status.spec is not None
    assert status.spec.python == "3.11" and status.spec.project == "cudaext"
    job = build_job(conn, status.job_id)
    assert job.args[2] == 1234 and job.timeout == 1234 + q.RQ_TIMEOUT_MARGIN
    # The Python that has a wheel enqueues nothing.
    client.get(page, headers={"User-Agent": _agent("3.12.0")})
    assert len(conn.keys("rq:job:*")) == 1


@pytest.mark.parametrize("setting", [{"build_on_miss": False}, {"recipe_dirs": ""}])
def test_off_by_default_and_only_for_recipes(redis_url: str, conn: Redis, tmp_path: Path,
                                             setting: dict[str, object]) -> None:
    values: dict[str, object] = {"build_on_miss": True, "recipe_dirs": str(FIXTURE_RECIPES)}
    values.update(setting)
    app = make_app(redis_url, tmp_path, **values)
    _publish_cp312(str(tmp_path / "data"), tmp_path)
    advertise_worker(conn, cuda="12.8")
    resp = app.test_client().get(f"/{VARIANT}/simple/cudaext/",
                                 headers={"User-Agent": _agent("3.11.7")})
    assert resp.status_code == 200
    assert conn.keys("rq:job:*") == []


def test_no_worker_no_build_and_the_page_still_answers(redis_url: str, conn: Redis,
                                                       tmp_path: Path) -> None:
    app = make_app(redis_url, tmp_path, build_on_miss=True, recipe_dirs=str(FIXTURE_RECIPES))
    _publish_cp312(str(tmp_path / "data"), tmp_path)
    resp = app.test_client().get(f"/{VARIANT}/simple/cudaext/",
                                 headers={"User-Agent": _agent("3.11.7")})
    assert resp.status_code == 200
    assert conn.keys("rq:job:*") == []


@pytest.mark.parametrize(
    ("tag", "python", "cpu", "enqueued"),
    [
        # A stable-ABI wheel serves its CPython and newer ones, not older ones.
        ("cp312-abi3-linux_x86_64", "3.13.1", "x86_64", False),
        ("cp312-abi3-linux_x86_64", "3.11.7", "x86_64", True),
        # A wheel for another CPU serves nobody on this one.
        ("cp311-cp311-linux_x86_64", "3.11.7", "aarch64", True),
        ("cp311-cp311-manylinux_2_28_aarch64", "3.11.7", "aarch64", False),
    ],
)
def test_which_wheel_serves_the_installer_is_the_build_spec_rule(
        redis_url: str, conn: Redis, tmp_path: Path, tag: str, python: str, cpu: str,
        enqueued: bool) -> None:
    app = make_app(redis_url, tmp_path, build_on_miss=True, recipe_dirs=str(FIXTURE_RECIPES))
    _publish_cp312(str(tmp_path / "data"), tmp_path, tag)
    advertise_worker(conn, cuda="12.8", machine=cpu)
    resp = app.test_client().get(f"/{VARIANT}/simple/cudaext/",
                                 headers={"User-Agent": _agent(python, cpu=cpu)})
    assert resp.status_code == 200
    jobs = [k.decode().removeprefix("rq:job:") for k in conn.keys("rq:job:*")]
    assert bool(jobs) is enqueued, jobs
    if enqueued:
        status = q.get_build(conn, jobs[0])
        assert status is not None
        assert status.spec is not None
        assert (status.spec.python, status.spec.machine) == (python[:4], cpu)


def test_plain_root_builds_for_the_installers_python(redis_url: str, conn: Redis,
                                                     tmp_path: Path) -> None:
    """From ``/simple/``: every variant the project is published in, for the User-Agent's
    Python (uv sends no GPU properties, so no variant is preferred)."""
    app = make_app(redis_url, tmp_path, build_on_miss=True, recipe_dirs=str(FIXTURE_RECIPES))
    variant = parse_variant(VARIANT)
    w = make_wheel(tmp_path / "w", "cudaext", f"0.1.0+{variant.local_label}",
                   tag="cp312-cp312-linux_x86_64")
    facts = BuildFacts(device_code={"cudaext/_C.so": {"sass": ["80"], "ptx": []}})
    publish(open_storage(Config(storage=str(tmp_path / "data"))), w, variant, build=facts)
    advertise_worker(conn, cuda="12.8")
    client = app.test_client()
    resp = client.get("/simple/cudaext/", headers={"User-Agent": _agent("3.11.7")})
    assert resp.status_code == 200
    assert "cudaext-0.1.0+pt28-cp312-cp312-linux_x86_64-cu128sm80.whl" in resp.text
    [job] = [k.decode().removeprefix("rq:job:") for k in conn.keys("rq:job:*")]
    status = q.get_build(conn, job)
    assert status is not None
    assert status.spec is not None
    assert (status.spec.python, status.spec.torch, status.spec.cuda) == (
        "3.11", "2.8", "12.8")
