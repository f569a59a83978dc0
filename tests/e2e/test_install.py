"""uv and pip install from a running index, on local and S3 storage, with upstream routing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest
import requests

from tests.helpers import clean_env, make_venv, make_wheel, start_index
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant

VARIANT = "torch2.14-cu130"

pytestmark = pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not installed")


def _publish_demo(config: Config, tmp_path: Path) -> Path:
    """A labelled wheel that depends on a project only the upstream has."""
    variant = parse_variant(VARIANT)
    wheel = make_wheel(
        tmp_path / "build", "demo-ext", f"1.0+{variant.local_label}",
        tag="py3-none-any", requires=["helperdep>=1.0"], requires_python=">=3.8",
        module_body="from helperdep import ANSWER\nVALUE = ANSWER + 1\n",
        payload=b"x" * 300_000,  # big enough that a body download shows in the log
    )
    publish(open_storage(config), wheel, variant)
    return wheel


def _requests_for(log: str, suffix: str) -> list[str]:
    """Access-log lines of GET/HEAD requests whose (unquoted) path ends with ``suffix``."""
    pattern = re.compile(r'"(GET|HEAD) [^"]*' + re.escape(suffix) + " ")
    return [line for line in log.splitlines() if pattern.search(unquote(line))]


@pytest.mark.parametrize("client", ["uv", "pip"])
def test_install_resolves_through_metadata_and_upstream(
    any_config: Config, upstream_index: str, tmp_path: Path, client: str
) -> None:
    config = any_config.replace(upstream=upstream_index, upstream_rules="")
    wheel = _publish_demo(config, tmp_path)
    python = make_venv(tmp_path / "venv")
    env = clean_env(UV_CACHE_DIR=str(tmp_path / "uv-cache"))
    with start_index(config, tmp_path) as url:
        index = f"{url}/{VARIANT}/simple"
        if client == "uv":
            resolve = ["uv", "pip", "compile", "-", "--index-url", index, "--python", str(python),
                       "--no-header"]
            out = subprocess.run(resolve, input="demo-ext\n", env=env, capture_output=True,
                                 text=True, check=True).stdout
            assert "demo-ext==1.0+cu130torch2.14" in out
            assert "helperdep==1.0" in out
            log = url.access_log()
            assert _requests_for(log, wheel.name + ".metadata"), log
            assert not _requests_for(log, wheel.name), "uv downloaded the wheel body to resolve"
            install = ["uv", "pip", "install", "--index-url", index, "--python", str(python),
                       "demo-ext"]
        else:
            install = [str(python), "-m", "pip", "install", "--no-cache-dir", "--index-url",
                       index, "demo-ext"]
        subprocess.run(install, env=env, check=True, capture_output=True)
        log = url.access_log()
        # The dependency came through upstream routing: the index answered with a redirect.
        assert re.search(r'"GET /torch2.14-cu130/simple/helperdep/ HTTP/1.1" 302', log), log
        assert _requests_for(log, wheel.name + ".metadata")
    got = subprocess.run([str(python), "-c", "import demo_ext; print(demo_ext.VALUE)"],
                         capture_output=True, text=True, check=True).stdout
    assert got.strip() == "43"


def test_s3_presigned_redirect(s3_config: Config, tmp_path: Path) -> None:
    config = s3_config.replace(s3_file_mode="redirect", upstream="off")
    wheel = _publish_demo(config, tmp_path)
    python = make_venv(tmp_path / "venv")
    with start_index(config, tmp_path) as url:
        page = requests.get(f"{url}/{VARIANT}/simple/demo-ext/",
                            headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=10)
        file_url = url + page.json()["files"][0]["url"]
        first = requests.get(file_url, allow_redirects=False, timeout=10)
        assert first.status_code == 302
        assert first.headers["Location"].startswith(config.s3_endpoint_url or "")
        assert "X-Amz-Signature" in first.headers["Location"]
        body = requests.get(first.headers["Location"], timeout=10).content
        assert body == wheel.read_bytes()
        # uv follows the redirect too (helperdep is absent and routing is off, so skip deps).
        subprocess.run(["uv", "pip", "install", "--no-deps", "--index-url",
                        f"{url}/{VARIANT}/simple", "--python", str(python), "demo-ext"],
                       env=clean_env(UV_CACHE_DIR=str(tmp_path / "uvc")), check=True,
                       capture_output=True)
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True,
                            env=clean_env()).stdout
    assert "demo-ext==1.0+cu130torch2.14" in listed
