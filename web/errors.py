"""Every error becomes a clear response here, in one place; never a traceback page."""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException, InternalServerError
from werkzeug.wrappers import Response as BaseResponse

from wheelhouse.errors import (
    AlreadyPublished,
    InvalidBuildSpec,
    InvalidProjectName,
    InvalidVariant,
    InvalidWheel,
    StorageError,
    TokenError,
    UnservableSpec,
    WheelhouseError,
)

log = logging.getLogger(__name__)

#: Domain errors -> HTTP status. Order matters: first match wins.
STATUS: list[tuple[type[Exception], int]] = [
    (InvalidVariant, 404),
    (InvalidProjectName, 404),
    (InvalidWheel, 404),
    (AlreadyPublished, 409),
    (InvalidBuildSpec, 400),
    (UnservableSpec, 409),
    (TokenError, 400),
    (StorageError, 503),
    (WheelhouseError, 400),
]


_KEPT_HEADERS = frozenset({"Content-Range", "Allow", "WWW-Authenticate", "Retry-After"})


def _wants_json() -> bool:
    if request.path.startswith("/api/"):
        return True
    best = request.accept_mimetypes.best_match(["text/html", "application/json"])
    return best == "application/json" or "json" in request.headers.get("Accept", "")[:40]


def error_response(status: int, message: str) -> Response:
    if _wants_json():
        resp = jsonify({"error": message, "status": status})
        resp.status_code = status
        return resp
    if request.path.startswith(("/files/",)) or "/simple/" in request.path:
        return Response(message + "\n", status=status, mimetype="text/plain")
    html = render_template("error.html", status=status, message=message)
    return Response(html, status=status, mimetype="text/html")


def register(app: Flask) -> None:
    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> BaseResponse:
        if exc.code is not None and 300 <= exc.code < 400:
            return exc.get_response()  # routing redirects
        resp = error_response(exc.code or 500, exc.description or exc.name)
        for k, v in exc.get_headers():
            if k in _KEPT_HEADERS:
                resp.headers[k] = v
        return resp

    @app.errorhandler(WheelhouseError)
    def _domain(exc: WheelhouseError) -> Response:
        for kind, status in STATUS:
            if isinstance(exc, kind):
                return error_response(status, str(exc))
        return error_response(400, str(exc))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, InternalServerError.description)
