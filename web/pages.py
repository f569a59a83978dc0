"""The pages: the build matrix, the request form, live build pages, sign-in and sign-out."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from flask import (
    Blueprint,
    redirect,
    render_template,
    request,
    url_for,
)
from packaging.utils import InvalidName, canonicalize_name
from werkzeug.exceptions import NotFound
from werkzeug.wrappers import Response as BaseResponse

from web import auth
from web.api import base_url
from web.builds import JOB_ID, build_view, spec_of, submit
from web.form import SUGGESTED_TORCH, parse_request
from web.matrix import build_matrix, newest_per_major
from web.services import services
from wheelhouse.buildspec import KNOWN_MACHINES, KNOWN_PYTHONS
from wheelhouse.errors import TorchUnavailable, UnservableSpec
from wheelhouse.fleet import live_workers, servable, unavailable_reasons
from wheelhouse.queue import BuildState, cancel_build, get_build, log_tail
from wheelhouse.recipes import allowed_projects
from wheelhouse.variants import KNOWN_ARCHS, KNOWN_CUDA

bp = Blueprint("pages", __name__)

LOG_LINES = 200


#: The longest ``next`` kept; a longer one is not a page of ours.
_NEXT_MAX = 2000


def _safe_next(target: str | None) -> str:
    """Only same-site paths: a sign-in must never bounce to another host.

    Browsers drop tabs, CR and LF from URLs and read a backslash as a slash, so ``/%09/evil``
    (a tab, once the query is decoded) would become ``//evil``, another host: any control
    character, backslash, scheme or host refuses the target, as does a path that doesn't start
    with exactly one slash.
    """
    fallback = url_for("pages.matrix")
    if not target or len(target) > _NEXT_MAX or "\\" in target \
            or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in target):
        return fallback
    try:
        parts = urlsplit(target)
    except ValueError:  # e.g. an unbalanced "[" taken for an IPv6 host
        return fallback
    # "///evil" parses with an empty host, but browsers skip any number of slashes there.
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return fallback
    return target


def _login_redirect() -> BaseResponse:
    return redirect(url_for("pages.login", next=request.full_path.rstrip("?")))


#: The README section on the shapes wheelhouse runs in, builds included (``home.readme``).
BUILDS_SECTION = "Running it for real"


@bp.app_context_processor
def _build_queue() -> dict[str, Any]:
    """Whether this server has a build queue: without one, nobody can sign in or request."""
    return {"build_queue": services().redis is not None}


def _no_build_queue() -> tuple[str, int]:
    """What ``/request`` and ``/login`` answer in index-only mode: builds need Redis and a
    worker, and how to get them (a sign-in form could never succeed here)."""
    readme = url_for("home.readme") + "#:~:text=" + quote(BUILDS_SECTION)
    return render_template("no_queue.html", readme=readme, section=BUILDS_SECTION), 503


# -- sign-in --


@bp.route("/login", methods=["GET", "POST"])
def login() -> BaseResponse | tuple[str, int] | str:
    error = None
    nxt = _safe_next(request.values.get("next"))
    if services().tokens is None and request.method == "GET":
        return _no_build_queue()
    if request.method == "POST":
        auth.check_csrf()
        tokens = services().tokens
        if tokens is None:
            error = "This server has no build queue, so there is nothing to sign in to."
            return render_template("login.html", error=error, next=nxt), 401
        auth.refuse_if_locked_out()  # the right token too, until the lockout ends
        info = tokens.verify(request.form.get("token", "").strip())
        if info is None:
            auth.failed_sign_in()
            error = "That token is not valid (or was revoked)."
            return render_template("login.html", error=error, next=nxt), 401
        auth.login(info)
        return redirect(nxt)
    return render_template("login.html", error=error, next=nxt)


@bp.post("/logout")
def logout() -> BaseResponse:
    auth.check_csrf()
    auth.logout()
    return redirect(url_for("pages.matrix"))


# -- the matrix --


@bp.get("/matrix")
def matrix() -> str:
    svc = services()
    project = request.args.get("project") or None
    # One read of the fleet's adverts: the CUDA lines some live worker builds.
    workers = live_workers(svc.redis) if svc.redis is not None else []
    fleet_cuda = {c for ad in workers for c in ad.cuda_versions}
    projects = build_matrix(svc.catalog, svc.redis, project=project,
                            buildable_cuda=newest_per_major(fleet_cuda))
    # The filter offers every project: those with a recipe and those the index hosts.
    hosted = {str(r.project) for r in svc.catalog.all_records()}
    return render_template("matrix.html", projects=projects, selected=project,
                           recipes=sorted(set(svc.recipes) | hosted),
                           queue=svc.redis is not None)


# -- the request form --


def _fleet() -> tuple[set[tuple[str, str]], list[Any]]:
    conn = services().redis
    if conn is None:
        return set(), []
    return servable(conn), live_workers(conn)


def _form_context(values: dict[str, Any], errors: dict[str, str]) -> dict[str, Any]:
    svc = services()
    pairs, workers = _fleet()
    # The allowlist where there is one, else the projects with a recipe of their own; any
    # other valid name may be typed.
    suggestions: list[str] = [*sorted(allowed_projects(svc.config))] or sorted(svc.recipes)
    project = values.get("project") or (suggestions[0] if suggestions else "")
    # Versions are looked up for a name that is valid and allowed (never for arbitrary input).
    versions = (svc.versions.get(svc.router.default, project)
                if project and "project" not in errors and _valid_name(project) else None)
    servable_cuda = sorted({c for c, _ in pairs})
    return {
        "values": values, "errors": errors, "suggestions": suggestions, "project": project,
        "allowlist": bool(allowed_projects(svc.config)),
        "versions": versions, "upstream": svc.router.default,
        "torch_versions": SUGGESTED_TORCH, "cudas": KNOWN_CUDA, "servable_cuda": servable_cuda,
        "pairs": sorted(pairs), "machines": KNOWN_MACHINES,
        "servable_machines": sorted({m for _, m in pairs}), "pythons": KNOWN_PYTHONS,
        "archs": KNOWN_ARCHS, "workers": workers, "unavailable": unavailable_reasons(workers),
    }


def _valid_name(project: str) -> bool:
    """A valid project name that the operator's allowlist (if any) includes."""
    try:
        name = canonicalize_name(project, validate=True)
    except InvalidName:
        return False
    allowed = allowed_projects(services().config)
    return not allowed or name in allowed


@bp.get("/request")
def request_form() -> BaseResponse | tuple[str, int] | str:
    if services().redis is None:
        return _no_build_queue()
    info = auth.current_token()
    if info is None:
        return _login_redirect()
    values: dict[str, Any] = {
        "project": request.args.get("project", ""), "version": request.args.get("version", ""),
        "torch": request.args.get("torch", ""), "cuda": request.args.get("cuda", ""),
        "python": request.args.getlist("python"), "archs": request.args.getlist("archs"),
        "machine": request.args.get("machine", "x86_64"),
        "rerun": request.args.get("rerun") == "1",
    }
    return render_template("request.html", **_form_context(values, {}), submitted=None,
                           can_build=info.allows("build"))


@bp.post("/request")
def request_submit() -> BaseResponse | tuple[str, int]:
    if auth.current_token() is None:
        return redirect(url_for("pages.login", next=url_for("pages.request_form")), code=303)
    auth.check_csrf()
    info = auth.require_scope("build")
    auth.rate_limit(info)
    svc = services()
    data: dict[str, Any] = {k: request.form.get(k, "") for k in
                            ("project", "version", "torch", "cuda", "machine")}
    data["python"] = request.form.getlist("python")
    data["archs"] = request.form.getlist("archs")
    req = parse_request(data, allowed_projects(svc.config))
    rerun = request.form.get("rerun") == "1"
    req.values["rerun"] = rerun
    submitted = None
    status = 400
    if not req.errors:
        assert svc.redis is not None  # require_scope checked it
        try:
            submitted = submit(svc.redis, svc.catalog, req.specs,
                               rerun_failed=rerun, torch=svc.torch)
        except UnservableSpec as exc:
            req.errors["cuda"] = str(exc)
        except TorchUnavailable as exc:
            req.errors["torch"] = str(exc)
    if submitted is not None:
        # A build queued unchecked (torch index unreachable) stays on this page, which says so.
        if len(submitted) == 1 and submitted[0].wheel is None and not submitted[0].warning:
            return redirect(url_for("pages.build", job_id=submitted[0].job_id), code=303)
        status = 200
    return render_template("request.html", **_form_context(req.values, req.errors),
                           submitted=submitted, can_build=True, base=base_url()), status


# -- a build --


@bp.get("/builds/<job_id>")
def build(job_id: str) -> str:
    conn = services().redis
    if conn is None or not JOB_ID.fullmatch(job_id):
        raise NotFound("no such build")
    status = get_build(conn, job_id)
    if status is None:
        raise NotFound("no such build (builds are kept for 30 days)")
    view = build_view(conn, status, base_url(), services().catalog)
    lines = log_tail(conn, job_id, LOG_LINES)
    if not lines and status.finished and status.log_key:
        lines = _stored_log_tail(status.log_key)
    info = auth.current_token()
    spec = spec_of(status)
    return render_template(
        "build.html", view=view, status=status, spec=spec, log=lines,
        can_cancel=info is not None and info.allows("build") and not status.finished,
        retry_url=url_for("pages.request_form", **_retry_args(status.spec))
        if status.state in (BuildState.FAILED, BuildState.CANCELLED) else None,
    )


def _retry_args(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: spec.get(k) for k in ("project", "version", "torch", "cuda", "machine")} | {
        "python": spec.get("python"), "archs": spec.get("archs") or [], "rerun": "1"}


def _stored_log_tail(key: str) -> list[str]:
    """The last lines of a finished build's full log, from storage."""
    try:
        data = services().storage.get_bytes(key)
    except (FileNotFoundError, OSError, ValueError):
        return []
    return data[-200_000:].decode(errors="replace").splitlines()[-LOG_LINES:]


@bp.post("/builds/<job_id>/cancel")
def cancel(job_id: str) -> BaseResponse:
    auth.check_csrf()
    info = auth.require_scope("build")
    auth.rate_limit(info)
    conn = services().redis
    if conn is None or not JOB_ID.fullmatch(job_id) or get_build(conn, job_id) is None:
        raise NotFound("no such build")
    cancel_build(conn, job_id)
    return redirect(url_for("pages.build", job_id=job_id), code=303)


@bp.app_template_global()
def request_fields(project: str, version: str, variant: str, python: str) -> list[tuple[str, str]]:
    """The request form's fields for one missing matrix cell."""
    from wheelhouse.variants import parse_variant

    v = parse_variant(variant)
    fields = [("project", project), ("version", version), ("torch", v.torch), ("cuda", v.cuda),
              ("python", python)]
    fields.extend(("archs", a) for a in v.archs)
    return fields


@bp.app_template_global()
def matrix_request_link(project: str, version: str, variant: str, python: str) -> str:
    """The request form, filled in for one missing matrix cell."""
    return url_for("pages.request_form") + "?" + urlencode(
        request_fields(project, version, variant, python))


@bp.app_template_filter("duration")
def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


@bp.app_template_filter("bytes")
def human_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"
