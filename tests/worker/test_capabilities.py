"""Toolkit discovery asks each nvcc for its version; folder names never decide it."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from wheelhouse.builds.fleet import queues_for
from worker.capabilities import discover, discover_toolkits, nvcc_version, parse_nvidia_smi


def fake_toolkit(home: Path, release: str, *, headers: bool = True) -> Path:
    """A toolkit folder whose nvcc is a real executable that answers like NVIDIA's."""
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    mm = ".".join(release.split(".")[:2])
    nvcc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        '  echo "nvcc: NVIDIA (R) Cuda compiler driver"\n'
        f'  echo "Cuda compilation tools, release {mm}, V{release}"\n'
        "  exit 0\nfi\nexit 1\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    if headers:
        (home / "include").mkdir()
        (home / "include" / "cuda_runtime.h").write_text("/* test */\n")
    return home


def test_discovery_finds_each_toolkit_once_with_its_real_version(tmp_path: Path) -> None:
    root = tmp_path / "root"
    fake_toolkit(root / "cuda-12.8", "12.8.93")
    # A folder name that lies: nvcc's answer wins.
    fake_toolkit(root / "cuda-12.4", "12.6.85")
    (root / "cuda").symlink_to(root / "cuda-12.8")  # the same toolkit again
    fake_toolkit(root / "cuda-11.0", "11.0.1", headers=False)  # no headers: not a toolkit
    broken = fake_toolkit(root / "cuda-13.9", "13.9.0")
    (broken / "bin" / "nvcc").write_text("#!/bin/sh\nexit 3\n")  # doesn't answer
    home = fake_toolkit(tmp_path / "elsewhere", "13.0.88")
    env = {"CUDA_HOME": str(home), "PATH": os.defpath}

    found = discover_toolkits(env, roots=[root])
    assert [(t.cuda, t.release) for t in found] == [
        ("13.0", "V13.0.88"), ("12.8", "V12.8.93"), ("12.6", "V12.6.85")]
    assert found[1].home == str((root / "cuda-12.8").resolve())
    assert queues_for([t.cuda for t in found], "x86_64") == (
        "build-cu121-x86_64", "build-cu124-x86_64", "build-cu126-x86_64", "build-cu128-x86_64",
        "build-cu130-x86_64")


def test_nvcc_on_path_is_found_through_its_toolkit(tmp_path: Path) -> None:
    home = fake_toolkit(tmp_path / "opt" / "cuda-x", "12.9.41")
    env = {"PATH": f"{home / 'bin'}{os.pathsep}{os.defpath}"}
    found = discover_toolkits(env, roots=[])
    assert [t.release for t in found] == ["V12.9.41"]


def test_nvidia_smi_parsing() -> None:
    text = "NVIDIA H100 80GB HBM3, 9.0\nNVIDIA GeForce RTX 5090, 12.0\ngarbage line\n"
    assert [(g.name, g.arch) for g in parse_nvidia_smi(text)] == [
        ("NVIDIA H100 80GB HBM3", "90"), ("NVIDIA GeForce RTX 5090", "120")]


def test_this_host() -> None:
    caps = discover()
    assert caps.cores >= 1 and caps.memory_bytes > 1024**3
    assert caps.machine in ("x86_64", "aarch64")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this host")
    version = nvcc_version(Path(nvcc))
    assert version is not None
    assert version[0] in {t.cuda for t in caps.toolkits}
    assert f"build-cu{version[0].replace('.', '')}-{caps.machine}" in caps.queues


def test_a_worker_advertises_the_toolkits_it_provisioned(tmp_path: Path) -> None:
    """Issue 13: a host with only CUDA 12.8 serves 13.x too once it provisioned that toolkit;
    a provisioned toolkit under the toolkit root is found like any (issue 21: and only then)."""
    from wheelhouse.builds.fleet import WorkerAd

    root = tmp_path / "root"
    fake_toolkit(root / "cuda-12.8", "12.8.93")
    fake_toolkit(tmp_path / "toolkits" / "cuda-13.0", "13.0.88")
    caps = discover({"PATH": os.defpath}, roots=[root, tmp_path / "toolkits"],
                    provisionable=("13.0",), unavailable={"13.1": "no CUDA 13.1 release"})
    assert [t.release for t in caps.toolkits] == ["V13.0.88", "V12.8.93"]
    assert "build-cu130-x86_64" in caps.queues or caps.machine != "x86_64"
    assert "build-cu131-x86_64" not in caps.queues
    ad = caps.advert("w", started_at=0.0)
    assert ad.provisionable == ("13.0",) and "13.1" not in ad.cuda_versions
    assert ad.unavailable == {"13.1": "no CUDA 13.1 release"}
    assert WorkerAd.from_json(ad.to_json()) == ad
    # An advert written before provisionable and unavailable existed still reads.
    old = json.loads(ad.to_json())
    del old["provisionable"], old["unavailable"]
    back = WorkerAd.from_json(json.dumps(old))
    assert back.provisionable == () and back.unavailable == {}
