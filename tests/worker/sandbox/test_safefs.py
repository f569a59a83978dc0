"""worker.sandbox.safefs: what a build leaves is opened by descriptor, never followed, never
blocks."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from worker.errors import UnsafePath
from worker.sandbox import safefs

SECRET = b"the worker's secret"


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of resolving without links: the kernel's openat2, and the component walk."""
    monkeypatch.setattr(safefs, "USE_OPENAT2", request.param == "openat2")
    return str(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    """A trusted root with a build's directory in it, and a secret outside."""
    (tmp_path / "secret").write_bytes(SECRET)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_bytes(SECRET)
    root = tmp_path / "build"
    (root / "dist").mkdir(parents=True)
    yield root


def _symlink_to_file(root: Path) -> None:
    (root / "dist" / "result").symlink_to(root.parent / "secret")


def _symlink_to_dir(root: Path) -> None:
    (root / "dist" / "result").symlink_to(root.parent / "secrets")


def _symlink_in_parent(root: Path) -> None:
    (root / "dist" / "sub").symlink_to(root.parent / "secrets")


def _relative_escape(root: Path) -> None:
    (root / "dist" / "result").symlink_to("../../secret")


def _fifo(root: Path) -> None:
    os.mkfifo(root / "dist" / "result")


def _device(root: Path) -> None:
    os.mknod(root / "dist" / "result", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero


def _socket(root: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(root / "dist" / "result"))
    s.close()


def _sparse(root: Path) -> None:
    with open(root / "dist" / "result", "wb") as f:
        f.truncate(64 * 1024**3)  # 64 GiB of nothing: reading it would take minutes and RAM


HOSTILE: list[tuple[str, Callable[[Path], None], str, str]] = [
    ("symlink to a file", _symlink_to_file, "dist/result", "link"),
    ("symlink to a directory", _symlink_to_dir, "dist/result/key", "link"),
    ("symlink in a parent", _symlink_in_parent, "dist/sub/key", "link"),
    ("relative link out", _relative_escape, "dist/result", "link"),
    ("FIFO", _fifo, "dist/result", "FIFO"),
    ("device node", _device, "dist/result", "character device"),
    ("socket", _socket, "dist/result", "socket"),
    ("huge sparse file", _sparse, "dist/result", "cap"),
]


@pytest.mark.parametrize(("what", "plant", "rel", "said"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_every_hostile_result_is_refused_without_blocking(
        tree: Path, resolver: str, what: str, plant: Callable[[Path], None], rel: str,
        said: str) -> None:
    if plant is _device and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    plant(tree)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(safefs.read_text(tree, rel, max_bytes=1024 * 1024).encode())
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    # In a thread, so that a FIFO that blocked would fail the test instead of hanging it.
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), f"reading a {what} blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], UnsafePath), outcome
    assert said in str(outcome[0])
    dest = tree.parent / "copied"
    dirfd = safefs.open_dir(tree)
    try:
        with pytest.raises(UnsafePath):
            safefs.copy_out(dirfd, rel, dest, max_bytes=1024 * 1024)
    finally:
        os.close(dirfd)
    assert not dest.exists()


def test_a_regular_file_is_read_and_copied(tree: Path, resolver: str) -> None:
    (tree / "dist" / "deep").mkdir()
    (tree / "dist" / "deep" / "stats.json").write_bytes(b"{}")
    assert safefs.read_text(tree, "dist/deep/stats.json", max_bytes=10) == "{}"
    dirfd = safefs.open_dir(tree)
    try:
        assert safefs.copy_out(dirfd, "dist/deep/stats.json", tree.parent / "out",
                               max_bytes=10) == 2
        with pytest.raises(FileNotFoundError):
            safefs.read_bytes(dirfd, "dist/missing", max_bytes=10)
    finally:
        os.close(dirfd)
    assert (tree.parent / "out").read_bytes() == b"{}"


@pytest.mark.parametrize("rel", ["/etc/passwd", "../secret", "dist/../../secret", "", "a//b"])
def test_names_that_escape_are_refused(tree: Path, rel: str) -> None:
    with pytest.raises(UnsafePath, match="not a plain relative path"):
        safefs.read_text(tree, rel, max_bytes=10)


def test_writing_never_goes_through_what_is_there(tree: Path, resolver: str) -> None:
    (tree / "dist" / "launch").symlink_to(tree.parent / "secrets")
    with pytest.raises(UnsafePath, match="link"):
        safefs.write_new(tree, "dist/launch/key", b"overwritten")
    (tree / "dist" / "file").symlink_to(tree.parent / "secret")
    with pytest.raises(UnsafePath, match="exists already"):
        safefs.write_new(tree, "dist/file", b"overwritten")
    assert (tree.parent / "secret").read_bytes() == SECRET
    assert (tree.parent / "secrets" / "key").read_bytes() == SECRET
    safefs.write_new(tree, "dist/new/entry", b"fresh", mode=0o4755)
    made = tree / "dist" / "new" / "entry"
    assert made.read_bytes() == b"fresh"
    assert stat.S_IMODE(made.stat().st_mode) == 0o755  # never setuid


def test_walk_and_remove_never_follow_links(tree: Path) -> None:
    (tree / "dist" / "a" / "b").mkdir(parents=True)
    (tree / "dist" / "a" / "b" / "f").write_bytes(b"x")
    (tree / "dist" / "a" / "out").symlink_to(tree.parent / "secrets")
    dirfd = safefs.open_dir(tree)
    try:
        found = {e.rel: stat.S_IFMT(e.stat.st_mode) for e in safefs.walk(dirfd)}
    finally:
        os.close(dirfd)
    assert found == {"dist": stat.S_IFDIR, "dist/a": stat.S_IFDIR, "dist/a/b": stat.S_IFDIR,
                     "dist/a/b/f": stat.S_IFREG, "dist/a/out": stat.S_IFLNK}
    safefs.remove_tree(tree)
    assert not tree.exists()
    assert (tree.parent / "secrets" / "key").read_bytes() == SECRET


def test_a_tree_deeper_than_the_cap_is_refused(tmp_path: Path) -> None:
    fd = safefs.open_dir(tmp_path)
    deep = safefs.make_dirs(fd, "/".join(["d"] * 12))
    os.close(deep)
    try:
        with pytest.raises(UnsafePath, match="deeper than 8"):
            list(safefs.walk(fd, max_depth=8))
    finally:
        os.close(fd)


def test_a_sparse_file_under_the_cap_is_not_copied(tree: Path, resolver: str) -> None:
    # A hole costs the build no disk (its cap counts blocks); the copy would write it whole.
    with (tree / "dist" / "x.whl").open("wb") as f:
        f.write(b"PK")
        f.truncate(64 * 1024 * 1024)
    dirfd = safefs.open_dir(tree)
    try:
        with pytest.raises(UnsafePath, match="sparse"):
            safefs.copy_out(dirfd, "dist/x.whl", tree.parent / "out", max_bytes=1024**3)
    finally:
        os.close(dirfd)
    assert not (tree.parent / "out").exists()
