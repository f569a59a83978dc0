"""``wheelhouse request`` against a running server, a real Redis and a real worker whose build
fails: the installed console script, run by its path with a minimal ``PATH``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import requests
from redis import Redis

from tests.helpers import (
    QuietHandler,
    fake_cuda_toolkit,
    free_port,
    run_console,
    run_worker,
    serve_http,
    start_index,
)
from wheelhouse.config import Config
from wheelhouse.index.tokens import create_token

#: One job (flash-attn's recipe would split its four default archs into four).
REQUEST = ("request", "flash-attn==2.8.3", "--torch", "2.8", "--cuda", "12.8",
           "--python", "3.11", "--no-split-archs")


def _wait_for(check: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.25)
    return found


def _state(url: str, build_id: str, token: str) -> str:
    view = requests.get(f"{url}/api/builds/{build_id}", timeout=10,
                        headers={"Authorization": f"Bearer {token}"}).json()
    return str(view["state"])


def test_a_failed_build_says_why_exits_1_and_retries_on_request(
        redis_url: str, tmp_path: Path) -> None:
    # A worker that can take CUDA 12.8 builds; with no upstream index, each fails at its fetch.
    # No torch index here to check against (test_torchindex does, with a fake one).
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                    redis_url=redis_url, upstream="off", worker_heartbeat_seconds=1,
                    torch_check=False)
    token = create_token(Redis.from_url(redis_url), "cli", ("build", "read"))
    cuda = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-12.8", "12.8"))}
    with start_index(config, tmp_path) as url, \
            run_worker(config, "w", tmp_path / "worker.log", "--cuda", "12.8", extra_env=cuda):
        _wait_for(lambda: requests.get(f"{url}/api/workers", timeout=5).json()["workers"],
                  "the worker never advertised itself")
        env = {"WHEELHOUSE_SERVER": url, "WHEELHOUSE_TOKEN": token}

        first = run_console(*REQUEST, env=env)
        assert first.returncode == 0, first.stderr
        build_id, python, what, page = first.stdout.strip().split("\t")
        assert (python, what) == ("Python 3.11", "created, queued")
        assert page == f"{url}/builds/{build_id}"
        _wait_for(lambda: _state(url, build_id, token) == "failed", "the build never failed")

        again = run_console(*REQUEST, env=env)
        assert again.returncode == 1
        assert again.stdout == (
            f"{build_id}\tPython 3.11\tfailed earlier: [incompatible] no upstream index is "
            f"configured, so the sdist must be given\t{url}/builds/{build_id}\n")
        assert again.stderr == (
            "Error: 1 of these builds ended without a wheel (its page says more); "
            "run again with --retry to build again\n")

        retried = run_console(*REQUEST, "--retry", env=env)
        assert retried.returncode == 0, retried.stderr
        assert retried.stdout.startswith(f"{build_id}\tPython 3.11\tcreated, ")
        _wait_for(lambda: _state(url, build_id, token) == "failed", "the retry never ran")
        waited = run_console(*REQUEST, "--retry", "--wait", "--poll-seconds", "0.2", env=env)
        assert waited.returncode == 1
        assert f"{build_id}: failed [incompatible] no upstream index" in waited.stdout


def test_token_comes_from_the_environment_and_is_not_marked_required() -> None:
    shown = " ".join(run_console("request", "--help").stdout.split())
    assert "--token TEXT API token with the build scope; default: $WHEELHOUSE_TOKEN" in shown
    assert "[required]" not in shown.split("--token", 1)[1].split("--retry", 1)[0]
    missing = run_console(*REQUEST)
    assert missing.returncode == 2
    assert "no API token: set WHEELHOUSE_TOKEN (or pass --token)" in missing.stderr
    assert "wheelhouse token create NAME" in " ".join(missing.stderr.split())


def test_a_server_that_refuses_names_the_setting_to_change() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    done = run_console(*REQUEST, "--server", dead, env={"WHEELHOUSE_TOKEN": "whk_x"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"cannot reach {dead}/api/builds" in done.stderr
    assert "point --server or WHEELHOUSE_SERVER at it" in done.stderr


@pytest.mark.parametrize("bad", ["0", "-1", "soon"])
def test_poll_seconds_must_be_positive(bad: str) -> None:
    done = run_console(*REQUEST, "--poll-seconds", bad, env={"WHEELHOUSE_TOKEN": "whk_x"})
    assert done.returncode == 2 and "--poll-seconds" in done.stderr


def test_a_local_sdist_must_be_named_as_one(tmp_path: Path) -> None:
    """Issue 21: a local sdist is uploaded (tests/e2e/test_request_sdist.py); one whose name
    is not an sdist's is refused before anything is sent."""
    sdist = tmp_path / "vecadd.tar.gz"
    sdist.write_bytes(b"")
    done = run_console("request", str(sdist), "--torch", "2.14", "--cuda", "13.0", "--python",
                       "3.11", env={"WHEELHOUSE_TOKEN": "whk_x"})
    assert done.returncode == 1
    assert done.stderr == ("Error: vecadd.tar.gz is not an sdist file name "
                           "(name-version.tar.gz)\n")


class _AnswerWithoutIds(QuietHandler):
    """A server whose build submission answers lack each build's id."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_body(b'{"builds": [{"python": "3.11", "state": "queued"}]}',
                       "application/json", 201)


def test_an_answer_the_cli_cannot_read_is_one_line() -> None:
    with serve_http(_AnswerWithoutIds) as url:
        done = run_console(*REQUEST, "--server", url, env={"WHEELHOUSE_TOKEN": "whk_x"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr == ("Error: the server's answer is not understood: "
                           "a submitted build: the answer has no 'id'\n")
