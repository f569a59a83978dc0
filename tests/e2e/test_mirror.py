"""The pull-through cache end to end: a real index (gunicorn) in front of two real upstreams,
one that looks like PyTorch's index (PEP 503 HTML, absolute links, local-version wheels, a
~20 MB wheel) and one that looks like PyPI (PEP 691 JSON, relative links, PEP 658 metadata);
real uv and pip install through it, with the upstreams up, then stopped."""

from __future__ import annotations

import collections
import hashlib
import html
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from tests.helpers import (
    QuietHandler,
    clean_env,
    make_venv,
    make_wheel,
    start_index,
    wait_until,
)
from wheelhouse.config import Config
from wheelhouse.index import layout
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant
from worker.steps.venv import index_args

ROOT = "torch2.14-cu130"
BIG = 20 * 1024**2

pytestmark = pytest.mark.skipif(shutil.which("uv") is None, reason="uv is needed")


@dataclass
class Upstream:
    """A real HTTP server in a thread, counting the requests for each path; ``stop`` makes
    it unreachable (connection refused)."""

    style: str
    """``torch`` (HTML, absolute links) or ``pypi`` (JSON, relative links)."""
    wheels: dict[str, list[Path]]
    tampered: set[str] = field(default_factory=set)
    """File names served with bytes other than those the page's sha256 is of."""
    yanked: dict[str, str] = field(default_factory=dict)
    slow: set[str] = field(default_factory=set)
    """File names sent in 1 MiB pieces 20 ms apart (first downloads then overlap)."""
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def root(self) -> str:
        return self.url + ("/whl/cu130/" if self.style == "torch" else "/simple/")

    def file(self, name: str) -> Path:
        return next(w for ws in self.wheels.values() for w in ws if w.name == name)


def _metadata(wheel: Path) -> bytes:
    import zipfile
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _handler(up: Upstream) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            up.hits[requests.utils.unquote(path)] += 1
            files = {w.name: w for ws in up.wheels.values() for w in ws}
            name = requests.utils.unquote(path.rsplit("/", 1)[-1])
            if name.endswith(".metadata") and name.removesuffix(".metadata") in files:
                self.send_body(_metadata(files[name.removesuffix(".metadata")]), "text/plain")
            elif name in files:
                body = files[name].read_bytes()
                if name in up.tampered:
                    body = body[:-1] + bytes([body[-1] ^ 1])
                if name not in up.slow:
                    self.send_body(body, "application/octet-stream")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for start in range(0, len(body), 1024**2):
                    self.wfile.write(body[start:start + 1024**2])
                    time.sleep(0.02)
            elif (project := path.strip("/").split("/")[-1]) in up.wheels:
                self._page(project)
            else:
                self.send_error(404)

        def _page(self, project: str) -> None:
            wheels = up.wheels[project]
            etag = '"' + _sha("".join(w.name for w in wheels).encode())[:16] + '"'
            if self.headers.get("If-None-Match") == etag:
                self.send_response(304)
                self.send_header("ETag", etag)
                self.end_headers()
                return
            if up.style == "torch":
                # As download.pytorch.org: absolute links, '+' escaped, metadata hashes.
                links = "".join(
                    f'<a href="{up.url}/whl/cu130/{w.name.replace("+", "%2B")}'
                    f'#sha256={_sha(w.read_bytes())}" data-requires-python="&gt;=3.10"'
                    f' data-dist-info-metadata="sha256={_sha(_metadata(w))}"'
                    + (f' data-yanked="{up.yanked[w.name]}"' if w.name in up.yanked else "")
                    + f'>{html.escape(w.name)}</a><br/>\n' for w in wheels)
                body = f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode()
                ctype = "text/html"
            else:
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": project, "files": [
                    {"filename": w.name, "url": f"../../files/{w.name}",
                     "hashes": {"sha256": _sha(w.read_bytes())}, "requires-python": ">=3.8",
                     "core-metadata": {"sha256": _sha(_metadata(w))},
                     "size": w.stat().st_size} for w in wheels]}).encode()
                ctype = "application/vnd.pypi.simple.v1+json"
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.write(body)

    return Handler


@dataclass(frozen=True)
class Site:
    torch: Upstream
    pypi: Upstream
    config: Config
    tmp: Path


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    wheels = tmp_path / "wheels"
    big = os.urandom(BIG)  # random: the deflated wheel stays ~20 MB
    torch = Upstream("torch", {
        "torch": [make_wheel(wheels, "torch", "2.14.1+cu130", requires=["filelock>=3"],
                             payload=big),
                  make_wheel(wheels, "torch", "2.14.0+cu130")],
        "torchaudio": [make_wheel(wheels, "torchaudio", "2.14.1+cu130", payload=big[::-1])],
        "nvidia-tampered": [make_wheel(wheels, "nvidia-tampered", "1.0")],
    }, tampered={"nvidia_tampered-1.0-py3-none-any.whl"},
        yanked={"torch-2.14.0+cu130-py3-none-any.whl": "broken build"},
        slow={"torchaudio-2.14.1+cu130-py3-none-any.whl"})
    pypi = Upstream("pypi", {"filelock": [make_wheel(wheels, "filelock", "3.0")]})
    torch.start()
    pypi.start()
    config = Config(storage=str(tmp_path / "data"), catalog_refresh_seconds=0.0,
                    upstream=pypi.root, upstream_rules=f"torch*,nvidia-*={torch.url}/whl/{{cu}}/",
                    cache_page_max_age=0, cache_spool=str(tmp_path / "spool"))
    try:
        yield Site(torch, pypi, config, tmp_path)
    finally:
        torch.stop()
        pypi.stop()


def _install(client: str, index: str, venv: Path, *reqs: str,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    python = make_venv(venv) if not venv.exists() else venv / "bin" / "python"
    url = f"{index}/{ROOT}/simple/"
    if client == "uv":
        args = [shutil.which("uv") or "uv", "pip", "install", "--python", str(python),
                "--no-cache", "--index-url", url, *reqs]
    else:
        args = [str(python), "-m", "pip", "install", "--no-cache-dir", "--index-url", url, *reqs]
    done = subprocess.run(args, env=clean_env(), capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def _installed(venv: Path, module: str) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c",
                           f"import {module}; print({module}.VERSION)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _cached(config: Config) -> dict[str, int]:
    storage = open_storage(config)
    return {o.key.rsplit("/", 1)[-1]: o.size for o in storage.list(layout.MIRROR_FILES)}


def _kept(config: Config, *names: str, gone: tuple[str, ...] = ()) -> dict[str, int]:
    """What the cache holds once ``names`` are in it and ``gone`` are not: the index keeps
    (and evicts) right after a download's last byte, so an installer may finish first."""
    wait_until(lambda: set(names) <= set(held := _cached(config))
               and not set(gone) & set(held), f"the cache to hold {names}, not {gone}")
    return _cached(config)


def test_installs_through_the_cache_and_again_with_the_upstreams_stopped(site: Site) -> None:
    torch_file = "torch-2.14.1+cu130-py3-none-any.whl"
    with start_index(site.config, site.tmp) as index:
        page = requests.get(f"{index}/{ROOT}/simple/torch/", timeout=10)
        assert page.status_code == 200 and page.headers["X-Wheelhouse-Upstream"] == "fresh"
        assert site.torch.url not in page.text and "/mirror/" in page.text
        assert 'data-yanked="broken build"' in page.text
        assert 'data-requires-python="&gt;=3.10"' in page.text
        assert "data-core-metadata=\"sha256=" in page.text
        listing = requests.get(f"{index}/{ROOT}/simple/filelock/", timeout=10, headers={
            "Accept": "application/vnd.pypi.simple.v1+json"}).json()
        assert listing["files"][0]["url"].startswith("/mirror/")
        assert listing["files"][0]["requires-python"] == ">=3.8"

        _install("uv", index, site.tmp / "uv", "torch==2.14.*")
        assert _installed(site.tmp / "uv", "torch") == "2.14.1+cu130"
        assert _installed(site.tmp / "uv", "filelock") == "3.0"
        cached = _kept(site.config, torch_file, "filelock-3.0-py3-none-any.whl")
        assert cached[torch_file] == site.torch.file(torch_file).stat().st_size
        wheel_path = f"/whl/cu130/{torch_file}"
        assert site.torch.hits[wheel_path] == 1

        _install("pip", index, site.tmp / "pip", "torch==2.14.1+cu130")
        assert _installed(site.tmp / "pip", "torch") == "2.14.1+cu130"
        # The second install came from storage: the upstream served the wheel once.
        assert site.torch.hits[wheel_path] == 1

        site.torch.stop()
        site.pypi.stop()
        stale = requests.get(f"{index}/{ROOT}/simple/torch/", timeout=10)
        assert stale.status_code == 200
        assert stale.headers["X-Wheelhouse-Upstream"].startswith("stale")
        assert "could not be asked" in stale.text
        for client in ("uv", "pip"):
            venv = site.tmp / f"{client}-offline"
            _install(client, index, venv, "torch==2.14.1+cu130")
            assert _installed(venv, "torch") == "2.14.1+cu130"
            assert _installed(venv, "filelock") == "3.0"
        # A file never fetched can't be installed with the upstream gone, and says why.
        missing = requests.get(f"{index}/{ROOT}/simple/torchaudio/", timeout=10)
        assert missing.status_code == 503


def test_a_tampered_file_is_never_kept_and_the_install_fails(site: Site) -> None:
    name = "nvidia_tampered-1.0-py3-none-any.whl"
    with start_index(site.config, site.tmp) as index:
        for client in ("uv", "pip"):
            done = _install(client, index, site.tmp / client, "nvidia-tampered", check=False)
            assert done.returncode != 0, done.stdout
            assert "nvidia_tampered" not in subprocess.run(
                [str(site.tmp / client / "bin" / "python"), "-m", "pip", "list"],
                capture_output=True, text=True).stdout
        page = requests.get(f"{index}/{ROOT}/simple/nvidia-tampered/", timeout=10, headers={
            "Accept": "application/vnd.pypi.simple.v1+json"}).json()
        # The answer is cut short of its Content-Length (here before its first byte, as the
        # file is one chunk): no client takes it for whole.
        with pytest.raises((requests.exceptions.ChunkedEncodingError,
                            requests.exceptions.ConnectionError)):
            requests.get(index + page["files"][0]["url"], timeout=10)
        assert name not in _cached(site.config)
        # Each try (uv and pip retry a cut answer) fetched again: nothing was kept.
        assert site.torch.hits[f"/whl/cu130/{name}"] >= 2
        assert not list((site.tmp / "spool").iterdir())


def test_two_concurrent_first_downloads_fetch_once(site: Site) -> None:
    name = "torchaudio-2.14.1+cu130-py3-none-any.whl"
    expected = _sha(site.torch.file(name).read_bytes())
    with start_index(site.config, site.tmp, workers=2) as index:
        page = requests.get(f"{index}/{ROOT}/simple/torchaudio/", timeout=10, headers={
            "Accept": "application/vnd.pypi.simple.v1+json"}).json()
        url = index + page["files"][0]["url"]
        got: list[str] = []

        def download() -> None:
            with requests.get(url, timeout=60, stream=True) as resp:
                resp.raise_for_status()
                digest = hashlib.sha256()
                for chunk in resp.iter_content(256 * 1024):
                    digest.update(chunk)
                got.append(digest.hexdigest())

        threads = [threading.Thread(target=download) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == [expected] * 4
        assert site.torch.hits[f"/whl/cu130/{name}"] == 1
        _kept(site.config, name)


def test_eviction_keeps_the_budget(site: Site) -> None:
    config = site.config.replace(cache_max_gib=30 / 1024)  # 30 MiB: one big wheel, not two
    torch_file = "torch-2.14.1+cu130-py3-none-any.whl"
    audio_file = "torchaudio-2.14.1+cu130-py3-none-any.whl"
    with start_index(config, site.tmp) as index:
        _install("uv", index, site.tmp / "a", "torch==2.14.1+cu130")
        _kept(config, torch_file)
        _install("uv", index, site.tmp / "b", "torchaudio")
        cached = _kept(config, audio_file, gone=(torch_file,))
        assert sum(cached.values()) <= 30 * 1024**2
        # Evicted is not lost: it is fetched again on demand.
        _install("uv", index, site.tmp / "c", "torch==2.14.1+cu130")
        assert _installed(site.tmp / "c", "torch") == "2.14.1+cu130"


def test_mirror_command_primes_the_cache(site: Site) -> None:
    with start_index(site.config, site.tmp) as index:
        done = subprocess.run(
            [sys.executable, "-c", "from wheelhouse.cli.main import main; "
             "from wheelhouse.cli.mirror import mirror; main.add_command(mirror); main()",
             "mirror", "torch==2.14.*", "--cuda", "13.0", "--python", "3.11",
             "--server", index], env=clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", "")),
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        _kept(site.config, "torch-2.14.1+cu130-py3-none-any.whl", "filelock-3.0-py3-none-any.whl")
        site.torch.stop()
        site.pypi.stop()
        _install("uv", index, site.tmp / "after", "torch==2.14.*")
        assert _installed(site.tmp / "after", "torch") == "2.14.1+cu130"


def test_build_venvs_get_torch_through_the_cache(site: Site) -> None:
    """What the worker's venv step runs (``index_args`` with ``build_through_index``), twice:
    torch comes from the index, fetched from the upstream once for both "builds"."""
    with start_index(site.config, site.tmp) as index:
        argv = index_args(site.config.replace(build_through_index=index), parse_variant(ROOT))
        for build in ("one", "two"):
            python = make_venv(site.tmp / build)
            done = subprocess.run([shutil.which("uv") or "uv", "pip", "install", "--python",
                                   str(python), "--no-build", "--no-cache", *argv,
                                   "torch==2.14.*"], env=clean_env(), capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            assert _installed(site.tmp / build, "torch") == "2.14.1+cu130"
        assert site.torch.hits["/whl/cu130/torch-2.14.1+cu130-py3-none-any.whl"] == 1
        _kept(site.config, "torch-2.14.1+cu130-py3-none-any.whl")
