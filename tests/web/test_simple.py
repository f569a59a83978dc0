"""Index pages: formats, negotiation, caching headers, redirects, routing and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from pypi_simple import ACCEPT_JSON_PREFERRED, ProjectPage

from tests.helpers import make_wheel
from tests.web.conftest import VARIANT
from web import create_app
from wheelhouse.catalog import Record
from wheelhouse.config import Config
from wheelhouse.publish import publish
from wheelhouse.storage import open_storage
from wheelhouse.variants import parse_variant

UV_ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
             "text/html;q=0.01")
PIP_ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.1, "
              "text/html;q=0.01")


@pytest.mark.parametrize(
    ("accept", "mimetype"),
    [
        (UV_ACCEPT, "application/vnd.pypi.simple.v1+json"),
        (PIP_ACCEPT, "application/vnd.pypi.simple.v1+json"),
        ("text/html", "text/html"),
        ("application/vnd.pypi.simple.v1+html", "text/html"),
        ("*/*", "application/vnd.pypi.simple.v1+json"),
        ("", "text/html"),
        ("image/png", "text/html"),
    ],
)
def test_negotiation(client: FlaskClient, published: list[Record], accept: str,
                     mimetype: str) -> None:
    resp = client.get(f"/{VARIANT}/simple/demo-ext/", headers={"Accept": accept})
    assert resp.status_code == 200
    assert resp.mimetype == mimetype
    assert resp.headers["Vary"] == "Accept"


@pytest.mark.parametrize("accept", [ACCEPT_JSON_PREFERRED, "text/html"])
def test_pages_parse_with_pypi_simple(client: FlaskClient, published: list[Record],
                                      accept: str) -> None:
    resp = client.get(f"/{VARIANT}/simple/demo-ext/", headers={"Accept": accept})
    url = "http://idx/" + VARIANT + "/simple/demo-ext/"
    if (resp.mimetype or "").endswith("+json"):
        page = ProjectPage.from_json_data(json.loads(resp.data), base_url=url)
    else:
        page = ProjectPage.from_html("demo-ext", resp.get_data(as_text=True), base_url=url)
    base_files = {r.filename: r for r in published if r.variant.key == VARIANT}
    assert {p.filename for p in page.packages} == set(base_files)
    for pkg in page.packages:
        rec = base_files[pkg.filename]
        assert pkg.digests == {"sha256": rec.sha256}
        assert pkg.requires_python == ">=3.9,<4"
        assert pkg.has_metadata is True
        assert pkg.metadata_digests == {"sha256": rec.metadata_sha256}
        assert pkg.url.startswith("http://idx/files/torch2.8-cu128/demo-ext/")
    assert page.repository_version == "1.1"


def test_json_page_has_pep700_fields(client: FlaskClient, published: list[Record]) -> None:
    data = client.get(f"/{VARIANT}/simple/demo-ext/", headers={"Accept": UV_ACCEPT}).get_json(
        force=True)
    assert data["meta"]["api-version"] == "1.1"
    assert data["versions"] == ["1.0+cu128torch2.8", "1.1+cu128torch2.8"]
    f = data["files"][0]
    assert set(f) >= {"filename", "url", "hashes", "requires-python", "core-metadata",
                      "dist-info-metadata", "yanked", "size", "upload-time"}
    assert f["upload-time"].endswith("Z")
    assert isinstance(f["size"], int) and f["size"] > 0


def test_html_escapes_requires_python(client: FlaskClient, published: list[Record]) -> None:
    body = client.get(f"/{VARIANT}/simple/demo-ext/").get_data(as_text=True)
    assert 'data-requires-python="&gt;=3.9,&lt;4"' in body
    assert 'data-core-metadata="sha256=' in body and 'data-dist-info-metadata="sha256=' in body
    assert "#sha256=" in body


def test_narrowed_root_prefers_the_narrow_build(client: FlaskClient,
                                                published: list[Record]) -> None:
    data = client.get(f"/{VARIANT}-sm90/simple/demo-ext/", headers={"Accept": UV_ACCEPT}).get_json(
        force=True)
    names = [f["filename"] for f in data["files"]]
    assert names == ["demo_ext-1.0+cu128torch2.8-cp311-cp311-linux_x86_64.whl",
                     "demo_ext-1.1+cu128torch2.8.sm90-cp311-cp311-linux_x86_64.whl"]
    # sm100 is in neither build: nothing to list, so the project is routed upstream.
    resp = client.get(f"/{VARIANT}-sm100/simple/demo-ext/")
    assert resp.status_code == 302


def test_etag_and_304(client: FlaskClient, published: list[Record]) -> None:
    first = client.get(f"/{VARIANT}/simple/demo-ext/", headers={"Accept": UV_ACCEPT})
    etag = first.headers["ETag"]
    assert etag.startswith('"') and not etag.startswith("W/")
    assert "max-age=" in first.headers["Cache-Control"]
    again = client.get(f"/{VARIANT}/simple/demo-ext/",
                       headers={"Accept": UV_ACCEPT, "If-None-Match": etag})
    assert again.status_code == 304
    assert again.get_data() == b""
    # The HTML page is a different representation with its own ETag.
    html = client.get(f"/{VARIANT}/simple/demo-ext/", headers={"If-None-Match": etag})
    assert html.status_code == 200


def test_root_lists_projects(client: FlaskClient, published: list[Record]) -> None:
    data = json.loads(client.get(f"/{VARIANT}/simple/", headers={"Accept": UV_ACCEPT}).data)
    assert data["projects"] == [{"name": "demo-ext"}]
    assert "demo-ext" in client.get(f"/{VARIANT}/simple/").get_data(as_text=True)


@pytest.mark.parametrize(
    ("path", "location"),
    [
        (f"/{VARIANT}/simple/Demo_Ext/", f"/{VARIANT}/simple/demo-ext/"),
        (f"/{VARIANT}/simple/demo-ext", f"/{VARIANT}/simple/demo-ext/"),
        (f"/{VARIANT}/simple/Demo.Ext", f"/{VARIANT}/simple/demo-ext/"),
        (f"/{VARIANT}/simple", f"/{VARIANT}/simple/"),
    ],
)
def test_redirects_to_normal_form(client: FlaskClient, published: list[Record], path: str,
                                  location: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 301
    assert resp.headers["Location"].endswith(location)


@pytest.mark.parametrize(
    ("project", "target"),
    [
        ("torch", "https://download.pytorch.org/whl/cu128/torch/"),
        ("nvidia-cublas-cu12", "https://download.pytorch.org/whl/cu128/nvidia-cublas-cu12/"),
        ("einops", "https://up.example/simple/einops/"),
    ],
)
def test_upstream_routing(client: FlaskClient, project: str, target: str) -> None:
    resp = client.get(f"/{VARIANT}/simple/{project}/")
    assert resp.status_code == 302
    assert resp.headers["Location"] == target


def test_routing_off_gives_404(app_config: Config, published: list[Record]) -> None:
    client = create_app(app_config.replace(upstream="off")).test_client()
    resp = client.get(f"/{VARIANT}/simple/einops/")
    assert resp.status_code == 404
    assert b"upstream routing is off" in resp.data


@pytest.mark.parametrize(
    "path",
    [
        "/torch2.8-cu999/simple/",
        "/torch2.8/simple/",
        "/torch2.8-cu128-sm91/simple/x/",
        "/torch2.8-cu128-sm90-sm80/simple/x/",
        "/" + "torch2.8-cu128" + "-sm90" * 40 + "/simple/",
        "/..%2f..%2fetc/simple/passwd/",
        "/%00/simple/x/",
        f"/{VARIANT}/simple/" + "a" * 5000 + "/",
        f"/{VARIANT}/simple/-bad-/",
        f"/{VARIANT}/simple/%E2%98%83/",
        f"/{VARIANT}/simple/..%2f..%2fetc%2fpasswd/",
    ],
)
def test_bad_requests_get_a_plain_4xx(client: FlaskClient, path: str) -> None:
    resp = client.get(path)
    assert 400 <= resp.status_code < 500, (path, resp.status_code)
    assert b"Traceback" not in resp.data
    assert resp.data.strip()


def test_new_publication_shows_up(app_config: Config, client: FlaskClient,
                                  published: list[Record], tmp_path: Path) -> None:
    first = client.get(f"/{VARIANT}/simple/demo-ext/", headers={"Accept": UV_ACCEPT})
    w = make_wheel(tmp_path / "n", "demo-ext", "1.2+cu128torch2.8", tag="cp311-cp311-linux_x86_64")
    publish(open_storage(app_config), w, parse_variant(VARIANT))
    second = client.get(f"/{VARIANT}/simple/demo-ext/",
                        headers={"Accept": UV_ACCEPT, "If-None-Match": first.headers["ETag"]})
    assert second.status_code == 200
    assert "1.2+cu128torch2.8" in second.get_json(force=True)["versions"]
