"""PEP 503 / 691 / 658 / 700 / 714 simple-index pages, one index root per variant.

Pages are rendered once per catalog generation and kept as bytes with a strong ETag, so a
request costs a dictionary look-up; rendering costs O(files on the page).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass

from flask import Blueprint, Response, redirect, render_template, request, url_for
from packaging.utils import NormalizedName, canonicalize_name
from werkzeug.exceptions import NotFound
from werkzeug.wrappers import Response as BaseResponse

from web.app import services
from web.metrics import PAGE_CACHE
from wheelhouse.catalog import Record
from wheelhouse.errors import InvalidProjectName
from wheelhouse.variants import Variant, parse_variant

bp = Blueprint("simple", __name__)

JSON_V1 = "application/vnd.pypi.simple.v1+json"
HTML_V1 = "application/vnd.pypi.simple.v1+html"
_OFFERS = [JSON_V1, "application/vnd.pypi.simple.latest+json", HTML_V1,
           "application/vnd.pypi.simple.latest+html", "text/html"]
API_VERSION = "1.1"
MAX_PROJECT_LENGTH = 200


@dataclass(frozen=True)
class Page:
    body: bytes
    etag: str
    mimetype: str


class PageCache:
    """Rendered pages by (script root, variant, project, format), valid for one generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = ""
        self._pages: dict[tuple[str, str, str, str], Page] = {}

    def get(self, generation: str, key: tuple[str, str, str, str]) -> Page | None:
        if generation != self._generation:
            with self._lock:
                if generation != self._generation:
                    self._pages = {}
                    self._generation = generation
            return None
        return self._pages.get(key)

    def put(self, generation: str, key: tuple[str, str, str, str], page: Page) -> None:
        if generation == self._generation:
            self._pages[key] = page


def _cache() -> PageCache:
    from flask import current_app

    cache: PageCache = current_app.extensions.setdefault("wheelhouse_pages", PageCache())
    return cache


def negotiate() -> str:
    """``json`` or ``html`` from ``?format=`` or the Accept header that uv and pip send."""
    fmt = request.args.get("format")
    if fmt in (JSON_V1, "json"):
        return "json"
    if fmt in (HTML_V1, "text/html", "html"):
        return "html"
    best = request.accept_mimetypes.best_match(_OFFERS, default="text/html")
    return "json" if best and best.endswith("+json") else "html"


def _variant(key: str) -> Variant:
    return parse_variant(key)


def _project(name: str) -> NormalizedName:
    if len(name) > MAX_PROJECT_LENGTH or not name.isascii():
        raise InvalidProjectName("project name is not valid")
    normalized = canonicalize_name(name, validate=False)
    try:
        return canonicalize_name(name, validate=True)
    except Exception:
        raise InvalidProjectName(f"{normalized[:80]!r} is not a valid project name") from None


def _respond(page: Page, fmt: str) -> Response:
    max_age = services().config.page_max_age
    headers = {"ETag": page.etag, "Cache-Control": f"max-age={max_age}, public",
               "Vary": "Accept"}
    if request.if_none_match.contains(page.etag.strip('"')):
        return Response(status=304, headers=headers)
    return Response(page.body, mimetype=page.mimetype, headers=headers)


def _make_page(body: str | bytes, fmt: str) -> Page:
    data = body.encode() if isinstance(body, str) else body
    etag = '"' + hashlib.sha256(data).hexdigest()[:32] + '"'
    mimetype = JSON_V1 if fmt == "json" else "text/html"
    return Page(data, etag, mimetype)


_Key = tuple[str, str, str, str]


def _cached(kind: str, variant: Variant, project: str, fmt: str) -> tuple[str, _Key, Page | None]:
    generation = services().catalog.generation
    key = (request.script_root + kind, variant.key, project, fmt)
    page = _cache().get(generation, key)
    PAGE_CACHE.labels("hit" if page is not None else "miss").inc()
    return generation, key, page


@bp.get("/<variant_key>/simple/")
def root(variant_key: str) -> BaseResponse:
    variant = _variant(variant_key)
    fmt = negotiate()
    generation, key, page = _cached("root", variant, "", fmt)
    if page is None:
        projects = services().catalog.projects(variant)
        if fmt == "json":
            body: str = json.dumps({"meta": {"api-version": API_VERSION},
                                    "projects": [{"name": p} for p in projects]})
        else:
            body = render_template("simple_root.html", variant=variant, projects=projects,
                                   api_version=API_VERSION)
        page = _make_page(body, fmt)
        _cache().put(generation, key, page)
    return _respond(page, fmt)


@bp.get("/<variant_key>/simple")
def root_no_slash(variant_key: str) -> BaseResponse:
    _variant(variant_key)
    return redirect(url_for("simple.root", variant_key=variant_key), 301)


@bp.get("/<variant_key>/simple/<name>")
def project_no_slash(variant_key: str, name: str) -> BaseResponse:
    _variant(variant_key)
    project = _project(name)
    return redirect(url_for("simple.project", variant_key=variant_key, name=project), 301)


@bp.get("/<variant_key>/simple/<name>/")
def project(variant_key: str, name: str) -> BaseResponse:
    variant = _variant(variant_key)
    normalized = _project(name)
    if normalized != name:
        return redirect(url_for("simple.project", variant_key=variant_key, name=normalized), 301)
    fmt = negotiate()
    generation, key, page = _cached("project", variant, normalized, fmt)
    if page is None:
        files = services().catalog.files(variant, normalized)
        if not files:
            return _not_hosted(variant, normalized)
        page = _make_page(_render_project(normalized, files, fmt), fmt)
        _cache().put(generation, key, page)
    return _respond(page, fmt)


def _not_hosted(variant: Variant, project: NormalizedName) -> BaseResponse:
    upstream = services().router.url_for(project, variant)
    if upstream is None:
        raise NotFound(f"{project} is not hosted in {variant.key}, and upstream routing is off")
    return redirect(upstream, 302)


def _file_url(r: Record) -> str:
    return url_for("files.wheel", base_key=r.variant_obj.base.key, project=r.project,
                   filename=r.filename)


def _render_project(project: NormalizedName, files: list[Record], fmt: str) -> str:
    if fmt == "json":
        versions: dict[str, None] = {}
        entries = []
        for r in files:
            versions[r.version] = None
            entries.append({
                "filename": r.filename,
                "url": _file_url(r),
                "hashes": {"sha256": r.sha256},
                "requires-python": r.requires_python,
                "core-metadata": {"sha256": r.metadata_sha256},
                "dist-info-metadata": {"sha256": r.metadata_sha256},
                "yanked": r.yanked,
                "size": r.size,
                "upload-time": r.upload_time,
            })
        return json.dumps({"meta": {"api-version": API_VERSION}, "name": project,
                           "versions": list(versions), "files": entries})
    links = [(r, _file_url(r)) for r in files]
    return render_template("simple_project.html", project=project, links=links,
                           api_version=API_VERSION)
