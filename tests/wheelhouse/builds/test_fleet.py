"""The fleet's adverts: workers whose workspaces differ share no nvcc cache entries (issue 31)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace

from redis import Redis

from wheelhouse.builds import fleet
from wheelhouse.config import Config

TOOLKIT = fleet.ToolkitInfo(cuda="13.0", home="/usr/local/cuda-13.0", nvcc="nvcc",
                            release="V13.0.88")
AD = fleet.WorkerAd(name="gpu-1", hostname="gpu1", machine="x86_64", cores=16,
                    memory_bytes=128 * 1024**3, toolkits=(TOOLKIT,),
                    queues=fleet.queues_for(["13.0"], "x86_64"))


def _at(name: str, workspace: str | None) -> fleet.WorkerAd:
    extra = {"pid": 1} if workspace is None else {"pid": 1, "workspace": workspace}
    return replace(AD, name=name, hostname=name, extra=extra)


def test_one_workspace_path_says_nothing() -> None:
    assert fleet.workspaces_differ([_at("gpu-1", "/work"), _at("gpu-2", "/work")]) is None
    # An older worker's advert names no workspace: nothing to compare it with.
    assert fleet.workspaces_differ([_at("gpu-1", "/work"), _at("old", None)]) is None
    assert fleet.workspaces_differ([]) is None


def test_different_workspace_paths_are_named_with_their_workers() -> None:
    note = fleet.workspaces_differ([_at("gpu-2", "/srv/ws"), _at("gpu-1", "/work"),
                                    _at("gpu-3", "/work"), _at("old", None)])
    assert note is not None
    assert "(/srv/ws: gpu-2; /work: gpu-1, gpu-3)" in note
    assert "WHEELHOUSE_WORKSPACE" in note and "old" not in note


def test_the_workers_command_warns_when_workspaces_differ(conn: Redis, redis_url: str) -> None:
    env = {**os.environ, **Config(redis_url=redis_url).to_env()}
    fleet.advertise(conn, _at("gpu-1", "/work"), ttl=120)
    fleet.advertise(conn, _at("gpu-2", "/work"), ttl=120)
    same = subprocess.run(["wheelhouse", "workers"], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    assert "gpu-1" in same.stdout and "gpu-2" in same.stdout
    assert "warning" not in same.stdout

    fleet.advertise(conn, _at("gpu-3", "/home/ci/wheelhouse-work"), ttl=120)
    split = subprocess.run(["wheelhouse", "workers"], capture_output=True, text=True, env=env,
                           timeout=60, check=True)
    assert ("warning: workers build under different workspaces "
            "(/home/ci/wheelhouse-work: gpu-3; /work: gpu-1, gpu-2)") in split.stdout
