"""The request form (``/request``): what the fleet can build, and submitting builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Blueprint, redirect, render_template, request, url_for
from packaging.utils import InvalidName, canonicalize_name
from packaging.version import InvalidVersion, Version
from werkzeug.datastructures import FileStorage
from werkzeug.wrappers import Response as BaseResponse

from web import auth
from web.api import base_url
from web.form import SUGGESTED_TORCH, BuildRequest, parse_request
from web.guard import MAX_BODY
from web.services import services
from web.signin import login_redirect, no_build_queue
from web.sources import MIB, store_source
from wheelhouse.builds.fleet import live_workers, servable, unavailable_reasons
from wheelhouse.builds.spec import KNOWN_MACHINES, KNOWN_PYTHONS, check_sdist_filename
from wheelhouse.builds.submission import submit_request
from wheelhouse.errors import (
    StorageError,
    TorchUnavailable,
    UnservableSpec,
    UpstreamUnavailable,
    WheelhouseError,
)
from wheelhouse.index.tokens import TokenInfo
from wheelhouse.recipes.book import allowed_projects
from wheelhouse.variants import KNOWN_ARCHS, KNOWN_CUDA

bp = Blueprint("requestpage", __name__)


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
    # The checkbox's default is the project's recipe's (the generic one's for any other name).
    split_default = bool(project and "project" not in errors and _valid_name(project)
                         and svc.recipe_for(project).split_archs)
    return {
        "values": values, "errors": errors, "suggestions": suggestions, "project": project,
        "allowlist": bool(allowed_projects(svc.config)),
        "versions": versions, "upstream": svc.router.default,
        "torch_versions": SUGGESTED_TORCH, "cudas": KNOWN_CUDA, "servable_cuda": servable_cuda,
        "pairs": sorted(pairs), "machines": KNOWN_MACHINES,
        "servable_machines": sorted({m for _, m in pairs}), "pythons": KNOWN_PYTHONS,
        "archs": KNOWN_ARCHS, "workers": workers, "unavailable": unavailable_reasons(workers),
        "split_default": split_default,
    }


def _valid_name(project: str) -> bool:
    """A valid project name that the operator's allowlist (if any) includes."""
    try:
        name = canonicalize_name(project, validate=True)
    except InvalidName:
        return False
    allowed = allowed_projects(services().config)
    return not allowed or name in allowed


def _split_field(values: list[str]) -> bool | str | None:
    """The form's "one job per GPU architecture": a hidden ``0`` before the checkbox's ``1``,
    so the last value is what was chosen; absent (a form or link without the field) is None,
    the recipe's default. Anything else is passed on for the form to refuse."""
    if not values:
        return None
    return {"0": False, "1": True}.get(values[-1], values[-1])


def _take_sdist(info: TokenInfo, upload: FileStorage, req: BuildRequest) -> None:
    """The form's sdist, stored as ``PUT /api/sources`` stores one, becomes the source of
    every spec of the request; why it can't be is the field's error."""
    spec = req.specs[0]
    filename = Path(upload.filename or "").name
    try:
        check_sdist_filename(filename, spec.project, Version(spec.version))
        stored = store_source(services(), info, filename, upload.stream.read)
    except (WheelhouseError, OSError) as exc:  # refused, too large, upstream or storage down
        if isinstance(exc, StorageError | UpstreamUnavailable):
            raise
        req.errors["sdist"] = str(exc)
        return
    source = {"sha256": stored.ref.sha256, "filename": stored.ref.filename}
    req.specs = [s.with_source(source) for s in req.specs]


def _check_released(project: str, version: str, errors: dict[str, str]) -> None:
    """A version the upstream doesn't list (a typo, most often) is refused on the form, with
    the versions it does list; unchecked when the upstream doesn't answer or lists nothing."""
    svc = services()
    versions = svc.versions.get(svc.router.default, project)
    if not versions:
        return
    try:
        wanted = Version(version)
        if any(Version(v) == wanted for v in versions):
            return
    except InvalidVersion:
        return  # parse_request checked it; an unparsable listed version is the upstream's
    errors["version"] = (f"{project} {version} is not on the upstream index "
                         f"({svc.router.default}); newest: {', '.join(versions[:5])}")


@bp.get("/request")
def request_form() -> BaseResponse | tuple[str, int] | str:
    if services().redis is None:
        return no_build_queue()
    info = auth.current_token()
    if info is None:
        return login_redirect()
    values: dict[str, Any] = {
        "project": request.args.get("project", ""), "version": request.args.get("version", ""),
        "torch": request.args.get("torch", ""), "cuda": request.args.get("cuda", ""),
        "python": request.args.getlist("python"), "archs": request.args.getlist("archs"),
        "machine": request.args.get("machine", "x86_64"),
        "rerun": request.args.get("rerun") == "1",
        "split_archs": _split_field(request.args.getlist("split_archs")),
    }
    return render_template("request.html", **_form_context(values, {}), submitted=None,
                           can_build=info.allows("build"))


@bp.post("/request")
def request_submit() -> BaseResponse | tuple[str, int]:
    if auth.current_token() is None:
        return redirect(url_for("signin.login", next=url_for("requestpage.request_form")),
                        code=303)
    svc = services()
    # The form may carry an sdist (multipart): its part is spooled to disk, up to the sdist
    # cap; every other field stays under the app's small form limits.
    request.max_content_length = svc.config.sdist_upload_max_mib * MIB + MAX_BODY
    auth.check_csrf()
    info = auth.require_scope("build")
    auth.rate_limit(info)
    data: dict[str, Any] = {k: request.form.get(k, "") for k in
                            ("project", "version", "torch", "cuda", "machine")}
    data["python"] = request.form.getlist("python")
    data["archs"] = request.form.getlist("archs")
    if "split_archs" in request.form:
        data["split_archs"] = _split_field(request.form.getlist("split_archs"))
    req = parse_request(data, allowed_projects(svc.config))
    rerun = request.form.get("rerun") == "1"
    req.values["rerun"] = rerun
    submitted = None
    status = 400
    upload = request.files.get("sdist")
    if not req.errors and upload is not None and upload.filename:
        _take_sdist(info, upload, req)
    elif not req.errors:
        _check_released(req.specs[0].project, req.specs[0].version, req.errors)
    if not req.errors:
        assert svc.redis is not None  # require_scope checked it
        try:
            recipe = svc.recipe_for(req.specs[0].project)
            submitted = submit_request(svc.redis, svc.catalog, svc.config, req.specs, recipe,
                                       split=req.split_archs, rerun_failed=rerun,
                                       torch=svc.torch, by=info.name)
        except UnservableSpec as exc:
            req.errors["cuda"] = str(exc)
        except TorchUnavailable as exc:
            req.errors["torch"] = str(exc)
    if submitted is not None:
        # A build queued unchecked (torch index unreachable) stays on this page, which says so.
        if len(submitted) == 1 and submitted[0].wheel is None and not submitted[0].warning:
            return redirect(url_for("buildpage.build", job_id=submitted[0].job_id), code=303)
        status = 200
    return render_template("request.html", **_form_context(req.values, req.errors),
                           submitted=submitted, can_build=True, base=base_url()), status
