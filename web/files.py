"""Wheel, ``.metadata`` and ``.provenance`` downloads: immutable, strong ETags, ranges, S3
stream or redirect; and a wheel's GPU proof, ``.proof``, which a later proof replaces.

A published file is served only as its record describes it: the stored wheel's size is checked
before the first byte is sent (a truncated or missing wheel answers 503, never a short 200 or a
closed connection), and a ``.metadata`` or ``.provenance`` body (PEP 658, PEP 740) is hashed
against its record before it is served or kept.

Wheel bytes avoid Python where they can: a local file (whole or one range) goes to the WSGI
server's file wrapper, which gunicorn sends with ``sendfile``; behind nginx, Apache or
lighttpd, ``WHEELHOUSE_LOCAL_FILE_MODE`` can hand the file to the proxy instead; S3 objects
stream through, or clients are redirected to a presigned URL (``WHEELHOUSE_S3_FILE_MODE``).

While the catalog's refresh fails, storage is known not to answer: what would need it answers
503 at once instead of spending the storage timeouts (and a server thread) to learn it again;
``.metadata`` bodies already in memory are still served.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator

from flask import Blueprint, Response, redirect, request
from packaging.utils import canonicalize_name
from werkzeug.datastructures import Range
from werkzeug.exceptions import NotFound, RequestedRangeNotSatisfiable
from werkzeug.wrappers import Response as BaseResponse

from web.caches import etag_matches
from web.services import services
from wheelhouse.config import Config
from wheelhouse.errors import DamagedFile, StorageError, StorageUnavailable
from wheelhouse.index import proofs
from wheelhouse.index.catalog import Record
from wheelhouse.index.storage import ByteStream
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import parse_name, split_variant_label

bp = Blueprint("files", __name__)
log = logging.getLogger(__name__)

IMMUTABLE = "max-age=31536000, immutable, public"
METADATA_SUFFIX = ".metadata"
PROVENANCE_SUFFIX = ".provenance"
#: ``WHEELHOUSE_LOCAL_FILE_MODE``: the index sends local files (with the WSGI server's
#: sendfile), or has the reverse proxy in front send them.
LOCAL_FILE_MODES = ("sendfile", "x-accel-redirect", "x-sendfile")
#: ``WHEELHOUSE_S3_FILE_MODE``: S3 objects stream through the index, or clients are
#: redirected to a presigned URL.
S3_FILE_MODES = ("stream", "redirect")
#: Bytes per read where a server copies a file instead of sending it with sendfile.
FILE_CHUNK = 1024 * 1024

#: Opens bytes [start, stop) of the file to serve; HEAD opens an empty range.
Opener = Callable[[int, int], Iterable[bytes]]


def _lookup(base_key: str, project: str, filename: str) -> Record:
    base = parse_variant(base_key)
    if base.archs or canonicalize_name(project) != project:
        raise NotFound("no such file")
    # Refuses traversal and anything that is not a wheel name; a variant wheel's label aside.
    name = parse_name(split_variant_label(filename)[0])
    if name.project != project:
        raise NotFound("no such file")
    catalog = services().catalog
    record = catalog.find(base, name.project, filename)
    if record is None:
        # Another server process may have listed it a moment ago (gunicorn workers refresh
        # on their own): look again before a 404 that would contradict that page.
        catalog.catch_up()
        record = catalog.find(base, name.project, filename)
    if record is None:
        raise NotFound(f"{filename} is not published in {base.key}")
    return record


@bp.get("/files/<base_key>/<project>/<filename>")
def wheel(base_key: str, project: str, filename: str) -> BaseResponse:
    if filename.endswith(METADATA_SUFFIX):
        record = _lookup(base_key, project, filename.removesuffix(METADATA_SUFFIX))
        body = _metadata(record)
        return serve(record.metadata_key, record.metadata_sha256, len(body), "text/plain",
                     lambda start, stop: (body[start:stop],))
    if filename.endswith(PROVENANCE_SUFFIX):
        record = _lookup(base_key, project, filename.removesuffix(PROVENANCE_SUFFIX))
        if record.provenance_sha256 is None:
            raise NotFound(f"{record.filename} was published without provenance")
        body = _small(record.provenance_key, record.provenance_sha256, record)
        return serve(record.provenance_key, record.provenance_sha256, len(body),
                     "application/json", lambda start, stop: (body[start:stop],))
    if filename.endswith(proofs.SUFFIX):
        return _proof(_lookup(base_key, project, filename.removesuffix(proofs.SUFFIX)))
    record = _lookup(base_key, project, filename)
    if services().held(record):  # its .metadata, .provenance and .proof stay readable
        raise NotFound(f"{record.filename} is held until a GPU proof passes on it "
                       "(WHEELHOUSE_UNPROVEN_WHEELS=hold)")
    return serve(record.wheel_key, record.sha256, record.size, "application/octet-stream",
                 lambda start, stop: _open_wheel(record, start, stop))


def _proof(record: Record) -> BaseResponse:
    """The wheel's GPU proof with its attestation, as the catalog holds it (a variant form's is
    the proof of the wheel it was made from). Not immutable: a later proof replaces it."""
    proof = services().catalog.proof(record)
    if proof is None:
        raise NotFound(f"{record.filename} has no recorded GPU proof")
    body = proof.to_json()
    etag = f'"{hashlib.sha256(body).hexdigest()}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return Response(status=304, headers=headers)
    return Response(body, mimetype="application/json", headers=headers)


def _metadata(record: Record) -> bytes:
    """METADATA bodies are small and immutable once published: keep them in memory, once
    their hash matches the record."""
    return _small(record.metadata_key, record.metadata_sha256, record)


def _small(key: str, sha256: str, record: Record) -> bytes:
    """A small immutable file of a published wheel (its METADATA, its provenance), from
    memory once its hash matched the record's."""
    svc = services()
    body = svc.metadata.get(key)
    if body is None:
        _storage_answers()
        try:
            body = svc.storage.get_bytes(key)
        except FileNotFoundError:
            raise _damaged(key, record, "is missing from storage") from None
        digest = hashlib.sha256(body).hexdigest()
        if digest != sha256:
            raise _damaged(key, record, f"has sha256 {digest[:12]}… in storage, "
                                        f"{sha256[:12]}… in its record")
        svc.metadata.put(key, body)
    return body


def _open_wheel(record: Record, start: int, stop: int) -> ByteStream:
    """The stored wheel, refused before any byte is sent unless its size is the record's."""
    _storage_answers()
    try:
        stream = services().storage.open_range(record.wheel_key, start, stop)
    except FileNotFoundError:
        raise _damaged(record.wheel_key, record, "is missing from storage") from None
    if stream.size != record.size:
        stream.close()
        raise _damaged(record.wheel_key, record,
                       f"is {stream.size} bytes in storage, {record.size} in its record")
    return stream


def _storage_answers() -> None:
    """Refuse at once while the catalog's refresh fails: storage is down. (Not while a
    refresh is merely slow: that may be a big reload, and refusing would be a false alarm.)"""
    state = services().catalog.state()
    if state.stale and state.error is not None:
        raise StorageUnavailable(
            f"storage is not answering (the catalog has not been refreshed for "
            f"{state.age:.0f}s: {state.error}); try again shortly")


def _damaged(key: str, record: Record, what: str) -> DamagedFile:
    # Not a 404: the index lists this file, so the fault is the server's (and 404s get
    # cached); web.errors answers 503 and logs it for the operator.
    return DamagedFile(f"{key} {what}: it cannot be served until it is republished "
                       f"(wheelhouse verify lists such files; sha256 {record.sha256[:12]}…)")


def _bounds(rng: Range, size: int) -> tuple[int, int] | None:
    """[start, stop) of a single byte range, or None when it is unsatisfiable."""
    start, stop = rng.ranges[0]
    if start < 0:
        # A suffix range longer than the file is the whole file (RFC 9110, 14.1.3).
        start, stop = max(size + start, 0), size
    else:
        stop = size if stop is None else min(stop, size)
    return (start, stop) if start < stop else None


def check_modes(config: Config) -> None:
    """Refuse, at start-up, a file mode this module does not know."""
    if config.local_file_mode not in LOCAL_FILE_MODES:
        raise ValueError(f"WHEELHOUSE_LOCAL_FILE_MODE must be one of "
                         f"{', '.join(LOCAL_FILE_MODES)}, got {config.local_file_mode[:40]!r}")
    if config.s3_file_mode not in S3_FILE_MODES:
        raise ValueError(f"WHEELHOUSE_S3_FILE_MODE must be one of {', '.join(S3_FILE_MODES)}, "
                         f"got {config.s3_file_mode[:40]!r}")
    prefix = config.accel_redirect_prefix
    if config.local_file_mode == "x-accel-redirect" and not (
            prefix.startswith("/") and prefix.endswith("/")):
        raise ValueError(f"WHEELHOUSE_ACCEL_REDIRECT_PREFIX must start and end with /, "
                         f"got {prefix[:100]!r}")


def _handoff(key: str, headers: dict[str, str], mimetype: str,
             open_: Opener) -> BaseResponse | None:
    """Where the bytes come from elsewhere, the answer that sends the client there: a
    presigned S3 URL, or a header that has the reverse proxy in front send the local file
    (ranges are then the proxy's to answer). None where this index sends the bytes."""
    svc = services()
    config = svc.config
    if config.s3_file_mode == "redirect":
        url = svc.storage.presigned_url(key, config.presign_seconds)
        if url is not None:
            return redirect(url, 302)
    if config.local_file_mode == "sendfile":
        return None
    path = svc.storage.local_path(key)
    if path is None:
        return None
    body = open_(0, 0)  # checks the stored file's size before the proxy is sent to it
    if isinstance(body, ByteStream):
        body.close()
    if config.local_file_mode == "x-accel-redirect":
        headers["X-Accel-Redirect"] = config.accel_redirect_prefix + key
    else:
        headers["X-Sendfile"] = str(path)
    return Response(b"", mimetype=mimetype, headers=headers)


def serve(key: str, sha256: str, size: int, mimetype: str, open_: Opener) -> BaseResponse:
    etag = f'"{sha256}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE, "Accept-Ranges": "bytes"}
    if etag_matches(request.headers.get("If-None-Match"), etag):
        return Response(status=304, headers=headers)
    if mimetype == "application/octet-stream":
        handoff = _handoff(key, headers, mimetype, open_)
        if handoff is not None:
            return handoff
    start, stop, status = 0, size, 200
    rng = request.range
    if_range = request.headers.get("If-Range")
    if rng is not None and rng.units == "bytes" and len(rng.ranges) == 1 and (
        if_range is None or if_range == etag
    ):
        bounds = _bounds(rng, size)
        if bounds is None:
            raise RequestedRangeNotSatisfiable(length=size)
        start, stop = bounds
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    headers["Content-Length"] = str(stop - start)
    if request.method == "HEAD":
        body = open_(start, start)  # checks the stored file all the same
        if isinstance(body, ByteStream):
            body.close()
        return Response(iter(()), status=status, mimetype=mimetype, headers=headers)
    body = open_(start, stop)
    wrapper = request.environ.get("wsgi.file_wrapper")
    if isinstance(body, ByteStream) and body.file is not None and wrapper is not None:
        # The server's own file wrapper, passed through untouched: gunicorn then sends the
        # range from the descriptor with sendfile, and Python never touches the bytes.
        out: Iterable[bytes] = wrapper(body.file, FILE_CHUNK)
    elif isinstance(body, ByteStream):
        out = _logged(body, key)
    else:
        out = body
    return Response(out, status=status, mimetype=mimetype, headers=headers,
                    direct_passthrough=True)


def _logged(stream: ByteStream, key: str) -> Iterator[bytes]:
    """The stream, with one clear log line if storage fails once the answer has begun (the
    connection is then closed short of Content-Length, which clients detect)."""
    try:
        yield from stream
    except StorageError as exc:
        log.warning("download of %s cut short by storage: %s", key, exc)
        raise
    finally:
        stream.close()
