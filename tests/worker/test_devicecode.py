"""Device code in shared libraries: the fatbin reader against real nvcc output and cuobjdump."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.worker.conftest import host_cuda_home
from wheelhouse.errors import BuildFailed, FailureKind
from worker.devicecode import (
    DeviceCode,
    archs_found,
    check_device_code,
    library_device_code,
    parse_fatbin,
    wheel_device_code,
)

KERNEL = """\
__global__ void k(float* x) { x[threadIdx.x] *= 2.f; }
void launch(float* x) { k<<<1, 32>>>(x); }
"""
#: nvcc -gencode pairs and what NVIDIA's cuobjdump names for them.
GENCODES = [
    ("compute_80", "sm_80"),
    ("compute_90a", "sm_90a"),
    ("compute_90", "compute_90"),  # PTX only
    ("compute_100f", "sm_100f"),
]


def cuobjdump() -> Path:
    """cuobjdump from the ``nvidia-cuda-cuobjdump`` wheel (the system toolkit has none)."""
    files = metadata.files("nvidia-cuda-cuobjdump") or []
    [path] = [f for f in files if f.name == "cuobjdump"]
    return Path(str(path.locate()))


def cuobjdump_archs(library: Path) -> DeviceCode:
    """What cuobjdump lists: ``ELF file 1: x.1.sm_80.cubin``, ``PTX file 1: x.1.sm_90.ptx``."""
    found: dict[str, set[str]] = {"elf": set(), "ptx": set()}
    for flag, kind in (("--list-elf", "elf"), ("--list-ptx", "ptx")):
        out = subprocess.run([str(cuobjdump()), flag, str(library)], capture_output=True,
                             text=True, check=False)
        found[kind] |= set(re.findall(r"\.sm_([0-9]+a?)\.(?:cubin|ptx)$", out.stdout, re.M))
    return DeviceCode(frozenset(found["elf"]), frozenset(found["ptx"]))


@pytest.fixture(scope="module")
def multi_arch_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small shared library compiled by nvcc for SASS sm_80, sm_90a, sm_100f and PTX 9.0."""
    from tests.worker.conftest import require_nvcc

    require_nvcc()
    root = tmp_path_factory.mktemp("multiarch")
    (root / "k.cu").write_text(KERNEL)
    argv = [str(Path(host_cuda_home()) / "bin" / "nvcc"), "-shared", "-Xcompiler", "-fPIC",
            "-o", "k.so", "k.cu"]
    for arch, code in GENCODES:
        argv += ["-gencode", f"arch={arch},code={code}"]
    subprocess.run(argv, cwd=root, check=True, capture_output=True)
    return root / "k.so"


@pytest.mark.nvcc
def test_the_reader_agrees_with_cuobjdump(multi_arch_library: Path) -> None:
    with multi_arch_library.open("rb") as f:
        ours = library_device_code(f)
    assert ours == cuobjdump_archs(multi_arch_library)
    # cuobjdump names the family-specific sm_100f cubin sm_100; so do we.
    assert ours.sass == {"80", "90a", "100"} and ours.ptx == {"90"}
    assert ours.describe() == "sm_80, sm_90a, sm_100, compute_90"


@pytest.mark.nvcc
def test_the_compiled_fixture_extension_holds_sm80(cudaext_sm80_wheel: Path) -> None:
    found = wheel_device_code(cudaext_sm80_wheel)
    [(name, code)] = found.items()
    assert name.startswith("cudaext/_C.cpython-311-") and name.endswith(".so")
    assert code.sass == {"80"}
    # Cross-check the whole library with NVIDIA's tool.
    with zipfile.ZipFile(cudaext_sm80_wheel) as zf, (
            Path(str(cudaext_sm80_wheel) + ".so")).open("wb") as out:
        out.write(zf.read(name))
    assert cuobjdump_archs(Path(str(cudaext_sm80_wheel) + ".so")) == code
    check_device_code(found, ["80"], wheel_name=cudaext_sm80_wheel.name)  # passes
    assert archs_found(found) == {name: {"sass": ["80"], "ptx": []}}


@pytest.mark.nvcc
def test_a_missing_arch_fails_with_what_was_found(cudaext_sm80_wheel: Path) -> None:
    found = wheel_device_code(cudaext_sm80_wheel)
    with pytest.raises(BuildFailed) as err:
        check_device_code(found, ["80", "90"], wheel_name="cudaext.whl")
    assert err.value.kind == FailureKind.NO_DEVICE_CODE == "no-device-code"
    assert re.fullmatch(r"cudaext\.whl misses SASS for requested archs: "
                        r"_C\.cpython-311-\S+\.so lacks sm_90 \(has sm_80\)", err.value.reason)


@pytest.mark.nvcc
def test_a_cpu_only_wheel_under_a_cuda_label_is_rejected(opsext_wheel: Path) -> None:
    found = wheel_device_code(opsext_wheel)
    assert list(found) and all(code.empty for code in found.values())
    with pytest.raises(BuildFailed) as err:
        check_device_code(found, ["80"], wheel_name=opsext_wheel.name)
    assert err.value.kind == FailureKind.NO_DEVICE_CODE
    assert err.value.reason == (f"{opsext_wheel.name} holds no GPU device code in its 2 shared "
                                "libraries (asked for sm_80): the CUDA extension was not compiled")


@pytest.mark.nvcc
def test_ptx_alone_does_not_satisfy_an_sm_request(multi_arch_library: Path,
                                                  tmp_path: Path) -> None:
    with multi_arch_library.open("rb") as f:
        code = library_device_code(f)
    found = {"pkg/k.so": code}
    check_device_code(found, ["80", "90", "90a", "100"])  # sm_90a meets a request for 90
    with pytest.raises(BuildFailed) as err:
        check_device_code(found, ["89"])
    assert "k.so lacks sm_89 (has sm_80, sm_90a, sm_100, compute_90)" in err.value.reason
    # PTX for compute_90 only, no SASS: a request for sm_90 is not met.
    ptx_only = tmp_path / "ptx.so"
    shutil.copy(multi_arch_library, ptx_only)
    subprocess.run([str(Path(host_cuda_home()) / "bin" / "nvcc"), "-shared", "-Xcompiler",
                    "-fPIC", "-o", str(ptx_only), str(multi_arch_library.with_name("k.cu")),
                    "-gencode", "arch=compute_90,code=compute_90"], check=True,
                   capture_output=True)
    with ptx_only.open("rb") as f:
        ptx_code = library_device_code(f)
    assert ptx_code == DeviceCode(frozenset(), frozenset({"90"}))
    with pytest.raises(BuildFailed, match=r"lacks sm_90 \(has compute_90\)"):
        check_device_code({"pkg/ptx.so": ptx_code}, ["90"])


def _container(entries: list[tuple[int, int, int]]) -> bytes:
    """A fat binary container as nvcc lays it out: (kind, arch, flags) entries, 8-byte payloads."""
    body = b""
    for kind, arch, flags in entries:
        header = struct.pack("<HHIQIIHHIIIQ", kind, 0x101, 64, 8, 0, 0, 8, 1, arch, 0, 0, flags)
        body += header.ljust(64, b"\0") + b"\xab" * 8
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


@pytest.mark.parametrize(("data", "sass", "ptx"), [
    (b"", set(), set()),
    (_container([(2, 80, 0x11)]), {"80"}, set()),
    (_container([(2, 90, 0x100011), (1, 90, 0x8011)]), {"90a"}, {"90"}),
    # Two containers with padding between them, as the linker concatenates translation units.
    (_container([(2, 80, 0x11)]) + b"\0" * 8 + _container([(2, 120, 0x11)]), {"80", "120"},
     set()),
    # A container cut inside its second entry's header yields the first and does not raise.
    (_container([(2, 80, 0x11), (2, 86, 0x11)])[:-40], {"80"}, set()),
    (b"\x50\xed\x55\xba" + b"\0" * 40, set(), set()),  # magic without a valid header
])
def test_parse_fatbin_layouts(data: bytes, sass: set[str], ptx: set[str]) -> None:
    assert parse_fatbin(data) == DeviceCode(frozenset(sass), frozenset(ptx))


def test_a_file_that_is_not_elf_is_refused() -> None:
    import io

    with pytest.raises(ValueError, match="not an ELF"):
        library_device_code(io.BytesIO(b"INPUT(-lfoo)\n"))
