"""The legacy upload API at ``/<variant>/`` (and ``/<variant>/legacy/``), so that
``twine upload --repository-url URL/<variant>/`` and ``uv publish --publish-url
URL/<variant>/`` publish into that root. The checks and the publication are the core's
(:mod:`wheelhouse.index.upload`); here the request becomes fields and a file.

The app-wide body limit (``web.guard.MAX_BODY``, 64 KiB) is raised for these routes only, to
``WHEELHOUSE_UPLOAD_MAX_MIB``, before the body is read: Werkzeug spools the file part to a
temporary file, so a large wheel never sits in memory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from flask import Blueprint, Response, request
from werkzeug.datastructures import FileStorage

from web import auth
from web.services import services
from wheelhouse.errors import InvalidUpload, UploadTooLarge
from wheelhouse.index.ownership import Publisher
from wheelhouse.index.upload import accept
from wheelhouse.index.uploadchecks import check_text
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import MAX_FILENAME_LENGTH

bp = Blueprint("upload", __name__)

MIB = 1024 * 1024
#: Limits for the text fields twine sends beside the file (the long description among them).
FIELD_MAX = 1024 * 1024
FIELD_PARTS = 1000


@bp.post("/<variant_key>/")
@bp.post("/<variant_key>/legacy/")
def upload(variant_key: str) -> Response:
    svc = services()
    variant = parse_variant(variant_key)  # 404 with a message for a malformed key
    info = auth.require_upload(variant.key)
    limit = svc.config.upload_max_mib * MIB + FIELD_MAX
    if request.content_length is not None and request.content_length > limit:
        raise UploadTooLarge(
            f"the upload is {request.content_length / MIB:.0f} MiB, more than this index "
            f"accepts (WHEELHOUSE_UPLOAD_MAX_MIB={svc.config.upload_max_mib})")
    request.max_content_length = limit
    request.max_form_memory_size = FIELD_MAX
    request.max_form_parts = FIELD_PARTS
    content = request.files.get("content")
    if not isinstance(content, FileStorage) or not content.filename:
        raise InvalidUpload("the upload has no file: send it as the multipart field 'content' "
                            "(twine upload, uv publish)")
    fields = {k: v for k, v in request.form.items() if isinstance(v, str)}
    # Before the name becomes a path: a NUL in it would be an OSError, not a refusal.
    check_text(fields, content.filename)
    filename = Path(content.filename).name[:MAX_FILENAME_LENGTH + 1]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-upload-") as tmp:
        path = Path(tmp) / (filename or "upload")
        content.save(path)
        if path.stat().st_size > svc.config.upload_max_mib * MIB:
            raise UploadTooLarge(
                f"{filename} is larger than this index accepts "
                f"(WHEELHOUSE_UPLOAD_MAX_MIB={svc.config.upload_max_mib})")
        record = accept(svc.storage, svc.config, variant, fields, path,
                        publisher=Publisher.of(info),
                        recipes=svc.recipes)
    resp = Response(f"OK: {record.filename} in {variant.key} (sha256 {record.sha256})\n",
                    mimetype="text/plain")
    resp.headers["Cache-Control"] = "no-store"
    return resp
