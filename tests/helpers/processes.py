"""Fresh venvs, the console script, and the real index, worker and Redis processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tests.helpers.net import free_port, wait_for_port

if TYPE_CHECKING:

    from wheelhouse.config import Config



def stop_group(proc: subprocess.Popen[bytes],
               signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGKILL),
               grace: float = 15.0) -> None:
    """Stop the process group ``proc`` leads (it was started with ``start_new_session``): each
    signal in turn, ``grace`` seconds apart, until no process of the group is left (gunicorn's
    workers and a worker's children may outlive their leader for a moment); then reap it."""
    for sig in signals:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        if group_gone(proc, grace):
            break
    proc.wait()


def group_gone(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether the process group ``proc`` leads has no process left within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()  # reap the leader, or its zombie keeps the group alive
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@contextlib.contextmanager
def own_session(argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None,
                cwd: Path | None = None,
                signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGKILL),
                grace: float = 15.0) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` in a session of its own, its output appended to ``log``, until the block ends;
    then its whole process group is stopped (:func:`stop_group`) and nothing else."""
    with log.open("ab") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, signals, grace)


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
    argv = [wheelhouse, "serve", "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(workers), *args]
    with own_session(argv, log, env=env) as proc:
        url = IndexURL(f"http://127.0.0.1:{port}")
        url.log = log
        url.proc = proc
        wait_for_port(port, timeout=30)
        _wait_for_a_worker(url, proc, log)
        yield url


def _wait_for_a_worker(url: str, proc: subprocess.Popen[bytes], log: Path,
                      timeout: float = 90.0) -> None:
    """Until a gunicorn worker answers: the master listens at once, and each worker builds the
    app after it forks (web.geventworker), which on a loaded 2-core machine takes seconds."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"wheelhouse serve exited ({proc.returncode}): "
                               f"{log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5):
                return
        except urllib.error.HTTPError:
            return  # a worker answered (a read-protected or unhealthy index answers too)
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker of {url} answered within {timeout:.0f}s") from None
            time.sleep(0.1)


@contextlib.contextmanager
def run_worker(config: Config, name: str, log: Path, *args: str,
               extra_env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``wheelhouse worker`` in its own session, configured by ``config``; on exit its process
    group is asked to stop warmly (SIGTERM), then coldly (a second SIGTERM), then killed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config_env(config))
    env.update(extra_env or {})
    argv = [shutil.which("wheelhouse") or "wheelhouse", "worker", "--name", name, *args]
    with own_session(argv, log, env=env, grace=20,
                     signals=(signal.SIGTERM, signal.SIGTERM, signal.SIGKILL)) as proc:
        yield proc


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
