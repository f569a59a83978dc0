"""Helpers shared by tests: building real wheels, starting real servers, fresh venvs."""

from __future__ import annotations

import base64
import contextlib
import csv
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
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wheelhouse.config import Config


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
) -> Path:
    """Write a small but complete, installable wheel (METADATA, WHEEL, RECORD)."""
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
    files: dict[str, bytes] = {
        f"{dist}/__init__.py": (module_body or f"VERSION = {version!r}\n").encode(),
        f"{info}/METADATA": ("\n".join(meta) + "\n\n").encode(),
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: wheelhouse-tests\nRoot-Is-Purelib: true\n"
            + "".join(f"Tag: {t}\n" for t in [tag])
        ).encode(),
    }
    if payload:
        files[f"{dist}/payload.bin"] = payload
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow((path, f"sha256={digest}", len(data)))
    writer.writerow((f"{info}/RECORD", "", ""))
    files[f"{info}/RECORD"] = record.getvalue().encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / filename
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, data in files.items():
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


def console_script() -> Path:
    """The installed ``wheelhouse`` console script of the interpreter that runs the tests."""
    script = Path(sys.executable).parent / "wheelhouse"
    assert script.exists(), f"{script} is missing: install the project (pip install -e .)"
    return script


def run_console(*args: str, config: Config | None = None, env: dict[str, str] | None = None,
                cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed console script by its path, as a unit file would: ``PATH`` is
    :data:`MINIMAL_PATH`, the settings are ``config``'s (none: the defaults) and ``env``."""
    environ = {"PATH": MINIMAL_PATH, "HOME": os.environ.get("HOME", "/")}
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
