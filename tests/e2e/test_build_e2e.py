"""The build fleet end to end: a real worker, Redis, S3 API, nvcc, the index, and uv.

The fixture extension is enqueued, a real ``wheelhouse worker`` subprocess builds it against
torch 2.14.1 (CUDA 13.0) with real nvcc and ninja, publishes it to a moto S3 server, and
``uv pip install --index-url`` installs it from a running index into a fresh venv, where it
imports. The fresh venv sees torch installed once per test run (from the local torch wheels plus
PyPI for torch's own dependencies) and gets ``cudaext`` with ``--no-deps`` from the index alone:
routing torch through the index's upstream would make uv fetch 3 GB from download.pytorch.org,
and the point here is that *our* wheel installs from *our* index.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import redis

from tests.e2e.conftest import venv_with_torch
from tests.helpers import clean_env, config_env, start_index
from tests.worker.conftest import CUDAEXT, build_config, make_sdist
from wheelhouse.builds import queue as q
from wheelhouse.builds import stats
from wheelhouse.builds.fleet import build_id_prefix, live_workers
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind, UnservableSpec
from wheelhouse.index.storage import open_storage
from worker.build import run_build
from worker.events import BuildEvent, LogLines, Reporter
from worker.steps.publish import log_key
from worker.supervision.reaper import BUILD_ID_ENV, build_id_base, sweep_orphans

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

SPEC = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])


@pytest.fixture
def fleet_config(tmp_path: Path, s3_config: Config, redis_url: str) -> Config:
    return replace(build_config(tmp_path), storage=s3_config.storage,
                   s3_endpoint_url=s3_config.s3_endpoint_url, redis_url=redis_url,
                   worker_heartbeat_seconds=1)


@pytest.fixture
def worker(fleet_config: Config, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``wheelhouse worker`` in its own session, with the config in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(fleet_config))
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen([shutil.which("wheelhouse") or "wheelhouse", "worker",
                             "--name", "e2e-worker"], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    conn = redis.Redis.from_url(fleet_config.redis_url or "")
    try:
        deadline = time.monotonic() + 60
        while not [a for a in live_workers(conn) if a.name == "e2e-worker"]:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the worker never advertised itself"
            time.sleep(0.2)
        yield proc
    finally:
        _stop_worker(proc, conn)
        log.close()
        conn.close()


def _stop_worker(proc: subprocess.Popen[bytes], conn: redis.Redis) -> None:
    """Stop the worker and everything it started, even after a failed test mid-build.

    RQ's first SIGTERM waits for the running job, the second kills the work horse (which has
    its own process group); the build tree is then found by its fleet's cookie.
    """
    try:
        started = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        started = []
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for child in started:
        with contextlib.suppress(psutil.Error):
            child.kill()
    report = sweep_orphans(set(), id_prefix=build_id_prefix(conn), grace=2)
    assert report.survivors == 0


def test_enqueue_build_publish_install_import(
    fleet_config: Config, worker: subprocess.Popen[bytes], cudaext_sdist: Path, tmp_path: Path,
    torch_site: Path,
) -> None:
    conn = redis.Redis.from_url(fleet_config.redis_url or "")
    [ad] = live_workers(conn)
    assert "build-cu130-x86_64" in ad.queues and ad.hostname == socket.gethostname()

    # The same spec twice: one build.
    first = q.enqueue_build(conn, SPEC, source=str(cudaext_sdist), timeout=900)
    second = q.enqueue_build(conn, SPEC, source=str(cudaext_sdist), timeout=900)
    assert first.created and not second.created and first.job_id == second.job_id

    # Issue 21: a worker not told to provision CUDA 12.x (and with no 12.x toolkit) does not
    # advertise it; the refusal names the setting that would.
    assert "build-cu128-x86_64" not in ad.queues and ad.provisionable == ()
    with pytest.raises(UnservableSpec, match=r"WHEELHOUSE_TOOLKIT_PROVISION names 12\.8"):
        q.enqueue_build(conn, BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.8",
                                               cuda="12.8"))
    # A spec no live worker serves gets a clear answer, not a job that waits forever (NVIDIA
    # publishes no CUDA 11 toolkit wheels).
    with pytest.raises(UnservableSpec, match=r"no live worker can build for CUDA 11\.8"):
        q.enqueue_build(conn, BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.8",
                                               cuda="11.8"))

    listing = subprocess.run(["wheelhouse", "workers"],
                             capture_output=True, text=True,
                             env={**os.environ, **config_env(fleet_config)}, check=True)
    assert "e2e-worker" in listing.stdout and "build-cu130-x86_64" in listing.stdout

    # Watch it build: state, phase and the live log come from Redis while it runs.
    seen_states: set[q.BuildState] = set()
    seen_phases: set[str] = set()
    log_lines: list[str] = []
    offset = 0
    deadline = time.monotonic() + 900
    while True:
        status = q.get_build(conn, first.job_id)
        assert status is not None
        seen_states.add(status.state)
        if status.phase:
            seen_phases.add(status.phase)
        lines, offset = q.log_since(conn, first.job_id, offset)
        log_lines.extend(lines)
        if status.finished:
            break
        assert time.monotonic() < deadline, "the build took too long"
        assert worker.poll() is None, "the worker died"
        time.sleep(0.5)
    assert status.state is q.BuildState.BUILT, (status.reason, log_lines[-40:])
    assert q.BuildState.BUILDING in seen_states
    assert {"venv", "compile"} <= seen_phases
    assert status.wheel == SPEC.expected_wheel_name
    assert status.max_jobs is not None and (status.max_jobs_reason or "").startswith("MAX_JOBS=")
    assert status.progress is not None and status.progress[0] == status.progress[1]
    # The job's meta carries what the build measured, as the record does.
    assert status.build.max_jobs is not None and status.build.max_jobs.jobs == status.max_jobs
    assert status.build.peak_tree_bytes and status.build.seconds
    assert any("[probe 1/1]" in line for line in log_lines)
    # The advert shows the worker idle again by its next heartbeat (1 s here).
    deadline = time.monotonic() + 10
    while [a.current_job for a in live_workers(conn)] != [None]:
        assert time.monotonic() < deadline, live_workers(conn)
        time.sleep(0.2)

    storage = open_storage(fleet_config)
    log = storage.get_bytes(log_key(SPEC)).decode()
    assert "loaded: import cudaext._C" in log
    # Device code and the compile cache's counts are build facts; the cache's entries went to
    # the bucket, under their own prefix, for the next build on any host.
    assert status.build.sass_archs == ["80"]
    assert status.build.compile_cache is not None and status.build.compile_cache.misses >= 3
    assert "compile cache: 0 of 0 entries fetched from storage" in log
    assert list(storage.list("sccache/cudaext/cu130/"))
    assert not q.enqueue_build(conn, SPEC).created  # finished: returned as is

    with start_index(fleet_config, tmp_path) as url:
        root = f"{url}/torch2.14-cu130-sm80/simple"
        with urllib.request.urlopen(f"{root}/cudaext/") as resp:
            assert SPEC.expected_wheel_name in resp.read().decode()
        python = venv_with_torch(tmp_path / "fresh", torch_site)
        uv = shutil.which("uv") or "uv"
        env = clean_env()
        subprocess.run([uv, "pip", "install", "--python", str(python), "--index-url", root,
                        "--no-deps", "cudaext"], env=env, check=True)
    out = subprocess.run(
        [str(python), "-W", "ignore", "-c",
         "import importlib.metadata as m, cudaext; "
         "print(m.version('cudaext'), cudaext.kernels, cudaext.add.__doc__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert out.stdout.split()[0] == "0.1.0+cu130torch2.14.sm80"
    assert "['add', 'scale']" in out.stdout and "a + b on CUDA" in out.stdout


def test_a_compile_error_fails_once_with_its_reason(
    fleet_config: Config, worker: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    src = tmp_path / "broken"
    shutil.copytree(CUDAEXT, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    scale = src / "csrc" / "scale.cu"
    scale.write_text(scale.read_text().replace("x[i] * factor", "x[i] * factr"))
    broken = BuildSpec.create("cudaext", "0.0.1", python="3.11", torch="2.14", cuda="13.0",
                              archs=["80"])
    sdist = make_sdist(src, tmp_path / "sdist", "cudaext", "0.0.1")
    conn = redis.Redis.from_url(fleet_config.redis_url or "")
    ended = stats.snapshot(conn).builds_ended.get(FailureKind.COMPILE_ERROR.value, 0)
    q.enqueue_build(conn, broken, source=str(sdist), timeout=600)
    deadline = time.monotonic() + 600
    while not (status := q.get_build(conn, broken.job_id)) or not status.finished:
        assert time.monotonic() < deadline and worker.poll() is None
        time.sleep(0.5)
    assert status.state is q.BuildState.FAILED
    assert status.failure_kind is FailureKind.COMPILE_ERROR
    assert status.reason == 'scale.cu(6): error: identifier "factr" is undefined'
    assert status.build.seconds is not None and status.build.toolkit is not None
    # Not retried: another attempt can't fix a compile error (the job had one retry for
    # abandonment by a dead worker). RQ marks a job failed only once it decided against a
    # retry, and the worker counts every attempt it ends: a retry would have counted two.
    assert stats.snapshot(conn).builds_ended.get(FailureKind.COMPILE_ERROR.value) == ended + 1
    assert not q.enqueue_build(conn, broken, source=str(sdist)).created
    log = open_storage(fleet_config).get_bytes(log_key(broken)).decode()
    assert "FAILED [compile-error]" in log


# --- the real flash-attn sdist ----------------------------------------------------------------

def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/flash-attn/", timeout=10):
            return True
    except OSError:
        return False


def _build_processes(build_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            # The build's cookie is its id plus a suffix of its own.
            if build_id_base(proc.environ().get(BUILD_ID_ENV, "")) == build_id:
                found.append(proc)
        except psutil.Error:
            continue
    return found


class _StopWhenNvccRuns(Reporter):
    """Cancels the build once real nvcc/cicc processes of this build exist (and says so)."""

    def __init__(self, build_id: str) -> None:
        self.build_id = build_id
        self.compilers: list[str] = []
        self.nvcc_argv: list[list[str]] = []
        self.log: list[str] = []

    def report(self, event: BuildEvent) -> None:
        if isinstance(event, LogLines):
            self.log.extend(event.lines)

    def should_cancel(self) -> bool:
        names = []
        for proc in _build_processes(self.build_id):
            try:
                name, argv = proc.name(), proc.cmdline()
                if name == "nvcc" and "-E" in argv:
                    continue  # the compile cache asking nvcc what it is: no compile yet
                names.append(name)
                if name == "nvcc":
                    self.nvcc_argv.append(argv)
            except psutil.Error:
                continue
        compilers = [n for n in names if n in ("nvcc", "cicc", "cudafe++", "ptxas")]
        if compilers:
            self.compilers = compilers
        return bool(compilers)


FLASH = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.14", cuda="13.0",
                         archs=["80"])


@pytest.fixture
def pypi() -> None:
    if not _pypi_reachable():
        pytest.skip("pypi.org is not reachable from here")


@pytest.mark.usefixtures("pypi")
def test_flash_attn_sdist_build_starts_and_is_stopped(tmp_path: Path) -> None:
    config = build_config(tmp_path)
    storage = open_storage(config)
    build_id = "build-e2e-flash-stop"
    reporter = _StopWhenNvccRuns(build_id)
    with pytest.raises(BuildFailed) as err:
        run_build(FLASH, config=config, storage=storage, reporter=reporter, timeout=900,
                  build_id=build_id)
    assert err.value.kind is FailureKind.CANCELLED, storage.get_bytes(
        log_key(FLASH)).decode()[-3000:]
    assert reporter.compilers, "no nvcc was seen"
    log = "\n".join(reporter.log)
    assert "sha256 verified: flash_attn-2.8.3.tar.gz" in log
    # The recipe's patch made it C++20 for torch 2.14, so the probe passed and the kernels ran.
    assert "patch flash-attn/cxx20 applied: Compile as C++20" in log
    # The recipe's FLASH_ATTN_CUDA_ARCHS reached setup.py: only sm80 is compiled.
    assert reporter.nvcc_argv
    for argv in reporter.nvcc_argv:
        line = " ".join(argv)
        assert "arch=compute_80" in line and "compute_90" not in line, line
        assert any(a.endswith(".cu") for a in argv)
    assert "MAX_JOBS=" in log
    assert _build_processes(build_id) == []  # stopped means stopped: zero survivors
    assert not list(storage.list("records/"))


@pytest.mark.usefixtures("pypi")
def test_flash_attn_2_8_3_with_torch_2_14_is_incompatible_in_one_line(tmp_path: Path) -> None:
    """flash-attn 2.8.3 compiles as C++17; torch 2.14's headers need C++20. Without the recipe's
    patch (a recipe directory whose flash-attn recipe lacks it), the probe says so."""
    from wheelhouse.recipes.book import BUILTIN_DIR

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    text = (BUILTIN_DIR / "flash-attn.toml").read_text()
    (recipes / "flash-attn.toml").write_text(text[:text.index("[[patch]]")])
    config = build_config(tmp_path, recipe_dirs=str(recipes))
    storage = open_storage(config)
    started = time.monotonic()
    with pytest.raises(BuildFailed) as err:
        run_build(FLASH, config=config, storage=storage, timeout=900)
    assert err.value.kind is FailureKind.INCOMPATIBLE, err.value.reason
    assert err.value.reason == (
        "flash-attn 2.8.3 compiles as C++17, but torch 2.14's headers need C++20 "
        "(std::strong_ordering); this combination needs a newer flash-attn")
    assert time.monotonic() - started < 600
    log = storage.get_bytes(log_key(FLASH)).decode()
    assert "[probe 1/1]" in log and "FAILED [incompatible]" in log
