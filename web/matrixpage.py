"""The matrix page (``/matrix``), and the links from its missing cells to the request form."""

from __future__ import annotations

from urllib.parse import urlencode

from flask import Blueprint, render_template, request, url_for

from web.matrix import build_matrix, split_requests
from web.services import services
from wheelhouse.builds.queue import all_build_jobs
from wheelhouse.variants import parse_variant

bp = Blueprint("matrixpage", __name__)


@bp.get("/matrix")
def matrix() -> str:
    svc = services()
    project = request.args.get("project") or None
    jobs = all_build_jobs(svc.redis) if svc.redis is not None else None
    projects = build_matrix(svc.catalog, svc.redis, project=project, jobs=jobs)
    splits = split_requests(svc.catalog, svc.redis, jobs, project=project) \
        if svc.redis is not None and jobs is not None else []
    # The filter offers every project: those with a recipe and those the index hosts.
    hosted = {str(r.project) for r in svc.catalog.all_records()}
    return render_template("matrix.html", projects=projects, selected=project,
                           recipes=sorted(set(svc.recipes) | hosted),
                           queue=svc.redis is not None, splits=splits)


@bp.app_template_global()
def request_fields(project: str, version: str, variant: str, python: str) -> list[tuple[str, str]]:
    """The request form's fields for one missing matrix cell."""
    v = parse_variant(variant)
    fields = [("project", project), ("version", version), ("torch", v.torch), ("cuda", v.cuda),
              ("python", python)]
    fields.extend(("archs", a) for a in v.archs)
    # A cell asks for the one wheel of its column, never one job per architecture.
    fields.append(("split_archs", "0"))
    return fields


@bp.app_template_global()
def matrix_request_link(project: str, version: str, variant: str, python: str) -> str:
    """The request form, filled in for one missing matrix cell."""
    return url_for("requestpage.request_form") + "?" + urlencode(
        request_fields(project, version, variant, python))
