"""Liveness, readiness, metrics and request ids."""

from __future__ import annotations

from pathlib import Path

import requests
from flask.testing import FlaskClient

from tests.helpers import start_index
from tests.web.conftest import VARIANT
from web import create_app
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record


def test_healthz(client: FlaskClient) -> None:
    resp = client.get("/healthz")
    assert resp.status_code == 200 and resp.data == b"ok\n"


def test_readyz_checks_storage_catalog_and_redis(any_config: Config, redis_url: str) -> None:
    client = create_app(any_config.replace(redis_url=redis_url)).test_client()
    resp = client.get("/readyz")
    assert resp.status_code == 200
    body = resp.get_json()
    assert body["ready"] is True
    assert set(body["checks"]) == {"storage", "catalog", "redis"}
    for check in body["checks"].values():
        assert check["ok"] is True and check["error"] is None and check["last_ok"]
        assert check["last_error"] is None


def test_readyz_fails_fast_when_redis_is_down_and_keeps_the_last_error(tmp_path: Path) -> None:
    from tests.helpers import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    client = create_app(Config(storage=str(tmp_path), redis_url=dead)).test_client()
    resp = client.get("/readyz")
    assert resp.status_code == 503 and resp.headers["Cache-Control"] == "no-store"
    body = resp.get_json()
    assert body["ready"] is False
    redis = body["checks"]["redis"]
    assert redis["ok"] is False and "unreachable" in redis["error"]
    assert redis["last_error"] == redis["error"] and redis["last_error_at"]
    assert body["checks"]["storage"]["ok"] is True  # one dependency down is said as such


def test_request_id_is_returned_and_sanitized(client: FlaskClient) -> None:
    assert client.get("/healthz", headers={"X-Request-ID": "abc-123"}).headers[
        "X-Request-ID"] == "abc-123"
    rid = client.get("/healthz", headers={"X-Request-ID": "<script>"}).headers["X-Request-ID"]
    assert rid != "<script>" and len(rid) == 32


def test_metrics_merge_across_gunicorn_workers(tmp_path: Path, redis_url: str) -> None:
    """Under 4 gunicorn processes, /metrics counts every process's requests."""
    from tests.helpers import make_wheel
    from wheelhouse.builds.stats import record_build
    from wheelhouse.index.publish import publish
    from wheelhouse.index.storage import open_storage
    from wheelhouse.variants import parse_variant

    config = Config(storage=str(tmp_path / "data"), redis_url=redis_url, upstream="off")
    w = make_wheel(tmp_path, "demo-ext", "1.0+cu128torch2.8")
    publish(open_storage(config), w, parse_variant(VARIANT))
    import redis

    record_build(redis.Redis.from_url(redis_url), state="built", seconds=42.0, reaped=7,
                 pauses=3)
    with start_index(config, tmp_path, workers=4) as url, requests.Session() as s:
        for _ in range(60):
            assert s.get(f"{url}/{VARIANT}/simple/demo-ext/", timeout=5).status_code == 200
        text = s.get(f"{url}/metrics", timeout=5).text
    lines = [ln for ln in text.splitlines() if ln.startswith("wheelhouse_http_requests_total")
             and 'route="/<variant_key>/simple/<name>/"' in ln and 'status="200"' in ln]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == 60
    assert "wheelhouse_catalog_files 1.0" in text
    assert "wheelhouse_reaped_processes_total 7.0" in text
    assert "wheelhouse_governor_pauses_total 3.0" in text
    assert 'wheelhouse_builds_ended_total{state="built"} 1.0' in text
    assert "wheelhouse_build_duration_seconds_count 1.0" in text
    assert 'wheelhouse_page_cache_total{result="hit"}' in text


def test_metrics_without_multiprocess(client: FlaskClient, published: list[Record]) -> None:
    client.get(f"/{VARIANT}/simple/demo-ext/")
    text = client.get("/metrics").get_data(as_text=True)
    assert "wheelhouse_http_requests_total" in text
    assert "wheelhouse_catalog_files 3.0" in text


def test_metric_labels_come_from_a_closed_set(tmp_path: Path) -> None:
    """Invented methods and unknown paths don't add label values (each one a time series)."""
    client = create_app(Config(storage=str(tmp_path / "data"), upstream="off")).test_client()
    for i in range(50):
        client.open(f"/no/such/page/{i}", method=f"BREW{i}")
        client.open("/healthz", method=f"X-{i}")
        client.get(f"/nothing-{i}")
    text = client.get("/metrics").get_data(as_text=True)
    lines = [ln for ln in text.splitlines() if ln.startswith("wheelhouse_http_requests_total{")]
    methods = {ln.split('method="')[1].split('"')[0] for ln in lines}
    routes = {ln.split('route="')[1].split('"')[0] for ln in lines}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}
    assert "other" in methods
    assert routes <= {"unmatched", "/healthz", "/metrics"}
    assert not any("BREW" in ln or "nothing-" in ln for ln in lines)
