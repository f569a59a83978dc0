"""The page cache stays bounded whatever names clients ask for, and keeps the real pages."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask.testing import FlaskClient

from tests.helpers import make_wheel
from tests.web.conftest import VARIANT
from web import create_app
from web.caches import MetadataCache, Page, PageCache
from web.services import services
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant


def _page(body: bytes, status: int = 200) -> Page:
    return Page(body, '"e"', (("ETag", '"e"'),), None, status)


def test_least_recently_used_pages_go_first_past_the_byte_budget() -> None:
    cache = PageCache(max_page_bytes=10_000, max_other=10)
    cache.get("g", ("root", VARIANT, "", "html"))  # as the views do: look up, then store
    for i in range(20):
        cache.put("g", ("project", VARIANT, f"p{i}", "html"), _page(b"x" * 1000))
        cache.get("g", ("project", VARIANT, "p0", "html"))  # p0 is used all the time
    assert cache.bytes <= 10_000
    assert cache.get("g", ("project", VARIANT, "p0", "html")) is not None
    assert cache.get("g", ("project", VARIANT, "p1", "html")) is None  # used once, long ago
    assert cache.get("g", ("project", VARIANT, "p19", "html")) is not None


def test_redirects_are_counted_apart_and_never_evict_pages() -> None:
    cache = PageCache(max_page_bytes=1_000_000, max_other=100)
    cache.get("g", ("root", VARIANT, "", "html"))
    cache.put("g", ("project", VARIANT, "real", "json"), _page(b"page"))
    for i in range(10_000):
        cache.put("g", ("project", VARIANT, f"made-up-{i}", "json"), _page(b"", 302))
    assert len(cache) == 101
    assert cache.get("g", ("project", VARIANT, "real", "json")) is not None
    assert cache.get("g", ("project", VARIANT, "made-up-9999", "json")) is not None
    assert cache.get("g", ("project", VARIANT, "made-up-0", "json")) is None


def test_a_new_generation_starts_empty() -> None:
    cache = PageCache()
    cache.get("g1", ("root", VARIANT, "", "html"))
    cache.put("g1", ("root", VARIANT, "", "html"), _page(b"old"))
    assert cache.get("g1", ("root", VARIANT, "", "html")) is not None
    assert cache.get("g2", ("root", VARIANT, "", "html")) is None
    cache.put("g1", ("root", VARIANT, "", "html"), _page(b"late"))  # rendered for g1: dropped
    assert len(cache) == 0


@pytest.fixture
def flooded(tmp_path: Path) -> FlaskClient:
    config = Config(storage=str(tmp_path / "data"), upstream="https://up.example/simple/",
                    catalog_refresh_seconds=3600)
    variant = parse_variant(VARIANT)
    publish(open_storage(config), make_wheel(tmp_path, "demo-ext", f"1.0+{variant.local_label}"),
            variant)
    return create_app(config).test_client()


def test_a_flood_of_unknown_projects_keeps_the_cache_bounded(flooded: FlaskClient) -> None:
    """Each unknown name is answered with a redirect upstream, and each answer is cached; the
    flood is larger than the bound, and the hosted page stays cached through it."""
    page = flooded.get(f"/{VARIANT}/simple/demo-ext/")
    assert page.status_code == 200
    with flooded.application.app_context():
        cache = services().pages
        generation = services().catalog.generation
    # Pages are kept per origin: they hold fully qualified provenance URLs (PEP 740).
    hosted = ("http://localhost" + "project", VARIANT, "demo-ext", "html")
    assert cache.get(generation, hosted) is not None
    bound = 4096
    for i in range(bound + 1000):
        resp = flooded.get(f"/{VARIANT}/simple/not-here-{i}/")
        assert resp.status_code == 302
    assert len(cache) <= bound + 1
    assert cache.bytes < 4 * 1024 * 1024
    assert cache.get(generation, hosted) is not None  # the real page outlived the flood


def test_metadata_bodies_are_kept_within_a_byte_budget_least_recently_used_first() -> None:
    cache = MetadataCache(max_items=100, max_bytes=10_000)
    for i in range(20):
        cache.put(f"k{i}", b"x" * 1000)
        assert cache.get("k0") is not None  # used all the time
    assert cache.bytes <= 10_000 and len(cache) == 10
    assert cache.get("k1") is None and cache.get("k19") is not None
    cache.put("huge", b"x" * 10_001)  # served by the caller, never kept
    assert cache.get("huge") is None and cache.get("k0") is not None
    cache.put("k0", b"y")  # replaced: counted once
    assert cache.bytes == 9 * 1000 + 1


def test_served_metadata_stays_within_the_cache_budget(tmp_path: Path) -> None:
    """Through the app: every .metadata is served whole, and what its process keeps of them
    stays within the budget however many are asked for."""
    config = Config(storage=str(tmp_path / "data"), upstream="off", catalog_refresh_seconds=0)
    variant = parse_variant(VARIANT)
    bodies = {}
    for i in range(6):
        version = f"1.{i}+{variant.local_label}"
        body = (f"Metadata-Version: 2.1\nName: meta-heavy\nVersion: {version}\n\n"
                + "README " * 30_000).encode()
        wheel = make_wheel(tmp_path / str(i), "meta-heavy", version, files={
            f"meta_heavy-{version}.dist-info/METADATA": body})
        publish(open_storage(config), wheel, variant, variant_form=False)
        bodies[wheel.name] = body
    app = create_app(config)
    with app.app_context():
        cache = services().metadata
    cache.max_bytes = 500_000  # room for two of the ~210 KB bodies
    client = app.test_client()
    for name, body in bodies.items():
        resp = client.get(f"/files/{VARIANT}/meta-heavy/{name}.metadata")
        assert resp.status_code == 200 and resp.data == body
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 2
