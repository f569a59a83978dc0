"""The sandbox's edge as a matrix: every place the worker touches around a sandboxed step
(:data:`worker.sandbox.wrapper.BUILD_WRITABLE`), turned by the build into each attack, through the
real
pipeline (:func:`worker.build.run_build`, real bubblewrap).

One build per case plants its attack at every target of the case
(``tests/fixtures/cext/hostile_matrix.py``): a link to the worker's root-only secret, a link
to a directory outside, a FIFO, or a sparse file (64 GiB; a wheel of 8 GiB and a compile cache
entry of 400 MiB, under the worker's caps on them). Each case must end classified
(``unsafe-result`` when the wheel is attacked) or as a correct, checked, published wheel, within
its deadline, with the secret in no object or log, nothing outside the workspace changed, and
none of the scripts the build left where the worker once ran launchers run.

Covered here: local storage for every attack with every target; S3 (moto over HTTP) with an
out-of-memory retry (the first compile plants the attack in dist) and without, each ending in a
correct wheel. Covered by unit tests instead: device nodes (the build can't make one, asserted
in every case; :func:`worker.sandbox.safefs` refuses them in tests/worker/sandbox/test_safefs.py),
and a link
to the secret as the wheel under S3 with a retry (tests/worker/test_edge.py).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.helpers import fake_cuda_toolkit
from tests.worker.conftest import FIXTURES, build_config, make_sdist
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index.storage import open_storage
from worker.build import run_build
from worker.sandbox.wrapper import BUILD_WRITABLE, writable_place
from worker.steps.publish import log_key
from worker.supervision import runner as runner_module

pytestmark = pytest.mark.sandbox

CEXT = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])
#: The matrix's target for each registered build-writable place: a new place fails
#: :func:`test_every_registered_place_is_attacked` until the matrix attacks it.
TARGETS = {
    "{build}/dist": "wheel",
    "{build}/sccache": "stats",
    "{build}/home": "home",
    "{build}/tmp": "tmp",
    "{build}/load-check": "load-check",
    "{source}": "source",
    "{cache}/<project>/cu<cuda>": "entry",
}
#: Written only by :mod:`worker.sandbox.untrusted` (the worker's own code, on the build's bytes)
#: after
#: every step that runs the build's code has ended; no step of the build holds it. What a
#: parser that fell to the build's bytes could leave there (a link, a FIFO or a file past the
#: cap as the report, the wheel or its METADATA) is attacked in
#: tests/worker/sandbox/test_untrusted.py.
UNTRUSTED_ONLY = {"{build}/inspect"}
ALL = sorted(TARGETS.values())
BUT_THE_WHEEL = [t for t in ALL if t != "wheel"]
#: What take_wheel says of each attack on the wheel.
REFUSED = {"link-file": "is a link", "link-dir": "is a link", "fifo": "is a FIFO",
           "sparse": "is sparse"}


@dataclass(frozen=True)
class Case:
    attack: str
    targets: tuple[str, ...]
    s3: bool = False
    oom: bool = False

    @property
    def id(self) -> str:
        return (f"{self.attack}-{'all' if 'wheel' in self.targets else 'but-wheel'}"
                f"-{'s3' if self.s3 else 'local'}{'-oom' if self.oom else ''}")


CASES = [
    *(Case(attack, tuple(ALL)) for attack in ("link-file", "link-dir", "fifo", "sparse")),
    Case("link-dir", tuple(BUT_THE_WHEEL), s3=True, oom=True),
    Case("sparse", tuple(BUT_THE_WHEEL), s3=True),
]


def test_every_registered_place_is_attacked() -> None:
    assert set(TARGETS) | UNTRUSTED_ONLY == set(BUILD_WRITABLE)
    assert {t for case in CASES for t in case.targets} == set(TARGETS.values())


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns, p.lstat().st_mode)
            for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_an_attack_on_the_edge_ends_classified_or_correct(
    case: Case, tmp_path: Path, request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch, artifacts_dir: Path,
) -> None:
    # Outside the workspace: a directory the build's links point at, the worker's root-only
    # secret in it, and where a planted script would leave its marker if anyone ran it.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "published.whl").write_bytes(b"another project's wheel")
    secret = outside / "worker-secret"
    canary = f"canary-edge-matrix-{os.getpid()}-{time.time_ns()}"
    secret.write_text(canary)
    secret.chmod(0o600)
    marker = tmp_path / "ran-marker"

    config = build_config(tmp_path)
    if case.s3:
        s3_config: Config = request.getfixturevalue("s3_config")
        config = replace(config, storage=s3_config.storage,
                         s3_endpoint_url=s3_config.s3_endpoint_url)
    storage = open_storage(config)
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "build-options.json").write_text(json.dumps({"matrix": {
        "attack": case.attack, "targets": list(case.targets), "oom": case.oom,
        "secret": str(secret), "outside": str(outside), "marker": str(marker)}}))
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    home = fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")
    toolkit = ToolkitInfo(cuda="13.0", home=str(home), nvcc=str(home / "bin" / "nvcc"),
                          release="V13.0.93")
    places: set[str] = set()
    def recording(path: Path, **where: Path) -> str:
        name = writable_place(path, **where)
        places.add(name)
        return name

    monkeypatch.setattr(runner_module, "writable_place", recording)
    before = _tree(outside)
    started = time.monotonic()
    failed: BuildFailed | None = None
    try:
        result = run_build(CEXT, config=config, storage=storage, source=sdist, timeout=300,
                           toolkits=[toolkit], max_jobs=2)
    except BuildFailed as exc:
        failed = exc
    seconds = time.monotonic() - started

    log = storage.get_bytes(log_key(CEXT)).decode()
    lines = [json.loads(line.split("hostile-matrix: ", 1)[1])
             for line in log.splitlines() if "hostile-matrix: " in line]
    assert lines, log[-3000:]
    did = {k: v for line in lines for k, v in line.items()}
    # The figures first, so that a failing case leaves them too.
    out = artifacts_dir / "edge" / "matrix"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{case.id}.json").write_text(json.dumps({
        "case": case.id, "attack": case.attack, "targets": list(case.targets),
        "storage": "s3" if case.s3 else "local", "oom_retry": case.oom,
        "outcome": failed.kind.value if failed else "built",
        "reason": failed.reason if failed else None, "seconds": round(seconds, 1),
        "build": did}, indent=1, sort_keys=True))
    # The build did plant what the case says, and could not make a device node.
    assert all(did[t] == "planted" for t in ("entry", "source", "home", "tmp")
               if t in case.targets), did
    assert all(v == "planted" for k, v in did.items() if k.startswith("script")), did
    assert did["mknod"].startswith("failed"), did
    if case.oom:
        assert did["dist before the retry"] == "planted", did
        assert "retrying once with MAX_JOBS=1" in log
    # Nothing outside changed or ran; the secret left in no object or log.
    assert _tree(outside) == before
    assert not marker.exists(), marker.read_text()
    assert canary not in log
    for obj in storage.list(""):
        assert canary.encode() not in storage.get_bytes(obj.key), obj.key
    # The statistics the build swapped were not read (a FIFO did not hang the worker).
    if "stats" in case.targets:
        assert " hits, " not in log.rsplit("retrying once", 1)[-1]
    # Classified, or correct.
    if "wheel" in case.targets:
        assert failed is not None, log[-3000:]
        assert failed.kind is FailureKind.UNSAFE_RESULT, failed
        assert REFUSED[case.attack] in failed.reason, failed.reason
        assert not list(storage.list("wheels/"))
    else:
        assert failed is None, failed
        assert result.record.filename == CEXT.expected_wheel_name
        assert [o for o in storage.list("") if o.key.endswith(CEXT.expected_wheel_name)]
    if case.s3:  # the pushed compile cache holds only sccache's own entries, none planted
        pushed = [o.key for o in storage.list("sccache/")]
        assert not [k for k in pushed if k.endswith("b" * 62)], pushed
    assert places <= set(BUILD_WRITABLE), places
    assert not (Path(config.workspace) / "src" / "cext-0.1.0").exists()

    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
