"""HTTP details on every path an installer or cache reads (root and project pages,
``.metadata``, wheels), answered by Flask (a cold cache) and by the fast path (a warm one)
alike: conditional requests, content negotiation, redirects, the auth challenge."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.web.conftest import VARIANT
from web import create_app
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record


@pytest.fixture
def any_config(tmp_path: Path) -> Config:
    """Local storage only: these are HTTP rules, the same over either storage."""
    return Config(storage=str(tmp_path / "data"))


def _paths(published: list[Record]) -> dict[str, str]:
    r = published[0]
    wheel = f"/files/{r.variant.base.key}/{r.project}/{r.filename}"
    return {"root": f"/{VARIANT}/simple/", "project": f"/{VARIANT}/simple/demo-ext/",
            "metadata": wheel + ".metadata", "wheel": wheel}


PATHS = ["root", "project", "metadata", "wheel"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("match", ["*", "weak", "listed"])
def test_if_none_match_weak_and_star(client: FlaskClient, published: list[Record], path: str,
                                     match: str) -> None:
    url = _paths(published)[path]
    etag = client.get(url).headers["ETag"]  # Flask; later answers come from the fast path
    header = {"*": "*", "weak": f"W/{etag}", "listed": f'"other", W/{etag}'}[match]
    for _ in range(2):  # the second may be the fast path's (pages, .metadata)
        resp = client.get(url, headers={"If-None-Match": header})
        assert resp.status_code == 304, (url, header)
        assert resp.headers["ETag"] == etag and resp.data == b""
    assert client.get(url, headers={"If-None-Match": '"other"'}).status_code == 200


def test_if_none_match_star_on_a_cold_cache(app_config: Config,
                                            published: list[Record]) -> None:
    """Before any page was rendered or any .metadata read: Flask answers ``*`` too."""
    for path in PATHS:
        fresh = create_app(app_config).test_client()
        resp = fresh.get(_paths(published)[path], headers={"If-None-Match": "*"})
        assert resp.status_code == 304, path


@pytest.mark.parametrize(("accept", "mimetype"), [
    ("*/*", "text/html"),
    ("application/vnd.pypi.simple.latest+html", "application/vnd.pypi.simple.v1+html"),
    ("application/vnd.pypi.simple.v1+html", "application/vnd.pypi.simple.v1+html"),
    ("application/vnd.pypi.simple.latest+json", "application/vnd.pypi.simple.v1+json"),
])
@pytest.mark.parametrize("path", ["root", "project"])
def test_concrete_types_on_both_paths(client: FlaskClient, published: list[Record],
                                      accept: str, mimetype: str, path: str) -> None:
    url = _paths(published)[path]
    for _ in range(2):  # Flask, then the fast path
        resp = client.get(url, headers={"Accept": accept})
        assert resp.status_code == 200 and resp.mimetype == mimetype


@pytest.mark.parametrize(("path", "target"), [
    (f"/{VARIANT}/simple", f"/{VARIANT}/simple/"),
    (f"/{VARIANT}/simple/Demo_Ext/", f"/{VARIANT}/simple/demo-ext/"),
    (f"/{VARIANT}/simple/Demo.Ext", f"/{VARIANT}/simple/demo-ext/"),
])
def test_normalisation_redirects_keep_the_query(client: FlaskClient, published: list[Record],
                                                path: str, target: str) -> None:
    resp = client.get(path + "?format=application/vnd.pypi.simple.v1%2Bjson")
    assert resp.status_code == 301
    assert resp.headers["Location"].endswith(
        target + "?format=application/vnd.pypi.simple.v1%2Bjson")
    assert client.get(path).headers["Location"].endswith(target)


def test_basic_auth_challenge_names_the_realm(app_config: Config,
                                              published: list[Record]) -> None:
    app: Flask = create_app(app_config.replace(auth="basic:team:s3cret"))
    client = app.test_client()
    for path in PATHS:
        resp = client.get(_paths(published)[path])
        assert resp.status_code == 401
        assert resp.headers["WWW-Authenticate"] == 'Basic realm="wheelhouse"'
        ok = client.get(_paths(published)[path], auth=("team", "s3cret"))
        assert ok.status_code == 200
