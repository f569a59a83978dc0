"""Hermetic CUDA toolkits: nvcc, the runtime headers and CCCL from NVIDIA's wheels.

When no host toolkit matches torch's CUDA major.minor, the worker installs the toolkit's wheels
with uv into a directory of its own and assembles a ``CUDA_HOME`` the way
``torch.utils.cpp_extension`` expects it: ``bin/nvcc``, ``include/`` (runtime headers, CCCL under
``include/cccl`` as nvcc.profile names it, the crt headers), ``nvvm/`` (cicc, libdevice) and
``lib64/`` (``libcudart.so``, which ``-lcudart`` needs and the wheels ship only as
``libcudart.so.13``). Files are hard-linked from the installed wheels, not symlinked: nvcc finds
cicc and its headers relative to its own resolved path (nvcc.profile's ``$(_HERE_)/..``), so it
must live inside the assembled tree.

Wheel names: CUDA 13.x publishes ``nvidia-cuda-nvcc``, ``-runtime``, ``-cccl``, ``-crt`` and
``nvidia-nvvm`` (one ``nvidia/cu13/`` tree); 12.x publishes ``nvidia-cuda-nvcc-cu12``,
``nvidia-cuda-runtime-cu12`` and ``nvidia-cuda-cccl-cu12`` (``nvidia/cuda_nvcc/``,
``nvidia/cuda_runtime/``, ``nvidia/cuda_cccl/``, merged here). Every wheel is pinned to the same
major.minor, since nvcc's own requirements name its siblings without a version; except CCCL
(header-only), which PyPI stops publishing per toolkit release (13.3 is the newest for 13.4 and
13.5), so it is the newest of the same major not newer than the toolkit.

Toolkits are kept under ``<root>/cuda-<major.minor>`` and reused by later builds; a toolkit is
assembled in a private directory and renamed into place, so concurrent workers on one host never
see half of one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from wheelhouse.config import Config
from wheelhouse.fleet import ToolkitInfo
from wheelhouse.variants import KNOWN_CUDA
from worker.capabilities import nvcc_version

#: Wheels per CUDA major version; each gets ``==<major>.<minor>.*`` (CCCL: see the docstring).
TOOLKIT_WHEELS: dict[int, tuple[str, ...]] = {
    13: ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-crt",
         "nvidia-nvvm"),
    12: ("nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12"),
}
#: The parts of each ``nvidia/<package>/`` tree that make up a CUDA_HOME.
_PARTS = ("bin", "include", "lib", "nvvm")


class ToolkitError(RuntimeError):
    """The toolkit's wheels could not be installed or do not form a working toolkit."""


def toolkit_root(config: Config) -> Path:
    """Where provisioned toolkits are kept: ``<workspace>/toolkits/cuda-<major.minor>``."""
    return Path(config.workspace).resolve() / "toolkits"


def provisionable_cuda() -> tuple[str, ...]:
    """The known CUDA versions whose toolkit NVIDIA publishes as wheels (12.x and 13.x)."""
    return tuple(v for v in KNOWN_CUDA if int(v.split(".")[0]) in TOOLKIT_WHEELS)


def _major_minor(cuda: str) -> tuple[int, int]:
    major, _, minor = cuda.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ToolkitError(f"CUDA version {cuda!r} is not major.minor")
    return int(major), int(minor)


def requirements(cuda: str) -> list[str]:
    """The pinned wheel requirements for CUDA ``major.minor``."""
    major, minor = _major_minor(cuda)
    names = TOOLKIT_WHEELS.get(major)
    if names is None:
        raise ToolkitError(f"no toolkit wheels are known for CUDA {major}.x")
    return [f"{name}>={major}.0,<{major}.{minor + 1}" if "-cccl" in name
            else f"{name}=={major}.{minor}.*" for name in names]


def _link_tree(src: Path, dest: Path) -> None:
    """Hard-link every file of ``src`` into ``dest`` (merging directories); symlinks are kept."""
    for path in sorted(src.rglob("*")):
        target = dest / path.relative_to(src)
        if path.is_symlink():
            if not target.exists() and not target.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(os.readlink(path))
        elif path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:  # another filesystem: copy instead
                shutil.copy2(path, target)


def assemble(installed: Path, home: Path) -> None:
    """A CUDA_HOME in ``home`` from the ``nvidia/*/`` trees of a ``--target`` install."""
    trees = sorted(p for p in (installed / "nvidia").glob("*") if p.is_dir())
    for tree in trees:
        for part in _PARTS:
            if (tree / part).is_dir():
                _link_tree(tree / part, home / part)
    lib = home / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    # The linker looks for the unversioned name; the wheels carry only the SONAME.
    for versioned in sorted(lib.glob("lib*.so.*")):
        plain = lib / (versioned.name.split(".so.", 1)[0] + ".so")
        if not plain.exists():
            plain.symlink_to(versioned.name)
    (home / "lib64").symlink_to("lib")


def provision(cuda: str, root: Path, *, uv: str, index_url: str,
              find_links: Sequence[str] = (), env: Mapping[str, str] | None = None,
              timeout: float = 1800.0) -> ToolkitInfo:
    """The toolkit for CUDA ``major.minor`` under ``root``: reused if there, else installed.

    ``env`` is the installer's environment (proxies, uv's cache); raises :class:`ToolkitError`
    with one line when the wheels don't install or nvcc doesn't answer with that version.
    """
    major, minor = _major_minor(cuda)
    wanted = f"{major}.{minor}"
    home = root / f"cuda-{wanted}"
    if (home / "bin" / "nvcc").is_file():
        return _verified(home, wanted)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{wanted}-{uuid.uuid4().hex[:8]}"
    try:
        argv = [uv, "pip", "install", "--quiet", "--target", str(staging / "wheels"),
                "--index-url", index_url]
        for link in find_links:
            argv += ["--find-links", link]
        try:
            out = subprocess.run([*argv, *requirements(cuda)], capture_output=True, text=True,
                                 env=dict(env) if env is not None else None, timeout=timeout,
                                 check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ToolkitError(f"installing the CUDA {wanted} wheels: {exc}") from None
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or [""])[-1]
            raise ToolkitError(f"installing the CUDA {wanted} wheels failed: {last[:300]}")
        assemble(staging / "wheels", staging / "home")
        _verified(staging / "home", wanted)
        try:
            (staging / "home").rename(home)
        except OSError:
            if not (home / "bin" / "nvcc").is_file():  # not a lost race: a real failure
                raise
        return _verified(home, wanted)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _verified(home: Path, wanted: str) -> ToolkitInfo:
    nvcc = home / "bin" / "nvcc"
    version = nvcc_version(nvcc)
    if version is None:
        raise ToolkitError(f"{nvcc} does not answer --version")
    mm, full = version
    if mm != wanted:
        raise ToolkitError(f"{nvcc} is CUDA {mm}, not {wanted}")
    if not (home / "include" / "cuda_runtime.h").is_file():
        raise ToolkitError(f"{home} lacks include/cuda_runtime.h")
    return ToolkitInfo(cuda=mm, home=str(home), nvcc=str(nvcc), release=full)
