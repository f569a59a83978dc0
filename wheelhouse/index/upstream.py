"""Upstream indexes: where the index sends clients for projects it does not host, and the one
client that reads an upstream project page.

Routing rules are ``pattern[,pattern...]=URL`` joined by ``;``. Patterns are shell-style globs
on normalized names (``nvidia-*``). URLs are simple-index roots and may name the variant with
``{cu}`` (``cu128``), ``{cuda}`` (``12.8``) and ``{torch}`` (``2.8``).

The client (:func:`fetch_project`) asks for a project page the way uv does and reads either
answer an index may give: PEP 691 JSON or PEP 503 HTML. The worker takes sdists (with their
hashes) from it, the request form the released versions.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from wheelhouse.config import Route
from wheelhouse.errors import UpstreamUnavailable
from wheelhouse.variants import Variant

#: What uv sends: PEP 691 JSON preferred, PEP 503 HTML accepted.
ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
          "text/html;q=0.01")
#: The largest project page read (download.pytorch.org's torch page is a few MB).
MAX_PAGE_BYTES = 64 * 1024**2
SDIST_SUFFIXES = (".tar.gz", ".zip")
_SCHEMES = ("http", "https", "file")
_SHA256 = re.compile(r"sha256=([0-9a-f]{64})")


class Router:
    """Picks the upstream simple-index page for a project in a variant, or None when off."""

    def __init__(self, default: str, routes: tuple[Route, ...]) -> None:
        self.default = None if default.strip().lower() in ("", "off", "none") else default.strip()
        self.routes = routes if self.default is not None else ()

    @property
    def enabled(self) -> bool:
        return self.default is not None

    def root_for(self, project: NormalizedName, variant: Variant) -> str | None:
        """The upstream simple-index root that ``project`` is sent to from ``variant``'s root."""
        if self.default is None:
            return None
        root = self.default
        for route in self.routes:
            if route.matches(project):
                root = route.url.format(cu=variant.cu, cuda=variant.cuda, torch=variant.torch)
                break
        return root

    def url_for(self, project: NormalizedName, variant: Variant) -> str | None:
        root = self.root_for(project, variant)
        return None if root is None else f"{root.rstrip('/')}/{project}/"


# -- the client --


@dataclass(frozen=True)
class ProjectFile:
    """One file an upstream project page lists."""

    filename: str
    url: str
    """Absolute, without the hash fragment."""
    sha256: str | None
    requires_python: str | None = None
    yanked: bool = False
    yank_reason: str | None = None
    metadata: bool = False
    """PEP 658/714: the index serves the file's METADATA at ``url + ".metadata"``."""
    metadata_sha256: str | None = None
    size: int | None = None
    upload_time: str | None = None

    @property
    def is_sdist(self) -> bool:
        return self.filename.endswith(SDIST_SUFFIXES)

    @property
    def version(self) -> Version | None:
        """The version in the file name (wheel or sdist), or None for other names."""
        try:
            if self.filename.endswith(".whl"):
                return parse_wheel_filename(self.filename)[1]
            if self.is_sdist:
                return parse_sdist_filename(self.filename)[1]
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            pass
        return None


@dataclass(frozen=True)
class ProjectPage:
    """An upstream project page: its files and released versions (newest first)."""

    url: str
    files: tuple[ProjectFile, ...]
    versions: tuple[Version, ...]

    @property
    def sdists(self) -> list[ProjectFile]:
        return [f for f in self.files if f.is_sdist]


def project_url(index_url: str, project: str) -> str:
    return f"{index_url.rstrip('/')}/{canonicalize_name(project)}/"


def fetch_project(index_url: str, project: str, *, timeout: float = 60.0) -> ProjectPage:
    """``project``'s page on the simple index at ``index_url``, in whichever format it answers.

    A project the index does not know (404) is a page without files. Raises
    :class:`UpstreamUnavailable` when the index cannot be reached, answers another error, or
    sends something that is not a simple-index page.
    """
    return fetch_page(project_url(index_url, project), timeout=timeout)


def fetch_page(url: str, *, timeout: float = 60.0) -> ProjectPage:
    """The files the simple-index (or find-links) page at ``url`` lists; see
    :func:`fetch_project`."""
    fetched = fetch_if_changed(url, None, timeout=timeout)
    assert fetched.page is not None  # no ETag sent: never "not modified"
    return fetched.page


@dataclass(frozen=True)
class Fetched:
    """A conditional fetch's answer: the page, or None when the upstream said 304."""

    page: ProjectPage | None
    etag: str | None


def fetch_if_changed(url: str, etag: str | None, *, timeout: float = 60.0) -> Fetched:
    """:func:`fetch_page` with ``If-None-Match: etag`` (when given): a 304 is a
    :class:`Fetched` without a page, so a cached copy is confirmed for the price of a round
    trip."""
    if urlsplit(url).scheme not in _SCHEMES:
        raise UpstreamUnavailable(f"refusing to fetch {url[:200]!r}: not an http(s) URL")
    headers = {"Accept": ACCEPT, "User-Agent": "wheelhouse"}
    if etag:
        headers["If-None-Match"] = etag
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 (scheme checked)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310
            body = resp.read(MAX_PAGE_BYTES + 1)
            content_type = resp.headers.get("Content-Type", "")
            final = resp.geturl()
            new_etag = resp.headers.get("ETag")
    except urllib.error.HTTPError as exc:
        if exc.code == 304 and etag:
            return Fetched(None, exc.headers.get("ETag") or etag)
        if exc.code == 404:
            return Fetched(ProjectPage(url, (), ()), None)
        raise UpstreamUnavailable(f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
        raise UpstreamUnavailable(f"{url}: {getattr(exc, 'reason', exc)}") from None
    if len(body) > MAX_PAGE_BYTES:
        raise UpstreamUnavailable(f"{url} is larger than {MAX_PAGE_BYTES // 1024**2} MiB")
    text = body.decode("utf-8", errors="replace")
    try:
        if "json" in content_type:
            files, listed = _from_json(json.loads(text), final)
        else:
            files, listed = _from_html(text, final), None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UpstreamUnavailable(f"{url} is not a simple-index page: {exc}") from None
    return Fetched(ProjectPage(url, tuple(files), _versions(listed, files)), new_etag)


def _from_json(data: Any, base: str) -> tuple[list[ProjectFile], list[Any] | None]:
    """PEP 691 files; PEP 700 ``versions`` when the index gives them."""
    files = []
    for f in data["files"]:
        yanked = f.get("yanked", False)
        meta = f.get("core-metadata", f.get("dist-info-metadata", False))
        size = f.get("size")
        files.append(ProjectFile(
            filename=str(f["filename"]),
            url=urldefrag(urljoin(base, str(f["url"])))[0],
            sha256=(f.get("hashes") or {}).get("sha256"),
            requires_python=f.get("requires-python"),
            yanked=yanked not in (False, None),
            yank_reason=yanked if isinstance(yanked, str) and yanked else None,
            metadata=meta not in (False, None),
            metadata_sha256=meta.get("sha256") if isinstance(meta, dict) else None,
            size=size if isinstance(size, int) else None,
            upload_time=f.get("upload-time"),
        ))
    listed = data.get("versions")
    return files, listed if isinstance(listed, list) else None


class _Anchors(HTMLParser):
    """The anchors of a PEP 503 page: attributes and text (entities already decoded)."""

    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[tuple[dict[str, str | None], str]] = []
        self._open: tuple[dict[str, str | None], list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._close()
            self._open = (dict(attrs), [])

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open[1].append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._close()

    def close(self) -> None:
        super().close()
        self._close()  # an anchor left open at the end of the page still counts

    def _close(self) -> None:
        if self._open is not None:
            attrs, text = self._open
            self.anchors.append((attrs, "".join(text).strip()))
            self._open = None


def _from_html(text: str, base: str) -> list[ProjectFile]:
    parser = _Anchors()
    parser.feed(text)
    parser.close()
    files = []
    for attrs, label in parser.anchors:
        href = attrs.get("href")
        if not href:
            continue
        url, fragment = urldefrag(urljoin(base, href))
        m = _SHA256.fullmatch(fragment)
        meta = attrs.get("data-core-metadata", attrs.get("data-dist-info-metadata"))
        meta_hash = _SHA256.fullmatch(meta or "")
        files.append(ProjectFile(
            # PEP 503: the text is the file name; the URL's last segment where it is missing.
            filename=label or urlsplit(url).path.rsplit("/", 1)[-1],
            url=url,
            sha256=m.group(1) if m else None,
            requires_python=attrs.get("data-requires-python"),
            yanked="data-yanked" in attrs,
            yank_reason=attrs.get("data-yanked") or None,
            # PEP 714: the attribute's presence (``true`` or a hash) says the file is there.
            metadata=meta is not None,
            metadata_sha256=meta_hash.group(1) if meta_hash else None,
        ))
    return files


def _versions(listed: list[Any] | None, files: list[ProjectFile]) -> tuple[Version, ...]:
    found: set[Version] = set()
    if listed is not None:
        for v in listed:
            try:
                found.add(Version(str(v)))
            except InvalidVersion:
                continue
    else:
        found = {v for f in files if (v := f.version) is not None}
    return tuple(sorted(found, reverse=True))
