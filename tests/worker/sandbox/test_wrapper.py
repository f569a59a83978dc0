"""The build sandbox: a hostile sdist built inside it learns, reaches and leaves nothing.

The hostile fixture (tests/fixtures/hostile) is built with a real ``pip wheel`` inside
:class:`worker.sandbox.wrapper.Sandbox`, under :class:`worker.supervision.reaper.BuildProcess` as
the worker runs
builds, while canary secrets sit in this test's environment (as in a worker's), in files, in the
workspace root, in the storage directory and in a fake worker process's environment and command
line; a real redis-server, moto's S3 server and a counting listener on the host wait for it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import redis

from tests.helpers import Listener, host_addresses, make_venv
from tests.worker.conftest import hostile_sdist
from tests.worker.supervision.test_governor import JobStates
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from worker.errors import SandboxUnavailable
from worker.sandbox.limits import GIB, MAX_DEPTH, DiskQuota, TreeLimits
from worker.sandbox.takeout import take_wheel
from worker.sandbox.untrusted import unpack
from worker.sandbox.wrapper import (
    SOURCE_INSIDE,
    Layout,
    Sandbox,
    python_prefix,
    startup_check,
)
from worker.steps.prove import gpu_devices
from worker.supervision.governor import MemoryGovernor
from worker.supervision.reaper import BUILD_ID_ENV, BuildProcess

HOSTILE_SCRIPTS = Path(__file__).resolve().parents[1] / "hostile"
IS_ROOT = os.geteuid() == 0
MiB = 1 << 20

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def build_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv with pip and setuptools, made outside the sandbox as the worker
    makes it."""
    return make_venv(tmp_path_factory.mktemp("build-venv") / "venv")


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    made = Sandbox.from_config(Config(workspace=str(tmp_path / "work")))
    assert made is not None
    return made


class Workspace:
    """One build's workspace, laid out as the worker lays it out."""

    def __init__(self, root: Path, python: Path) -> None:
        self.root = root
        self.python = python
        self.src = root / "src"
        self.dist = root / "dist"
        self.log = root / "build.log"
        prefix = python_prefix(python)
        read_only = [python.parent.parent, *([prefix] if prefix else [])]
        self.layout = Layout.in_workspace(root, read_only=read_only,
                                          writable=[self.src, self.dist])

    def env(self, sandbox: Sandbox) -> dict[str, str]:
        base = {"PATH": f"{self.python.parent}:/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
                "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "PIP_NO_INDEX": "1"}
        return sandbox.environment(base, self.layout)

    def start(self, sandbox: Sandbox, argv: list[str], *, cwd: Path | None = None,
              network: bool = False, extra_env: dict[str, str] | None = None) -> BuildProcess:
        sandbox.prepare(self.layout)
        cwd = cwd or self.layout.home
        return BuildProcess.start(
            sandbox.wrap(argv, layout=self.layout, cwd=cwd, network=network),
            build_id=f"test-sandbox-{uuid.uuid4().hex[:8]}",
            env={**self.env(sandbox), **(extra_env or {})}, cwd=cwd, log_path=self.log,
            uids=sandbox.build_uids)


@pytest.fixture
def workspace(tmp_path: Path, build_python: Path) -> Workspace:
    root = tmp_path / "work" / "build-1"
    root.mkdir(parents=True)
    return Workspace(root, build_python)


def _namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def _in_namespace(ns: str) -> list[int]:
    pids = []
    for proc in psutil.process_iter():
        try:
            if _namespace(proc.pid) == ns and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return pids


def _sandbox_namespace(build: BuildProcess, timeout: float = 10.0) -> str:
    """The PID namespace the sandbox created, seen from here."""
    mine = _namespace(os.getpid())
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for proc in build.processes():
            try:
                ns = _namespace(proc.pid)
            except OSError:
                continue
            if ns != mine:
                return ns
        time.sleep(0.05)
    raise AssertionError("the sandbox's PID namespace did not appear")


# --- the hostile sdist ----------------------------------------------------------------------


def test_a_hostile_sdist_learns_nothing_reaches_nothing_and_writes_nothing_outside(
    tmp_path: Path, workspace: Workspace, sandbox: Sandbox, redis_url: str, s3_config: Config,
    listener: Listener, monkeypatch: pytest.MonkeyPatch,
) -> None:
    canaries = {name: f"canary-{name}-{uuid.uuid4().hex}" for name in (
        "env", "redis-password", "secret-key", "aws-file", "storage", "workspace-root",
        "worker-env", "worker-argv")}
    # The worker's own secrets, where a worker has them.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canaries["env"])
    monkeypatch.setenv("WHEELHOUSE_REDIS_URL", f"redis://:{canaries['redis-password']}@h/0")
    monkeypatch.setenv("WHEELHOUSE_SECRET_KEY", canaries["secret-key"])
    worker_home = tmp_path / "worker-home"
    (worker_home / ".aws").mkdir(parents=True)
    (worker_home / ".aws" / "credentials").write_text(
        f"[default]\naws_secret_access_key = {canaries['aws-file']}\n")
    monkeypatch.setenv("HOME", str(worker_home))
    storage = tmp_path / "data"
    storage.mkdir()
    (storage / "wheel-record.json").write_text(canaries["storage"])
    work_root = workspace.root.parent
    private_redis = work_root / "redis"  # the single-box shape's private Redis
    private_redis.mkdir()
    (private_redis / "appendonly.aof").write_text(canaries["workspace-root"])
    fake_worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)",
         f"--token={canaries['worker-argv']}"],
        env={**os.environ, "WORKER_SECRET": canaries["worker-env"]})
    outside_tmp = Path("/tmp") / f"hostile-{uuid.uuid4().hex}"
    writes = [worker_home / "hostile", storage / "hostile", private_redis / "hostile",
              workspace.root / "hostile", workspace.python.parent / "hostile", tmp_path / "hostile",
              outside_tmp, Path("/") / f"hostile-{uuid.uuid4().hex}"]

    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    s3_port = int(str(s3_config.s3_endpoint_url).rsplit(":", 1)[1])
    targets = {
        "read": [str(worker_home / ".aws" / "credentials"), str(storage / "wheel-record.json"),
                 str(private_redis / "appendonly.aof"), str(private_redis), str(storage),
                 str(work_root), f"/proc/{fake_worker.pid}/environ",
                 f"/proc/{os.getpid()}/environ"],
        "connect": [["redis", "127.0.0.1", redis_port], ["s3", "127.0.0.1", s3_port],
                    ["listener", "127.0.0.1", listener.port],
                    *[["listener", addr, listener.port] for addr in host_addresses()],
                    ["public", "1.1.1.1", 443]],
        "kill": [fake_worker.pid, os.getpid()],
        "write": [str(p) for p in writes],
    }
    sdist = hostile_sdist(tmp_path)
    src = unpack(sdist, workspace.src)
    (src / "targets.json").write_text(json.dumps(targets))
    server = redis.Redis.from_url(redis_url)
    connections_before = server.info("stats")["total_connections_received"]
    from wheelhouse.index.storage import make_s3_client

    s3 = make_s3_client(s3_config)
    buckets_before = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    # The session's S3 server is shared: other tests' objects (a real worker's hostile build,
    # say) are there already; this build must add none.
    objects_before = {(bucket, o["Key"]) for bucket in buckets_before
                      for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}

    try:
        build = workspace.start(sandbox, [str(workspace.python), "-m", "pip", "wheel",
                                          "--no-build-isolation", "--no-deps", "-v",
                                          "-w", str(workspace.dist), str(src)], cwd=src)
        outcome = build.wait(deadline=time.monotonic() + 300)
        log = workspace.log.read_text(errors="replace")
        assert outcome.returncode == 0, log[-3000:]
        assert fake_worker.poll() is None, "the build killed a process outside its sandbox"
    finally:
        fake_worker.kill()
        fake_worker.wait()

    wheel = take_wheel(workspace.dist, tmp_path / "out")
    with zipfile.ZipFile(wheel) as zf:
        packed = {name: zf.read(name) for name in zf.namelist()}
    findings = json.loads(packed["hostile/findings.json"])

    # It ran and it looked: the test is only as good as the attempts it saw fail.
    assert findings["files"] and findings["proc"] and len(findings["connections"]) >= 4
    everything = log.encode() + b"".join(packed.values()) + wheel.read_bytes()
    for name, canary in canaries.items():
        assert canary.encode() not in everything, f"the build saw the {name} canary"
    # Its own view: a handful of its own processes, none of the worker's.
    visible = {key.split("/")[2] for key in findings["proc"]}
    assert len(visible) < 15, visible
    assert all(text.startswith("denied") for path, text in findings["files"].items()
               if path in targets["read"] and not path.startswith(("/proc/", str(work_root)))
               ), findings["files"]
    # The workspace root exists inside only as the empty parent of this build's mounts.
    assert findings["files"][str(work_root)] == f"dir: {workspace.root.name}"
    if IS_ROOT:
        assert findings["identity"]["uid"] == sandbox.uid
        assert findings["identity"]["gid"] == sandbox.gid
        assert findings["identity"]["groups"] in ([], [sandbox.gid])
        assert "CapEff:\t0000000000000000" in findings["identity"]["status"]
    assert findings["identity"]["home"] == str(workspace.layout.home)
    assert not [d for d in findings["dev"] if d.startswith("nvidia")]
    # No connection got anywhere.
    assert all(result.startswith("failed") for result in findings["connections"].values()), \
        findings["connections"]
    assert listener.accepted == 0
    assert server.info("stats")["total_connections_received"] == connections_before
    assert server.get("hostile-was-here") is None
    assert {b["Name"] for b in s3.list_buckets()["Buckets"]} == buckets_before
    objects_after = {(bucket, o["Key"]) for bucket in buckets_before
                     for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert objects_after == objects_before, objects_after ^ objects_before
    # No signal reached anything outside.
    assert all(result.startswith("failed") for pid, result in findings["signals"].items()
               if "probe" not in pid), findings["signals"]
    # Nothing written outside its writable paths.
    assert all(not path.exists() for path in writes), [p for p in writes if p.exists()]
    assert all(result.startswith("failed") for path, result in findings["writes"].items()
               if path != str(outside_tmp)), findings["writes"]


def test_network_opt_in_shares_the_host_network(
    workspace: Workspace, sandbox: Sandbox, listener: Listener,
) -> None:
    """What a recipe's network opt-in means: the host's addresses are reachable (documented)."""
    code = f"import socket; socket.create_connection(('127.0.0.1', {listener.port}), 5).close()"
    for network, expected_rc, accepted in ((False, 1, 0), (True, 0, 1)):
        build = workspace.start(sandbox, [str(workspace.python), "-c", code], network=network)
        outcome = build.wait(deadline=time.monotonic() + 60)
        assert outcome.returncode == expected_rc, workspace.log.read_text()
        assert listener.accepted == accepted


# --- fail closed ----------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "reason"), [
    ("missing", "bubblewrap ('/nonexistent/bwrap') is not installed"),
    ("failing", "Creating new namespace failed: Operation not permitted"),
    ("mode", "WHEELHOUSE_BUILD_SANDBOX must be on or off"),
])
def test_the_check_fails_closed_with_one_line(
    tmp_path: Path, failing_bwrap: Path, setting: str, reason: str,
) -> None:
    overrides: dict[str, object] = {
        "missing": {"build_sandbox_bwrap": "/nonexistent/bwrap"},
        "failing": {"build_sandbox_bwrap": str(failing_bwrap)},
        "mode": {"build_sandbox": "maybe"},
    }[setting]
    config = Config(workspace=str(tmp_path / "work"), **overrides)  # type: ignore[arg-type]

    why = startup_check(config)

    assert why is not None and reason in why
    assert "\n" not in why and len(why) < 400


def test_the_check_passes_where_the_sandbox_works_and_cleans_up(tmp_path: Path) -> None:
    config = Config(workspace=str(tmp_path / "work"))
    assert startup_check(config) is None
    # What stays: the worker's own directory (the seccomp filter; the uid locks are host-wide).
    assert [p.name for p in (tmp_path / "work").iterdir()] == [".sandbox"]


def test_only_off_runs_unsandboxed(tmp_path: Path) -> None:
    assert Sandbox.from_config(Config(build_sandbox="off")) is None
    assert startup_check(Config(build_sandbox="off", build_sandbox_bwrap="/nonexistent")) is None
    assert isinstance(Sandbox.from_config(Config(workspace=str(tmp_path))), Sandbox)
    assert Config.from_env({}).build_sandbox == "on"
    for bad in ("0-10", "10-5", "x", "65500-"):
        with pytest.raises(ValueError, match="WHEELHOUSE_BUILD_UID_RANGE"):
            Sandbox.from_config(Config(workspace=str(tmp_path), build_uid_range=bad))


# --- supervision inside the sandbox ---------------------------------------------------------


def test_the_reaper_kills_a_sandboxed_tree_with_a_setsid_double_fork(
    tmp_path: Path, workspace: Workspace, sandbox: Sandbox,
) -> None:
    pid_dir = workspace.root / "pids"
    layout = workspace.layout
    workspace.layout = Layout(home=layout.home, tmp=layout.tmp,
                              read_only=(*layout.read_only, HOSTILE_SCRIPTS),
                              writable=(*layout.writable, pid_dir))
    tree = ("import os, subprocess, sys, time\n"
            f"scripts = {str(HOSTILE_SCRIPTS)!r}\n"
            "for args in (['double_fork.py', '--clear-env'], ['sleeper.py', 'ignorer', "
            "'--ignore-term'], ['pgroup_jobs.py', '2']):\n"
            "    subprocess.Popen([sys.executable, os.path.join(scripts, args[0]), *args[1:]])\n"
            "time.sleep(1000)\n")
    build = workspace.start(sandbox, [str(workspace.python), "-c", tree],
                            extra_env={"HOSTILE_PIDS": str(pid_dir)})
    ns = _sandbox_namespace(build)
    end = time.monotonic() + 20
    while not any(p.name.startswith("escaped-noenv") for p in pid_dir.iterdir()):
        assert time.monotonic() < end, workspace.log.read_text()
        time.sleep(0.05)
    inside = _in_namespace(ns)
    escapee = next(pid for pid in inside
                   if psutil.Process(pid).cmdline()[:1] == ["sleep"]
                   and BUILD_ID_ENV not in psutil.Process(pid).environ())
    assert os.getsid(escapee) != build.pid  # neither its session nor its cookie lead to it
    if IS_ROOT:
        assert psutil.Process(escapee).uids().real == sandbox.uid

    outcome = build.wait(deadline=time.monotonic(), grace=0.5)

    assert outcome.timed_out and outcome.reap is not None and outcome.reap.survivors == 0
    assert _in_namespace(ns) == []
    assert not psutil.pid_exists(escapee) or psutil.Process(escapee).status() == "zombie"
    assert build.processes() == []


def test_the_governor_sees_and_pauses_sandboxed_compile_jobs(
    workspace: Workspace, sandbox: Sandbox,
) -> None:
    layout = workspace.layout
    workspace.layout = Layout(home=layout.home, tmp=layout.tmp,
                              read_only=(*layout.read_only, HOSTILE_SCRIPTS),
                              writable=layout.writable)
    # As in test_governor: four 200 MiB jobs in their own process groups, a 600 MiB budget;
    # each holds its peak for a second, so that a loaded machine's sampler still sees it.
    build = workspace.start(sandbox, [str(workspace.python), str(HOSTILE_SCRIPTS / "hog_jobs.py"),
                                      "4", "200", "2", "1"])
    budget = 600 * MiB
    governor = MemoryGovernor(build, budget_bytes=budget, low_watermark=150 * MiB,
                              high_watermark=250 * MiB)
    states = JobStates(build, governor)

    outcome = build.wait(deadline=time.monotonic() + 60, on_tick=states.tick, tick=0.1)

    assert outcome.returncode == 0, workspace.log.read_text()
    assert governor.pauses >= 1 and governor.resumes == governor.pauses
    assert max(stopped for _, stopped in states.samples) >= 1
    assert all(running >= 1 for running, _ in states.samples)
    assert len(governor.job_peaks) == 4
    assert all(peak >= 200 * MiB for peak in governor.job_peaks)


# --- limits and what leaves ---------------------------------------------------------------


def test_the_disk_quota_kills_a_build_that_writes_too_much(
    workspace: Workspace, sandbox: Sandbox,
) -> None:
    code = (f"import time\nwith open({str(workspace.dist / 'fill')!r}, 'wb') as f:\n"
            "    for _ in range(64):\n        f.write(b'x' * (1 << 20)); f.flush()\n"
            "time.sleep(1000)\n")
    build = workspace.start(sandbox, [str(workspace.python), "-c", code])
    quota = DiskQuota(workspace.layout.all_writable, 16 * MiB, every=0.1)

    with pytest.raises(BuildFailed) as failed:
        build.wait(deadline=time.monotonic() + 60, on_tick=quota.check, tick=0.1, grace=0.2)

    assert failed.value.kind == FailureKind.TOO_LARGE
    assert "WHEELHOUSE_BUILD_DISK_LIMIT_GIB" in failed.value.reason
    assert quota.peak > 16 * MiB
    assert build.processes() == []


HOLD_UNLINKED = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.posix_fallocate(fd, 0, 256 << 20)
os.unlink(sys.argv[1])
print('holding', flush=True)
time.sleep(1000)
"""


def test_the_disk_quota_counts_files_held_open_after_unlinking_them(
    workspace: Workspace, sandbox: Sandbox,
) -> None:
    """No walk sees a file that was unlinked while open: the quota finds it through the
    build's descriptors (st_blocks: the preallocated 256 MiB, not a sparse size)."""
    build = workspace.start(sandbox, [str(workspace.python), "-c", HOLD_UNLINKED,
                                      str(workspace.dist / "held.bin")])
    quota = DiskQuota(workspace.layout.all_writable, 64 * MiB, every=0.1)
    free_before = shutil.disk_usage(workspace.root).free

    with pytest.raises(BuildFailed) as failed:
        build.wait(deadline=time.monotonic() + 60,
                   on_tick=lambda: quota.check(build.processes), tick=0.1, grace=0.2)

    assert "holding" in workspace.log.read_text()
    assert failed.value.kind is FailureKind.TOO_LARGE
    assert "unlinked but kept open" in failed.value.reason
    assert quota.peak_unlinked >= 256 * MiB
    assert build.processes() == []
    assert list(workspace.dist.iterdir()) == []  # nothing to walk, ever
    # The space came back with the processes (others' writes meanwhile aside).
    assert shutil.disk_usage(workspace.root).free > free_before - 128 * MiB


def test_prepare_gives_the_writable_paths_to_the_build_user(
    workspace: Workspace, sandbox: Sandbox,
) -> None:
    workspace.src.mkdir()
    (workspace.src / "setup.py").write_text("")
    (workspace.src / "link").symlink_to("/etc/passwd")
    sandbox.prepare(workspace.layout)
    for path in (workspace.src, workspace.src / "setup.py", workspace.dist,
                 workspace.layout.home, workspace.layout.tmp):
        assert os.lstat(path).st_uid == (sandbox.uid if IS_ROOT else os.getuid())
    assert Path("/etc/passwd").stat().st_uid == 0  # the link was not followed


def test_prepare_refuses_paths_the_build_could_have_swapped(
    workspace: Workspace, sandbox: Sandbox,
) -> None:
    """bubblewrap mounts as root: a path below an earlier step's writable tree, or a link in
    place of a writable directory, could point it at the worker's secrets."""
    if not IS_ROOT:
        pytest.skip("only a root worker has a build user distinct from itself")
    workspace.src.mkdir()
    os.chown(workspace.src, sandbox.uid, sandbox.gid)
    nested = Layout.in_workspace(workspace.root, writable=[workspace.src / "sub"])
    with pytest.raises(SandboxUnavailable, match="lies in a directory the build user owns"):
        sandbox.prepare(nested)
    (workspace.root / "dist").symlink_to("/root")
    with pytest.raises(SandboxUnavailable, match="is a link"):
        sandbox.prepare(workspace.layout)


def test_a_read_only_link_is_mounted_with_its_target(
    tmp_path: Path, workspace: Workspace, sandbox: Sandbox,
) -> None:
    """A toolkit at /opt/cuda -> /opt/cuda-12.8 works inside as outside."""
    real = tmp_path / "cuda-12.8"
    (real / "bin").mkdir(parents=True)
    (real / "bin" / "nvcc").write_text("fake")
    link = tmp_path / "cuda"
    link.symlink_to("cuda-12.8")
    layout = workspace.layout
    workspace.layout = Layout(home=layout.home, tmp=layout.tmp,
                              read_only=(*layout.read_only, link), writable=layout.writable)
    build = workspace.start(sandbox, ["/bin/cat", str(link / "bin" / "nvcc")])
    assert build.wait(deadline=time.monotonic() + 60).returncode == 0
    assert workspace.log.read_text().endswith("fake")


def test_the_source_is_seen_at_one_path_whatever_the_workspace(
    tmp_path: Path, workspace: Workspace, sandbox: Sandbox,
) -> None:
    """The build's source path is mounted at SOURCE_INSIDE (nvcc's cache keys hold the path a
    compiler sees): the program runs there, reads and writes the tree outside through it, and
    its outside path is not in the sandbox at all."""
    workspace.src.mkdir()
    (workspace.src / "kernel.cu").write_text("__global__ void k() {}\n")
    layout = workspace.layout
    workspace.layout = replace(layout, moved=((workspace.src, SOURCE_INSIDE),))
    assert workspace.layout.inside(workspace.src / "kernel.cu") == SOURCE_INSIDE / "kernel.cu"
    assert workspace.layout.inside(workspace.dist) == workspace.dist
    script = ("import os, sys; print(os.getcwd()); print(open('kernel.cu').read().strip()); "
              "open('built.o', 'w').write('object'); print(os.path.exists(sys.argv[1]))")
    build = workspace.start(sandbox, [str(workspace.python), "-c", script, str(workspace.src)],
                            cwd=workspace.src)
    assert build.wait(deadline=time.monotonic() + 60).returncode == 0, workspace.log.read_text()
    lines = workspace.log.read_text().splitlines()[-3:]
    assert lines == [str(SOURCE_INSIDE), "__global__ void k() {}", "False"], lines
    assert (workspace.src / "built.o").read_text() == "object"


def test_a_workspace_below_the_source_s_inside_path_is_refused(
    tmp_path: Path, sandbox: Sandbox,
) -> None:
    """Another mount below SOURCE_INSIDE would get its mount point made in the build's own
    tree: the sandbox refuses such a layout (a WHEELHOUSE_WORKSPACE below /wheelhouse/src)."""
    root = SOURCE_INSIDE / "work" / "build-1"
    layout = Layout.in_workspace(root, writable=[tmp_path / "src"],
                                 moved=((tmp_path / "src", SOURCE_INSIDE),))
    with pytest.raises(SandboxUnavailable, match="would be mounted inside /wheelhouse/src"):
        sandbox.wrap(["true"], layout=layout, cwd=tmp_path / "src")


def test_walks_stop_at_the_depth_limit(workspace: Workspace, sandbox: Sandbox) -> None:
    """A tree nested past MAX_DEPTH (deeper than PATH_MAX, too) fails the build, not the worker."""
    workspace.src.mkdir()
    fd = os.open(workspace.src, os.O_RDONLY)
    for _ in range(MAX_DEPTH + 5):  # relative to descriptors: no path gets long
        os.mkdir("d" * 200, dir_fd=fd)
        sub = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    with pytest.raises(BuildFailed, match=f"deeper than {MAX_DEPTH} levels") as failed:
        DiskQuota([workspace.src], GIB).usage()
    assert failed.value.kind == FailureKind.TOO_LARGE
    if IS_ROOT:
        with pytest.raises(BuildFailed, match=f"deeper than {MAX_DEPTH} levels"):
            sandbox.prepare(workspace.layout)
    shutil.rmtree(workspace.src)


# --- the edge: what one build may do to the host and to other builds -----------------------

NESTED = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(rc):
    return 'ok' if rc >= 0 else os.strerror(ctypes.get_errno())
unshare = subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'],
                         capture_output=True, text=True)
print('unshare-cmd', unshare.returncode, unshare.stderr.strip()[-80:])
print('unshare-sys', errno_of(libc.unshare(0x10000000)))
print('add_key', errno_of(libc.syscall(248, b'user', b'canary', b'secret', 6, -4)))
print('keyctl', errno_of(libc.syscall(250, 0, -4, 0)))
print('fork', subprocess.run(['true']).returncode)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="syscall numbers of x86_64")
def test_no_user_namespace_and_no_keyring_inside_a_build(
    workspace: Workspace, sandbox: Sandbox,
) -> None:
    build = workspace.start(sandbox, [str(workspace.python), "-c", NESTED])
    outcome = build.wait(deadline=time.monotonic() + 60)
    out = workspace.log.read_text()
    assert outcome.returncode == 0, out
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()
            if line.split(" ", 1)[0] in ("unshare-cmd", "unshare-sys", "add_key", "keyctl",
                                          "fork")}
    assert said["unshare-cmd"].startswith("1 ") and "Operation not permitted" in said[
        "unshare-cmd"], said
    assert said["unshare-sys"] == "Operation not permitted"
    assert said["add_key"] == said["keyctl"] == "Operation not permitted"
    assert said["fork"] == "0"  # threads and processes still start (clone3 falls back)


FORK_BOMB = """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
    except OSError:
        time.sleep(0.01)
"""
HOG = "import time\nheld = b'x' * (160 << 20)\nprint('holding', flush=True)\ntime.sleep(600)\n"


@pytest.mark.skipif(not IS_ROOT, reason="RLIMIT_NPROC of a build uid needs a root worker")
@pytest.mark.parametrize(("what", "code", "limits", "said"), [
    ("processes", FORK_BOMB, {"max_processes": 48, "max_bytes": 64 * GIB}, "processes"),
    ("memory", HOG, {"max_processes": 0, "max_bytes": 100 * MiB}, "of memory, over the 100 MiB"),
], ids=["processes", "memory"])
def test_a_build_past_its_process_or_memory_cap_ends_classified(
    workspace: Workspace, sandbox: Sandbox, what: str, code: str, limits: dict[str, int],
    said: str, artifacts_dir: Path,
) -> None:
    from dataclasses import replace


    capped = replace(sandbox, max_processes=limits["max_processes"] or sandbox.max_processes)
    tree = TreeLimits(max_processes=limits["max_processes"], max_bytes=limits["max_bytes"],
                      every=0.2)
    started = time.monotonic()
    build = workspace.start(capped, [str(workspace.python), "-c", code])
    with pytest.raises(BuildFailed, match=said) as failed:
        build.wait(deadline=time.monotonic() + 120, on_tick=lambda: tree.check(build.processes),
                   tick=0.2, grace=0.5)
    assert failed.value.kind is FailureKind.TOO_LARGE
    assert build.processes() == []
    # Figures for docs/security.md.
    (artifacts_dir / "edge").mkdir(exist_ok=True)
    (artifacts_dir / "edge" / f"cap-{what}.json").write_text(json.dumps({
        "reason": failed.value.reason, "seconds to the end": round(time.monotonic() - started, 2),
        "peak tasks": tree.peak_processes, "peak MiB": tree.peak_bytes >> 20}, indent=1))
    if what == "processes":
        # The kernel held it at the cap: never more of the build uid's tasks than RLIMIT_NPROC
        # allows (besides them, the tree holds bubblewrap's own two processes, root's).
        assert tree.peak_processes <= limits["max_processes"] + 2


LOOK_AROUND = """
import os, sys
other_file, other_uid = sys.argv[1], int(sys.argv[2])
mine = [p for p in os.listdir('/proc') if p.isdigit()]
owners = set()
for pid in mine:
    try:
        owners.add(os.stat('/proc/' + pid).st_uid)
    except OSError:
        pass
try:
    open(other_file).read()
    seen = 'read'
except OSError as exc:
    seen = exc.strerror
print('look', os.getuid(), other_uid in owners, seen)
"""


@pytest.mark.skipif(not IS_ROOT, reason="builds have their own uids only under a root worker")
def test_two_builds_at_once_have_two_uids_and_see_nothing_of_each_other(
    tmp_path: Path, build_python: Path, sandbox: Sandbox,
) -> None:
    first, lock_a = sandbox.claim()
    second, lock_b = sandbox.claim()
    assert lock_a is not None and lock_b is not None
    try:
        assert first.uid != second.uid and first.uid in sandbox.range_uids
        a = Workspace(tmp_path / "work" / "build-a", build_python)
        b = Workspace(tmp_path / "work" / "build-b", build_python)
        a.root.mkdir(parents=True)
        b.root.mkdir()
        secret = a.layout.home / "secret"
        keeper = a.start(first, [str(build_python), "-c",
                                 f"import time; open({str(secret)!r}, 'w').write('a');"
                                 "time.sleep(600)"])
        end = time.monotonic() + 30
        while not secret.exists():
            assert time.monotonic() < end, a.log.read_text()
            time.sleep(0.05)
        looker = b.start(second, [str(build_python), "-c", LOOK_AROUND, str(secret),
                                  str(first.uid)])
        assert looker.wait(deadline=time.monotonic() + 60).returncode == 0, b.log.read_text()
        keeper.wait(deadline=time.monotonic(), grace=0.5)
        look = next(line for line in b.log.read_text().splitlines() if line.startswith("look"))
        assert look == f"look {second.uid} False No such file or directory"
        assert os.stat(secret).st_uid == first.uid
    finally:
        os.close(lock_a)
        os.close(lock_b)
    # Released, the first uid is the next build's again.
    again, lock = sandbox.claim()
    assert lock is not None and again.uid == first.uid
    os.close(lock)


@pytest.mark.skipif(not IS_ROOT, reason="builds have their own uids only under a root worker")
def test_workers_with_different_workspaces_never_share_a_uid(tmp_path: Path) -> None:
    """The claim locks are host-wide (WHEELHOUSE_BUILD_UID_LOCK_DIR), not per workspace: two
    workers on one host hand out different uids while both builds hold theirs."""
    one = Sandbox.from_config(Config(workspace=str(tmp_path / "worker-1")))
    two = Sandbox.from_config(Config(workspace=str(tmp_path / "worker-2")))
    assert one is not None and two is not None
    assert one.slots_dir == two.slots_dir == Path(Config().build_uid_lock_dir)
    first, lock_a = one.claim()
    second, lock_b = two.claim()
    try:
        assert lock_a is not None and lock_b is not None
        assert first.uid != second.uid
        held = os.lstat(one.slots_dir)
        assert stat.S_IMODE(held.st_mode) == 0o700 and held.st_uid == 0
    finally:
        for lock in (lock_a, lock_b):
            if lock is not None:
                os.close(lock)


@pytest.mark.skipif(not IS_ROOT, reason="builds have their own uids only under a root worker")
def test_the_startup_check_runs_as_a_uid_it_holds(tmp_path: Path) -> None:
    """The check claims its uid as a build does: with the range's one uid held by a build, it
    waits until that build lets go rather than run as the build's identity."""
    import threading

    config = Config(workspace=str(tmp_path / "work"), build_uid_range="65490",
                    build_uid_lock_dir=str(tmp_path / "uids"))
    sandbox = Sandbox.from_config(config)
    assert sandbox is not None
    build, held = sandbox.claim()
    assert held is not None and build.uid == 65490
    lock: int = held
    released = 0.0

    def release() -> None:
        nonlocal released
        time.sleep(1.5)
        released = time.monotonic()
        os.close(lock)

    letting_go = threading.Thread(target=release)
    letting_go.start()
    try:
        assert startup_check(config) is None
        checked = time.monotonic()
    finally:
        letting_go.join()
    assert released and checked >= released
    # ... and it let go of the uid when done: the next build gets it at once.
    again, second = sandbox.claim()
    assert second is not None and again.uid == 65490
    os.close(second)


def test_builds_in_one_process_write_the_seccomp_filter_without_renaming_each_others(
    tmp_path: Path,
) -> None:
    """Two builds of one worker process (threads share the pid) write the filter at once: each
    writes a file of its own and renames it over, so none finds its file renamed away."""
    from worker.sandbox import seccomp

    target = seccomp.write_filter(tmp_path)
    errors: list[BaseException] = []

    def write(barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            assert seccomp.write_filter(tmp_path) == target
        except BaseException as exc:  # the test reports it
            errors.append(exc)

    for _ in range(30):
        target.write_bytes(b"stale")  # every writer finds it out of date and rewrites it
        barrier = threading.Barrier(8)
        threads = [threading.Thread(target=write, args=(barrier,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert target.read_bytes() == seccomp.program()
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no writer's file left over


def test_a_proof_gets_the_device_nodes_it_is_given_and_a_build_none(
        workspace: Workspace, sandbox: Sandbox) -> None:
    """What a GPU proof's ``/dev/nvidia*`` get, shown with a host character device that the
    sandbox's own ``/dev`` lacks: present only when given; a link or a path outside ``/dev``
    is refused before anything runs."""
    device = Path("/dev/kmsg")
    if not device.is_char_device():
        pytest.skip("this host has no /dev/kmsg to stand in for a GPU's device node")
    probe = ["/bin/sh", "-c", f"test -c {device} && echo present || echo absent"]
    build = workspace.start(sandbox, probe)
    assert build.wait(deadline=time.monotonic() + 60).returncode == 0
    assert workspace.log.read_text().strip().endswith("absent")  # a build gets no host device
    layout = workspace.layout
    workspace.layout = Layout(home=layout.home, tmp=layout.tmp, read_only=layout.read_only,
                              writable=layout.writable, devices=(device,))
    build = workspace.start(sandbox, probe)
    assert build.wait(deadline=time.monotonic() + 60).returncode == 0
    assert workspace.log.read_text().strip().endswith("present")
    for bad, why in ((Path("/dev/stdin"), "not a character device under /dev"),
                     (workspace.root, "not a character device under /dev"),
                     (Path("/dev/nvidia-none"), "No such file")):
        workspace.layout = replace(workspace.layout, devices=(bad,))
        with pytest.raises(SandboxUnavailable, match=why):
            workspace.start(sandbox, probe)


def test_the_gpu_device_nodes_are_character_devices_never_links(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia0", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(dev / "nvidiactl", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (dev / "nvidia1").symlink_to("/dev/null")  # a link is never followed into the sandbox
    (dev / "nvidia2").write_text("not a device")
    (dev / "null").symlink_to("/dev/null")
    assert gpu_devices(dev) == [dev / "nvidia0", dev / "nvidiactl"]
    assert gpu_devices(tmp_path / "none") == []
