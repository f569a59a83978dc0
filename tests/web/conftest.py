"""App fixtures: a real app over real storage (a directory, or the loopback S3 server), and
one with a build queue (real Redis) for the build pages, the build API, auth and the guard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from redis import Redis

from tests.helpers import free_port, make_wheel
from tests.web.buildhelpers import advertise_worker, close_made_apps, close_redis, make_app
from web import create_app
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import LocalStorage, S3Storage, Storage, make_s3_client, open_storage
from wheelhouse.retry import RetryPolicy
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"


@pytest.fixture(autouse=True)
def _apps_closed() -> Iterator[None]:
    """An app a test made with ``make_app`` has its Redis connections closed when the test
    ends, not whenever the garbage collector reaches the socket (a ResourceWarning, an error
    here, in whichever later test or at the session's end)."""
    yield
    close_made_apps()


@pytest.fixture
def app_config(any_config: Config, tmp_path: Path) -> Config:
    # The pull-through cache off: these tests check routing (redirects) without a network;
    # tests/web/test_mirror.py and tests/e2e/test_mirror.py cover the cache.
    return any_config.replace(catalog_refresh_seconds=0.0, upstream="https://up.example/simple/",
                              workspace=str(tmp_path / "work"), cache_projects="")


@pytest.fixture
def app(app_config: Config) -> Flask:
    app = create_app(app_config)
    app.testing = True
    return app


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


@pytest.fixture
def queue_app(redis_url: str, tmp_path: Path) -> Iterator[Flask]:
    """An app with a build queue (real Redis, its own database), over storage in a directory:
    what the build pages, API, auth and guard do doesn't depend on the kind of storage."""
    app = make_app(redis_url, tmp_path)
    yield app
    close_redis(app)


@pytest.fixture
def queue_client(queue_app: Flask) -> FlaskClient:
    return queue_app.test_client()


@pytest.fixture
def fleet_client(queue_client: FlaskClient, conn: Redis) -> FlaskClient:
    """``queue_client`` with one live worker advertised (CUDA 12.8, x86_64), so that builds
    can be requested."""
    advertise_worker(conn)
    return queue_client


@pytest.fixture
def published(app_config: Config, tmp_path: Path) -> list[Record]:
    """Two versions of demo-ext in torch2.8-cu128, plus a narrowed sm90 build of 1.1."""
    storage = open_storage(app_config)
    base = parse_variant(VARIANT)
    sm90 = parse_variant(VARIANT + "-sm90")
    out = []
    for version in ("1.0", "1.1"):
        w = make_wheel(tmp_path / "w", "demo-ext", f"{version}+{base.local_label}",
                       tag="cp311-cp311-linux_x86_64", requires_python=">=3.9,<4",
                       payload=bytes(range(256)) * 40)
        out.append(publish(storage, w, base, archs=("80", "90")))
    w = make_wheel(tmp_path / "w", "demo-ext", f"1.1+{sm90.local_label}",
                   tag="cp311-cp311-linux_x86_64", requires_python=">=3.9,<4")
    out.append(publish(storage, w, sm90))
    return out


class Outage:
    """Storage going away under a running app, and coming back: a local root that is suddenly
    a file, or an S3 client pointed at a port nothing listens on. Real errors, translated by
    the real storage classes; only where the storage object points changes."""

    def __init__(self, storage: Storage, tmp_path: Path) -> None:
        self.storage = storage
        if isinstance(storage, LocalStorage):
            self._good: object = storage.root
            (tmp_path / "gone").write_bytes(b"")
            self._bad: object = tmp_path / "gone"
        else:
            assert isinstance(storage, S3Storage)
            self._good = storage.client
            dead = Config(storage="s3://x", s3_endpoint_url=f"http://127.0.0.1:{free_port()}")
            self._bad = make_s3_client(dead, policy=RetryPolicy(attempts=1, timeout=1))

    def _point(self, where: object) -> None:
        if isinstance(self.storage, LocalStorage):
            self.storage.root = where  # type: ignore[assignment]
        else:
            self.storage.client = where  # type: ignore[attr-defined]

    def begin(self) -> None:
        self._point(self._bad)

    def end(self) -> None:
        self._point(self._good)


@pytest.fixture
def outage(app: Flask, tmp_path: Path) -> Outage:
    """The app's storage, ready to fail (``begin``) and recover (``end``)."""
    return Outage(app.extensions["wheelhouse"].storage, tmp_path)
