"""Redis down: every route that needs it answers 503 with a message and Retry-After, token
checks included (never 401), the index keeps serving, and all of it recovers by itself.

Real redis-server, killed and restarted on the same port (append-only, as in production)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from tests.helpers import RedisProcess, make_wheel
from tests.web.buildhelpers import (
    GOOD,
    advertise_worker,
    bearer,
    close_redis,
    csrf_of,
    sign_in,
)
from web import create_app
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import create_token
from wheelhouse.redisconn import QueueClient, queue_client
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"
JOB = "build-flash-attn-2_8_3-py3_11-torch2_8-cu128-x86_64-0123456789ab"


@pytest.fixture
def redis_proc(tmp_path: Path) -> Iterator[RedisProcess]:
    with RedisProcess(tmp_path / "redis") as proc:
        yield proc


@pytest.fixture
def make(redis_proc: RedisProcess, tmp_path: Path) -> Iterator[Callable[..., Flask]]:
    """Apps over one published wheel and ``redis_proc``; their Redis clients are closed at
    the end (redis-py leaves a socket to the GC after a reconnect otherwise)."""
    made: list[Flask] = []

    def app(**overrides: str) -> Flask:
        config = Config(storage=str(tmp_path / "data"), redis_url=redis_proc.url,
                        upstream="off", catalog_refresh_seconds=0.0, secret_key="s" * 32,
                        **overrides)
        variant = parse_variant(VARIANT)
        wheel = make_wheel(tmp_path / "w", "demo-ext", f"1.0+{variant.local_label}")
        publish(open_storage(config), wheel, variant)
        made.append(create_app(config))
        made[-1].testing = True
        return made[-1]

    yield app
    for each in made:
        close_redis(each)


@pytest.fixture
def conn(redis_proc: RedisProcess) -> Iterator[QueueClient]:
    client = queue_client(Config(redis_url=redis_proc.url))
    yield client
    client.close()


def _is_503(resp: TestResponse, what: str) -> None:
    assert resp.status_code == 503, (what, resp.status_code, resp.text[:300])
    assert resp.headers["Retry-After"] == "10", what
    assert "build queue" in resp.text, what


def test_every_route_that_needs_redis_answers_503_then_recovers(
        redis_proc: RedisProcess, make: Callable[..., Flask], conn: QueueClient) -> None:
    app = make()
    advertise_worker(conn, ttl=3600)
    tok = create_token(conn, "alice")
    reader = app.test_client()
    browser = app.test_client()
    csrf = sign_in(browser, tok)
    [build] = reader.post("/api/builds", json=GOOD, headers=bearer(tok)).json["builds"]
    anonymous = app.test_client()
    login_csrf = csrf_of(anonymous.get("/login").text)

    redis_proc.kill()
    checks = {
        "matrix": lambda: reader.get("/matrix"),
        "build api": lambda: reader.get(f"/api/builds/{build['id']}"),
        "build log": lambda: reader.get(f"/api/builds/{build['id']}/log"),
        "workers": lambda: reader.get("/api/workers"),
        "request a build (a good token)": lambda: reader.post(
            "/api/builds", json=GOOD, headers=bearer(tok)),
        "cancel": lambda: reader.post(f"/api/builds/{build['id']}/cancel",
                                      headers=bearer(tok)),
        "sign in": lambda: anonymous.post("/login", data={"token": tok,
                                                          "csrf_token": login_csrf}),
        "request form (signed in)": lambda: browser.get("/request"),
        "request form POST": lambda: browser.post("/request", data={
            **GOOD, "python": "3.11", "csrf_token": csrf}),
        "build page": lambda: reader.get(f"/builds/{build['id']}"),
    }
    for what, ask in checks.items():
        _is_503(ask(), what)
    # What doesn't need Redis keeps working.
    assert reader.get("/healthz").status_code == 200
    assert reader.get(f"/{VARIANT}/simple/demo-ext/").status_code == 200
    assert reader.get("/").status_code == 200
    assert browser.get("/").status_code == 200  # the signed-in nav just shows "Sign in"
    assert anonymous.get("/login").status_code == 200
    ready = reader.get("/readyz")
    assert ready.status_code == 503 and not ready.json["checks"]["redis"]["ok"]

    redis_proc.start()  # no restart of the app: redis-py reconnects on the next command
    assert reader.get("/matrix").status_code == 200
    assert reader.get(f"/api/builds/{build['id']}").json["state"] == "queued"
    assert reader.get("/api/workers").status_code == 200
    assert browser.get("/request").status_code == 200  # still signed in
    assert reader.post(f"/api/builds/{build['id']}/cancel",
                       headers=bearer(tok)).status_code == 200
    assert reader.get("/readyz").status_code == 200


def test_a_private_index_answers_503_not_401_while_tokens_cant_be_checked(
        redis_proc: RedisProcess, make: Callable[..., Flask], conn: QueueClient) -> None:
    app = make(auth="token")
    reader_token = create_token(conn, "reader", ("read",))
    client: FlaskClient = app.test_client()
    page = f"/{VARIANT}/simple/demo-ext/"
    assert client.get(page, headers=bearer(reader_token)).status_code == 200
    signed_in = app.test_client()
    sign_in(signed_in, create_token(conn, "browser", ("build", "read")))
    redis_proc.kill()
    # Liveness asks nothing of Redis, whatever the request carries.
    for who, headers in ((signed_in, {}), (client, bearer(reader_token)),
                         (client, {"Authorization": "Basic !!"})):
        assert who.get("/healthz", headers=headers).status_code == 200
    _is_503(client.get(page, headers=bearer(reader_token)), "a read with a token")
    _is_503(client.get("/matrix", headers=bearer(reader_token)), "a page with a token")
    # No credentials: nothing to check, so the usual challenge.
    assert client.get(page).status_code == 401
    assert client.get("/healthz").status_code == 200
    redis_proc.start()
    assert client.get(page, headers=bearer(reader_token)).status_code == 200
