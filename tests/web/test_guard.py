"""What is refused before a view runs: bad Host headers, bad percent-encoding, bodies too
large, JSON nested too deeply. Each is a 4xx with a message, never a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from redis import Redis
from werkzeug.test import EnvironBuilder

from tests.web.buildhelpers import GOOD, bearer, token
from web.guard import MAX_BODY, MAX_JSON_DEPTH, host_problem


def _wsgi(app: Flask, path: str = "/login", **environ: str) -> tuple[int, str, str]:
    """Call the app's WSGI callable directly, as a server would; (status, type, body).

    Werkzeug's test client itself fails on some hosts after the answer (it builds the URL for
    its cookie jar), so these requests skip it."""
    env = EnvironBuilder(path=path).get_environ()
    env.update(environ)
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(app.wsgi_app(env, start_response))
    return int(seen["status"].split()[0]), seen["headers"]["Content-Type"], body.decode()


@pytest.mark.parametrize("host", [
    "exa mple", "exämple", "a" * 300, "[::1", "x:notaport", "..", "-", "xn--a", "a/b",
    "a@b", "evil.example\r\nX-Injected: 1", "\x00", "ex%41mple", "a..b", "x:123456",
    "[::1]junk", "label" + "x" * 70 + ".com",
])
def test_bad_hosts_are_400_with_a_message(queue_app: Flask, host: str) -> None:
    status, content_type, body = _wsgi(queue_app, HTTP_HOST=host)
    assert status == 400 and content_type.startswith("text/plain")
    assert "Host header" in body
    status, content_type, body = _wsgi(queue_app, "/api/workers", HTTP_HOST=host)
    assert status == 400 and json.loads(body)["status"] == 400  # JSON on the API


@pytest.mark.parametrize("host", [
    "localhost", "localhost:8000", "wheels.internal", "WHEELS.example.com.", "10.0.0.1:80",
    "[::1]", "[::1]:8000", "[2001:db8::1]", "my_service:8000", "xn--bcher-kva.example",
])
def test_good_hosts_pass(queue_app: Flask, host: str) -> None:
    assert host_problem(host) is None
    status, _, _ = _wsgi(queue_app, HTTP_HOST=host)
    assert status == 200


@pytest.mark.parametrize(("query", "why"), [
    ("project=%zz", "malformed percent-escape"),
    ("project=100%", "malformed percent-escape"),
    ("project=%ff%fe", "not UTF-8"),
    ("project=%C3", "not UTF-8"),
])
def test_malformed_query_encoding_is_400(queue_client: FlaskClient, query: str, why: str) -> None:
    resp = queue_client.get(f"/login?{query}")
    assert resp.status_code == 400 and why in resp.text


@pytest.mark.parametrize("raw", ["/login/%zz", "/torch2.8-cu128/simple/a%2"])
def test_malformed_path_escapes_are_400(queue_app: Flask, raw: str) -> None:
    status, _, body = _wsgi(queue_app, raw, RAW_URI=raw, REQUEST_URI=raw)
    assert status == 400 and "malformed percent-escape" in body


def test_a_path_that_is_not_utf8_is_400(queue_app: Flask) -> None:
    # What a WSGI server hands over for /torch2.8-cu128/simple/%ff%fe/: the bytes as Latin-1.
    status, _, body = _wsgi(queue_app, PATH_INFO="/torch2.8-cu128/simple/\xff\xfe/")
    assert status == 400 and "not UTF-8" in body


def test_good_encodings_pass(queue_client: FlaskClient) -> None:
    assert queue_client.get("/login?next=%2Fmatrix%3Fproject%3Dflash-attn").status_code == 200
    assert queue_client.get("/login?next=/caf%C3%A9").status_code == 200


# -- bodies --


@pytest.fixture
def build_client(fleet_client: FlaskClient, conn: Redis) -> tuple[FlaskClient, str]:
    return fleet_client, token(conn)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000 // 2])
def test_deep_json_is_400_with_the_reason(build_client: tuple[FlaskClient, str],
                                         depth: int) -> None:
    client, tok = build_client
    body = "[" * depth + "]" * depth
    resp = client.post("/api/builds", data=body, headers={
        **bearer(tok), "Content-Type": "application/json"})
    if len(body) > MAX_BODY:
        assert resp.status_code == 413 and resp.is_json
    else:
        assert resp.status_code == 400 and "nested deeper than" in resp.json["error"]


def test_json_inside_the_limit_still_works(build_client: tuple[FlaskClient, str]) -> None:
    client, tok = build_client
    resp = client.post("/api/builds", json=GOOD, headers=bearer(tok))
    assert resp.status_code == 201


def test_a_non_json_body_says_what_to_send(build_client: tuple[FlaskClient, str]) -> None:
    client, tok = build_client
    resp = client.post("/api/builds", data="project=x", headers=bearer(tok))
    assert resp.status_code == 400 and "Content-Type: application/json" in resp.json["error"]


def test_oversized_form_bodies_are_413(queue_client: FlaskClient) -> None:
    resp = queue_client.post("/login", data={"token": "x" * (MAX_BODY + 1)})
    assert resp.status_code == 413 and "exceeds" in resp.text


def test_too_many_multipart_fields_are_413(queue_client: FlaskClient) -> None:
    import io

    fields: dict[str, Any] = {f"f{i}": "x" for i in range(1000)}
    fields["file"] = (io.BytesIO(b"x"), "x.txt")  # makes it multipart
    resp = queue_client.post("/login", data=fields)
    assert resp.status_code == 413
