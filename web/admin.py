"""Yank, unyank and delete: the JSON API (admin tokens) and the project page's buttons.

The changes themselves are the core's (:mod:`wheelhouse.index.manage`): markers and deletions in
storage, an audit entry naming the token, and a new generation, so every page (and its ETag)
changes on the next catalog refresh; this process refreshes at once.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, redirect, render_template, request, url_for
from packaging.utils import canonicalize_name
from werkzeug.exceptions import BadRequest
from werkzeug.wrappers import Response as BaseResponse

from web import auth
from web.services import services
from wheelhouse.config import Unproven
from wheelhouse.errors import ProvenanceInvalid, ProvenanceUnavailable
from wheelhouse.index.catalog import Record
from wheelhouse.index.manage import Action, Target, delete, unyank, yank
from wheelhouse.index.proofs import GpuProof, verify_proof
from wheelhouse.index.tokens import TokenInfo
from wheelhouse.provenance.ca import ca_cert_for

bp = Blueprint("admin", __name__)

_SHAPE = ('send a JSON object: {"target": "PROJECT==VERSION" or a wheel\'s file name, '
          '"variant": optional variant key, "reason": optional text}')


def _apply(action: Action, target: Target, info: TokenInfo, reason: str) -> list[Record]:
    svc = services()
    who = f"token {info.name}"
    # Every file's own root, not the target's: a target in a narrowed root names its base's
    # files too, and a token limited to the narrowed root must not reach those.
    reach = info.allows_variant
    if action is Action.YANK:
        records = yank(svc.storage, target, who=who, reason=reason, reach=reach)
    elif action is Action.UNYANK:
        records = unyank(svc.storage, target, who=who, reach=reach)
    else:
        records = delete(svc.storage, target, who=who, reason=reason, reach=reach)
    svc.catalog.refresh()  # this process's pages change at once; the others on their refresh
    return records


@bp.post("/api/yank")
@bp.post("/api/unyank")
@bp.post("/api/delete")
def api_change() -> Response:
    """``{"target", "variant"?, "reason"?}`` → the files changed."""
    action = Action(request.path.rsplit("/", 1)[1])
    data: Any = request.get_json(silent=True) if request.is_json else None
    if not isinstance(data, dict) or not isinstance(data.get("target"), str):
        raise BadRequest(_SHAPE)
    variant, reason = data.get("variant"), data.get("reason", "")
    if not isinstance(variant, str | None) or not isinstance(reason, str) or len(reason) > 500:
        raise BadRequest(_SHAPE + " (a reason of at most 500 characters)")
    target = Target.parse(data["target"], variant)
    info = auth.require_admin(target.variant.key if target.variant else None)
    records = _apply(action, target, info, reason)
    resp = jsonify({"action": action.value, "files": [
        {"filename": r.filename, "variant": r.variant.key} for r in records]})
    resp.headers["Cache-Control"] = "no-store"
    return resp


@bp.get("/projects/<name>")
def project_page(name: str) -> BaseResponse | str:
    """Every published file of a project, in every root, with its GPU proof (or that it has
    none); admins get yank buttons."""
    project = canonicalize_name(name)
    if project != name:
        return redirect(url_for("admin.project_page", name=project), 301)
    catalog = services().catalog
    records = [r for v in catalog.variants_of(project) if not v.archs
               for r in catalog.files(v, project)]
    proofs = {r.key: catalog.proof(r) for r in records}  # from the catalog's view: no read
    info = auth.shown_token()
    admin = info is not None and info.allows("admin")
    return render_template("project.html", project=project, records=records, proofs=proofs,
                           seals=_seals(proofs), held=services().config.unproven is Unproven.HOLD,
                           admin=admin)


def _seals(proofs: dict[str, GpuProof | None]) -> dict[str, tuple[bool, str]]:
    """Per record key with a proof: whether its attestation verifies against the fleet CA, and
    who signed it or why not (one line), so the page never names a signer it did not check."""
    present = {key: p for key, p in proofs.items() if p is not None}
    if not present:
        return {}
    try:
        authority = ca_cert_for(services().config)
    except ProvenanceUnavailable as exc:
        return {key: (False, str(exc)) for key in present}
    out = {}
    for key, proof in present.items():
        try:
            out[key] = (True, verify_proof(proof, authority).signer)
        except ProvenanceInvalid as exc:
            out[key] = (False, str(exc))
    return out


@bp.post("/projects/<name>/yank")
def project_yank(name: str) -> BaseResponse:
    """The project page's Yank and Unyank buttons (a login session with CSRF)."""
    filename = request.form.get("filename", "")
    variant = request.form.get("variant", "")
    target = Target.parse(filename, variant or None)
    if target.project != canonicalize_name(name):
        raise BadRequest("that file is not of this project")
    info = auth.require_admin(target.variant.key if target.variant else None)
    action = Action.UNYANK if request.form.get("undo") else Action.YANK
    _apply(action, target, info, request.form.get("reason", "")[:500])
    return redirect(url_for("admin.project_page", name=target.project), 303)


@bp.post("/projects/<name>/delete")
def project_delete(name: str) -> BaseResponse:
    """The project page's Delete button: only with its confirmation box ticked, since a
    deleted file is gone (the audit trail keeps who and when)."""
    filename = request.form.get("filename", "")
    target = Target.parse(filename, request.form.get("variant") or None)
    if target.project != canonicalize_name(name):
        raise BadRequest("that file is not of this project")
    info = auth.require_admin(target.variant.key if target.variant else None)
    if request.form.get("confirm") != filename:
        raise BadRequest(f"tick the box to confirm that {filename} is to be deleted")
    _apply(Action.DELETE, target, info, request.form.get("reason", "")[:500])
    return redirect(url_for("admin.project_page", name=target.project), 303)
