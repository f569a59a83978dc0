"""Who may publish which project (issue 26): owners, release identity and sticky ownership,
through the real server (gunicorn, real Redis for tokens, local storage), with the real
clients: twine publishes, uv and pip say what an installer then gets.

The upstream is a local PEP 691 index whose projects a test can add to while the server
runs, as an outsider registering a name on PyPI would."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from redis import Redis

from tests.helpers import (
    IndexURL,
    clean_env,
    make_wheel,
    run_console,
    serve_http,
    simple_index,
    start_index,
)
from wheelhouse.config import Config
from wheelhouse.index.layout import owner_key
from wheelhouse.index.manage import audit_entries
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import create_token
from wheelhouse.variants import parse_variant

VARIANT = "torch2.14-cu130"
OTHER = "torch2.14-cu128"
LABEL = parse_variant(VARIANT).local_label

pytestmark = pytest.mark.skipif(shutil.which("uv") is None or shutil.which("twine") is None,
                                reason="uv and twine are needed")


@dataclass
class Upstream:
    url: str
    wheels: dict[str, list[Path]]
    """Project -> its wheels: add to it to 'register' a project upstream."""


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    tmp = tmp_path_factory.mktemp("public")
    wheels = {"iniconfig": [make_wheel(tmp, "iniconfig", "2.0")]}
    with serve_http(simple_index(wheels)) as url:
        yield Upstream(url + "/simple/", wheels)


@dataclass(frozen=True)
class Server:
    url: IndexURL
    config: Config
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def server(redis_server: str, upstream: Upstream,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("owners")
    redis_url = f"{redis_server}/0"
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    tokens = {
        "alice": create_token(conn, "alice", ["upload"]),
        "mallory": create_token(conn, "mallory", ["upload"]),
        "narrow": create_token(conn, "narrow", ["upload"], projects=["only-this"]),
        "ops": create_token(conn, "ops", ["upload", "admin"]),
    }
    config = Config(storage=str(tmp / "data"), redis_url=redis_url, catalog_refresh_seconds=0.0,
                    upstream=upstream.url, upstream_rules="", upload_max_mib=1)
    with start_index(config, tmp) as url:
        yield Server(url, config, tokens)
    conn.flushdb()
    conn.close()


def _twine(server: Server, wheel: Path, who: str,
           root: str = VARIANT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["twine", "upload", "--non-interactive", "--disable-progress-bar", "--repository-url",
         f"{server.url}/{root}/", "-u", "__token__", "-p", server.tokens[who], str(wheel)],
        capture_output=True, text=True, env=clean_env(), timeout=120)


def _files(server: Server, project: str, root: str = VARIANT) -> dict[str, str]:
    """Filename -> sha256 of what the root lists for ``project``."""
    resp = requests.get(f"{server.url}/{root}/simple/{project}/",
                        headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=30)
    if resp.status_code == 404:
        return {}
    resp.raise_for_status()
    return {f["filename"]: f["hashes"]["sha256"] for f in resp.json()["files"]}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _uv_pick(server: Server, requirement: str, root: str = VARIANT) -> str:
    """What uv resolves ``requirement`` to from the root (its version, or uv's error)."""
    done = subprocess.run(["uv", "pip", "compile", "-", "--index-url",
                           f"{server.url}/{root}/simple", "--no-header", "--no-annotate",
                           "--python-version", "3.11"],
                          input=requirement + "\n", env=clean_env(UV_NO_CACHE="1"),
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return "error: " + done.stderr
    return done.stdout.strip().split("==", 1)[1]


def _pip_download(server: Server, requirement: str, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--no-cache-dir", "--dest", str(dest), "--index-url",
                    f"{server.url}/{VARIANT}/simple", requirement],
                   env=clean_env(), capture_output=True, text=True, check=True, timeout=120)
    (got,) = dest.glob("*.whl")
    return got


def test_only_owners_publish_a_project_until_an_admin_grants(server: Server,
                                                             tmp_path: Path) -> None:
    first = make_wheel(tmp_path / "a", "trav-a", f"1.0+{LABEL}")
    assert _twine(server, first, "alice").returncode == 0
    # Another token adds a newer version: refused, and uv still resolves the owner's.
    intruder = make_wheel(tmp_path / "b", "trav-a", f"2.0+{LABEL}")
    refused = _twine(server, intruder, "mallory")
    assert refused.returncode != 0 and "403" in refused.stdout + refused.stderr
    assert _files(server, "trav-a") == {first.name: _sha(first)}
    assert _uv_pick(server, "trav-a") == f"1.0+{LABEL}"
    # In another root too: ownership is the project's, not a root's.
    elsewhere = make_wheel(tmp_path / "c", "trav-a", f"2.0+{parse_variant(OTHER).local_label}")
    assert _twine(server, elsewhere, "mallory", root=OTHER).returncode != 0
    assert _files(server, "trav-a", OTHER) == {}
    # An admin grants mallory; then her upload is published; the change is audited.
    granted = run_console("projects", "grant", "trav-a", "mallory", config=server.config)
    assert granted.returncode == 0, granted.stderr
    assert _twine(server, intruder, "mallory").returncode == 0
    assert _uv_pick(server, "trav-a") == f"2.0+{LABEL}"
    entries = [e for e in audit_entries(open_storage(server.config)) if e["action"] == "grant"]
    assert entries and entries[-1]["records"] == [owner_key("trav-a")]
    listing = run_console("projects", "list", config=server.config)
    assert "trav-a\talice, mallory\tprivate" in listing.stdout


def test_recipe_projects_are_the_builds_and_tokens_keep_to_their_projects(
        server: Server, tmp_path: Path) -> None:
    # A pure-Python flash-attn into the recipe project: refused, so uv finds no flash-attn.
    fake = make_wheel(tmp_path / "fa", "flash-attn", f"99.0+{LABEL}")
    refused = _twine(server, fake, "alice")
    assert refused.returncode != 0 and "403" in refused.stdout + refused.stderr
    assert _files(server, "flash-attn") == {}
    assert _uv_pick(server, "flash-attn").startswith("error:")
    # A token limited to one project publishes that one and nothing else.
    other = make_wheel(tmp_path / "x", "not-this", f"1.0+{LABEL}")
    assert _twine(server, other, "narrow").returncode != 0
    assert _files(server, "not-this") == {}
    mine = make_wheel(tmp_path / "y", "only-this", f"1.0+{LABEL}")
    assert _twine(server, mine, "narrow").returncode == 0
    assert _files(server, "only-this") == {mine.name: _sha(mine)}


def _build_tagged(wheel: Path, build: str) -> Path:
    """The wheel under its name with a build tag (which installers prefer)."""
    name, version, tags = wheel.name.split("-", 2)
    return wheel.rename(wheel.with_name(f"{name}-{version}-{build}-{tags}"))


def test_other_bytes_under_another_spelling_of_a_release_are_refused(
        server: Server, tmp_path: Path) -> None:
    victim = make_wheel(tmp_path / "v", "alias-victim", f"1.0+{LABEL}")
    assert _twine(server, victim, "alice").returncode == 0
    aliases = [
        make_wheel(tmp_path / "z", "alias-victim", f"1.0.0+{LABEL}", module_body="X = 1\n"),
        _build_tagged(make_wheel(tmp_path / "t", "alias-victim", f"1.0+{LABEL}",
                                 module_body="X = 2\n"), "9"),
    ]
    for alias in aliases:
        # Not even the owner: installers could not tell them from the published file.
        done = _twine(server, alias, "alice")
        assert done.returncode != 0 and "409" in done.stdout + done.stderr, alias.name
        # Another token is refused for not owning it, before identity is even looked at.
        assert _twine(server, alias, "mallory").returncode != 0
    assert _files(server, "alias-victim") == {victim.name: _sha(victim)}
    got = _pip_download(server, "alias-victim==1.0", tmp_path / "pip")
    assert _sha(got) == _sha(victim)
    # Once the owner yanks it, a build-tagged replacement may be published (and is what the
    # page lists for that version and those tags).
    yanked = run_console("yank", "alias-victim==1.0", config=server.config)
    assert yanked.returncode == 0, yanked.stderr
    assert _twine(server, aliases[1], "alice").returncode == 0
    assert _files(server, "alias-victim") == {aliases[1].name: _sha(aliases[1])}


def test_an_owned_name_never_flips_to_the_upstream(server: Server, upstream: Upstream,
                                                   tmp_path: Path) -> None:
    ours = make_wheel(tmp_path / "p", "sticky-priv", f"1.0+{LABEL}")
    assert _twine(server, ours, "alice").returncode == 0
    kept = requests.get(f"{server.url}/{OTHER}/simple/sticky-priv/", allow_redirects=False,
                        timeout=30)
    assert kept.status_code == 404
    # An outsider registers the name upstream with a tempting version.
    upstream.wheels["sticky-priv"] = [make_wheel(tmp_path / "out", "sticky-priv", "99.0")]
    newer = make_wheel(tmp_path / "q", "sticky-priv", f"1.1+{LABEL}")
    assert _twine(server, newer, "alice").returncode == 0
    for root in (OTHER, VARIANT):
        page = requests.get(f"{server.url}/{root}/simple/sticky-priv/", allow_redirects=False,
                            timeout=30)
        assert page.status_code in (200, 404), (root, page.status_code)
    assert _uv_pick(server, "sticky-priv", OTHER).startswith("error:")
    assert _uv_pick(server, "sticky-priv") == f"1.1+{LABEL}"
    # Still private with no file left anywhere.
    for wheel in (ours, newer):
        gone = run_console("delete", wheel.name, "--variant", VARIANT, "--yes",
                           config=server.config)
        assert gone.returncode == 0, gone.stderr
    empty = requests.get(f"{server.url}/{VARIANT}/simple/sticky-priv/", allow_redirects=False,
                         timeout=30)
    assert empty.status_code == 404
    # Until an admin releases it: then the upstream's project is the upstream's.
    released = run_console("projects", "release", "sticky-priv", "--variant", VARIANT,
                           config=server.config)
    assert released.returncode == 0, released.stderr
    assert "its upstream lists it" in released.stdout
    assert _uv_pick(server, "sticky-priv", OTHER) == "99.0"


def test_a_public_project_in_one_root_is_the_upstreams_elsewhere(server: Server,
                                                                  tmp_path: Path) -> None:
    public = make_wheel(tmp_path / "i", "iniconfig", f"2.0+{LABEL}")
    assert _twine(server, public, "alice").returncode == 0
    for path in (f"/{OTHER}/simple/iniconfig/", "/simple/iniconfig/"):
        away = requests.get(server.url + path, allow_redirects=False, timeout=30)
        assert away.status_code == 302, path
        assert away.headers["Location"].endswith("/simple/iniconfig/")


def test_after_an_uploads_200_every_server_process_lists_it(redis_server: str, upstream: Upstream,
                                                            tmp_path: Path) -> None:
    """Read your writes: with catalogs that would not refresh on their own for a minute, the
    redirect upstream that each gunicorn worker cached gives way to the file at once."""
    redis_url = f"{redis_server}/1"
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    tok = create_token(conn, "ryw", ["upload"])
    config = Config(storage=str(tmp_path / "data"), redis_url=redis_url,
                    catalog_refresh_seconds=60.0, upstream=upstream.url, upstream_rules="")
    try:
        with start_index(config, tmp_path, workers=2) as url:
            page = f"{url}/{VARIANT}/simple/iniconfig/"
            # Many requests, so that both workers cache the redirect.
            with requests.Session() as s:
                for _ in range(20):
                    assert s.get(page, allow_redirects=False, timeout=30).status_code == 302
            wheel = make_wheel(tmp_path / "w", "iniconfig", f"2.0+{LABEL}")
            server = Server(url, config, {"ryw": tok})
            assert _twine(server, wheel, "ryw").returncode == 0
            answers = [requests.get(page, allow_redirects=False, timeout=30).status_code
                       for _ in range(20)]
            assert answers == [200] * 20
    finally:
        conn.flushdb()
        conn.close()
