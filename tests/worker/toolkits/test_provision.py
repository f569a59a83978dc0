"""Hermetic CUDA toolkits from NVIDIA's wheels, proven by compiling the fixture extension."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.worker.conftest import CUDAEXT, pip_wheel
from worker.capabilities import discover_toolkits
from worker.devicecode import wheel_device_code
from worker.toolkits.provision import ToolkitError, provision, requirements

#: The wheels come from the machine's local mirror where there is one, else from PyPI.
INDEX = os.environ.get("WHEELHOUSE_TEST_TOOLKIT_INDEX") or (
    "file:///opt/pypi/simple" if Path("/opt/pypi/simple/nvidia-cuda-nvcc").is_dir()
    else "https://pypi.org/simple")


@pytest.mark.parametrize(("cuda", "wanted"), [
    ("13.0", ["nvidia-cuda-nvcc==13.0.*", "nvidia-cuda-runtime==13.0.*",
              "nvidia-cuda-cccl>=13.0,<13.1", "nvidia-cuda-crt==13.0.*", "nvidia-nvvm==13.0.*"]),
    ("13.5", ["nvidia-cuda-nvcc==13.5.*", "nvidia-cuda-runtime==13.5.*",
              "nvidia-cuda-cccl>=13.0,<13.6", "nvidia-cuda-crt==13.5.*", "nvidia-nvvm==13.5.*"]),
])
def test_requirements_pin_the_minor_and_cap_cccl(cuda: str, wanted: list[str]) -> None:
    assert requirements(cuda) == wanted


# 12.x: nvidia-cuda-nvcc-cu12 holds only ptxas, so no CUDA 12 toolkit comes from wheels.
@pytest.mark.parametrize("cuda", ["11.8", "12.8", "13", "x.y"])
def test_unknown_versions_are_refused(cuda: str) -> None:
    with pytest.raises(ToolkitError):
        requirements(cuda)


def test_a_version_that_does_not_exist_fails_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ToolkitError, match=r"^installing the CUDA 13\.99 wheels failed: "):
        provision("13.99", tmp_path, uv=shutil.which("uv") or "uv", index_url=INDEX)
    assert list(tmp_path.iterdir()) == []  # nothing half-made left behind


@pytest.mark.nvcc
@pytest.mark.slow
def test_the_fixture_extension_compiles_with_a_provisioned_toolkit(
        session_torch_python: Path, tmp_path: Path) -> None:
    root = tmp_path / "toolkits"
    toolkit = provision("13.0", root, uv=shutil.which("uv") or "uv", index_url=INDEX)
    home = Path(toolkit.home)
    assert home == root / "cuda-13.0" and toolkit.release.startswith("V13.0.")
    assert (home / "lib64" / "libcudart.so").exists() and (home / "include" / "cccl").is_dir()
    assert provision("13.0", root, uv="/nonexistent/uv", index_url=INDEX) == toolkit  # reused
    # The worker's discovery recognises it as a toolkit like any other.
    assert discover_toolkits({"CUDA_HOME": str(home), "PATH": ""}, roots=[]) == [toolkit]

    # Compile with it, with the host toolkit out of reach: no /usr/local/cuda, no nvcc on PATH.
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "nvcc").exists())
    wheel = pip_wheel(session_torch_python, CUDAEXT, tmp_path / "dist",
                      {"CUDA_HOME": str(home), "PATH": f"{session_torch_python.parent}"
                       f"{os.pathsep}{path}", "TORCH_CUDA_ARCH_LIST": "8.0"})
    log = (tmp_path / "build.log").read_text()
    assert f"{home}/bin/nvcc" in log and "/usr/local/cuda" not in log
    [code] = wheel_device_code(wheel).values()
    assert code.sass == {"80"}
    # And the result loads.
    subprocess.run([shutil.which("uv") or "uv", "pip", "install", "-q", "--python",
                    str(session_torch_python), "--no-deps", "--reinstall", str(wheel)],
                   check=True)
    done = subprocess.run([str(session_torch_python), "-I", "-c",
                           "import cudaext; print(cudaext.kernels)"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0 and "add" in done.stdout, done.stderr
