"""Fetch a project's sdist from the upstream simple index, verify its hash, and unpack it safely."""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import Version

from wheelhouse.errors import BuildFailed, FailureKind, InfrastructureError, UpstreamUnavailable
from wheelhouse.upstream import ProjectFile, fetch_project

_CHUNK = 1024 * 1024
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


def download_sdist(link: ProjectFile, dest_dir: Path, *, timeout: float = 300.0) -> Path:
    """Download and check the sha256 the index published; refuse a source without one."""
    if link.sha256 is None:
        raise BuildFailed(FailureKind.UNVERIFIED_SOURCE,
                          f"the upstream index publishes no sha256 for {link.filename}; "
                          "wheelhouse builds only source it can verify (WHEELHOUSE_UPSTREAM)")
    if "/" in link.filename or link.filename.startswith("."):
        raise BuildFailed(FailureKind.INCOMPATIBLE, f"bad sdist name {link.filename!r}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / link.filename
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    size = 0
    req = _request(link.url)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp, part.open("wb") as out:  # noqa: S310
            while chunk := resp.read(_CHUNK):
                size += len(chunk)
                if size > MAX_SDIST_BYTES:
                    raise BuildFailed(FailureKind.INCOMPATIBLE,
                                      f"{link.filename} is larger than 2 GiB")
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        part.unlink(missing_ok=True)
        raise InfrastructureError(f"downloading {link.url}: {exc}") from None
    if digest.hexdigest() != link.sha256:
        part.unlink(missing_ok=True)
        # A whole transfer (its length was checked by HTTP) with other bytes than the index
        # promised is a changed or tampered file, not a network hiccup: not worth another try.
        raise BuildFailed(
            FailureKind.UNVERIFIED_SOURCE,
            f"{link.filename}: sha256 {digest.hexdigest()[:16]}… does not match the "
            f"{link.sha256[:16]}… the upstream index publishes; refusing to build it")
    part.replace(dest)
    return dest


def unpack(sdist: Path, dest: Path) -> Path:
    """Unpack into ``dest`` without letting members escape it; return the project directory."""
    dest.mkdir(parents=True, exist_ok=True)
    if sdist.name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(sdist) as tf:
            tf.extractall(dest, filter="data")
    elif sdist.name.endswith(".zip"):
        with zipfile.ZipFile(sdist) as zf:
            root = dest.resolve()
            for member in zf.infolist():
                target = (dest / member.filename).resolve()
                if not target.is_relative_to(root):
                    raise BuildFailed(FailureKind.INCOMPATIBLE,
                                      f"{sdist.name}: member {member.filename!r} escapes")
            zf.extractall(dest)  # noqa: S202 (every member checked above)
    elif sdist.is_dir():
        shutil.copytree(sdist, dest / sdist.name)
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
