"""Real wheels made in a test, and real sdists from PyPI (cached)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:

    pass



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
