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


#: Most a static metadata file (PKG-INFO, pyproject.toml) is read to: it is parsed here.
MAX_METADATA_BYTES = 1024 * 1024
#: Most a directory is packed to (the worker's cap on a downloaded sdist).
MAX_PACKED_BYTES = 2 * 1024**3
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_regular(name: str, dir_fd: int) -> int | None:
    """A descriptor of the regular file ``name`` in ``dir_fd``: opened without following a link
    or blocking on a FIFO, None for anything else (the tree may be anyone's: a clone, a
    download)."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _read_small(dir_fd: int, name: str) -> bytes | None:
    """A static metadata file's bytes (capped: it is parsed), None where it is no regular file."""
    fd = _open_regular(name, dir_fd)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise InvalidBuildSpec(f"{name} is larger than {MAX_METADATA_BYTES // 1024} KiB")
    return data


def static_name_version(directory: Path) -> tuple[str, Version]:
    """The project's name and version from its static metadata; :class:`InvalidBuildSpec`
    saying what to do where there is none."""
    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _name_version(directory, top)
    finally:
        os.close(top)


def _name_version(directory: Path, top: int) -> tuple[str, Version]:
    raw = _read_small(top, "PKG-INFO")
    if raw is not None:
        headers = BytesParser().parsebytes(raw, headersonly=True)
        name, version = headers.get("Name"), headers.get("Version")
        if name and version:
            return str(name), _version(str(version), directory / "PKG-INFO")
    raw = _read_small(top, "pyproject.toml")
    if raw is not None:
        pyproject = directory / "pyproject.toml"
        try:
            table = tomllib.loads(raw.decode()).get("project", {})
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


def pack_directory(directory: Path, dest_dir: Path, *,
                   max_bytes: int = MAX_PACKED_BYTES) -> Path:
    """Write ``directory`` as ``<name>-<version>.tar.gz`` into ``dest_dir``; return its path.

    Regular files and directories only, walked and read by descriptor (``os.fwalk``, files
    opened without following a link or blocking on a FIFO), at most ``max_bytes`` in all: a
    symbolic link, FIFO or device in the tree is refused (an sdist holds none that pip would
    keep, and following one could pack files from outside the project)."""
    directory = directory.resolve()
    name, version = static_name_version(directory)
    dist = canonicalize_name(name).replace("-", "_")
    top = f"{dist}-{version}"
    has_pkg_info = False
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / f"{top}.tar.gz"
    total = 0
    with out.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=EPOCH) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files, dir_fd in os.fwalk(directory, follow_symlinks=False):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info"))
            rel = Path(root).relative_to(directory)
            for entry in [*dirs, *sorted(files)]:
                mode = os.lstat(entry, dir_fd=dir_fd).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise InvalidBuildSpec(f"{Path(root, entry)} is not a regular file or "
                                           "directory: an sdist holds only those (replace the "
                                           "link with its file)")
            has_pkg_info = has_pkg_info or (not rel.parts and "PKG-INFO" in files)
            for entry in sorted(files):
                total = _add(tar, f"{top}/{(rel / entry).as_posix()}", entry, dir_fd, total,
                             max_bytes)
        if not has_pkg_info:
            pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
            tar.addfile(_info(f"{top}/PKG-INFO", len(pkg_info), 0o644), io.BytesIO(pkg_info))
    return out


def _add(tar: tarfile.TarFile, arcname: str, name: str, dir_fd: int, total: int,
         max_bytes: int) -> int:
    """One regular file into ``tar``, read through its own descriptor; the new total."""
    fd = _open_regular(name, dir_fd)
    if fd is None:  # replaced by something else since the walk looked
        raise InvalidBuildSpec(f"{arcname} is not a regular file: an sdist holds only those")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        total += st.st_size
        if total > max_bytes:
            raise InvalidBuildSpec(f"the directory is larger than {max_bytes // 1024**2} MiB "
                                   "packed: make its sdist with `python -m build --sdist`")
        tar.addfile(_info(arcname, st.st_size, 0o755 if st.st_mode & 0o111 else 0o644), f)
    return total


def _info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, EPOCH
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
