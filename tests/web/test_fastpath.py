"""Cache hits answered before Flask: identical to what the Flask view answers."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import EnvironBuilder

from tests.web.conftest import VARIANT
from tests.web.test_simple import UV_ACCEPT
from web.fastpath import CachedPages
from wheelhouse.catalog import Record

COMPARED = ("ETag", "Cache-Control", "Vary", "Content-Type", "Content-Length", "Location")


def _direct(app: Flask, path: str, headers: dict[str, str], method: str = "GET") -> Any:
    """Ask the middleware alone; None means it would hand the request to Flask."""
    middleware = app.wsgi_app
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
    from wheelhouse.publish import bump_generation

    bump_generation(app.extensions["wheelhouse"].storage)
    assert _direct(app, path, {}) is None  # new generation: Flask renders again


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
