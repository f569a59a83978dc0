"""Index-page cache hits answered before Flask builds a request context.

uv and pip fetch the same project pages over and over; once a page is rendered (by the Flask
view in ``web.simple``) it is a dictionary look-up away. This WSGI middleware does that look-up
and answers directly; everything else (misses, other routes, read-protected indexes, callers
that send a request id, JSON logging) goes to Flask unchanged. It is given the app's
:class:`~web.services.Services`, so it uses the same page cache, negotiated formats, metadata
bodies and metrics as the views, and the two paths give identical answers.

It answers only what it can answer whole: when the catalog is unreadable (storage down since
start-up) it hands the request to Flask, whose error handling (``web.errors``) answers 503, so
the fast path never turns storage trouble into a 500. While the catalog is stale its answers
carry the same header as Flask's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from packaging.utils import NormalizedName

from web.caches import STATUS_LINES, etag_matches, origin
from web.errors import CATALOG_HEADER, catalog_header
from web.files import IMMUTABLE, METADATA_SUFFIX
from web.services import Services
from wheelhouse.errors import InvalidVariant, StorageError
from wheelhouse.variants import parse_variant

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
_ROUTES = {"root": "/<variant_key>/simple/", "project": "/<variant_key>/simple/<name>/",
           "file": "/files/<base_key>/<project>/<filename>"}
_METADATA_TYPE = "text/plain; charset=utf-8"


class CachedPages:
    """WSGI middleware in front of ``next_app`` (Flask's own WSGI callable)."""

    def __init__(self, next_app: WSGIApp, svc: Services) -> None:
        self.next = next_app
        self.catalog = svc.catalog
        self.pages = svc.pages
        self.formats = svc.formats
        self.metadata = svc.metadata
        self.metrics = svc.metrics
        # Read protection, JSON access logs and build-on-miss need Flask: leave them to it.
        self.enabled = not (svc.config.auth or svc.config.log_json or svc.config.build_on_miss)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            answer = self._answer(environ, start_response)
        except StorageError:
            # Nothing was started yet (start_response comes last): Flask answers it, through
            # the one place that maps errors to responses.
            answer = None
        return answer if answer is not None else self.next(environ, start_response)

    def _stale(self, headers: list[tuple[str, str]]) -> None:
        value = catalog_header(self.catalog)
        if value is not None:
            headers.append((CATALOG_HEADER, value))
            self.metrics.stale_answers.inc()

    def _answer(self, environ: dict[str, Any],
                start_response: StartResponse) -> Iterable[bytes] | None:
        method = environ.get("REQUEST_METHOD")
        if not self.enabled or method not in ("GET", "HEAD") or environ.get("QUERY_STRING") \
                or "HTTP_X_REQUEST_ID" in environ:
            return None
        parts = environ.get("PATH_INFO", "").split("/")
        if len(parts) == 5 and parts[1] == "files" and parts[4].endswith(METADATA_SUFFIX):
            return self._metadata(environ, start_response, method, parts[2], parts[3], parts[4])
        if len(parts) != 5 or parts[0] or parts[2] != "simple" or parts[4]:
            if len(parts) != 4 or parts[0] or parts[2] != "simple" or parts[3]:
                return None
            parts.insert(3, "")
        kind = "project" if parts[3] else "root"
        fmt = self.formats.get(environ.get("HTTP_ACCEPT", ""))
        if fmt is None:
            return None
        key = (origin(environ) + environ.get("SCRIPT_NAME", "") + kind, parts[1], parts[3],
               fmt)
        page = self.pages.get(self.catalog.generation, key)
        if page is not None and page.status != 200:
            # A redirect upstream may be what this process knew before another one published
            # the project: catch up with storage first (read your writes), as the view does.
            self.catalog.catch_up()
            page = self.pages.get(self.catalog.generation, key)
        if page is None:
            return None
        self.metrics.page_hit.inc()
        inm = environ.get("HTTP_IF_NONE_MATCH")
        if etag_matches(inm, page.etag):
            status, body = 304, b""
            headers = [*page.headers]
        else:
            status, body = page.status, page.body
            headers = [*page.headers, ("Content-Type", page.content_type),
                       ("Content-Length", str(len(body)))]
        headers.append(("X-Request-ID", os.urandom(16).hex()))
        self._stale(headers)
        self.metrics.count_request(_ROUTES[kind], method, status, len(body))
        start_response(STATUS_LINES[status], headers)
        return [] if method == "HEAD" else [body]

    def _metadata(self, environ: dict[str, Any], start_response: StartResponse, method: str,
                  base_key: str, project: str, filename: str) -> Iterable[bytes] | None:
        """A published wheel's METADATA whose body is already in memory (no ranges here)."""
        if "HTTP_RANGE" in environ:
            return None
        try:
            base = parse_variant(base_key)
        except InvalidVariant:
            return None
        # A name that isn't normalized finds nothing, and Flask answers it.
        record = self.catalog.find(base, NormalizedName(project),
                                   filename.removesuffix(METADATA_SUFFIX))
        body = self.metadata.get(record.metadata_key) if record is not None else None
        if record is None or body is None:
            return None
        etag = f'"{record.metadata_sha256}"'
        headers = [("ETag", etag), ("Cache-Control", IMMUTABLE), ("Accept-Ranges", "bytes"),
                   ("X-Request-ID", os.urandom(16).hex())]
        inm = environ.get("HTTP_IF_NONE_MATCH")
        if etag_matches(inm, etag):
            status, body = 304, b""
        else:
            status = 200
            headers += [("Content-Type", _METADATA_TYPE), ("Content-Length", str(len(body)))]
        self._stale(headers)
        self.metrics.count_request(_ROUTES["file"], method, status, len(body))
        start_response(STATUS_LINES[status], headers)
        return [] if method == "HEAD" else [body]

