"""Real builds of the fixture CUDA extension with nvcc, ninja and torch 2.14.1 (CUDA 13.0)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.metadata import Metadata

from bench.cold_cache_bench import split
from tests.helpers import run_console
from tests.worker.conftest import CUDAEXT, build_config, make_sdist, require_nvcc
from wheelhouse.builds.maxjobs import learned_job_peaks
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.storage import open_storage
from wheelhouse.provenance import attest, ca
from worker.build import run_build
from worker.steps.publish import log_key

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

SPEC = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])


@dataclass(frozen=True)
class Built:
    config: Config
    done: subprocess.CompletedProcess[str]
    sdist: Path
    workdir: Path


#: Credentials and switches in the worker's environment that must not reach setup.py.
SECRETS = {"AWS_SECRET_ACCESS_KEY": "do-not-leak", "GITHUB_TOKEN": "ghp_do_not_leak",
           "WHEELHOUSE_REDIS_URL": "redis://secret@127.0.0.1/0", "TORCH_CUDA_ARCH_LIST": "5.0"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """One real build of the fixture extension, shared by this module's tests: ``wheelhouse
    build`` run by its path with a minimal ``PATH``, as a unit file runs it, so uv must be
    found through its package and nvcc through the toolkit's directory."""
    require_nvcc()
    tmp = tmp_path_factory.mktemp("built")
    sdist = make_sdist(CUDAEXT, tmp / "sdist", "cudaext", "0.1.0")
    # At sccache's debug level, as a bench asks for to split the cache's time.
    config = build_config(tmp, compile_cache_log="debug")
    done = run_console("build", str(sdist), "--torch", "2.14", "--cuda", "13.0", "--python",
                       "3.11", "--arch", "sm80", "--timeout", "900", "--keep-workspace",
                       config=config, env=SECRETS, cwd=tmp, timeout=1200)
    return Built(config, done, sdist, tmp / "work")


def test_the_console_script_builds_with_a_minimal_path(built: Built) -> None:
    out = built.done
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"published {SPEC.expected_wheel_name} to torch2.14-cu130-sm80" in out.stdout
    phases = [line.removeprefix("==> ") for line in out.stderr.splitlines()
              if line.startswith("==> ")]
    assert phases == ["toolkit", "fetch", "venv", "compile", "check", "publish"]
    bars = [line for line in out.stderr.splitlines() if line.startswith("[#")]
    done, total = bars[-1].split()[1].split("/")
    assert done == total and int(total) >= 2 and bars[-1].endswith("100%")
    assert "MAX_JOBS=" in out.stderr


def test_the_record_says_what_the_build_measured(built: Built) -> None:
    storage = open_storage(built.config)
    catalog = Catalog(storage, 0)
    [record] = catalog.files(SPEC.variant, SPEC.project)
    assert record.filename == SPEC.expected_wheel_name
    assert record.variant.key == "torch2.14-cu130-sm80" and record.archs == ("80",)
    build = record.build
    assert build.max_jobs is not None
    assert build.max_jobs.jobs >= 1 and build.max_jobs.reason.startswith("MAX_JOBS=")
    assert build.max_jobs.reason in built.done.stderr
    assert build.torch is not None and build.torch.startswith("2.14.")
    assert build.toolkit is not None and build.toolkit.startswith("V13.0")
    assert build.peak_job_bytes is not None and build.peak_job_bytes > 0
    assert build.peak_tree_bytes is not None and build.peak_tree_bytes > 0
    # Learned under the job's effective threads (one target: one thread), for the next MAX_JOBS.
    assert build.max_jobs.targets == 1 and build.max_jobs.effective_threads == 1
    # Only the compilers' memory (nvcc and what it runs), under the project's own key.
    learned = learned_job_peaks(storage, "cudaext", "cudaext", "13.0")
    assert list(learned) == [1] and learned[1] == [build.peak_job_bytes]
    assert build.device_code is not None and build.sass_archs == ["80"]
    assert build.patches == ()  # the fixture's recipe has none
    # Its variant form (made in the sandbox by worker.sandbox.untrusted) was published beside it.
    forms = [o.key.rsplit("/", 1)[1] for o in storage.list("records/torch2.14-cu130/cudaext/")
             if o.key != f"records/torch2.14-cu130/cudaext/{record.filename}.json"]
    assert forms == ["cudaext-0.1.0+pt214-cp311-cp311-linux_x86_64-cu130sm80.whl.json"], forms
    # Both say, in their headers, the torch they were built against (issue 30).
    [form] = [r for r in catalog.variant_files("cudaext")]
    for published in (record, form):
        meta = Metadata.from_email(storage.get_bytes(published.metadata_key), validate=False)
        assert [str(r) for r in meta.requires_dist or [] if r.name == "torch"] == \
            ["torch==2.14.*"], published.filename
    # The compile went through this build's sccache server, which counted every compile.
    assert build.compile_cache is not None
    assert build.compile_cache.misses >= 3 and build.compile_cache.errors == 0
    # Both carry signed provenance that verifies against the box's own CA (made in the
    # workspace by the build) and names the toolkit that compiled and the device code found.
    authority = ca.ca_cert_for(built.config)
    for published in (record, form):
        (verified,) = attest.verify_document(storage.get_bytes(published.provenance_key),
                                             authority, published.filename, published.sha256)
        deps = {d["name"]: d["uri"]
                for d in verified.predicate["buildDefinition"]["resolvedDependencies"]}
        assert deps["cuda-toolkit"] == f"pkg:generic/cuda-toolkit@{build.toolkit}"
        [code] = verified.predicate["runDetails"]["byproducts"]
        assert code["annotations"]["sass"] == ["80"]


def test_a_debug_cache_log_times_the_builds_compiles(built: Built) -> None:
    """``WHEELHOUSE_COMPILE_CACHE_LOG=debug`` reaches the build's sccache server: its log in
    the kept workspace times each compile (what ``bench/torch_scatter_generic.py`` splits);
    the worker itself never reads it, and the stored build log does not carry it."""
    [log] = built.workdir.glob("*/sccache/sccache.log")
    timings = split(log)
    assert timings.get("hash_keys", 0) > 0 and timings.get("steps", 0) > 0, timings
    assert "generate_hash_key" not in open_storage(built.config).get_bytes(log_key(SPEC)).decode()


def test_the_log_is_stored_with_the_probe_first_and_no_secret(built: Built) -> None:
    log = open_storage(built.config).get_bytes(log_key(SPEC)).decode()
    assert log.index("wheelhouse: probe: compiling") < log.index("[1/")
    # Each library was loaded the way its package loads it (in the sandbox).
    assert "loaded: import torch" in log and "loaded: import cudaext._C" in log
    assert "device code in cudaext/_C" in log and ": sm_80" in log
    assert "wheelhouse: compile cache: sccache " in log
    assert "do-not-leak" not in log and "ghp_" not in log


def test_setup_py_sees_the_recipe_and_no_credentials(built: Built) -> None:
    # The source sits at one path per project version on the host (so the compile cache hits).
    [env_file] = built.workdir.glob("src/cudaext-0.1.0/cudaext-0.1.0/build-env.json")
    names = set(json.loads(env_file.read_text()))  # what setup.py saw, by name
    assert {"MAX_JOBS", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "WHEELHOUSE_BUILD_ID"} <= names
    assert not {"AWS_SECRET_ACCESS_KEY", "WHEELHOUSE_REDIS_URL", "GITHUB_TOKEN"} & names
    assert not [n for n in names if n.startswith("WHEELHOUSE_") and n != "WHEELHOUSE_BUILD_ID"]


def test_a_second_request_publishes_nothing_new_and_another_python_hits_the_cache(
        built: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = open_storage(built.config)
    [record] = Catalog(storage, 0).files(SPEC.variant, SPEC.project)
    again = run_build(SPEC, config=built.config, storage=storage, source=built.sdist,
                      timeout=60)
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
    second = run_build(other, config=built.config, storage=storage, source=built.sdist,
                       timeout=900)
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


def test_a_compile_error_is_one_line_from_the_probe(tmp_path: Path) -> None:
    """``wheelhouse build`` of a source that doesn't compile: exit 1 with the compiler's first
    error, in one line, after only the probe ran (the heavy translation units never start)."""
    src = tmp_path / "broken"
    shutil.copytree(CUDAEXT, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    add = src / "csrc" / "add.cu"
    add.write_text(add.read_text().replace("out[i] = a[i] + b[i];", "out[i] = a[i] + oops;"))
    sdist = make_sdist(src, tmp_path / "sdist", "cudaext", "0.1.0")
    config = build_config(tmp_path)
    out = run_console("build", str(sdist), "--torch", "2.14", "--cuda", "13.0", "--python",
                      "3.11", "--arch", "sm80", "--timeout", "600", config=config, cwd=tmp_path,
                      timeout=900)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "==> compile" in out.stderr and "MAX_JOBS=" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: build failed [compile-error]: add.cu("), last
    assert 'identifier "oops" is undefined' in last
    assert "Traceback" not in out.stderr
    storage = open_storage(config)
    log = storage.get_bytes(log_key(SPEC)).decode()
    assert "[probe 1/1]" in log and "[1/" not in log and "bindings.cpp" not in log
    assert "FAILED [compile-error]" in log
    assert not list(storage.list("records/"))


def test_a_rebuild_in_another_workspace_hits_every_compile_of_a_kernel_with_torch_headers(
        tmp_path: Path) -> None:
    """A kernel file that includes a header of torch's (as flash-attn's and torch-scatter's
    do), built twice, each time in a new build directory and into another storage: the second
    build hits every compile, the host side of both kernel files too. Every sandboxed build sees
    its venv at ``/wheelhouse/venv`` (worker.sandbox.wrapper.VENV_INSIDE), where torch's
    headers are included from. Checked: this small kernel hits with the venv seen where it lies
    as well, so the test guards the fixed path against breaking the build, not the miss it
    removes; torch-scatter's kernels, which missed their host side in every build before, are
    measured by ``bench/torch_scatter_generic.py`` (docs/benchmarks.md)."""
    src = tmp_path / "cudaext"
    shutil.copytree(CUDAEXT, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    scale = src / "csrc" / "scale.cu"
    # A torch header whose inline code asserts: its __FILE__, the header's absolute path,
    # lands in the host code nvcc's front end writes (as torch's Device.h does for any kernel
    # file that includes ATen).
    scale.write_text("#include <c10/util/llvmMathExtras.h>\n" + scale.read_text() + (
        "\nunsigned long long scale_align(unsigned long long v) "
        "{ return c10::llvm::alignTo(v, 8); }\n"))
    sdist = make_sdist(src, tmp_path / "sdist", "cudaext", "0.1.0")
    first = build_config(tmp_path, storage=str(tmp_path / "data-1"))
    cold = run_build(SPEC, config=first, storage=open_storage(first), source=sdist,
                     timeout=900)
    assert cold.build.compile_cache is not None and cold.build.compile_cache.misses > 0
    second = build_config(tmp_path, storage=str(tmp_path / "data-2"))
    again = run_build(SPEC, config=second, storage=open_storage(second), source=sdist,
                      timeout=900)
    assert not again.already_published
    cache = again.build.compile_cache
    assert cache is not None
    assert cache.misses == 0 and cache.misses_by_language == {}, cache
    assert cache.hits_by_language.get("CUDA", 0) == 2, cache  # add.cu and scale.cu, host side
