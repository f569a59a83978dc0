"""Issue 20: a split request runs in parallel on several workers and publishes one wheel per
architecture.

Real parts throughout: Redis, ``wheelhouse serve`` (gunicorn), two ``wheelhouse worker``
processes (each its own workspace, as two hosts would have) and sandboxed builds of the C
extension fixture, which holds sm_80 or sm_90 device code as the recipe's
``TORCH_CUDA_ARCH_LIST`` asks (no nvcc, so the builds take seconds). Parallelism is shown by
the RQ jobs' own times, never by a timed assertion: both parts built on different workers, and
each part started before the other ended.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
import requests

from tests.helpers import build_job, fake_cuda_toolkit, run_worker, start_index
from tests.worker.conftest import FIXTURES, SANDBOXED_BUILDS, build_config, make_sdist
from wheelhouse.builds.fanout import part_spec, request_id
from wheelhouse.builds.fleet import live_workers
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.index.tokens import create_token

pytestmark = SANDBOXED_BUILDS

WHOLE = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                         archs=["sm80", "sm90"])


def _cext_sdist(tmp_path: Path) -> Path:
    """The C extension as an sdist that sleeps a little in its build (``build-options.json``):
    the margin by which each part is still building when the other starts."""
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "build-options.json").write_text(json.dumps({"sleep": 5}))
    return make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")


def _wait(what: str, check: Any, timeout: float, *logs: Path) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        tails = "\n".join(f"{log.name}:\n{log.read_text()[-2000:]}" for log in logs
                          if log.exists())
        assert time.monotonic() < deadline, f"{what}\n{tails}"
        time.sleep(0.5)
    return found


def test_a_split_request_builds_its_parts_side_by_side_and_publishes_one_wheel_each(
        tmp_path: Path, redis_url: str) -> None:
    config = replace(build_config(tmp_path), redis_url=redis_url, upstream="off",
                     torch_check=False, worker_heartbeat_seconds=1,
                     catalog_refresh_seconds=0.2)
    conn = redis.Redis.from_url(redis_url)
    headers = {"Authorization": f"Bearer {create_token(conn, 'fanout')}"}
    env = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")),
           "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    sdist = _cext_sdist(tmp_path)

    with start_index(config, tmp_path, workers=2) as url, \
            run_worker(replace(config, workspace=str(tmp_path / "work-a")), "gpu-a", logs[0],
                       "--cuda", "13.0", extra_env=env), \
            run_worker(replace(config, workspace=str(tmp_path / "work-b")), "gpu-b", logs[1],
                       "--cuda", "13.0", extra_env=env):
        _wait("both workers advertise", lambda: len(live_workers(conn)) == 2, 60, *logs)
        with sdist.open("rb") as body:
            put = requests.put(f"{url}/api/sources/{sdist.name}", data=body, headers=headers,
                               timeout=30)
        assert put.status_code == 201, put.text
        source = {"sha256": put.json()["sha256"], "filename": sdist.name}
        resp = requests.post(f"{url}/api/builds", headers=headers, timeout=30, json={
            "project": "cext", "version": "0.1.0", "torch": "2.14", "cuda": "13.0",
            "python": ["3.11"], "archs": ["sm80", "sm90"], "split_archs": True,
            "source": source})
        assert resp.status_code == 201, resp.text
        [req] = resp.json()["builds"]
        whole = WHOLE.with_source(source)
        assert req["id"] == request_id(whole)
        parts = {p["arch"]: p["id"] for p in req["parts"]}
        assert parts == {a: part_spec(whole, a).job_id for a in ("80", "90")}

        view = _wait("the request ends", lambda: (v := requests.get(
            f"{url}/api/builds/{req['id']}", headers=headers, timeout=10).json())["finished"]
            and v, 600, *logs)
        assert view["state"] == "built", (view, *(log.read_text()[-3000:] for log in logs))

        jobs = {arch: build_job(conn, job_id) for arch, job_id in parts.items()}
        # Each part on its own worker, and running at the same time: each started before the
        # other ended.
        assert {job.worker_name for job in jobs.values()} == {"gpu-a", "gpu-b"}
        a, b = jobs["80"], jobs["90"]
        assert a.started_at is not None and b.started_at is not None
        assert a.ended_at is not None and b.ended_at is not None
        assert a.started_at < b.ended_at and b.started_at < a.ended_at

        # One single-arch wheel per part, each in its own -smXX root (and with its sm_XX
        # device code alone), and both at the variant-wheels root /simple/.
        wheels = {p["arch"]: p["wheel"] for p in view["parts"]}
        for arch in ("80", "90"):
            assert wheels[arch] == part_spec(whole, arch).expected_wheel_name
            assert f".sm{arch}-cp311" in wheels[arch]
            page = _wait(f"sm{arch} is listed", lambda arch=arch: (r := requests.get(
                f"{url}/torch2.14-cu130-sm{arch}/simple/cext/", timeout=10)).ok and r.text, 30)
            assert wheels[arch] in page
            part = requests.get(f"{url}/api/builds/{parts[arch]}", headers=headers,
                                timeout=10).json()
            assert part["device_code"].split(" ")[0] == f"sm_{arch}"  # its own SASS alone
        plain = requests.get(f"{url}/simple/cext/", timeout=10).text
        assert "sm80" in plain and "sm90" in plain
