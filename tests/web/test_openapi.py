"""The JSON API against its OpenAPI description, with schemathesis generating the requests:
no 500, and every answer's status, content type and body as described."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, settings
from redis import Redis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.web.buildhelpers import advertise_worker, close_redis, make_app, token

OPENAPI = Path(__file__).resolve().parents[2] / "web" / "static" / "openapi.json"
schema = schemathesis.openapi.from_path(str(OPENAPI))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture
def api(redis_url: str, tmp_path: Path, conn: Redis) -> Iterator[tuple[Flask, dict[str, str]]]:
    """An app with a live (advertised) worker and a token that may build; rate limits high
    enough that generated requests are judged on their content, not their number."""
    advertise_worker(conn)
    app = make_app(redis_url, tmp_path, rate_limit="100000/60")
    yield app, {"Authorization": f"Bearer {token(conn)}"}
    close_redis(app)


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
def test_the_api_answers_as_described(case: schemathesis.Case,
                                      api: tuple[Flask, dict[str, str]]) -> None:
    app, auth = api
    case.call_and_validate(app=app, headers=auth, checks=CHECKS)


def test_the_description_is_served(api: tuple[Flask, dict[str, str]]) -> None:
    app, _ = api
    resp = app.test_client().get("/api/openapi.json")
    assert resp.status_code == 200 and resp.is_json
    assert resp.json == json.loads(OPENAPI.read_text())
