"""Worker test helpers: the nvcc gate, the fixture extension's sdist, and a build config."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from wheelhouse.config import Config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CUDAEXT = FIXTURES / "cudaext"
FIXTURE_RECIPES = FIXTURES / "recipes"
#: Where torch 2.14.1 (CUDA 13.0) and its nvidia wheels are on local disk on the test machines.
TORCH_FIND_LINKS = os.environ.get("WHEELHOUSE_TEST_TORCH_FIND_LINKS", "/opt/pypi-more/files")


def nvcc_missing() -> str | None:
    """Why the nvcc tests can't run here, or None."""
    from worker.capabilities import discover_toolkits

    if not any(t.cuda.startswith("13.") for t in discover_toolkits()):
        return "no CUDA 13.x toolkit (nvcc) found"
    if shutil.which("uv") is None:
        return "uv is not installed"
    if not any(Path(TORCH_FIND_LINKS).glob("torch-2.14.*.whl")):
        return f"no torch 2.14 wheel in {TORCH_FIND_LINKS} (set WHEELHOUSE_TEST_TORCH_FIND_LINKS)"
    return None


#: The sandboxed real-worker tests' marks: they build against torch 2.14 from the local wheels.
SANDBOXED_BUILDS = [
    pytest.mark.sandbox,
    pytest.mark.slow,
    pytest.mark.skipif(not any(Path(TORCH_FIND_LINKS).glob("torch-2.14.*.whl")),
                       reason=f"no torch 2.14 wheel in {TORCH_FIND_LINKS}"),
]


def require_nvcc() -> None:
    """Skip with the reason, or fail where ``WHEELHOUSE_REQUIRE_NVCC=1`` makes these mandatory."""
    reason = nvcc_missing()
    if reason is None:
        return
    if os.environ.get("WHEELHOUSE_REQUIRE_NVCC") == "1":
        pytest.fail(f"nvcc tests are mandatory here (WHEELHOUSE_REQUIRE_NVCC=1), but {reason}")
    pytest.skip(reason)


def hostile_sdist(dest_dir: Path, targets: dict[str, object] | None = None) -> Path:
    """The hostile fixture as an sdist: what it should try in ``targets.json``, and the C
    extension's device code (``fatbin.h``) so that its wheel passes the device-code check."""
    src = dest_dir / "hostile-src"
    shutil.copytree(FIXTURES / "hostile", src)
    shutil.copy(FIXTURES / "cext" / "fatbin.h", src / "hostile" / "fatbin.h")
    if targets is not None:
        (src / "targets.json").write_text(json.dumps(targets))
    return make_sdist(src, dest_dir / "sdist", "hostile", "0.1.0")


def make_sdist(src: Path, dest_dir: Path, name: str, version: str) -> Path:
    """A plain sdist (``name-version/`` plus PKG-INFO) of a source tree, without running setup.py.

    The fixture's setup.py imports torch, which the test runner need not have.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"{name}-{version}.tar.gz"
    root = f"{name}-{version}"

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p in ("__pycache__", "build", "dist") or p.endswith(".egg-info") for p in parts):
            return None
        return info

    with tarfile.open(path, "w:gz") as tf:
        tf.add(src, arcname=root, filter=keep)
        pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
        info = tarfile.TarInfo(f"{root}/PKG-INFO")
        info.size = len(pkg_info)
        tf.addfile(info, io.BytesIO(pkg_info))
    return path


def build_config(tmp_path: Path, **overrides: object) -> Config:
    """Storage and workspace in tmp_path; torch from the local wheels, the rest from PyPI."""
    values: dict[str, object] = {
        "storage": str(tmp_path / "data"),
        "workspace": str(tmp_path / "work"),
        "torch_index_url": "",
        "torch_find_links": TORCH_FIND_LINKS,
        "recipe_dirs": str(FIXTURE_RECIPES),
    }
    values.update(overrides)
    return Config(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def cudaext_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sdist(CUDAEXT, tmp_path_factory.mktemp("sdist"), "cudaext", "0.1.0")


# -- compiled artifacts shared by the device-code, load-check, compile-cache and toolkit tests --

OPSEXT = FIXTURES / "opsext"


def torch_venv(dest: Path, python: str = "3.11") -> Path:
    """A fresh venv with torch 2.14.1 from the local wheels and what setup.py builds need;
    returns its interpreter."""
    import subprocess

    uv = shutil.which("uv") or "uv"
    subprocess.run([uv, "venv", "-q", "--seed", "--python", python, str(dest)], check=True)
    interpreter = dest / "bin" / "python"
    subprocess.run([uv, "pip", "install", "-q", "--python", str(interpreter),
                    "--find-links", TORCH_FIND_LINKS, "torch==2.14.1", "setuptools", "wheel",
                    "ninja"], check=True)
    return interpreter


def pip_wheel(python: Path, src: Path, out: Path, env: dict[str, str],
              wrap: Callable[[list[str]], list[str]] | None = None) -> Path:
    """``pip wheel`` of a source tree copied into ``out``'s parent (so build/ stays out of the
    repository); returns the wheel. Output goes to ``out/../build.log``. ``wrap`` puts a
    command around pip's (the compile cache's wrapper)."""
    import subprocess

    work = out.parent / f"src-{src.name}"
    shutil.copytree(src, work, ignore=shutil.ignore_patterns("build", "*.egg-info", "dist"))
    full_env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}",
                "MAX_JOBS": "2", "TORCH_NO_COMPILER_WRAPPER": "1", **env}
    log = out.parent / "build.log"
    with log.open("w") as f:
        argv = [str(python), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                "--no-index", "-w", str(out), str(work)]
        done = subprocess.run(wrap(argv) if wrap else argv, stdout=f, stderr=subprocess.STDOUT,
                              env=full_env, cwd=work, check=False)
    if done.returncode != 0:
        raise AssertionError(f"building {src.name} failed:\n{log.read_text()[-4000:]}")
    [wheel] = out.glob("*.whl")
    return wheel


def host_cuda_home() -> str:
    from worker.capabilities import discover_toolkits

    return next(t.home for t in discover_toolkits() if t.cuda.startswith("13."))


@pytest.fixture(scope="session")
def session_torch_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torch venv for the session; tests install the fixture wheels into it."""
    require_nvcc()
    return torch_venv(tmp_path_factory.mktemp("torch-venv") / "venv")


@pytest.fixture(scope="session")
def cudaext_sm80_wheel(session_torch_python: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture CUDA extension compiled once for sm_80 with the host toolkit."""
    out = tmp_path_factory.mktemp("cudaext-sm80") / "dist"
    return pip_wheel(session_torch_python, CUDAEXT, out,
                     {"CUDA_HOME": host_cuda_home(), "TORCH_CUDA_ARCH_LIST": "8.0"})


@pytest.fixture(scope="session")
def opsext_wheel(session_torch_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CPU-only torch operator library (no ``PyInit_*``, no device code)."""
    out = tmp_path_factory.mktemp("opsext") / "dist"
    return pip_wheel(session_torch_python, OPSEXT, out, {})
