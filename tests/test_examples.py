"""examples/: the sdist command the examples' README shows makes an sdist wheelhouse takes."""

from __future__ import annotations

import py_compile
import shlex
import subprocess
from pathlib import Path

from wheelhouse.config import Config
from worker.cli import parse_target
from worker.untrusted import SdistLimits, unpack

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "examples" / "README.md"


def _lines(prefix: str) -> list[str]:
    return [line.strip() for line in README.read_text().splitlines()
            if line.startswith("    ") and line.strip().startswith(prefix)]


def test_the_example_sdist_is_one_command_and_builds_as_shown(tmp_path: Path) -> None:
    [make] = _lines("tar ")
    # Run as from the repository's root, writing into tmp_path, not the checkout.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    subprocess.run(shlex.split(make), cwd=tmp_path, check=True)
    sdist = tmp_path / "vecadd-0.1.0.tar.gz"
    [build] = _lines("wheelhouse build ")
    assert shlex.split(build)[2] == sdist.name
    assert parse_target(str(sdist)) == ("vecadd", "0.1.0", sdist.resolve())
    tree = unpack(sdist, tmp_path / "src", limits=SdistLimits.from_config(Config()))
    assert (tree / "PKG-INFO").read_text().startswith("Metadata-Version: 2.1\nName: vecadd\n")
    assert sorted(p.name for p in (tree / "csrc").iterdir()) == ["add.cu", "bindings.cpp"]
    py_compile.compile(str(tree / "setup.py"), doraise=True, cfile=str(tmp_path / "setup.pyc"))
