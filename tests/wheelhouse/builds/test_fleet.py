"""The fleet's adverts: workers whose builds see their sources at different paths share no nvcc
cache entries (issue 31)."""

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


def _at(name: str, source: str | None) -> fleet.WorkerAd:
    extra = {"pid": 1} if source is None else {"pid": 1, "source_path": source}
    return replace(AD, name=name, hostname=name, extra=extra)


SANDBOXED = "/wheelhouse/src"


def test_one_source_path_says_nothing() -> None:
    assert fleet.source_paths_differ([_at("gpu-1", SANDBOXED),
                                      _at("gpu-2", SANDBOXED)]) is None
    # An older worker's advert names no path: nothing to compare it with.
    assert fleet.source_paths_differ([_at("gpu-1", SANDBOXED), _at("old", None)]) is None
    assert fleet.source_paths_differ([]) is None


def test_different_source_paths_are_named_with_their_workers() -> None:
    # Two unsandboxed workers with different workspaces, and sandboxed ones.
    note = fleet.source_paths_differ([_at("gpu-2", "/srv/ws/src"), _at("gpu-1", SANDBOXED),
                                      _at("gpu-3", SANDBOXED), _at("old", None)])
    assert note is not None
    assert "(/srv/ws/src: gpu-2; /wheelhouse/src: gpu-1, gpu-3)" in note
    assert "WHEELHOUSE_WORKSPACE" in note and "old" not in note


def test_the_workers_command_warns_when_source_paths_differ(conn: Redis,
                                                            redis_url: str) -> None:
    env = {**os.environ, **Config(redis_url=redis_url).to_env()}
    fleet.advertise(conn, _at("gpu-1", SANDBOXED), ttl=120)
    fleet.advertise(conn, _at("gpu-2", SANDBOXED), ttl=120)
    same = subprocess.run(["wheelhouse", "workers"], capture_output=True, text=True, env=env,
                          timeout=60, check=True)
    assert "gpu-1" in same.stdout and "gpu-2" in same.stdout
    assert "warning" not in same.stdout

    # An unsandboxed worker: its builds see their sources under its workspace.
    fleet.advertise(conn, _at("gpu-3", "/home/ci/wheelhouse-work/src"), ttl=120)
    split = subprocess.run(["wheelhouse", "workers"], capture_output=True, text=True, env=env,
                           timeout=60, check=True)
    assert ("warning: workers' builds see their sources at different paths "
            "(/home/ci/wheelhouse-work/src: gpu-3; /wheelhouse/src: gpu-1, gpu-2)"
            ) in split.stdout
