"""The single-box shape's private Redis: one per workspace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from redis import Redis

from tests.helpers import free_port, run_console
from wheelhouse.config import Config
from wheelhouse.localredis import LocalRedisError, private_redis, socket_path

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="needs redis-server")


def test_a_second_server_in_the_workspace_refuses_and_leaves_the_first_alone(
        tmp_path: Path) -> None:
    workspace = tmp_path / "work"
    with private_redis(workspace) as url:
        with pytest.raises(LocalRedisError, match="another wheelhouse server"), \
                private_redis(workspace):
            pass
        config = Config(storage=str(tmp_path / "data"), workspace=str(workspace))
        done = run_console("serve", "--with-worker", "--port", str(free_port()), config=config,
                           timeout=60)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines()[-1].startswith(
            "Error: another wheelhouse server runs the private Redis of this workspace")
        assert "Traceback" not in done.stderr
        # The first one's socket is still there, and it still answers.
        assert socket_path(workspace).exists()
        conn = Redis.from_url(url)
        assert conn.ping()
        conn.close()
    # Once the first has stopped, the workspace's Redis can be started again.
    with private_redis(workspace) as again:
        conn = Redis.from_url(again)
        assert conn.ping()
        conn.close()
