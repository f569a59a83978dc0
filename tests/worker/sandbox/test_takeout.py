"""The wheel's take-out: one regular file, by descriptor, capped; a link or a FIFO the build
left is refused, never followed or opened."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from wheelhouse.errors import BuildFailed, FailureKind
from worker.sandbox.takeout import take_wheel


def test_take_wheel_copies_one_regular_file_and_refuses_links_and_fifos(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "credentials"
    secret.write_text("secret")
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "a-1.0-py3-none-any.whl").symlink_to(secret)
    with pytest.raises(BuildFailed, match="link") as failed:
        take_wheel(dist, tmp_path / "out")
    assert failed.value.kind is FailureKind.UNSAFE_RESULT
    (dist / "a-1.0-py3-none-any.whl").unlink()
    os.mkfifo(dist / "a-1.0-py3-none-any.whl")
    with pytest.raises(BuildFailed, match="FIFO") as failed:
        take_wheel(dist, tmp_path / "out")
    assert failed.value.kind is FailureKind.UNSAFE_RESULT
    (dist / "a-1.0-py3-none-any.whl").unlink()
    (dist / "a-1.0-py3-none-any.whl").write_bytes(b"PK" * 100)
    with pytest.raises(BuildFailed, match="cap"):
        take_wheel(dist, tmp_path / "out", max_bytes=100)
    (dist / "a-1.0-py3-none-any.whl").unlink()
    (dist / "a-1.0-py3-none-any.whl").write_bytes(b"PK")
    taken = take_wheel(dist, tmp_path / "out")
    assert taken.read_bytes() == b"PK" and taken.parent == tmp_path / "out"
    assert stat.S_ISREG(os.lstat(taken).st_mode)
    (dist / "b-1.0-py3-none-any.whl").write_bytes(b"PK")
    with pytest.raises(BuildFailed, match="2 wheels"):
        take_wheel(dist, tmp_path / "out2")
