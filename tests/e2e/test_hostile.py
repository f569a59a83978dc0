"""A hostile sdist built by a real ``wheelhouse worker`` (issue 9's figures).

The worker runs as an operator runs it: a real redis-server that requires a password, moto's S3
server holding the wheels, the index in front. Canary secrets sit where a worker keeps its own:
its environment (``WHEELHOUSE_SECRET_KEY``, the AWS keys, the Redis URL's password), its home
(``~/.aws/credentials``, ``~/.netrc``) and its workspace root. The hostile fixture
(``tests/fixtures/hostile``) looks for all of them while it builds and again when the worker
imports its extension, tries Redis, S3, a counting listener and the internet, signals the worker
and writes where it should not. Whatever it found goes into its log and its wheel, which is why
the log, the wheel, Redis and the bucket are searched for every canary afterwards.

A second test denies the worker its sandbox: it refuses to take builds at all.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import uuid
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from tests.helpers import (
    Listener,
    fake_cuda_toolkit,
    free_port,
    host_addresses,
    run_worker,
    start_index,
    wait_for_port,
)
from tests.worker.conftest import TORCH_FIND_LINKS, build_config, hostile_sdist
from wheelhouse.builds import queue as q
from wheelhouse.builds.fleet import live_workers
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.index.storage import make_s3_client
from worker.sandbox.wrapper import Sandbox
from worker.steps.publish import log_key

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server is not installed"),
    pytest.mark.skipif(not any(Path(TORCH_FIND_LINKS).glob("torch-2.14.*.whl")),
                       reason=f"no torch 2.14 wheel in {TORCH_FIND_LINKS}"),
]

SPEC = BuildSpec.create("hostile", "0.1.0", python="3.11", torch="2.14", cuda="13.0",
                        archs=["sm80"])
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def guarded_redis(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A redis-server of its own that requires a password (a canary); yields (URL, password)."""
    import signal
    import subprocess

    password = f"canary-redis-password-{uuid.uuid4().hex}"
    port = free_port()
    workdir = tmp_path / "redis"
    workdir.mkdir()
    proc = subprocess.Popen(
        [str(shutil.which("redis-server")), "--port", str(port), "--bind", "127.0.0.1",
         "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(port)
        yield f"redis://:{password}@127.0.0.1:{port}/0", password
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture
def abstract_listener() -> Iterator[tuple[str, Listener]]:
    """A unix socket in the abstract namespace (no file to hide it behind); yields its name."""
    name = f"wheelhouse-test-{uuid.uuid4().hex}"
    server = Listener(abstract=name)
    try:
        yield name, server
    finally:
        server.close()


def _wait_for(what: str, check: Any, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}; worker log:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def _files(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``roots`` with its size and mtime (logs of the test's servers aside)."""
    found = {}
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and path.suffix != ".log":
                st = path.stat()
                found[str(path)] = (st.st_size, st.st_mtime_ns)
    return found


def _redis_dump(conn: redis.Redis) -> list[bytes]:
    """Every key and value in the database, decompressed where RQ compressed it."""
    out: list[bytes] = []
    for key in conn.scan_iter(count=1000):
        out.append(key)
        kind = conn.type(key)
        values: list[bytes] = []
        if kind == b"string":
            values = [conn.get(key) or b""]
        elif kind == b"list":
            values = conn.lrange(key, 0, -1)
        elif kind == b"hash":
            for field, value in conn.hgetall(key).items():
                values += [field, value]
        elif kind == b"set":
            values = list(conn.smembers(key))
        elif kind == b"zset":
            values = conn.zrange(key, 0, -1)
        elif kind == b"stream":
            for _, fields in conn.xrange(key):
                for field, value in fields.items():
                    values += [field, value]
        for value in values:
            out.append(value)
            try:
                out.append(zlib.decompress(value))
            except zlib.error:
                pass
    return out


def _bucket_dump(s3: Any, bucket: str) -> dict[str, list[bytes]]:
    """Every object in the bucket; a wheel's members unzipped (they are compressed in it)."""
    out: dict[str, list[bytes]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            parts = [obj["Key"].encode(), body]
            if obj["Key"].endswith(".whl") and "/wheels/" in obj["Key"]:  # not a claim
                with zipfile.ZipFile(io.BytesIO(body)) as zf:
                    parts += [zf.read(name) for name in zf.namelist()]
            out[obj["Key"]] = parts
    return out


def _findings(log: str, marker: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(marker, 1)[1]) for line in log.splitlines() if marker in line]


def _summary(findings: dict[str, Any]) -> dict[str, Any]:
    """What one look tried and what came of it, in counts."""
    def tally(results: dict[str, str], ok: str) -> str:
        return f"{sum(not r.startswith(ok) for r in results.values())} of {len(results)}"

    return {
        "processes visible": len({key.split("/")[2] for key in findings["proc"]}),
        "files read (of those tried)": tally(findings["files"], "denied"),
        "connections made": tally(findings["connections"], "failed"),
        "signals delivered": tally({k: v for k, v in findings["signals"].items()
                                    if "probe" not in k}, "failed"),
        "files written": tally(findings["writes"], "failed"),
        "uid": findings["identity"]["uid"],
        "gpu devices": [d for d in findings["dev"] if d.startswith("nvidia")],
        "kernel (user namespaces, keyrings)": tally(findings.get("kernel", {}), "failed"),
    }


def test_a_hostile_sdist_built_by_a_real_worker_learns_reaches_and_leaves_nothing(
    tmp_path: Path, guarded_redis: tuple[str, str], s3_server: str, listener: Listener,
    abstract_listener: tuple[str, Listener], monkeypatch: pytest.MonkeyPatch,
    artifacts_dir: Path,
) -> None:
    redis_url, redis_password = guarded_redis
    canaries = {name: f"canary-{name}-{uuid.uuid4().hex}" for name in (
        "secret-key", "aws-key-id", "aws-secret", "aws-file", "netrc", "workspace-file")}
    canaries["redis-password"] = redis_password
    aws = {"AWS_ACCESS_KEY_ID": canaries["aws-key-id"],
           "AWS_SECRET_ACCESS_KEY": canaries["aws-secret"], "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in aws.items():  # moto takes any keys; the test's own client uses these
        monkeypatch.setenv(name, value)
    bucket = f"wheels-{uuid.uuid4().hex[:8]}"
    config = replace(build_config(tmp_path), storage=f"s3://{bucket}/idx",
                     s3_endpoint_url=s3_server, redis_url=redis_url,
                     secret_key=canaries["secret-key"], worker_heartbeat_seconds=1,
                     catalog_refresh_seconds=0.2)
    s3 = make_s3_client(config)
    s3.create_bucket(Bucket=bucket)
    # The worker's home and workspace root, with its secrets in them.
    home = tmp_path / "worker-home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = x\naws_secret_access_key = {canaries['aws-file']}\n")
    (home / ".netrc").write_text(f"machine example.com password {canaries['netrc']}\n")
    work = Path(config.workspace)
    work.mkdir()
    (work / "notes.txt").write_text(canaries["workspace-file"])
    env = {**aws, "HOME": str(home),
           # The real uv cache (the fake home has none): torch is linked from it, not copied.
           "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv")),
           "CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0"))}
    conn = redis.Redis.from_url(redis_url)
    log = tmp_path / "worker.log"

    with start_index(config, tmp_path, extra_env=env) as url, \
            run_worker(config, "hostile-host", log, "--cuda", "13.0", extra_env=env) as worker:
        _wait_for("the worker never advertised", lambda: live_workers(conn), 60, log)
        outside_tmp = Path("/tmp") / f"hostile-{uuid.uuid4().hex}"
        outside_root = Path("/") / f"hostile-{uuid.uuid4().hex}"
        writes = [home / "hostile", work / "hostile", tmp_path / "hostile", outside_tmp,
                  outside_root]
        targets = {
            "read": [str(home / ".aws" / "credentials"), str(home / ".netrc"),
                     str(work / "notes.txt"), str(home), f"/proc/{worker.pid}/environ"],
            "connect": [["redis", "127.0.0.1", conn.connection_pool.connection_kwargs["port"]],
                        ["s3", "127.0.0.1", int(s3_server.rsplit(":", 1)[1])],
                        ["listener", "127.0.0.1", listener.port],
                        *[["listener", addr, listener.port] for addr in host_addresses()],
                        ["abstract", abstract_listener[0], 0],
                        ["public", "1.1.1.1", 443]],
            "kill": [worker.pid],
            "write": [str(p) for p in writes],
        }
        sdist = hostile_sdist(tmp_path, targets)
        before = _files(tmp_path, home)
        noauth_before = conn.info("errorstats").get("errorstat_NOAUTH", {}).get("count", 0)

        job_id = q.enqueue_build(conn, SPEC, source=str(sdist), timeout=900).job_id

        def finished() -> bool:
            status = q.get_build(conn, job_id)
            return status is not None and status.finished

        _wait_for("the build did not finish", finished, 600, log)
        status = q.get_build(conn, job_id)
        assert status is not None
        live_log = "\n".join(q.log_since(conn, job_id)[0])
        page = requests.get(f"{url}/builds/{job_id}", timeout=30).text
        view = requests.get(f"{url}/api/builds/{job_id}", timeout=30).json()
        assert worker.poll() is None, "the build stopped the worker"
        after = _files(tmp_path, home)

    sandbox = Sandbox.from_config(config)
    assert sandbox is not None
    stored_log = s3.get_object(Bucket=bucket, Key=f"idx/{log_key(SPEC)}")["Body"].read().decode()
    # The wheel is published: a well-formed wheel of the spec, whose import the check ran.
    # (Were the build to fail, no wheel would be published; every search below still holds.)
    assert status.state is q.BuildState.BUILT, (status.failure_kind, status.reason)
    built = _findings(stored_log, "hostile-build-findings: ")
    imported = _findings(stored_log, "hostile-import-findings: ")
    assert built and imported, stored_log[-3000:]
    # The figures in the README's Security section come from here.
    out = artifacts_dir / "hostile"
    out.mkdir(exist_ok=True)
    (out / "findings.json").write_text(json.dumps(
        {"summary": {"build": _summary(built[-1]), "import": _summary(imported[-1])},
         "build": built[-1], "import": imported[-1]}, indent=1, sort_keys=True))

    # Nothing it could see held a secret: not its log (stored and live), not the wheel or
    # anything else in the bucket, not Redis.
    objects = _bucket_dump(s3, bucket)
    assert any(key.endswith(".whl") and "/wheels/" in key for key in objects)
    searched = {"stored log": [stored_log.encode()], "live log": [live_log.encode()],
                "redis": _redis_dump(conn), **objects}
    for canary_name, canary in canaries.items():
        for where, blobs in searched.items():
            assert not any(canary.encode() in blob for blob in blobs), \
                f"the {canary_name} canary is in {where}"

    for findings in (*built, *imported):
        # It looked, and found nothing of the host: a private /proc with its own few processes,
        # no home or workspace files of the worker's, no GPU devices.
        assert len({key.split("/")[2] for key in findings["proc"]}) < 15
        for path in targets["read"]:
            assert findings["files"][path].startswith("denied"), (path, findings["files"][path])
        own = findings["identity"]["home"]
        assert own.startswith(str(work) + "/")
        # The workspace root holds only this build's own directory, as far as it can tell.
        assert findings["files"].get(str(work), f"dir: {Path(own).parent.name}") == \
            f"dir: {Path(own).parent.name}"
        if IS_ROOT:
            assert findings["identity"]["uid"] == sandbox.uid
        assert not [d for d in findings["dev"] if d.startswith("nvidia")]
        # Every door was tried and none opened.
        assert len(findings["connections"]) >= 5
        assert all(r.startswith("failed") for r in findings["connections"].values()), \
            findings["connections"]
        assert all(r.startswith("failed") for pid, r in findings["signals"].items()
                   if "probe" not in pid), findings["signals"]
        assert all(r.startswith("failed") for path, r in findings["writes"].items()
                   if path != str(outside_tmp)), findings["writes"]  # /tmp is its own
        # No user namespace of its own, no kernel keyring (docs/security.md).
        if IS_ROOT and os.uname().machine == "x86_64":
            assert set(findings["kernel"].values()) == {"failed: Operation not permitted"}, \
                findings["kernel"]

    # No connection reached the services.
    assert listener.accepted == 0 and abstract_listener[1].accepted == 0
    assert conn.info("errorstats").get("errorstat_NOAUTH", {}).get("count", 0) == noauth_before
    assert conn.get("hostile-was-here") is None
    assert "hostile-was-here" not in {b["Name"] for b in s3.list_buckets()["Buckets"]}
    # Nothing was written outside its workspace (which is gone with the build).
    assert not [p for p in writes if p.exists()]
    # Besides the workspace, what a build leaves on the host by design: the worker's lock on
    # the project version's source path (empty), and the compile cache's entries in this
    # project's own namespace, where the sandbox let the build's sccache server write.
    # and the worker's own directory (the seccomp filter, the locks of the build uids).
    lock = str(work / "src" / "hostile-0.1.0.lock")
    own_cache = f"{work / 'sccache' / 'hostile'}/"
    assert after.pop(lock, (0, 0))[0] == 0
    after = {path: st for path, st in after.items() if not path.startswith(own_cache)}
    # The box's provenance CA and the worker's certificate (root's, 0600: docs/provenance.md)
    # are the worker's own too.
    worker_own = (f"{work / '.sandbox'}/", f"{work / 'provenance'}/")
    after, before = ({path: st for path, st in files.items() if not path.startswith(worker_own)}
                     for files in (after, before))
    assert after == before, set(after.items()) ^ set(before.items())
    assert {p.name for p in work.iterdir()} <= {"notes.txt", "src", "sccache", ".sandbox",
                                                "provenance"}
    assert [p.name for p in (work / "sccache").iterdir()] in ([], ["hostile"])

    # The build page and the record say how it was sandboxed.
    assert view["sandbox"] == sandbox.describe() and sandbox.describe() in page
    assert f"build sandbox: {sandbox.describe()}" in log.read_text()


def test_a_worker_that_cannot_sandbox_builds_takes_no_build(tmp_path: Path,
                                                            redis_url: str) -> None:
    """Fail closed: denied what the sandbox needs, the worker says why in one line and exits
    before it listens on a queue or advertises itself; the queued build stays queued."""
    bwrap = tmp_path / "bin" / "bwrap"
    bwrap.parent.mkdir()
    bwrap.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not "
                     "permitted' >&2\nexit 1\n")
    bwrap.chmod(0o755)
    config = replace(build_config(tmp_path), redis_url=redis_url,
                     build_sandbox_bwrap=str(bwrap))
    conn = redis.Redis.from_url(redis_url)
    job_id = q.enqueue_build(conn, SPEC, source=str(tmp_path / "nothing.tar.gz"),
                             require_worker=False).job_id
    log = tmp_path / "worker.log"
    env = {"CUDA_HOME": str(fake_cuda_toolkit(tmp_path / "cuda-13.0", "13.0"))}

    with run_worker(config, "no-sandbox", log, "--cuda", "13.0", extra_env=env) as worker:
        returncode = worker.wait(timeout=120)

    lines = log.read_text().strip().splitlines()
    assert returncode == 1
    assert lines[-1] == ("Error: refusing to build: the build sandbox cannot be created: bwrap: "
                         "Creating new namespace failed: Operation not permitted")
    assert not [line for line in lines if "listening on" in line or "Traceback" in line]
    assert live_workers(conn) == []
    status = q.get_build(conn, job_id)
    assert status is not None and status.state is q.BuildState.QUEUED
