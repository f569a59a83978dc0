"""examples/: the directory the examples' README builds packs as an sdist wheelhouse takes."""

from __future__ import annotations

import py_compile
import shlex
from pathlib import Path

from wheelhouse.builds.sourcedir import pack_directory
from wheelhouse.config import Config
from worker.cli import parse_target
from worker.sandbox.untrusted import SdistLimits, unpack

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "examples" / "README.md"


def _lines(prefix: str) -> list[str]:
    return [line.strip() for line in README.read_text().splitlines()
            if line.startswith("    ") and line.strip().startswith(prefix)]


def test_the_example_builds_from_its_directory_as_shown(tmp_path: Path) -> None:
    [build] = _lines("wheelhouse build ")
    directory = ROOT / shlex.split(build)[2]
    assert directory.is_dir() and directory.name == "vecadd-0.1.0"
    sdist = pack_directory(directory, tmp_path)
    assert sdist.name == "vecadd-0.1.0.tar.gz"
    assert parse_target(str(sdist)) == ("vecadd", "0.1.0", sdist.resolve())
    tree = unpack(sdist, tmp_path / "src", limits=SdistLimits.from_config(Config()))
    assert (tree / "PKG-INFO").read_text().startswith("Metadata-Version: 2.1\nName: vecadd\n")
    assert sorted(p.name for p in (tree / "csrc").iterdir()) == ["add.cu", "bindings.cpp"]
    py_compile.compile(str(tree / "setup.py"), doraise=True, cfile=str(tmp_path / "setup.pyc"))
    [request] = _lines("wheelhouse request ")
    assert shlex.split(request)[2] == shlex.split(build)[2]
