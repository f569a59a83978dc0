"""Fetch a project's sdist from the upstream simple index, verify its hash, and unpack it safely."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import stat
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import Version

from wheelhouse.config import Config
from wheelhouse.errors import (
    BuildFailed,
    FailureKind,
    InfrastructureError,
    StorageUnavailable,
    UpstreamUnavailable,
)
from wheelhouse.layout import source_key
from wheelhouse.storage import Storage
from wheelhouse.upstream import ProjectFile, fetch_project

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


@dataclass(frozen=True)
class SdistLimits:
    """What an sdist may weigh, hold and unpack to (``WHEELHOUSE_SDIST_MAX_*``)."""

    max_bytes: int = 2048 * _MIB
    max_members: int = 100_000
    max_unpacked_bytes: int = 10_240 * _MIB

    @classmethod
    def from_config(cls, config: Config) -> SdistLimits:
        return cls(max_bytes=config.sdist_max_mib * _MIB,
                   max_members=config.sdist_max_members,
                   max_unpacked_bytes=config.sdist_max_unpacked_mib * _MIB)


def unpack(sdist: Path, dest: Path, *, limits: SdistLimits | None = None) -> Path:
    """Unpack into ``dest`` without letting members escape it; return the project directory.

    Every member is checked before anything is written: one that would land outside ``dest``
    (``..``, an absolute path, a link out of the tree, a device) fails the build as
    ``unsafe-archive``; an archive over ``limits`` (size, members, unpacked size) as
    ``too-large``, each with its own one-line reason.
    """
    limits = limits or SdistLimits()
    dest.mkdir(parents=True, exist_ok=True)
    if sdist.is_dir():
        shutil.copytree(sdist, dest / sdist.name)
    elif sdist.name.endswith((".tar.gz", ".tgz", ".tar", ".zip")):
        size = sdist.stat().st_size
        if size > limits.max_bytes:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"{sdist.name} is {size / _MIB:.0f} MiB, over the "
                              f"{limits.max_bytes / _MIB:.0f} MiB limit (WHEELHOUSE_SDIST_MAX_MIB)")
        try:
            if sdist.name.endswith(".zip"):
                _unpack_zip(sdist, dest, limits)
            else:
                _unpack_tar(sdist, dest, limits)
        except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            if isinstance(exc, tarfile.FilterError):
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  _unsafe_member(sdist.name, exc)) from None
            if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile):
                raise  # the disk, not the archive
            raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                              f"{sdist.name} is not a readable archive: "
                              f"{' '.join(str(exc).split())[:200] or type(exc).__name__}"
                              ) from None
    else:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{sdist.name} is not an sdist (.tar.gz or .zip)")
    entries = [p for p in dest.iterdir() if not p.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    if (dest / "setup.py").exists() or (dest / "pyproject.toml").exists():
        return dest
    raise BuildFailed(FailureKind.INCOMPATIBLE,
                      f"{sdist.name} does not unpack into one project directory")


def _too_many(name: str, limits: SdistLimits) -> BuildFailed:
    return BuildFailed(FailureKind.TOO_LARGE,
                       f"{name} holds more than {limits.max_members} members "
                       "(WHEELHOUSE_SDIST_MAX_MEMBERS)")


def _too_big(name: str, limits: SdistLimits) -> BuildFailed:
    return BuildFailed(FailureKind.TOO_LARGE,
                       f"{name} unpacks to more than {limits.max_unpacked_bytes / _MIB:.0f} MiB "
                       "(WHEELHOUSE_SDIST_MAX_UNPACKED_MIB)")


def _unpack_tar(sdist: Path, dest: Path, limits: SdistLimits) -> None:
    members: list[tarfile.TarInfo] = []
    total = 0
    with tarfile.open(sdist) as tf:
        # Headers are read one by one, so a bomb is refused once it passes a limit, and every
        # member passes the "data" filter before the first byte is written.
        for member in tf:
            if member.name.startswith("/"):  # the data filter would only strip the slash
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  f"{sdist.name}: member {member.name[:200]!r} has an absolute "
                                  "path")
            members.append(tarfile.data_filter(member, str(dest)))
            total += member.size if member.isreg() else 0
            if len(members) > limits.max_members:
                raise _too_many(sdist.name, limits)
            if total > limits.max_unpacked_bytes:
                raise _too_big(sdist.name, limits)
        tf.extractall(dest, members=members, filter="data")


def _unpack_zip(sdist: Path, dest: Path, limits: SdistLimits) -> None:
    root = dest.resolve()
    with zipfile.ZipFile(sdist) as zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise _too_many(sdist.name, limits)
        # zipfile reads no more than a member's declared size, so the sum bounds what is written.
        if sum(info.file_size for info in infos) > limits.max_unpacked_bytes:
            raise _too_big(sdist.name, limits)
        for info in infos:
            name = info.filename
            if name.startswith("/"):
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  f"{sdist.name}: member {name[:200]!r} has an absolute path")
            if not (dest / name).resolve().is_relative_to(root):
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  f"{sdist.name}: member {name[:200]!r} would land outside the "
                                  "project directory")
            if stat.S_ISLNK(info.external_attr >> 16):
                target = zf.read(info).decode(errors="replace")
                if target.startswith("/") or not (
                        dest / name).parent.joinpath(target).resolve().is_relative_to(root):
                    raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                      f"{sdist.name}: member {name[:200]!r} links out of the "
                                      f"tree (to {target[:200]!r})")
        zf.extractall(dest)  # noqa: S202 (every member checked above)


def _unsafe_member(archive: str, exc: tarfile.FilterError) -> str:
    member = exc.tarinfo.name[:200]
    if isinstance(exc, tarfile.AbsolutePathError):
        why = "has an absolute path"
    elif isinstance(exc, tarfile.OutsideDestinationError):
        why = "would land outside the project directory"
    elif isinstance(exc, tarfile.AbsoluteLinkError | tarfile.LinkOutsideDestinationError):
        why = f"links out of the tree (to {exc.tarinfo.linkname[:200]!r})"
    elif isinstance(exc, tarfile.SpecialFileError):
        why = "is a device or FIFO"
    else:
        why = f"is refused: {str(exc)[:200]}"
    return f"{archive}: member {member!r} {why}"
