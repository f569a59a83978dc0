"""``wheelhouse publish`` as operators run it, and what every gunicorn worker then serves."""

from __future__ import annotations

import os
import subprocess
import time
import zipfile
from pathlib import Path

import requests

from tests.helpers import config_env, make_wheel, start_index
from wheelhouse.config import Config

JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}


def _wheelhouse(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    return subprocess.run(["wheelhouse", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_refuses_inconsistent_upstream_style_wheel(tmp_path: Path) -> None:
    """flash-attn's release wheels: label in the file name, plain version in METADATA."""
    config = Config(storage=str(tmp_path / "data"))
    wheel = make_wheel(tmp_path, "flash-attn", "2.8.3+cu12torch2.8cxx11abiTRUE",
                       metadata_version="2.8.3", tag="cp311-cp311-linux_x86_64")
    done = _wheelhouse(config, "publish", str(wheel), "--variant", "torch2.8-cu128")
    assert done.returncode != 0
    assert "METADATA says version 2.8.3" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "records").exists()


def test_relabel_then_every_worker_lists_it(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), catalog_refresh_seconds=0.5)
    wheel = make_wheel(tmp_path, "flash-attn", "2.8.3", tag="cp311-cp311-linux_x86_64")
    with start_index(config, tmp_path, workers=4) as url:
        page = f"{url}/torch2.8-cu128/simple/flash-attn/"
        # flash-attn has a recipe here: before its first wheel, a 404, never the upstream.
        assert requests.get(page, allow_redirects=False, timeout=5).status_code == 404
        done = _wheelhouse(config, "publish", str(wheel), "--variant", "torch2.8-cu128",
                           "--relabel")
        assert done.returncode == 0, done.stderr
        time.sleep(1.0)
        # Many requests spread over the 4 gunicorn processes: every one sees the new wheel.
        with requests.Session() as s:
            for _ in range(40):
                resp = s.get(page, headers=JSON, allow_redirects=False, timeout=5)
                assert resp.status_code == 200
                assert resp.json()["versions"] == ["2.8.3+cu128torch2.8"]
        stored = next((tmp_path / "data" / "wheels").rglob("*.whl"))
    assert stored.name == "flash_attn-2.8.3+cu128torch2.8-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(stored) as zf:
        meta = zf.read("flash_attn-2.8.3+cu128torch2.8.dist-info/METADATA").decode()
    assert "Version: 2.8.3+cu128torch2.8" in meta


def test_bad_variant_is_a_clear_error(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "x", "1.0")
    done = _wheelhouse(Config(storage=str(tmp_path / "d")), "publish", str(wheel), "--variant",
                       "torch2.8-cu199")
    assert done.returncode != 0
    assert "unknown CUDA version" in done.stderr
    assert "Traceback" not in done.stderr
