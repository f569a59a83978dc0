"""Operating endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from flask import Blueprint, Flask, Response, jsonify

from web.app import services

bp = Blueprint("ops", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    """The process is alive and serving; touches nothing else."""
    return Response("ok\n", mimetype="text/plain", headers={"Cache-Control": "no-store"})


def init_app(app: Flask) -> None:
    """Placeholder for per-app hooks (metrics, request ids)."""


@bp.get("/readyz")
def readyz() -> Response:
    """Storage and (if configured) Redis answer within short timeouts."""
    svc = services()
    checks: dict[str, str] = {}
    ok = True
    try:
        svc.storage.ping()
        checks["storage"] = "ok"
    except OSError as exc:
        ok = False
        checks["storage"] = str(exc)
    if svc.redis is not None:
        from redis.exceptions import RedisError

        try:
            svc.redis.ping()
            checks["redis"] = "ok"
        except RedisError as exc:
            ok = False
            checks["redis"] = f"unreachable: {exc}"
    resp = jsonify({"ready": ok, "checks": checks})
    resp.status_code = 200 if ok else 503
    resp.headers["Cache-Control"] = "no-store"
    return resp
