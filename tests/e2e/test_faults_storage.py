"""Storage faults injected into a running index (issue 10): real servers, real signals.

Every part is a real process: moto's S3 server in a process group of its own (so it can be
stopped with SIGSTOP, killed and started again), ``wheelhouse serve`` under gunicorn, a small
tmpfs for a full disk. Each test says the fault, what is asked during it, and asserts: no 500
(only 200, and 503 with ``Retry-After`` where storage is needed), no request slower than the
configured storage timeouts allow, and recovery within a stated time after the fault ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import requests

from tests.helpers import IndexURL, free_port, make_wheel, run_console, start_index, wait_for_port
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import S3Storage, make_s3_client, open_storage
from wheelhouse.retry import S3_REQUESTS
from wheelhouse.variants import parse_variant

pytestmark = pytest.mark.slow

V = parse_variant("torch2.8-cu128")
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}
CONNECT, READ = 1.0, 2.0
#: The longest a request may take while storage hangs: the attempts of one storage call, each
#: bounded by the read timeout, botocore's backoff between them (at most 1 s), the catalog's
#: wait for a refresh it started (2 s), and 3 s for a loaded 2-core machine.
BOUND = S3_REQUESTS.attempts * READ + 1 + 2 + 3
#: How soon after a fault ends everything must answer as before it.
RECOVERY = 20.0
STALE = "X-Wheelhouse-Catalog"


class MotoServer:
    """moto's S3 API as a separate process on a fixed port, in its own process group."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_port(self.port, timeout=30)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: state is lost, connections are refused until :meth:`start`."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def moto(tmp_path: Path, s3_env: dict[str, str]) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path / "moto.log")
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.kill()


def _config(moto: MotoServer) -> Config:
    return Config(storage="s3://faults/idx", s3_endpoint_url=moto.url,
                  storage_connect_timeout=CONNECT, storage_read_timeout=READ,
                  catalog_refresh_seconds=0.5, upstream="http://127.0.0.1:9/simple/")


def _publish(config: Config, tmp_path: Path, versions: range) -> list[Record]:
    storage = open_storage(config)
    if isinstance(storage, S3Storage):
        with contextlib.suppress(storage.client.exceptions.BucketAlreadyOwnedByYou):
            storage.client.create_bucket(Bucket=storage.bucket)
    return [publish(storage, make_wheel(tmp_path / "w" / str(v), "demo-ext",
                                        f"1.{v}+{V.local_label}", payload=os.urandom(20_000)), V)
            for v in versions]


@dataclass
class Answer:
    path: str
    status: int | None
    """None: the connection failed (refused, reset, or closed mid-body)."""
    seconds: float
    stale: bool
    body_ok: bool = True
    retry_after: bool = False


@dataclass
class Prober:
    """Asks the index a fixed round of questions, over and over, in a thread."""

    url: IndexURL
    records: list[Record]
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def round(self) -> list[tuple[str, Callable[[requests.Response], bool]]]:
        page = f"/{V.key}/simple/demo-ext/"
        out: list[tuple[str, Callable[[requests.Response], bool]]] = [
            ("/healthz", lambda r: True),
            (page, lambda r: r.json()["name"] == "demo-ext"),
            (f"/{V.key}/simple/", lambda r: True),
        ]
        for rec in self.records:
            url = f"/files/{V.key}/demo-ext/{rec.filename}"
            out.append((url, lambda r, rec=rec: hashlib.sha256(r.content).hexdigest()
                        == rec.sha256))
            out.append((url + ".metadata", lambda r, rec=rec:
                        hashlib.sha256(r.content).hexdigest() == rec.metadata_sha256))
        return out

    def ask(self, session: requests.Session, path: str,
            check: Callable[[requests.Response], bool]) -> Answer:
        started = time.monotonic()
        try:
            r = session.get(self.url + path, headers=JSON, timeout=BOUND + 10,
                            allow_redirects=False)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            # Refused, reset, or cut short of Content-Length (which the client detects).
            return Answer(path, None, time.monotonic() - started, False)
        return Answer(path, r.status_code, time.monotonic() - started, STALE in r.headers,
                      body_ok=r.status_code != 200 or check(r),
                      retry_after=r.headers.get("Retry-After") is not None)

    def _ask_over_and_over(self, path: str, check: Callable[[requests.Response], bool]) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                self.answers.append(self.ask(session, path, check))

    @contextlib.contextmanager
    def running(self) -> Iterator[list[Answer]]:
        """One client per question, each asking it over and over: a slow answer to one (a
        wheel while storage hangs) does not keep the others from being asked."""
        threads = [threading.Thread(target=self._ask_over_and_over, args=q, daemon=True)
                   for q in self.round()]
        for t in threads:
            t.start()
        try:
            yield self.answers
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=BOUND + 20)


def _assert_no_500_and_bounded(answers: list[Answer], what: str) -> None:
    assert answers, f"nothing was asked during {what}"
    bad = [a for a in answers if a.status is not None and a.status >= 500 and a.status != 503]
    assert not bad, f"{what}: {bad[:5]}"
    assert all(a.retry_after for a in answers if a.status == 503), what
    slow = [a for a in answers if a.seconds > BOUND]
    assert not slow, f"{what}: slower than {BOUND}s: {slow[:5]}"
    wrong = [a for a in answers if not a.body_ok]
    assert not wrong, f"{what}: wrong bytes served: {wrong[:5]}"


def _recovered(url: IndexURL, records: list[Record], started: float) -> float:
    """Seconds from ``started`` until every question is answered 200, fresh, with the right
    bytes; fails the test past :data:`RECOVERY`."""
    prober = Prober(url, records)
    with requests.Session() as session:
        while True:
            answers = [prober.ask(session, p, c) for p, c in prober.round()]
            if all(a.status == 200 and a.body_ok and not a.stale for a in answers):
                return time.monotonic() - started
            assert time.monotonic() - started < RECOVERY, \
                f"not recovered after {RECOVERY}s: {[a for a in answers if a.status != 200]}"
            time.sleep(0.2)


def _serve(config: Config, tmp_path: Path, workers: int = 2) -> contextlib.AbstractContextManager[
        IndexURL]:
    return start_index(config, tmp_path, workers=workers)


def test_s3_hangs(moto: MotoServer, tmp_path: Path) -> None:
    """Fault: the S3 server SIGSTOPped for 12 s (connections accepted, never answered).
    Asked throughout: /healthz, the project page and the root (JSON), every wheel and its
    .metadata. Expected: pages 200 from the last good catalog, marked stale once the refresh
    has hung; what needs storage 503 with Retry-After; nothing slower than BOUND; all fresh
    and 200 within RECOVERY of SIGCONT."""
    config = _config(moto)
    records = _publish(config, tmp_path, range(3))
    with _serve(config, tmp_path) as url:
        assert _recovered(url, records, time.monotonic()) >= 0  # warm: everything answers
        prober = Prober(url, records)
        with prober.running() as answers:
            moto.signal(signal.SIGSTOP)
            time.sleep(12)
            during = list(answers)
            moto.signal(signal.SIGCONT)
            resumed = time.monotonic()
        _assert_no_500_and_bounded(during, "an S3 hang")
        pages = [a for a in during if "/simple/" in a.path]
        assert pages and all(a.status == 200 for a in pages), pages[:5]
        assert any(a.stale for a in pages), "no page was marked stale during the hang"
        wheels = [a for a in during if a.path.endswith(".whl")]
        assert any(a.status == 503 for a in wheels)
        health = [a for a in during if a.path == "/healthz"]
        # Never touched storage; it can still queue behind a worker's threads that all wait on
        # storage at the very start of the hang, which BOUND (asserted above) limits.
        assert health and all(a.status == 200 for a in health)
        took = _recovered(url, records, resumed)
        print(f"S3 hang: {len(during)} requests, "
              f"{sum(a.status == 503 for a in during)} answered 503, 0 x 500, slowest "
              f"{max(a.seconds for a in during):.1f}s (/healthz "
              f"{max(a.seconds for a in health):.2f}s); recovered {took:.1f}s after SIGCONT")
        assert " 500 " not in url.access_log()


def test_s3_killed_restarted_empty_and_restored(moto: MotoServer, tmp_path: Path) -> None:
    """Fault: the S3 server SIGKILLed (connections refused) for 5 s, then started again with
    its state lost: no bucket (NoSuchBucket) for 2 s, then an empty bucket for 3 s, then the
    objects restored from a copy. Asked throughout: as in test_s3_hangs. Expected: pages 200
    and marked stale while S3 is gone, bucketless or empty (never an empty index, never a
    redirect upstream), storage reads 503 with Retry-After, nothing slower than BOUND; all
    fresh and whole within RECOVERY of the restore."""
    config = _config(moto)
    records = _publish(config, tmp_path, range(3))
    storage = open_storage(config)
    copy = {o.key: storage.get_bytes(o.key) for o in storage.list("")}
    with _serve(config, tmp_path) as url:
        _recovered(url, records, time.monotonic())
        prober = Prober(url, records)
        with prober.running() as answers:
            moto.kill()
            time.sleep(5)
            moto.start()
            time.sleep(2)
            make_s3_client(config).create_bucket(Bucket="faults")
            time.sleep(3)
            restored = time.monotonic()
            fresh = open_storage(config)
            for key, data in copy.items():
                fresh.put_bytes(key, data)
            during = list(answers)
        _assert_no_500_and_bounded(during, "S3 killed and restarted")
        pages = [a for a in during if "/simple/" in a.path]
        assert all(a.status == 200 for a in pages), [a for a in pages if a.status != 200][:5]
        assert any(a.stale for a in pages)
        took = _recovered(url, records, restored)
        print(f"S3 killed: {len(during)} requests, "
              f"{sum(a.status == 503 for a in during)} answered 503, "
              f"{sum(a.status is None for a in during)} connection errors, 0 x 500; "
              f"recovered {took:.1f}s after the restore")
        assert " 500 " not in url.access_log()


def test_s3_down_at_start_up(moto: MotoServer, tmp_path: Path) -> None:
    """Fault: the S3 server is down when the index starts. Asked: /healthz, a hosted project's
    page, its root. Expected: the index starts anyway; /healthz 200; the pages 503 with a
    message and Retry-After (never a 500, never a redirect upstream); once S3 is up with the
    bucket, all 200 within RECOVERY."""
    config = _config(moto)
    records = _publish(config, tmp_path, range(2))
    storage = open_storage(config)
    copy = {o.key: storage.get_bytes(o.key) for o in storage.list("")}
    moto.kill()
    with _serve(config, tmp_path) as url:
        assert requests.get(url + "/healthz", timeout=5).status_code == 200
        for path in (f"/{V.key}/simple/demo-ext/", f"/{V.key}/simple/"):
            r = requests.get(url + path, headers=JSON, timeout=BOUND, allow_redirects=False)
            assert r.status_code == 503, (path, r.status_code, r.text[:200])
            assert r.headers["Retry-After"]
            assert "catalog has not been read from storage yet" in r.json()["error"]
        moto.start()
        back = time.monotonic()
        make_s3_client(config).create_bucket(Bucket="faults")
        fresh = open_storage(config)
        for key, data in copy.items():
            fresh.put_bytes(key, data)
        took = _recovered(url, records, back)
        print(f"S3 down at start-up: recovered {took:.1f}s after S3 came back")
        assert " 500 " not in url.access_log()


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[bool]:
    """A tmpfs of ``size`` at ``path``: yields True. Where mounting is not allowed (not
    root), yields False and the caller caps its writer's file size instead."""
    path.mkdir(parents=True)
    mount = shutil.which("mount")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True) if mount and os.geteuid() == 0 else None
    if done is None or done.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """Write until the file system is full; returns the filler."""
    filler = directory / "filler"
    with filler.open("wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return filler


def test_full_disk_under_local_storage(tmp_path: Path) -> None:
    """Fault: the storage's file system is full (a 3 MiB tmpfs filled up; without the right
    to mount, the publisher's file size is capped instead). Asked: a publish of a new wheel,
    and during it the round of test_s3_hangs. Expected: the publish fails with one line
    ("No space left on device"), lists nothing and leaves no partial object; the index keeps
    serving everything published before (all 200, nothing stale); once space is freed the
    same publish succeeds and is listed within RECOVERY."""
    root = tmp_path / "disk"
    with _small_disk(root, "3m") as mounted:
        config = Config(storage=str(root / "data"), catalog_refresh_seconds=0.5,
                        upstream="http://127.0.0.1:9/simple/")
        records = _publish(config, tmp_path, range(2))
        new = make_wheel(tmp_path / "new", "demo-ext", f"2.0+{V.local_label}",
                         payload=os.urandom(200_000))
        with _serve(config, tmp_path) as url:
            _recovered(url, records, time.monotonic())
            prober = Prober(url, records)
            with prober.running() as answers:
                if mounted:
                    filler = _fill(root)
                    failed = run_console("publish", str(new), "--variant", V.key,
                                         config=config)
                else:
                    failed = _publish_capped(config, new, cap=64 * 1024)
                during = list(answers)
            assert failed.returncode == 1, failed.stdout + failed.stderr
            message = failed.stderr.strip()
            assert "Traceback" not in message and len(message.splitlines()) == 1, message
            assert ("No space left on device" if mounted else "File too large") in message
            _assert_no_500_and_bounded(during, "a full disk")
            assert all(a.status == 200 and not a.stale for a in during), \
                [a for a in during if a.status != 200][:5]
            storage = open_storage(config)
            assert not any(o.key.endswith(new.name) for o in storage.list("records/"))
            assert list(storage.list_partials()) == []

            if mounted:
                filler.unlink()
            freed = time.monotonic()
            done = run_console("publish", str(new), "--variant", V.key, config=config)
            assert done.returncode == 0, done.stderr
            took = _recovered(url, [*records, publish(storage, new, V)], freed)
            print(f"full disk ({'tmpfs' if mounted else 'RLIMIT_FSIZE'}): {len(during)} "
                  f"requests, all 200; publish refused with one line; listed {took:.1f}s "
                  "after space was freed")


def _publish_capped(config: Config, wheel: Path, cap: int) -> subprocess.CompletedProcess[str]:
    """``wheelhouse publish`` unable to write a file past ``cap`` bytes (EFBIG)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), **config.to_env()}
    script = Path(sys.executable).parent / "wheelhouse"
    return subprocess.run([str(script), "publish", str(wheel), "--variant", V.key], env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)


def test_web_worker_killed_under_load(tmp_path: Path) -> None:
    """Fault: one of two gunicorn workers SIGKILLed while 18 clients fetch pages, .metadata
    and wheels. Expected: no 5xx at all; a connection error only for requests that were in
    flight on the killed worker (at most one per client); every body served is whole;
    gunicorn has two workers again and everything answers 200 within RECOVERY."""
    config = Config(storage=str(tmp_path / "data"), catalog_refresh_seconds=0.5,
                    upstream="http://127.0.0.1:9/simple/")
    records = _publish(config, tmp_path, range(3))
    with _serve(config, tmp_path) as url:
        _recovered(url, records, time.monotonic())
        master = psutil.Process(url.proc.pid)
        probers = [Prober(url, records) for _ in range(2)]
        with contextlib.ExitStack() as stack:
            for p in probers:
                stack.enter_context(p.running())
            time.sleep(2)
            victim = master.children()[0]
            victim.kill()
            killed = time.monotonic()
            victim.wait(timeout=10)
            while len(master.children()) < 2:
                assert time.monotonic() < killed + RECOVERY, "the worker was not replaced"
                time.sleep(0.05)
            replaced = time.monotonic() - killed
            time.sleep(3)  # the load goes on, now on the new worker too
        answers = [a for p in probers for a in p.answers]
        _assert_no_500_and_bounded(answers, "a killed web worker")
        assert not [a for a in answers if a.status == 503], "503 without a storage fault"
        failed = [a for a in answers if a.status is None]
        assert len(failed) <= sum(len(p.round()) for p in probers), failed
        _recovered(url, records, time.monotonic())
        print(f"web worker killed: {len(answers)} requests, {len(failed)} connection errors "
              f"(in flight on the killed worker), 0 x 5xx; replaced {replaced:.1f}s after")
