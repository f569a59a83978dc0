"""What the server refuses before any view sees it, each with a 4xx and a message.

- :class:`RequestGuard`, a WSGI middleware in front of everything (the fast path included):
  a ``Host`` header that is not a host name, an IPv4 or an IPv6 literal with an optional port
  (Werkzeug would fail on it while building the request's URLs, even on the error page), and a
  URL whose percent-encoding is malformed or does not decode to UTF-8.
- :func:`configure`: Flask's limits on request bodies and forms (413 past :data:`MAX_BODY`;
  the upload routes of ``web.upload`` alone raise them, per request, to
  ``WHEELHOUSE_UPLOAD_MAX_MIB`` before reading the body, and ``PUT /api/sources/<name>`` of
  ``web.api`` to ``WHEELHOUSE_SDIST_UPLOAD_MAX_MIB``),
  and :class:`BoundedJSON`, which refuses JSON nested deeper than :data:`MAX_JSON_DEPTH`
  (Python's parser would recurse until a ``RecursionError``), with the reason in the 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote_to_bytes

from flask import Flask, Request
from flask.json.provider import DefaultJSONProvider
from werkzeug.exceptions import BadRequest

from web.metrics import Metrics

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

#: The largest request body read: build requests and forms are a few hundred bytes.
MAX_BODY = 64 * 1024
#: The most form fields (a build request lists a few Pythons and archs).
MAX_FORM_PARTS = 200
#: The deepest JSON accepted; a build request is two levels deep.
MAX_JSON_DEPTH = 32

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"(?:\[[0-9A-Fa-f:.]{{2,45}}\]|{_LABEL}(?:\.{_LABEL})*\.?)(?::[0-9]{{1,5}})?")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def host_problem(host: str) -> str | None:
    """Why ``host`` (a ``Host`` header) is refused, or None."""
    if len(host) > 260 or not _HOST.fullmatch(host):
        return "the Host header is not a host name or address (with an optional port)"
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    try:
        name.encode("ascii").decode("idna")  # "xn--" labels must be real punycode
    except UnicodeError:
        return "the Host header is not a valid internationalized host name"
    return None


def url_problem(environ: dict[str, Any]) -> str | None:
    """Why the request's URL is refused (malformed or non-UTF-8 percent-encoding), or None."""
    path: str = environ.get("PATH_INFO", "")
    if not path.isascii():
        # WSGI servers hand over the decoded path as Latin-1: it must be UTF-8 underneath.
        try:
            path.encode("latin-1").decode("utf-8")
        except UnicodeError:
            return "the URL path is not UTF-8 once percent-decoded"
    raw: str = environ.get("RAW_URI") or environ.get("REQUEST_URI") or ""
    if "%" in raw and _BAD_ESCAPE.search(raw.partition("?")[0]):
        return "the URL path has a malformed percent-escape (% not followed by two hex digits)"
    query: str = environ.get("QUERY_STRING", "")
    if "%" in query:
        if _BAD_ESCAPE.search(query):
            return ("the query string has a malformed percent-escape "
                    "(% not followed by two hex digits)")
        try:
            unquote_to_bytes(query).decode("utf-8")
        except UnicodeError:
            return "the query string is not UTF-8 once percent-decoded"
    elif not query.isascii():
        try:
            query.encode("latin-1").decode("utf-8")
        except UnicodeError:
            return "the query string is not UTF-8"
    return None


class RequestGuard:
    """WSGI middleware that answers 400 for a bad ``Host`` or URL before anything else runs."""

    #: Hosts already found good; clients send few distinct ones (bounded all the same).
    _KNOWN_MAX = 64

    def __init__(self, next_app: WSGIApp, metrics: Metrics) -> None:
        self.next = next_app
        self.metrics = metrics
        self._good_hosts: set[str] = set()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        problem = None
        host = environ.get("HTTP_HOST")
        if host and host not in self._good_hosts:
            problem = host_problem(host)
            if problem is None:
                if len(self._good_hosts) >= self._KNOWN_MAX:
                    self._good_hosts.clear()
                self._good_hosts.add(host)
        problem = problem or url_problem(environ)
        if problem is None:
            return self.next(environ, start_response)
        method = str(environ.get("REQUEST_METHOD", ""))
        if str(environ.get("PATH_INFO", "")).startswith("/api/"):
            body = json.dumps({"error": problem, "status": 400}).encode()
            content_type = "application/json"
        else:
            body = (problem + "\n").encode()
            content_type = "text/plain; charset=utf-8"
        self.metrics.count_request("unmatched", method, 400, len(body))
        start_response("400 BAD REQUEST", [("Content-Type", content_type),
                                           ("Content-Length", str(len(body))),
                                           ("Cache-Control", "no-store")])
        return [] if method == "HEAD" else [body]


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (iteratively: no recursion to exhaust)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in item)
    return deepest


class BoundedJSON(DefaultJSONProvider):
    """Flask's JSON, refusing documents nested deeper than :data:`MAX_JSON_DEPTH`.

    Flask turns the ``ValueError`` into a 400 that says why.
    """

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        try:
            data = json.loads(s, **kwargs)
        except RecursionError:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
        if _depth(data) > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return data


class GuardedRequest(Request):
    """Flask's request, saying why a JSON body was refused (Flask hides it outside debug)."""

    def on_json_loading_failed(self, e: ValueError | None) -> Any:
        if e is None:
            return super().on_json_loading_failed(e)  # wrong Content-Type: 415
        raise BadRequest(f"the body is not valid JSON: {e}")


def configure(app: Flask) -> None:
    """Flask's own limits: bodies, forms and JSON (each a 4xx with a message)."""
    app.config.update(MAX_CONTENT_LENGTH=MAX_BODY, MAX_FORM_MEMORY_SIZE=MAX_BODY,
                      MAX_FORM_PARTS=MAX_FORM_PARTS)
    app.json = BoundedJSON(app)
    app.request_class = GuardedRequest
