"""App fixtures: a real app over real storage (a directory, or the loopback S3 server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from redis import Redis

from tests.helpers import make_wheel
from web import create_app
from wheelhouse.catalog import Record
from wheelhouse.config import Config
from wheelhouse.publish import publish
from wheelhouse.storage import open_storage
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"


@pytest.fixture
def conn(redis_url: str) -> Redis:
    """A client of this test's own Redis database."""
    return Redis.from_url(redis_url)


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
