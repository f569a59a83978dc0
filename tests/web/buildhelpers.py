"""Helpers for the build API, pages and auth tests: a real app over real Redis and storage."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from flask import Flask
from flask.testing import FlaskClient
from redis import Redis

from web import create_app
from wheelhouse.builds.fleet import ToolkitInfo, WorkerAd, advertise
from wheelhouse.config import Config
from wheelhouse.index.tokens import create_token

#: One build request the fleet advertised by :func:`advertise_worker` can serve.
GOOD = {"project": "flash-attn", "version": "2.8.3", "torch": "2.8", "cuda": "12.8",
        "python": ["3.11"], "archs": ["sm90"]}


def make_app(redis_url: str, tmp_path: Path, **overrides: Any) -> Flask:
    # The workspace too: uploads and /api/provenance/ca.pem make the box's CA there.
    settings: dict[str, Any] = {"storage": str(tmp_path / "data"), "redis_url": redis_url,
                                "workspace": str(tmp_path / "work"),
                                "catalog_refresh_seconds": 0.0, "upstream": "off",
                                # No network here: the torch check is tested with a fake index.
                                "torch_check": False}
    config = Config(**(settings | overrides))
    app = create_app(config)
    app.testing = True
    MADE.append(app)
    return app


#: Every app :func:`make_app` made; ``tests/web/conftest.py`` closes their Redis connections
#: after each test (:func:`close_made_apps`).
MADE: list[Flask] = []


def close_made_apps() -> None:
    while MADE:
        close_redis(MADE.pop())


def close_redis(app: Flask) -> None:
    """Close the app's Redis connections now, not whenever the garbage collector gets to them
    (a socket it reaches before its connection warns, and warnings are errors here)."""
    with app.app_context():
        from web.services import services

        conn = services().redis
        if conn is not None:
            conn.close()


def advertise_worker(conn: Redis, *, cuda: str = "12.8", machine: str = "x86_64",
                     name: str = "gpu-1", ttl: float = 120) -> WorkerAd:
    """Advertise a worker the way ``wheelhouse worker`` does (the fleet's real Redis keys)."""
    from wheelhouse.builds.fleet import queues_for

    ad = WorkerAd(name=name, hostname="gpu-host", machine=machine, cores=64,
                  memory_bytes=512 * 1024**3,
                  toolkits=(ToolkitInfo(cuda=cuda, home=f"/usr/local/cuda-{cuda}",
                                        nvcc=f"/usr/local/cuda-{cuda}/bin/nvcc"),),
                  queues=queues_for([cuda], machine))
    advertise(conn, ad, ttl=ttl)
    return ad


def token(conn: Redis, name: str = "alice", scopes: tuple[str, ...] = ("build", "read")) -> str:
    return create_token(conn, name, scopes)


def bearer(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m is not None, "the page has no CSRF field"
    return m.group(1)


def sign_in(client: FlaskClient, tok: str) -> str:
    """Sign in through the login form; return the session's CSRF token."""
    page = client.get("/login")
    resp = client.post("/login", data={"token": tok, "csrf_token": csrf_of(page.text),
                                       "next": "/request"})
    assert resp.status_code == 302, resp.text
    return csrf_of(client.get("/request").text)
