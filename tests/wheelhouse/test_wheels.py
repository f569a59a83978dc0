"""Wheel files: name validation, METADATA consistency, relabelling that pip accepts."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
import stat
import subprocess
import time
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.tags import Tag
from packaging.version import Version

from tests.helpers import clean_env, make_venv, make_wheel, metadata_bomb
from wheelhouse.errors import InvalidWheel, VersionMismatch
from wheelhouse.wheels import (
    MAX_FILENAME_LENGTH,
    MAX_METADATA_BYTES,
    add_description_note,
    check_consistent,
    parse_metadata,
    parse_name,
    read_metadata,
    relabel,
    sha256_file,
    validate_wheel,
)

FLASH_DEFECT = "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"


@pytest.mark.parametrize(("filename", "project", "version", "tags"), [
    ("foo-1.0-py3-none-any.whl", "foo", "1.0", {"py3-none-any"}),
    ("Foo_Bar-1.0-py3-none-any.whl", "foo-bar", "1.0", {"py3-none-any"}),
    ("foo.bar-1.0-py3-none-any.whl", "foo-bar", "1.0", {"py3-none-any"}),
    ("foo-1.0-1-py3-none-any.whl", "foo", "1.0", {"py3-none-any"}),
    ("foo-1.0-py2.py3-none-any.whl", "foo", "1.0", {"py2-none-any", "py3-none-any"}),
    ("foo-1!2.0-py3-none-any.whl", "foo", "1!2.0", {"py3-none-any"}),
    ("foo-1.0.post1.dev2-py3-none-any.whl", "foo", "1.0.post1.dev2", {"py3-none-any"}),
    (FLASH_DEFECT, "flash-attn", "2.8.3+cu12torch2.8cxx11abitrue", {"cp312-cp312-linux_x86_64"}),
    ("flash_attn-2.8.3+cu128torch2.8-cp312-cp312-manylinux_2_28_x86_64.whl", "flash-attn",
     "2.8.3+cu128torch2.8", {"cp312-cp312-manylinux_2_28_x86_64"}),
])
def test_parse_name_accepts(filename: str, project: str, version: str, tags: set[str]) -> None:
    name = parse_name(filename)
    assert name.filename == filename
    assert name.project == project
    assert name.version == Version(version)
    assert name.tags == frozenset(Tag(*t.split("-")) for t in tags)
    assert name.dist_name == project.replace("-", "_")


@pytest.mark.parametrize("filename", [
    "",
    ".whl",
    "foo.whl",
    "foo-1.0.whl",
    "foo-1.0-py3-none.whl",
    "foo-1.0-py3-none-any.tar.gz",
    "foo-1.0-py3-none-any.WHL",
    "foo-1.0-py3-none-any.whl.metadata",
    "foo-1.0-py3-none-any.whl/",
    "foo-1.0-1-2-py3-none-any.whl",
    "foo-not_a_version-py3-none-any.whl",
    "foo__bar-1.0-py3-none-any.whl",
    "foo-1.0-py3-none-any..whl",
    "foo-1.0-py3--any.whl",
    ".foo-1.0-py3-none-any.whl",
    "../foo-1.0-py3-none-any.whl",
    "..%2ffoo-1.0-py3-none-any.whl",
    "%2e%2e-1.0-py3-none-any.whl",
    "foo-1.0-py3-none-any%2f.whl",
    "dir/foo-1.0-py3-none-any.whl",
    "dir\\foo-1.0-py3-none-any.whl",
    "/etc/foo-1.0-py3-none-any.whl",
    "foo-1.0-py3-none-a y.whl",
    "foo-1.0-py3-none-any\n.whl",
    "foo-1.0-py3-none-any.whl\x00",
    "foo\x00-1.0-py3-none-any.whl",
    "f\u0192oo-1.0-py3-none-any.whl",        # Latin f with hook
    "\u212a-1.0-py3-none-any.whl",           # Kelvin sign, which folds to "k"
    "foo-1.0-py3-none-\u0430ny.whl",         # Cyrillic a
    "foo-1.0-py3-none-any;rm -rf.whl",
    "f" * (MAX_FILENAME_LENGTH - len("-1.0-py3-none-any.whl") + 1) + "-1.0-py3-none-any.whl",
    "foo-1.0-py3-none-" + "x" * 10_000 + ".whl",
])
def test_parse_name_rejects(filename: str) -> None:
    with pytest.raises(InvalidWheel) as exc:
        parse_name(filename)
    assert len(str(exc.value)) < 400  # never echoes an overlong name in full


def test_longest_name_is_accepted() -> None:
    tail = "-1.0-py3-none-any.whl"
    filename = "f" * (MAX_FILENAME_LENGTH - len(tail)) + tail
    assert parse_name(filename).project == "f" * (MAX_FILENAME_LENGTH - len(tail))


def _defect_wheel(directory: Path) -> Path:
    """What upstream flash-attn CI ships: a label in the file name only, added after the build."""
    return make_wheel(directory, "flash-attn", "2.8.3+cu12torch2.8cxx11abiTRUE",
                      metadata_version="2.8.3", tag="cp312-cp312-linux_x86_64",
                      requires=["torch", "einops"], requires_python=">=3.9")


def test_check_consistent_catches_the_flash_attn_defect(tmp_path: Path) -> None:
    path = _defect_wheel(tmp_path)
    assert path.name == FLASH_DEFECT
    with pytest.raises(VersionMismatch) as exc:
        check_consistent(path, parse_name(path.name))
    message = str(exc.value)
    assert "2.8.3" in message and "2.8.3+cu12torch2.8cxx11abitrue" in message
    assert "--relabel" in message


@pytest.mark.parametrize(("file_version", "metadata_version"), [
    ("1.0", "1.0.1"),
    ("1.0+cu128torch2.8", "1.0"),
    ("1.0", "1.0+cu128torch2.8"),
    ("1.0+cu128torch2.8", "1.0+cu128torch2.9"),
])
def test_check_consistent_version_mismatch(
    tmp_path: Path, file_version: str, metadata_version: str
) -> None:
    path = make_wheel(tmp_path, "pkg", file_version, metadata_version=metadata_version)
    with pytest.raises(VersionMismatch):
        check_consistent(path, parse_name(path.name))


@pytest.mark.parametrize(("file_version", "metadata_version"), [
    ("1.0", "1.0"), ("1.0", "1.0.0"), ("1.0+cu128torch2.8", "1.0+cu128torch2.8"),
    ("1.0.post1", "1.0-post1"),
])
def test_check_consistent_accepts_equal_versions(
    tmp_path: Path, file_version: str, metadata_version: str
) -> None:
    path = make_wheel(tmp_path, "pkg", file_version, metadata_version=metadata_version,
                      requires_python=">=3.10")
    meta = check_consistent(path, parse_name(path.name))
    assert meta.version == Version(file_version)
    assert meta.requires_python == ">=3.10"


def test_check_consistent_catches_a_project_name_mismatch(tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "foo", "1.0")
    renamed = path.rename(tmp_path / "bar-1.0-py3-none-any.whl")
    with pytest.raises(InvalidWheel, match="names project") as exc:
        check_consistent(renamed, parse_name(renamed.name))
    assert not isinstance(exc.value, VersionMismatch)


def test_not_a_zip_is_an_invalid_wheel(tmp_path: Path) -> None:
    path = tmp_path / "foo-1.0-py3-none-any.whl"
    path.write_bytes(b"not a zip file")
    with pytest.raises(InvalidWheel, match="not a readable wheel"):
        read_metadata(path)


@pytest.mark.parametrize(("drop", "add", "message"), [
    ("foo-1.0.dist-info/METADATA", {}, "not a readable wheel"),
    (None, {"bar-1.0.dist-info/METADATA": b"Name: bar\n"}, "exactly one .dist-info"),
])
def test_broken_dist_info(
    tmp_path: Path, drop: str | None, add: dict[str, bytes], message: str
) -> None:
    path = _rewrite(make_wheel(tmp_path, "foo", "1.0"), tmp_path / "out", drop=drop, add=add)
    with pytest.raises(InvalidWheel, match=message):
        read_metadata(path)


@pytest.mark.parametrize("metadata", [
    b"Metadata-Version: 2.1\nName: foo\n\n",
    b"Metadata-Version: 2.1\nName: foo\nVersion: not-a-version\n\n",
    b"Metadata-Version: 2.1\nVersion: 1.0\n\n",
    b"Metadata-Version: 2.1\nName: foo\nVersion: 1.0\nRequires-Python: 3.8+\n\n",
])
def test_parse_metadata_refuses_malformed(metadata: bytes) -> None:
    with pytest.raises(InvalidWheel, match="METADATA is malformed"):
        parse_metadata(metadata)


# --- relabelling -----------------------------------------------------------------------------


def _rewrite(
    path: Path,
    directory: Path,
    *,
    drop: str | None = None,
    add: dict[str, bytes] | None = None,
    replace: dict[str, bytes] | None = None,
) -> Path:
    """A copy of a wheel with files dropped, added or replaced, and a RECORD that matches."""
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path) as zf:
        files = {n: zf.read(n) for n in zf.namelist() if not n.endswith("/RECORD")}
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    if drop:
        files.pop(drop)
    files.update(add or {})
    files.update(replace or {})
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for name, data in files.items():
        writer.writerow((name, "sha256=" + _b64sha(data), len(data)))
    writer.writerow((record_name, "", ""))
    files[record_name] = buf.getvalue().encode()
    out = directory / path.name
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 2, 3, 4, 6))
            if "/scripts/" in name:
                info.external_attr = 0o100755 << 16
            zf.writestr(info, data)
    return out


def _b64sha(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def assert_record_matches(path: Path) -> list[list[str]]:
    """Every RECORD line matches the zip's contents, and every file is in RECORD."""
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        infos = {i.filename: i for i in zf.infolist()}
        record_names = [n for n in infos if n.endswith(".dist-info/RECORD")]
        assert len(record_names) == 1
        rows = list(csv.reader(io.StringIO(zf.read(record_names[0]).decode())))
        listed = set()
        for row in rows:
            assert len(row) == 3, row
            name, digest, size = row
            assert name not in listed, f"{name} listed twice"
            listed.add(name)
            assert name in infos, f"RECORD lists {name}, which is not in the wheel"
            if name == record_names[0]:
                assert (digest, size) == ("", "")
                continue
            data = zf.read(name)
            assert digest == "sha256=" + _b64sha(data), f"wrong hash for {name}"
            assert int(size) == len(data), f"wrong size for {name}"
        files = {n for n in infos if not n.endswith("/")}
        assert files == listed, f"not in RECORD: {files - listed}"
    return rows


def test_make_wheel_records_are_checked_by_the_checker(tmp_path: Path) -> None:
    # The checker itself must fail on a wheel whose RECORD lies.
    good = make_wheel(tmp_path, "foo", "1.0")
    assert_record_matches(good)
    with zipfile.ZipFile(good) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    files["foo/__init__.py"] = b"tampered = True\n"
    bad = tmp_path / "bad" / good.name
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    with pytest.raises(AssertionError, match="wrong hash"):
        assert_record_matches(bad)


@pytest.mark.parametrize(("version", "metadata_version", "label", "expected"), [
    ("1.0", None, "cu128torch2.8", "1.0+cu128torch2.8"),
    ("1.0+cu12torch2.8cxx11abiTRUE", "1.0", "cu128torch2.8", "1.0+cu128torch2.8"),
    ("1.0+cu128torch2.8", "1.0", "cu128torch2.8", "1.0+cu128torch2.8"),
    ("2.8.3", None, "cu128torch2.8.sm90", "2.8.3+cu128torch2.8.sm90"),
    ("2.8.3+old", "2.8.3+old", "cu124torch2.5.cxx11abi1.sm80.sm90",
     "2.8.3+cu124torch2.5.cxx11abi1.sm80.sm90"),
    ("0.1.post2", None, "cu130torch2.10", "0.1.post2+cu130torch2.10"),
])
def test_relabel_rewrites_name_dist_info_metadata_and_record(
    tmp_path: Path, version: str, metadata_version: str | None, label: str, expected: str
) -> None:
    src = make_wheel(tmp_path / "src", "my-pkg", version, metadata_version=metadata_version,
                     requires=["numpy>=1"], requires_python=">=3.9", payload=b"\x00\x01" * 5000)
    before = src.read_bytes()
    out = _relabel(src, label, tmp_path / "out")
    assert src.read_bytes() == before, "the source must be left untouched"
    assert out.parent == tmp_path / "out"
    assert out.name == f"my_pkg-{expected}-py3-none-any.whl"
    assert [p.name for p in (tmp_path / "out").iterdir()] == [out.name], "no temporary left"
    name = parse_name(out.name)
    meta = check_consistent(out, name)
    assert meta.version == Version(expected)
    assert meta.requires_python == ">=3.9"
    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
        assert {n.split("/")[0] for n in names} == {"my_pkg", f"my_pkg-{expected}.dist-info"}
        assert zf.read("my_pkg/payload.bin") == b"\x00\x01" * 5000
        metadata = zf.read(f"my_pkg-{expected}.dist-info/METADATA").decode()
    assert f"Version: {expected}\n" in metadata
    assert "Requires-Dist: numpy>=1" in metadata
    assert metadata.count("Version:") == 2  # Metadata-Version and Version, nothing added
    assert_record_matches(out)


def test_relabel_is_deterministic(tmp_path: Path) -> None:
    # Publishing the same upstream wheel twice with --relabel must give the same bytes.
    src = _defect_wheel(tmp_path / "src")
    a = _relabel(src, "cu128torch2.8", tmp_path / "a")
    time.sleep(2.1)  # zip timestamps have a 2-second resolution: "now" would differ by then
    b = _relabel(src, "cu128torch2.8", tmp_path / "b")
    assert a.name == b.name
    assert sha256_file(a) == sha256_file(b)


def test_relabel_refuses_different_public_versions(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "pkg", "1.0", metadata_version="1.1")
    (tmp_path / "out").mkdir()
    with pytest.raises(VersionMismatch, match="public versions differ"):
        relabel(src, "cu128torch2.8", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_relabel_refuses_metadata_without_version_header(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "pkg", "1.0")
    # Version only in the description: the headers have none.
    body = b"Metadata-Version: 2.1\nName: pkg\n\nVersion: 1.0\n"
    broken = _rewrite(src, tmp_path / "broken", replace={"pkg-1.0.dist-info/METADATA": body})
    (tmp_path / "out").mkdir()
    with pytest.raises(InvalidWheel):
        relabel(broken, "cu128torch2.8", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_relabel_keeps_crlf_metadata_parseable(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "pkg", "1.0")
    body = b"Metadata-Version: 2.1\r\nName: pkg\r\nVersion: 1.0\r\nSummary: s\r\n\r\n"
    crlf = _rewrite(src, tmp_path / "crlf", replace={"pkg-1.0.dist-info/METADATA": body})
    out = _relabel(crlf, "cu128torch2.8", tmp_path / "out")
    metadata = read_metadata(out)
    assert b"Version: 1.0+cu128torch2.8\r\n" in metadata
    assert parse_metadata(metadata).version == Version("1.0+cu128torch2.8")
    assert_record_matches(out)


def test_relabel_renames_the_data_directory(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "pkg", "1.0")
    with_data = _rewrite(src, tmp_path / "data", add={
        "pkg-1.0.data/scripts/pkg-hello": b"#!python\nprint('hello from pkg')\n",
        "pkg-1.0.data/data/share/pkg/notes.txt": b"notes\n",
    })
    out = _relabel(with_data, "cu128torch2.8", tmp_path / "out")
    with zipfile.ZipFile(out) as zf:
        tops = {n.split("/")[0] for n in zf.namelist()}
        mode = zf.getinfo("pkg-1.0+cu128torch2.8.data/scripts/pkg-hello").external_attr >> 16
    assert tops == {"pkg", "pkg-1.0+cu128torch2.8.dist-info", "pkg-1.0+cu128torch2.8.data"}
    assert mode & 0o111, "the executable bit survives"
    assert_record_matches(out)


@pytest.mark.parametrize(("metadata", "expected"), [
    (b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\n",
     b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\nnote one\n\nnote two\n"),
    (b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
     b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\nnote one\n\nnote two\n"),
    (b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\n# Pkg\n\nText.\n\n\n",
     b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\n# Pkg\n\nText.\n\nnote one\n\n"
     b"note two\n"),
    (b"Metadata-Version: 2.1\r\nName: pkg\r\nVersion: 1.0\r\n\r\nText.\r\n",
     b"Metadata-Version: 2.1\r\nName: pkg\r\nVersion: 1.0\r\n\r\nText.\r\n\r\nnote one\r\n"
     b"\r\nnote two\r\n"),
])
def test_a_description_note_ends_the_metadata_body(
    tmp_path: Path, metadata: bytes, expected: bytes
) -> None:
    src = _rewrite(make_wheel(tmp_path / "src", "pkg", "1.0"), tmp_path / "meta",
                   replace={"pkg-1.0.dist-info/METADATA": metadata})
    (tmp_path / "out").mkdir()
    out = add_description_note(src, "note one\n\nnote two", tmp_path / "out")
    assert out.name == src.name
    assert read_metadata(out) == expected
    assert parse_metadata(read_metadata(out)).version == Version("1.0")
    assert_record_matches(out)
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(out) as b:
        assert a.read("pkg/__init__.py") == b.read("pkg/__init__.py")
    time.sleep(2.1)  # same bytes when done again later: republishing must not see a difference
    (tmp_path / "again").mkdir()
    again = add_description_note(src, "note one\n\nnote two", tmp_path / "again")
    assert again != out and sha256_file(again) == sha256_file(out)


# --- real installers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_venv(tmp_path_factory.mktemp("venv") / "venv")


def _pip_install(
    python: Path, wheel: Path, *, via_links: bool = False
) -> subprocess.CompletedProcess[str]:
    """Install a wheel file, or (``via_links``) its project from the wheel's folder, as from an
    index: only then does pip compare the file name's version with METADATA's."""
    target = ["--find-links", str(wheel.parent), parse_name(wheel.name).project] if via_links \
        else [str(wheel)]
    return subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir",
         "--force-reinstall", *target],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )


def _relabel(src: Path, label: str, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    return relabel(src, label, dest_dir)


def _installed_version(python: Path, project: str) -> str:
    out = subprocess.run(
        [str(python), "-c",
         f"import importlib.metadata as m; print(m.version({project!r}))"],
        capture_output=True, text=True, env=clean_env(), check=True, timeout=60,
    )
    return out.stdout.strip()


def test_pip_refuses_the_upstream_defect_but_installs_the_relabelled_wheel(
    tmp_path: Path, venv_python: Path
) -> None:
    src = make_wheel(tmp_path / "src", "defect-pkg", "2.8.3+cu12torch2.8cxx11abiTRUE",
                     metadata_version="2.8.3")
    refused = _pip_install(venv_python, src, via_links=True)
    assert refused.returncode != 0
    assert "inconsistent version" in (refused.stdout + refused.stderr).lower()

    out = _relabel(src, "cu128torch2.8", tmp_path / "out")
    for via_links in (False, True):
        done = _pip_install(venv_python, out, via_links=via_links)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _installed_version(venv_python, "defect-pkg") == "2.8.3+cu128torch2.8"
    check = subprocess.run([str(venv_python), "-m", "pip", "check"], capture_output=True,
                           text=True, env=clean_env(), timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_pip_installs_relabelled_wheel_with_data_and_verifies_record(
    tmp_path: Path, venv_python: Path
) -> None:
    src = make_wheel(tmp_path / "src", "data-pkg", "1.0",
                     module_body="GREETING = 'hello'\n")
    with_data = _rewrite(src, tmp_path / "data", add={
        "data_pkg-1.0.data/scripts/data-pkg-hello": b"#!python\nprint('hello from data-pkg')\n",
    })
    out = _relabel(with_data, "cu128torch2.8.sm90", tmp_path / "out")
    done = _pip_install(venv_python, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _installed_version(venv_python, "data-pkg") == "1.0+cu128torch2.8.sm90"
    script = venv_python.parent / "data-pkg-hello"
    ran = subprocess.run([str(script)], capture_output=True, text=True, check=True, timeout=60)
    assert ran.stdout.strip() == "hello from data-pkg"
    site = subprocess.run(
        [str(venv_python), "-c", "import data_pkg, os; print(os.path.dirname(data_pkg.__file__))"],
        capture_output=True, text=True, check=True, env=clean_env(), timeout=60,
    ).stdout.strip()
    leftovers = [p.name for p in Path(site).parent.iterdir() if p.name.endswith(".data")]
    assert leftovers == [], "a stale .data directory was copied into site-packages"


def test_uv_installs_relabelled_wheel_with_data(tmp_path: Path) -> None:
    # uv only treats <name>-<version>.data as the data directory, so a stale one would be copied
    # into site-packages and the script never installed.
    uv = shutil.which("uv")
    assert uv is not None
    python = make_venv(tmp_path / "venv")
    src = make_wheel(tmp_path / "src", "uv-data-pkg", "1.0")
    with_data = _rewrite(src, tmp_path / "data", add={
        "uv_data_pkg-1.0.data/scripts/uv-data-pkg-hello": b"#!python\nprint('hello from uv')\n",
    })
    out = _relabel(with_data, "cu128torch2.8", tmp_path / "out")
    done = subprocess.run(
        [uv, "pip", "install", "--python", str(python), "--no-index", "--no-deps", "--no-cache",
         str(out)],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _installed_version(python, "uv-data-pkg") == "1.0+cu128torch2.8"
    ran = subprocess.run([str(python.parent / "uv-data-pkg-hello")], capture_output=True,
                         text=True, check=True, timeout=60)
    assert ran.stdout.strip() == "hello from uv"


# --- validating what a build produced -------------------------------------------------------

CP311 = Tag("cp311", "cp311", "linux_x86_64")


def _accepts_cp311(tags: frozenset[Tag]) -> bool:
    return CP311 in tags


def _record(files: dict[str, bytes], info: str) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow((path, f"sha256={digest}", len(data)))
    writer.writerow((f"{info}/RECORD", "", ""))
    return out.getvalue().encode()


Members = list[tuple[str, bytes, int]]
"""(name, data, unix mode) of every member but RECORD."""


def _tampered(tmp_path: Path, edit: Callable[[Members], Members | None] | None = None, *,
              record: Callable[[bytes], bytes] | None = None, name: str | None = None,
              after: Callable[[Members], Members] | None = None) -> Path:
    """A valid cp311 wheel from make_wheel, with ``edit`` applied before RECORD is written,
    ``after`` applied after (so RECORD no longer matches) and ``record`` rewriting RECORD."""
    base = make_wheel(tmp_path / "base", "demo", "1.0", tag="cp311-cp311-linux_x86_64")
    info = "demo-1.0.dist-info"
    with zipfile.ZipFile(base) as zf:
        members: Members = [(n, zf.read(n), 0o644) for n in zf.namelist()
                            if n != f"{info}/RECORD"]
    members = (edit(members) if edit else None) or members
    data = _record({n: d for n, d, _ in members}, info)
    if record is not None:
        data = record(data)
    members = (after(members) if after else members) + [(f"{info}/RECORD", data, 0o644)]
    out = tmp_path / "out" / (name or base.name)
    out.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(out, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of the duplicate we want
        for member, content, mode in members:
            zi = zipfile.ZipInfo(member)
            zi.external_attr = mode << 16
            zf.writestr(zi, content)
    return out


def _replace(members: Members, old: str, new: tuple[str, bytes, int]) -> Members:
    return [new if n == old else (n, d, m) for n, d, m in members]


def _metadata(text: str) -> Callable[[Members], Members]:
    return lambda ms: _replace(ms, "demo-1.0.dist-info/METADATA",
                               ("demo-1.0.dist-info/METADATA", text.encode(), 0o644))


TAMPERED: list[tuple[str, Callable[[Path], Path], str]] = [
    ("content-changed", lambda t: _tampered(t, after=lambda ms: _replace(
        ms, "demo/__init__.py", ("demo/__init__.py", b"import os; os.system('x')\n", 0o644))),
     "'demo/__init__.py' does not match its RECORD hash and size"),
    ("size-wrong", lambda t: _tampered(t, record=_bump_first_size),
     "'demo/__init__.py' does not match its RECORD hash and size"),
    ("unrecorded-member", lambda t: _tampered(t, after=lambda ms: [
        *ms, ("demo/backdoor.py", b"x", 0o644)]), "'demo/backdoor.py' is not in RECORD"),
    ("recorded-but-missing", lambda t: _tampered(t, record=lambda r: r + b"demo/gone.py,,\n"),
     "RECORD lists 'demo/gone.py', which is not in the wheel"),
    ("md5", lambda t: _tampered(t, record=lambda r: r.replace(b"sha256=", b"md5=")),
     "with md5, not sha256 or stronger"),
    ("dotdot", lambda t: _tampered(t, lambda ms: [*ms, ("demo/../../evil.py", b"x", 0o644)]),
     "member name 'demo/../../evil.py' escapes the install tree"),
    ("absolute", lambda t: _tampered(t, lambda ms: [*ms, ("/etc/evil", b"x", 0o644)]),
     "member name '/etc/evil' escapes the install tree"),
    ("backslash", lambda t: _tampered(t, lambda ms: [*ms, ("demo\\..\\..\\evil.py", b"x", 0o644)]),
     "escapes the install tree"),
    ("symlink", lambda t: _tampered(t, lambda ms: [
        *ms, ("demo/creds", b"/root/.aws/credentials", stat.S_IFLNK | 0o777)]),
     "member 'demo/creds' is a symbolic link"),
    ("twice", lambda t: _tampered(t, after=lambda ms: [*ms, ms[0]]), "appears twice"),
    ("metadata-name", lambda t: _tampered(t, _metadata(
        "Metadata-Version: 2.1\nName: other\nVersion: 1.0\n\n")), "METADATA names project 'other'"),
    ("metadata-version", lambda t: _tampered(t, _metadata(
        "Metadata-Version: 2.1\nName: demo\nVersion: 1.1\n\n")), "METADATA says version 1.1"),
    ("wheel-tags", lambda t: _tampered(t, lambda ms: _replace(
        ms, "demo-1.0.dist-info/WHEEL", ("demo-1.0.dist-info/WHEEL",
                                         b"Wheel-Version: 1.0\nTag: py3-none-any\n", 0o644))),
     "WHEEL says tags py3-none-any"),
    ("two-dist-infos", lambda t: _tampered(t, lambda ms: [
        *ms, ("evil-1.0.dist-info/METADATA", b"Name: evil\n", 0o644)]),
     "exactly one .dist-info directory"),
    ("dist-info-via-data", lambda t: _tampered(t, lambda ms: [
        *ms, ("demo-1.0.data/purelib/other-9.0.dist-info/METADATA", b"Name: other\n", 0o644)]),
     "would install the .dist-info of another project"),
    ("unrecorded-pth", lambda t: _tampered(t, after=lambda ms: [
        *ms, ("evil.pth", b"import os; os.system('x')\n", 0o644)]), "'evil.pth' is not in RECORD"),
    ("requires-python", lambda t: _tampered(t, _metadata(
        "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\nRequires-Python: >=3.8,banana\n\n")),
     "Requires-Python '>=3.8,banana' is no version specifier"),
    ("metadata-too-large", lambda t: _tampered(t, _metadata(
        "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n\n" + "x" * MAX_METADATA_BYTES)),
     f"METADATA is larger than {MAX_METADATA_BYTES // 1024} KiB"),
    ("not-a-zip", lambda t: _write(t / "demo-1.0-cp311-cp311-linux_x86_64.whl", b"PK\x03\x04no"),
     "not a well-formed zip"),
    ("unexpected-tags", lambda t: make_wheel(t, "demo", "1.0", tag="py3-none-any"),
     "tags py3-none-any are not the ones this build must produce"),
    ("unexpected-version", lambda t: make_wheel(t, "demo", "1.1", tag="cp311-cp311-linux_x86_64"),
     "built version 1.1, expected 1.0"),
    ("unexpected-project", lambda t: make_wheel(t, "other", "1.0", tag="cp311-cp311-linux_x86_64"),
     "built project other, expected demo"),
    ("symlinked-file", lambda t: _symlink_to(_tampered(t)), "not a regular file"),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _bump_first_size(record: bytes) -> bytes:
    """RECORD with the first member's size one too big (its hash still right)."""
    rows = list(csv.reader(io.StringIO(record.decode())))
    rows[0][2] = str(int(rows[0][2]) + 1)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue().encode()


def _symlink_to(wheel: Path) -> Path:
    link = wheel.parent / "links" / wheel.name
    link.parent.mkdir()
    link.symlink_to(wheel)
    return link


def test_validate_wheel_accepts_a_valid_wheel(tmp_path: Path) -> None:
    wheel = _tampered(tmp_path)
    name = validate_wheel(wheel, "demo", Version("1.0"), _accepts_cp311)
    assert name.project == "demo" and name.tags == frozenset({CP311})


@pytest.mark.parametrize(("make", "reason"), [(m, r) for _, m, r in TAMPERED],
                         ids=[i for i, _, _ in TAMPERED])
def test_validate_wheel_refuses_tampered_wheels_in_one_line(
    tmp_path: Path, make: Callable[[Path], Path], reason: str,
) -> None:
    wheel = make(tmp_path)
    with pytest.raises(InvalidWheel) as refused:
        validate_wheel(wheel, "demo", Version("1.0"), _accepts_cp311)
    message = str(refused.value)
    assert reason in message
    assert "\n" not in message and message.startswith(wheel.name)


def test_validate_wheel_refuses_a_zip_bomb_before_reading_it(tmp_path: Path) -> None:
    wheel = _tampered(tmp_path, lambda ms: [*ms, ("demo/zeros.bin", bytes(4 << 20), 0o644)])
    validate_wheel(wheel, "demo", Version("1.0"), _accepts_cp311)
    with pytest.raises(InvalidWheel, match="MiB allowed"):
        validate_wheel(wheel, "demo", Version("1.0"), _accepts_cp311, max_unpacked_bytes=1 << 20)


def test_a_relabelled_wheel_validates(tmp_path: Path) -> None:
    """The build validates what relabel wrote, so relabel must write a valid wheel."""
    built = make_wheel(tmp_path / "built", "demo", "1.0", tag="cp311-cp311-linux_x86_64")
    (tmp_path / "out").mkdir()
    wheel = relabel(built, "cu130torch2.14", tmp_path / "out")
    name = validate_wheel(wheel, "demo", Version("1.0+cu130torch2.14"), _accepts_cp311)
    assert name.version == Version("1.0+cu130torch2.14")


@pytest.mark.parametrize("metadata", [
    b"Metadata-Version: 2.1\nName: gpuvar\nVersion: 1.0.0\n",  # headers simply end
    b"Metadata-Version: 2.1\nName: gpuvar\nVersion: 1.0.0",  # no final newline either
    b"Metadata-Version: 2.1\nName: gpuvar\nVersion: 1.0.0\n\n",
    b"Metadata-Version: 2.1\nName: gpuvar\nVersion: 1.0.0\n\nA body.\n\nTwo paragraphs.\n",
    b"Metadata-Version: 2.1\r\nName: gpuvar\r\nVersion: 1.0.0\r\n\r\nCRLF body.\r\n",
    b"Metadata-Version: 2.1\nName: gpuvar\nVersion: 1.0.0\nRequires-Dist: torch>=2\n"
    b"Requires-Dist: torch ; extra == 'x'\nSummary: s\n\nRequires-Dist: torch (in the body)\n",
], ids=["no-body", "no-newline", "blank-end", "body", "crlf", "torch-and-body"])
def test_every_metadata_rewrite_keeps_headers_headers(metadata: bytes) -> None:
    """Issue 30: a Requires-Dist added after a header block that simply ended landed in the
    description, where installers ignore it. What packaging reads back is what was meant."""
    from packaging.metadata import Metadata

    from wheelhouse.wheels import edit_metadata

    before = Metadata.from_email(metadata, validate=False)
    out = edit_metadata(metadata, version=Version("1.0.0+pt214"), torch="torch==2.14.*",
                        note="Built by wheelhouse.")
    after = Metadata.from_email(out, validate=False)
    assert str(after.version) == "1.0.0+pt214" and after.name == "gpuvar"
    torch = [str(r) for r in after.requires_dist or [] if r.name == "torch"]
    assert torch[-1] == "torch==2.14.*" and "torch>=2" not in torch
    assert [str(r) for r in after.requires_dist or [] if r.marker] == \
        [str(r) for r in before.requires_dist or [] if r.marker]
    assert after.summary == before.summary
    body = (before.description or "").strip()
    assert (after.description or "").strip().endswith("Built by wheelhouse.")
    assert (after.description or "").startswith(body)
    # Each edit alone leaves the rest as it was.
    assert Metadata.from_email(edit_metadata(metadata, note="n"),
                               validate=False).requires_dist == before.requires_dist


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """~400 KiB wheels whose METADATA inflates to 400 MiB: honestly declared, and declared as
    100 bytes (what a reader that trusts the header would allocate)."""
    tmp = tmp_path_factory.mktemp("bombs")
    return {"honest": metadata_bomb(tmp / "honest", "bomb", "1.0", 400 << 20),
            "lying": metadata_bomb(tmp / "lying", "bomb", "1.0", 400 << 20, declared=100)}


@pytest.mark.parametrize(("kind", "says"), [("honest", "METADATA is larger than 1024 KiB"),
                                            ("lying", "Bad CRC-32")])
@pytest.mark.parametrize("read", ["read_metadata", "validate_wheel"])
def test_a_metadata_bomb_is_refused_without_inflating_it(
        bombs: dict[str, Path], kind: str, says: str, read: str) -> None:
    wheel = bombs[kind]
    assert wheel.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(InvalidWheel, match=says):
            if read == "read_metadata":
                read_metadata(wheel)
            else:
                validate_wheel(wheel, "bomb", Version("1.0"), lambda _tags: True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_METADATA_BYTES  # the cap and zlib's buffers, never the 400 MiB


def test_relabelling_validation_takes_the_public_version_only(tmp_path: Path) -> None:
    """An upload the operator has relabelled is checked before relabel rewrites it: METADATA
    and .dist-info may lack the label, everything else is checked as for a build."""
    built = make_wheel(tmp_path / "built", "demo", "1.0", tag="cp311-cp311-linux_x86_64")
    defect = tmp_path / "demo-1.0+cu130torch2.14-cp311-cp311-linux_x86_64.whl"
    shutil.copy(built, defect)
    labelled = Version("1.0+cu130torch2.14")
    with pytest.raises(InvalidWheel, match="names another project or version"):
        validate_wheel(defect, "demo", labelled, _accepts_cp311)
    validate_wheel(defect, "demo", labelled, _accepts_cp311, relabelling=True)
    other = tmp_path / "demo-1.1+cu130torch2.14-cp311-cp311-linux_x86_64.whl"
    shutil.copy(built, other)
    with pytest.raises(InvalidWheel, match="names another project or version"):
        validate_wheel(other, "demo", Version("1.1+cu130torch2.14"), _accepts_cp311,
                       relabelling=True)
    tampered = _tampered(tmp_path / "t", after=lambda ms: [*ms, ("evil.pth", b"x", 0o644)],
                         name=defect.name)
    with pytest.raises(InvalidWheel, match=r"'evil\.pth' is not in RECORD"):
        validate_wheel(tampered, "demo", labelled, _accepts_cp311, relabelling=True)
