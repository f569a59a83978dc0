"""The JSON API behind every action: request, look up, tail and cancel builds; list the fleet."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flask import Blueprint, Response, current_app, jsonify, request, url_for
from werkzeug.exceptions import BadRequest, Conflict, NotFound, ServiceUnavailable

from web import auth
from web.builds import JOB_ID, build_view, request_view
from web.form import parse_request
from web.services import services
from web.sources import store_source, too_large
from wheelhouse.builds.fanout import cancel_request, is_request_id, load_request, request_status
from wheelhouse.builds.fleet import live_workers, servable, unavailable_reasons
from wheelhouse.builds.queue import cancel_build, get_build, log_since
from wheelhouse.builds.responses import (
    BuildsCreated,
    CancelRequested,
    FleetView,
    LogPage,
    SourceStored,
    SubmittedBuild,
)
from wheelhouse.builds.spec import check_sdist_filename
from wheelhouse.builds.submission import Submitted, SubmittedSplit, submit_request
from wheelhouse.errors import InvalidBuildSpec
from wheelhouse.index.layout import source_key
from wheelhouse.index.ownership import Publisher, admit_source
from wheelhouse.recipes.book import allowed_projects

if TYPE_CHECKING:
    from redis import Redis

bp = Blueprint("api", __name__, url_prefix="/api")

#: The most log lines one poll returns.
LOG_PAGE = 500
MIB = 1024 * 1024
_CHUNK = 1024 * 1024


def _conn() -> Redis:
    conn = services().redis
    if conn is None:
        raise ServiceUnavailable("this server has no build queue (WHEELHOUSE_REDIS_URL is unset)")
    return conn


def base_url() -> str:
    return request.host_url.rstrip("/") + request.script_root


def _job_id(job_id: str) -> str:
    if not JOB_ID.fullmatch(job_id):
        raise NotFound("no such build")
    return job_id


def _no_store(resp: Response) -> Response:
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.get("/openapi.json")
def openapi() -> Response:
    """This API's OpenAPI description (``web/static/openapi.json``)."""
    assert current_app.static_folder is not None
    body = (Path(current_app.static_folder) / "openapi.json").read_bytes()
    return Response(body, mimetype="application/json")


@bp.post("/builds")
def create_builds() -> Response:
    """``{"project", "version", "torch", "cuda", "python": [...], "archs": [...]}`` → build ids;
    ``"split_archs": true`` makes one job per architecture (absent: the recipe's default)."""
    info = auth.require_scope("build")
    auth.rate_limit(info)
    shape = ("send a JSON object (Content-Type: application/json): {\"project\", \"version\", "
             "\"torch\", \"cuda\", \"python\": [...], \"archs\": [...]}")
    if not request.is_json:
        raise BadRequest(shape)
    # A body that doesn't parse (or nests too deeply) is a 400 saying why; past
    # web.guard.MAX_BODY it is a 413.
    data = request.get_json()
    if not isinstance(data, dict):
        raise BadRequest(shape)
    rerun = data.pop("rerun_failed", False) is True
    source = data.pop("source", None)
    svc = services()
    req = parse_request(data, allowed_projects(svc.config))
    if req.errors:
        resp = jsonify({"error": "; ".join(f"{k}: {v}" if k != "_" else v
                                           for k, v in req.errors.items()),
                        "fields": req.errors, "status": 400})
        resp.status_code = 400
        return resp
    specs = req.specs
    if source is not None and specs:
        specs = [spec.with_source(source) for spec in specs]
        ref = specs[0].source
        assert ref is not None
        if not svc.storage.exists(source_key(ref.sha256, ref.filename)):
            raise InvalidBuildSpec(f"no sdist {ref.filename} with sha256 {ref.sha256[:16]}… "
                                   "was uploaded here: PUT it to /api/sources/<filename> first")
        # Asked again here: a stored sdist may be named by another token than its uploader's.
        admit_source(svc.storage, svc.config, ref.filename, ref.sha256, Publisher.of(info),
                     recipe=specs[0].project in svc.recipes)
    # Every spec of one request is of one project, so of one recipe (its split_archs default).
    recipe = svc.recipe_for(specs[0].project)
    results = submit_request(_conn(), svc.catalog, svc.config, specs, recipe,
                             split=req.split_archs, rerun_failed=rerun, torch=svc.torch,
                             by=info.name)
    builds = []
    for r in results:
        item = _submitted(r)
        if isinstance(r, SubmittedSplit):
            # One request, one job per architecture: each part is a build of its own.
            item = replace(item, parts=tuple(replace(_submitted(p), arch=p.spec.archs[0])
                                             for p in r.parts))
        builds.append(item)
    warnings = sorted({r.warning for r in results if r.warning})
    resp = jsonify(BuildsCreated(builds=tuple(builds), warnings=tuple(warnings)).to_json())
    resp.status_code = 201 if any(r.created for r in results) else 200
    return _no_store(resp)


def _submitted(r: Submitted | SubmittedSplit) -> SubmittedBuild:
    return SubmittedBuild(
        id=r.job_id, python=r.spec.python, variant=r.spec.variant.key,
        state=r.state, created=r.created, wheel=r.wheel,
        url=url_for("buildpage.build", job_id=r.job_id, _external=True),
        api=url_for("api.build", job_id=r.job_id, _external=True),
    )


@bp.put("/sources/<filename>")
def upload_source(filename: str) -> Response:
    """The body is an sdist to build (``wheelhouse request PATH``): stored under its sha256
    (``sources/<sha256>/<filename>``), which the answer names for the build request's
    ``source``. At most ``WHEELHOUSE_SDIST_UPLOAD_MAX_MIB`` (413 past it)."""
    info = auth.require_scope("build")
    auth.rate_limit(info)
    svc = services()
    check_sdist_filename(filename)  # before a byte is read
    limit = svc.config.sdist_upload_max_mib * MIB
    if request.content_length is not None and request.content_length > limit:
        raise too_large(svc)
    request.max_content_length = limit  # raises the app-wide web.guard.MAX_BODY for this route
    stored = store_source(svc, info, filename, request.stream.read)
    ref, size, created = stored.ref, stored.size, stored.created
    resp = jsonify(SourceStored(sha256=ref.sha256, filename=ref.filename, size=size).to_json())
    resp.status_code = 201 if created else 200
    return _no_store(resp)


@bp.get("/builds/<job_id>")
def build(job_id: str) -> Response:
    conn = _conn()
    if is_request_id(_job_id(job_id)):
        request = load_request(conn, job_id)
        if request is None:
            raise NotFound("no such build request")
        view = request_view(conn, request_status(conn, request, services().catalog),
                            base_url(), services().catalog)
        parts = tuple(replace(part, url=url_for("buildpage.build", job_id=part.id),
                              api=url_for("api.build", job_id=part.id))
                      for part in view.parts)
        view = replace(view, parts=parts,
                       urls={"page": url_for("buildpage.build", job_id=job_id),
                             "cancel": url_for("api.cancel", job_id=job_id)})
        return _no_store(jsonify(view.to_json()))
    status = get_build(conn, job_id)
    if status is None:
        raise NotFound("no such build")
    one = replace(build_view(conn, status, base_url(), services().catalog),
                  urls={"page": url_for("buildpage.build", job_id=job_id),
                        "log": url_for("api.build_log", job_id=job_id),
                        "cancel": url_for("api.cancel", job_id=job_id)})
    return _no_store(jsonify(one.to_json()))


@bp.get("/builds/<job_id>/log")
def build_log(job_id: str) -> Response:
    """Live log lines from ``?offset=N`` on; ``next`` is the offset to ask for next."""
    conn = _conn()
    _job_id(job_id)
    raw = request.args.get("offset", "0")
    if not raw.isdigit() or len(raw) > 12:
        raise BadRequest("offset must be a non-negative integer")
    lines, total = log_since(conn, job_id, int(raw))
    dropped = 0
    if len(lines) > LOG_PAGE:
        dropped = len(lines) - LOG_PAGE
        lines = lines[-LOG_PAGE:]
    return _no_store(jsonify(LogPage(lines=tuple(lines), next=total, skipped=dropped).to_json()))


@bp.post("/builds/<job_id>/cancel")
def cancel(job_id: str) -> Response:
    info = auth.require_canceller()
    auth.rate_limit(info)
    conn = _conn()
    if is_request_id(_job_id(job_id)):
        request = load_request(conn, job_id)
        if request is None:
            raise NotFound("no such build request")
        auth.require_cancel(info, job_id)
        cancelled = cancel_request(conn, request)
        if not cancelled:
            raise Conflict("every part of the request already ended")
        state = request_status(conn, request, services().catalog).state
        return _no_store(jsonify(CancelRequested(id=job_id, state=state.value,
                                                 parts=tuple(cancelled)).to_json()))
    if get_build(conn, job_id) is None:
        raise NotFound("no such build")
    auth.require_cancel(info, job_id)
    if not cancel_build(conn, job_id):
        raise Conflict("the build already ended")
    status = get_build(conn, job_id)
    return _no_store(jsonify(CancelRequested(
        id=job_id, state=status.state.value if status else None).to_json()))


@bp.get("/workers")
def workers() -> Response:
    conn = _conn()
    ads: list[dict[str, Any]] = []
    for ad in live_workers(conn):
        item = asdict(ad)
        item["cuda_versions"] = list(ad.cuda_versions)
        ads.append(item)
    pairs = sorted(servable(conn))
    # Issue 21: versions a worker was told to provision and could not, with each reason.
    unavailable = unavailable_reasons(live_workers(conn))
    return _no_store(jsonify(FleetView(workers=tuple(ads), servable=tuple(pairs),
                                       unavailable=unavailable).to_json()))
