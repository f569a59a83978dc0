"""Sdist intake: hostile archives are refused in one line, before anything is written."""

from __future__ import annotations

import hashlib
import io
import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index.layout import source_key
from wheelhouse.index.storage import LocalStorage
from worker.sandbox.untrusted import unpack
from worker.sdist import SdistLimits, fetch_stored_sdist

MiB = 1 << 20
SETUP = b"from setuptools import setup\nsetup()\n"


def _tar(path: Path, *members: tarfile.TarInfo | tuple[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tf.addfile(member)
            else:
                name, data = member
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def _fifo(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.FIFOTYPE
    return info


def _zip(path: Path, *members: tuple[str, bytes] | tuple[str, bytes, int]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for member in members:
            info = zipfile.ZipInfo(member[0])
            info.compress_type = zipfile.ZIP_DEFLATED
            if len(member) == 3:
                info.external_attr = member[2] << 16
            zf.writestr(info, member[1])
    return path


Archive = Callable[[Path], Path]
UNSAFE: list[tuple[str, Archive, str]] = [
    ("dotdot", lambda d: _tar(d / "p-1.tar.gz", ("p-1/setup.py", SETUP), ("p-1/../../evil", b"x")),
     "'p-1/../../evil' would land outside the project directory"),
    ("absolute", lambda d: _tar(d / "p-1.tar.gz", ("p-1/setup.py", SETUP), ("/tmp/evil", b"x")),
     "'/tmp/evil' has an absolute path"),
    ("absolute-link", lambda d: _tar(d / "p-1.tar.gz", ("p-1/setup.py", SETUP),
                                     _link("p-1/creds", "/root/.aws/credentials")),
     "'p-1/creds' links out of the tree (to '/root/.aws/credentials')"),
    ("relative-link", lambda d: _tar(d / "p-1.tar.gz", ("p-1/setup.py", SETUP),
                                     _link("p-1/up", "../../../etc")),
     "'p-1/up' links out of the tree (to '../../../etc')"),
    ("hard-link", lambda d: _tar(d / "p-1.tar.gz", ("p-1/setup.py", SETUP),
                                 _link("p-1/h", "../outside", tarfile.LNKTYPE)),
     "'p-1/h' links out of the tree"),
    ("fifo", lambda d: _tar(d / "p-1.tar.gz", ("p-1/setup.py", SETUP), _fifo("p-1/pipe")),
     "'p-1/pipe' is a device or FIFO"),
    ("zip-dotdot", lambda d: _zip(d / "p-1.zip", ("p-1/setup.py", SETUP), ("p-1/../../evil", b"x")),
     "'p-1/../../evil' would land outside the project directory"),
    ("zip-absolute", lambda d: _zip(d / "p-1.zip", ("p-1/setup.py", SETUP), ("/tmp/evil", b"x")),
     "'/tmp/evil' has an absolute path"),
    ("zip-link", lambda d: _zip(d / "p-1.zip", ("p-1/setup.py", SETUP),
                                ("p-1/creds", b"/root/.aws/credentials", stat.S_IFLNK | 0o777)),
     "'p-1/creds' links out of the tree"),
    ("not-gzip", lambda d: _write(d / "p-1.tar.gz", b"\x1f\x8b\x08\x00garbage" * 10),
     "p-1.tar.gz is not a readable archive"),
    ("not-zip", lambda d: _write(d / "p-1.zip", b"PK\x03\x04garbage"),
     "p-1.zip is not a readable archive"),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("build", "reason"), [(b, r) for _, b, r in UNSAFE],
                         ids=[i for i, _, _ in UNSAFE])
def test_unsafe_archives_are_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, build: Archive, reason: str,
) -> None:
    archives = tmp_path / "archives"
    archives.mkdir()
    sdist = build(archives)
    dest = tmp_path / "unpack" / "src"

    with pytest.raises(BuildFailed) as failed:
        unpack(sdist, dest)

    assert failed.value.kind == FailureKind.UNSAFE_ARCHIVE
    assert reason in failed.value.reason
    assert "\n" not in failed.value.reason
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "evil").exists() and not (tmp_path / "unpack" / "evil").exists()


def _many(d: Path, zipped: bool) -> Path:
    members = [("p-1/setup.py", SETUP)] + [(f"p-1/f{i}.py", b"") for i in range(20)]
    return _zip(d / "p-1.zip", *members) if zipped else _tar(d / "p-1.tar.gz", *members)


def _bomb(d: Path, zipped: bool) -> Path:
    members = [("p-1/setup.py", SETUP), ("p-1/zeros.bin", bytes(3 * MiB))]
    return _zip(d / "p-1.zip", *members) if zipped else _tar(d / "p-1.tar.gz", *members)


def _big(d: Path, zipped: bool) -> Path:
    import os

    noise = os.urandom(2 * MiB)  # does not compress
    members = [("p-1/setup.py", SETUP), ("p-1/noise.bin", noise)]
    return _zip(d / "p-1.zip", *members) if zipped else _tar(d / "p-1.tar.gz", *members)


LIMITS = SdistLimits(max_bytes=1 * MiB, max_members=10, max_unpacked_bytes=2 * MiB)


@pytest.mark.parametrize("zipped", [False, True], ids=["tar", "zip"])
@pytest.mark.parametrize(("build", "reason"), [
    (_many, "holds more than 10 members (WHEELHOUSE_SDIST_MAX_MEMBERS)"),
    (_bomb, "unpacks to more than 2 MiB (WHEELHOUSE_SDIST_MAX_UNPACKED_MIB)"),
    (_big, "is 2 MiB, over the 1 MiB limit (WHEELHOUSE_SDIST_MAX_MIB)"),
], ids=["members", "unpacked", "size"])
def test_each_limit_has_its_own_failure(
    tmp_path: Path, zipped: bool, build: Callable[[Path, bool], Path], reason: str,
) -> None:
    sdist = build(tmp_path, zipped)
    dest = tmp_path / "src"

    with pytest.raises(BuildFailed) as failed:
        unpack(sdist, dest, limits=LIMITS)

    assert failed.value.kind == FailureKind.TOO_LARGE
    assert reason in failed.value.reason and "\n" not in failed.value.reason
    assert list(dest.iterdir()) == []
    # Within the defaults, the same archive unpacks.
    assert (unpack(sdist, tmp_path / "ok") / "setup.py").read_bytes() == SETUP


def test_limits_come_from_the_config() -> None:
    config = Config.from_env({"WHEELHOUSE_SDIST_MAX_MIB": "3", "WHEELHOUSE_SDIST_MAX_MEMBERS": "7",
                              "WHEELHOUSE_SDIST_MAX_UNPACKED_MIB": "5"})
    assert SdistLimits.from_config(config) == SdistLimits(3 * MiB, 7, 5 * MiB)
    assert SdistLimits.from_config(Config()) == SdistLimits()


@pytest.mark.parametrize("zipped", [False, True], ids=["tar", "zip"])
def test_a_plain_sdist_with_links_inside_its_tree_unpacks(tmp_path: Path, zipped: bool) -> None:
    if zipped:
        sdist = _zip(tmp_path / "p-1.zip", ("p-1/setup.py", SETUP), ("p-1/pkg/__init__.py", b""))
    else:
        sdist = _tar(tmp_path / "p-1.tar.gz", ("p-1/setup.py", SETUP),
                     ("p-1/pkg/__init__.py", b""), _link("p-1/alias.py", "setup.py"))
    project = unpack(sdist, tmp_path / "src")
    assert project == tmp_path / "src" / "p-1"
    assert (project / "setup.py").read_bytes() == SETUP
    if not zipped:
        assert (project / "alias.py").is_symlink()


def test_an_uploaded_sdist_is_copied_out_of_storage_only_whole_and_as_uploaded(
        tmp_path: Path) -> None:
    """fetch_stored_sdist: the bytes whose sha256 the request names, or a one-line failure
    that leaves no ``.part`` behind (a collected sdist, other bytes, one over the limit)."""
    storage = LocalStorage(tmp_path / "data")
    body = b"an sdist's bytes"
    sha = hashlib.sha256(body).hexdigest()
    dest = tmp_path / "sdist"
    name = "demo-1.0.tar.gz"

    with pytest.raises(BuildFailed) as gone:  # collected by `wheelhouse gc`, say
        fetch_stored_sdist(storage, sha, name, dest)
    assert gone.value.kind is FailureKind.INCOMPATIBLE
    assert "is not in storage" in gone.value.reason and "upload it again" in gone.value.reason

    storage.put_bytes(source_key(sha, name), b"other bytes")
    with pytest.raises(BuildFailed) as other:
        fetch_stored_sdist(storage, sha, name, dest)
    assert other.value.kind is FailureKind.UNVERIFIED_SOURCE
    assert list(dest.iterdir()) == []  # the .part went with the failure

    storage.put_bytes(source_key(sha, name), body)
    with pytest.raises(BuildFailed) as large:
        fetch_stored_sdist(storage, sha, name, dest, max_bytes=4)
    assert large.value.kind is FailureKind.TOO_LARGE
    assert fetch_stored_sdist(storage, sha, name, dest).read_bytes() == body
    assert [p.name for p in dest.iterdir()] == [name]
