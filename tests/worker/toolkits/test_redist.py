"""CUDA toolkits from NVIDIA's redistributable archives, tested against a local mirror.

The mirror is what these tests build: a ``redistrib_<version>.json`` manifest and tar.xz archives
laid out as NVIDIA's (``<component>/linux-x86_64/<component>-…-archive.tar.xz``, each with one
top directory), whose nvcc is a script that answers ``--version`` like nvcc 12.8, served by a real
HTTP server. No archive of NVIDIA's own was fetched from here (no network to NVIDIA).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, serve_http
from wheelhouse.builds.fleet import unavailable_reasons
from wheelhouse.errors import InfrastructureError
from worker.capabilities import discover, discover_toolkits, machine
from worker.errors import ToolkitUnavailable
from worker.toolkits import redist
from worker.toolkits.provision import Sources, prepare, proof, provision, wanted_versions

PLATFORM = redist.PLATFORMS.get(machine(), "linux-x86_64")
NVCC = """#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "nvcc: NVIDIA (R) Cuda compiler driver"
  echo "Copyright (c) 2005-2025 NVIDIA Corporation"
  echo "Cuda compilation tools, release {mm}, V{full}"
  echo "Build cuda_{mm}.r{mm}/compiler.35583870_0"
  exit 0
fi
exit 1
"""


def _tar_xz(top: str, files: dict[str, str | bytes], links: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, body in files.items():
            data = body.encode() if isinstance(body, str) else body
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o755 if name.startswith("bin/") else 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def _contents(component: str, mm: str, full: str) -> tuple[dict[str, str | bytes], dict[str, str]]:
    if component == "cuda_nvcc":
        return {"bin/nvcc": NVCC.format(mm=mm, full=full), "nvvm/bin/cicc": "",
                "include/crt/host_config.h": ""}, {}
    if component == "cuda_cudart":
        return ({"include/cuda_runtime.h": "/* runtime */\n", "lib/libcudart.so.12": b"\x7fELF"},
                {"lib/libcudart.so": "libcudart.so.12"})
    if component == "cuda_cccl":
        return {"include/cuda/std/version": ""}, {}
    header = {"libcublas": "cublas_v2.h", "libcusparse": "cusparse.h",
              "libcusolver": "cusolverDn.h", "libcurand": "curand.h"}.get(component, "x.h")
    return {f"include/{header}": "", f"lib/{component}.so.12": b"\x7fELF big library"}, {}


def make_mirror(root: Path, release: str = "12.8.1", full: str = "12.8.93", *,
                drop: tuple[str, ...] = (), corrupt: tuple[str, ...] = ()) -> Path:
    """A mirror of one release under ``root``; ``drop``: components left out of the manifest,
    ``corrupt``: components whose archive differs from the manifest's sha256."""
    major, minor = release.split(".")[:2]
    manifest: dict[str, Any] = {"release_label": release, "release_product": "cuda"}
    for component in redist.components(int(major)):
        top = f"{component}-{PLATFORM}-{full}-archive"
        rel = f"{component}/{PLATFORM}/{top}.tar.xz"
        data = _tar_xz(top, *_contents(component, f"{major}.{minor}", full))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data + (b"tampered" if component in corrupt else b""))
        if component not in drop:
            manifest[component] = {"name": component, "version": full, PLATFORM: {
                "relative_path": rel, "sha256": hashlib.sha256(data).hexdigest(),
                "size": str(len(data))}}
    (root / f"redistrib_{release}.json").write_text(json.dumps(manifest, indent=2))
    return root


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """An empty mirror directory and the URL a real HTTP server serves it at."""
    root = tmp_path / "mirror"
    root.mkdir()

    class Mirror(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    with serve_http(Mirror) as url:
        yield root, url + "/"


def test_a_12_8_toolkit_from_the_mirror_is_proven_and_found(
        mirror: tuple[Path, str], tmp_path: Path) -> None:
    root, url = mirror
    make_mirror(root, "12.8.0", "12.8.61")
    make_mirror(root, "12.8.1", "12.8.93")  # the listing names both: the newest patch wins
    toolkits = tmp_path / "toolkits"
    said: list[str] = []
    info = provision("12.8", toolkits, sources=Sources(redist_url=url), say=said.append)
    home = toolkits / "cuda-12.8"
    assert (info.cuda, info.release, Path(info.home)) == ("12.8", "V12.8.93", home)
    assert (home / "lib64" / "libcudart.so").resolve() == home / "lib" / "libcudart.so.12"
    # The libraries torch's headers need: headers only.
    assert (home / "include" / "cublas_v2.h").is_file()
    assert not (home / "lib" / "libcublas.so.12").exists()
    assert proof(home) is not None and proof(home)["source"] == "redist"  # type: ignore[index]
    assert str(proof(home)["origin"]).endswith("redistrib_12.8.1.json")  # type: ignore[index]
    assert any("libcublas" in line for line in said)
    # Discovery finds it like a host toolkit; a second provision reuses it (no mirror needed).
    assert discover_toolkits({"PATH": ""}, roots=[toolkits]) == [info]
    assert provision("12.8", toolkits, sources=Sources(redist_url="http://127.0.0.1:9/")) == info
    assert [p.name for p in toolkits.iterdir()] == ["cuda-12.8"]
    # A mirror that is a directory (file://) serves as well.
    other = provision("12.8", tmp_path / "other", sources=Sources(redist_url=f"file://{root}"))
    assert other.release == "V12.8.93" and proof(Path(other.home)) is not None


@pytest.mark.parametrize(("drop", "corrupt", "message"), [
    (("libcusparse",), (), r"redistrib_12\.8\.1\.json lacks libcusparse for linux-"),
    ((), ("cuda_cccl",), r"cuda_cccl-linux-.*\.tar\.xz does not match the manifest's sha256"),
])
def test_a_broken_mirror_is_refused_in_one_line(
        mirror: tuple[Path, str], tmp_path: Path, drop: tuple[str, ...],
        corrupt: tuple[str, ...], message: str) -> None:
    root, url = mirror
    make_mirror(root, drop=drop, corrupt=corrupt)
    toolkits = tmp_path / "toolkits"
    with pytest.raises(ToolkitUnavailable, match=message) as caught:
        provision("12.8", toolkits, sources=Sources(redist_url=url))
    assert "\n" not in str(caught.value)
    assert list(toolkits.iterdir()) == []  # nothing half-made left behind


def test_a_release_the_mirror_lacks_and_a_host_that_does_not_answer(
        mirror: tuple[Path, str], tmp_path: Path) -> None:
    root, url = mirror
    make_mirror(root)
    with pytest.raises(ToolkitUnavailable, match=r"no CUDA 12\.4 release at .*redistrib_12\.4\.0"
                       r"\.json; WHEELHOUSE_TOOLKIT_REDIST_URL"):
        provision("12.4", tmp_path / "t", sources=Sources(redist_url=url))
    closed = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(InfrastructureError, match=r"^127\.0\.0\.1:\d+ did not answer .*"
                       r"WHEELHOUSE_TOOLKIT_REDIST_URL"):
        provision("12.8", tmp_path / "t", sources=Sources(redist_url=closed))
    # CUDA 12 never comes from wheels (nvidia-cuda-nvcc-cu12 has no nvcc).
    with pytest.raises(ToolkitUnavailable, match="set WHEELHOUSE_TOOLKIT_REDIST_URL"):
        provision("12.8", tmp_path / "t", sources=Sources(wheels=True, redist_url=""))


def _evil(kind: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        info = tarfile.TarInfo({"dotdot": "top/../../escape", "absolute": "/etc/escape"}
                               .get(kind, "top/include/x.h"))
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "../../../../etc/passwd"
        elif kind == "device":
            info.type = tarfile.CHRTYPE
        tar.addfile(info, io.BytesIO(b""))
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "device"])
def test_unsafe_archives_are_refused(tmp_path: Path, kind: str) -> None:
    archive = tmp_path / "evil.tar.xz"
    archive.write_bytes(_evil(kind))
    with pytest.raises(ToolkitUnavailable, match=r"unsafe|points out|not a file"):
        redist.unpack(archive, tmp_path / "home")
    assert not (tmp_path / "escape").exists() and not list((tmp_path / "home").rglob("*"))


def test_a_worker_offers_what_it_proved_and_says_why_not_the_rest(
        mirror: tuple[Path, str], tmp_path: Path) -> None:
    """Issue 21: versions are advertised only once provisioned and proven; the rest say why."""
    root, url = mirror
    make_mirror(root)
    toolkits = tmp_path / "toolkits"
    wanted = wanted_versions("12.8, 13.0")
    prepared = prepare(wanted, [], toolkits, Sources(wheels=False, redist_url=url))
    assert [t.release for t in prepared.provisioned] == ["V12.8.93"]
    assert list(prepared.unavailable) == ["13.0"]
    assert "no CUDA 13.0 release at" in prepared.unavailable["13.0"]
    caps = discover({"PATH": ""}, roots=[toolkits], provisionable=("12.8",),
                    unavailable=prepared.unavailable)
    ad = caps.advert("w1", started_at=0.0)
    assert "12.8" in ad.cuda_versions and "13.0" not in ad.cuda_versions
    assert unavailable_reasons([ad]) == {"13.0": [f"w1: {prepared.unavailable['13.0']}"]}
    assert wanted_versions("auto") == ("12.9", "13.2")
