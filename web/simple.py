"""PEP 503 / 691 / 658 / 700 / 714 simple-index pages, one index root per variant.

Pages are rendered once per catalog generation and kept as bytes with a strong ETag, so a
request costs a dictionary look-up; rendering costs O(files on the page).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from flask import (
    Blueprint,
    Response,
    redirect,
    render_template,
    request,
    url_for,
)
from packaging.utils import InvalidName, NormalizedName, canonicalize_name
from werkzeug.exceptions import NotFound
from werkzeug.wrappers import Response as BaseResponse

from web import onmiss
from web.caches import Page, PageKey, etag_matches, origin
from web.services import services
from wheelhouse.errors import InvalidProjectName
from wheelhouse.index import mirror, variantwheels
from wheelhouse.index.catalog import Listing, Record
from wheelhouse.index.layout import PROVENANCE_SUFFIX
from wheelhouse.index.ownership import pinned
from wheelhouse.variants import Variant, parse_variant
from wheelhouse.wheels import parse_name, split_variant_label

bp = Blueprint("simple", __name__)

JSON_V1 = "application/vnd.pypi.simple.v1+json"
HTML_V1 = "application/vnd.pypi.simple.v1+html"
# text/html first: a client that takes anything (``Accept: */*``, browsers, curl) gets HTML, as
# PEP 691 advises; the PEP 691 types win whenever they are asked for by name.
_OFFERS = ("text/html", JSON_V1, "application/vnd.pypi.simple.latest+json", HTML_V1,
           "application/vnd.pypi.simple.latest+html")
#: Format -> the concrete content type served: ``latest`` is answered with ``v1``.
MIMETYPES = {"json": JSON_V1, "html-v1": HTML_V1, "html": "text/html"}
API_VERSION = "1.1"
MAX_PROJECT_LENGTH = 200


def negotiate() -> str:
    """``json``, ``html-v1`` (PEP 691's HTML type, asked for by name) or ``html`` from
    ``?format=`` or the Accept header that uv and pip send."""
    accept = request.headers.get("Accept", "")
    fmt_arg = request.args.get("format")
    formats = services().formats
    known = formats.get(accept, fmt_arg)
    if known is not None:
        return known
    if fmt_arg in (JSON_V1, "json"):
        fmt = "json"
    elif fmt_arg == HTML_V1:
        fmt = "html-v1"
    elif fmt_arg in ("text/html", "html"):
        fmt = "html"
    else:
        best = request.accept_mimetypes.best_match(_OFFERS, default="text/html")
        fmt = ("json" if best and best.endswith("+json")
               else "html-v1" if best and best.endswith("+html") else "html")
    formats.put(accept, fmt_arg, fmt)
    return fmt


_variant = parse_variant  # cached in the core


def _project(name: str) -> NormalizedName:
    if len(name) > MAX_PROJECT_LENGTH or not name.isascii():
        raise InvalidProjectName("project name is not valid")
    try:
        return canonicalize_name(name, validate=True)
    except InvalidName:
        shown = canonicalize_name(name, validate=False)[:80]
        raise InvalidProjectName(f"{shown!r} is not a valid project name") from None


def _respond(page: Page) -> Response:
    if etag_matches(request.headers.get("If-None-Match"), page.etag):
        return Response(status=304, headers=page.headers)
    return Response(page.body, status=page.status, mimetype=page.mimetype,
                    headers=page.headers)


def _make_page(body: str | bytes, fmt: str, *, status: int = 200,
               location: str | None = None) -> Page:
    data = body.encode() if isinstance(body, str) else body
    etag = '"' + hashlib.sha256(data + (location or "").encode()).hexdigest()[:32] + '"'
    max_age = services().config.page_max_age
    headers = [("ETag", etag), ("Cache-Control", f"max-age={max_age}, public"),
               ("Vary", "Accept")]
    if location is not None:
        headers.append(("Location", location))
    mimetype = MIMETYPES[fmt]
    return Page(data, etag, tuple(headers), mimetype, status)


def _lookup(kind: str, variant_key: str, name: str,
            fmt: str) -> tuple[str, PageKey, Page | None]:
    svc = services()
    generation = svc.catalog.generation
    key = (origin(request.environ) + request.script_root + kind, variant_key, name, fmt)
    page = svc.pages.get(generation, key)
    (svc.metrics.page_hit if page is not None else svc.metrics.page_miss).inc()
    return generation, key, page


def _store(generation: str, key: PageKey, page: Page) -> Page:
    services().pages.put(generation, key, page)
    return page


@bp.get("/<variant_key>/simple/")
def root(variant_key: str) -> BaseResponse:
    return _root(variant_key)


def _root(variant_key: str) -> BaseResponse:
    """A root's project list; the plain root (:data:`PLAIN`) lists projects with variant
    wheels."""
    fmt = negotiate()
    generation, key, page = _lookup("root", variant_key, "", fmt)
    if page is None:
        catalog = services().catalog
        variant = _variant(variant_key) if variant_key != PLAIN else None
        projects = catalog.projects(variant) if variant else catalog.variant_projects()
        if fmt == "json":
            body: str = json.dumps({"meta": {"api-version": API_VERSION},
                                    "projects": [{"name": p} for p in projects]})
        else:
            body = render_template("simple_root.html", variant=variant, projects=projects,
                                   api_version=API_VERSION)
        page = _store(generation, key, _make_page(body, fmt))
    return _respond(page)


def _moved(location: str) -> BaseResponse:
    """301 to the normal URL, with the query string (``?format=``) kept."""
    query = request.query_string.decode("latin-1")
    return redirect(location + ("?" + query if query else ""), 301)


@bp.get("/<variant_key>/simple")
def root_no_slash(variant_key: str) -> BaseResponse:
    _variant(variant_key)
    return _moved(url_for("simple.root", variant_key=variant_key))


@bp.get("/<variant_key>/simple/<name>")
def project_no_slash(variant_key: str, name: str) -> BaseResponse:
    _variant(variant_key)
    project = _project(name)
    return _moved(url_for("simple.project", variant_key=variant_key, name=project))


@bp.get("/<variant_key>/simple/<name>/")
def project(variant_key: str, name: str) -> BaseResponse:
    fmt = negotiate()
    generation, key, page = _lookup("project", variant_key, name, fmt)
    svc = services()
    if page is not None and page.status != 200 and _caught_up(generation):
        generation, key, page = _lookup("project", variant_key, name, fmt)
    if page is not None:
        if svc.config.build_on_miss:  # a cached page was valid: name and key are normal
            _build_on_miss(_variant(variant_key), name)  # type: ignore[arg-type]
        return _respond(page)
    variant = _variant(variant_key)
    normalized = _project(name)
    if normalized != name:
        return _moved(url_for("simple.project", variant_key=variant_key, name=normalized))
    listing = svc.catalog.listing(variant, normalized)
    files = listing.files
    if svc.config.build_on_miss:
        _build_on_miss(variant, normalized, files)
    if not files and _caught_up(generation):
        generation = svc.catalog.generation
        listing = svc.catalog.listing(variant, normalized)
        files = listing.files
    if files:
        page = _make_page(_render_project(normalized, _shown(files), fmt), fmt)
    else:
        elsewhere = listing.elsewhere
        if _owned(normalized, listing):
            # Never upstream: the public index would hand the installer an sdist to compile
            # (or, for a name we host, a stranger's package). Not cached: the answer names
            # this server's address, and such misses are rare.
            raise NotFound(_missing(variant, normalized, elsewhere))
        root = svc.router.root_for(normalized, variant)
        if root is not None and svc.mirror is not None and mirror.caches(svc.config, normalized):
            return _mirrored(root, normalized, fmt)
        page = _make_page(b"", fmt, status=302, location=_not_hosted(variant, normalized))
    return _respond(_store(generation, key, page))


def _shown(files: list[Record]) -> list[Record]:
    """What a page lists of a project's published files: with ``WHEELHOUSE_UNPROVEN_WHEELS=hold``
    only those a recorded GPU proof passed on (issue 27). A project whose files are all held
    still answers its page, empty: it is hosted here, so it is never sent upstream for that."""
    svc = services()
    return [r for r in files if not svc.held(r)]


def _caught_up(generation: str) -> bool:
    """Before a redirect upstream or a 404: whether storage has moved on since ``generation``
    (another server process published meanwhile, perhaps the upload that just answered 200),
    after catching up with it. Bounded: one refresh at a time, at most every 50 ms."""
    catalog = services().catalog
    catalog.catch_up()
    return catalog.generation != generation


def _build_on_miss(variant: Variant, project: NormalizedName,
                   files: list[Record] | None = None) -> None:
    """Checked on every request (the fast path stands aside while the policy is on)."""
    svc = services()
    if files is None:
        files = svc.catalog.files(variant, project)
    onmiss.maybe_build(svc, variant, project, files, request.headers.get("User-Agent", ""))


def _owned(project: NormalizedName, listing: Listing) -> bool:
    """Whether ``project`` is this index's own, never sent upstream from any root: it has a
    recipe here, the operator pins it, or it was published here and its upstream did not list
    it then (``wheelhouse.index.ownership``). A project published here that the upstream lists is
    sent there from roots that don't hold it; one kept private at its first publication
    (``private/<project>``) is never sent there, even with no file left."""
    svc = services()
    if project in svc.recipes or pinned(svc.config, project) or listing.private:
        return True
    return listing.published_here and not listing.upstream_listed


def _missing(variant: Variant, project: NormalizedName, elsewhere: list[Variant]) -> str:
    """What a 404 for a hosted project says: where its wheels are, and how to get this one."""
    base_url = request.host_url.rstrip("/") + request.script_root
    lines = [f"{project} has no wheel in {variant.key}."]
    related = [v for v in elsewhere if v.base == variant.base]
    others = [v for v in elsewhere if v.base != variant.base]
    if related:
        lines.append(
            f"It is built here for {', '.join(v.key for v in related)}: wheels narrowed to "
            "one GPU architecture are listed only by their own root. Install from the root "
            "for your GPU, e.g.:")
        lines.append(f"  uv pip install --index-url {base_url}/{related[0].key}/simple {project}")
    if others:
        lines.append(f"Other variants with {project}: {', '.join(v.key for v in others)}.")
    if not elsewhere and project in services().recipes:
        lines.append(f"{project} has a recipe here but no wheel has been built yet.")
    elif not elsewhere and pinned(services().config, project):
        lines.append(f"{project} is private to this index (WHEELHOUSE_PRIVATE_PROJECTS) and "
                     "nothing of it is published here.")
    elif not elsewhere:
        lines.append(f"{project} was published here, but storage lists no wheel of it now.")
    lines.append(f"This index does not send {project} to the public upstream, since it is "
                 "hosted here: the upstream would give your installer an sdist to compile.")
    spec = f"--torch {variant.torch} --cuda {variant.cuda}" + "".join(
        f" --arch sm{a}" for a in variant.archs)
    if services().redis is not None:
        query = urlencode([("project", project), ("torch", variant.torch),
                           ("cuda", variant.cuda), *(("archs", a) for a in variant.archs)])
        lines.append(f"Request a build: {base_url}{url_for('requestpage.request_form')}?{query}")
        lines.append(f"  or: wheelhouse request {project}==VERSION {spec} --python 3.X "
                     f"--server {base_url}")
    else:
        lines.append("This server has no build queue; an operator can build it with:")
        lines.append(f"  wheelhouse build {project}==VERSION {spec} --python 3.X")
    return "\n".join(lines)


def _not_hosted(variant: Variant, project: NormalizedName) -> str:
    """Where a project we don't host lives upstream (404 when routing is off)."""
    upstream = services().router.url_for(project, variant)
    if upstream is None:
        raise NotFound(f"{project} is not hosted in {variant.key}, and upstream routing is off")
    return upstream


#: On pages the pull-through cache serves: ``fresh`` when the upstream confirmed the page
#: within ``WHEELHOUSE_CACHE_PAGE_MAX_AGE``, else ``stale; <why>`` (the page this index kept).
UPSTREAM_HEADER = "X-Wheelhouse-Upstream"


def _mirrored(root: str, project: NormalizedName, fmt: str) -> BaseResponse:
    """The upstream's page of ``project``, from the cache, linking to this index. Not kept in
    the page cache: its freshness is the cache's to judge (``wheelhouse.index.mirror.Pages``)."""
    svc = services()
    assert svc.mirror is not None  # callers check
    served = svc.mirror.get(root, project)
    page = served.page
    # (file, URL, provenance): the upstream's files have none of this fleet's.
    links = [(f, url_for("mirror.file", root_id=page.root_id, project=project,
                         filename=f.filename), None) for f in page.files]
    if fmt == "json":
        entries: list[dict[str, Any]] = []
        for f, url, _provenance in links:
            meta: bool | dict[str, str] = (
                {"sha256": f.metadata_sha256} if f.metadata_sha256 else f.metadata)
            entry: dict[str, Any] = {"filename": f.filename, "url": url,
                                     "hashes": {"sha256": f.sha256},
                                     "requires-python": f.requires_python,
                                     "core-metadata": meta, "dist-info-metadata": meta,
                                     "yanked": f.yanked}
            if f.size is not None:
                entry["size"] = f.size
            if f.upload_time is not None:
                entry["upload-time"] = f.upload_time
            entries.append(entry)
        meta_block: dict[str, Any] = {"api-version": API_VERSION}
        if served.stale:
            meta_block["_wheelhouse-upstream"] = f"stale; {served.stale}"
        body = json.dumps({"meta": meta_block, "name": project, "versions": list(page.versions),
                           "files": entries})
    else:
        fetched = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(page.fetched))
                   if page.fetched else None)
        body = render_template("simple_project.html", project=project, links=links,
                               documents=[], api_version=API_VERSION, stale=served.stale,
                               fetched=fetched)
    made = _make_page(body, fmt)
    state = f"stale; {served.stale}" if served.stale else "fresh"
    return _respond(Page(made.body, made.etag, (*made.headers, (UPSTREAM_HEADER, state)),
                         made.mimetype, made.status))


def _file_url(r: Record) -> str:
    return url_for("files.wheel", base_key=r.variant.base.key, project=r.project,
                   filename=r.filename)


def provenance_url(r: Record) -> str | None:
    """PEP 740: the fully qualified URL of the file's provenance, or None without one."""
    if r.provenance_sha256 is None:
        return None
    return url_for("files.wheel", base_key=r.variant.base.key, project=r.project,
                   filename=r.filename + PROVENANCE_SUFFIX, _external=True)


# -- the plain root /simple/: wheel variants (wheelhouse.index.variantwheels) --

#: The plain root's place in the page cache's keys (no variant key is empty).
PLAIN = ""


@dataclass(frozen=True)
class VariantsFile:
    """A version's ``-variants.json`` as a project page links it."""

    filename: str
    url: str
    sha256: str


@bp.get("/simple/")
def variant_root() -> BaseResponse:
    return _root(PLAIN)


@bp.get("/simple")
def variant_root_no_slash() -> BaseResponse:
    return redirect(url_for("simple.variant_root"), 301)


@bp.get("/simple/<name>")
def variant_project_no_slash(name: str) -> BaseResponse:
    return redirect(url_for("simple.variant_project", name=_project(name)), 301)


@bp.get("/simple/<name>/")
def variant_project(name: str) -> BaseResponse:
    """A project's variant wheels and, per version, its ``-variants.json``."""
    fmt = negotiate()
    generation, key, page = _lookup("project", PLAIN, name, fmt)
    svc = services()
    if page is not None:
        if svc.config.build_on_miss:
            _variant_build_on_miss(name)  # type: ignore[arg-type]
        return _respond(page)
    normalized = _project(name)
    if normalized != name:
        return redirect(url_for("simple.variant_project", name=normalized), 301)
    listing = svc.catalog.listing(None, normalized)
    files = listing.files
    if svc.config.build_on_miss:
        _variant_build_on_miss(normalized)
    if files:
        files = _shown(files)
        documents = [VariantsFile(filename, url_for("simple.variants_file", project=normalized,
                                                    filename=filename),
                                  hashlib.sha256(body).hexdigest())
                     for filename, body in _documents(files).items()]
        page = _make_page(_render_project(normalized, files, fmt, documents), fmt)
    else:
        elsewhere = listing.elsewhere
        # A public project published only into some roots (a pure-Python upload has no
        # variant wheel) is the upstream's here too.
        if _owned(normalized, listing) or (elsewhere and not listing.upstream_listed):
            raise NotFound(_missing_variant_wheel(normalized, elsewhere))
        if svc.router.default is None:
            raise NotFound(f"{normalized} is not hosted here, and upstream routing is off")
        if svc.mirror is not None and mirror.caches(svc.config, normalized):
            return _mirrored(svc.router.default, normalized, fmt)
        # No variant to fill a rule's {cu}/{torch} with: the default upstream.
        page = _make_page(b"", fmt, status=302,
                          location=f"{svc.router.default.rstrip('/')}/{normalized}/")
    return _respond(_store(generation, key, page))


@bp.get("/files/variants/<project>/<filename>")
def variants_file(project: str, filename: str) -> BaseResponse:
    """A version's variants document, made from the catalog: the same bytes as long as the
    version's variant wheels are the same (the project page lists its sha256)."""
    generation, key, page = _lookup("variants", PLAIN, f"{project}/{filename}", "json")
    if page is None:
        normalized = _project(project)
        body = _documents(_shown(services().catalog.variant_files(normalized))).get(filename)
        if normalized != project or body is None:
            raise NotFound(f"{filename} is not published here")
        data = _make_page(body, "json")
        page = _store(generation, key, Page(data.body, data.etag, data.headers,
                                            "application/json", 200))
    return _respond(page)


def _documents(files: list[Record]) -> dict[str, bytes]:
    """``{name}-{version}-variants.json`` per version of a project's variant wheels."""
    labels: dict[str, dict[str, Any]] = {}
    for r in files:
        dist = parse_name(split_variant_label(r.filename)[0]).dist_name
        filename = variantwheels.variants_filename(dist, r.version)
        labels.setdefault(filename, {})[str(r.variant_label)] = variantwheels.properties(
            r.variant.cuda, r.archs or ())
    return {f: variantwheels.variants_document(ls) for f, ls in labels.items()}


def _variant_build_on_miss(project: NormalizedName) -> None:
    """Build on miss from the plain root: for every variant the project's newest version was
    published into, the installer's Python (from its User-Agent) gets a build if it has none.
    uv sends no detected variant properties (checked with 0.13.9), so its GPU is unknown."""
    svc = services()
    agent = request.headers.get("User-Agent", "")
    for variant in svc.catalog.variants_of(project):
        onmiss.maybe_build(svc, variant, project, svc.catalog.files(variant, project), agent)


def _missing_variant_wheel(project: NormalizedName, elsewhere: list[Variant]) -> str:
    base_url = request.host_url.rstrip("/") + request.script_root
    lines = [f"{project} has no variant wheel here (no published wheel with GPU device code)."]
    if elsewhere:
        lines.append(f"It is built here for {', '.join(v.key for v in elsewhere)}; install "
                     "from the root that fits your torch, CUDA and GPU, e.g.:")
        lines.append(f"  uv pip install --index-url {base_url}/{elsewhere[-1].key}/simple "
                     f"{project}")
    lines.append(f"This index does not send {project} to the public upstream, since it is "
                 "hosted here.")
    return "\n".join(lines)


def _render_project(project: NormalizedName, files: list[Record], fmt: str,
                    documents: list[VariantsFile] | None = None) -> str:
    documents = documents or []
    if fmt == "json":
        versions: dict[str, None] = {}
        entries: list[dict[str, Any]] = []
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
                "provenance": provenance_url(r),
            })
        entries.extend({"filename": d.filename, "url": d.url, "hashes": {"sha256": d.sha256}}
                       for d in documents)
        return json.dumps({"meta": {"api-version": API_VERSION}, "name": project,
                           "versions": list(versions), "files": entries})
    links = [(r, _file_url(r), provenance_url(r)) for r in files]
    return render_template("simple_project.html", project=project, links=links,
                           documents=documents, api_version=API_VERSION)
