"""Uploading with the real clients (twine, uv publish) and yanking as pip and uv see it, all
against one running server (gunicorn, real Redis for tokens, local storage)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import psutil
import pytest
import requests
from redis import Redis

from tests.helpers import (
    IndexURL,
    clean_env,
    make_wheel,
    metadata_bomb,
    run_console,
    serve_http,
    simple_index,
    start_index,
)
from wheelhouse.config import Config
from wheelhouse.index.manage import audit_entries
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import create_token
from wheelhouse.variants import parse_variant

VARIANT = "torch2.14-cu130"
OTHER = "torch2.14-cu128"
LABEL = parse_variant(VARIANT).local_label

pytestmark = pytest.mark.skipif(shutil.which("uv") is None or shutil.which("twine") is None,
                                reason="uv and twine are needed")


@dataclass(frozen=True)
class Server:
    url: IndexURL
    config: Config
    tokens: dict[str, str]
    """Token by role: upload, admin, build (no upload scope), other (upload to OTHER only)."""


def _upstream_handler(wheels: list[Path]) -> type[BaseHTTPRequestHandler]:
    by_project: dict[str, list[Path]] = {}
    for w in wheels:
        by_project.setdefault(w.name.split("-")[0].replace("_", "-"), []).append(w)
    return simple_index(by_project)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fake upstream with pytest (9.0 needs iniconfig; 1.0 needs nothing) and iniconfig."""
    tmp = tmp_path_factory.mktemp("public")
    wheels = [make_wheel(tmp, "pytest", "9.0", requires=["iniconfig>=2"]),
              make_wheel(tmp, "pytest", "1.0"), make_wheel(tmp, "iniconfig", "2.0")]
    with serve_http(_upstream_handler(wheels)) as url:
        yield url + "/simple/"


@pytest.fixture(scope="module")
def server(redis_server: str, upstream: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("upload")
    redis_url = f"{redis_server}/0"
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    tokens = {
        "upload": create_token(conn, "ci", ["upload"]),
        "admin": create_token(conn, "ops", ["admin"]),
        "build": create_token(conn, "builder", ["build", "read"]),
        "other": create_token(conn, "elsewhere", ["upload"], variants=[OTHER]),
    }
    config = Config(storage=str(tmp / "data"), redis_url=redis_url, catalog_refresh_seconds=0.0,
                    upstream=upstream, upstream_rules="", upload_max_mib=1)
    with start_index(config, tmp) as url:
        yield Server(url, config, tokens)
    conn.flushdb()
    conn.close()


def _twine(server: Server, wheel: Path, token: str, *args: str,
           root: str = VARIANT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["twine", "upload", "--non-interactive", "--disable-progress-bar", "--repository-url",
         f"{server.url}/{root}/", "-u", "__token__", "-p", token, *args, str(wheel)],
        capture_output=True, text=True, env=clean_env(), timeout=120)


def _uv_publish(server: Server, wheel: Path, token: str,
                path: str = "/") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["uv", "publish", "--publish-url", f"{server.url}/{VARIANT}{path}", "-u", "__token__",
         "-p", token, str(wheel)],
        capture_output=True, text=True, env=clean_env(), timeout=120)


def _files(server: Server, project: str, root: str = VARIANT) -> dict[str, object]:
    resp = requests.get(f"{server.url}/{root}/simple/{project}/",
                        headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=30)
    if resp.status_code == 404:
        return {}
    resp.raise_for_status()
    return {f["filename"]: f["yanked"] for f in resp.json()["files"]}


def test_twine_uploads_and_skips_what_is_there(server: Server, tmp_path: Path) -> None:
    # Past the 64 KiB body limit of every other route: uploads have their own.
    wheel = make_wheel(tmp_path / "a", "up-twine", f"1.0+{LABEL}", payload=os.urandom(200_000))
    ok = _twine(server, wheel, server.tokens["upload"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert _files(server, "up-twine") == {wheel.name: False}
    # The same bytes again: a success (a retried CI job).
    again = _twine(server, wheel, server.tokens["upload"])
    assert again.returncode == 0, again.stdout + again.stderr
    # Other bytes under the published name: 409, which --skip-existing takes as "there".
    other = make_wheel(tmp_path / "b", "up-twine", f"1.0+{LABEL}", module_body="X = 2\n")
    refused = _twine(server, other, server.tokens["upload"])
    assert refused.returncode != 0
    assert "409" in refused.stdout + refused.stderr
    assert "immutable" in refused.stdout + refused.stderr
    skipped = _twine(server, other, server.tokens["upload"], "--skip-existing")
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "Skipping" in skipped.stdout + skipped.stderr
    stored = open_storage(server.config)
    record = json.loads(stored.get_bytes(f"records/{VARIANT}/up-twine/{wheel.name}.json"))
    assert record["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.mark.parametrize(("role", "status", "says"), [
    (None, "403", "lacks the 'upload' scope"),  # a token that may only build
    ("wrong", "401", "invalid or revoked token"),
    ("other", "403", f"may not upload to {VARIANT}"),
])
def test_twine_refusals_say_why(server: Server, tmp_path: Path, role: str | None, status: str,
                                says: str) -> None:
    wheel = make_wheel(tmp_path, "up-refused", f"1.0+{LABEL}")
    token = {"wrong": "whk_" + "x" * 43, None: server.tokens["build"]}.get(
        role, server.tokens.get(role or "", ""))
    if role is None:  # what twine shows of it (once: the rest is the same answer)
        out = _twine(server, wheel, token)
        assert out.returncode != 0
        assert status in out.stdout and says in out.stdout
    resp = requests.post(f"{server.url}/{VARIANT}/", auth=("__token__", token),
                         files={"content": (wheel.name, wheel.read_bytes())},
                         data={":action": "file_upload"}, timeout=30)
    assert str(resp.status_code) == status and says in resp.text
    assert _files(server, "up-refused") == {}


def test_uv_publish_uploads_and_refuses_a_wheel_without_the_label(server: Server,
                                                                  tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "up-uv", f"2.0+{LABEL}")
    ok = _uv_publish(server, wheel, server.tokens["upload"], path="/legacy/")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert _files(server, "up-uv") == {wheel.name: False}
    plain = make_wheel(tmp_path / "plain", "up-uv", "2.1")
    refused = _uv_publish(server, plain, server.tokens["upload"])
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert f"build it as version 2.1+{LABEL}" in said and "WHEELHOUSE_UPLOAD_RELABEL" in said
    wrong = _uv_publish(server, wheel, "whk_" + "y" * 43)
    assert wrong.returncode != 0 and "401" in wrong.stdout + wrong.stderr


def _post(server: Server, wheel: Path, **fields: str) -> requests.Response:
    data = {":action": "file_upload", "sha256_digest":
            hashlib.sha256(wheel.read_bytes()).hexdigest(), **fields}
    return requests.post(f"{server.url}/{VARIANT}/", auth=("__token__", server.tokens["upload"]),
                         files={"content": (wheel.name, wheel.read_bytes())}, data=data,
                         timeout=30)


def test_uploads_that_cannot_be_published_as_sent(server: Server, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "up-raw", f"1.0+{LABEL}")
    bad = _post(server, wheel, sha256_digest="0" * 64)
    assert bad.status_code == 400 and "does not match the bytes received" in bad.text
    sdist = tmp_path / "up_raw-1.0.tar.gz"
    sdist.write_bytes(b"not really")
    refused = _post(server, sdist, filetype="sdist")
    assert refused.status_code == 400 and "hosts wheels only" in refused.text
    named = _post(server, wheel, name="something-else")
    assert named.status_code == 400 and "is not the wheel's project" in named.text
    big = make_wheel(tmp_path / "big", "up-raw", f"2.0+{LABEL}", payload=os.urandom(1_300_000))
    too_big = _post(server, big)
    assert too_big.status_code == 413 and "WHEELHOUSE_UPLOAD_MAX_MIB=1" in too_big.text
    assert _files(server, "up-raw") == {}
    # The message is the reason phrase too: what can't be in a status line is replaced.
    odd = requests.post(f"{server.url}/t%C3%B8rch%E2%9C%93%01/", data={":action": "x"},
                        auth=("__token__", server.tokens["upload"]), timeout=30)
    assert odd.status_code == 404 and "tørch✓" in odd.text and "t\xf8rch?" in odd.reason


def _resolve(server: Server, client: str, project: str, tmp_path: Path,
             root: str = VARIANT) -> str:
    """The version of ``project`` that ``client`` picks from the root, unpinned."""
    index = f"{server.url}/{root}/simple"
    # Fresh every time: a client's cache keeps a page for its max-age (page_max_age) by design.
    env = clean_env(UV_NO_CACHE="1")
    if client == "uv":
        done = subprocess.run(["uv", "pip", "compile", "-", "--index-url", index, "--no-header",
                               "--python-version", "3.11", "--no-annotate"],
                              input=project + "\n", env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        pins = dict(line.split("==") for line in done.stdout.split())
        return pins[project]
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                          "--quiet", "--report", "-", "--no-cache-dir", "--index-url", index,
                          project], env=env, capture_output=True, text=True, check=True).stdout
    return str(json.loads(out)["install"][0]["metadata"]["version"])


@pytest.mark.parametrize("client", ["uv", "pip"])
def test_installers_honour_yank_by_cli_and_api_and_unyank(server: Server, tmp_path: Path,
                                                          client: str) -> None:
    project = f"up-yank-{client}"
    for version in ("1.0", "1.1"):
        wheel = make_wheel(tmp_path / version, project, f"{version}+{LABEL}")
        assert _post(server, wheel).status_code == 200
    # By the CLI, on storage, as the operator.
    out = run_console("yank", f"{project}==1.1", "--reason", "broken build", config=server.config)
    assert out.returncode == 0, out.stderr
    assert _resolve(server, client, project, tmp_path) == f"1.0+{LABEL}"
    assert set(_files(server, project).values()) == {False, "broken build"}
    # By the API: an admin token may unyank and yank; an upload token may not.
    api = f"{server.url}/api"
    denied = requests.post(f"{api}/unyank", json={"target": f"{project}==1.1"}, timeout=30,
                           headers={"Authorization": f"Bearer {server.tokens['upload']}"})
    assert denied.status_code == 403
    admin = {"Authorization": f"Bearer {server.tokens['admin']}"}
    undone = requests.post(f"{api}/unyank", json={"target": f"{project}==1.1"}, headers=admin,
                           timeout=30)
    assert undone.status_code == 200, undone.text
    assert _resolve(server, client, project, tmp_path) == f"1.1+{LABEL}"
    assert set(_files(server, project).values()) == {False}
    yanked = requests.post(f"{api}/yank", json={"target": f"{project}==1.1",
                                                "variant": VARIANT, "reason": "api"},
                           headers=admin, timeout=30)
    assert yanked.status_code == 200 and len(yanked.json()["files"]) == 1
    assert set(_files(server, project).values()) == {False, "api"}
    assert _resolve(server, client, project, tmp_path) == f"1.0+{LABEL}"
    whos = [e["by"] for e in audit_entries(open_storage(server.config))
            if any(project in k for k in e["records"])]  # type: ignore[attr-defined]
    assert whos[-2:] == ["token ops", "token ops"] and "(cli)" in whos[0]


def test_delete_asks_first_and_frees_the_name(server: Server, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "a", "up-delete", f"1.0+{LABEL}")
    assert _post(server, wheel).status_code == 200
    env = {**server.config.to_env(), "PATH": os.environ["PATH"]}
    script = str(Path(sys.executable).parent / "wheelhouse")
    kept = subprocess.run([script, "delete", "up-delete==1.0"], input="n\n", env=env,
                          capture_output=True, text=True, timeout=60)
    assert kept.returncode != 0 and wheel.name in kept.stdout
    assert _files(server, "up-delete") == {wheel.name: False}
    gone = subprocess.run([script, "delete", "up-delete==1.0", "--reason", "leaked a secret"],
                          input="y\n", env=env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0, gone.stderr
    assert _files(server, "up-delete") == {}
    assert requests.get(f"{server.url}/files/{VARIANT}/up-delete/{wheel.name}",
                        timeout=30).status_code == 404
    entry = audit_entries(open_storage(server.config))[-1]
    assert entry["action"] == "delete" and entry["reason"] == "leaked a secret"
    # The name is free again: other bytes may be published under it.
    other = make_wheel(tmp_path / "b", "up-delete", f"1.0+{LABEL}", module_body="X = 3\n")
    assert _post(server, other).status_code == 200
    stored = requests.get(f"{server.url}/files/{VARIANT}/up-delete/{other.name}", timeout=30)
    assert stored.content == other.read_bytes()


def test_never_shadows_what_it_owns_nor_hides_what_it_does_not(server: Server,
                                                               tmp_path: Path) -> None:
    """iniconfig (public upstream) uploaded into one root is still found upstream from the
    others, so pytest resolves to its newest version there; a name the upstream does not know
    is never sent upstream from any root."""
    public = make_wheel(tmp_path / "a", "iniconfig", f"2.0+{LABEL}")
    assert _post(server, public).status_code == 200
    assert _resolve(server, "uv", "pytest", tmp_path, root=OTHER) == "9.0"
    away = requests.get(f"{server.url}/{OTHER}/simple/iniconfig/", allow_redirects=False,
                        timeout=30)
    assert away.status_code == 302 and away.headers["Location"].endswith("/simple/iniconfig/")
    private = make_wheel(tmp_path / "b", "up-private", f"1.0+{LABEL}")
    assert _post(server, private).status_code == 200
    kept = requests.get(f"{server.url}/{OTHER}/simple/up-private/", allow_redirects=False,
                        timeout=30)
    assert kept.status_code == 404 and "does not send up-private to the public upstream" \
        in kept.text


# -- hostile uploads: the build's checks, through the real server --


def _rezip(wheel: Path, edit: Callable[[dict[str, bytes]], dict[str, bytes]]) -> Path:
    """``wheel`` rewritten with its members edited, RECORD left as it was."""
    with zipfile.ZipFile(wheel) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in edit(members).items():
            zf.writestr(name, data)
    return wheel


def _dist(project: str) -> str:
    return f"{project.replace('-', '_')}-1.0+{LABEL}"


Hostile = Callable[[Path, str], Path]
HOSTILE: list[tuple[str, Hostile, str]] = [
    ("no-record", lambda t, p: _rezip(make_wheel(t, p, f"1.0+{LABEL}"), lambda ms: {
        n: d for n, d in ms.items() if not n.endswith("/RECORD")}), "RECORD"),
    ("record-mismatch", lambda t, p: _rezip(make_wheel(t, p, f"1.0+{LABEL}"), lambda ms: {
        **ms, f"{p.replace('-', '_')}/__init__.py": b"import os\n"}),
     "does not match its RECORD hash"),
    ("absolute-member", lambda t, p: make_wheel(t, p, f"1.0+{LABEL}", files={
        "/etc/evil.py": b"x"}), "escapes the install tree"),
    ("dotdot-member", lambda t, p: make_wheel(t, p, f"1.0+{LABEL}", files={
        "pkg/../../evil.py": b"x"}), "escapes the install tree"),
    ("other-dist-info", lambda t, p: make_wheel(t, p, f"1.0+{LABEL}", files={
        "other-1.0.dist-info/METADATA": b"Name: other\nVersion: 1.0\n"}),
     "exactly one .dist-info"),
    ("dist-info-via-data", lambda t, p: make_wheel(t, p, f"1.0+{LABEL}", files={
        f"{_dist(p)}.data/purelib/other-9.0.dist-info/METADATA": b"Name: other\n"}),
     "would install the .dist-info of another project"),
    ("unlisted-pth", lambda t, p: _rezip(make_wheel(t, p, f"1.0+{LABEL}"), lambda ms: {
        **ms, "evil.pth": b"import os; os.system('id')\n"}), "'evil.pth' is not in RECORD"),
    ("requires-python", lambda t, p: make_wheel(t, p, f"1.0+{LABEL}",
                                                requires_python=">=3.8,banana"),
     "is no version specifier"),
    # Under the unpacked cap (20 times WHEELHOUSE_UPLOAD_MAX_MIB=1): the METADATA cap refuses it.
    ("metadata-bomb-16MiB", lambda t, p: metadata_bomb(t, p, f"1.0+{LABEL}", 16 << 20),
     "METADATA is larger than 1024 KiB"),
    ("metadata-bomb-400MiB", lambda t, p: metadata_bomb(t, p, f"1.0+{LABEL}", 400 << 20),
     "MiB allowed"),
    ("metadata-bomb-lying", lambda t, p: metadata_bomb(t, p, f"1.0+{LABEL}", 400 << 20,
                                                       declared=100), "Bad CRC-32"),
]


def _peaks(server: Server) -> dict[int, int]:
    """Each gunicorn worker's peak resident memory (VmHWM), in bytes, by pid."""
    out = {}
    for proc in psutil.Process(server.url.proc.pid).children(recursive=True):
        status = Path(f"/proc/{proc.pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
        out[proc.pid] = int(kib) * 1024
    return out


def _stored(server: Server, project: str) -> list[str]:
    dist = project.replace("-", "_")
    return [o.key for o in open_storage(server.config).list("")
            if project in o.key or dist in o.key]


@pytest.mark.parametrize(("kind", "make", "says"), HOSTILE, ids=[i for i, _, _ in HOSTILE])
def test_hostile_wheels_are_refused_and_nothing_is_stored(
        server: Server, tmp_path: Path, kind: str, make: Hostile, says: str) -> None:
    """Uploads get the checks a built wheel gets; the METADATA bombs (~400 KiB, inflating to
    16 or 400 MiB) are refused without any worker inflating them."""
    project = f"up-hostile-{kind}".lower()
    wheel = make(tmp_path, project)
    assert wheel.stat().st_size < 1 << 20
    before = _peaks(server)
    refused = _post(server, wheel)
    after = _peaks(server)
    growth = max(after[pid] - peak for pid, peak in before.items() if pid in after)
    assert growth < 50 << 20, f"a worker's peak memory grew by {growth >> 20} MiB"
    assert refused.status_code == 400, refused.text
    assert says in refused.text and wheel.name in refused.text
    assert _files(server, project) == {}
    assert _stored(server, project) == []


@pytest.mark.parametrize(("filename", "fields", "says"), [
    (f"up_text-1.0+{LABEL}-py3-none-any.whl\x00.txt", {}, "file name"),
    (None, {"description": "fine\n\tREADME\x00"}, "'description' holds a control character"),
    (None, {"summary": "\x1b[31mred"}, "'summary' holds a control character"),
    (None, {"comment\x01": "x"}, "holds a control character in its name"),
])
def test_control_characters_in_fields_or_the_file_name_are_refused(
        server: Server, tmp_path: Path, filename: str | None, fields: dict[str, str],
        says: str) -> None:
    wheel = make_wheel(tmp_path, "up-text", f"1.0+{LABEL}")
    data = {":action": "file_upload",
            "sha256_digest": hashlib.sha256(wheel.read_bytes()).hexdigest(), **fields}
    resp = requests.post(f"{server.url}/{VARIANT}/", auth=("__token__", server.tokens["upload"]),
                         files={"content": (filename or wheel.name, wheel.read_bytes())},
                         data=data, timeout=30)
    assert resp.status_code == 400 and says in resp.text
    assert _files(server, "up-text") == {}
    assert _stored(server, "up-text") == []


def test_a_description_with_line_breaks_and_tabs_is_taken(server: Server,
                                                          tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "up-readme", f"1.0+{LABEL}")
    ok = _post(server, wheel, description="# Title\r\n\n\tcode\n", summary="plain")
    assert ok.status_code == 200, ok.text
    assert _files(server, "up-readme") == {wheel.name: False}
