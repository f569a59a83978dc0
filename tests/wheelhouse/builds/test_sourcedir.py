"""wheelhouse.builds.sourcedir: a project directory packed as an sdist, without running its code."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest
from packaging.version import Version

from wheelhouse.builds.sourcedir import pack_directory
from wheelhouse.errors import InvalidBuildSpec

PYPROJECT = '[project]\nname = "My.Ext"\nversion = "1.2"\n'


def _project(root: Path, pyproject: str = PYPROJECT) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "pyproject.toml").write_text(pyproject)
    (root / "setup.py").write_text("raise SystemExit('never run here')\n")
    (root / "src" / "k.cu").write_text("__global__ void k() {}\n")
    for junk in (".git/HEAD", "build/x.o", "dist/old.tar.gz", "src/__pycache__/a.pyc",
                 "my_ext.egg-info/PKG-INFO"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("junk")
    return root


def test_a_directory_packs_as_its_sdist_the_same_every_time(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    first = pack_directory(root, tmp_path / "a")
    os.utime(root / "setup.py", (1e9, 1e9))  # times are not part of the archive
    second = pack_directory(root, tmp_path / "b")
    assert first.name == "my_ext-1.2.tar.gz"
    assert hashlib.sha256(first.read_bytes()).digest() == \
        hashlib.sha256(second.read_bytes()).digest()
    with tarfile.open(first) as tar:
        names = tar.getnames()
        pkg_info = tar.extractfile("my_ext-1.2/PKG-INFO")
        assert pkg_info is not None and b"Name: My.Ext\nVersion: 1.2\n" in pkg_info.read()
        assert all(m.uid == 0 and m.isfile() for m in tar.getmembers())
    assert sorted(names) == ["my_ext-1.2/PKG-INFO", "my_ext-1.2/pyproject.toml",
                             "my_ext-1.2/setup.py", "my_ext-1.2/src/k.cu"]


@pytest.mark.parametrize(("pyproject", "why"), [
    ('[project]\nname = "x"\ndynamic = ["version"]\n', "python -m build --sdist"),
    ('[project]\nname = "x"\nversion = "not a version"\n', "is not a valid version"),
    ("[project\n", "pyproject.toml"),
])
def test_no_static_version_says_what_to_do(tmp_path: Path, pyproject: str, why: str) -> None:
    root = _project(tmp_path / "proj", pyproject)
    with pytest.raises(InvalidBuildSpec) as err:
        pack_directory(root, tmp_path / "out")
    assert why in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_link_in_the_tree_is_refused_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host key")
    root = _project(tmp_path / "proj")
    (root / "src" / "key").symlink_to(secret)
    with pytest.raises(InvalidBuildSpec, match="not a regular file or directory"):
        pack_directory(root, tmp_path / "out")


@pytest.mark.parametrize("command", ["build", "request"])
def test_the_cli_takes_a_directory_and_says_what_to_do_in_one_line(
        tmp_path: Path, command: str) -> None:
    from tests.helpers import run_console

    root = _project(tmp_path / "proj", '[project]\nname = "x"\ndynamic = ["version"]\n')
    args = [command, str(root), "--torch", "2.14", "--cuda", "13.0", "--python", "3.11"]
    if command == "request":
        args += ["--token", "whk_" + "x" * 43, "--server", "http://127.0.0.1:9"]
    done = run_console(*args, cwd=tmp_path)
    assert done.returncode != 0
    assert "python -m build --sdist" in done.stderr and "Traceback" not in done.stderr


def test_a_fifo_or_a_linked_metadata_file_is_neither_opened_nor_followed(
        tmp_path: Path) -> None:
    """The tree may be anyone's (a clone, a download): a FIFO is refused without blocking on
    it, a PKG-INFO that is a link is not read (the static name comes from pyproject), and a
    metadata file past the cap is refused before it is parsed."""
    secret = tmp_path / "secret"
    secret.write_text("Metadata-Version: 2.1\nName: stolen\nVersion: 6.6.6\n")
    root = _project(tmp_path / "proj")
    (root / "PKG-INFO").symlink_to(secret)
    with pytest.raises(InvalidBuildSpec, match="not a regular file or directory"):
        pack_directory(root, tmp_path / "out")  # the link itself is refused as a member
    (root / "PKG-INFO").unlink()
    os.mkfifo(root / "src" / "pipe")
    with pytest.raises(InvalidBuildSpec, match="not a regular file or directory"):
        pack_directory(root, tmp_path / "out")
    (root / "src" / "pipe").unlink()
    (root / "pyproject.toml").write_text(PYPROJECT + "#" * (2 * 1024 * 1024))
    with pytest.raises(InvalidBuildSpec, match="larger than"):
        pack_directory(root, tmp_path / "out")


def test_static_metadata_behind_a_link_is_not_read(tmp_path: Path) -> None:
    from wheelhouse.builds.sourcedir import static_name_version

    secret = tmp_path / "secret"
    secret.write_text("Metadata-Version: 2.1\nName: stolen\nVersion: 6.6.6\n")
    root = _project(tmp_path / "proj")
    (root / "PKG-INFO").symlink_to(secret)
    assert static_name_version(root) == ("My.Ext", Version("1.2"))
