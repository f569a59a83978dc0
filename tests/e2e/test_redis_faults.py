"""Redis faults against real processes: ``wheelhouse serve`` (gunicorn, 2 workers) and a
``wheelhouse worker``, with a redis-server that is hung (SIGSTOP), killed and restarted.

Each test states the fault, the requests sent during it, what they must answer (never a 500,
never slower than the web's Redis timeout plus slack), and how soon after the fault ends
everything answers as before, with no restart of the web or the worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.helpers import (
    IndexURL,
    QuietHandler,
    RedisProcess,
    fake_cuda_toolkit,
    make_wheel,
    run_worker,
    serve_http,
    start_index,
)
from wheelhouse.builds.fleet import live_workers
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import create_token
from wheelhouse.redisconn import queue_client
from wheelhouse.retry import QUEUE_COMMANDS
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"
REQUEST = {"project": "flash-attn", "version": "2.8.3", "torch": "2.8", "cuda": "12.8",
           "python": ["3.11"]}
assert QUEUE_COMMANDS.timeout is not None
#: The longest any request may take while Redis hangs: the web's Redis timeout, plus slack
#: for a loaded 2-core machine. A request past it fails the test (a read timeout).
HANG_BOUND = QUEUE_COMMANDS.timeout + 4.0
#: How soon after Redis answers again every route must answer as before.
RECOVERY = 15.0
#: How soon after Redis answers again a worker must take a new build: its reconnect policy
#: waits 1, 2, 5, 10 s between pings (retry.WORKER_RECONNECT), plus RQ's own backoff.
WORKER_RECOVERY = 60.0


@dataclass
class Servers:
    redis: RedisProcess
    open: IndexURL
    """Reading is open: the index needs no Redis."""
    private: IndexURL
    """WHEELHOUSE_AUTH=token: every read checks a token in Redis."""
    token: str
    build_id: str


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("redis-faults")
    with RedisProcess(tmp / "redis") as proc:
        config = Config(storage=str(tmp / "data"), redis_url=proc.url, upstream="off",
                        secret_key="k" * 32, rate_limit="1000/60")
        variant = parse_variant(VARIANT)
        publish(open_storage(config),
                make_wheel(tmp / "w", "demo-ext", f"1.0+{variant.local_label}"), variant)
        conn = queue_client(Config(redis_url=proc.url))
        tok = create_token(conn, "ops", ("build", "read"))
        from rq import Queue

        # A queued build to look up; enqueued directly (no worker needs to be alive for it).
        job = Queue("build-cu128-x86_64", connection=conn).enqueue(
            "worker.jobs.run_build", job_id="build-looked-up", meta={"spec": {}})
        conn.close()
        with start_index(config, tmp) as open_url, \
                start_index(config.replace(auth="token"), tmp) as private_url:
            yield Servers(proc, open_url, private_url, tok, job.id)


def _timed(ask: Callable[[], requests.Response]) -> tuple[requests.Response, float]:
    started = time.monotonic()
    resp = ask()
    return resp, time.monotonic() - started


def _during_fault(s: Servers) -> dict[str, Callable[[], requests.Response]]:
    """The requests sent while Redis is down or hung: (what, how) for each route."""
    auth = {"Authorization": f"Bearer {s.token}"}
    t = HANG_BOUND
    return {
        "GET /matrix": lambda: requests.get(f"{s.open}/matrix", timeout=t),
        "GET /api/builds/<id>": lambda: requests.get(f"{s.open}/api/builds/{s.build_id}",
                                                     timeout=t),
        "GET /api/workers": lambda: requests.get(f"{s.open}/api/workers", timeout=t),
        "POST /api/builds": lambda: requests.post(f"{s.open}/api/builds", json=REQUEST,
                                                  headers=auth, timeout=t),
        "GET a private index page": lambda: requests.get(
            f"{s.private}/{VARIANT}/simple/demo-ext/", headers=auth, timeout=t),
    }


def _served_anyway(s: Servers) -> None:
    """What needs no Redis answers as usual during the fault, without waiting for Redis."""
    assert QUEUE_COMMANDS.timeout is not None
    for url in (f"{s.open}/healthz", f"{s.private}/healthz",
                f"{s.open}/{VARIANT}/simple/demo-ext/"):
        resp, seconds = _timed(lambda url=url: requests.get(url, timeout=HANG_BOUND))
        assert resp.status_code == 200, (url, resp.status_code)
        assert seconds < QUEUE_COMMANDS.timeout, (url, seconds)  # never a Redis timeout
    ready = requests.get(f"{s.open}/readyz", timeout=HANG_BOUND)
    assert ready.status_code == 503 and ready.json()["checks"]["redis"]["ok"] is False
    assert ready.json()["checks"]["storage"]["ok"] is True


def _all_refused(s: Servers) -> None:
    for what, ask in _during_fault(s).items():
        resp, seconds = _timed(ask)  # a hang past HANG_BOUND raises ReadTimeout here
        assert resp.status_code == 503, (what, resp.status_code, resp.text[:200])
        assert resp.headers.get("Retry-After") == "10", what
        assert "build queue" in resp.text, what
        assert seconds < HANG_BOUND, (what, seconds)


def _recovers(s: Servers) -> float:
    """Seconds until every route answers as it does with Redis up (asserted within RECOVERY):
    200, except the build request, which is a 409 (no worker runs in this fixture)."""
    expected = {what: 200 for what in _during_fault(s)} | {"POST /api/builds": 409,
                                                           "GET /readyz": 200}
    started = time.monotonic()
    while True:
        codes = {what: ask().status_code for what, ask in _during_fault(s).items()}
        codes["GET /readyz"] = requests.get(f"{s.open}/readyz", timeout=HANG_BOUND).status_code
        if codes == expected:
            return time.monotonic() - started
        assert 500 not in codes.values(), codes
        assert time.monotonic() - started < RECOVERY, codes
        time.sleep(0.2)


def test_hung_redis(servers: Servers) -> None:
    """Fault: redis-server stopped with SIGSTOP (connections open, nothing answers) while the
    requests of ``_during_fault`` and ``_served_anyway`` are sent. Each Redis route answers 503
    with Retry-After within the 2 s Redis timeout (+ slack); the index and /healthz answer as
    usual; after SIGCONT everything answers within RECOVERY seconds."""
    servers.redis.hang()
    try:
        _served_anyway(servers)
        _all_refused(servers)
    finally:
        servers.redis.resume()
    assert _recovers(servers) < RECOVERY


def test_killed_and_restarted_redis(servers: Servers) -> None:
    """Fault: redis-server killed (connections reset, new ones refused), then, after the
    requests, started again on the same port with its append-only data. Same requests and
    answers as when it hangs; refusals come at once. No web process is restarted."""
    servers.redis.kill()
    try:
        _served_anyway(servers)
        _all_refused(servers)
    finally:
        servers.redis.start()
    assert _recovers(servers) < RECOVERY


class _SlowUpstream(QuietHandler):
    """An upstream index that takes 4 s to say it has nothing: the build fails at its sdist
    fetch, 4 s after it started, which lets the test kill Redis while a build runs."""

    def do_GET(self) -> None:
        time.sleep(4)
        self.send_body(b"no such project", "text/plain", 404)


def _wait(what: str, check: Callable[[], bool], timeout: float, log: Path) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what}; worker log:\n" + \
            log.read_text()[-4000:]
        time.sleep(0.3)
    return time.monotonic() - started


def test_a_worker_survives_redis_restarts(tmp_path: Path) -> None:
    """A real ``wheelhouse worker`` (a fake CUDA 12.8 toolkit; builds fail at the sdist
    fetch) through two faults, then a build request is picked up each time:

    1. Redis killed while the worker waits for a job, restarted 3 s later.
    2. Redis killed while a build runs, and the build ends while Redis is away (RQ's loop
       quits on that); restarted 6 s later.

    After each, a new build request must be taken within WORKER_RECOVERY seconds, by the same
    worker process; the build whose end was lost must not stay 'building'."""
    log = tmp_path / "worker.log"
    cuda = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-12.8", "12.8"))}
    with RedisProcess(tmp_path / "redis") as proc, serve_http(_SlowUpstream) as upstream:
        config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                        redis_url=proc.url, upstream=upstream + "/simple/",
                        worker_heartbeat_seconds=1)
        conn = queue_client(Config(redis_url=proc.url))
        tok = create_token(conn, "ops")
        auth = {"Authorization": f"Bearer {tok}"}

        def request(python: str) -> str:
            resp = requests.post(f"{url}/api/builds", json={**REQUEST, "python": [python]},
                                 headers=auth, timeout=HANG_BOUND)
            assert resp.status_code == 201, resp.text
            return str(resp.json()["builds"][0]["id"])

        def state(build_id: str) -> str:
            resp = requests.get(f"{url}/api/builds/{build_id}", timeout=HANG_BOUND)
            return str(resp.json()["state"]) if resp.status_code == 200 else "unknown"

        with start_index(config, tmp_path) as url, \
                run_worker(config, "survivor", log, "--cuda", "12.8", extra_env=cuda) as worker:
            _wait("the worker never advertised", lambda: bool(live_workers(conn)), 60, log)

            proc.kill()  # 1: while idle
            time.sleep(3)
            proc.start()
            first = _wait_for_request(request, "3.11", log)
            _wait("the build was not taken after Redis came back",
                  lambda: state(first) != "queued", WORKER_RECOVERY, log)

            running = request("3.12")  # 2: while a build runs
            _wait("the build never started", lambda: state(running) == "building", 60, log)
            proc.kill()
            time.sleep(6)  # the build ends (fails at its fetch) while Redis is away
            proc.start()
            after = _wait_for_request(request, "3.13", log)
            _wait("the build was not taken after Redis came back",
                  lambda: state(after) != "queued", WORKER_RECOVERY, log)
            _wait("the build that ended while Redis was away stayed 'building'",
                  lambda: state(running) in ("failed", "built"), WORKER_RECOVERY, log)
            assert worker.poll() is None, "the worker exited"
        conn.close()
    text = log.read_text()
    assert "RQ's work loop ended" in text and "Redis answers again" in text


def _wait_for_request(request: Callable[[str], str], python: str, log: Path) -> str:
    """Ask for a build until the web takes it (503 while it reconnects, 409 until the worker's
    advert is back), within WORKER_RECOVERY seconds."""
    started = time.monotonic()
    while True:
        try:
            return request(python)
        except AssertionError:
            assert time.monotonic() - started < WORKER_RECOVERY, log.read_text()[-4000:]
            time.sleep(0.5)
