"""Real builds of the fixture CUDA extension with nvcc, ninja and torch 2.14.1 (CUDA 13.0)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.worker.conftest import CUDAEXT, build_config, make_sdist
from wheelhouse.buildspec import BuildSpec
from wheelhouse.catalog import Catalog
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.maxjobs import learned_per_thread
from wheelhouse.storage import open_storage
from worker.build import Reporter, log_key, run_build

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

SPEC = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])


class Recorder(Reporter):
    def __init__(self) -> None:
        self.phases: list[str] = []
        self.progress_seen: list[tuple[int, int]] = []
        self.log: list[str] = []
        self.notes: dict[str, Any] = {}

    def phase(self, name: str) -> None:
        self.phases.append(name)

    def progress(self, done: int, total: int) -> None:
        self.progress_seen.append((done, total))

    def lines(self, lines: list[str]) -> None:
        self.log.extend(lines)

    def note(self, **fields: Any) -> None:
        self.notes.update(fields)


def test_fixture_extension_builds_checks_and_publishes(
    tmp_path: Path, cudaext_sdist: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Secrets in the worker's environment must not reach setup.py.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    monkeypatch.setenv("WHEELHOUSE_REDIS_URL", "redis://secret@127.0.0.1/0")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_do_not_leak")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "5.0")
    config = build_config(tmp_path)
    storage = open_storage(config)
    reporter = Recorder()

    result = run_build(SPEC, config=config, storage=storage, reporter=reporter,
                       source=cudaext_sdist, timeout=900, keep_workspace=True)

    record = result.record
    assert record.filename == SPEC.expected_wheel_name
    assert record.variant.key == "torch2.14-cu130-sm80" and record.archs == ("80",)
    assert reporter.phases == ["toolkit", "fetch", "venv", "compile", "check", "publish"]
    done, total = reporter.progress_seen[-1]
    assert done == total >= 2
    build = record.build
    assert build.max_jobs is not None
    assert build.max_jobs.jobs >= 1 and build.max_jobs.reason.startswith("MAX_JOBS=")
    assert reporter.notes["max_jobs_reason"] == build.max_jobs.reason
    assert build.torch is not None and build.torch.startswith("2.14.")
    assert build.toolkit is not None and build.toolkit.startswith("V13.0")
    assert build.peak_job_bytes is not None and build.peak_job_bytes > 0
    assert learned_per_thread(storage, "cudaext", "13.0") is not None  # feeds the next MAX_JOBS

    # The index lists it, under the narrowed variant.
    catalog = Catalog(storage)
    catalog.refresh()
    files = catalog.files(SPEC.variant, SPEC.project)
    assert [r.filename for r in files] == [SPEC.expected_wheel_name]

    # The log went to storage beside the record, with the probe compile first.
    log = storage.get_bytes(log_key(SPEC)).decode()
    assert log.index("wheelhouse: probe: compiling") < log.index("[1/")
    # Each library was loaded the way its package loads it; what the wheel holds is recorded.
    assert "loaded: import torch" in log and "loaded: import cudaext._C" in log
    assert build.device_code is not None and build.sass_archs == ["80"]
    assert "device code in cudaext/_C" in log and ": sm_80" in log
    assert build.patches == ()  # the fixture's recipe has none
    # The compile went through this build's sccache server, which counted every compile.
    assert build.compile_cache is not None
    assert build.compile_cache.misses >= 3 and build.compile_cache.errors == 0
    assert "wheelhouse: compile cache: sccache " in log
    assert "do-not-leak" not in log and "ghp_" not in log

    # What setup.py saw: the recipe's settings, no credentials, no worker configuration. The
    # source sits at one path per project version on the host (so the compile cache hits).
    [env_file] = (tmp_path / "work" / "src").glob("cudaext-0.1.0/cudaext-0.1.0/build-env.json")
    names = set(json.loads(env_file.read_text()))
    assert {"MAX_JOBS", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "WHEELHOUSE_BUILD_ID"} <= names
    assert not {"AWS_SECRET_ACCESS_KEY", "WHEELHOUSE_REDIS_URL", "GITHUB_TOKEN"} & names
    assert not [n for n in names if n.startswith("WHEELHOUSE_") and n != "WHEELHOUSE_BUILD_ID"]

    # A second request for the same wheel publishes nothing new.
    again = run_build(SPEC, config=config, storage=storage, source=cudaext_sdist, timeout=60)
    assert again.already_published and again.record.sha256 == record.sha256

    # Another Python for the same torch x CUDA x arch: only what includes Python.h (the
    # binding) is compiled again; every kernel comes from the cache.
    other = BuildSpec.create("cudaext", "0.1.0", python="3.12", torch="2.14", cuda="13.0",
                             archs=["sm80"])
    python312 = _find_python("3.12")
    if python312 is None:
        pytest.skip("no Python 3.12 for uv here")
    # Where uv finds it, since the build's environment drops pyenv's PYENV_VERSION.
    monkeypatch.setenv("PATH", f"{python312.parent}:{os.environ['PATH']}")
    second = run_build(other, config=config, storage=storage, source=cudaext_sdist, timeout=900)
    cache = second.record.build.compile_cache
    assert cache is not None
    assert cache.misses_by_language.keys() <= {"C/C++"}, cache  # bindings.cpp only
    assert cache.hits_by_language.get("CUDA", 0) >= 2, cache  # add.cu, scale.cu


def _find_python(version: str) -> Path | None:
    """An interpreter of ``version`` (pyenv's shims answer only when told which one)."""
    import subprocess

    uv = shutil.which("uv") or "uv"
    out = subprocess.run([uv, "python", "find", version], capture_output=True, text=True,
                         check=False, env={**os.environ, "PYENV_VERSION": version})
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def test_a_cpu_only_build_under_a_cuda_label_is_not_published(tmp_path: Path) -> None:
    """What torch-scatter did without FORCE_CUDA: compile only CPU code. The worker reads the
    wheel's libraries and refuses to publish it as +cu130 (generic recipe, no recipe of its own)."""
    from tests.worker.conftest import OPSEXT

    sdist = make_sdist(OPSEXT, tmp_path / "sdist", "opsext", "0.1.0")
    config = build_config(tmp_path)
    storage = open_storage(config)
    spec = BuildSpec.create("opsext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                            archs=["sm80"])
    with pytest.raises(BuildFailed) as err:
        run_build(spec, config=config, storage=storage, source=sdist, timeout=900)
    assert err.value.kind is FailureKind.NO_DEVICE_CODE == "no-device-code"
    assert err.value.reason.startswith("opsext-0.1.0+cu130torch2.14.sm80-cp311-cp311-")
    assert "holds no GPU device code in its 2 shared libraries (asked for sm_80)" \
        in err.value.reason
    assert err.value.facts is not None and err.value.facts.recipe == "generic"
    found = err.value.facts.device_code or {}
    assert len(found) == 2 and all(code == {"sass": [], "ptx": []} for code in found.values())
    log = storage.get_bytes(log_key(spec)).decode()
    assert "device code in opsext/_ops" in log and "FAILED [no-device-code]" in log
    assert not list(storage.list("records/")) and not list(storage.list("wheels/"))


def test_a_compile_error_surfaces_from_the_probe(tmp_path: Path) -> None:
    src = tmp_path / "broken"
    shutil.copytree(CUDAEXT, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    add = src / "csrc" / "add.cu"
    add.write_text(add.read_text().replace("out[i] = a[i] + b[i];", "out[i] = a[i] + oops;"))
    sdist = make_sdist(src, tmp_path / "sdist", "cudaext", "0.1.0")
    config = build_config(tmp_path)
    storage = open_storage(config)

    with pytest.raises(BuildFailed) as err:
        run_build(SPEC, config=config, storage=storage, source=sdist, timeout=900)

    assert err.value.kind is FailureKind.COMPILE_ERROR
    assert err.value.reason.startswith("add.cu(")
    assert 'identifier "oops" is undefined' in err.value.reason
    log = storage.get_bytes(log_key(SPEC)).decode()
    # Only the probe ran: the heavy translation units were never started.
    assert "[probe 1/1]" in log and "[1/" not in log and "bindings.cpp" not in log
    assert "FAILED [compile-error]" in log
    assert not list(storage.list("records/"))


def test_wheelhouse_build_exits_non_zero_with_the_reason(tmp_path: Path) -> None:
    import os
    import subprocess

    from tests.helpers import config_env

    src = tmp_path / "broken"
    shutil.copytree(CUDAEXT, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    (src / "csrc" / "add.cu").write_text("this is not C++\n")
    sdist = make_sdist(src, tmp_path / "sdist", "cudaext", "0.1.0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(build_config(tmp_path)))
    out = subprocess.run(
        [shutil.which("wheelhouse") or "wheelhouse", "build", str(sdist), "--torch", "2.14",
         "--cuda", "13.0", "--python", "3.11", "--arch", "sm80", "--timeout", "600"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert out.returncode == 1, out.stderr
    assert "==> compile" in out.stderr and "MAX_JOBS=" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "Error: build failed [compile-error]: add.cu(1): error:")
    assert "Traceback" not in out.stderr


def test_wheelhouse_build_publishes_to_the_configured_storage(tmp_path: Path) -> None:
    """The single-box command without Redis: build, check, publish, exit 0."""
    import os
    import subprocess

    from tests.helpers import config_env

    sdist = make_sdist(CUDAEXT, tmp_path / "sdist", "cudaext", "0.1.0")
    config = build_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    out = subprocess.run(
        [shutil.which("wheelhouse") or "wheelhouse", "build", str(sdist), "--torch", "2.14",
         "--cuda", "13.0", "--python", "3.11", "--arch", "sm80", "--timeout", "900"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert SPEC.expected_wheel_name in out.stdout + out.stderr
    catalog = Catalog(open_storage(config), 0)
    [record] = catalog.files(SPEC.variant, SPEC.project)  # type: ignore[arg-type]
    assert record.filename == SPEC.expected_wheel_name
    # The record says what MAX_JOBS was chosen and why, and what the build measured.
    assert record.build.max_jobs is not None
    assert record.build.max_jobs.reason.startswith("MAX_JOBS=")
    assert record.build.toolkit is not None and record.build.toolkit.startswith("V13.0")
    assert record.build.peak_tree_bytes is not None and record.build.peak_tree_bytes > 0
