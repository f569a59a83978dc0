"""Index pages: formats, negotiation, caching headers, redirects, routing and bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from pypi_simple import ACCEPT_JSON_PREFERRED, ProjectPage

from tests.helpers import make_wheel
from tests.web.conftest import VARIANT
from web import create_app
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
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
        # The PEP 691 HTML types get that concrete type back; anything at all gets HTML.
        ("application/vnd.pypi.simple.v1+html", "application/vnd.pypi.simple.v1+html"),
        ("application/vnd.pypi.simple.latest+html", "application/vnd.pypi.simple.v1+html"),
        ("application/vnd.pypi.simple.latest+json", "application/vnd.pypi.simple.v1+json"),
        ("*/*", "text/html"),
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
    # sm100 is in neither build: nothing to list, and a hosted project is never routed
    # upstream; the 404 says which roots have it.
    resp = client.get(f"/{VARIANT}-sm100/simple/demo-ext/")
    assert resp.status_code == 404
    assert "It is built here for torch2.8-cu128, torch2.8-cu128-sm90" in resp.text


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


# -- hosted projects never fall through to the upstream --


def _narrow_only(app_config: Config, tmp_path: Path) -> Record:
    """cudaext built for sm80 alone: its base root lists nothing."""
    variant = parse_variant("torch2.14-cu130-sm80")
    wheel = make_wheel(tmp_path / "n", "cudaext", f"0.1.0+{variant.local_label}",
                       tag="cp311-cp311-linux_x86_64")
    return publish(open_storage(app_config), wheel, variant)


@pytest.mark.parametrize("accept", [UV_ACCEPT, "text/html"])
def test_a_base_root_never_sends_a_hosted_project_upstream(
        client: FlaskClient, app_config: Config, tmp_path: Path, accept: str) -> None:
    _narrow_only(app_config, tmp_path)
    for _ in range(2):  # the second answer may come from a cache: it must be the same
        resp = client.get("/torch2.14-cu130/simple/cudaext/", headers={"Accept": accept})
        assert resp.status_code == 404
        assert "Location" not in resp.headers
        text = resp.get_json()["error"] if resp.is_json else resp.text
        assert "cudaext has no wheel in torch2.14-cu130." in text
        assert "It is built here for torch2.14-cu130-sm80" in text
        assert ("uv pip install --index-url http://localhost/torch2.14-cu130-sm80/simple "
                "cudaext") in text
        assert "does not send cudaext to the public upstream" in text
        # Index-only here: how an operator builds it.
        assert "wheelhouse build cudaext==VERSION --torch 2.14 --cuda 13.0 --python 3.X" in text
    # Other torch/CUDA variants say where it is too.
    other = client.get("/torch2.8-cu128/simple/cudaext/", headers={"Accept": UV_ACCEPT})
    assert other.status_code == 404
    assert "Other variants with cudaext: torch2.14-cu130-sm80." in other.get_json()["error"]
    # The narrow root itself lists it; a project we don't host is still routed upstream.
    assert client.get("/torch2.14-cu130-sm80/simple/cudaext/").status_code == 200
    assert client.get("/torch2.14-cu130/simple/einops/").status_code == 302


def test_a_recipe_project_without_a_wheel_is_a_404_with_a_request_link(
        redis_url: str, tmp_path: Path) -> None:
    from tests.web.buildhelpers import make_app

    client = make_app(redis_url, tmp_path, upstream="https://up.example/simple/").test_client()
    resp = client.get("/torch2.8-cu128-sm90/simple/flash-attn/", headers={"Accept": UV_ACCEPT})
    assert resp.status_code == 404
    text = resp.get_json()["error"]
    assert "flash-attn has a recipe here but no wheel has been built yet." in text
    assert ("Request a build: http://localhost/request?project=flash-attn&torch=2.8&cuda=12.8"
            "&archs=90") in text
    assert ("wheelhouse request flash-attn==VERSION --torch 2.8 --cuda 12.8 --arch sm90 "
            "--python 3.X --server http://localhost") in text


def test_a_project_whose_records_vanish_stays_hosted(
        app_config: Config, tmp_path: Path) -> None:
    """An emptied bucket must not turn the index into a redirect to the public upstream."""
    from wheelhouse.index.layout import RECORDS

    app = create_app(app_config)
    client = app.test_client()
    _narrow_only(app_config, tmp_path)
    assert client.get("/torch2.14-cu130-sm80/simple/cudaext/").status_code == 200
    storage = open_storage(app_config)
    for obj in list(storage.list(RECORDS)):
        storage.delete(obj.key)
    storage.put_bytes("generation", b"emptied")
    resp = client.get("/torch2.14-cu130-sm80/simple/cudaext/", headers={"Accept": UV_ACCEPT})
    assert resp.status_code == 404, resp.headers.get("Location")
    assert "cudaext was published here, but storage lists no wheel of it now." in (
        resp.get_json()["error"])


def test_plain_root_answers_without_variant_wheels(client: FlaskClient,
                                                   published: list[Record]) -> None:
    """``/simple/`` lists only variant wheels (made from wheels with GPU code; these have
    none): a hosted project is a 404 that names its roots, never upstream; others go there."""
    assert client.get("/simple").status_code == 301
    assert client.get("/simple/Demo_Ext/").headers["Location"].endswith("/simple/demo-ext/")
    root = client.get("/simple/", headers={"Accept": UV_ACCEPT})
    assert root.status_code == 200 and root.json == {"meta": {"api-version": "1.1"},
                                                     "projects": []}
    missing = client.get("/simple/demo-ext/")
    assert missing.status_code == 404
    assert "torch2.8-cu128" in missing.text and "has no variant wheel" in missing.text
    away = client.get("/simple/requests/")
    assert away.status_code == 302
    assert away.headers["Location"] == "https://up.example/simple/requests/"
    assert client.get("/files/variants/demo-ext/demo_ext-1.0-variants.json").status_code == 404
    # The variant roots are as they were.
    assert client.get(f"/{VARIANT}/simple/demo-ext/").status_code == 200


def test_variants_document_is_rebuilt_when_a_version_gains_a_variant(
        client: FlaskClient, app_config: Config, tmp_path: Path) -> None:
    storage = open_storage(app_config)

    def publish_for(key: str, arch: str) -> None:
        variant = parse_variant(key)
        wheel = make_wheel(tmp_path / key, "gpu-ext", f"1.0+{variant.local_label}")
        publish(storage, wheel, variant, build=BuildFacts(
            device_code={"gpu_ext/_C.so": {"sass": [arch], "ptx": []}}))

    def listed() -> tuple[str, bytes]:
        page = client.get("/simple/gpu-ext/", headers={"Accept": UV_ACCEPT}).json
        [doc] = [f for f in page["files"] if f["filename"].endswith("-variants.json")]
        assert doc["filename"] == "gpu_ext-1.0+pt28-variants.json"
        body = client.get(doc["url"]).data
        assert hashlib.sha256(body).hexdigest() == doc["hashes"]["sha256"]
        return doc["hashes"]["sha256"], body

    publish_for("torch2.8-cu128-sm80", "80")
    first, body = listed()
    assert list(json.loads(body)["variants"]) == ["cu128sm80"]
    publish_for("torch2.8-cu128-sm90", "90")
    second, body = listed()
    assert second != first
    assert list(json.loads(body)["variants"]) == ["cu128sm80", "cu128sm90"]
    html = client.get("/simple/gpu-ext/", headers={"Accept": "text/html"}).text
    assert f"-variants.json#sha256={second}\">gpu_ext-1.0+pt28-variants.json</a>" in html


def test_pinned_private_projects_are_never_sent_upstream(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), upstream="https://up.example/simple/",
                    upstream_rules="", private_projects="acme-*, secret")
    client = create_app(config).test_client()
    for name in ("acme-kernels", "secret"):
        resp = client.get(f"/{VARIANT}/simple/{name}/")
        assert resp.status_code == 404 and "WHEELHOUSE_PRIVATE_PROJECTS" in resp.text
    public = client.get(f"/{VARIANT}/simple/acme/")
    assert public.status_code == 302
    assert public.headers["Location"] == "https://up.example/simple/acme/"
