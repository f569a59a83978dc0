"""Helpers shared by tests: building real wheels, starting real servers, fresh venvs."""

from __future__ import annotations

import base64
import contextlib
import csv
import dataclasses
import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from redis import Redis

    from wheelhouse.buildjob import BuildJob
    from wheelhouse.config import Config


def build_job(conn: Redis, job_id: str) -> BuildJob:
    """The build job ``job_id`` as wheelhouse reads it (JSON); it must exist."""
    from wheelhouse.queue import fetch_job

    job = fetch_job(conn, job_id)
    assert job is not None, f"no job {job_id} in Redis"
    return job


def plant_job(conn: Redis, job_id: str, queue: str, data: bytes, **fields: str) -> None:
    """Write a job straight into Redis, as someone holding the Redis password could: RQ's hash
    (``data`` is what a job's serializer reads), in the queue's list, the queue registered."""
    conn.hset(f"rq:job:{job_id}", mapping={
        "data": data, "origin": queue, "status": "queued", "description": "planted",
        "created_at": "2026-01-01T00:00:00.000000Z",
        "enqueued_at": "2026-01-01T00:00:00.000000Z", **fields})
    conn.rpush(f"rq:queue:{queue}", job_id)
    conn.sadd("rq:queues", f"rq:queue:{queue}")


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    ca: Path
    """The private CA's certificate: what clients trust."""
    cert: Path
    key: Path


def make_tls_certs(directory: Path, hostname: str = "localhost") -> TLSFiles:
    """A private CA and a server certificate it signed for ``hostname`` and 127.0.0.1, made by
    the ``openssl`` command as an operator would (the README's Security section)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(ca=directory / "ca.crt", cert=directory / "redis.crt",
                     key=directory / "redis.key")
    openssl = shutil.which("openssl")
    assert openssl, "the openssl command is required"

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=wheelhouse test CA", "-keyout", str(directory / "ca.key"), "-out", str(files.ca))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={hostname}",
        "-keyout", str(files.key), "-out", str(directory / "redis.csr"))
    ext = directory / "san.cnf"
    ext.write_text(f"subjectAltName=DNS:{hostname},IP:127.0.0.1\n")
    run("x509", "-req", "-days", "2", "-in", str(directory / "redis.csr"), "-CA", str(files.ca),
        "-CAkey", str(directory / "ca.key"), "-CAcreateserial", "-extfile", str(ext),
        "-out", str(files.cert))
    return files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds. The
    deadline only bounds a hang: a test waits for the event, never for a fixed time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def make_wheel(
    directory: Path,
    name: str,
    version: str,
    *,
    tag: str = "py3-none-any",
    requires: list[str] | None = None,
    requires_python: str | None = None,
    metadata_version: str | None = None,
    module_body: str = "",
    payload: bytes = b"",
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write a small but complete, installable wheel (METADATA, WHEEL, RECORD); ``files`` are
    more members, by archive path."""
    dist = name.replace("-", "_")
    filename = f"{dist}-{version}-{tag}.whl"
    info = f"{dist}-{metadata_version or version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {metadata_version or version}",
    ]
    if requires_python:
        meta.append(f"Requires-Python: {requires_python}")
    meta.extend(f"Requires-Dist: {r}" for r in requires or [])
    members: dict[str, bytes] = {
        f"{dist}/__init__.py": (module_body or f"VERSION = {version!r}\n").encode(),
        f"{info}/METADATA": ("\n".join(meta) + "\n\n").encode(),
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: wheelhouse-tests\nRoot-Is-Purelib: true\n"
            + "".join(f"Tag: {t}\n" for t in [tag])
        ).encode(),
    }
    if payload:
        members[f"{dist}/payload.bin"] = payload
    members.update(files or {})
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow((path, f"sha256={digest}", len(data)))
    writer.writerow((f"{info}/RECORD", "", ""))
    members[f"{info}/RECORD"] = record.getvalue().encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / filename
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, data in members.items():
            zf.writestr(arc, data)
    return wheel


def make_venv(path: Path, python: str | None = None) -> Path:
    """A fresh virtual environment made by uv; returns its python."""
    uv = shutil.which("uv")
    assert uv, "uv is required"
    subprocess.run([uv, "venv", "-q", "--seed", "--python", python or sys.executable, str(path)],
                   check=True)
    return path / "bin" / "python"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without pip/uv settings that would point clients at other indexes."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "UV_", "WHEELHOUSE_"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["UV_NO_CONFIG"] = "1"
    env.update(extra)
    return env


def config_env(config: Config) -> dict[str, str]:
    """The ``WHEELHOUSE_*`` variables that reproduce ``config`` in a subprocess."""
    return config.to_env()


#: What a systemd unit or a container gives a command: no virtual environment on PATH.
MINIMAL_PATH = "/usr/bin:/bin"
#: The host's network settings, which a unit file on this host would set too (a TLS-inspecting
#: proxy's CA bundle, proxies): carried into :func:`run_console`'s otherwise bare environment.
HOST_NETWORK_ENV = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "HTTP_PROXY",
                    "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


def console_script() -> Path:
    """The installed ``wheelhouse`` console script of the interpreter that runs the tests."""
    script = Path(sys.executable).parent / "wheelhouse"
    assert script.exists(), f"{script} is missing: install the project (pip install -e .)"
    return script


def run_console(*args: str, config: Config | None = None, env: dict[str, str] | None = None,
                cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed console script by its path, as a unit file would: ``PATH`` is
    :data:`MINIMAL_PATH`, the settings are ``config``'s (none: the defaults) and ``env``, and
    only the host's network settings (:data:`HOST_NETWORK_ENV`) come from this process."""
    environ = {"PATH": MINIMAL_PATH, "HOME": os.environ.get("HOME", "/")}
    environ.update({k: os.environ[k] for k in HOST_NETWORK_ENV if k in os.environ})
    if config is not None:
        environ.update(config.to_env())
    environ.update(env or {})
    return subprocess.run([str(console_script()), *args], env=environ, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def fake_cuda_toolkit(root: Path, release: str = "12.8") -> Path:
    """A CUDA toolkit's layout with an nvcc that only answers ``--version``: it lets a worker
    *advertise* that release (``CUDA_HOME``); nothing compiles with it."""
    (root / "bin").mkdir(parents=True)
    (root / "targets" / "x86_64-linux" / "include").mkdir(parents=True)
    (root / "targets" / "x86_64-linux" / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.93'\n")
    nvcc.chmod(0o755)
    return root


class IndexURL(str):
    """The base URL of a running index; ``.log`` is the file its access log goes to."""

    log: Path
    proc: subprocess.Popen[bytes]

    def access_log(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def start_index(config: Config, tmp_path: Path, *, workers: int = 2,
                extra_env: dict[str, str] | None = None,
                args: Sequence[str] = ()) -> Iterator[IndexURL]:
    """Run ``wheelhouse serve`` (gunicorn) on a free loopback port in its own process group;
    ``args`` are more options of ``serve``."""
    port = free_port()
    log = tmp_path / f"index-{port}.log"
    env = dict(os.environ)
    env = {k: v for k, v in env.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    env.update(extra_env or {})
    wheelhouse = shutil.which("wheelhouse") or "wheelhouse"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [wheelhouse, "serve", "--host", "127.0.0.1", "--port", str(port),
             "--workers", str(workers), *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    url = IndexURL(f"http://127.0.0.1:{port}")
    url.log = log
    url.proc = proc
    try:
        wait_for_port(port, timeout=30)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def run_worker(config: Config, name: str, log: Path, *args: str,
               extra_env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``wheelhouse worker`` in its own session, configured by ``config``; on exit its process
    group is asked to stop warmly (SIGTERM), then coldly (a second SIGTERM), then killed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    env.update(extra_env or {})
    with log.open("ab") as out:
        proc = subprocess.Popen([shutil.which("wheelhouse") or "wheelhouse", "worker",
                                 "--name", name, *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue


class Listener:
    """A TCP listener on every host address that counts the connections it accepts; with
    ``abstract``, a unix socket of that name in the abstract namespace instead."""

    def __init__(self, abstract: str | None = None) -> None:
        if abstract is None:
            self.sock = socket.socket()
            self.sock.bind(("0.0.0.0", 0))  # reachable on every address
        else:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.bind("\0" + abstract)
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1] if abstract is None else 0
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(timeout=5)


def host_addresses() -> list[str]:
    """This host's IPv4 addresses besides loopback (a build must reach none of them)."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                found.append(addr.address)
    return found


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler for small test servers: ``send_body`` and no access log on stderr."""

    def send_body(self, body: bytes, content_type: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_http(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on a free loopback port in a thread; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class RedisProcess:
    """A redis-server of a test's own, to stop (SIGSTOP: hung), kill and restart on the same
    port. Append-only with fsync on every write, as a production Redis keeps its data, so
    tokens and jobs outlive a kill."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, start_new_session=True)
        wait_for_port(self.port)

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def hang(self) -> None:
        """SIGSTOP: connections stay open and nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: connections are reset, new ones refused."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.kill()

#: Where sdists downloaded from PyPI for tests are kept between sessions (verified by sha256).
SDIST_CACHE = Path(os.environ.get(
    "WHEELHOUSE_TEST_SDIST_CACHE", Path.home() / ".cache" / "wheelhouse-tests" / "sdists"))


def pypi_sdist(project: str, version: str, cache: Path = SDIST_CACHE) -> Path:
    """The real sdist of ``project==version`` from PyPI, downloaded once into ``cache``.

    The file is checked against the sha256 PyPI lists for it, also when it comes from the cache.
    Raises ``requests.ConnectionError`` or ``requests.Timeout`` when PyPI can't be reached.
    """
    import requests
    from pypi_simple import PyPISimple

    with PyPISimple(session=requests.Session()) as client:
        page = client.get_project_page(project, timeout=60)
    found = [p for p in page.packages if p.package_type == "sdist" and p.version == version
             and p.filename.endswith(".tar.gz")]
    if not found:
        raise FileNotFoundError(f"PyPI lists no sdist of {project} {version}")
    package = found[0]
    expected = package.digests["sha256"]
    path = cache / package.filename
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == expected:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    response = requests.get(package.url, timeout=300)
    response.raise_for_status()
    if hashlib.sha256(response.content).hexdigest() != expected:
        raise OSError(f"{package.filename} from PyPI does not match its listed sha256")
    partial = path.with_suffix(".part")
    partial.write_bytes(response.content)
    partial.replace(path)
    return path
