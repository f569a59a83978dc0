"""The upstream client over real HTTP: PEP 691 JSON and PEP 503 HTML pages, read alike."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import ClassVar

import pytest
from packaging.version import Version

from tests.helpers import QuietHandler, free_port, serve_http
from wheelhouse.errors import UpstreamUnavailable
from wheelhouse.index.upstream import ACCEPT, fetch_project

SHA_A = "a" * 64
SHA_B = "b" * 64

HTML_PAGE = f"""<!DOCTYPE html>
<html><head><meta name="pypi:repository-version" content="1.0"><title>Links</title></head>
<body><h1>Links for demo-ext</h1>
<a href="../../files/demo_ext-1.0.tar.gz#sha256={SHA_A}"
   data-requires-python="&gt;=3.9">demo_ext-1.0.tar.gz</a><br/>
<a href="/files/demo_ext-1.10-cp311-cp311-linux_x86_64.whl?x=1&amp;y=2#sha256={SHA_B}"
   data-dist-info-metadata="sha256={SHA_B}" data-yanked="broken">
   demo_ext-1.10-cp311-cp311-linux_x86_64.whl</a><br/>
<a href="https://elsewhere.example/demo_ext-0.9.zip">demo_ext-0.9.zip</a>
<a href="../../files/demo_ext-1.2.dev1.tar.gz#md5=0123"></a>
</body></html>
"""


class _Index(QuietHandler):
    accepts: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.accepts.append(self.headers.get("Accept", ""))
        kind, _, rest = self.path.strip("/").partition("/")
        if rest != "demo-ext":
            self.send_error(404)
        elif kind == "json":
            self.send_body(json.dumps({
                "meta": {"api-version": "1.1"}, "name": "demo-ext",
                "versions": ["1.0", "1.10", "not a version", "0.9"],
                "files": [
                    {"filename": "demo_ext-1.0.tar.gz", "url": "../../files/demo_ext-1.0.tar.gz",
                     "hashes": {"sha256": SHA_A}, "requires-python": ">=3.9"},
                    {"filename": "demo_ext-1.10-py3-none-any.whl",
                     "url": "https://files.example/demo_ext-1.10-py3-none-any.whl",
                     "hashes": {}, "yanked": "broken"},
                ]}).encode(), "application/vnd.pypi.simple.v1+json")
        elif kind == "json-no-versions":  # api-version 1.0: versions come from the file names
            self.send_body(json.dumps({
                "meta": {"api-version": "1.0"}, "name": "demo-ext",
                "files": [{"filename": n, "url": n, "hashes": {}} for n in (
                    "demo_ext-2.0.tar.gz", "demo_ext-1.9-cp311-cp311-linux_x86_64.whl",
                    "demo_ext-2.0.zip", "README.txt")]}).encode(),
                "application/vnd.pypi.simple.v1+json")
        elif kind == "html":
            self.send_body(HTML_PAGE.encode(), "text/html; charset=utf-8")
        elif kind == "moved":
            self.send_response(301)
            self.send_header("Location", "/html/demo-ext/")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif kind == "garbled":
            self.send_body(b"{not json", "application/vnd.pypi.simple.v1+json")
        else:
            self.send_error(503)


@pytest.fixture
def index() -> Iterator[str]:
    _Index.accepts.clear()
    with serve_http(_Index) as url:
        yield url


def test_json_page_with_pep700_versions(index: str) -> None:
    page = fetch_project(f"{index}/json/", "Demo_Ext")
    assert _Index.accepts == [ACCEPT]  # what uv sends: JSON first, HTML accepted
    assert page.url == f"{index}/json/demo-ext/"
    sdist, wheel = page.files
    assert (sdist.filename, sdist.url, sdist.sha256) == (
        "demo_ext-1.0.tar.gz", f"{index}/files/demo_ext-1.0.tar.gz", SHA_A)
    assert sdist.requires_python == ">=3.9" and not sdist.yanked
    assert wheel.sha256 is None and wheel.yanked and not wheel.is_sdist
    assert [f.filename for f in page.sdists] == ["demo_ext-1.0.tar.gz"]
    # PEP 700's list wins over the file names, newest first, invalid entries skipped.
    assert page.versions == (Version("1.10"), Version("1.0"), Version("0.9"))


def test_json_page_without_versions_derives_them_from_file_names(index: str) -> None:
    page = fetch_project(f"{index}/json-no-versions", "demo-ext")
    assert page.versions == (Version("2.0"), Version("1.9"))
    assert [f.filename for f in page.sdists] == ["demo_ext-2.0.tar.gz", "demo_ext-2.0.zip"]


def test_html_page(index: str) -> None:
    page = fetch_project(f"{index}/html", "demo-ext")
    by_name = {f.filename: f for f in page.files}
    assert list(by_name) == ["demo_ext-1.0.tar.gz", "demo_ext-1.10-cp311-cp311-linux_x86_64.whl",
                             "demo_ext-0.9.zip", "demo_ext-1.2.dev1.tar.gz"]
    sdist = by_name["demo_ext-1.0.tar.gz"]
    assert sdist.url == f"{index}/files/demo_ext-1.0.tar.gz"  # relative to the page
    assert sdist.sha256 == SHA_A and sdist.requires_python == ">=3.9"  # entities decoded
    wheel = by_name["demo_ext-1.10-cp311-cp311-linux_x86_64.whl"]
    assert wheel.url == f"{index}/files/demo_ext-1.10-cp311-cp311-linux_x86_64.whl?x=1&y=2"
    assert wheel.sha256 == SHA_B and wheel.yanked
    assert by_name["demo_ext-0.9.zip"].url == "https://elsewhere.example/demo_ext-0.9.zip"
    assert by_name["demo_ext-0.9.zip"].sha256 is None
    # No anchor text: the name is the URL's last segment; an md5 fragment is no sha256.
    assert by_name["demo_ext-1.2.dev1.tar.gz"].sha256 is None
    assert page.versions == (Version("1.10"), Version("1.2.dev1"), Version("1.0"),
                             Version("0.9"))


def test_redirects_are_followed_and_links_resolved_against_the_final_page(index: str) -> None:
    page = fetch_project(f"{index}/moved", "demo-ext")
    assert page.files[0].url == f"{index}/files/demo_ext-1.0.tar.gz"


def test_an_unknown_project_is_an_empty_page(index: str) -> None:
    page = fetch_project(f"{index}/json", "nothing-here")
    assert page.files == () and page.versions == ()


@pytest.mark.parametrize("kind", ["down", "garbled"])
def test_errors_say_upstream_is_unavailable(index: str, kind: str) -> None:
    with pytest.raises(UpstreamUnavailable, match=re.escape(f"{index}/{kind}/demo-ext/")):
        fetch_project(f"{index}/{kind}", "demo-ext")


def test_unreachable_and_unsupported_indexes() -> None:
    with pytest.raises(UpstreamUnavailable):
        fetch_project(f"http://127.0.0.1:{free_port()}/simple", "demo-ext", timeout=5)
    with pytest.raises(UpstreamUnavailable, match="not an http"):
        fetch_project("ftp://example.invalid/simple", "demo-ext")
