"""The front page and what index-only mode says about builds, rendered from real storage."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis
from setuptools import find_packages

from tests.helpers import make_wheel
from tests.web.buildhelpers import make_app
from web import create_app
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant


def _index_only(tmp_path: Path) -> tuple[Config, FlaskClient]:
    config = Config(storage=str(tmp_path / "data"), catalog_refresh_seconds=0.0,
                    upstream="off")
    app = create_app(config)
    app.testing = True
    return config, app.test_client()


def test_an_empty_index_still_shows_the_install_command(tmp_path: Path) -> None:
    _, client = _index_only(tmp_path)
    page = html.unescape(client.get("/").text)
    assert ("uv pip install --index-url http://localhost/torch2.8-cu128/simple PROJECT"
            in page)
    assert "Nothing is published yet" in page
    assert "wheelhouse publish FILE.whl --variant torch2.8-cu128 --relabel" in page
    # Index-only: building is explained, not offered through a sign-in that can't succeed.
    assert "wheelhouse build PROJECT==VERSION" in page
    assert ">Sign in<" not in page
    # How to keep an installed torch, beside (never inside) the command a user copies.
    keep = page.split('id="keep-torch"', 1)[1].split("</p>", 1)[0]
    assert "Requires-Dist: torch==X.Y.*" in keep
    assert '"torch==$(python -c \'import torch; print(torch.__version__)\')"' in keep


def test_every_listed_wheel_has_the_command_of_the_root_that_lists_it(tmp_path: Path) -> None:
    config, client = _index_only(tmp_path)
    storage = open_storage(config)
    base, sm80 = parse_variant("torch2.14-cu130"), parse_variant("torch2.14-cu130-sm80")
    publish(storage, make_wheel(tmp_path / "w", "fat-ext", f"1.0+{base.local_label}"), base,
            archs=("80", "90"))
    publish(storage, make_wheel(tmp_path / "w", "narrow-ext", f"1.0+{sm80.local_label}"), sm80)
    page = html.unescape(client.get("/").text)
    assert ("uv pip install --index-url http://localhost/torch2.14-cu130/simple fat-ext"
            in page)
    assert ("uv pip install --index-url http://localhost/torch2.14-cu130-sm80/simple "
            "narrow-ext") in page
    # The base root does not list the narrow build, and the page says so.
    assert "http://localhost/torch2.14-cu130/simple narrow-ext" not in page
    narrowed = page[page.index('id="narrowed"'):page.index('id="variants"')]
    assert "narrow-ext" in narrowed and "torch2.14-cu130-sm80" in narrowed
    assert "only here: built for sm80 alone, not listed by torch2.14-cu130" in page
    # Commands are plain selectable text: a copy button is added by script, never required.
    # the one command, the example, fat-ext twice, narrow-ext
    assert page.count('class="install copyable"') == 5


def test_the_page_leads_with_one_command_and_the_matrix_shows_labels(tmp_path: Path) -> None:
    config, client = _index_only(tmp_path)
    empty = html.unescape(client.get("/").text)
    assert ('uv pip install --preview-features wheel-variants --index-url '
            'http://localhost/simple PROJECT "torch==2.8.*"') in empty
    sm90 = parse_variant("torch2.14-cu130-sm90")
    facts = BuildFacts(device_code={"gpu_ext/_C.so": {"sass": ["90"], "ptx": []}})
    publish(open_storage(config), make_wheel(tmp_path / "w", "gpu-ext", f"1.0+{sm90.local_label}"),
            sm90, build=facts)
    page = html.unescape(client.get("/").text)
    one = ('uv pip install --preview-features wheel-variants --index-url '
           'http://localhost/simple gpu-ext "torch==2.14.*"')
    assert page.index(one) < page.index('id="variants"')  # first, before the roots
    matrix = client.get("/matrix").text
    assert 'data-label="cu130sm90"' in matrix


def test_index_only_request_and_sign_in_explain_what_builds_need(tmp_path: Path) -> None:
    _, client = _index_only(tmp_path)
    for path in ("/request", "/login"):
        resp = client.get(path)
        assert resp.status_code == 503
        text = " ".join(html.unescape(resp.text).split())
        assert "Builds need a build queue (Redis) and a build worker" in text
        assert "wheelhouse serve --with-worker" in text
        assert 'href="/readme#:~:text=Running%20it%20for%20real"' in text
    readme = client.get("/readme")
    assert readme.status_code == 200 and readme.mimetype == "text/plain"
    assert "\n## Running it for real" in readme.text


def test_with_a_build_queue_sign_in_is_offered(redis_url: str, tmp_path: Path,
                                               conn: Redis) -> None:
    client = make_app(redis_url, tmp_path).test_client()
    assert ">Sign in<" in client.get("/").text
    assert client.get("/login").status_code == 200


ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_are_served_as_the_readme_links_them(tmp_path: Path) -> None:
    _, client = _index_only(tmp_path)
    listed = client.get("/docs/").text.split()
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == listed
    readme = client.get("/readme").text
    for name in listed:
        page = client.get(f"/docs/{name}")
        assert page.status_code == 200 and page.mimetype == "text/plain"
        assert page.text == (ROOT / "docs" / name).read_text()
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", readme))
    assert linked and linked <= set(listed)
    for missing in ("nope.md", "..%2FREADME.md", "%2E%2E", "security"):
        assert client.get(f"/docs/{missing}").status_code == 404


def test_every_package_is_in_the_wheel() -> None:
    """pyproject lists the packages (docs/ travels as ``web.docs``): none may be left out."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = find_packages(str(ROOT), include=["wheelhouse*", "web*", "worker*"])
    assert set(found) <= set(listed), "add the new package to [tool.setuptools] packages"


@pytest.mark.slow
def test_an_installed_wheel_serves_its_readme_and_docs(tmp_path: Path) -> None:
    """Installed from a wheel (built from the sdist, as an index would), not from a clone: the
    README comes from the distribution's metadata, the docs from package data."""
    uv = shutil.which("uv")
    git = shutil.which("git")
    if uv is None or git is None or not (ROOT / ".git").exists():
        pytest.skip("needs uv, git and a git checkout")
    source = tmp_path / "source"  # a copy of the working tree: the build leaves nothing here
    files = subprocess.run([git, "ls-files", "-c", "-o", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([uv, "build", "-q", "-o", str(tmp_path / "dist"), str(source)], check=True)
    site = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))) as wheel:
        wheel.extractall(site)
    code = (
        "import sys, web\n"
        "from wheelhouse.config import Config\n"
        "assert web.__file__.startswith(sys.argv[1]), web.__file__\n"
        "client = web.create_app(Config(storage=sys.argv[2], upstream='off')).test_client()\n"
        "print(client.get('/readme').text.splitlines()[0])\n"
        "print(client.get('/docs/').text.split())\n"
        "print(client.get('/docs/security.md').text.splitlines()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(site), str(tmp_path / "data")],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first, listed, security = out.stdout.splitlines()
    assert first == "# wheelhouse"
    assert listed == str(sorted(p.name for p in (ROOT / "docs").glob("*.md")))
    assert security == "# Security"
