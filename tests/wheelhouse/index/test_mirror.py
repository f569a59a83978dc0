"""The pull-through cache's core over a real HTTP upstream and real local storage: pages kept
and revalidated with ETags, offline and unreachable upstreams, files verified before they are
kept, a concurrent first download followed, and least-recently-used eviction."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.helpers import QuietHandler, serve_http
from wheelhouse.config import Config
from wheelhouse.errors import UpstreamMismatch, UpstreamUnavailable
from wheelhouse.index import layout, mirror
from wheelhouse.index.mirror import MirrorFile, MirrorPage, Pages
from wheelhouse.index.storage import LocalStorage, Storage
from wheelhouse.index.upstream import fetch_page

BODY = os.urandom(3 * mirror.CHUNK + 5)
SHA = hashlib.sha256(BODY).hexdigest()
DEMO = canonicalize_name("demo")
OTHER = canonicalize_name("other")


@dataclass
class Upstream:
    url: str = ""
    etag: str = '"v1"'
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    not_modified: int = 0
    gate: threading.Event = field(default_factory=threading.Event)
    """Until set, file bodies stop after their first chunk (a slow upstream)."""
    body: bytes = BODY


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    up.gate.set()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            up.hits[self.path] += 1
            if self.path == "/simple/demo/":
                if self.headers.get("If-None-Match") == up.etag:
                    up.not_modified += 1
                    self.send_response(304)
                    self.end_headers()
                    return
                page = {"meta": {"api-version": "1.1"}, "name": "demo", "files": [
                    {"filename": "demo-1.0-py3-none-any.whl", "url": "/f/demo-1.0-py3-none-any.whl",
                     "hashes": {"sha256": SHA}, "yanked": "bad", "size": len(BODY),
                     "core-metadata": {"sha256": "c" * 64}, "requires-python": ">=3.9"},
                    {"filename": "demo-0.9-py3-none-any.whl", "url": "/f/x", "hashes": {}},
                    {"filename": "demo 0.8.whl", "url": "/f/y", "hashes": {"sha256": SHA}},
                ]}
                body = json.dumps(page).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", up.etag)
                self.end_headers()
                self.wfile.write(body)
            elif self.path.startswith("/f/"):
                self.send_response(200)
                self.send_header("Content-Length", str(len(up.body)))
                self.end_headers()
                self.wfile.write(up.body[:mirror.CHUNK])
                self.wfile.flush()
                up.gate.wait(20)
                self.wfile.write(up.body[mirror.CHUNK:])
            else:
                self.send_error(404)

    with serve_http(Handler) as url:
        up.url = url
        yield up


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return LocalStorage(tmp_path / "data")


def _config(tmp_path: Path, **changes: object) -> Config:
    return Config(storage=str(tmp_path / "data"), cache_spool=str(tmp_path / "spool"),
                  **changes)  # type: ignore[arg-type]


def test_a_page_keeps_what_installers_need_and_drops_what_cannot_be_verified(
        upstream: Upstream, storage: Storage, tmp_path: Path) -> None:
    served = Pages(storage, _config(tmp_path)).get(upstream.url + "/simple/", DEMO)
    assert served.stale is None
    (f,) = served.page.files  # no sha256, or a name storage can't hold: left out
    assert f == MirrorFile(filename="demo-1.0-py3-none-any.whl",
                           url=upstream.url + "/f/demo-1.0-py3-none-any.whl", sha256=SHA,
                           requires_python=">=3.9", yanked="bad", metadata=True,
                           metadata_sha256="c" * 64, size=len(BODY))
    stored = MirrorPage.from_json(storage.get_bytes(served.page.key))
    assert stored.files == served.page.files and stored.etag == '"v1"'


def test_pages_are_revalidated_with_their_etag_after_max_age(
        upstream: Upstream, storage: Storage, tmp_path: Path) -> None:
    root = upstream.url + "/simple/"
    pages = Pages(storage, _config(tmp_path, cache_page_max_age=600))
    pages.get(root, DEMO, now=1000.0)
    pages.get(root, DEMO, now=1500.0)
    assert upstream.hits["/simple/demo/"] == 1  # younger than max age: not asked
    again = pages.get(root, DEMO, now=1700.0)
    assert upstream.hits["/simple/demo/"] == 2 and upstream.not_modified == 1
    assert again.stale is None and again.page.fetched == 1700.0
    # Another process (a fresh Pages) starts from storage and revalidates too.
    Pages(storage, _config(tmp_path)).get(root, DEMO)
    assert upstream.not_modified == 2


def test_kept_pages_serve_when_the_upstream_is_down_or_off(
        upstream: Upstream, storage: Storage, tmp_path: Path) -> None:
    root = upstream.url + "/simple/"
    Pages(storage, _config(tmp_path)).get(root, DEMO)
    offline = Pages(storage, _config(tmp_path, upstream_offline=True)).get(root, DEMO)
    assert offline.stale == "offline" and len(offline.page.files) == 1
    assert upstream.hits["/simple/demo/"] == 1
    with pytest.raises(UpstreamUnavailable, match="not in the cache"):
        Pages(storage, _config(tmp_path, upstream_offline=True)).get(root, OTHER)
    dead = "http://127.0.0.1:9/simple/"  # discard port: nothing listens
    kept = MirrorPage.from_json(storage.get_bytes(offline.page.key))
    storage.put_bytes(layout.mirror_page_key(mirror.root_id(dead), DEMO),
                      MirrorPage(dead, kept.project, kept.files).to_json())
    down = Pages(storage, _config(tmp_path)).get(dead, DEMO)
    assert down.stale == "unreachable" and down.page.files == kept.files
    with pytest.raises(UpstreamUnavailable):
        Pages(storage, _config(tmp_path)).get(dead, OTHER)


def _file(upstream: Upstream, sha: str = SHA) -> MirrorFile:
    return MirrorFile("demo-1.0-py3-none-any.whl", upstream.url + "/f/demo", sha)


def test_a_first_download_is_kept_only_once_verified(
        upstream: Upstream, storage: Storage, tmp_path: Path) -> None:
    f = _file(upstream)
    download = mirror.begin(storage, _config(tmp_path), f)
    assert download is not None and download.size == len(BODY)
    chunks = iter(download.chunks)
    got = [next(chunks)]
    assert not storage.exists(f.key)  # not before the whole body matched
    got.extend(chunks)
    assert b"".join(got) == BODY
    assert storage.get_bytes(f.key) == BODY
    assert storage.exists(layout.mirror_used_key(SHA))
    assert mirror.begin(storage, _config(tmp_path), f) is None  # in storage now
    assert list((tmp_path / "spool").iterdir()) == []


def test_a_mismatch_is_never_kept_and_never_sent_whole(
        upstream: Upstream, storage: Storage, tmp_path: Path) -> None:
    f = _file(upstream, sha="0" * 64)
    download = mirror.begin(storage, _config(tmp_path), f)
    assert download is not None
    sent = []
    with pytest.raises(UpstreamMismatch):
        sent.extend(download.chunks)
    assert sum(map(len, sent)) < len(BODY)  # the last chunk is held back
    assert not storage.exists(f.key)
    assert list((tmp_path / "spool").iterdir()) == []


def test_a_concurrent_first_download_follows_the_fetch(
        upstream: Upstream, storage: Storage, tmp_path: Path) -> None:
    upstream.gate.clear()
    f = _file(upstream)
    first = mirror.begin(storage, _config(tmp_path), f)
    assert first is not None
    chunks = iter(first.chunks)
    head = next(chunks)  # the fetch is under way, stalled by the upstream
    second = mirror.begin(storage, _config(tmp_path), f)
    assert second is not None and second.size == len(BODY)
    got: list[bytes] = []
    follower = threading.Thread(target=lambda: got.extend(second.chunks))
    follower.start()
    upstream.gate.set()
    assert head + b"".join(chunks) == BODY
    follower.join(timeout=20)
    assert b"".join(got) == BODY
    assert upstream.hits["/f/demo"] == 1


def _put(storage: Storage, sha: str, size: int, used: float | None) -> None:
    key = layout.mirror_file_key(sha, f"p-{sha[:4]}-1.0-py3-none-any.whl")
    storage.put_bytes(key, b"x" * size)
    path = storage.local_path(key)
    assert path is not None
    os.utime(path, (1000.0, 1000.0))
    if used is not None:
        storage.put_bytes(layout.mirror_used_key(sha), b"")
        marker = storage.local_path(layout.mirror_used_key(sha))
        assert marker is not None
        os.utime(marker, (used, used))


def test_eviction_takes_the_least_recently_served_first(storage: Storage) -> None:
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    _put(storage, a, 100, used=5000.0)  # written first, served last
    _put(storage, b, 100, used=2000.0)
    _put(storage, c, 100, used=None)  # never served since it was written
    gone = mirror.evict(storage, budget=150, keep={c})
    assert [g.sha256 for g in gone] == [b, a]  # c is older but kept
    left = [o.key for o in storage.list(layout.MIRROR_FILES)]
    assert len(left) == 1 and left[0].startswith(layout.mirror_file_key(c, ""))
    assert not storage.exists(layout.mirror_used_key(a))
    assert mirror.evict(storage, budget=150) == []


def _put_named(storage: Storage, sha: str, filename: str, size: int, used: float) -> None:
    """A cached file and its PEP 658 metadata (written first: in whichever order storage lists
    them, the line is the wheel's)."""
    keys = (layout.mirror_file_key(sha, filename + ".metadata"),
            layout.mirror_file_key(sha, filename), layout.mirror_used_key(sha))
    for key in keys:
        storage.put_bytes(key, b"x" * size if key.endswith(".whl") else b"")
        path = storage.local_path(key)
        assert path is not None
        os.utime(path, (used, used))


@pytest.mark.parametrize(("filename", "line"), [
    ("torch-2.14.1+cu130-cp311-cp311-manylinux_2_28_x86_64.whl", "cu130"),
    ("torchvision-0.24.0+cu128-cp311-cp311-manylinux_2_28_x86_64.whl", "cu128"),
    ("nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl", "cu12"),
    ("torch-2.14.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", ""),
    ("numpy-2.3.0-cp311-cp311-manylinux_2_28_x86_64.whl", ""),
    ("cupy_cuda12x-13.0.0-cp311-cp311-manylinux2014_x86_64.whl", ""),
    ("not-a-wheel.tar.gz", ""),
])
def test_a_files_cuda_line_is_read_from_its_name(filename: str, line: str) -> None:
    assert mirror.cuda_line(filename) == line


def test_each_cuda_line_is_evicted_within_its_own_budget(storage: Storage) -> None:
    """A cluster moving to CUDA 13.0 fills the cache with cu130 torch: the cu128 torch the rest
    of it installs stays, however long ago it was served; the oldest cu130 file goes."""
    old128, old130, new130, pypi = "a" * 64, "b" * 64, "c" * 64, "d" * 64
    _put_named(storage, old128, "torch-2.8.0+cu128-cp311-cp311-linux_x86_64.whl", 100, 1000.0)
    _put_named(storage, old130, "torch-2.14.0+cu130-cp311-cp311-linux_x86_64.whl", 100, 2000.0)
    _put_named(storage, pypi, "numpy-2.3.0-cp311-cp311-linux_x86_64.whl", 100, 1500.0)
    _put_named(storage, new130, "torch-2.14.1+cu130-cp311-cp311-linux_x86_64.whl", 100, 3000.0)
    gone = mirror.evict(storage, budget=150, keep={new130}, line="cu130")
    assert [g.sha256 for g in gone] == [old130]
    left = {o.key.removeprefix(layout.MIRROR_FILES).split("/")[0]
            for o in storage.list(layout.MIRROR_FILES)}
    assert left == {old128, new130, pypi}
    # Each line within budget: nothing more goes, the files of no line included.
    assert mirror.evict(storage, budget=150, line="cu128") == []
    assert mirror.evict(storage, budget=150, line="") == []


@pytest.mark.parametrize(("patterns", "project", "cached"), [
    ("torch,nvidia-*", "torch", True),
    ("torch,nvidia-*", "nvidia-cublas-cu12", True),
    ("torch,nvidia-*", "numpy", False),
    ("*", "anything", True),
    ("", "torch", False),
    ("Typing_Extensions", "typing-extensions", True),
])
def test_which_projects_are_cached(patterns: str, project: str, cached: bool) -> None:
    assert mirror.caches(Config(cache_projects=patterns), canonicalize_name(project)) is cached


def test_the_default_caches_the_torch_family_and_build_requirements() -> None:
    config = Config()
    for project in ("torch", "torchvision", "triton", "nvidia-cudnn-cu12", "setuptools",
                    "ninja", "numpy", "filelock", "cuda-bindings", "cuda-toolkit", "pillow"):
        assert mirror.caches(config, canonicalize_name(project)), project
    assert not mirror.caches(config, canonicalize_name("flash-attn"))


def test_html_pages_give_metadata_and_yank_reasons(upstream: Upstream) -> None:
    sha = "d" * 64

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.send_body((
                f'<a href="https://x.example/whl/t-1.0%2Bcu130-py3-none-any.whl#sha256={sha}" '
                f'data-core-metadata="sha256={sha}" data-yanked="old">'
                "t-1.0+cu130-py3-none-any.whl</a>"
                f'<a href="/t-0.9-py3-none-any.whl#sha256={sha}" data-core-metadata="true">'
                "t-0.9-py3-none-any.whl</a>").encode(), "text/html")

    with serve_http(Handler) as url:
        page = fetch_page(url + "/t/")
    first, second = page.files
    assert first.url == "https://x.example/whl/t-1.0%2Bcu130-py3-none-any.whl"
    assert (first.metadata, first.metadata_sha256, first.yanked, first.yank_reason) == (
        True, sha, True, "old")
    assert (second.metadata, second.metadata_sha256, second.yanked) == (True, None, False)


def test_a_page_cannot_make_the_index_read_its_own_disk(
        storage: Storage, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * (3 * mirror.CHUNK))
    f = MirrorFile("demo-1.0-py3-none-any.whl", secret.as_uri(), "0" * 64)
    with pytest.raises(UpstreamUnavailable, match="not an http"):
        mirror.begin(storage, _config(tmp_path), f)
    assert list((tmp_path / "spool").iterdir()) == []


def test_a_page_never_sends_the_index_to_an_internal_host_it_names() -> None:
    """An upstream page is data: its links may point at the upstream's own host or at public
    hosts (PyPI's files live on files.pythonhosted.org), never at the index's network."""
    from packaging.utils import canonicalize_name

    from wheelhouse.index.mirror import from_upstream
    from wheelhouse.index.upstream import ProjectFile, ProjectPage

    sha = "a" * 64
    page = ProjectPage("https://203.0.113.7/simple/demo/", (
        ProjectFile("demo-1.0-py3-none-any.whl", "https://203.0.113.7/f/demo-1.0-py3-none-any.whl",
                    sha),
        ProjectFile("demo-1.1-py3-none-any.whl", "http://127.0.0.1:8500/v1/secret.whl", sha),
        ProjectFile("demo-1.2-py3-none-any.whl", "http://169.254.169.254/latest/x.whl", sha),
        ProjectFile("demo-1.3-py3-none-any.whl", "http://10.1.2.3/internal.whl", sha),
    ), ())
    kept = from_upstream("https://203.0.113.7/simple/", canonicalize_name("demo"), page, None,
                         0.0)
    assert [f.filename for f in kept.files] == ["demo-1.0-py3-none-any.whl"]
