"""The build pipeline's parts that need no nvcc: classification, sdist fetching, environment."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import psutil
import pytest

from tests.helpers import QuietHandler, fake_cuda_toolkit, free_port, run_console, serve_http
from tests.worker.conftest import FIXTURES, build_config, make_sdist
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind, InfrastructureError, StorageUnavailable
from wheelhouse.index.layout import Record
from wheelhouse.index.storage import Storage, make_s3_client, open_storage
from wheelhouse.provenance import attest, ca
from wheelhouse.retry import BUILD_STEPS, RetryPolicy
from worker.build import BuildResult, run_build
from worker.cli import parse_target
from worker.events import BuildEvent, LogLines, Measured, PhaseBegan, Reporter
from worker.failures import classify_log, with_retries
from worker.sandbox.untrusted import extension_modules, unpack
from worker.sandbox.wrapper import VENV_INSIDE, Sandbox
from worker.sdist import download_sdist, find_sdist
from worker.steps.publish import log_key
from worker.supervision.reaper import BUILD_ID_ENV, build_id_base
from worker.supervision.runner import UNSANDBOXED

FA = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.14", cuda="13.0")

# Trimmed from a real flash-attn 2.8.3 build against torch 2.14.1 with nvcc 13.0.
CXX20_LOG = """\
[1/96] /usr/local/cuda-13.0/bin/nvcc -c csrc/flash_attn/src/flash_fwd_hdim128_fp16_sm80.cu \
-std=c++17 --use_fast_math
FAILED: /w/build/temp.linux-x86_64-cpython-311/csrc/flash_attn/src/flash_fwd_hdim128_fp16_sm80.o
/w/venv/lib/python3.11/site-packages/torch/include/torch/csrc/api/include/torch/all.h:5:2: \
error: #error C++20 or later compatible compiler is required to use PyTorch.
/w/venv/lib/python3.11/site-packages/torch/include/c10/util/intrusive_ptr.h(80): error: \
namespace "std" has no member "strong_ordering"
ninja: build stopped: subcommand failed.
"""


@pytest.mark.parametrize(
    ("log", "kind", "reason"),
    [
        (CXX20_LOG, FailureKind.INCOMPATIBLE,
         "flash-attn 2.8.3 compiles as C++17, but torch 2.14's headers need C++20"),
        ("RuntimeError:\nThe detected CUDA version (12.8) mismatches the version that was used "
         "to compile\nPyTorch (13.0). Please make sure to use the same CUDA versions.",
         FailureKind.INCOMPATIBLE, "nvcc 12.8 does not match the CUDA 13.0"),
        ("nvcc fatal   : Unsupported gpu architecture 'compute_61'", FailureKind.INCOMPATIBLE,
         "does not support GPU architecture compute_61"),
        ("FAILED: /w/build/x/flash_bwd_hdim256_fp16_sm80.o\n"
         "nvcc error   : 'cicc' died due to signal 9 (Kill signal)\n",
         FailureKind.OOM,
         "killed for lack of memory while compiling flash_bwd_hdim256_fp16_sm80.o"),
        ("FAILED: /w/build/add.o\n/w/src/csrc/add.cu(7): error: identifier \"oops\" is undefined\n"
         "1 error detected", FailureKind.COMPILE_ERROR, 'add.cu(7): error: identifier "oops"'),
        ("FAILED: /w/build/b.o\n/w/src/csrc/b.cpp:3:1: error: expected ';' before '}' token\n",
         FailureKind.COMPILE_ERROR, "b.cpp:3:1: error: expected ';'"),
        ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'einops'\n",
         FailureKind.COMPILE_ERROR, "No module named 'einops'"),
        ("  Running command Preparing metadata (pyproject.toml)\n  cext: no CUDA_HOME\n"
         "  error: subprocess-exited-with-error\n\n  \u00d7 Preparing metadata (pyproject.toml) "
         "did not run successfully.\n  │ exit code: 1\nerror: metadata-generation-failed\n"
         "hint: See above for details.\n", FailureKind.COMPILE_ERROR,
         "the build failed: cext: no CUDA_HOME"),
        ("FAILED: /w/build/a.o\n/usr/bin/ld: final link failed: No space left on device\n",
         FailureKind.TOO_LARGE, "ran out of disk space"),
    ],
)
def test_classify_says_why_in_one_line(log: str, kind: FailureKind, reason: str) -> None:
    found = classify_log(log, FA)
    assert found.kind is kind
    assert reason in found.reason
    assert "\n" not in found.reason and len(found.reason) <= 300
    assert "/w/" not in found.reason  # workspace paths are noise


def test_governor_verdict_makes_it_oom() -> None:
    assert classify_log("ninja: build stopped", FA, oom=True).kind is FailureKind.OOM


@pytest.mark.parametrize("error", [InfrastructureError("503"),
                                   StorageUnavailable("S3 bucket 'b': get k: SlowDown")])
def test_infrastructure_failures_are_retried_then_classified(error: Exception) -> None:
    calls: list[float] = []
    said: list[str] = []
    with pytest.raises(BuildFailed) as err:
        with_retries(BUILD_STEPS, "uploading", lambda: (_ for _ in ()).throw(error),
                     say=said.append, sleep=calls.append)
    assert calls == [2, 10, 30]  # BUILD_STEPS: four attempts
    assert len(said) == 3 and said[0].startswith("uploading failed (")
    assert err.value.kind is FailureKind.INFRASTRUCTURE
    assert f"after 4 attempts: {error}" in err.value.reason
    flaky = iter([error, None])

    def once_flaky() -> str:
        exc = next(flaky)
        if exc:
            raise exc
        return "ok"

    assert with_retries(BUILD_STEPS, "x", once_flaky, sleep=calls.append) == "ok"


def test_a_build_whose_storage_is_unreachable_fails_as_infrastructure(
        tmp_path: Path, cudaext_sdist: Path, s3_env: dict[str, str]) -> None:
    """Storage errors reach the worker as StorageUnavailable, retried, then classified."""
    dead = f"http://127.0.0.1:{free_port()}"
    config = build_config(tmp_path, storage="s3://wheels", s3_endpoint_url=dead)
    storage = open_storage(config, s3_client=make_s3_client(
        config, policy=RetryPolicy(attempts=1, timeout=2)))
    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0")
    started = time.monotonic()
    with pytest.raises(BuildFailed) as err:
        run_build(spec, config=config, storage=storage, source=cudaext_sdist,
                  retry=RetryPolicy(attempts=2, delays=(0,), retry_on=BUILD_STEPS.retry_on))
    assert err.value.kind is FailureKind.INFRASTRUCTURE
    assert "reading storage failed after 2 attempts" in err.value.reason
    assert "S3 bucket 'wheels'" in err.value.reason and "Could not connect" in err.value.reason
    assert time.monotonic() - started < 60


# --- sdists from an index, over real HTTP ---------------------------------------------------

class _Index(QuietHandler):
    files: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")
        if parts[0] == "files" and parts[-1] in self.files:
            self.send_body(self.files[parts[-1]], "application/octet-stream")
        elif len(parts) == 2 and parts[1] == "demo-ext":
            data = self.files["demo_ext-1.0.tar.gz"]
            good = hashlib.sha256(data).hexdigest()
            sha = {"json": good, "html": good, "bad": "0" * 64, "nohash": None}[parts[0]]
            if parts[0] == "html":
                body = (f'<a href="../../files/demo_ext-1.0.tar.gz#sha256={sha}">'
                        "demo_ext-1.0.tar.gz</a>").encode()
                self.send_body(body, "text/html")
            else:
                files = [{"filename": "demo_ext-1.0.tar.gz",
                          "url": "../../files/demo_ext-1.0.tar.gz",
                          "hashes": {"sha256": sha} if sha else {}},
                         {"filename": "demo_ext-0.9.tar.gz", "url": "../../files/x",
                          "hashes": {"sha256": "1" * 64}}]
                page = {"meta": {"api-version": "1.0"}, "files": files}
                self.send_body(json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json")
        else:
            self.send_error(404)



@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    src = tmp_path / "demo"
    (src / "demo_ext").mkdir(parents=True)
    (src / "setup.py").write_text("from setuptools import setup\nsetup(name='demo-ext')\n")
    from tests.worker.conftest import make_sdist

    _Index.files = {"demo_ext-1.0.tar.gz": make_sdist(src, tmp_path, "demo_ext", "1.0")
                    .read_bytes()}
    with serve_http(_Index) as url:
        yield url


@pytest.mark.parametrize("flavour", ["json", "html"])
def test_fetch_verifies_and_unpacks(index: str, tmp_path: Path, flavour: str) -> None:
    link = find_sdist(f"{index}/{flavour}/", "Demo_Ext", "1.0")
    assert link.filename == "demo_ext-1.0.tar.gz" and link.url.startswith(index + "/files/")
    path = download_sdist(link, tmp_path / "dl")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == link.sha256
    project = unpack(path, tmp_path / "src")
    assert (project / "setup.py").is_file() and project.name == "demo_ext-1.0"


def test_fetch_refuses_bad_or_missing_hashes_and_versions(index: str, tmp_path: Path) -> None:
    with pytest.raises(BuildFailed, match="does not match") as mismatch:
        download_sdist(find_sdist(f"{index}/bad/", "demo-ext", "1.0"), tmp_path / "dl")
    assert mismatch.value.kind is FailureKind.UNVERIFIED_SOURCE
    assert not list((tmp_path / "dl").iterdir())  # no partial file left behind
    with pytest.raises(BuildFailed, match="no sha256") as missing:
        download_sdist(find_sdist(f"{index}/nohash/", "demo-ext", "1.0"), tmp_path / "dl")
    assert missing.value.kind is FailureKind.UNVERIFIED_SOURCE
    with pytest.raises(BuildFailed, match=r"demo-ext 2\.0 has no sdist"):
        find_sdist(f"{index}/json/", "demo-ext", "2.0")
    with pytest.raises(BuildFailed, match="has no sdist"):
        find_sdist(f"{index}/json/", "unknown-project", "1.0")
    with pytest.raises(InfrastructureError):
        find_sdist("http://127.0.0.1:9/simple/", "demo-ext", "1.0")  # nothing listens


def test_unpack_refuses_escaping_members(tmp_path: Path) -> None:
    import tarfile

    evil = tmp_path / "evil-1.0.tar.gz"
    with tarfile.open(evil, "w:gz") as tf:
        info = tarfile.TarInfo("../../escaped.txt")
        tf.addfile(info)
    with pytest.raises(BuildFailed) as failed:
        unpack(evil, tmp_path / "out")
    assert failed.value.kind == FailureKind.UNSAFE_ARCHIVE  # one line, not a traceback
    assert not (tmp_path.parent / "escaped.txt").exists()


def test_extension_modules(tmp_path: Path) -> None:
    wheel = tmp_path / "x-1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("pkg/__init__.py", "pkg/_C.cpython-311-x86_64-linux-gnu.so",
                     "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so",
                     "x-1.0.data/data/lib.so", "x-1.0.dist-info/METADATA"):
            zf.writestr(name, b"")
    assert extension_modules(wheel) == ["flash_attn_2_cuda", "pkg._C"]


@pytest.mark.parametrize(
    ("target", "expected"),
    [("flash-attn==2.8.3", ("flash-attn", "2.8.3", None)),
     ("Flash_Attn === 2.8.3.post1", ("Flash_Attn", "2.8.3.post1", None))],
)
def test_parse_target(target: str, expected: tuple[str, str, None]) -> None:
    assert parse_target(target) == expected


@pytest.mark.parametrize("target", ["flash-attn", "flash-attn>=2.8", "flash-attn==2.*",
                                    "flash-attn==2.8.3,!=2.8.2", "; rm -rf /"])
def test_parse_target_wants_one_exact_version(target: str) -> None:
    from wheelhouse.errors import InvalidBuildSpec

    with pytest.raises(InvalidBuildSpec):
        parse_target(target)


def test_build_cli_rejects_bad_input_without_a_traceback(tmp_path: Path) -> None:
    out = subprocess.run(
        [shutil.which("wheelhouse") or "wheelhouse", "build", "flash-attn==2.8.3",
         "--torch", "2.14", "--cuda", "10.2"], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "WHEELHOUSE_STORAGE": str(tmp_path / "data")})
    assert out.returncode == 2
    assert "unknown CUDA version '10.2'" in out.stderr and "Traceback" not in out.stderr


def test_timeout_kills_the_build_and_stores_the_log(tmp_path: Path, cudaext_sdist: Path) -> None:
    """A 2 s deadline hits while uv installs torch: classified, logged, and nothing survives."""
    if shutil.which("uv") is None:
        pytest.skip("uv is not installed")
    config = build_config(tmp_path)
    storage = open_storage(config)
    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                            archs=["80"])
    toolkit = ToolkitInfo(cuda="13.0", home="/nonexistent", nvcc="/nonexistent/bin/nvcc")
    with pytest.raises(BuildFailed) as err:
        run_build(spec, config=config, storage=storage, source=cudaext_sdist, timeout=2,
                  toolkits=[toolkit], build_id="build-timeout-test")
    assert err.value.kind is FailureKind.TIMEOUT
    assert "2 s deadline" in err.value.reason
    log = storage.get_bytes(log_key(spec)).decode()
    assert "FAILED [timeout]" in log and "uv" in log
    survivors = []
    for proc in psutil.process_iter():
        try:
            if build_id_base(proc.environ().get(BUILD_ID_ENV, "")) == "build-timeout-test":
                survivors.append(proc)
        except psutil.Error:
            continue
    assert survivors == []
    # The workspace is removed, and the unpacked source; only the source path's lock stays,
    # and the worker's own directory (the seccomp filter, the build uids' locks).
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == [".sandbox", "src"]
    assert [p.name for p in (tmp_path / "work" / "src").iterdir()] == ["cudaext-0.1.0.lock"]


# --- whole builds in the sandbox, of a C extension (no nvcc) -----------------------------

CEXT = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])


def _cext_sdist(tmp_path: Path, name: str = "cext", **options: object) -> Path:
    """The C extension fixture as an sdist, with ``build-options.json`` (sleep, print_mib)."""
    src = tmp_path / f"{name}-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "build-options.json").write_text(json.dumps(options))
    return make_sdist(src, tmp_path / f"{name}-sdist", "cext", "0.1.0")


@pytest.fixture
def toolkit(tmp_path: Path) -> ToolkitInfo:
    """A CUDA 13.0 toolkit's layout: the C extension needs no nvcc, only a toolkit to pick."""
    home = fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")
    return ToolkitInfo(cuda="13.0", home=str(home), nvcc=str(home / "bin" / "nvcc"),
                       release="V13.0.93")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_whole_build_runs_its_steps_sandboxed_and_caps_its_log(
    tmp_path: Path, toolkit: ToolkitInfo, mode: str,
) -> None:
    """The torch check, the compile and the import check run in the sandbox (or, with
    ``off``, say loudly that they did not); the wheel is checked and published; a build that
    prints more than the log cap gets its log's head and tail and a note."""
    config = build_config(tmp_path, build_sandbox=mode, build_log_max_mib=1)
    storage = open_storage(config)
    sdist = _cext_sdist(tmp_path, print_mib=4)

    result = run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                       toolkits=[toolkit])

    assert result.record.filename == CEXT.expected_wheel_name
    # Each step's wall-clock seconds, in order: the record has them up to publishing (it is
    # written then), the result to the end. Together they are about the whole build.
    steps = ["toolkit", "fetch", "venv", "compile", "check"]
    assert list(result.record.build.step_seconds or {}) == steps
    assert list(result.build.step_seconds or {}) == [*steps, "publish"]
    assert 0.9 * result.seconds <= sum((result.build.step_seconds or {}).values()) <= (
        result.seconds + 0.5)
    # Where the worker stored the log is a key the record owns (gc prunes it with the wheel).
    assert log_key(CEXT) == result.record.log_key == result.record.build.log_key
    sandbox = Sandbox.from_config(config)
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert 900_000 < len(log) < 1_100_000
    head, cut, tail = log.partition(" bytes of output truncated here")
    assert cut and "building cext 0.1.0" in head and f"published {CEXT.expected_wheel_name}" in tail
    assert int(head.rsplit("[", 1)[1]) > 3 * 1024 * 1024  # the note says how much was cut
    ran = [line for line in log.splitlines() if line.startswith("wheelhouse: $ ")]
    python_steps = [line for line in ran if "/venv/bin/python" in line.split()[3]]
    assert len(python_steps) == 3  # torch check, compile, import check
    if sandbox is None:
        assert result.build.sandbox == UNSANDBOXED
        assert "WARNING: this build runs unsandboxed" in head
        assert all(line.split()[2] == "[unsandboxed]" for line in python_steps)
    else:
        # The build claims a free uid of the range (host-wide): not always the range's first,
        # when an earlier test of this session still holds that one.
        m = re.search(r"build user (\d+):", result.build.sandbox or "")
        assert m is not None, result.build.sandbox
        claimed = int(m.group(1))
        assert result.build.sandbox == dataclasses.replace(
            sandbox, uid=claimed, gid=claimed).describe()
        assert all(line.split()[2] == "[sandbox]" for line in python_steps)
        # The venv is seen at one path in every build (VENV_INSIDE): torch's headers are
        # included from there, and nvcc's cached front end output holds their paths.
        assert {line.split()[3] for line in python_steps} == {f"{VENV_INSIDE}/bin/python"}
        uid = claimed if os.geteuid() == 0 else os.getuid()
        assert f"cext: building as uid {uid} with HOME={tmp_path / 'work'}/" in head
    # Every parse of the sdist and the wheel ran in the sandbox (worker.sandbox.untrusted): the
    # unpack
    # and the wheel's check, which also installed it for the load check; no installer of the
    # worker's touched the wheel.
    untrusted = [line for line in ran if "from worker.sandbox.untrusted import main" in line]
    where = "[sandbox]" if sandbox is not None else "[unsandboxed]"
    assert [line.split()[2] for line in untrusted] == [where, where]
    assert [json.loads(line[line.index(' {"'):])["op"] for line in untrusted] == [
        "unpack", "wheel"]
    assert not [line for line in ran if "--prefix" in line]
    # The build's workspace and its source are gone; the host's compile cache and the source
    # path's lock stay, and the worker's own directories (seccomp filter, build uids' locks;
    # the box's own CA and the worker's certificate, which no build uid may read).
    assert {p.name for p in (tmp_path / "work").iterdir()} <= {"src", "sccache", ".sandbox",
                                                               "provenance"}
    assert stat.S_IMODE((tmp_path / "work" / "provenance").stat().st_mode) == 0o700
    assert [p.name for p in (tmp_path / "work" / "src").iterdir()] == ["cext-0.1.0.lock"]
    _assert_provenance(storage, config, result.record, sdist)


def _assert_provenance(storage: Storage, config: Config, record: Record, sdist: Path) -> None:
    """The published wheel's provenance verifies against the box's CA, signed by the worker,
    and names what the build was made from by digest."""
    authority = ca.ca_cert_for(config)
    (verified,) = attest.verify_document(storage.get_bytes(record.provenance_key), authority,
                                         record.filename, record.sha256)
    assert verified.signer == "worker"
    definition = verified.predicate["buildDefinition"]
    deps = {d["name"]: d for d in definition["resolvedDependencies"]}
    assert deps["sdist"] == {"name": "sdist", "uri": sdist.resolve().as_uri(),
                             "digest": {"sha256": hashlib.sha256(sdist.read_bytes()).hexdigest()}}
    assert deps["cuda-toolkit"]["uri"] == "pkg:generic/cuda-toolkit@V13.0.93"
    assert deps["torch"]["uri"] == f"pkg:pypi/torch@{record.build.torch}"
    assert definition["externalParameters"]["archs"] == ["80"]
    assert record.build.max_jobs is not None
    assert definition["internalParameters"]["max_jobs"] == record.build.max_jobs.jobs
    run = verified.predicate["runDetails"]
    assert run["metadata"]["invocationId"] == record.build.build_id


def test_two_builds_of_one_spec_on_one_host_leave_each_other_alone(
    tmp_path: Path, toolkit: ToolkitInfo,
) -> None:
    """Each build's cookie is its own: the first to finish a step kills its own strays only,
    not the other build's compile (which shared the cookie when build ids were job ids)."""
    config = build_config(tmp_path)
    storage = open_storage(config)
    sdist = _cext_sdist(tmp_path, sleep=8)
    results: dict[int, BuildResult | BaseException] = {}

    def build(n: int) -> None:
        try:
            results[n] = run_build(CEXT, config=config, storage=storage, source=sdist,
                                   timeout=600, toolkits=[toolkit])
        except BaseException as exc:  # the test reports it
            results[n] = exc

    threads = [threading.Thread(target=build, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert all(isinstance(r, BuildResult) for r in results.values()), results
    ids = {r.build.build_id for r in results.values() if isinstance(r, BuildResult)}
    ids |= {r.record.build.build_id for r in results.values() if isinstance(r, BuildResult)}
    assert len(ids) == 2 and {build_id_base(i) for i in ids} == {CEXT.job_id}


def test_a_wheel_that_fails_its_checks_is_never_published(
    tmp_path: Path, toolkit: ToolkitInfo,
) -> None:
    """What the build leaves is untrusted: a wheel whose RECORD does not match is classified
    invalid-wheel and nothing is published."""
    src = tmp_path / "tampering"
    shutil.copytree(FIXTURES / "cext", src)
    # An in-tree build backend that builds the wheel, then changes a file behind RECORD's back.
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "tamper"\n'
        'backend-path = ["."]\n')
    (src / "tamper.py").write_text(
        "import zipfile\nfrom pathlib import Path\n"
        "from setuptools.build_meta import *  # noqa\n"
        "from setuptools import build_meta\n"
        "def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):\n"
        "    name = build_meta.build_wheel(wheel_directory, config_settings, metadata_directory)\n"
        "    path = Path(wheel_directory) / name\n"
        "    with zipfile.ZipFile(path) as zf:\n"
        "        members = {i.filename: zf.read(i) for i in zf.infolist()}\n"
        "    members['cext/__init__.py'] = b'print(\"not what RECORD says\")\\n'\n"
        "    with zipfile.ZipFile(path, 'w') as zf:\n"
        "        for member, data in members.items():\n"
        "            zf.writestr(member, data)\n"
        "    return name\n")
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    config = build_config(tmp_path)
    storage = open_storage(config)

    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                  toolkits=[toolkit])

    assert failed.value.kind is FailureKind.INVALID_WHEEL
    assert "cext/__init__.py" in failed.value.reason and "RECORD" in failed.value.reason
    assert not list(storage.list("records/"))
    assert "FAILED [invalid-wheel]" in storage.get_bytes(log_key(CEXT)).decode()


def test_a_retry_after_an_out_of_memory_kill_is_classified_by_its_own_output(
    tmp_path: Path, toolkit: ToolkitInfo,
) -> None:
    """The first attempt's kill is in the log; the retry failed for another reason, and that
    reason is what the build reports (not a second out-of-memory kill)."""
    config = build_config(tmp_path)
    storage = open_storage(config)
    sdist = _cext_sdist(tmp_path, oom_then_fail=True)

    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                  toolkits=[toolkit], max_jobs=2)

    log = storage.get_bytes(log_key(CEXT)).decode()
    assert "retrying once with MAX_JOBS=1" in log and "died due to signal 9" in log
    assert failed.value.kind is FailureKind.COMPILE_ERROR, failed.value
    assert "the retry fails by itself" in failed.value.reason
    assert not list(storage.list("wheels/"))


def test_a_cpu_only_build_under_a_cuda_label_is_not_published(
    tmp_path: Path, toolkit: ToolkitInfo,
) -> None:
    """What torch-scatter did without FORCE_CUDA: a build that compiled no GPU code. The worker
    reads the wheel's libraries and refuses to publish it as +cu130 (generic recipe)."""
    config = build_config(tmp_path)
    storage = open_storage(config)
    sdist = _cext_sdist(tmp_path, device_code=False)

    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                  toolkits=[toolkit])

    assert failed.value.kind is FailureKind.NO_DEVICE_CODE == "no-device-code"
    assert failed.value.reason.startswith(f"{CEXT.expected_wheel_name} holds no GPU device code "
                                          "in its 1 shared library (asked for sm_80)")
    assert failed.value.facts is not None and failed.value.facts.recipe == "generic"
    found = failed.value.facts.device_code or {}
    assert list(found.values()) == [{"sass": [], "ptx": []}]
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert "device code in cext/_native" in log and "FAILED [no-device-code]" in log
    assert not list(storage.list("records/")) and not list(storage.list("wheels/"))


def test_a_build_fails_closed_when_the_sandbox_cannot_be_made(
    tmp_path: Path, toolkit: ToolkitInfo, failing_bwrap: Path,
) -> None:
    config = build_config(tmp_path, build_sandbox_bwrap=str(failing_bwrap))
    storage = open_storage(config)

    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=_cext_sdist(tmp_path),
                  timeout=600, toolkits=[toolkit])

    assert failed.value.kind is FailureKind.SANDBOX_UNAVAILABLE
    assert "Creating new namespace failed: Operation not permitted" in failed.value.reason
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert "$ " not in log  # nothing ran: no venv, no setup.py
    assert "FAILED [sandbox-unavailable]" in log


def test_wheelhouse_build_refuses_to_build_without_a_sandbox(
    tmp_path: Path, failing_bwrap: Path,
) -> None:
    config = build_config(tmp_path, build_sandbox_bwrap=str(failing_bwrap))
    out = run_console("build", str(_cext_sdist(tmp_path)), "--torch", "2.14", "--cuda", "13.0",
                      config=config, cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "Error: refusing to build: the build sandbox cannot be created: bwrap: Creating new "
        "namespace failed: Operation not permitted"]
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("*.whl"))


def test_a_patch_that_does_not_apply_fails_the_build_in_one_line(
        tmp_path: Path, cudaext_sdist: Path) -> None:
    """Recipe patches are applied right after the sdist is unpacked, before any venv."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    fixture = (Path(__file__).parent.parent / "fixtures" / "recipes" / "cudaext.toml").read_text()
    (recipes / "cudaext.toml").write_text(fixture + """
[[patch]]
id = "fast-math"
description = "Compile add.cu with fast math"
versions = ">=0.1"
[[patch.replace]]
file = "csrc/add.cu"
old = "this text is not in add.cu"
new = "neither is this"
count = 1
""")
    config = build_config(tmp_path, recipe_dirs=str(recipes))
    storage = open_storage(config)
    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                            archs=["80"])
    toolkit = ToolkitInfo(cuda="13.0", home="/nonexistent", nvcc="/nonexistent/bin/nvcc")
    with pytest.raises(BuildFailed) as err:
        run_build(spec, config=config, storage=storage, source=cudaext_sdist, timeout=60,
                  toolkits=[toolkit])
    assert err.value.kind is FailureKind.PATCH_FAILED == "patch-failed"
    assert err.value.reason == (
        "patch cudaext/fast-math does not apply: csrc/add.cu holds 'this text is not in add.cu'"
        " 0 time(s), the recipe expects 1; the sdist changed, so update the patch or narrow "
        "its versions")
    log = storage.get_bytes(log_key(spec)).decode()
    assert "FAILED [patch-failed]" in log and "uv" not in log  # before the venv
    assert not list(storage.list("records/"))


class _Recorder(Reporter):
    def __init__(self) -> None:
        self.events: list[BuildEvent] = []

    def report(self, event: BuildEvent) -> None:
        self.events.append(event)


def test_what_a_build_reports_is_one_stream_and_its_last_facts_are_the_recorded_ones(
        tmp_path: Path, cudaext_sdist: Path) -> None:
    """Phases, log lines and measurements arrive as typed events, in the build's order; the
    last ``Measured`` a watcher saw is what the failure carries (no second channel to compare).
    A build without a toolkit for its CUDA stops at the toolkit step: cheap, and real."""
    config = build_config(tmp_path, toolkit_wheels=False)
    recorder = _Recorder()
    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.14", cuda="13.0")
    with pytest.raises(BuildFailed) as err:
        run_build(spec, config=config, storage=open_storage(config), reporter=recorder,
                  source=cudaext_sdist, toolkits=[], build_id="build-events-test")
    assert err.value.kind is FailureKind.INCOMPATIBLE
    assert [e.name for e in recorder.events if isinstance(e, PhaseBegan)] == ["toolkit"]
    measured = [e.facts for e in recorder.events if isinstance(e, Measured)]
    assert measured[0].sandbox is not None  # how it is sandboxed, before anything runs
    assert measured[-1] == err.value.facts and measured[-1].seconds is not None
    # The step it failed in counts too: where the build's time went, up to its failure.
    assert list(measured[-1].step_seconds or {}) == ["toolkit"]
    assert build_id_base(measured[-1].build_id) == "build-events-test"
    lines = [line for e in recorder.events if isinstance(e, LogLines) for line in e.lines]
    assert lines[-1].startswith("wheelhouse: FAILED [incompatible]: no CUDA 13.x toolkit")


@pytest.mark.parametrize(("requires", "refused"), [
    (["setuptools>=64", "wheel", "torch", "ninja; python_version >= '3'"], None),
    (["setuptools", "evil @ file:///root/.aws/credentials"], "direct reference"),
    (["evil @ https://attacker.example/evil-1.0-py3-none-any.whl"], "direct reference"),
    (["./vendored/evil"], "not a name and version specifiers"),
    (["/opt/evil"], "not a name and version specifiers"),
    (["file:///etc/passwd"], "not a name and version specifiers"),
])
def test_build_requirements_are_names_and_specifiers_only(
        tmp_path: Path, requires: list[str], refused: str | None) -> None:
    from worker.steps.venv import _pyproject_requires

    (tmp_path / "pyproject.toml").write_text(
        "[build-system]\nrequires = " + json.dumps(requires) + "\n")
    if refused is None:
        from packaging.requirements import Requirement

        assert _pyproject_requires(tmp_path) == [str(Requirement(r)) for r in requires
                                                 if r != "torch"]
        return
    with pytest.raises(BuildFailed, match=refused) as failed:
        _pyproject_requires(tmp_path)
    assert failed.value.kind is FailureKind.UNSAFE_REQUIREMENT
    assert "\n" not in failed.value.reason


def test_a_direct_reference_among_the_build_requirements_fails_at_once(
    tmp_path: Path, toolkit: ToolkitInfo,
) -> None:
    """Through the pipeline: refused before anything is installed, in one line."""
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools", "evil @ file:///etc/shadow"]\n')
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    config = build_config(tmp_path)
    storage = open_storage(config)

    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                  toolkits=[toolkit])

    assert failed.value.kind is FailureKind.UNSAFE_REQUIREMENT
    assert "'evil @ file:///etc/shadow' is a direct reference" in failed.value.reason
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert "FAILED [unsafe-requirement]" in log and "uv pip install" not in log


def test_a_torch_index_that_does_not_resolve_names_its_setting_and_is_not_retried(
    tmp_path: Path, toolkit: ToolkitInfo,
) -> None:
    """Issue 30: a new user's first build failed with 'Name or service not known' until they
    found WHEELHOUSE_TORCH_INDEX_URL. One line with the URL and the setting; one attempt."""
    sdist = make_sdist(FIXTURES / "cext", tmp_path / "sdist", "cext", "0.1.0")
    config = build_config(tmp_path, torch_index_url="http://torch-index.invalid/whl/{cu}",
                          torch_find_links="")
    storage = open_storage(config)
    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                  toolkits=[toolkit])
    assert failed.value.kind is FailureKind.MISCONFIGURED
    assert not failed.value.kind.retryable
    reason = failed.value.reason
    assert "\n" not in reason
    assert "torch-index.invalid does not resolve (tried http://torch-index.invalid/whl/" in reason
    assert reason.endswith("set WHEELHOUSE_TORCH_INDEX_URL to an index this worker reaches")
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert log.count("$ ") and log.count("--extra-index-url http://torch-index.invalid") == 1


def test_compile_cache_entries_reach_storage_while_the_compile_runs(
    tmp_path: Path, toolkit: ToolkitInfo, s3_config: Config, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 31: a worker that dies after most of its compiles kept them only on its own host;
    now they go to storage as they are made, so the build's next attempt on any worker finds
    them. The build here compiles, then waits until the test has seen its entries in storage
    (or two minutes), then fails."""
    from dataclasses import replace as replace_config

    from worker.steps import compile as compile_step

    monkeypatch.setattr(compile_step, "PUSH_EVERY", 0.5)
    monkeypatch.setattr(compile_step, "PUSH_SETTLED", 0.0)
    config = replace_config(build_config(tmp_path), storage=s3_config.storage,
                            s3_endpoint_url=s3_config.s3_endpoint_url)
    storage = open_storage(config)
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "build-options.json").write_text(json.dumps({"wait_after_compile": 120}))
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    failed: list[BaseException] = []

    def build() -> None:
        try:
            run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                      toolkits=[toolkit])
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        entries: list[str] = []
        while not entries and thread.is_alive() and time.monotonic() < deadline:
            entries = [o.key for o in storage.list("sccache/cext/cu130/")]
            time.sleep(0.2)
        running = thread.is_alive()
    finally:
        for setup_py in (tmp_path / "work").rglob("cext-0.1.0/setup.py"):
            (setup_py.parent / "go").write_text("go")
        thread.join(timeout=300)
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert entries, "no compile cache entry reached storage:\n" + log[-3000:]
    assert running, "the entries reached storage only after the compile ended"
    assert failed and isinstance(failed[0], BuildFailed)
    assert failed[0].kind is FailureKind.COMPILE_ERROR
    assert "entries stored while compiling" in log
