"""Every error becomes a clear response here, in one place; never a traceback page.

Storage trouble included: an unreachable or damaged storage answers 503 with ``Retry-After``
(never 500), and while the catalog's refresh fails, answers built from the last good catalog
carry :data:`CATALOG_HEADER`. The fast path (``web.fastpath``) hands every request it cannot
answer cleanly to Flask, so these rules cover it too, and adds the header with
:func:`catalog_header`.
"""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException, InternalServerError
from werkzeug.wrappers import Response as BaseResponse

from web.services import Services
from wheelhouse.errors import (
    AlreadyPublished,
    DamagedFile,
    InvalidBuildSpec,
    InvalidProjectName,
    InvalidUpload,
    InvalidVariant,
    InvalidWheel,
    NothingPublished,
    NotOnUpstream,
    NotOwner,
    OutOfReach,
    ProvenanceUnavailable,
    QueueUnavailable,
    StorageError,
    TokenError,
    UnservableSpec,
    UploadTooLarge,
    UpstreamUnavailable,
    WheelhouseError,
)
from wheelhouse.index.catalog import Catalog

log = logging.getLogger(__name__)

#: Seconds a client is asked to wait before trying again when storage or the build queue is in
#: trouble: about what one failed storage call costs, so a retry meets a refreshed state.
RETRY_AFTER = "10"
#: Present while this process's catalog could not be refreshed: ``stale; age=<seconds since
#: storage last confirmed it>``.
CATALOG_HEADER = "X-Wheelhouse-Catalog"

#: Domain errors -> HTTP status. Order matters: first match wins.
STATUS: list[tuple[type[Exception], int]] = [
    (InvalidVariant, 404),
    (InvalidProjectName, 404),
    (InvalidWheel, 404),
    (UploadTooLarge, 413),
    (InvalidUpload, 400),
    (NotOwner, 403),
    (NothingPublished, 404),
    (OutOfReach, 403),
    (NotOnUpstream, 404),
    (AlreadyPublished, 409),
    (InvalidBuildSpec, 400),
    (UnservableSpec, 409),
    (TokenError, 400),
    (StorageError, 503),
    (UpstreamUnavailable, 503),
    (QueueUnavailable, 503),
    (ProvenanceUnavailable, 503),
    (WheelhouseError, 400),
]


_KEPT_HEADERS = frozenset({"Content-Range", "Allow", "WWW-Authenticate", "Retry-After"})


def _wants_json() -> bool:
    if request.path.startswith("/api/"):
        return True
    best = request.accept_mimetypes.best_match(["text/html", "application/json"])
    return best == "application/json" or "json" in request.headers.get("Accept", "")[:40]


def error_response(status: int, message: str) -> Response:
    """The answer for ``status``: JSON for the API, plain text for the index, else a page.

    It must not fail itself (an error page that raises is a 500, or worse an unhandled
    exception): a page that can't be rendered, whatever the reason, falls back to plain text.
    """
    try:
        if request.blueprint == "upload":
            return _for_uploaders(status, message)
        if _wants_json():
            resp = jsonify({"error": message, "status": status})
            resp.status_code = status
            return resp
        if not (request.path.startswith("/files/") or "/simple/" in request.path):
            html = render_template("error.html", status=status, message=message)
            return Response(html, status=status, mimetype="text/html")
    except Exception:
        log.exception("could not render the %d page; answering in plain text", status)
    return Response(message + "\n", status=status, mimetype="text/plain")


def _for_uploaders(status: int, message: str) -> Response:
    """Plain text, and the message as the status line's reason phrase too: twine shows only
    the reason phrase (PyPI answers the same way), uv the body."""
    resp = Response(message + "\n", status=status, mimetype="text/plain")
    line = "".join(c if c.isprintable() and ord(c) < 256 else "?"
                   for c in " ".join(message.split())[:400])
    resp.status = f"{status} {line}"
    return resp


def catalog_header(catalog: Catalog) -> str | None:
    """The value of :data:`CATALOG_HEADER` for an answer read from ``catalog``, if stale."""
    state = catalog.state()
    return f"stale; age={state.age:.0f}" if state.stale else None


def register(app: Flask, svc: Services) -> None:
    @app.after_request
    def _stale(resp: Response) -> Response:
        value = catalog_header(svc.catalog)
        if value is not None:
            resp.headers[CATALOG_HEADER] = value
            svc.metrics.stale_answers.inc()
        return resp

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
        if isinstance(exc, StorageError):
            return _storage(exc)
        if isinstance(exc, QueueUnavailable):
            return _queue(exc)
        for kind, status in STATUS:
            if isinstance(exc, kind):
                return error_response(status, str(exc))
        return error_response(400, str(exc))

    def _queue(exc: QueueUnavailable) -> Response:
        # The operator needs the detail (the cause: which address, refused or timed out); the
        # client a time to retry.
        log.warning("503 on %s %s: %s (%s)", request.method, request.path, exc,
                    exc.__cause__ or exc)
        resp = error_response(503, str(exc))
        resp.headers["Retry-After"] = RETRY_AFTER
        return resp

    def _storage(exc: StorageError) -> Response:
        damaged = isinstance(exc, DamagedFile)
        # One line, no traceback: the storage boundary already said what failed.
        log.log(logging.ERROR if damaged else logging.WARNING, "503 on %s %s: %s",
                request.method, request.path, exc)
        svc.metrics.storage_errors.labels("damaged" if damaged else "unavailable").inc()
        resp = error_response(503, str(exc))
        resp.headers["Retry-After"] = RETRY_AFTER
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, InternalServerError.description)
