"""The sandbox's edge, through the real pipeline: nothing a build leaves behind steers the worker.

The C extension fixture, built by :func:`worker.build.run_build` in the real sandbox with S3
storage (moto over HTTP), attacks what the worker does after each sandboxed program
(``tests/fixtures/cext/hostile_edge.py``): links where the worker used to write before an
out-of-memory retry, a faked out-of-memory kill, a FIFO where the worker reads the compile
cache's statistics and a link to the worker's secret where it takes the wheel. An earlier build
of the same project is played by the test: it left links in the project's compile cache
directory, and storage holds entries (one named as sccache names them) that the pull would have
written through those links into a directory the worker's own Python reads.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import fake_cuda_toolkit
from tests.worker.conftest import FIXTURES, build_config, make_sdist
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index.storage import open_storage
from worker.build import log_key, run_build
from worker.sandbox.wrapper import BUILD_WRITABLE, writable_place
from worker.supervision import runner as runner_module

pytestmark = pytest.mark.sandbox

CEXT = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])
ENTRY = "8/9/89" + "a" * 62
DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def test_a_build_that_attacks_the_edge_ends_classified_or_correct(
    tmp_path: Path, s3_config: Config, monkeypatch: pytest.MonkeyPatch, artifacts_dir: Path,
) -> None:
    secret = tmp_path / "worker-secret"
    canary = "canary-worker-secret-edge"
    secret.write_text(canary)
    victim = tmp_path / "site-packages"  # stands for a directory the worker's Python reads
    victim.mkdir()
    (victim / "published.whl").write_bytes(b"another project's wheel")
    config = replace(build_config(tmp_path), storage=s3_config.storage,
                     s3_endpoint_url=s3_config.s3_endpoint_url)
    storage = open_storage(config)
    # The earlier build of this project: links in its cache directory, entries in storage.
    cache_dir = Path(config.workspace).resolve() / "sccache" / "cext" / "cu130"
    cache_dir.mkdir(parents=True)
    (cache_dir / "8").symlink_to(victim)
    (cache_dir / "preprocessor").symlink_to(victim)
    for name in (ENTRY, "9/sitecustomize.py", "x.pth"):
        storage.put_bytes(f"sccache/cext/cu130/{name}", b"import os  # would run as the worker")
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "build-options.json").write_text(json.dumps(
        {"edge": {"victim_dir": str(victim), "secret": str(secret)}}))
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    home = fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")
    toolkit = ToolkitInfo(cuda="13.0", home=str(home), nvcc=str(home / "bin" / "nvcc"),
                          release="V13.0.93")
    # Every place the build was given writable, as the worker named it.
    places: set[str] = set()
    real_place = runner_module.writable_place

    def recording(path: Path, **where: Path) -> str:
        name = real_place(path, **where)
        places.add(name)
        return name

    monkeypatch.setattr(runner_module, "writable_place", recording)
    before = _tree(victim)
    started = time.monotonic()

    failed: BuildFailed | None = None
    try:
        result = run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                           toolkits=[toolkit], max_jobs=2, keep_workspace=True)
    except BuildFailed as exc:
        failed = exc
    seconds = time.monotonic() - started

    log = storage.get_bytes(log_key(CEXT)).decode()
    done = json.loads(next(Path(config.workspace).glob("src/cext-0.1.0/cext-0.1.0/"
                                                       "edge-done.json")).read_text())
    # The faked out-of-memory kill was retried, after the planted links had been left.
    assert done["oom"] and done["did"]["watcher"] == "started", log[-3000:]
    assert "retrying once with MAX_JOBS=1" in log
    assert all(v == "planted" for k, v in done["did"].items() if k.startswith("link ")), done
    # Nothing was written through a link: the directory the links pointed at is as it was, and
    # the worker's secret left in no wheel, log or object.
    assert _tree(victim) == before
    assert canary not in log
    for obj in storage.list(""):
        assert canary.encode() not in storage.get_bytes(obj.key), obj.key
    # Classified or correct: a link where the wheel should be is refused, never followed; a
    # FIFO where the statistics should be is never opened (the worker did not hang on it). When
    # the watcher swaps the wheel while pip still copies it, pip's chmod through the link fails
    # the compile itself: a compile error classified from the retry's own output, never the
    # first attempt's faked kill.
    if failed is not None:
        assert failed.kind in (FailureKind.UNSAFE_RESULT, FailureKind.COMPILE_ERROR), failed
        if failed.kind is FailureKind.UNSAFE_RESULT:
            assert "link" in failed.reason
        assert not list(storage.list("wheels/"))
    else:
        assert result.record.filename == CEXT.expected_wheel_name
        assert done["did"].get("wheel") is None
    if done["did"].get("stats.json") == "a FIFO":
        # read_stats refused it: the retry's statistics are not in the log.
        assert " hits, " not in log.rsplit("retrying once", 1)[-1]
    # The places the build could write are the registered ones, and the docs list them all.
    assert places <= set(BUILD_WRITABLE), places
    assert {"{build}/dist", "{build}/sccache", "{source}", "{cache}/<project>/cu<cuda>"} <= places
    documented = DOCS.read_text()
    assert all(f"`{name}`" in documented for name in BUILD_WRITABLE)

    out = artifacts_dir / "edge"
    out.mkdir(exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps({
        "outcome": failed.kind.value if failed else "built",
        "reason": failed.reason if failed else None,
        "seconds": round(seconds, 1), "build": done,
        "writable places": sorted(places)}, indent=1, sort_keys=True))


def test_an_unregistered_writable_place_is_refused(tmp_path: Path) -> None:
    from worker.errors import SandboxUnavailable

    where = {"build": tmp_path / "b", "source": tmp_path / "src" / "p-1", "cache": tmp_path / "c"}
    assert writable_place(tmp_path / "b" / "dist", **where) == "{build}/dist"
    assert writable_place(tmp_path / "c" / "p" / "cu130", **where) == "{cache}/<project>/cu<cuda>"
    for path in (tmp_path / "b" / "venv", tmp_path / "b", tmp_path / "elsewhere",
                 tmp_path / "c" / "p"):
        with pytest.raises(SandboxUnavailable, match="not a registered"):
            writable_place(path, **where)


def test_a_build_that_hides_a_big_file_by_unlinking_it_is_too_large(tmp_path: Path) -> None:
    """A child of the build preallocates 256 MiB in the source tree, unlinks it and sleeps
    holding it open (the disk cap is 64 MiB): through the real pipeline, the build ends as
    too-large, its processes are gone and the space is free again."""
    config = build_config(tmp_path, build_disk_limit_gib=64 / 1024)
    storage = open_storage(config)
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    # The file's name carries this test's marker: the sandbox's processes see the source tree
    # at /wheelhouse/src, so that is the path their descriptors' link text names.
    (src / "build-options.json").write_text(json.dumps({"hold_unlinked_mib": 256,
                                                        "hold_marker": tmp_path.name}))
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    home = fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")
    toolkit = ToolkitInfo(cuda="13.0", home=str(home), nvcc=str(home / "bin" / "nvcc"),
                          release="V13.0.93")
    free_held: list[int] = []  # free space while the file was held
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not free_held:
            if _holders(tmp_path.name):
                free_held.append(shutil.disk_usage(tmp_path).free)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(BuildFailed) as failed:
            run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                      toolkits=[toolkit], max_jobs=1)
    finally:
        done.set()
        watcher.join()

    log = storage.get_bytes(log_key(CEXT)).decode()
    held = [line for line in log.splitlines() if "cext: holding pid" in line]
    assert held, log[-3000:]
    assert failed.value.kind is FailureKind.TOO_LARGE, failed.value
    assert "unlinked but kept open" in failed.value.reason
    assert time.monotonic() - started < 300  # killed, not left to its deadline
    # No process anywhere on the host still holds the file (the holder's pid above is its
    # sandbox's own, so the host's descriptors are searched instead).
    assert _holders(tmp_path.name) == []
    assert not list(storage.list("wheels/"))
    # The 256 MiB came back (the workspace's removal only adds to it).
    assert free_held, "the watcher never saw the file held"
    assert shutil.disk_usage(tmp_path).free >= free_held[0] + 192 * 1024**2


def _holders(marker: str) -> list[str]:
    """Descriptors of any host process that hold an unlinked ``held-<marker>.bin`` (``marker``:
    this test's directory's name), found by their link text."""
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            names = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in names:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.endswith(f"/held-{marker}.bin (deleted)"):
                found.append(f"{fd}: {target}")
    return found
