"""Fixtures that start real things: redis-server, an S3 API server (moto), storage, the app."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.helpers import (
    Listener,
    TLSFiles,
    free_port,
    make_tls_certs,
    moto_s3_server,
    wait_for_port,
)
from wheelhouse.config import Config
from wheelhouse.index.storage import LocalStorage, S3Storage, Storage

ARTIFACTS = Path(os.environ.get("WHEELHOUSE_TEST_ARTIFACTS", "test-artifacts")).resolve()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``nvcc`` skip with the reason where nvcc or torch is missing, and those
    marked ``sandbox`` where bubblewrap is; both fail instead where ``WHEELHOUSE_REQUIRE_NVCC=1``
    or ``WHEELHOUSE_REQUIRE_SANDBOX=1`` make them mandatory (as in .ci/run)."""
    if item.get_closest_marker("nvcc") is not None:
        from tests.worker.conftest import require_nvcc

        require_nvcc()
    if item.get_closest_marker("sandbox") is not None and shutil.which("bwrap") is None:
        reason = "bubblewrap is not installed (apt-get install bubblewrap)"
        if os.environ.get("WHEELHOUSE_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox tests are mandatory here (WHEELHOUSE_REQUIRE_SANDBOX=1), "
                        f"but {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a loopback port, private to this test session; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_for_port(port)
        yield f"redis://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


_redis_db_counter = iter(range(1, 16))


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A flushed Redis database of its own for one test."""
    import redis

    db = next(_redis_db_counter, None)
    if db is None:  # more tests than databases: reuse, flushed
        db = 15
    url = f"{redis_server}/{db}"
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    yield url
    conn.flushdb()
    conn.close()


@pytest.fixture
def conn(redis_url: str) -> Iterator[Redis]:
    """A client of this test's own Redis database, closed after the test."""
    client = Redis.from_url(redis_url)
    yield client
    client.close()


@dataclass(frozen=True)
class TLSRedis:
    """A redis-server that speaks only TLS and wants a password, as a remote worker meets it."""

    port: int
    tls: TLSFiles
    password: str
    password_file: Path

    def url(self, db: int = 0, *, host: str = "localhost", ca: bool = True) -> str:
        """``rediss://`` without the password, verifying the server with the test CA."""
        query = f"?ssl_ca_certs={self.tls.ca}" if ca else ""
        return f"rediss://{host}:{self.port}/{db}{query}"


@pytest.fixture(scope="session")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    """redis-server with ``requirepass`` (given on its stdin, as compose.yaml does) and only a
    TLS port, with a certificate from a private CA made by the openssl command."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("tls-redis")
    tls = make_tls_certs(workdir / "tls")
    password = secrets.token_hex(32)
    password_file = workdir / "redis_password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key),
         "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(f"requirepass {password}\n".encode())
    proc.stdin.close()
    try:
        wait_for_port(port)
        yield TLSRedis(port=port, tls=tls, password=password, password_file=password_file)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's S3 API in server mode over HTTP on loopback; yields its endpoint URL."""
    with moto_s3_server() as url:
        yield url


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


_bucket_counter = iter(range(1_000_000))


@pytest.fixture
def s3_config(s3_server: str, s3_env: dict[str, str]) -> Config:
    """A Config pointing at a fresh bucket on the loopback S3 server."""
    from wheelhouse.index.storage import make_s3_client

    bucket = f"wheels-{next(_bucket_counter)}"
    config = Config(storage=f"s3://{bucket}/idx", s3_endpoint_url=s3_server)
    make_s3_client(config).create_bucket(Bucket=bucket)
    return config


@pytest.fixture(params=["local", "s3"])
def any_config(request: pytest.FixtureRequest, tmp_path: Path) -> Config:
    """Run a test against both storages."""
    if request.param == "s3":
        config: Config = request.getfixturevalue("s3_config")
        return config
    return Config(storage=str(tmp_path / "data"))


@pytest.fixture
def local_storage(tmp_path: Path) -> LocalStorage:
    return LocalStorage(tmp_path / "data")


@pytest.fixture
def s3_storage(s3_config: Config) -> S3Storage:
    from wheelhouse.index.storage import open_storage

    storage = open_storage(s3_config)
    assert isinstance(storage, S3Storage)
    return storage


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest) -> Storage:
    result: Any = request.getfixturevalue(f"{request.param}_storage")
    return result  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def listener() -> Iterator[Listener]:
    """A TCP listener on every address that counts the connections it accepts."""
    server = Listener()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def failing_bwrap(tmp_path: Path) -> Path:
    """A bubblewrap that fails as it does in a container without the privileges it needs."""
    path = tmp_path / "bin" / "bwrap"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: "
                    "Operation not permitted' >&2\nexit 1\n")
    path.chmod(0o755)
    return path
