"""Fetch a project's sdist from the upstream simple index, verify its hash, and unpack it safely."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlsplit

from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import Version

from wheelhouse.buildspec import FailureKind
from wheelhouse.errors import BuildFailed
from worker.failures import InfrastructureError

ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, " \
         "text/html;q=0.01"
_CHUNK = 1024 * 1024
MAX_SDIST_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class SdistLink:
    filename: str
    url: str
    sha256: str | None


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def _request(url: str, **headers: str) -> urllib.request.Request:
    """A request for an index or file URL; only http(s) and file URLs are ever opened."""
    if urlsplit(url).scheme not in ("http", "https", "file"):
        raise BuildFailed(FailureKind.INCOMPATIBLE.value, f"refusing to fetch {url[:200]!r}")
    return urllib.request.Request(url, headers={"User-Agent": "wheelhouse-worker", **headers})  # noqa: S310


def _open(url: str, timeout: float) -> tuple[bytes, str, str]:
    req = _request(url, Accept=ACCEPT)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (scheme checked)
            return resp.read(), resp.headers.get("Content-Type", ""), resp.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise FileNotFoundError(url) from None
        raise InfrastructureError(f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise InfrastructureError(f"{url}: {exc}") from None


def list_sdists(index_url: str, project: str, *, timeout: float = 60.0) -> list[SdistLink]:
    """Every sdist the index lists for ``project`` (PEP 691 JSON, or PEP 503 HTML)."""
    page = index_url.rstrip("/") + "/" + canonicalize_name(project) + "/"
    try:
        body, ctype, final = _open(page, timeout)
    except FileNotFoundError:
        return []
    links: list[SdistLink] = []
    if "json" in ctype:
        data = json.loads(body)
        for f in data.get("files", []):
            links.append(SdistLink(f["filename"], urljoin(final, f["url"]),
                                   (f.get("hashes") or {}).get("sha256")))
    else:
        parser = _Anchors()
        parser.feed(body.decode("utf-8", errors="replace"))
        for href, text in parser.links:
            url, frag = urldefrag(urljoin(final, href))
            m = re.fullmatch(r"sha256=([0-9a-f]{64})", frag)
            name = text or urlsplit(url).path.rsplit("/", 1)[-1]
            links.append(SdistLink(name, url, m.group(1) if m else None))
    return [link for link in links if link.filename.endswith((".tar.gz", ".zip"))]


def find_sdist(index_url: str, project: str, version: str, *, timeout: float = 60.0) -> SdistLink:
    wanted = Version(version)
    name = canonicalize_name(project)
    matches = []
    for link in list_sdists(index_url, project, timeout=timeout):
        try:
            sname, sversion = parse_sdist_filename(link.filename)
        except InvalidSdistFilename:
            continue
        if sname == name and sversion == wanted:
            matches.append(link)
    if not matches:
        raise BuildFailed(FailureKind.INCOMPATIBLE.value,
                          f"{project} {version} has no sdist on {index_url}")
    matches.sort(key=lambda link: not link.filename.endswith(".tar.gz"))
    return matches[0]


def download_sdist(link: SdistLink, dest_dir: Path, *, timeout: float = 300.0) -> Path:
    """Download and check the sha256 the index published; refuse a source without one."""
    if link.sha256 is None:
        raise BuildFailed(FailureKind.INCOMPATIBLE.value,
                          f"the index publishes no sha256 for {link.filename}; refusing to "
                          "build unverified source")
    if "/" in link.filename or link.filename.startswith("."):
        raise BuildFailed(FailureKind.INCOMPATIBLE.value, f"bad sdist name {link.filename!r}")
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
                    raise BuildFailed(FailureKind.INCOMPATIBLE.value,
                                      f"{link.filename} is larger than 2 GiB")
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        part.unlink(missing_ok=True)
        raise InfrastructureError(f"downloading {link.url}: {exc}") from None
    if digest.hexdigest() != link.sha256:
        part.unlink(missing_ok=True)
        # A corrupted transfer is worth another try; a tampered file fails every time.
        raise InfrastructureError(
            f"{link.filename}: sha256 {digest.hexdigest()[:16]}… does not match the index's "
            f"{link.sha256[:16]}…")
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
                    raise BuildFailed(FailureKind.INCOMPATIBLE.value,
                                      f"{sdist.name}: member {member.filename!r} escapes")
            zf.extractall(dest)  # noqa: S202 (every member checked above)
    elif sdist.is_dir():
        shutil.copytree(sdist, dest / sdist.name)
    else:
        raise BuildFailed(FailureKind.INCOMPATIBLE.value,
                          f"{sdist.name} is not an sdist (.tar.gz or .zip)")
    entries = [p for p in dest.iterdir() if not p.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    if (dest / "setup.py").exists() or (dest / "pyproject.toml").exists():
        return dest
    raise BuildFailed(FailureKind.INCOMPATIBLE.value,
                      f"{sdist.name} does not unpack into one project directory")
