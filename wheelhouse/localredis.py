"""A private redis-server for the single-box shape (``wheelhouse serve --with-worker``).

It listens only on a unix socket in the workspace (no TCP port), persists with an append-only
file there so queued builds survive a restart, and is stopped by whoever started it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from wheelhouse.errors import WheelhouseError


class LocalRedisError(WheelhouseError, RuntimeError):
    """The private Redis could not be started."""


def socket_path(workspace: Path) -> Path:
    return workspace.resolve() / "redis" / "redis.sock"


def url_for(workspace: Path) -> str:
    return f"unix://{socket_path(workspace)}"


@contextlib.contextmanager
def private_redis(workspace: Path, *, timeout: float = 15.0) -> Iterator[str]:
    """Start redis-server on a unix socket under ``workspace``; yield its URL; stop it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise LocalRedisError(
            "no WHEELHOUSE_REDIS_URL is set and no redis-server binary is on PATH "
            "(install redis-server, or point WHEELHOUSE_REDIS_URL at a Redis)"
        )
    sock = socket_path(workspace)
    sock.parent.mkdir(parents=True, exist_ok=True)
    if len(str(sock)) > 100:
        raise LocalRedisError(f"the socket path {sock} is too long for a unix socket")
    # One private Redis per workspace: held for its whole life, and let go by the kernel when
    # its holder dies, so a second server neither starts a second Redis on the same socket nor
    # deletes the first one's on its way out.
    lock = os.open(sock.parent / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise LocalRedisError(
            f"another wheelhouse server runs the private Redis of this workspace ({sock}): "
            "stop it first, or give this one its own WHEELHOUSE_WORKSPACE") from None
    try:
        yield from _run(binary, sock, timeout)
    finally:
        os.close(lock)


def _run(binary: str, sock: Path, timeout: float) -> Iterator[str]:
    sock.unlink(missing_ok=True)  # a stale socket of a Redis that died with its host
    proc = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
         "--dir", str(sock.parent), "--appendonly", "yes", "--save", "",
         "--daemonize", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LocalRedisError(f"redis-server did not come up on {sock}")
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # redis saves its AOF and exits
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sock.unlink(missing_ok=True)
