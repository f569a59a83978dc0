"""The pull-through cache: upstream project pages and files kept in storage, served as our own.

For a project the operator names (``WHEELHOUSE_CACHE_PROJECTS``) that the index routes
upstream, the index serves the upstream's page itself, with links to itself. Pages are kept in
storage (``mirror/pages/``) and revalidated with ``If-None-Match`` once they are older than
``WHEELHOUSE_CACHE_PAGE_MAX_AGE``; with the upstream down (or ``WHEELHOUSE_UPSTREAM_OFFLINE``)
the kept page is served, marked stale.

A file's first download streams it from the upstream to the client while it is written to a
spool file; its last chunk is held back until the whole body matched the page's sha256, so a
client never receives a complete wrong file (the answer is cut short instead), and only a
matching file is kept, once its last chunk is sent (``mirror/files/<sha256>/<file>``). The
spool file is the claim: one fetch per file and host at a time; a concurrent first download on
the same host follows the spool file as it grows instead of fetching again. Files without a
sha256 on the upstream page are not listed: they could not be verified.

Past ``WHEELHOUSE_CACHE_MAX_GIB`` (a budget per CUDA line: :func:`cuda_line`) the least
recently served files of the new file's line are deleted (:func:`evict`); serving a file
touches ``mirror/used/<sha256>`` (at most every :data:`TOUCH_SECONDS` per process).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from packaging.utils import InvalidWheelFilename, NormalizedName, parse_wheel_filename

from wheelhouse.config import Config
from wheelhouse.errors import NotOnUpstream, StorageError, UpstreamMismatch, UpstreamUnavailable
from wheelhouse.index import layout
from wheelhouse.index.storage import Storage, check_key
from wheelhouse.index.upstream import Fetched, ProjectPage, fetch_if_changed, project_url

log = logging.getLogger(__name__)

PAGE_VERSION = 1
CHUNK = 1024 * 1024
#: Seconds a spool file may stop growing before its fetch counts as dead (and is taken over).
STALL_SECONDS = 60.0
#: A process touches a served file's ``used`` marker at most this often.
TOUCH_SECONDS = 300.0
#: Seconds an upstream file download may stay silent.
FETCH_TIMEOUT = 60.0
METADATA_SUFFIX = ".metadata"
#: Pages one process keeps in memory (least recently used go; storage still has them).
MAX_PAGES_IN_MEMORY = 4096


def caches(config: Config, project: NormalizedName) -> bool:
    """Whether ``project`` (routed upstream) is served through the cache."""
    return any(fnmatch.fnmatchcase(project, p) for p in config.cache_patterns)


def root_id(root_url: str) -> str:
    """A short stable name for an upstream root URL (``{cu}`` already filled in)."""
    return hashlib.sha256((root_url.rstrip("/") + "/").encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MirrorFile:
    """One file of a cached upstream page, as the upstream listed it."""

    filename: str
    url: str
    """Absolute upstream URL, no fragment."""
    sha256: str
    requires_python: str | None = None
    yanked: bool | str = False
    metadata: bool = False
    metadata_sha256: str | None = None
    size: int | None = None
    upload_time: str | None = None

    @property
    def key(self) -> str:
        return layout.mirror_file_key(self.sha256, self.filename)

    @property
    def metadata_key(self) -> str:
        return self.key + METADATA_SUFFIX

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MirrorFile:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class MirrorPage:
    """An upstream project page as stored in ``mirror/pages/``; readers ignore unknown
    fields."""

    root: str
    project: NormalizedName
    files: tuple[MirrorFile, ...]
    versions: tuple[str, ...] = ()
    etag: str | None = None
    fetched: float = 0.0
    """When the upstream last confirmed it (Unix time)."""
    version: int = PAGE_VERSION

    @property
    def root_id(self) -> str:
        return root_id(self.root)

    @property
    def key(self) -> str:
        return layout.mirror_page_key(self.root_id, self.project)

    def file(self, filename: str) -> MirrorFile | None:
        return next((f for f in self.files if f.filename == filename), None)

    def to_json(self) -> bytes:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files]
        data["versions"] = list(self.versions)
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> MirrorPage:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["files"] = tuple(MirrorFile.from_dict(f) for f in data.get("files", []))
        values["versions"] = tuple(data.get("versions", []))
        return cls(**values)


def _usable(name: str) -> bool:
    try:
        check_key(f"x/{name}")
    except ValueError:
        return False
    return True


def _internal(host: str) -> bool:
    """Whether ``host`` is, or resolves to, an address that is not a public one (loopback,
    private, link-local, reserved): where an upstream page's links must not send the index."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False  # does not resolve: the fetch fails on its own
    for info in infos:
        try:
            address = ipaddress.ip_address(info[4][0])
        except ValueError:
            continue
        if not address.is_global:
            return True
    return False


def _reachable_from(root: str) -> Callable[[str], bool]:
    """Which file URLs of a page under ``root`` the index may fetch: its own host's, and any
    public host's (PyPI's files live on another host), never an internal host the page names
    (it would make the index fetch, and stream, from inside the network)."""
    root_host = urlsplit(root).hostname or ""
    verdicts: dict[str, bool] = {}

    def ok(url: str) -> bool:
        host = urlsplit(url).hostname or ""
        if host == root_host:
            return True
        if host not in verdicts:
            verdicts[host] = bool(host) and not _internal(host)
        return verdicts[host]

    return ok


def from_upstream(root: str, project: NormalizedName, page: ProjectPage, etag: str | None,
                  now: float) -> MirrorPage:
    """What to keep of an upstream page: files with a sha256 and a name storage can hold,
    linked from the upstream's own host or a public one (:func:`_reachable_from`)."""
    reachable = _reachable_from(root)
    files = tuple(
        MirrorFile(filename=f.filename, url=f.url, sha256=f.sha256.lower(),
                   requires_python=f.requires_python,
                   yanked=(f.yank_reason or True) if f.yanked else False,
                   metadata=f.metadata, metadata_sha256=f.metadata_sha256, size=f.size,
                   upload_time=f.upload_time)
        for f in page.files
        if f.sha256 and len(f.sha256) == 64 and _usable(f.filename) and reachable(f.url))
    return MirrorPage(root=root, project=project, files=files,
                      versions=tuple(str(v) for v in page.versions), etag=etag, fetched=now)


@dataclass(frozen=True)
class Served:
    """A page to serve, and why it may be out of date (None: the upstream confirmed it)."""

    page: MirrorPage
    stale: str | None = None


@dataclass
class Pages:
    """This process's view of cached pages: memory first, then storage, then the upstream."""

    storage: Storage
    config: Config
    _mem: OrderedDict[tuple[str, str], tuple[MirrorPage, float]] = field(
        default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _hold(self, key: tuple[str, str], page: MirrorPage, checked: float) -> None:
        with self._lock:
            self._mem[key] = (page, checked)
            self._mem.move_to_end(key)
            while len(self._mem) > MAX_PAGES_IN_MEMORY:
                self._mem.popitem(last=False)

    def _stored(self, rid: str, project: str) -> MirrorPage | None:
        try:
            return MirrorPage.from_json(self.storage.get_bytes(
                layout.mirror_page_key(rid, project)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError):
            log.warning("ignoring the unreadable cached page %s/%s", rid, project)
            return None

    def known(self, rid: str, project: str) -> MirrorPage | None:
        """The page kept for ``project`` from root ``rid``, without asking the upstream."""
        with self._lock:
            held = self._mem.get((rid, project))
        if held is not None:
            return held[0]
        page = self._stored(rid, project)
        if page is not None:
            self._hold((rid, project), page, 0.0)
        return page

    def get(self, root: str, project: NormalizedName, now: float | None = None) -> Served:
        """``project``'s page from the upstream ``root``, revalidated when older than
        ``cache_page_max_age``. Raises :class:`UpstreamUnavailable` when the upstream cannot
        answer and nothing is kept."""
        now = time.time() if now is None else now
        rid = root_id(root)
        with self._lock:
            held = self._mem.get((rid, project))
        if held is not None and now - held[1] < self.config.cache_page_max_age \
                and not self.config.upstream_offline:
            return Served(held[0])
        kept = held[0] if held is not None else self._stored(rid, project)
        if self.config.upstream_offline:
            if kept is None:
                raise UpstreamUnavailable(
                    f"{project} is not in the cache, and the upstream is off "
                    "(WHEELHOUSE_UPSTREAM_OFFLINE)")
            return Served(kept, "offline")
        try:
            fetched: Fetched = fetch_if_changed(project_url(root, project),
                                                kept.etag if kept else None, timeout=30)
        except UpstreamUnavailable as exc:
            if kept is None:
                raise
            log.warning("serving the cached page of %s: %s", project, exc)
            # Ask again after a while, not on every request.
            self._hold((rid, project), kept, now - self.config.cache_page_max_age + 30)
            return Served(kept, "unreachable")
        if fetched.page is None and kept is not None:
            page = replace(kept, fetched=now)
        else:
            assert fetched.page is not None  # 304 only when an ETag was sent
            page = from_upstream(root, project, fetched.page, fetched.etag, now)
            if not page.files and kept is None:
                # Not kept, in storage or memory: made-up names must not fill either.
                raise NotOnUpstream(f"{project} is not on its upstream {root}")
            if kept is None or replace(kept, fetched=0.0) != replace(page, fetched=0.0):
                try:
                    self.storage.put_bytes(page.key, page.to_json())
                except StorageError as exc:
                    log.warning("could not keep the page of %s: %s", project, exc)
        self._hold((rid, project), page, now)
        return Served(page)


# -- files --


def spool_dir(config: Config) -> Path:
    base = Path(config.cache_spool) if config.cache_spool else (
        Path(tempfile.gettempdir()) / f"wheelhouse-mirror-{os.getuid()}")
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    if base.stat().st_uid != os.getuid() or base.is_symlink():
        # The spool files are claims and bodies: another user's directory could fake both.
        raise UpstreamUnavailable(f"the cache's spool {base} is not this user's own directory "
                                  "(set WHEELHOUSE_CACHE_SPOOL)")
    return base


def _open_upstream(url: str, *, timeout: float = FETCH_TIMEOUT) -> Any:
    # Never file: an upstream page must not make the index read its own disk (bytes go out
    # before the hash is checked).
    if urlsplit(url).scheme not in ("http", "https"):
        raise UpstreamUnavailable(f"refusing to fetch {url[:200]!r}: not an http(s) URL")
    request = urllib.request.Request(url, headers={"User-Agent": "wheelhouse"})  # noqa: S310
    try:
        return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310
    except urllib.error.HTTPError as exc:
        raise UpstreamUnavailable(f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UpstreamUnavailable(f"{url}: {getattr(exc, 'reason', exc)}") from None


@dataclass(frozen=True)
class Download:
    """A first download under way: its size (None: unknown) and its bytes."""

    size: int | None
    chunks: Iterator[bytes]


def _held_back(chunks: Iterator[bytes], f: MirrorFile, what: str,
               verified: Callable[[], None] = lambda: None) -> Iterator[bytes]:
    """``chunks``, the last one only once the whole body matched ``f.sha256``; then
    ``verified`` runs (it keeps the file). Keeping comes after the last byte, so that a
    client never waits for storage (a multi-GB copy) with its read timeout running; a request
    meanwhile follows the spool file, which goes only once the file is kept."""
    digest = hashlib.sha256()
    held = b""
    for chunk in chunks:
        digest.update(chunk)
        if held:
            yield held
        held = chunk
    if digest.hexdigest() != f.sha256:
        raise UpstreamMismatch(f"{what} {f.filename} has sha256 {digest.hexdigest()[:12]}…, "
                               f"its upstream page lists {f.sha256[:12]}…: not kept")
    if held:
        yield held
    verified()


def begin(storage: Storage, config: Config, f: MirrorFile) -> Download | None:
    """Start the first download of ``f``; None when it is (now) in storage.

    This process fetches it (and keeps it) unless another fetch of it is under way on this
    host, which is then followed.
    """
    spool = spool_dir(config)
    part = spool / f"{f.sha256}.part"
    for _ in range(3):
        if storage.exists(f.key):
            return None
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            follow = _follow(storage, part, f)
            if follow is not None:
                return follow
            continue
        return _fetch(storage, config, f, part, fd)
    raise UpstreamUnavailable(f"{f.filename}: another fetch of it keeps failing; try again")


def _size_file(part: Path) -> Path:
    return part.with_suffix(".size")


def _fetch(storage: Storage, config: Config, f: MirrorFile, part: Path, fd: int) -> Download:
    try:
        resp = _open_upstream(f.url)
    except BaseException:
        os.close(fd)
        part.unlink(missing_ok=True)
        raise
    length = resp.headers.get("Content-Length")
    size = int(length) if length and length.isdigit() else f.size
    sizes = _size_file(part)
    sizes.write_text("" if size is None else str(size))

    def upstream_chunks(out: Any) -> Iterator[bytes]:
        while chunk := resp.read(CHUNK):
            out.write(chunk)
            out.flush()  # a follower reads what is written
            yield chunk

    def keep(out: Any) -> None:
        out.close()
        try:
            storage.put_file(f.key, part)
            log.info("cached %s (%s)", f.filename, f.sha256[:12])
            touch(storage, f.sha256)
            if config.cache_max_gib > 0:
                evict(storage, int(config.cache_max_gib * 1024**3), keep={f.sha256},
                      line=cuda_line(f.filename))
        except StorageError as exc:
            log.warning("%s is served but could not be kept: %s", f.filename, exc)

    def chunks() -> Iterator[bytes]:
        try:
            with os.fdopen(fd, "wb") as out, resp:
                yield from _held_back(upstream_chunks(out), f, "the upstream's",
                                      lambda: keep(out))
        except UpstreamMismatch as exc:
            log.error("%s", exc)
            raise
        finally:
            part.unlink(missing_ok=True)
            sizes.unlink(missing_ok=True)

    return Download(size, chunks())


def _follow(storage: Storage, part: Path, f: MirrorFile) -> Download | None:
    """Follow another fetch's spool file; None when there is none to follow (any more)."""
    sizes = _size_file(part)
    deadline = time.monotonic() + 10
    while not sizes.exists():
        if not part.exists() or time.monotonic() > deadline:
            _take_over_if_dead(part)
            return None
        time.sleep(0.02)
    try:
        src = part.open("rb")
        text = sizes.read_text().strip()
    except FileNotFoundError:
        return None  # finished meanwhile: storage has it, or the fetch failed
    if not text.isdigit():
        src.close()
        return _passthrough(f)  # of unknown length: its end can't be told; fetch, don't keep
    size = int(text)

    def grown() -> Iterator[bytes]:
        got, last_growth = 0, time.monotonic()
        with src:
            while got < size:
                chunk = src.read(min(CHUNK, size - got))
                if chunk:
                    got += len(chunk)
                    last_growth = time.monotonic()
                    yield chunk
                    continue
                if time.monotonic() - last_growth > STALL_SECONDS or (
                        not part.exists() and not storage.exists(f.key)):
                    raise UpstreamUnavailable(f"the fetch of {f.filename} this download "
                                              "followed stopped; try again")
                time.sleep(0.02)

    return Download(size, _held_back(grown(), f, "the followed fetch of"))


def _passthrough(f: MirrorFile) -> Download:
    """The file straight from the upstream, verified the same way, and not kept."""
    resp = _open_upstream(f.url)
    length = resp.headers.get("Content-Length")

    def chunks() -> Iterator[bytes]:
        with resp:
            yield from iter(lambda: resp.read(CHUNK), b"")

    return Download(int(length) if length and length.isdigit() else None,
                    _held_back(chunks(), f, "the upstream's"))


def _take_over_if_dead(part: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if time.time() - part.stat().st_mtime > STALL_SECONDS:
            part.unlink()


def fill(storage: Storage, config: Config, f: MirrorFile) -> None:
    """Make sure ``f`` is in storage (for answers that need the whole file first: ranges)."""
    download = begin(storage, config, f)
    if download is not None:
        for _ in download.chunks:
            pass
    if not storage.exists(f.key):
        raise UpstreamUnavailable(f"{f.filename} could not be cached; try again")


def metadata(storage: Storage, f: MirrorFile, *, offline: bool = False) -> bytes:
    """``f``'s METADATA (PEP 658), from storage or fetched once from the upstream and kept
    if it matches the hash the page lists."""
    try:
        return storage.get_bytes(f.metadata_key)
    except FileNotFoundError:
        if offline:
            raise UpstreamUnavailable(f"the METADATA of {f.filename} is not in the cache, and "
                                      "the upstream is off (WHEELHOUSE_UPSTREAM_OFFLINE)") from None
    with _open_upstream(f.url + METADATA_SUFFIX) as resp:
        body: bytes = resp.read(64 * 1024**2)
    digest = hashlib.sha256(body).hexdigest()
    if f.metadata_sha256 and digest != f.metadata_sha256:
        raise UpstreamMismatch(f"the upstream's METADATA of {f.filename} has sha256 "
                               f"{digest[:12]}…, its page lists {f.metadata_sha256[:12]}…")
    with contextlib.suppress(StorageError):
        storage.put_bytes(f.metadata_key, body)
    return body


# -- least recently used --


_touched: dict[str, float] = {}
_touch_lock = threading.Lock()


def touch(storage: Storage, sha256: str, now: float | None = None) -> None:
    """Note that the file ``sha256`` was served (at most every TOUCH_SECONDS per process)."""
    now = time.monotonic() if now is None else now
    with _touch_lock:
        if now - _touched.get(sha256, -TOUCH_SECONDS) < TOUCH_SECONDS:
            return
        _touched[sha256] = now
    with contextlib.suppress(StorageError):
        storage.put_bytes(layout.mirror_used_key(sha256), b"")


#: A CUDA line in a file name: PyTorch's local label (``torch-2.14.1+cu130``) or the suffix of
#: NVIDIA's runtime packages (``nvidia-cublas-cu12``).
_CUDA_LINE = re.compile(r"(?:^|[-_+.])(cu\d+)(?=$|[-_.])")


def cuda_line(filename: str) -> str:
    """The CUDA line a cached file belongs to (``cu130``), or ``""`` for one of none: each line
    is evicted within its own budget, so fetching one line's torch never evicts another's."""
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return ""
    for part in (version.local or "", name):
        match = _CUDA_LINE.search(part)
        if match:
            return match.group(1)
    return ""


@dataclass(frozen=True)
class Cached:
    """The files the cache holds under one sha256."""

    sha256: str
    keys: tuple[str, ...]
    size: int
    used: float

    @property
    def line(self) -> str:
        """The CUDA line of its file (:func:`cuda_line`)."""
        names = {k.rsplit("/", 1)[-1].removesuffix(METADATA_SUFFIX) for k in self.keys}
        return next((line for line in map(cuda_line, sorted(names)) if line), "")


def cached_files(storage: Storage) -> list[Cached]:
    """What the cache holds, least recently used first."""
    used = {o.key.removeprefix(layout.MIRROR_USED): o.mtime
            for o in storage.list(layout.MIRROR_USED)}
    groups: dict[str, list[Any]] = {}
    for obj in storage.list(layout.MIRROR_FILES):
        groups.setdefault(obj.key.removeprefix(layout.MIRROR_FILES).split("/")[0], []).append(obj)
    found = [Cached(sha, tuple(o.key for o in objs), sum(o.size for o in objs),
                    max([used.get(sha, 0.0), *(o.mtime for o in objs)]))
             for sha, objs in groups.items()]
    return sorted(found, key=lambda c: c.used)


def evict(storage: Storage, budget: int, keep: frozenset[str] | set[str] = frozenset(),
          line: str | None = None) -> list[Cached]:
    """Delete the least recently used files until the cache holds at most ``budget`` bytes
    (never those in ``keep``); with ``line``, only that CUDA line's files count and go (the
    budget is per line: ``""`` is the files of no line). Returns what went."""
    held = [c for c in cached_files(storage) if line is None or c.line == line]
    total = sum(c.size for c in held)
    gone = []
    for c in held:
        if total <= budget:
            break
        if c.sha256 in keep:
            continue
        for key in c.keys:
            storage.delete(key)
        storage.delete(layout.mirror_used_key(c.sha256))
        total -= c.size
        gone.append(c)
        log.info("evicted %s from the cache (%d bytes)", c.keys[0], c.size)
    return gone
