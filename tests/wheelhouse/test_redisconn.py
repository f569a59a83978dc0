"""Connecting to Redis with a password file and over TLS, against a real redis-server that
speaks only TLS and wants a password (as the fleet's Redis does for workers on other hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError

from tests.conftest import TLSRedis
from tests.helpers import run_console
from wheelhouse.config import Config
from wheelhouse.errors import RedisSettingError
from wheelhouse.redisconn import connect
from wheelhouse.tokens import list_tokens


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


def test_the_plain_test_redis_needs_no_password(redis_url: str) -> None:
    assert connect(Config(redis_url=redis_url)).ping()
    assert isinstance(connect(Config(redis_url=redis_url)), redis.Redis)
