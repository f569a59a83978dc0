"""The disk cap's measure: allocated blocks, hard links once, no link followed, and only what a
shared directory grows by. (The caps on a sandboxed build, end to end, are in test_wrapper.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wheelhouse.errors import BuildFailed, FailureKind
from worker.sandbox.limits import GIB, DiskQuota

MiB = 1 << 20


def test_disk_quota_counts_allocated_blocks_not_sizes(tmp_path: Path) -> None:
    data = tmp_path / "w"
    data.mkdir()
    with open(data / "sparse", "wb") as f:
        f.truncate(GIB)  # a hole: nothing allocated
    fd = os.open(data / "preallocated", os.O_RDWR | os.O_CREAT)
    os.posix_fallocate(fd, 0, 8 * MiB)
    os.close(fd)
    assert 8 * MiB <= DiskQuota([data], GIB).usage() < 9 * MiB


def test_disk_quota_counts_hard_links_once_and_follows_no_link(tmp_path: Path) -> None:
    data = tmp_path / "w"
    data.mkdir()
    (data / "a").write_bytes(b"x" * MiB)
    os.link(data / "a", data / "b")
    (data / "link").symlink_to("/usr")
    quota = DiskQuota([data], 10 * MiB)
    assert MiB <= quota.usage() < 2 * MiB


def test_disk_quota_counts_only_what_a_shared_directory_grows_by(tmp_path: Path) -> None:
    """The compile cache outlives builds: what earlier builds left there is not this build's."""
    own, cache = tmp_path / "own", tmp_path / "cache"
    own.mkdir()
    cache.mkdir()
    (cache / "earlier").write_bytes(b"x" * 4 * MiB)
    quota = DiskQuota([own], 3 * MiB, every=0, shared=[cache])
    assert quota.usage() < MiB
    quota.check()
    (cache / "mine").write_bytes(b"x" * 2 * MiB)
    (own / "obj").write_bytes(b"x" * 2 * MiB)
    assert 4 * MiB <= quota.usage() < 5 * MiB
    with pytest.raises(BuildFailed) as failed:
        quota.check()
    assert failed.value.kind is FailureKind.TOO_LARGE
