"""Storing an uploaded sdist to build (``PUT /api/sources/<file>`` for ``wheelhouse request
PATH``, and the request form's file field): the one place that caps, hashes, checks and
stores one, so both doors refuse the same things."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from web.services import Services
from wheelhouse.builds.spec import SourceRef, check_sdist_filename
from wheelhouse.errors import InvalidBuildSpec, UploadTooLarge
from wheelhouse.index.layout import source_key
from wheelhouse.index.ownership import Publisher, admit_source
from wheelhouse.index.tokens import TokenInfo
from wheelhouse.recipes.book import check_allowed

MIB = 1024 * 1024
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class StoredSource:
    ref: SourceRef
    size: int
    created: bool
    """False when the same bytes were stored before (content-addressed)."""


def too_large(svc: Services) -> UploadTooLarge:
    return UploadTooLarge(f"the sdist is larger than this server accepts "
                          f"(WHEELHOUSE_SDIST_UPLOAD_MAX_MIB={svc.config.sdist_upload_max_mib})")


def store_source(svc: Services, info: TokenInfo, filename: str,
                 read: Callable[[int], bytes]) -> StoredSource:
    """Read the sdist ``filename`` by ``read(n)`` (at most the configured cap), check that it
    may be built for ``info`` (:func:`wheelhouse.index.ownership.admit_source`) and store it under
    its
    sha256; nothing is stored for bytes that are refused."""
    project, _version = check_sdist_filename(filename)
    check_allowed(svc.config, project)
    limit = svc.config.sdist_upload_max_mib * MIB
    digest = hashlib.sha256()
    size = 0
    with tempfile.TemporaryDirectory(prefix="wheelhouse-source-") as tmp:
        path = Path(tmp) / filename
        with path.open("wb") as out:
            while chunk := read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise too_large(svc)
                digest.update(chunk)
                out.write(chunk)
        if size == 0:
            raise InvalidBuildSpec("the sdist is empty: send its bytes")
        ref = SourceRef(digest.hexdigest(), filename)
        admit_source(svc.storage, svc.config, filename, ref.sha256, Publisher.of(info),
                     recipe=project in svc.recipes)
        key = source_key(ref.sha256, ref.filename)
        created = not svc.storage.exists(key)
        if created:
            svc.storage.put_file(key, path)
    return StoredSource(ref, size, created)
