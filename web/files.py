"""Wheel and ``.metadata`` downloads: immutable, strong ETags, ranges, S3 stream or redirect."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flask import Blueprint, Response, redirect, request
from packaging.utils import canonicalize_name
from werkzeug.exceptions import NotFound, RequestedRangeNotSatisfiable
from werkzeug.wrappers import Response as BaseResponse

from web.services import services
from wheelhouse.catalog import Record
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import parse_name

bp = Blueprint("files", __name__)

IMMUTABLE = "max-age=31536000, immutable, public"
METADATA_SUFFIX = ".metadata"


def _lookup(base_key: str, project: str, filename: str) -> Record:
    base = parse_variant(base_key)
    if base.archs or canonicalize_name(project) != project:
        raise NotFound("no such file")
    name = parse_name(filename)  # refuses traversal and anything that is not a wheel name
    if name.project != project:
        raise NotFound("no such file")
    record = services().catalog.find(base, name.project, filename)
    if record is None:
        raise NotFound(f"{filename} is not published in {base.key}")
    return record


@bp.get("/files/<base_key>/<project>/<filename>")
def wheel(base_key: str, project: str, filename: str) -> BaseResponse:
    svc = services()
    if filename.endswith(METADATA_SUFFIX):
        record = _lookup(base_key, project, filename.removesuffix(METADATA_SUFFIX))
        body = _metadata(record.metadata_key)
        return _serve(record.metadata_key, record.metadata_sha256, len(body), "text/plain",
                      lambda start, stop: iter((body[start:stop],)))
    record = _lookup(base_key, project, filename)
    return _serve(record.wheel_key, record.sha256, record.size, "application/octet-stream",
                  lambda start, stop: svc.storage.iter_range(record.wheel_key, start, stop))


def _metadata(key: str) -> bytes:
    """METADATA bodies are small and immutable once published: keep them in memory."""
    svc = services()
    body = svc.metadata.get(key)
    if body is None:
        body = svc.storage.get_bytes(key)
        svc.metadata.put(key, body)
    return body


def _serve(key: str, sha256: str, size: int, mimetype: str,
           read: Callable[[int, int], Iterator[bytes]]) -> BaseResponse:
    svc = services()
    etag = f'"{sha256}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE, "Accept-Ranges": "bytes"}
    if request.if_none_match.contains(sha256):
        return Response(status=304, headers=headers)
    if svc.config.s3_file_mode == "redirect" and mimetype == "application/octet-stream":
        url = svc.storage.presigned_url(key, svc.config.presign_seconds)
        if url is not None:
            return redirect(url, 302)
    start, stop, status = 0, size, 200
    rng = request.range
    if_range = request.headers.get("If-Range")
    if rng is not None and rng.units == "bytes" and len(rng.ranges) == 1 and (
        if_range is None or if_range == etag
    ):
        bounds = rng.range_for_length(size)
        if bounds is None:
            raise RequestedRangeNotSatisfiable(length=size)
        start, stop = bounds
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    headers["Content-Length"] = str(stop - start)
    body = read(start, stop) if request.method != "HEAD" else iter(())
    return Response(body, status=status, mimetype=mimetype, headers=headers,
                    direct_passthrough=True)
