"""CUDA toolkits from NVIDIA's redistributable archives, for any CUDA release (12.x included).

NVIDIA publishes every CUDA release as per-component archives under ``compute/cuda/redist/``
with a manifest ``redistrib_<major.minor.patch>.json`` that names, per component and platform,
the archive's ``relative_path``, ``sha256`` and ``size`` (what JAX's and XLA's hermetic CUDA
builds use). A toolkit here is the components torch's ``cpp_extension`` needs: nvcc (with crt
and nvvm, separate components from 13.0), the runtime, CCCL, and the headers of the libraries
torch's own headers include (cuBLAS, cuSPARSE, cuSOLVER, cuRAND). Of those libraries only
``include/`` is unpacked: an extension links against torch, not against them.

The base URL is ``WHEELHOUSE_TOOLKIT_REDIST_URL``: NVIDIA's by default, a local mirror (any
HTTP server or a ``file://`` directory with the same layout) for fleets without the internet.
Every archive is checked against the manifest's sha256 before it is opened, and unpacked member
by member: no absolute paths, no ``..``, no link that points out of the toolkit, no devices.

Errors: what another attempt would answer the same (no manifest for the version, a component
missing, a checksum mismatch, an unsafe archive) is :class:`ToolkitUnavailable`; a host that
does not answer or times out is :class:`InfrastructureError`. Both name the URL.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from wheelhouse.errors import InfrastructureError
from worker.errors import ToolkitUnavailable

DEFAULT_REDIST_URL = "https://developer.download.nvidia.com/compute/cuda/redist/"
#: NVIDIA's platform names, by ``platform.machine()`` as wheelhouse normalizes it.
PLATFORMS = {"x86_64": "linux-x86_64", "aarch64": "linux-sbsa"}
#: Components every toolkit needs, whole.
TOOL_COMPONENTS = ("cuda_nvcc", "cuda_cudart", "cuda_cccl")
#: From CUDA 13.0, the crt headers and nvvm (cicc, libdevice) are components of their own.
TOOL_COMPONENTS_13 = ("cuda_crt", "libnvvm")
#: Libraries whose headers torch's headers include (``ATen/cuda/CUDAContextLight.h``); only
#: their ``include/`` is unpacked.
HEADER_COMPONENTS = ("libcublas", "libcusparse", "libcusolver", "libcurand")
_MANIFEST_NAME = re.compile(r"redistrib_(?P<v>[0-9]+\.[0-9]+\.[0-9]+)\.json")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Archive:
    """One component's archive as the manifest describes it."""

    component: str
    url: str
    sha256: str
    size: int
    headers_only: bool = False


def components(major: int) -> tuple[str, ...]:
    """The manifest components a CUDA ``major`` toolkit is made of."""
    tools = TOOL_COMPONENTS + (TOOL_COMPONENTS_13 if major >= 13 else ())
    return tools + HEADER_COMPONENTS


def _fetch(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (configured)
            data: bytes = response.read()
            return data
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in (404, 403, 410):
            raise FileNotFoundError(url) from None
        raise InfrastructureError(f"{url} answered HTTP {exc.code} "
                                  "(WHEELHOUSE_TOOLKIT_REDIST_URL)") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, FileNotFoundError):  # a file:// mirror without the file
            raise FileNotFoundError(url) from None
        raise InfrastructureError(f"{_host(url)} did not answer ({exc.reason}) "
                                  "(WHEELHOUSE_TOOLKIT_REDIST_URL)") from None
    except (TimeoutError, OSError) as exc:
        raise InfrastructureError(f"{_host(url)} did not answer ({exc}) "
                                  "(WHEELHOUSE_TOOLKIT_REDIST_URL)") from None


def _host(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.netloc or url


def _base(base_url: str) -> str:
    return base_url if base_url.endswith("/") else base_url + "/"


def find_manifest(base_url: str, cuda: str, *, timeout: float = 30.0) -> tuple[str, dict[str, Any]]:
    """(URL, parsed manifest) of the newest ``redistrib_<cuda>.<patch>.json`` under ``base_url``.

    The directory listing names the manifests (NVIDIA's and ``python -m http.server``'s both do);
    without a listing, ``<cuda>.0`` is tried.
    """
    base = _base(base_url)
    patches: list[tuple[int, str]] = []
    parts = urllib.parse.urlsplit(base)
    if parts.scheme == "file":  # a directory: its names are the listing
        folder = Path(urllib.parse.unquote(parts.path))
        listing = " ".join(sorted(p.name for p in folder.iterdir())) if folder.is_dir() else ""
    else:
        try:
            listing = _fetch(base, timeout).decode("utf-8", "replace")
        except FileNotFoundError:
            listing = ""
    for m in _MANIFEST_NAME.finditer(listing):
        version = m.group("v")
        if version.rsplit(".", 1)[0] == cuda:
            patches.append((int(version.rsplit(".", 1)[1]), m.group(0)))
    names = [name for _, name in sorted(set(patches), reverse=True)] or [f"redistrib_{cuda}.0.json"]
    url = base + names[0]
    try:
        raw = _fetch(url, timeout)
    except FileNotFoundError:
        raise ToolkitUnavailable(f"no CUDA {cuda} release at {base} (no {names[0]}; "
                                 "WHEELHOUSE_TOOLKIT_REDIST_URL)") from None
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise ToolkitUnavailable(f"{url} is not a JSON manifest") from None
    if not isinstance(manifest, dict):
        raise ToolkitUnavailable(f"{url} is not a JSON manifest")
    return url, manifest


def archives(manifest: dict[str, Any], manifest_url: str, major: int,
             machine: str) -> list[Archive]:
    """The archives of a CUDA ``major`` toolkit for ``machine``; refuses if any is missing."""
    platform = PLATFORMS.get(machine)
    if platform is None:
        raise ToolkitUnavailable(f"NVIDIA publishes no toolkit archives for {machine}")
    base = manifest_url.rsplit("/", 1)[0] + "/"
    found: list[Archive] = []
    missing: list[str] = []
    for name in components(major):
        entry = manifest.get(name, {}).get(platform) if isinstance(manifest.get(name), dict) \
            else None
        if not isinstance(entry, dict) or not {"relative_path", "sha256"} <= entry.keys():
            missing.append(name)
            continue
        rel = PurePosixPath(str(entry["relative_path"]))
        if rel.is_absolute() or ".." in rel.parts:
            raise ToolkitUnavailable(f"{manifest_url}: {name} points outside the mirror ({rel})")
        try:
            size = int(entry.get("size", 0))
        except (TypeError, ValueError):
            size = 0
        found.append(Archive(component=name, url=base + str(rel), sha256=str(entry["sha256"]),
                             size=size, headers_only=name in HEADER_COMPONENTS))
    if missing:
        raise ToolkitUnavailable(f"{manifest_url} lacks {', '.join(missing)} for {platform}")
    return found


def download(archive: Archive, dest: Path, *, timeout: float = 60.0) -> Path:
    """``archive`` into ``dest``, its sha256 checked against the manifest's while it streams."""
    path = dest / archive.url.rsplit("/", 1)[-1]
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(archive.url, timeout=timeout) as response, \
                path.open("wb") as out:  # noqa: S310 (configured)
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code in (404, 403, 410):
            raise ToolkitUnavailable(f"{archive.url} is missing (HTTP {exc.code}) though the "
                                     "manifest names it") from None
        raise InfrastructureError(f"{archive.url} answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, FileNotFoundError):
            raise ToolkitUnavailable(f"{archive.url} is missing though the manifest names it") \
                from None
        raise InfrastructureError(f"{_host(archive.url)} did not answer ({exc.reason})") from None
    except (TimeoutError, OSError) as exc:
        raise InfrastructureError(f"downloading {archive.url}: {exc}") from None
    if digest.hexdigest() != archive.sha256.lower():
        path.unlink(missing_ok=True)
        raise ToolkitUnavailable(f"{archive.url} does not match the manifest's sha256 "
                                 f"({digest.hexdigest()[:16]}…, expected {archive.sha256[:16]}…)")
    return path


def _inside(root: Path, path: Path) -> bool:
    return path == root or root in path.parents


def unpack(path: Path, home: Path, *, headers_only: bool = False) -> None:
    """Merge an archive's top directory into ``home``, refusing anything unsafe in it."""
    root = home.resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(path, "r:*") as tar:
            members = []
            for member in tar.getmembers():
                parts = PurePosixPath(member.name).parts
                if member.name.startswith("/") or ".." in parts:
                    raise ToolkitUnavailable(f"{path.name}: unsafe member {member.name!r}")
                rel = PurePosixPath(*parts[1:]) if len(parts) > 1 else None
                if rel is None or (headers_only and rel.parts[0] != "include"):
                    continue
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    raise ToolkitUnavailable(f"{path.name}: {member.name!r} is not a file")
                target = root / rel
                if member.issym():
                    pointed = (target.parent / member.linkname).resolve()
                    if member.linkname.startswith("/") or not _inside(root, pointed):
                        raise ToolkitUnavailable(
                            f"{path.name}: link {member.name!r} points out of the toolkit")
                if member.islnk():
                    lparts = PurePosixPath(member.linkname).parts
                    if member.linkname.startswith("/") or ".." in lparts or len(lparts) < 2:
                        raise ToolkitUnavailable(
                            f"{path.name}: link {member.name!r} points out of the toolkit")
                    member = member.replace(linkname=str(PurePosixPath(*lparts[1:])),
                                            deep=False)
                members.append(member.replace(name=str(rel), deep=False))
            # The data filter checks again (no escapes, no devices, sane modes).
            tar.extractall(root, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        if isinstance(exc, tarfile.FilterError):
            raise ToolkitUnavailable(f"{path.name}: unsafe archive: {exc}") from None
        raise ToolkitUnavailable(f"{path.name} is not a readable archive: {exc}") from None


def install(cuda: str, home: Path, *, base_url: str, machine: str, scratch: Path,
            timeout: float = 60.0, say: Callable[[str], None] | None = None) -> str:
    """Assemble CUDA ``cuda``'s toolkit in ``home`` from the archives at ``base_url``;
    returns the manifest's URL (for the proof)."""
    major = int(cuda.split(".")[0])
    url, manifest = find_manifest(base_url, cuda, timeout=timeout)
    wanted = archives(manifest, url, major, machine)
    scratch.mkdir(parents=True, exist_ok=True)
    for archive in wanted:
        if say is not None:
            say(f"fetching {archive.component} ({archive.size / 1024**2:.0f} MiB) from "
                f"{_host(archive.url) or 'the mirror'}")
        path = download(archive, scratch, timeout=timeout)
        unpack(path, home, headers_only=archive.headers_only)
        path.unlink()
    lib = home / "lib"
    if not (home / "lib64").exists() and lib.is_dir():
        (home / "lib64").symlink_to("lib")
    shutil.rmtree(scratch, ignore_errors=True)
    return url
