"""One URL for any GPU: uv with wheel variants picks the build that fits the machine.

Wheels with real device code (a tiny kernel nvcc compiles once per session for sm_80, sm_90 and
sm_120) are published into per-arch roots the ordinary way; the running index lists their variant
form at ``/simple/``, and real uv with ``--preview-features wheel-variants`` installs from it
with the NVIDIA provider's values forced (there is no GPU here). The proof of a selection is in
what lands on disk: the installed library's own SASS, read back by the device-code reader.

torch is never downloaded: a find-links directory holds stand-ins for torch 2.13.1 and 2.14.1
(pure-Python wheels of that name and version), which is all the resolver needs to pick a build
by its ``torch==X.Y.*`` requirement; the index's routing is off, so ``/simple/torch/`` is a 404.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest
import requests

from tests.helpers import IndexURL, clean_env, make_venv, make_wheel, start_index
from wheelhouse.config import Config
from wheelhouse.devicecode import library_device_code
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant

pytestmark = [pytest.mark.nvcc,
              pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not installed")]

KERNEL = """\
__global__ void k(float* x) { x[threadIdx.x] *= 2.f; }
extern "C" void launch(float* x) { k<<<1, 32>>>(x); }
"""
ARCHS = ("80", "90", "120")
#: Loads the library the way a CUDA extension's module does: importing fails if it can't.
MODULE = ("import ctypes, pathlib\n"
          "LIB = ctypes.CDLL(str(pathlib.Path(__file__).with_name('libkern.so')))\n")
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}
#: (torch variant key the build is published into, kernel arch)
PUBLISHED = [("torch2.14-cu130-sm80", "80"), ("torch2.14-cu130-sm90", "90"),
             ("torch2.14-cu130-sm120", "120"), ("torch2.13-cu130-sm90", "90")]


@pytest.fixture(scope="session")
def kernel_libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny CUDA kernel as a shared library per arch (real ``.nv_fatbin``), compiled once."""
    from tests.worker.conftest import host_cuda_home, require_nvcc

    require_nvcc()
    root = tmp_path_factory.mktemp("kernels")
    (root / "k.cu").write_text(KERNEL)
    nvcc = str(Path(host_cuda_home()) / "bin" / "nvcc")
    procs = {arch: subprocess.Popen(
        [nvcc, "-shared", "-Xcompiler", "-fPIC", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
         "-o", f"k{arch}.so", "k.cu"], cwd=root, stderr=subprocess.PIPE) for arch in ARCHS}
    for proc in procs.values():
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode(errors="replace")
    return {arch: root / f"k{arch}.so" for arch in ARCHS}


@pytest.fixture(scope="module")
def index(kernel_libraries: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[IndexURL]:
    """The index with the kernel published as four builds: three archs for torch 2.14, one
    for torch 2.13. No build facts: the archs are read from each wheel at publish."""
    tmp = tmp_path_factory.mktemp("variants")
    config = Config(storage=str(tmp / "data"), upstream="off")
    storage = open_storage(config)
    for key, arch in PUBLISHED:
        variant = parse_variant(key)
        wheel = make_wheel(tmp / key, "tiny-kern", f"1.0+{variant.local_label}",
                           tag="py3-none-linux_x86_64", requires=["torch"], module_body=MODULE,
                           files={"tiny_kern/libkern.so": kernel_libraries[arch].read_bytes()})
        publish(storage, wheel, variant)
    with start_index(config, tmp) as url:
        yield url


@pytest.fixture(scope="module")
def fake_torch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stand-ins for torch 2.13.1 and 2.14.1, for the resolver only."""
    links = tmp_path_factory.mktemp("torch-links")
    for version in ("2.13.1", "2.14.1"):
        make_wheel(links, "torch", version)
    return links


def uv_install(index: str, fake_torch: Path, tmp_path: Path, *requirements: str,
               driver: str = "13.0", sm: str = "9.0",
               preview: bool = True) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``uv pip install`` from ``/simple/`` into a fresh venv, the GPU as the provider is told."""
    python = make_venv(tmp_path / "venv")
    env = clean_env(UV_CACHE_DIR=str(tmp_path / "uv-cache"),
                    NV_VARIANT_PROVIDER_FORCE_CUDA_DRIVER_VERSION=driver,
                    NV_VARIANT_PROVIDER_FORCE_SM_ARCH=sm)
    argv = ["uv", "pip", "install", "--python", str(python), "--index-url", f"{index}/simple",
            "--find-links", str(fake_torch), *requirements]
    if preview:
        argv[3:3] = ["--preview-features", "wheel-variants"]
    return subprocess.run(argv, env=env, capture_output=True, text=True), python


def installed(python: Path) -> tuple[str, str, set[str]]:
    """(version, variant label, SASS archs of the installed library) of tiny-kern; and it
    imports (which loads the library)."""
    code = ("import importlib.metadata as m, json, tiny_kern, pathlib\n"
            "d = m.distribution('tiny-kern')\n"
            "print(json.dumps([d.version, d.read_text('variant.json'), tiny_kern.LIB._name]))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    version, variant_json, library = json.loads(out.stdout)
    [label] = json.loads(variant_json)["variants"]
    with Path(library).open("rb") as f:
        sass = set(library_device_code(f).sass)
    return version, label, sass


@pytest.mark.parametrize(("driver", "sm", "label", "sass"), [
    ("13.0", "9.0", "cu130sm90", {"90"}),
    ("13.0", "8.0", "cu130sm80", {"80"}),
    ("13.1", "12.0", "cu130sm120", {"120"}),
])
def test_uv_installs_the_build_for_the_gpu(index: IndexURL, fake_torch: Path, tmp_path: Path,
                                           driver: str, sm: str, label: str,
                                           sass: set[str]) -> None:
    result, python = uv_install(index, fake_torch, tmp_path, "tiny-kern", "torch==2.14.*",
                                driver=driver, sm=sm)
    assert result.returncode == 0, result.stderr
    assert installed(python) == ("1.0+pt214", label, sass)


def test_torch_pin_picks_the_build_for_that_torch(index: IndexURL, fake_torch: Path,
                                                  tmp_path: Path) -> None:
    result, python = uv_install(index, fake_torch, tmp_path, "tiny-kern", "torch==2.13.*")
    assert result.returncode == 0, result.stderr
    assert installed(python) == ("1.0+pt213", "cu130sm90", {"90"})
    assert "torch==2.13.1" in result.stderr


@pytest.mark.parametrize(("driver", "sm"), [("13.0", "7.5"), ("12.8", "9.0")])
def test_no_fitting_build_is_a_resolver_error(index: IndexURL, fake_torch: Path,
                                              tmp_path: Path, driver: str, sm: str) -> None:
    result, python = uv_install(index, fake_torch, tmp_path, "tiny-kern", "torch==2.14.*",
                                driver=driver, sm=sm)
    assert result.returncode != 0
    assert "only unsupported wheel variants" in result.stderr, result.stderr
    assert not list(python.parent.parent.glob("lib/python*/site-packages/tiny_kern"))


def test_without_the_preview_uv_sees_no_variant_wheel(index: IndexURL, fake_torch: Path,
                                                      tmp_path: Path) -> None:
    result, _ = uv_install(index, fake_torch, tmp_path, "tiny-kern", preview=False)
    assert result.returncode != 0
    assert "tiny-kern" in result.stderr


def test_pages_hashes_and_metadata_match(index: IndexURL, tmp_path: Path) -> None:
    page = requests.get(f"{index}/simple/tiny-kern/", headers=JSON, timeout=30).json()
    names = sorted(f["filename"] for f in page["files"])
    assert names == [
        "tiny_kern-1.0+pt213-py3-none-linux_x86_64-cu130sm90.whl",
        "tiny_kern-1.0+pt213-variants.json",
        "tiny_kern-1.0+pt214-py3-none-linux_x86_64-cu130sm120.whl",
        "tiny_kern-1.0+pt214-py3-none-linux_x86_64-cu130sm80.whl",
        "tiny_kern-1.0+pt214-py3-none-linux_x86_64-cu130sm90.whl",
        "tiny_kern-1.0+pt214-variants.json",
    ]
    for entry in page["files"]:
        body = requests.get(index + entry["url"], timeout=30).content
        assert hashlib.sha256(body).hexdigest() == entry["hashes"]["sha256"], entry["filename"]
        if entry["filename"].endswith(".whl"):
            metadata = requests.get(index + entry["url"] + ".metadata", timeout=30).content
            assert hashlib.sha256(metadata).hexdigest() == entry["core-metadata"]["sha256"]
            (tmp_path / "w.whl").write_bytes(body)
            with zipfile.ZipFile(tmp_path / "w.whl") as zf:
                [info] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
                assert zf.read(info) == metadata
            assert "Requires-Dist: torch==2.1" in metadata.decode()
    document = requests.get(index + next(f["url"] for f in page["files"] if f["filename"]
                                         == "tiny_kern-1.0+pt214-variants.json"), timeout=30)
    assert json.loads(document.content)["variants"] == {
        f"cu130sm{a}": {"nvidia": {"cuda_version_lower_bound": ["13.0"],
                                   "sm_arch": [f"{a}_real"]}} for a in ARCHS}
    # The HTML page lists the same files with the same hashes.
    html = requests.get(f"{index}/simple/tiny-kern/", headers={"Accept": "text/html"},
                        timeout=30).text
    linked = {unquote(href.rpartition("/")[2]): sha for href, sha in
              re.findall(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', html)}
    assert linked == {f["filename"]: f["hashes"]["sha256"] for f in page["files"]}
    # The per-variant roots stay as they were: the plain wheels, no variant form.
    narrowed = requests.get(f"{index}/torch2.14-cu130-sm90/simple/tiny-kern/", headers=JSON,
                            timeout=30).json()
    assert [f["filename"] for f in narrowed["files"]] == [
        "tiny_kern-1.0+cu130torch2.14.sm90-py3-none-linux_x86_64.whl"]
    root = requests.get(f"{index}/simple/", headers=JSON, timeout=30).json()
    assert root["projects"] == [{"name": "tiny-kern"}]


def test_pip_skips_variant_wheels_and_uses_the_variant_roots(index: IndexURL,
                                                             tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    pip = [str(python), "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d",
           str(tmp_path / "dl"), "--index-url"]
    plain = subprocess.run([*pip, f"{index}/simple", "tiny-kern"], env=clean_env(),
                           capture_output=True, text=True)
    assert plain.returncode != 0
    assert "No matching distribution found for tiny-kern" in plain.stderr
    narrowed = subprocess.run([*pip, f"{index}/torch2.14-cu130-sm90/simple", "tiny-kern"],
                              env=clean_env(), capture_output=True, text=True)
    assert narrowed.returncode == 0, narrowed.stderr
    assert [p.name for p in (tmp_path / "dl").iterdir()] == [
        "tiny_kern-1.0+cu130torch2.14.sm90-py3-none-linux_x86_64.whl"]
