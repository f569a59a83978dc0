"""Pages and files of the pull-through cache, through the app over both storages, with a real
HTTP upstream; ownership rules unchanged: what is owned here is never served from upstream."""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from tests.helpers import QuietHandler, make_wheel, serve_http
from web import create_app
from web.cli import through_own_cache
from web.simple import UPSTREAM_HEADER
from wheelhouse.config import Config
from wheelhouse.index import layout
from wheelhouse.index.catalog import Record
from wheelhouse.index.storage import open_storage

VARIANT = "torch2.8-cu128"


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[str, collections.Counter[str]]]:
    """One upstream with ``torch`` and ``demo-ext`` (PEP 503, absolute links); counts hits."""
    hits: collections.Counter[str] = collections.Counter()
    wheels = {p: make_wheel(tmp_path / "up", p, "1.0+cu128") for p in ("torch", "demo-ext")}

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            hits[self.path] += 1
            project = self.path.strip("/").split("/")[-1]
            by_name = {w.name: w for w in wheels.values()}
            if project in wheels:
                w = wheels[project]
                sha = hashlib.sha256(w.read_bytes()).hexdigest()
                base = f"http://{self.headers['Host']}"
                self.send_body(f'<a href="{base}/whl/{w.name}#sha256={sha}">{w.name}</a>'
                               .encode(), "text/html")
            elif project in by_name:
                self.send_body(by_name[project].read_bytes(), "application/octet-stream")
            else:
                self.send_error(404)

    with serve_http(Handler) as url:
        yield url, hits


def _client(app_config: Config, upstream: str, **changes: object) -> FlaskClient:
    settings: dict[str, object] = {"cache_projects": "torch,demo-ext", **changes}
    config = app_config.replace(upstream=upstream + "/simple/", upstream_rules="", **settings)
    return create_app(config).test_client()


def test_a_cached_project_is_served_by_the_index_and_its_files_kept(
        app_config: Config, upstream: tuple[str, collections.Counter[str]]) -> None:
    url, hits = upstream
    client = _client(app_config, url)
    page = client.get(f"/{VARIANT}/simple/torch/")
    assert page.status_code == 200 and page.headers[UPSTREAM_HEADER] == "fresh"
    assert url not in page.text
    listing = client.get(f"/{VARIANT}/simple/torch/",
                         headers={"Accept": "application/vnd.pypi.simple.v1+json"}).json
    assert listing is not None
    (entry,) = listing["files"]
    body = client.get(entry["url"]).data
    assert hashlib.sha256(body).hexdigest() == entry["hashes"]["sha256"]
    again = client.get(entry["url"], headers={"Range": "bytes=0-9"})
    assert again.status_code == 206 and again.data == body[:10]
    assert hits[f"/whl/{entry['filename']}"] == 1
    storage = open_storage(app_config)
    assert storage.get_bytes(layout.mirror_file_key(entry["hashes"]["sha256"],
                                                    entry["filename"])) == body


def test_a_project_owned_here_is_never_served_from_upstream(
        app_config: Config, upstream: tuple[str, collections.Counter[str]],
        published: list[Record]) -> None:
    url, hits = upstream
    client = _client(app_config, url, private_projects="torch", cache_projects="*")
    assert client.get(f"/{VARIANT}/simple/torch/").status_code == 404
    hosted = client.get(f"/{VARIANT}/simple/demo-ext/")  # published here: its own page
    assert hosted.status_code == 200 and UPSTREAM_HEADER not in hosted.headers
    files = json.loads(client.get(f"/{VARIANT}/simple/demo-ext/", headers={
        "Accept": "application/vnd.pypi.simple.v1+json"}).data)["files"]
    assert {f["filename"] for f in files} == {
        r.filename for r in published if r.variant.key == VARIANT}
    assert "/mirror/" not in hosted.text
    assert not [p for p in hits if p.startswith("/simple/")]  # the upstream was never asked


def test_with_the_cache_off_projects_are_redirected_as_before(
        app_config: Config, upstream: tuple[str, collections.Counter[str]]) -> None:
    url, hits = upstream
    client = _client(app_config, url, cache_projects="")
    resp = client.get(f"/{VARIANT}/simple/torch/")
    assert resp.status_code == 302 and resp.headers["Location"] == f"{url}/simple/torch/"
    assert not hits


def test_offline_serves_the_kept_page_and_refuses_what_was_never_fetched(
        app_config: Config, upstream: tuple[str, collections.Counter[str]]) -> None:
    url, hits = upstream
    _client(app_config, url).get(f"/{VARIANT}/simple/torch/")
    offline = _client(app_config, url, upstream_offline=True)
    page = offline.get(f"/{VARIANT}/simple/torch/")
    assert page.status_code == 200 and page.headers[UPSTREAM_HEADER] == "stale; offline"
    assert "could not be asked" in page.text
    link = page.text.split('href="')[1].split("#")[0]
    assert offline.get(link).status_code == 503  # never fetched, and the upstream is off
    assert offline.get(f"/{VARIANT}/simple/demo-ext/").status_code == 503
    assert hits["/simple/torch/"] == 1


@pytest.mark.parametrize(("settings", "host", "expected"), [
    ({}, "0.0.0.0", "http://127.0.0.1:8000"),
    ({}, "::", "http://[::1]:8000"),
    ({}, "10.0.0.5", "http://10.0.0.5:8000"),
    ({"build_through_index": "http://elsewhere:1"}, "0.0.0.0", "http://elsewhere:1"),
    ({"cache_projects": ""}, "0.0.0.0", ""),  # no cache: builds use the upstreams directly
    ({"torch_index_url": "http://mirror.lan/{cu}"}, "0.0.0.0", ""),  # the operator's own
    ({"upstream": "http://devpi.lan/simple/"}, "0.0.0.0", ""),
])
def test_a_single_box_builds_through_its_own_cache_by_default(
        settings: dict[str, str], host: str, expected: str) -> None:
    config = through_own_cache(Config(**settings), host, 8000)  # type: ignore[arg-type]
    assert config.build_through_index == expected


def test_a_name_the_upstream_does_not_know_is_404_and_not_kept(
        app_config: Config, upstream: tuple[str, collections.Counter[str]]) -> None:
    url, _ = upstream
    client = _client(app_config, url, cache_projects="*")
    resp = client.get(f"/{VARIANT}/simple/made-up-name/")
    assert resp.status_code == 404 and "not on its upstream" in resp.text
    assert list(open_storage(app_config).list(layout.MIRROR_PAGES)) == []


def test_the_plain_root_serves_cached_projects_from_the_default_upstream(
        app_config: Config, upstream: tuple[str, collections.Counter[str]]) -> None:
    url, hits = upstream
    page = _client(app_config, url).get("/simple/torch/")
    assert page.status_code == 200 and page.headers[UPSTREAM_HEADER] == "fresh"
    assert "/mirror/" in page.text and url not in page.text
    assert hits["/simple/torch/"] == 1


def test_a_range_of_a_file_not_cached_yet_fills_the_cache_first(
        app_config: Config, upstream: tuple[str, collections.Counter[str]]) -> None:
    """A range can't be checked against the sha256: the whole file is fetched and verified
    first, then the range served from storage."""
    url, hits = upstream
    client = _client(app_config, url)
    listing = client.get(f"/{VARIANT}/simple/torch/",
                         headers={"Accept": "application/vnd.pypi.simple.v1+json"}).json
    assert listing is not None
    (entry,) = listing["files"]
    part = client.get(entry["url"], headers={"Range": "bytes=2-5"})
    body = client.get(entry["url"]).data
    assert part.status_code == 206 and part.headers["Content-Range"] == f"bytes 2-5/{len(body)}"
    assert part.data == body[2:6]
    assert hashlib.sha256(body).hexdigest() == entry["hashes"]["sha256"]
    assert hits[f"/whl/{entry['filename']}"] == 1
    head = client.head(entry["url"])
    assert head.status_code == 200 and int(head.headers["Content-Length"]) == len(body)
