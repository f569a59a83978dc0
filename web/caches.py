"""What one server process keeps in memory between requests, each cache bounded or expiring.

- :class:`PageCache`: rendered index pages (and upstream redirects), valid for one catalog
  generation; read by the Flask views and by the fast path alike. Least recently used
  answers go first: pages past a byte budget, redirects for projects we don't host past a
  count, so a flood of made-up names neither grows memory nor evicts the real pages.
- :class:`FormatCache`: the format already negotiated for an ``Accept`` header.
- :class:`MetadataCache`: published ``.metadata`` bodies (small, and immutable once published),
  least recently used first out past a count and a byte budget.
- :class:`VersionsCache`: an upstream project's released versions, for the request form.

They hold no reference to Flask: the app factory makes one of each for :class:`Services`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from werkzeug.utils import get_content_type

from wheelhouse.errors import UpstreamUnavailable
from wheelhouse.index.upstream import fetch_project

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


#: (origin + script root + kind, variant key, project name as requested, format).
PageKey = tuple[str, str, str, str]


def origin(environ: Mapping[str, Any]) -> str:
    """``scheme://host`` as the request names it (after ProxyFix): a page holds fully
    qualified provenance URLs (PEP 740), so one page is kept per origin."""
    host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME", "")
    return f"{environ.get('wsgi.url_scheme', 'http')}://{host}"


class _LRU:
    """An ordered dict trimmed from its least recently used end past ``max_items`` entries or
    ``max_bytes`` of bodies. Not locked: :class:`PageCache` holds the lock."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0
        self.pages: OrderedDict[PageKey, Page] = OrderedDict()

    def get(self, key: PageKey) -> Page | None:
        page = self.pages.get(key)
        if page is not None:
            self.pages.move_to_end(key)
        return page

    def put(self, key: PageKey, page: Page) -> None:
        old = self.pages.pop(key, None)
        if old is not None:
            self.bytes -= _cost(old)
        self.pages[key] = page
        self.bytes += _cost(page)
        while self.pages and (len(self.pages) > self.max_items or self.bytes > self.max_bytes):
            _, gone = self.pages.popitem(last=False)
            self.bytes -= _cost(gone)


def _cost(page: Page) -> int:
    """Roughly what a cached answer holds: its body and headers, plus the entry's overhead."""
    return len(page.body) + sum(len(k) + len(v) for k, v in page.headers) + 256


class PageCache:
    """Answers by :data:`PageKey`, valid for one generation. Keyed on the raw request, so a
    hit skips validation: it was valid when cached.

    Pages (200) and other answers (redirects upstream) are kept apart, each least recently
    used first out: pages up to ``max_page_bytes``, other answers up to ``max_other``.
    """

    def __init__(self, *, max_page_bytes: int = 64 * 1024 * 1024, max_pages: int = 50_000,
                 max_other: int = 4096) -> None:
        self._lock = threading.Lock()
        self._generation = ""
        self._limits = (max_pages, max_page_bytes, max_other)
        self._pages = _LRU(max_pages, max_page_bytes)
        self._other = _LRU(max_other, max_other * 4096)

    def get(self, generation: str, key: PageKey) -> Page | None:
        with self._lock:
            if generation != self._generation:
                self._clear(generation)
                return None
            return self._pages.get(key) or self._other.get(key)

    def put(self, generation: str, key: PageKey, page: Page) -> None:
        with self._lock:
            if generation == self._generation:
                (self._pages if page.status == 200 else self._other).put(key, page)

    def _clear(self, generation: str) -> None:
        max_pages, max_page_bytes, max_other = self._limits
        self._pages = _LRU(max_pages, max_page_bytes)
        self._other = _LRU(max_other, max_other * 4096)
        self._generation = generation

    def __len__(self) -> int:
        return len(self._pages.pages) + len(self._other.pages)

    @property
    def bytes(self) -> int:
        """What the cached answers hold, roughly (see :func:`_cost`)."""
        return self._pages.bytes + self._other.bytes


def etag_matches(header: str | None, etag: str) -> bool:
    """Whether ``If-None-Match`` matches ``etag`` (quoted): ``*``, or any listed tag under
    the weak comparison that RFC 9110 (13.1.2) prescribes for it (``W/"x"`` matches ``"x"``)."""
    if header is None:
        return False
    if header.strip() == "*":
        return True
    return any(t.strip().removeprefix("W/") == etag for t in header.split(","))


class FormatCache:
    """``json``, ``html`` or ``html-v1`` by (Accept header, ``?format=``): clients send few distinct
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
    """``.metadata`` bodies by storage key, least recently used first out past ``max_items``
    bodies or ``max_bytes`` of them; a body larger than ``max_bytes`` alone is served but not
    kept. (Publishing caps METADATA at ``MAX_METADATA_BYTES``; one stored before that cap must
    not pin a worker's memory either.)"""

    MAX = 8192
    MAX_BYTES = 64 * 1024 * 1024

    def __init__(self, *, max_items: int = MAX, max_bytes: int = MAX_BYTES) -> None:
        self._lock = threading.Lock()
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0
        self._bodies: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            body = self._bodies.get(key)
            if body is not None:
                self._bodies.move_to_end(key)
            return body

    def put(self, key: str, body: bytes) -> None:
        if len(body) > self.max_bytes:
            return
        with self._lock:
            old = self._bodies.pop(key, None)
            self.bytes += len(body) - (len(old) if old is not None else 0)
            self._bodies[key] = body
            while len(self._bodies) > self.max_items or self.bytes > self.max_bytes:
                _, gone = self._bodies.popitem(last=False)
                self.bytes -= len(gone)

    def __len__(self) -> int:
        return len(self._bodies)


class VersionsCache:
    """An upstream project's versions for the request form, newest first, kept for
    :attr:`TTL` seconds; None (also kept) when the upstream did not answer."""

    TTL = 300.0
    #: The most versions the form lists.
    SHOWN = 100
    #: The most projects kept (only recipe projects are asked for; bounded all the same).
    MAX = 256

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
        if len(self._answers) >= self.MAX:
            self._answers.clear()
        self._answers[key] = (time.monotonic(), result)
        return result
