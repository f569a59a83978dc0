"""The web's Redis client on a real redis-server that is stopped, killed and restarted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from tests.helpers import RedisProcess
from wheelhouse.errors import QueueUnavailable
from wheelhouse.redisclient import QueueClient, connect
from wheelhouse.retry import QUEUE_COMMANDS

#: What a test allows beyond the client's own timeout for Python and the machine's load.
SLACK = 3.0


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProcess]:
    with RedisProcess(tmp_path / "redis") as proc:
        yield proc


def _fails_within(client: QueueClient, bound: float, what: str) -> QueueUnavailable:
    started = time.monotonic()
    with pytest.raises(QueueUnavailable, match=what) as caught:
        client.get("k")
    assert time.monotonic() - started < bound
    return caught.value


def test_a_client_made_while_redis_is_down_works_once_it_is_up(tmp_path: Path) -> None:
    proc = RedisProcess(tmp_path / "redis")
    client = connect(proc.url)  # nothing is sent yet
    err = _fails_within(client, SLACK, "unreachable")
    assert "connecting" in str(err.__cause__)  # the detail stays on the cause, for the log
    with proc:
        assert client.set("k", "v") is True and client.get("k") == b"v"


def test_a_hung_redis_costs_one_timeout_not_a_retry_each(redis_proc: RedisProcess) -> None:
    client = connect(redis_proc.url)
    client.set("k", "v")
    redis_proc.hang()
    try:
        assert QUEUE_COMMANDS.timeout is not None
        _fails_within(client, QUEUE_COMMANDS.timeout + SLACK, "did not answer in time")
    finally:
        redis_proc.resume()
    assert client.get("k") == b"v"  # the timed-out connection was replaced, nothing else


def test_a_restarted_redis_is_used_again_without_reconnecting_by_hand(
        redis_proc: RedisProcess) -> None:
    client = connect(redis_proc.url)
    client.set("k", "v")  # the pool now holds a connection to the process about to die
    redis_proc.kill()
    _fails_within(client, SLACK, "unreachable")
    redis_proc.start()
    assert client.get("k") == b"v"  # the stale pooled connection was re-made (append-only)


def test_pipelines_and_rq_translate_too(redis_proc: RedisProcess) -> None:
    from rq import Queue
    from rq.job import Job

    client = connect(redis_proc.url)
    with client.pipeline() as pipe:
        pipe.incr("n")
        pipe.expire("n", 60)
        assert pipe.execute() == [1, True]
    redis_proc.kill()
    with pytest.raises(QueueUnavailable), client.pipeline() as pipe:
        pipe.incr("n")
        pipe.execute()
    with pytest.raises(QueueUnavailable):
        Queue.all(connection=client)
    with pytest.raises(QueueUnavailable):
        Job.fetch("some-job", connection=client)


def test_errors_that_are_not_about_the_connection_pass_through(
        redis_proc: RedisProcess) -> None:
    client = connect(redis_proc.url)
    client.set("k", "not a number")
    with pytest.raises(ResponseError):
        client.incr("k")
