"""Files of the pull-through cache: ``/mirror/<root id>/<project>/<file>`` (and its
``.metadata``), linked from the upstream pages the index serves for cached projects.

A cached file is served like a published one (``web.files.serve``: sendfile, ranges, S3
stream or redirect); the first download streams from the upstream while it is kept
(``wheelhouse.index.mirror.begin``). A HEAD or range request for a file not cached yet fills the
cache first, since a range of a file can't be verified against its sha256.
"""

from __future__ import annotations

import re

from flask import Blueprint, Response, request
from packaging.utils import canonicalize_name
from werkzeug.exceptions import NotFound
from werkzeug.wrappers import Response as BaseResponse

from web.caches import etag_matches
from web.files import IMMUTABLE, serve
from web.services import services
from wheelhouse.errors import UpstreamUnavailable
from wheelhouse.index import mirror
from wheelhouse.index.mirror import MirrorFile

bp = Blueprint("mirror", __name__)

_ROOT_ID = re.compile(r"[0-9a-f]{16}")
_WHEEL_TYPE = "application/octet-stream"


def _find(root_id: str, project: str, filename: str) -> MirrorFile:
    svc = services()
    if svc.mirror is None or not _ROOT_ID.fullmatch(root_id) \
            or canonicalize_name(project) != project:
        raise NotFound("no such file")
    page = svc.mirror.known(root_id, project)
    f = page.file(filename) if page is not None else None
    if f is None:
        raise NotFound(f"{filename} is not on the cached page of {project}")
    return f


@bp.get("/mirror/<root_id>/<project>/<filename>")
def file(root_id: str, project: str, filename: str) -> BaseResponse:
    svc = services()
    if filename.endswith(mirror.METADATA_SUFFIX):
        f = _find(root_id, project, filename.removesuffix(mirror.METADATA_SUFFIX))
        if not f.metadata:
            raise NotFound(f"the upstream has no METADATA file for {f.filename}")
        body = mirror.metadata(svc.storage, f, offline=svc.config.upstream_offline)
        return serve(f.metadata_key, f.metadata_sha256 or f.sha256 + "-metadata", len(body),
                     "text/plain", lambda start, stop: (body[start:stop],))
    f = _find(root_id, project, filename)
    etag = f'"{f.sha256}"'
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return Response(status=304, headers={"ETag": etag, "Cache-Control": IMMUTABLE})
    stored = _stored(f)
    if stored is not None:
        return stored
    if svc.config.upstream_offline:
        raise UpstreamUnavailable(f"{f.filename} is not in the cache, and the upstream is off "
                                  "(WHEELHOUSE_UPSTREAM_OFFLINE)")
    if request.method == "HEAD" and request.range is None and f.size is not None:
        return Response(iter(()), mimetype=_WHEEL_TYPE, headers={
            "ETag": etag, "Content-Length": str(f.size), "Accept-Ranges": "bytes"})
    if request.method == "HEAD" or request.range is not None:
        mirror.fill(svc.storage, svc.config, f)
        return _stored(f) or _gone(f)
    download = mirror.begin(svc.storage, svc.config, f)
    if download is None:
        return _stored(f) or _gone(f)
    headers = {"ETag": etag}
    if download.size is not None:
        headers["Content-Length"] = str(download.size)
    # Not immutable yet: an answer cut short must not be kept by a proxy in front.
    return Response(download.chunks, mimetype=_WHEEL_TYPE, headers=headers,
                    direct_passthrough=True)


def _stored(f: MirrorFile) -> BaseResponse | None:
    storage = services().storage
    try:
        size = storage.stat(f.key).size
    except FileNotFoundError:
        return None
    mirror.touch(storage, f.sha256)
    return serve(f.key, f.sha256, size, _WHEEL_TYPE,
                 lambda start, stop: storage.open_range(f.key, start, stop))


def _gone(f: MirrorFile) -> BaseResponse:
    raise UpstreamUnavailable(f"{f.filename} was cached and is gone again (evicted); try again")
