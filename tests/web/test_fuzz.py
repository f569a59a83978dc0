"""Property: whatever a client sends to any route, the answer is 2xx, 3xx, 4xx or 503, and an
error answer carries a message. Never a 500.

Hypothesis builds each request from every route of the app (path parameters of arbitrary
unicode, huge values, malformed percent-escapes), odd methods, odd headers (Accept, Range,
Authorization, cookies, conditional requests), odd query strings and bodies (bytes, deep or
huge JSON, forms with the API's fields, near-valid build requests), sent signed out, with a
good or bad token, or signed in with a CSRF token. Requests go through Werkzeug's test client
(fast); a smaller sample of raw HTTP oddities goes to a real gunicorn server in
``tests/e2e/test_raw_http.py``. What was sent and seen is written to
``test-artifacts/fuzz-web.json``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis

from tests.helpers import make_wheel
from tests.web.buildhelpers import (
    GOOD,
    advertise_worker,
    close_redis,
    make_app,
    sign_in,
    token,
)
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant

#: Generated requests per route (about 600 in all); raise it locally to search harder.
EXAMPLES_PER_ROUTE = 25
VARIANT = "torch2.8-cu128"
FILENAME = "demo_ext-1.0+cu128torch2.8-py3-none-any.whl"
ODD_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
               "PROPFIND", "BREW", "get", "X" * 40]

# -- values --

_text = st.text(st.characters(codec="utf-8"), max_size=40)
_chars = st.sampled_from(["a", "é", "🦀", "%", "/", "\x00"])
#: Huge for a URL (servers refuse request lines past a few KiB; gunicorn at 4 KiB) ...
_huge = st.builds(lambda c, n: c * n, _chars, st.integers(1_000, 4_000))
#: ... and for a body, past the 64 KiB the server reads.
_huge_body = st.builds(lambda c, n: (c * n).encode(), _chars, st.integers(1_000, 70_000))
_escapes = st.sampled_from(["%", "%z", "%zz", "%ff", "%fe%ff", "%C3", "%00", "%2F", "%2e%2e",
                            "%25", "%u00e9", "%%", "%0d%0a", "%09"])
_known = st.sampled_from(["flash-attn", "demo-ext", VARIANT, "torch2.8-cu128-sm90", FILENAME,
                          FILENAME + ".metadata", "2.8.3", "12.8", "3.11", "sm90", "..", ".",
                          "build-x", "0", "-1", "1e9", "x" * 300])
value = st.one_of(_text, _known, st.integers().map(str), _escapes,
                  st.one_of(_text, _known, _huge))  # huge about one value in ten


def _segment(raw: str, escape: str | None) -> str:
    """A path segment: the value percent-encoded, sometimes with a raw (malformed) escape."""
    quoted = quote(raw, safe="")
    return quoted + escape if escape is not None else quoted


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                    exclude_characters="\x7f"), max_size=200)
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                       value)
# Shallow on purpose (generating deep trees is slow); deep JSON has its own tests in
# test_guard.py.
json_value = st.one_of(_json_leaf, st.lists(_json_leaf, max_size=4),
                       st.dictionaries(value, _json_leaf, max_size=4),
                       st.dictionaries(value, st.lists(_json_leaf, max_size=3), max_size=3))
_fields = ["project", "version", "torch", "cuda", "python", "archs", "machine", "rerun_failed",
           "rerun", "token", "next", "csrf_token"]
near_valid = st.fixed_dictionaries(
    {k: st.one_of(st.just(v), json_value) for k, v in GOOD.items()},
    optional={"machine": st.one_of(st.just("x86_64"), value),
              "rerun_failed": st.one_of(st.booleans(), json_value),
              "surprise": json_value})


@dataclass
class Request:
    method: str
    path: str
    rule: str
    query: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes | dict[str, Any] | None = None
    who: str = "anonymous"


@st.composite
def requests_for(draw: st.DrawFn, rules: list[tuple[str, list[str]]]) -> Request:
    rule, methods = draw(st.sampled_from(rules))
    parts = []
    for piece in rule.split("/"):
        if piece.startswith("<"):
            raw = draw(value)
            escape = draw(st.one_of(st.none(), _escapes)) if draw(st.booleans()) else None
            parts.append(_segment(raw, escape))
        else:
            parts.append(piece)
    method = draw(st.one_of(st.sampled_from(methods), st.sampled_from(ODD_METHODS)))
    pairs = draw(st.lists(st.tuples(st.one_of(st.sampled_from([*_fields, "offset", "format"]),
                                              _text), value), max_size=4))
    query = "&".join(f"{quote(k)}={quote(v)}" for k, v in pairs)
    if draw(st.booleans()):
        query += draw(st.one_of(_escapes, st.just("&&=&"), st.just("a=%"), st.just("%ff=1")))
    headers: dict[str, str] = {}
    for name in draw(st.lists(st.sampled_from([
            "Accept", "Range", "If-None-Match", "If-Range", "Authorization", "Cookie",
            "X-Request-ID", "User-Agent", "X-CSRF-Token", "Content-Type", "Accept-Encoding",
            "Referer", "Origin", "X-Forwarded-For"]), unique=True, max_size=5)):
        headers[name] = draw(st.one_of(header_text, st.sampled_from([
            "application/vnd.pypi.simple.v1+json", "text/html;q=0.1, */*", "bytes=-1",
            "bytes=0-0,5-", "bytes=99999999999999999999-", "Bearer whk_" + "A" * 43,
            "Basic !!!", "Basic " + "QQ==" * 2000, "application/json", "multipart/form-data",
            "wheelhouse_session=garbage", '"etag", W/"x"', "*"])))
    body_kind = draw(st.sampled_from(["none", "bytes", "json", "near-valid", "form"]))
    data: bytes | dict[str, Any] | None = None
    if body_kind == "bytes":
        data = draw(st.one_of(st.binary(max_size=300), _huge_body))
    elif body_kind == "json":
        data = json.dumps(draw(json_value)).encode()
        headers.setdefault("Content-Type", "application/json")
    elif body_kind == "near-valid":
        data = json.dumps(draw(near_valid)).encode()
        headers["Content-Type"] = "application/json"
    elif body_kind == "form":
        form = draw(st.dictionaries(st.sampled_from(_fields), value, max_size=6))
        data = {k: v.replace("\x00", "") for k, v in form.items()}
        headers.pop("Content-Type", None)
    who = draw(st.sampled_from(["anonymous", "token", "bad-token", "signed-in"]))
    return Request(method, "/".join(parts) or "/", rule, query, headers, data, who)


# -- the app under test --


@dataclass
class Target:
    app: Flask
    clients: dict[str, FlaskClient]
    csrf: str
    good_token: str


@pytest.fixture
def target(redis_url: str, tmp_path: Path, conn: Redis) -> Iterator[Target]:
    app = make_app(redis_url, tmp_path, rate_limit="1000000/60",
                   login_rate_limit="1000000/60", upstream="https://up.example/simple/")
    variant = parse_variant(VARIANT)
    publish(open_storage(app.extensions["wheelhouse"].config),
            make_wheel(tmp_path / "w", "demo-ext", f"1.0+{variant.local_label}"), variant)
    advertise_worker(conn, ttl=3600)
    tok = token(conn)
    signed_in = app.test_client()
    csrf = sign_in(signed_in, tok)
    clients = {"anonymous": app.test_client(), "token": app.test_client(),
               "bad-token": app.test_client(), "signed-in": signed_in}
    yield Target(app, clients, csrf, tok)
    close_redis(app)


def _send(t: Target, req: Request) -> Any:
    headers = dict(req.headers)
    if req.who == "token":
        headers["Authorization"] = f"Bearer {t.good_token}"
    elif req.who == "bad-token":
        headers["Authorization"] = "Bearer whk_" + "B" * 43
    data = req.data
    if req.who == "signed-in" and isinstance(data, dict) and "csrf_token" not in data:
        data = {**data, "csrf_token": t.csrf}
    return t.clients[req.who].open(req.path, method=req.method, query_string=req.query,
                                   headers=headers, data=data)


def _judge(req: Request, resp: Any) -> None:
    status = resp.status_code
    assert status < 500 or status == 503, (status, req, resp.get_data()[:500])
    if status >= 400 and req.method.upper() != "HEAD":
        assert resp.get_data().strip(), (status, req)  # an error says why


def test_no_request_gets_a_500(target: Target, artifacts_dir: Path) -> None:
    rules = sorted((r.rule, sorted(r.methods or ())) for r in target.app.url_map.iter_rules())
    seen: Counter[int] = Counter()
    per_rule: Counter[str] = Counter()

    # One property run per route, so that each gets its share of the examples.
    for rule in rules:
        @given(req=requests_for([rule]))
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        def answers_sanely(req: Request) -> None:
            resp = _send(target, req)
            try:
                _judge(req, resp)
            finally:
                resp.close()
            seen[resp.status_code] += 1
            per_rule[req.rule] += 1

        answers_sanely()
    assert set(per_rule) == {rule for rule, _ in rules}
    (artifacts_dir / "fuzz-web.json").write_text(json.dumps({
        "requests": sum(seen.values()), "statuses": dict(sorted(seen.items())),
        "per_route": dict(sorted(per_rule.items()))}, indent=1))
