"""Connecting to Redis with a password file and over TLS, against a real redis-server that
speaks only TLS and wants a password (as the fleet's Redis does for workers on other hosts);
and the web's client against a real redis-server that is stopped, killed and restarted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError

from tests.conftest import TLSRedis
from tests.helpers import RedisProcess, run_console
from wheelhouse.config import Config
from wheelhouse.errors import QueueUnavailable, RedisSettingError
from wheelhouse.index.tokens import list_tokens
from wheelhouse.redisconn import QueueClient, connect, queue_client
from wheelhouse.retry import QUEUE_COMMANDS


def _config(tls_redis: TLSRedis, **changes: object) -> Config:
    values: dict[str, object] = {"redis_url": tls_redis.url(),
                                 "redis_password_file": str(tls_redis.password_file)}
    values.update(changes)
    return Config(**values)  # type: ignore[arg-type]


def test_tls_with_the_private_ca_and_the_password_file(tls_redis: TLSRedis) -> None:
    conn = connect(_config(tls_redis), timeout=5)
    assert conn.ping()
    conn.set("wheelhouse:test", b"over tls")
    assert conn.get("wheelhouse:test") == b"over tls"
    assert conn.connection_pool.connection_kwargs["ssl_ca_certs"] == str(tls_redis.tls.ca)
    conn.delete("wheelhouse:test")


def test_strangers_are_refused(tls_redis: TLSRedis, tmp_path: Path) -> None:
    # Without the CA, the server's certificate is a stranger's.
    with pytest.raises(ConnectionError, match="certificate verify failed"):
        connect(_config(tls_redis, redis_url=tls_redis.url(ca=False)), timeout=5).ping()
    # A client that doesn't speak TLS gets nowhere.
    with pytest.raises(ConnectionError):
        connect(_config(tls_redis, redis_url=f"redis://localhost:{tls_redis.port}/0"),
                timeout=5).ping()
    with pytest.raises(AuthenticationError, match=r"authenticated|Authentication required"):
        connect(_config(tls_redis, redis_password_file=None), timeout=5).ping()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    with pytest.raises((AuthenticationError, ResponseError), match="invalid username-password"):
        connect(_config(tls_redis, redis_password_file=str(wrong)), timeout=5).ping()


def test_password_settings_that_cannot_work(tls_redis: TLSRedis, tmp_path: Path) -> None:
    with pytest.raises(RedisSettingError, match="given twice"):
        connect(_config(tls_redis, redis_url=f"rediss://:secret@localhost:{tls_redis.port}/0"))
    missing = tmp_path / "nope"
    with pytest.raises(RedisSettingError, match=f"cannot read the Redis password file {missing}"):
        connect(_config(tls_redis, redis_password_file=str(missing)))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RedisSettingError, match="is empty"):
        connect(_config(tls_redis, redis_password_file=str(empty)))
    with pytest.raises(RedisSettingError, match="set WHEELHOUSE_REDIS_URL"):
        connect(Config())


def test_a_password_in_the_url_still_works(tls_redis: TLSRedis) -> None:
    url = (f"rediss://:{tls_redis.password}@localhost:{tls_redis.port}/0"
           f"?ssl_ca_certs={tls_redis.tls.ca}")
    assert connect(Config(redis_url=url), timeout=5).ping()


def test_the_cli_reads_the_same_settings(tls_redis: TLSRedis) -> None:
    """``wheelhouse token create`` run as an operator would, over TLS with the password file."""
    config = _config(tls_redis)
    made = run_console("token", "create", "tls-operator", config=config)
    assert made.returncode == 0, made.stderr
    conn = connect(config, timeout=5)
    assert [t.name for t in list_tokens(conn)] == ["tls-operator"]
    assert run_console("token", "revoke", "tls-operator", config=config).returncode == 0
    # And a wrong setting is one line, not a traceback.
    broken = run_console("token", "list", config=config.replace(redis_password_file="/nope"))
    assert broken.returncode == 1
    assert broken.stderr.strip().splitlines() == [
        "error: cannot read the Redis password file /nope: No such file or directory"]


def test_the_webs_client_reads_the_same_settings(tls_redis: TLSRedis) -> None:
    assert queue_client(_config(tls_redis)).ping()
    with pytest.raises(QueueUnavailable):  # the cause (no password) goes to the server's log
        queue_client(_config(tls_redis, redis_password_file=None)).ping()


def test_the_plain_test_redis_needs_no_password(redis_url: str) -> None:
    assert connect(Config(redis_url=redis_url)).ping()
    assert isinstance(connect(Config(redis_url=redis_url)), redis.Redis)


# -- the web's client: bounded, translated, reconnecting --

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
    client = queue_client(Config(redis_url=proc.url))  # nothing is sent yet
    err = _fails_within(client, SLACK, "unreachable")
    assert "connecting" in str(err.__cause__)  # the detail stays on the cause, for the log
    with proc:
        assert client.set("k", "v") is True and client.get("k") == b"v"


def test_a_hung_redis_costs_one_timeout_not_a_retry_each(redis_proc: RedisProcess) -> None:
    client = queue_client(Config(redis_url=redis_proc.url))
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
    client = queue_client(Config(redis_url=redis_proc.url))
    client.set("k", "v")  # the pool now holds a connection to the process about to die
    redis_proc.kill()
    _fails_within(client, SLACK, "unreachable")
    redis_proc.start()
    assert client.get("k") == b"v"  # the stale pooled connection was re-made (append-only)


def test_pipelines_and_rq_translate_too(redis_proc: RedisProcess) -> None:
    from rq import Queue
    from rq.job import Job

    client = queue_client(Config(redis_url=redis_proc.url))
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
    client = queue_client(Config(redis_url=redis_proc.url))
    client.set("k", "not a number")
    with pytest.raises(ResponseError):
        client.incr("k")
