"""A build's page (``/builds/<job_id>``): state, facts, the log's tail; and cancelling it. A
split request (``wheelhouse.builds.fanout``) has a page at the same place: its parts, each linking
to
its own build's page; cancelling it cancels every part still queued or building."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, redirect, render_template, url_for
from werkzeug.exceptions import NotFound
from werkzeug.wrappers import Response as BaseResponse

from web import auth
from web.api import base_url
from web.builds import JOB_ID, build_view, request_view
from web.services import services
from wheelhouse.builds.fanout import cancel_request, is_request_id, load_request, request_status
from wheelhouse.builds.queue import BuildState, cancel_build, get_build, log_tail
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import FailureKind

bp = Blueprint("buildpage", __name__)

LOG_LINES = 200


@bp.get("/builds/<job_id>")
def build(job_id: str) -> str:
    conn = services().redis
    if conn is None or not JOB_ID.fullmatch(job_id):
        raise NotFound("no such build")
    if is_request_id(job_id):
        return _split_request(job_id)
    status = get_build(conn, job_id)
    if status is None:
        raise NotFound("no such build (builds are kept for 30 days)")
    view = build_view(conn, status, base_url(), services().catalog).to_json()
    lines = log_tail(conn, job_id, LOG_LINES)
    if not lines and status.finished and status.log_key:
        lines = _stored_log_tail(status.log_key)
    info = auth.current_token()
    spec = status.spec
    return render_template(
        "build.html", view=view, status=status, spec=spec, log=lines,
        can_cancel=auth.may_cancel(info, job_id) and not status.finished,
        # A worker's setting that points nowhere fails every rerun the same way: the page says
        # what to change (the reason names the setting) instead of offering one.
        retry_url=url_for("requestpage.request_form", **_retry_args(spec))
        if spec is not None and status.state in (BuildState.FAILED, BuildState.CANCELLED)
        and status.failure_kind is not FailureKind.MISCONFIGURED else None,
        misconfigured=status.failure_kind is FailureKind.MISCONFIGURED,
    )


def _split_request(request_id: str) -> str:
    conn = services().redis
    assert conn is not None
    request = load_request(conn, request_id)
    if request is None:
        raise NotFound("no such build request (requests are kept for 30 days)")
    status = request_status(conn, request, services().catalog)
    view = request_view(conn, status, base_url(), services().catalog).to_json()
    info = auth.current_token()
    return render_template(
        "split.html", view=view, spec=request.spec,
        can_cancel=auth.may_cancel(info, request_id) and not status.finished,
        retry_url=url_for("requestpage.request_form", **_retry_args(request.spec),
                          split_archs="1")
        if status.finished and status.state is not BuildState.BUILT else None,
    )


def _retry_args(spec: BuildSpec) -> dict[str, Any]:
    return {"project": str(spec.project), "version": spec.version, "torch": spec.torch,
            "cuda": spec.cuda, "machine": spec.machine, "python": spec.python,
            "archs": list(spec.archs), "rerun": "1"}


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
    info = auth.require_canceller()
    auth.rate_limit(info)
    conn = services().redis
    if conn is None or not JOB_ID.fullmatch(job_id):
        raise NotFound("no such build")
    if is_request_id(job_id):
        request = load_request(conn, job_id)
        if request is None:
            raise NotFound("no such build request")
        auth.require_cancel(info, job_id)
        cancel_request(conn, request)
        return redirect(url_for("buildpage.build", job_id=job_id), code=303)
    if get_build(conn, job_id) is None:
        raise NotFound("no such build")
    auth.require_cancel(info, job_id)
    cancel_build(conn, job_id)
    return redirect(url_for("buildpage.build", job_id=job_id), code=303)
