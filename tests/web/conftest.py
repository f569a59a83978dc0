"""App fixtures: a real app over real storage (a directory, or the loopback S3 server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import free_port, make_wheel
from web import create_app
from wheelhouse.catalog import Record
from wheelhouse.config import Config
from wheelhouse.publish import publish
from wheelhouse.retry import RetryPolicy
from wheelhouse.storage import LocalStorage, S3Storage, Storage, make_s3_client, open_storage
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"


@pytest.fixture
def app_config(any_config: Config) -> Config:
    return any_config.replace(catalog_refresh_seconds=0.0, upstream="https://up.example/simple/")


@pytest.fixture
def app(app_config: Config) -> Flask:
    app = create_app(app_config)
    app.testing = True
    return app


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


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
