"""What one server process keeps in memory between requests, each cache bounded or expiring.

- :class:`PageCache`: rendered index pages (and upstream redirects), valid for one catalog
  generation; read by the Flask views and by the fast path alike.
- :class:`FormatCache`: the format already negotiated for an ``Accept`` header.
- :class:`MetadataCache`: published ``.metadata`` bodies (small, and immutable once published).
- :class:`VersionsCache`: an upstream project's released versions, for the request form.

They hold no reference to Flask: the app factory makes one of each for :class:`Services`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from werkzeug.utils import get_content_type

from wheelhouse.errors import UpstreamUnavailable
from wheelhouse.upstream import fetch_project

#: Status lines of the answers a :class:`Page` can hold.
STATUS_LINES = {200: "200 OK", 302: "302 FOUND", 304: "304 NOT MODIFIED"}


@dataclass(frozen=True)
class Page:
    """A rendered answer, kept for one catalog generation: a page, or an upstream redirect."""

    body: bytes
    etag: str
    headers: tuple[tuple[str, str], ...]
    mimetype: str | None = None
    status: int = 200

    @property
    def content_type(self) -> str:
        return get_content_type(self.mimetype or "text/html", "utf-8")


#: (script root + kind, variant key, project name as requested, format).
PageKey = tuple[str, str, str, str]


class PageCache:
    """Answers by :data:`PageKey`, valid for one generation. Keyed on the raw request, so a
    hit skips validation: it was valid when cached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = ""
        self._pages: dict[PageKey, Page] = {}

    def get(self, generation: str, key: PageKey) -> Page | None:
        if generation != self._generation:
            with self._lock:
                if generation != self._generation:
                    self._pages = {}
                    self._generation = generation
            return None
        return self._pages.get(key)

    def put(self, generation: str, key: PageKey, page: Page) -> None:
        if generation == self._generation:
            self._pages[key] = page


class FormatCache:
    """``json`` or ``html`` by (Accept header, ``?format=``): clients send few distinct
    headers, and the fast path must know the format without Flask's negotiation."""

    MAX = 512

    def __init__(self) -> None:
        self._formats: dict[tuple[str, str | None], str] = {}

    def get(self, accept: str, format_arg: str | None = None) -> str | None:
        return self._formats.get((accept, format_arg))

    def put(self, accept: str, format_arg: str | None, fmt: str) -> None:
        if len(self._formats) >= self.MAX:  # stay bounded whatever clients send
            self._formats.clear()
        self._formats[(accept, format_arg)] = fmt


class MetadataCache:
    """``.metadata`` bodies by storage key."""

    MAX = 8192

    def __init__(self) -> None:
        self._bodies: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self._bodies.get(key)

    def put(self, key: str, body: bytes) -> None:
        if len(self._bodies) >= self.MAX:
            self._bodies.clear()
        self._bodies[key] = body


class VersionsCache:
    """An upstream project's versions for the request form, newest first, kept for
    :attr:`TTL` seconds; None (also kept) when the upstream did not answer."""

    TTL = 300.0
    #: The most versions the form lists.
    SHOWN = 100

    def __init__(self, *, timeout: float = 3.0) -> None:
        self.timeout = timeout
        self._answers: dict[tuple[str, str], tuple[float, list[str] | None]] = {}

    def get(self, index_url: str | None, project: str) -> list[str] | None:
        if not index_url:
            return None
        key = (index_url, project)
        cached = self._answers.get(key)
        if cached is not None and time.monotonic() - cached[0] < self.TTL:
            return cached[1]
        result: list[str] | None
        try:
            page = fetch_project(index_url, project, timeout=self.timeout)
            result = [str(v) for v in page.versions if not v.is_devrelease][:self.SHOWN]
        except UpstreamUnavailable:
            result = None
        self._answers[key] = (time.monotonic(), result)
        return result
