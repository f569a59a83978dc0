"""Cache hits answered before Flask: identical to what the Flask view answers."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import EnvironBuilder

from tests.web.conftest import VARIANT, Outage
from tests.web.test_simple import UV_ACCEPT
from web.errors import CATALOG_HEADER
from web.fastpath import CachedPages
from web.guard import RequestGuard
from wheelhouse.errors import StorageError
from wheelhouse.index.catalog import Record

COMPARED = ("ETag", "Cache-Control", "Vary", "Content-Type", "Content-Length", "Location")


def _direct(app: Flask, path: str, headers: dict[str, str], method: str = "GET") -> Any:
    """Ask the middleware alone; None means it would hand the request to Flask."""
    guard = app.wsgi_app  # the request guard stands in front of the fast path
    assert isinstance(guard, RequestGuard)
    middleware = guard.next
    assert isinstance(middleware, CachedPages)
    environ = EnvironBuilder(path=path, headers=headers, method=method).get_environ()
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = middleware._answer(environ, start_response)
    return None if body is None else (seen["status"], seen["headers"], b"".join(body))


@pytest.mark.parametrize("accept", [UV_ACCEPT, "text/html", ""])
@pytest.mark.parametrize("path", [f"/{VARIANT}/simple/demo-ext/", f"/{VARIANT}/simple/",
                                  f"/{VARIANT}/simple/einops/"])
def test_hit_matches_the_flask_answer(app: Flask, client: FlaskClient,
                                      published: list[Record], accept: str, path: str) -> None:
    headers = {"Accept": accept} if accept else {}
    assert _direct(app, path, headers) is None  # not rendered yet: Flask renders it
    first = client.get(path, headers=headers)
    fast = _direct(app, path, headers)
    assert fast is not None
    status, fast_headers, body = fast
    assert status.split()[0] == str(first.status_code)
    assert body == first.data
    for name in COMPARED:
        assert fast_headers.get(name) == first.headers.get(name), name
    assert len(fast_headers["X-Request-ID"]) == 32
    # Revalidation and HEAD.
    status, _h, body = _direct(app, path, {**headers, "If-None-Match": first.headers["ETag"]})
    assert (status, body) == ("304 NOT MODIFIED", b"")
    status, head_headers, body = _direct(app, path, headers, method="HEAD")
    assert body == b"" and head_headers["Content-Length"] == first.headers["Content-Length"]


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        (f"/{VARIANT}/simple/demo-ext/?format=json", {}),
        (f"/{VARIANT}/simple/demo-ext/", {"X-Request-ID": "abc"}),
        (f"/{VARIANT}/simple/Demo_Ext/", {}),
        ("/files/x/y/z.whl", {}),
        (f"/{VARIANT}/simple/demo-ext", {}),
    ],
)
def test_everything_else_goes_to_flask(app: Flask, client: FlaskClient,
                                       published: list[Record], path: str,
                                       headers: dict[str, str]) -> None:
    client.get(path, headers=headers)
    assert _direct(app, path, headers) is None


def test_a_new_publication_is_not_hidden(app: Flask, client: FlaskClient,
                                         published: list[Record]) -> None:
    path = f"/{VARIANT}/simple/demo-ext/"
    client.get(path)
    assert _direct(app, path, {}) is not None
    from wheelhouse.index.publish import bump_generation

    bump_generation(app.extensions["wheelhouse"].storage)
    assert _direct(app, path, {}) is None  # new generation: Flask renders again


def test_cached_redirects_follow_the_hosting_rule(app: Flask, client: FlaskClient,
                                                  published: list[Record], tmp_path: Any) -> None:
    """The fast path answers only what the view cached: a project's upstream redirect is gone
    with its first publication (any variant), and a hosted project's 404 is never cached."""
    from tests.helpers import make_wheel
    from wheelhouse.index.publish import publish
    from wheelhouse.variants import parse_variant

    path = f"/{VARIANT}/simple/newext/"
    assert client.get(path).status_code == 302
    assert _direct(app, path, {})[0] == "302 FOUND"
    narrow = parse_variant("torch2.14-cu130-sm80")
    wheel = make_wheel(tmp_path / "n", "newext", f"1.0+{narrow.local_label}")
    publish(app.extensions["wheelhouse"].storage, wheel, narrow)
    assert _direct(app, path, {}) is None
    for _ in range(2):
        resp = client.get(path)
        assert resp.status_code == 404 and "torch2.14-cu130-sm80" in resp.text
        assert _direct(app, path, {}) is None


def test_read_protected_index_always_asks_flask(app_config: Any, published: list[Record]) -> None:
    from web import create_app

    app = create_app(app_config.replace(auth="basic:reader:s3cret"))
    client = app.test_client()
    path = f"/{VARIANT}/simple/demo-ext/"
    import base64

    good = {"Authorization": "Basic " + base64.b64encode(b"reader:s3cret").decode()}
    assert client.get(path, headers=good).status_code == 200
    assert _direct(app, path, {}) is None
    assert client.get(path).status_code == 401


def test_metadata_hit_matches_the_flask_answer(app: Flask, client: FlaskClient,
                                               published: list[Record]) -> None:
    r = published[0]
    path = f"/files/{VARIANT}/{r.project}/{r.filename}.metadata"
    assert _direct(app, path, {}) is None  # not read yet
    first = client.get(path)
    status, headers, body = _direct(app, path, {})
    assert status == "200 OK" and body == first.data
    for name in ("ETag", "Cache-Control", "Accept-Ranges", "Content-Type", "Content-Length"):
        assert headers.get(name) == first.headers.get(name), name
    assert _direct(app, path, {"If-None-Match": first.headers["ETag"]})[0] == "304 NOT MODIFIED"
    assert _direct(app, path, {"Range": "bytes=0-9"}) is None  # ranges: Flask
    assert _direct(app, f"/files/{VARIANT}/{r.project}/nope-1.0-py3-none-any.whl.metadata",
                   {}) is None
    assert _direct(app, f"/files/bad-key/{r.project}/{r.filename}.metadata", {}) is None


def _stale_age(value: str | None) -> int:
    assert value is not None and value.startswith("stale; age="), value
    return int(value.removeprefix("stale; age="))


def test_a_stale_catalog_is_served_and_marked_on_both_paths(
    app: Flask, client: FlaskClient, published: list[Record], outage: Outage
) -> None:
    cached, uncached = f"/{VARIANT}/simple/demo-ext/", f"/{VARIANT}/simple/"
    meta = f"/files/{VARIANT}/{published[0].project}/{published[0].filename}.metadata"
    first = client.get(cached)
    client.get(meta)
    assert CATALOG_HEADER not in first.headers
    svc = app.extensions["wheelhouse"]

    outage.begin()
    with pytest.raises(StorageError):
        svc.catalog.refresh()  # what the next due refresh meets: storage is down
    fast = _direct(app, cached, {})
    assert fast is not None  # still answered at once, from the last good catalog
    status, headers, body = fast
    assert status == "200 OK" and body == first.data
    assert _stale_age(headers.get(CATALOG_HEADER)) >= 0
    assert _stale_age(_direct(app, meta, {})[1].get(CATALOG_HEADER)) >= 0
    for path in (cached, uncached, meta):  # Flask's answers too, rendered or not
        resp = client.get(path)
        assert resp.status_code == 200, path
        _stale_age(resp.headers.get(CATALOG_HEADER))
    metrics = client.get("/metrics").get_data(as_text=True)
    assert "wheelhouse_catalog_stale 1.0" in metrics
    assert "wheelhouse_catalog_stale_answers_total" in metrics

    outage.end()
    svc.catalog.refresh()
    resp = client.get(cached)
    assert resp.status_code == 200 and CATALOG_HEADER not in resp.headers
    assert CATALOG_HEADER not in _direct(app, cached, {})[1]
    assert "wheelhouse_catalog_stale 0.0" in client.get("/metrics").get_data(as_text=True)


def test_storage_down_at_start_up_answers_503_until_it_returns(
    app_config: Any, published: list[Record], tmp_path: Any
) -> None:
    """The server starts, answers what needs no catalog, and 503 (with a message, never a
    redirect upstream or a 500) for what does, on the fast path too; then recovers alone."""
    from web import create_app
    from wheelhouse.index.storage import open_storage

    storage = open_storage(app_config)
    outage = Outage(storage, tmp_path)
    outage.begin()
    app = create_app(app_config, storage=storage)  # does not raise
    client = app.test_client()
    assert client.get("/healthz").status_code == 200
    guard = app.wsgi_app
    assert isinstance(guard, RequestGuard)  # in front of the fast path, which every request
    assert isinstance(guard.next, CachedPages)  # below passes
    page = f"/{VARIANT}/simple/demo-ext/"
    for path, accept in ((page, UV_ACCEPT), (page, "text/html"), (f"/{VARIANT}/simple/", ""),
                         (f"/files/{VARIANT}/{published[0].project}/{published[0].filename}",
                          "")):
        resp = client.get(path, headers={"Accept": accept} if accept else {})
        assert resp.status_code == 503, path
        assert resp.headers["Retry-After"] == "10"
        assert "catalog has not been read from storage yet" in resp.get_data(as_text=True)
    assert "wheelhouse_catalog_stale 1.0" in client.get("/metrics").get_data(as_text=True)

    outage.end()
    resp = client.get(page, headers={"Accept": UV_ACCEPT})
    assert resp.status_code == 200 and published[0].filename in resp.get_data(as_text=True)
