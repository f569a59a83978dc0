"""Fetch a project's sdist from the upstream simple index or from storage and verify its hash.

The worker only moves an sdist as opaque bytes (hashed, size-capped); unpacking it is a parse of
the attacker's bytes and runs in the sandbox (:func:`worker.sandbox.untrusted.unpack`, never called
by
the worker itself; :class:`SdistLimits` is re-exported here)."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import Version

from wheelhouse.errors import (
    BuildFailed,
    FailureKind,
    InfrastructureError,
    StorageUnavailable,
    UpstreamUnavailable,
)
from wheelhouse.index.layout import source_key
from wheelhouse.index.storage import Storage
from wheelhouse.index.upstream import ProjectFile, fetch_project
from worker.sandbox.untrusted import SdistLimits

__all__ = ["MAX_SDIST_BYTES", "SdistLimits", "download_sdist", "fetch_stored_sdist",
           "find_sdist"]

_CHUNK = 1024 * 1024
_MIB = 1024 * 1024
MAX_SDIST_BYTES = 2 * 1024**3


def _request(url: str) -> urllib.request.Request:
    """A request for a file URL; only http(s) and file URLs are ever opened."""
    if urlsplit(url).scheme not in ("http", "https", "file"):
        raise BuildFailed(FailureKind.INCOMPATIBLE, f"refusing to fetch {url[:200]!r}")
    return urllib.request.Request(url, headers={"User-Agent": "wheelhouse-worker"})  # noqa: S310


def find_sdist(index_url: str, project: str, version: str, *,
               timeout: float = 60.0) -> ProjectFile:
    """The sdist of ``project`` ``version`` on the index (a .tar.gz before a .zip)."""
    wanted = Version(version)
    name = canonicalize_name(project)
    try:
        page = fetch_project(index_url, project, timeout=timeout)
    except UpstreamUnavailable as exc:
        raise InfrastructureError(str(exc)) from None
    matches = []
    for link in page.sdists:
        try:
            sname, sversion = parse_sdist_filename(link.filename)
        except InvalidSdistFilename:
            continue
        if sname == name and sversion == wanted:
            matches.append(link)
    if not matches:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{project} {version} has no sdist on {index_url}")
    matches.sort(key=lambda link: not link.filename.endswith(".tar.gz"))
    return matches[0]


def _write_hashed(chunks: Iterable[bytes], part: Path, *, max_bytes: int, filename: str) -> str:
    """Write ``chunks`` to ``part`` and return their sha256; more than ``max_bytes`` is
    ``too-large`` before more than that is written. ``part`` is removed on any failure."""
    digest = hashlib.sha256()
    size = 0
    try:
        with part.open("wb") as out:
            for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise BuildFailed(FailureKind.TOO_LARGE,
                                      f"{filename} is larger than the {max_bytes / _MIB:.0f} MiB "
                                      "limit (WHEELHOUSE_SDIST_MAX_MIB)")
                digest.update(chunk)
                out.write(chunk)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def download_sdist(link: ProjectFile, dest_dir: Path, *, timeout: float = 300.0,
                   max_bytes: int = MAX_SDIST_BYTES) -> Path:
    """Download and check the sha256 the index published; refuse a source without one, and one
    larger than ``max_bytes`` (``too-large``, before more than that is written)."""
    if link.sha256 is None:
        raise BuildFailed(FailureKind.UNVERIFIED_SOURCE,
                          f"the upstream index publishes no sha256 for {link.filename}; "
                          "wheelhouse builds only source it can verify (WHEELHOUSE_UPSTREAM)")
    if "/" in link.filename or link.filename.startswith("."):
        raise BuildFailed(FailureKind.INCOMPATIBLE, f"bad sdist name {link.filename!r}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / link.filename
    part = dest.with_name(dest.name + ".part")
    req = _request(link.url)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            digest = _write_hashed(iter(lambda: resp.read(_CHUNK), b""), part,
                                   max_bytes=max_bytes, filename=link.filename)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise InfrastructureError(f"downloading {link.url}: {exc}") from None
    if digest != link.sha256:
        part.unlink(missing_ok=True)
        # A whole transfer (its length was checked by HTTP) with other bytes than the index
        # promised is a changed or tampered file, not a network hiccup: not worth another try.
        raise BuildFailed(
            FailureKind.UNVERIFIED_SOURCE,
            f"{link.filename}: sha256 {digest[:16]}… does not match the "
            f"{link.sha256[:16]}… the upstream index publishes; refusing to build it")
    part.replace(dest)
    return dest


def fetch_stored_sdist(storage: Storage, sha256: str, filename: str, dest_dir: Path, *,
                       max_bytes: int = MAX_SDIST_BYTES) -> Path:
    """Copy an uploaded sdist (``sources/<sha256>/<filename>``) out of storage and check that
    its bytes have that sha256 (``unverified-source`` if not), within ``max_bytes``
    (``too-large``); a storage that doesn't answer is ``infrastructure`` (retried)."""
    if "/" in filename or filename.startswith("."):
        raise BuildFailed(FailureKind.INCOMPATIBLE, f"bad sdist name {filename!r}")
    key = source_key(sha256, filename)
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / filename
    part = dest.with_name(dest.name + ".part")
    try:
        size = storage.stat(key).size
        if size > max_bytes:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"{filename} is larger than the {max_bytes / _MIB:.0f} MiB limit "
                              "(WHEELHOUSE_SDIST_MAX_MIB)")
        digest = _write_hashed(storage.iter_range(key, 0, size), part, max_bytes=max_bytes,
                               filename=filename)
    except FileNotFoundError:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"the uploaded sdist {filename} ({sha256[:16]}…) is not in storage "
                          f"({key}); upload it again with `wheelhouse request PATH`") from None
    except StorageUnavailable as exc:
        raise InfrastructureError(f"reading the uploaded sdist {key}: {exc}") from None
    if digest != sha256:
        part.unlink(missing_ok=True)
        raise BuildFailed(
            FailureKind.UNVERIFIED_SOURCE,
            f"{filename}: the stored bytes have sha256 {digest[:16]}…, not the "
            f"{sha256[:16]}… it was uploaded as; refusing to build it")
    part.replace(dest)
    return dest
