"""Hermetic CUDA toolkits: from NVIDIA's wheels (13.x) or its redistributable archives (any).

A worker provisions at start the versions ``WHEELHOUSE_TOOLKIT_PROVISION`` names (:func:`prepare`)
and advertises only those it has proven: installed, and its ``nvcc --version`` answered with that
version (the proof is kept beside the toolkit, ``.wheelhouse-proof.json``). A version that can't
be provisioned is not advertised; the advert says why.

Sources, in order: NVIDIA's wheels, for CUDA 13.x only (``nvidia-cuda-nvcc-cu12`` holds only
``ptxas``, so no CUDA 12 toolkit comes from PyPI), when ``WHEELHOUSE_TOOLKIT_WHEELS`` is on; then
the redistributable archives at ``WHEELHOUSE_TOOLKIT_REDIST_URL`` (``worker.toolkits.redist``).

From the wheels, the worker installs them with uv into a directory of its own and assembles a
``CUDA_HOME`` the way ``torch.utils.cpp_extension`` expects it: ``bin/nvcc``, ``include/``
(runtime headers, CCCL under ``include/cccl`` as nvcc.profile names it, the crt headers),
``nvvm/`` (cicc, libdevice) and ``lib64/`` (``libcudart.so``, which ``-lcudart`` needs and the
wheels ship only as ``libcudart.so.13``). Files are hard-linked from the installed wheels, not
symlinked: nvcc finds cicc and its headers relative to its own resolved path (nvcc.profile's
``$(_HERE_)/..``), so it must live inside the assembled tree.

Wheel names: CUDA 13.x publishes ``nvidia-cuda-nvcc``, ``-runtime``, ``-cccl``, ``-crt`` and
``nvidia-nvvm`` (one ``nvidia/cu13/`` tree); 12.x publishes ``nvidia-cuda-nvcc-cu12`` and
siblings, but the nvcc one holds no ``nvcc``, so 12.x never comes from wheels. Every wheel is
pinned to the same major.minor, since nvcc's own requirements name its siblings without a version;
except CCCL (header-only), which PyPI stops publishing per toolkit release (13.3 is the newest for
13.4 and 13.5), so it is the newest of the same major not newer than the toolkit.

Toolkits are kept under ``<root>/cuda-<major.minor>`` and reused by later builds; a toolkit is
assembled in a private directory and renamed into place, so concurrent workers on one host never
see half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.config import Config
from wheelhouse.errors import InfrastructureError
from wheelhouse.variants import KNOWN_CUDA, normalize_cuda
from worker.capabilities import machine, nvcc_version
from worker.errors import ToolkitUnavailable
from worker.toolkits import redist

#: Wheels per CUDA major version; each gets ``==<major>.<minor>.*`` (CCCL: see the docstring).
#: Only majors whose wheels hold a working nvcc are listed.
TOOLKIT_WHEELS: dict[int, tuple[str, ...]] = {
    13: ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-crt",
         "nvidia-nvvm"),
}
#: The parts of each ``nvidia/<package>/`` tree that make up a CUDA_HOME.
_PARTS = ("bin", "include", "lib", "nvvm")
PROOF = ".wheelhouse-proof.json"


class ToolkitError(ToolkitUnavailable):
    """The toolkit's wheels could not be installed or do not form a working toolkit."""


def toolkit_root(config: Config) -> Path:
    """Where provisioned toolkits are kept: ``<workspace>/toolkits/cuda-<major.minor>``."""
    return Path(config.workspace).resolve() / "toolkits"


def wanted_versions(setting: str) -> tuple[str, ...]:
    """The CUDA versions ``WHEELHOUSE_TOOLKIT_PROVISION`` names; ``auto``: the newest known
    minor of CUDA 12 and 13 (one toolkit serves every older minor of its major)."""
    words = setting.replace(",", " ").split()
    out: list[str] = []
    for word in words:
        if word == "auto":
            for major in ("12", "13"):
                out.append([v for v in KNOWN_CUDA if v.split(".")[0] == major][-1])
        else:
            out.append(normalize_cuda(word))
    return tuple(dict.fromkeys(out))


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
        raise ToolkitError(f"NVIDIA publishes no working CUDA {major}.x toolkit wheels")
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


@dataclass(frozen=True)
class Sources:
    """Where toolkits come from: NVIDIA's wheels (13.x) and/or its redistributable archives."""

    uv: str = "uv"
    index_url: str = "https://pypi.org/simple"
    find_links: Sequence[str] = ()
    wheels: bool = True
    redist_url: str = ""
    env: Mapping[str, str] | None = None
    timeout: float = 1800.0

    @classmethod
    def from_config(cls, config: Config, *, uv: str,
                    env: Mapping[str, str] | None = None) -> Sources:
        return cls(uv=uv, index_url=config.build_index_url, wheels=config.toolkit_wheels,
                   redist_url=config.toolkit_redist_url, env=env)

    def for_major(self, major: int) -> list[str]:
        """The source names that may give a CUDA ``major`` toolkit, in the order tried."""
        names = ["wheels"] if self.wheels and major in TOOLKIT_WHEELS else []
        return names + (["redist"] if self.redist_url else [])


def provision(cuda: str, root: Path, *, uv: str = "uv", index_url: str = "https://pypi.org/simple",
              find_links: Sequence[str] = (), env: Mapping[str, str] | None = None,
              timeout: float = 1800.0, sources: Sources | None = None,
              say: Callable[[str], None] | None = None) -> ToolkitInfo:
    """The toolkit for CUDA ``major.minor`` under ``root``: reused if there, else installed.

    Raises :class:`ToolkitUnavailable` with one line when no source gives a toolkit whose nvcc
    answers with that version, :class:`InfrastructureError` when a source's host did not answer.
    """
    src = sources or Sources(uv=uv, index_url=index_url, find_links=find_links, env=env,
                             timeout=timeout)
    major, minor = _major_minor(cuda)
    wanted = f"{major}.{minor}"
    home = root / f"cuda-{wanted}"
    if (home / "bin" / "nvcc").is_file():
        return _verified(home, wanted)
    names = src.for_major(major)
    if not names:
        hint = ("set WHEELHOUSE_TOOLKIT_REDIST_URL" if major not in TOOLKIT_WHEELS
                else "set WHEELHOUSE_TOOLKIT_WHEELS or WHEELHOUSE_TOOLKIT_REDIST_URL")
        raise ToolkitUnavailable(f"no source is configured for a CUDA {wanted} toolkit ({hint})")
    root.mkdir(parents=True, exist_ok=True)
    failures: list[ToolkitUnavailable] = []
    for name in names:
        staging = root / f".staging-{wanted}-{uuid.uuid4().hex[:8]}"
        try:
            if name == "wheels":
                origin = _from_wheels(wanted, staging, src)
            else:
                origin = redist.install(wanted, staging / "home", base_url=src.redist_url,
                                        machine=machine(), scratch=staging / "download", say=say)
            info = _verified(staging / "home", wanted)
            _write_proof(staging / "home", info, name, origin)
            try:
                (staging / "home").rename(home)
            except OSError:
                if not (home / "bin" / "nvcc").is_file():  # not a lost race: a real failure
                    raise
            return _verified(home, wanted)
        except ToolkitUnavailable as exc:
            failures.append(exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if len(failures) == 1:
        raise failures[0]
    raise ToolkitUnavailable("; ".join(str(f) for f in failures))


def _from_wheels(wanted: str, staging: Path, src: Sources) -> str:
    argv = [src.uv, "pip", "install", "--quiet", "--target", str(staging / "wheels"),
            "--index-url", src.index_url]
    for link in src.find_links:
        argv += ["--find-links", link]
    try:
        out = subprocess.run([*argv, *requirements(wanted)], capture_output=True, text=True,
                             env=dict(src.env) if src.env is not None else None,
                             timeout=src.timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfrastructureError(f"installing the CUDA {wanted} wheels: {exc}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [""])[-1]
        message = f"installing the CUDA {wanted} wheels failed: {last[:300]}"
        if "No solution found" in out.stderr or "not found in the package registry" in out.stderr \
                or "unsatisfiable" in out.stderr:
            raise ToolkitError(message)
        raise InfrastructureError(f"{message} (index {src.index_url})")
    assemble(staging / "wheels", staging / "home")
    return src.index_url


def _write_proof(home: Path, info: ToolkitInfo, source: str, origin: str) -> None:
    proof = {"cuda": info.cuda, "release": info.release, "source": source, "origin": origin,
             "proved_at": time.time()}
    (home / PROOF).write_text(json.dumps(proof, sort_keys=True) + "\n")


def proof(home: Path) -> dict[str, object] | None:
    """What :func:`provision` recorded when it proved the toolkit in ``home``."""
    try:
        data = json.loads((home / PROOF).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _verified(home: Path, wanted: str) -> ToolkitInfo:
    nvcc = home / "bin" / "nvcc"
    version = nvcc_version(nvcc)
    if version is None:
        raise ToolkitUnavailable(f"{nvcc} does not answer --version")
    mm, full = version
    if mm != wanted:
        raise ToolkitUnavailable(f"{nvcc} is CUDA {mm}, not {wanted}")
    if not (home / "include" / "cuda_runtime.h").is_file():
        raise ToolkitUnavailable(f"{home} lacks include/cuda_runtime.h")
    return ToolkitInfo(cuda=mm, home=str(home), nvcc=str(nvcc), release=full)


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` provisioned, and why each other version it tried is not offered."""

    provisioned: tuple[ToolkitInfo, ...] = ()
    unavailable: dict[str, str] = field(default_factory=dict)


def prepare(versions: Iterable[str], host: Iterable[ToolkitInfo], root: Path,
            sources: Sources, *, say: Callable[[str], None] | None = None) -> Prepared:
    """Provision (or find proven) each of ``versions`` that no host toolkit has exactly."""
    have = {t.cuda for t in host}
    done: list[ToolkitInfo] = []
    unavailable: dict[str, str] = {}
    for cuda in versions:
        if cuda in have:
            continue
        try:
            done.append(provision(cuda, root, sources=sources, say=say))
        except (ToolkitUnavailable, InfrastructureError) as exc:
            unavailable[cuda] = str(exc)
            if say is not None:
                say(f"CUDA {cuda} is not offered: {exc}")
    return Prepared(provisioned=tuple(done), unavailable=unavailable)
