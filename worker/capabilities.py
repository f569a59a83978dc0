"""What this host can build: CUDA toolkits, CPU architecture, cores, memory, GPUs.

Toolkits are found in ``CUDA_HOME``/``CUDA_PATH``, versioned folders (``/usr/local/cuda-13.0``),
``/usr/local/cuda``, and ``nvcc`` on ``PATH``; each candidate is asked ``nvcc --version``, so a
folder name never decides the version. ``nvcc`` on PATH may be a wrapper script; its home is
only trusted when it holds the CUDA headers.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from wheelhouse.builds.fleet import GpuInfo, ToolkitInfo, WorkerAd, queues_for
from wheelhouse.builds.spec import normalize_machine
from wheelhouse.errors import InvalidBuildSpec

_RELEASE = re.compile(r"release (?P<mm>[0-9]+\.[0-9]+), (?P<full>V[0-9.]+)")
DEFAULT_ROOTS = (Path("/usr/local"), Path("/opt"))


def nvcc_version(nvcc: Path, timeout: float = 20.0) -> tuple[str, str] | None:
    """(``13.0``, ``V13.0.88``) from ``nvcc --version``, or None if it doesn't answer."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _RELEASE.search(out.stdout)
    if out.returncode != 0 or m is None:
        return None
    return m.group("mm"), m.group("full")


def _has_headers(home: Path) -> bool:
    return (home / "include" / "cuda_runtime.h").is_file() or any(
        home.glob("targets/*/include/cuda_runtime.h"))


def _candidates(environ: Mapping[str, str], roots: Iterable[Path]) -> list[Path]:
    homes: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(var):
            homes.append(Path(environ[var]))
    for root in roots:
        if root.is_dir():
            homes.extend(sorted(root.glob("cuda-*")))
            homes.append(root / "cuda")
    on_path = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if on_path:
        real = Path(on_path).resolve()
        homes.append(real.parent.parent)
    return homes


def discover_toolkits(
    environ: Mapping[str, str] | None = None, roots: Iterable[Path] = DEFAULT_ROOTS
) -> list[ToolkitInfo]:
    """Every distinct, working CUDA toolkit, newest first."""
    env = os.environ if environ is None else environ
    seen: set[Path] = set()
    found: dict[tuple[str, str], ToolkitInfo] = {}
    for home in _candidates(env, roots):
        nvcc = home / "bin" / "nvcc"
        if not nvcc.is_file() or not _has_headers(home):
            continue
        real_home = home.resolve()
        if real_home in seen:
            continue
        seen.add(real_home)
        version = nvcc_version(nvcc)
        if version is None:
            continue
        mm, full = version
        # One entry per release: /usr/local/cuda and /usr/local/cuda-13.0 are the same toolkit.
        found.setdefault((mm, full), ToolkitInfo(cuda=mm, home=str(real_home),
                                                 nvcc=str(real_home / "bin" / "nvcc"),
                                                 release=full))
    return sorted(found.values(), key=lambda t: tuple(int(p) for p in t.cuda.split(".")),
                  reverse=True)


def discover_gpus(timeout: float = 20.0) -> list[GpuInfo]:
    """GPUs from ``nvidia-smi``, if it exists and answers; none otherwise."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return parse_nvidia_smi(out.stdout)


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    gpus = []
    for line in text.splitlines():
        name, _, cap = line.rpartition(",")
        cap = cap.strip()
        if name and re.fullmatch(r"[0-9]+\.[0-9]+", cap):
            gpus.append(GpuInfo(name=name.strip(), arch=cap.replace(".", "")))
    return gpus


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine() -> str:
    try:
        return normalize_machine(platform.machine())
    except InvalidBuildSpec:
        return platform.machine()


@dataclass(frozen=True)
class Capabilities:
    machine: str
    cores: int
    memory_bytes: int
    toolkits: tuple[ToolkitInfo, ...]
    gpus: tuple[GpuInfo, ...]
    provisionable: tuple[str, ...] = ()
    """CUDA versions whose toolkit this worker provisioned and proved
    (``worker.toolkits.provision``)."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """CUDA versions it was told to provision and could not, with why."""

    @property
    def queues(self) -> tuple[str, ...]:
        return queues_for([t.cuda for t in self.toolkits], self.machine, self.provisionable)

    def advert(self, name: str, *, started_at: float) -> WorkerAd:
        return WorkerAd(
            name=name, hostname=socket.gethostname(), machine=self.machine, cores=self.cores,
            memory_bytes=self.memory_bytes, toolkits=self.toolkits, gpus=self.gpus,
            queues=self.queues, started_at=started_at, provisionable=self.provisionable,
            unavailable=dict(self.unavailable),
        )


def discover(
    environ: Mapping[str, str] | None = None, roots: Iterable[Path] = DEFAULT_ROOTS,
    provisionable: Iterable[str] = (), unavailable: Mapping[str, str] | None = None,
) -> Capabilities:
    """What this host can build; ``roots`` should include where provisioned toolkits are kept,
    ``provisionable`` the versions provisioned and proved there
    (``worker.toolkits.provision.prepare``),
    ``unavailable`` those that could not be, with why."""
    return Capabilities(
        machine=machine(),
        cores=usable_cores(),
        memory_bytes=int(psutil.virtual_memory().total),
        toolkits=tuple(discover_toolkits(environ, roots)),
        gpus=tuple(discover_gpus()),
        provisionable=tuple(provisionable),
        unavailable=dict(unavailable or {}),
    )
