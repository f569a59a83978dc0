"""The root worker never parses a build's hostile bytes itself (issue 25, items 1-3): the sdist's
tar, the wheel's zip and its ELF sections are read by :mod:`worker.sandbox.untrusted` in the build's
sandbox, through the real pipeline (:func:`worker.build.run_build`, real bubblewrap).

Each attack is one that broke the worker when it parsed these bytes as root: a tar that escapes
CPython's ``data`` filter (CVE-2025-4517, on the Pythons before 3.11.13/3.12.11/3.13.4), an ELF
whose fat binary sections declare a GiB each as ``SHT_NOBITS`` in a 408-byte file, and a wheel
with a GiB of zeros behind a correct RECORD. And should a parser fall to the bytes it reads,
what it leaves in ``{build}/inspect`` (a link to the worker's secret, a FIFO, a file past the
cap, as the report, the wheel or its METADATA) is refused by the worker reading it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.helpers import fake_cuda_toolkit
from tests.worker.conftest import FIXTURES, build_config, make_sdist
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.devicecode import FATBIN_SECTIONS, library_device_code
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index.storage import open_storage
from worker.build import run_build
from worker.steps.publish import log_key
from worker.supervision import runner as runner_module

CEXT = BuildSpec.create("cext", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])
GIB = 1024**3
#: The CPython releases that fixed CVE-2025-4517 in tarfile's filters.
FIXED = {(3, 11): 13, (3, 12): 11, (3, 13): 4}


def _add(tar: tarfile.TarFile, name: str, *, kind: bytes = tarfile.REGTYPE, link: str = "",
         data: bytes = b"", mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def escaping_tar(out: Path, dest: Path, victim: Path, payload: bytes) -> Path:
    """A tar that, extracted into ``dest`` with ``filter="data"`` on a CPython before the fix,
    writes ``payload`` to ``victim`` anywhere on the filesystem (CVE-2025-4517): a chain of
    directories and links whose resolved path passes ``PATH_MAX``, where ``os.path.realpath``
    stops resolving, so the filter's check sees a path inside ``dest`` that the kernel
    resolves outside it."""
    steps = "abcdefghijklmnop"
    comp = "d" * ((os.pathconf("/", "PC_PATH_MAX") - len(str(dest)) - 1) // (len(steps) + 1))
    path = ""
    with tarfile.open(out, "w:gz") as tar:
        for step in steps:
            _add(tar, os.path.join(path, comp), kind=tarfile.DIRTYPE, mode=0o777)
            _add(tar, os.path.join(path, step), kind=tarfile.SYMTYPE, link=comp)
            path = os.path.join(path, comp)
        linkpath = os.path.join(*steps, "l" * 254)
        _add(tar, linkpath, kind=tarfile.SYMTYPE, link=os.path.join(*[".."] * len(steps)))
        up = len(str(dest).strip("/").split("/"))
        _add(tar, "escape", kind=tarfile.SYMTYPE, link=os.path.join(linkpath, *[".."] * up))
        _add(tar, "escape/" + str(victim).lstrip("/"), data=payload)
    return out


def _vulnerable() -> bool:
    fixed = FIXED.get(sys.version_info[:2])
    return fixed is not None and sys.version_info[2] < fixed


def _toolkit(tmp_path: Path) -> ToolkitInfo:
    home = fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0")
    return ToolkitInfo(cuda="13.0", home=str(home), nvcc=str(home / "bin" / "nvcc"),
                       release="V13.0.93")


def test_the_escaping_tar_escapes_a_plain_data_filter_on_this_python(tmp_path: Path) -> None:
    """The generator is the real attack: on this CPython (3.11.7 here) the standard library's
    own ``extractall(filter="data")`` writes outside its destination."""
    if not _vulnerable():
        pytest.skip(f"CPython {sys.version.split()[0]} has the CVE-2025-4517 fix")
    dest = tmp_path / "dest"
    dest.mkdir()
    victim = tmp_path / "victim" / "planted.pth"
    victim.parent.mkdir()
    tar = escaping_tar(tmp_path / "x.tar.gz", dest, victim, b"import os\n")
    with tarfile.open(tar) as tf:
        tf.extractall(dest, filter="data")
    assert victim.read_bytes() == b"import os\n"


@pytest.mark.sandbox
def test_a_tar_that_escapes_the_data_filter_writes_nothing_outside_the_sandbox(
    tmp_path: Path,
) -> None:
    """Unpacked in the sandbox as the build's uid, the escape has nowhere to write: the build
    fails ``unsafe-archive`` in one line, and neither a root-only directory nor the worker's own
    interpreter gained a file."""
    config = build_config(tmp_path)
    storage = open_storage(config)
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    victim = root_only / "planted.pth"
    dest = Path(config.workspace) / "src" / "cext-0.1.0"
    sdist_dir = tmp_path / "sdist"
    sdist_dir.mkdir()
    sdist = escaping_tar(sdist_dir / "cext-0.1.0.tar.gz", dest, victim,
                         b"import os; os.system('touch /tmp/pwned-by-an-sdist')\n")
    site = Path(sys.prefix)
    before = sorted(p.name for p in site.rglob("*.pth"))
    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=300,
                  toolkits=[_toolkit(tmp_path)], max_jobs=1)
    assert failed.value.kind is FailureKind.UNSAFE_ARCHIVE, failed.value
    assert "\n" not in failed.value.reason and "cext-0.1.0.tar.gz" in failed.value.reason
    assert not victim.exists() and os.listdir(root_only) == []
    assert sorted(p.name for p in site.rglob("*.pth")) == before
    assert not list(storage.list("wheels/"))
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert "[sandbox]" in log and "from worker.sandbox.untrusted import main" in log


def elf_with_nobits_fatbins(path: Path, size: int = GIB) -> Path:
    """A 408-byte ELF shared library with three fat binary sections of type ``SHT_NOBITS``
    declaring ``size`` bytes each (what pyelftools' ``data()`` would allocate)."""
    names = b"\0.shstrtab\0" + b"\0".join(s.encode() for s in FATBIN_SECTIONS[:1]) + b"\0"
    strtab_at = 64
    shoff = (strtab_at + len(names) + 7) // 8 * 8
    fatbin_name = names.index(FATBIN_SECTIONS[0].encode())

    def section(name: int, kind: int, flags: int, offset: int, length: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, kind, flags, 0, offset, length, 0, 0, 1, 0)

    sections = [section(0, 0, 0, 0, 0), section(1, 3, 0, strtab_at, len(names)),
                *(section(fatbin_name, 8, 2, shoff, size) for _ in range(3))]
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8) + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64, len(sections), 1)
    data = header + names
    data += bytes(shoff - len(data)) + b"".join(sections)
    path.write_bytes(data)
    return path


def test_nobits_fat_binaries_are_refused_without_allocating_them(tmp_path: Path) -> None:
    """The device-code reader reads sections by offset and size from the file: a NOBITS fat
    binary holds no bytes, and is refused as no ELF with device code, not read as 3 GiB."""
    lib = elf_with_nobits_fatbins(tmp_path / "_bomb.so")
    assert lib.stat().st_size == 408
    from elftools.elf.elffile import ELFFile
    with lib.open("rb") as f:  # what the old reader saw: three sections of a GiB each
        assert [s["sh_size"] for s in ELFFile(f).iter_sections()
                if s.name in FATBIN_SECTIONS] == [GIB] * 3
    tracemalloc.start()
    try:
        with lib.open("rb") as f, pytest.raises(ValueError, match="NOBITS"):
            library_device_code(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak


@pytest.mark.sandbox
def test_a_zip_bomb_wheel_is_refused_in_the_sandbox_and_leaves_nothing_on_the_host(
    tmp_path: Path,
) -> None:
    """A wheel whose RECORD is right but whose members inflate past the build's disk cap is
    refused by the check in the sandbox, before anything installs it: no worker's installer
    or cache sees it, nothing is published, and no large file is left anywhere under the
    test's directory (the workspace, the storage, the worker's caches)."""
    config = build_config(tmp_path, build_disk_limit_gib=0.5)
    storage = open_storage(config)
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    (src / "build-options.json").write_text(json.dumps({"zero_member_gib": 1}))
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    uv_cache = Path(subprocess.run(["uv", "cache", "dir"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    with pytest.raises(BuildFailed) as failed:
        run_build(CEXT, config=config, storage=storage, source=sdist, timeout=600,
                  toolkits=[_toolkit(tmp_path)], max_jobs=1)
    log = storage.get_bytes(log_key(CEXT)).decode()
    assert "hostile-wheel: " in log  # the build made the bomb
    assert failed.value.kind in (FailureKind.TOO_LARGE, FailureKind.INVALID_WHEEL), failed.value
    assert "unpacks to 1,024 MiB, over the 512 MiB allowed" in failed.value.reason
    assert not list(storage.list("wheels/"))
    big = [p for p in tmp_path.rglob("*") if _is_big(p)]
    assert not big, big
    assert not list(uv_cache.rglob("zeros.bin")) if uv_cache.is_dir() else True


def _is_big(path: Path) -> bool:
    st = path.lstat()
    return stat.S_ISREG(st.st_mode) and st.st_blocks * 512 > 64 * 1024 * 1024


#: worker.sandbox.untrusted as a parser that fell to the bytes it read would run: the real
#: operation,
#: then ``target`` (the report, or the wheel or METADATA it names) replaced by ``attack``.
_FALLEN = """
import json, os, sys
sys.path[:0] = [sys.argv[1]]
from worker.sandbox.untrusted import main
rc = main(sys.argv[2:])
request = json.loads(sys.argv[2])
op, target, attack, secret = {op!r}, {target!r}, {attack!r}, {secret!r}
if request["op"] == op:
    path = request["report"]
    if target != "report":
        with open(path) as f:
            path = os.path.join(request["out"], "wheel", json.load(f)[target])
    os.unlink(path)
    if attack == "link":
        os.symlink(secret, path)
    elif attack == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(64 * 1024 * 1024)
sys.exit(rc)
"""


@pytest.mark.sandbox
@pytest.mark.parametrize(("op", "target", "attack", "kind"), [
    ("unpack", "report", "link", FailureKind.UNSAFE_ARCHIVE),
    ("unpack", "report", "fifo", FailureKind.UNSAFE_ARCHIVE),
    ("unpack", "report", "big", FailureKind.UNSAFE_ARCHIVE),
    ("wheel", "wheel", "link", FailureKind.UNSAFE_RESULT),
    ("wheel", "wheel", "fifo", FailureKind.UNSAFE_RESULT),
    ("wheel", "metadata", "link", FailureKind.UNSAFE_RESULT),
    ("wheel", "metadata", "fifo", FailureKind.UNSAFE_RESULT),
    ("wheel", "metadata", "big", FailureKind.UNSAFE_RESULT),
])
def test_what_a_fallen_parser_leaves_in_inspect_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str, target: str, attack: str,
    kind: FailureKind,
) -> None:
    """The worker reads ``{build}/inspect`` by descriptor, regular files only, capped and
    never blocking: a link is not followed to the worker's root-only secret, a FIFO does not
    hang it, a file past the cap is not read; the build fails classified, publishing nothing."""
    canary = f"canary-inspect-{os.getpid()}-{time.time_ns()}"
    secret = tmp_path / "worker-secret"
    secret.write_text(canary)
    secret.chmod(0o600)
    monkeypatch.setattr(runner_module, "_UNTRUSTED_BOOT", _FALLEN.format(
        op=op, target=target, attack=attack, secret=str(secret)))
    config = build_config(tmp_path)
    storage = open_storage(config)
    src = tmp_path / "cext-src"
    shutil.copytree(FIXTURES / "cext", src)
    sdist = make_sdist(src, tmp_path / "sdist", "cext", "0.1.0")
    ended: list[BaseException | None] = []

    def build() -> None:
        try:
            run_build(CEXT, config=config, storage=storage, source=sdist, timeout=300,
                      toolkits=[_toolkit(tmp_path)], max_jobs=1)
            ended.append(None)
        except BaseException as exc:  # handed to the test's thread
            ended.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(timeout=240)
    assert ended, "the worker hung on what the parser left"
    failed = ended[0]
    assert isinstance(failed, BuildFailed), failed
    assert failed.kind is kind, failed
    assert canary not in failed.reason
    assert canary not in storage.get_bytes(log_key(CEXT)).decode()
    assert not list(storage.list("wheels/"))
