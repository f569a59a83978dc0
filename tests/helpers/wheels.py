"""Real wheels made in a test, and real sdists from PyPI (cached)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import zipfile
from pathlib import Path


def make_wheel(
    directory: Path,
    name: str,
    version: str,
    *,
    tag: str = "py3-none-any",
    requires: list[str] | None = None,
    requires_python: str | None = None,
    metadata_version: str | None = None,
    module_body: str = "",
    payload: bytes = b"",
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write a small but complete, installable wheel (METADATA, WHEEL, RECORD); ``files`` are
    more members, by archive path."""
    dist = name.replace("-", "_")
    filename = f"{dist}-{version}-{tag}.whl"
    info = f"{dist}-{metadata_version or version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {metadata_version or version}",
    ]
    if requires_python:
        meta.append(f"Requires-Python: {requires_python}")
    meta.extend(f"Requires-Dist: {r}" for r in requires or [])
    members: dict[str, bytes] = {
        f"{dist}/__init__.py": (module_body or f"VERSION = {version!r}\n").encode(),
        f"{info}/METADATA": ("\n".join(meta) + "\n\n").encode(),
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: wheelhouse-tests\nRoot-Is-Purelib: true\n"
            + "".join(f"Tag: {t}\n" for t in [tag])
        ).encode(),
    }
    if payload:
        members[f"{dist}/payload.bin"] = payload
    members.update(files or {})
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow((path, f"sha256={digest}", len(data)))
    writer.writerow((f"{info}/RECORD", "", ""))
    members[f"{info}/RECORD"] = record.getvalue().encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / filename
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, data in members.items():
            zf.writestr(arc, data)
    return wheel


def metadata_bomb(directory: Path, name: str, version: str, size: int, *,
                  declared: int | None = None) -> Path:
    """A wheel whose METADATA is ``size`` bytes (its headers, then zeros: deflate shrinks them
    about a thousand times), with a RECORD that matches, written without ever holding it in
    memory. ``declared`` is the size its central directory then claims instead (a lie)."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    head = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n".encode()
    chunk = bytes(1 << 20)
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    small = {
        f"{dist}/__init__.py": b"",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    h = hashlib.sha256(head)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, data in small.items():
            zf.writestr(arc, data)
        member = zipfile.ZipInfo(f"{info}/METADATA")
        member.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(member, "w") as f:
            f.write(head)
            left = size - len(head)
            while left > 0:
                part = chunk[:min(left, len(chunk))]
                f.write(part)
                h.update(part)
                left -= len(part)
        rows = [(arc, _digest(hashlib.sha256(data)), len(data)) for arc, data in small.items()]
        rows += [(f"{info}/METADATA", _digest(h), size), (f"{info}/RECORD", "", "")]
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows)
        zf.writestr(f"{info}/RECORD", record.getvalue())
    if declared is not None:
        _declare_size(wheel, f"{info}/METADATA", declared)
    return wheel


def _digest(h: hashlib._Hash) -> str:
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def _declare_size(wheel: Path, member: str, size: int) -> None:
    """Make the central directory say ``member`` inflates to ``size`` bytes (what readers
    trust), whatever its data does."""
    data = bytearray(wheel.read_bytes())
    entry = data.find(b"PK\x01\x02")
    while entry != -1:
        name_length = int.from_bytes(data[entry + 28:entry + 30], "little")
        if data[entry + 46:entry + 46 + name_length] == member.encode():
            data[entry + 24:entry + 28] = size.to_bytes(4, "little")
            wheel.write_bytes(bytes(data))
            return
        entry = data.find(b"PK\x01\x02", entry + 4)
    raise LookupError(f"{member} is not in {wheel.name}'s central directory")


SDIST_CACHE = Path(os.environ.get(
    "WHEELHOUSE_TEST_SDIST_CACHE", Path.home() / ".cache" / "wheelhouse-tests" / "sdists"))


def pypi_sdist(project: str, version: str, cache: Path = SDIST_CACHE) -> Path:
    """The real sdist of ``project==version`` from PyPI, downloaded once into ``cache``.

    The file is checked against the sha256 PyPI lists for it, also when it comes from the cache.
    Raises ``requests.ConnectionError`` or ``requests.Timeout`` when PyPI can't be reached.
    """
    import requests
    from pypi_simple import PyPISimple

    with PyPISimple(session=requests.Session()) as client:
        page = client.get_project_page(project, timeout=60)
    found = [p for p in page.packages if p.package_type == "sdist" and p.version == version
             and p.filename.endswith(".tar.gz")]
    if not found:
        raise FileNotFoundError(f"PyPI lists no sdist of {project} {version}")
    package = found[0]
    expected = package.digests["sha256"]
    path = cache / package.filename
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == expected:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    response = requests.get(package.url, timeout=300)
    response.raise_for_status()
    if hashlib.sha256(response.content).hexdigest() != expected:
        raise OSError(f"{package.filename} from PyPI does not match its listed sha256")
    partial = path.with_suffix(".part")
    partial.write_bytes(response.content)
    partial.replace(path)
    return path
