"""The environment a build sees: an allow-list of the worker's, the probe wrapper first."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from wheelhouse.builds.facts import MaxJobs
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.recipes.book import load_recipe
from wheelhouse.variants import Variant
from worker.buildenv import compile_env, install_env, sanitized_env
from worker.sandbox.wrapper import VENV_INSIDE

WORKER_ENV = {
    "PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C",
    "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s", "WHEELHOUSE_REDIS_URL": "r",
    "WHEELHOUSE_STORAGE": "s3://b", "REDIS_URL": "redis://", "GITHUB_TOKEN": "t",
    "HF_TOKEN": "t", "MY_API_KEY": "k", "TORCH_CUDA_ARCH_LIST": "5.0", "MAX_JOBS": "99",
    "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "CUDA_HOME": "/wrong", "PYTHONPATH": "/x",
    "HTTPS_PROXY": "http://user:pw@proxy", "UV_CACHE_DIR": "/cache",
}
JOBS = MaxJobs(jobs=3, reason="MAX_JOBS=3: test", per_thread_bytes=1, nvcc_threads=1,
               available_bytes=1, reserve_bytes=1, cores=3, learned=False)
TOOLKIT = ToolkitInfo(cuda="13.0", home="/usr/local/cuda-13.0",
                      nvcc="/usr/local/cuda-13.0/bin/nvcc")


def test_sanitized_env_drops_credentials_and_switches() -> None:
    assert sanitized_env(WORKER_ENV) == {
        "PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C",
        "UV_CACHE_DIR": "/cache"}
    assert sanitized_env(WORKER_ENV, install=True)["HTTPS_PROXY"] == "http://user:pw@proxy"


def test_the_installer_sees_the_proxy_but_no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in WORKER_ENV.items():
        monkeypatch.setenv(k, v)
    env = install_env()
    assert env["HTTPS_PROXY"] == "http://user:pw@proxy" and env["UV_NO_PROGRESS"] == "1"
    assert not {"AWS_SECRET_ACCESS_KEY", "WHEELHOUSE_REDIS_URL", "GITHUB_TOKEN"} & set(env)


def _venv_with_ninja(tmp_path: Path) -> Path:
    """A venv's bin folder whose ninja says what it was asked."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    ninja = bin_dir / "ninja"
    ninja.write_text('#!/bin/sh\necho "real ninja $*"\n')
    ninja.chmod(0o755)
    return bin_dir / "python"


def test_compile_env_puts_the_probe_first_and_the_recipe_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in WORKER_ENV.items():
        monkeypatch.setenv(k, v)
    python = _venv_with_ninja(tmp_path)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    variant = Variant.of("2.14", "13.0", ["sm80", "sm90"])
    env = compile_env(workspace, python, TOOLKIT, JOBS, load_recipe("flash-attn"), variant)

    path = env["PATH"].split(os.pathsep)
    assert path[:3] == [str(workspace / "probe-bin"), str(python.parent),
                        "/usr/local/cuda-13.0/bin"]
    assert env["CUDA_HOME"] == "/usr/local/cuda-13.0" and env["MAX_JOBS"] == "3"
    assert env["TMPDIR"] == str(workspace / "tmp") and (workspace / "tmp").is_dir()
    # The recipe's [env], filled in, decides the build's switches, not the worker's.
    assert env["FLASH_ATTN_CUDA_ARCHS"] == "80;90"
    assert env["FLASH_ATTENTION_SKIP_CUDA_BUILD"] == "FALSE"
    assert not {"AWS_SECRET_ACCESS_KEY", "WHEELHOUSE_REDIS_URL", "GITHUB_TOKEN",
                "TORCH_CUDA_ARCH_LIST", "PYTHONPATH"} & set(env)
    assert "HTTPS_PROXY" not in env  # only the installer goes to the network
    assert env["TORCH_NO_COMPILER_WRAPPER"] == "1"  # no cache of torch's own choosing
    assert "CPLUS_INCLUDE_PATH" not in env  # no CUDA library wheels in this venv
    # Outside a ninja build (no build.ninja) the wrapper is the real ninja.
    out = subprocess.run(["ninja", "--version"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert out.stdout == "real ninja --version\n"


def test_compile_env_adds_the_library_headers_of_torchs_wheels(tmp_path: Path) -> None:
    """A minimal toolkit (NVIDIA's wheels, or this host's) lacks cusparse.h and friends, which
    torch's ATen/cuda headers include; torch's nvidia-* wheels in the venv carry them."""
    python = _venv_with_ninja(tmp_path)
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "nvidia"
    for lib in ("cu13", "cudnn", "nccl"):
        (site / lib / "include").mkdir(parents=True)
    (site / "cu13" / "lib").mkdir()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    env = compile_env(workspace, python, TOOLKIT, JOBS, load_recipe("generic"),
                      Variant.of("2.14", "13.0", ["sm80"]))
    expected = os.pathsep.join(str(site / lib / "include") for lib in ("cu13", "cudnn", "nccl"))
    assert env["CPLUS_INCLUDE_PATH"] == env["C_INCLUDE_PATH"] == expected
    assert env["FORCE_CUDA"] == "1" and env["TORCH_CUDA_ARCH_LIST"] == "8.0"


def test_compile_env_without_ninja_is_incompatible(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with pytest.raises(BuildFailed, match="ninja is neither") as err:
        compile_env(workspace, python, TOOLKIT, JOBS, load_recipe("flash-attn"),
                    Variant.of("2.14", "13.0"))
    assert err.value.kind is FailureKind.INCOMPATIBLE


def test_compile_env_names_the_venv_where_the_compile_sees_it(tmp_path: Path) -> None:
    """A sandboxed compile sees the venv at VENV_INSIDE: PATH, VIRTUAL_ENV, the library headers
    and the probe's real ninja name that place; what exists is still looked up outside."""
    python = _venv_with_ninja(tmp_path)
    venv = python.parent.parent
    (venv / "lib" / "python3.11" / "site-packages" / "nvidia" / "cu13" / "include").mkdir(
        parents=True)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    inside = VENV_INSIDE / "bin" / "python"
    env = compile_env(workspace, python, TOOLKIT, JOBS, load_recipe("generic"),
                      Variant.of("2.14", "13.0", ["sm80"]), seen_python=inside)
    assert env["PATH"].split(os.pathsep)[1] == str(VENV_INSIDE / "bin")
    assert env["VIRTUAL_ENV"] == str(VENV_INSIDE)
    assert env["CPLUS_INCLUDE_PATH"] == str(
        VENV_INSIDE / "lib" / "python3.11" / "site-packages" / "nvidia" / "cu13" / "include")
    assert f'real="{VENV_INSIDE / "bin" / "ninja"}"' in (workspace / "probe-bin" / "ninja"
                                                        ).read_text()
    assert str(tmp_path) not in env["PATH"].split(os.pathsep)[1] + env["CPLUS_INCLUDE_PATH"]
