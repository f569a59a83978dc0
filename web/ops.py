"""Operating endpoints and hooks: liveness, readiness, metrics, request ids and JSON logs."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from flask import Blueprint, Flask, Response, g, jsonify, request

from web.services import Services, services

bp = Blueprint("ops", __name__)
access_log = logging.getLogger("wheelhouse.access")


@bp.get("/healthz")
def healthz() -> Response:
    """Liveness: the process is serving. It touches neither storage nor Redis (the hooks stand
    aside for it too), so a dependency that hangs never makes a live server look dead."""
    return Response("ok\n", mimetype="text/plain", headers={"Cache-Control": "no-store"})


@bp.get("/readyz")
def readyz() -> Response:
    """Readiness: storage, the catalog's refresh and (if configured) Redis, each checked within
    a short deadline and reported with its last error; 503 while any of them fails."""
    ok, checks = services().readiness.report()
    resp = jsonify({"ready": ok, "checks": checks})
    resp.status_code = 200 if ok else 503
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.get("/metrics")
def prometheus() -> Response:
    svc = services()
    body, content_type = svc.metrics.scrape(svc.catalog, svc.redis)
    return Response(body, content_type=content_type)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update(getattr(record, "fields", {}))
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data)


def init_app(app: Flask, svc: Services) -> None:
    @app.after_request
    def _count(resp: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        svc.metrics.count_request(route, request.method, resp.status_code, resp.content_length)
        return resp

    @app.before_request
    def _request_id() -> None:
        incoming = request.headers.get("X-Request-ID", "")
        # Accept a caller's id only if it is short and plain; never echo arbitrary bytes.
        ok = 0 < len(incoming) <= 64 and incoming.replace("-", "").isalnum()
        g.request_id = incoming if ok else uuid.uuid4().hex
        g.t0 = time.monotonic()

    @app.after_request
    def _log(resp: Response) -> Response:
        resp.headers["X-Request-ID"] = g.get("request_id", "")
        if svc.config.log_json:
            access_log.info("request", extra={"fields": {
                "request_id": g.get("request_id"), "method": request.method,
                "path": request.path, "status": resp.status_code,
                "bytes": resp.content_length,
                "ms": round((time.monotonic() - g.get("t0", time.monotonic())) * 1000, 2),
                "user_agent": request.headers.get("User-Agent", "")[:200],
            }})
        return resp

    if svc.config.log_json and not access_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
