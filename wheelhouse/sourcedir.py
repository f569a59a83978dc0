"""A project directory as an sdist: ``wheelhouse build DIR`` and ``wheelhouse request DIR``.

The directory is packed as it is, without running any of its code (its build backend runs only
in the build's sandbox, from the sdist): name and version come from static metadata, its
``PKG-INFO`` (a directory that is an unpacked sdist, like ``examples/vecadd-0.1.0``) or the
``[project]`` table of its ``pyproject.toml``. A version the backend computes (``dynamic``)
can't be read without running it: the error says to make the sdist with ``python -m build
--sdist``. The archive is deterministic (sorted members, fixed times and owners), so the same
tree gives the same sha256 and a second request of it is the same build.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
import tomllib
from email.parser import BytesParser
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from wheelhouse.errors import InvalidBuildSpec

#: What a project directory holds that is no part of its source.
SKIPPED = frozenset({".git", ".hg", ".svn", ".venv", "venv", "__pycache__", "build", "dist",
                     ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
#: The time every member is dated (reproducible archives; 1980, as zip's earliest).
EPOCH = 315532800


def static_name_version(directory: Path) -> tuple[str, Version]:
    """The project's name and version from its static metadata; :class:`InvalidBuildSpec`
    saying what to do where there is none."""
    pkg_info = directory / "PKG-INFO"
    if pkg_info.is_file():
        headers = BytesParser().parsebytes(pkg_info.read_bytes(), headersonly=True)
        name, version = headers.get("Name"), headers.get("Version")
        if name and version:
            return str(name), _version(str(version), pkg_info)
    pyproject = directory / "pyproject.toml"
    if pyproject.is_file():
        try:
            table = tomllib.loads(pyproject.read_text()).get("project", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InvalidBuildSpec(f"{pyproject}: {exc}") from None
        name, version = table.get("name"), table.get("version")
        if isinstance(name, str) and isinstance(version, str):
            return name, _version(version, pyproject)
    raise InvalidBuildSpec(
        f"{directory} has no static name and version (a PKG-INFO, or [project] name and version "
        "in pyproject.toml): make its sdist with `python -m build --sdist` and build that")


def _version(text: str, where: Path) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise InvalidBuildSpec(f"{where}: version {text[:40]!r} is not a valid version") from None


def pack_directory(directory: Path, dest_dir: Path) -> Path:
    """Write ``directory`` as ``<name>-<version>.tar.gz`` into ``dest_dir``; return its path.

    Regular files and directories only: a symbolic link, FIFO or device in the tree is refused
    (an sdist holds none that pip would keep, and following one could pack files from outside
    the project)."""
    directory = directory.resolve()
    name, version = static_name_version(directory)
    dist = canonicalize_name(name).replace("-", "_")
    top = f"{dist}-{version}"
    members: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info"))
        for entry in [*dirs, *sorted(files)]:
            path = Path(root, entry)
            mode = path.lstat().st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise InvalidBuildSpec(f"{path} is not a regular file or directory: an sdist "
                                       "holds only those (replace the link with its file)")
            if stat.S_ISREG(mode):
                members.append((f"{top}/{path.relative_to(directory)}", path))
    if not (directory / "PKG-INFO").is_file():
        pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    else:
        pkg_info = None
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / f"{top}.tar.gz"
    with out.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=EPOCH) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if pkg_info is not None:
            tar.addfile(_info(f"{top}/PKG-INFO", len(pkg_info), 0o644), io.BytesIO(pkg_info))
        for arcname, path in sorted(members):
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                executable = path.stat().st_mode & 0o111
                tar.addfile(_info(arcname, size, 0o755 if executable else 0o644), f)
    return out


def _info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
