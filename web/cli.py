"""``wheelhouse serve``: the index under gunicorn, the same server production runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from flask import Flask
from gunicorn.app.base import BaseApplication

from wheelhouse.config import Config


class _Gunicorn(BaseApplication):  # type: ignore[misc]
    def __init__(self, app: Flask, options: dict[str, Any]) -> None:
        self.application = app
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Flask:
        return self.application


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--workers", default=2, show_default=True, type=int, help="gunicorn processes.")
@click.option("--threads", default=4, show_default=True, type=int, help="Threads per process.")
@click.option("--access-log/--no-access-log", default=True, show_default=True)
@click.option("--with-worker", is_flag=True,
              help="Single-box mode: also run a build worker (and a private Redis on a unix "
                   "socket in the workspace when WHEELHOUSE_REDIS_URL is unset).")
def serve(host: str, port: int, workers: int, threads: int, access_log: bool,
          with_worker: bool) -> None:
    """Serve the index (and web pages) from the configured storage."""
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Must be set before prometheus_client is imported, in every gunicorn worker.
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="wheelhouse-metrics-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tmp
        if with_worker:
            _start_single_box(stack)
        _serve(host, port, workers, threads, access_log)


def _start_single_box(stack: contextlib.ExitStack) -> None:
    """A private Redis if needed, and ``wheelhouse worker`` beside the index; both are stopped
    when the server exits (the ExitStack unwinds on gunicorn's SystemExit too)."""
    from wheelhouse.localredis import private_redis

    config = Config.from_env()
    if not config.redis_url:
        url = stack.enter_context(private_redis(Path(config.workspace)))
        os.environ["WHEELHOUSE_REDIS_URL"] = url
        click.echo(f"wheelhouse: private Redis on {url}; create a token with\n"
                   f"  WHEELHOUSE_REDIS_URL={url} wheelhouse token create NAME", err=True)
    stack.enter_context(_worker_process())


@contextlib.contextmanager
def _worker_process() -> Iterator[None]:
    """``wheelhouse worker`` in its own session; asked to stop warmly, then coldly."""
    exe = shutil.which("wheelhouse") or sys.argv[0]
    proc = subprocess.Popen([exe, "worker"], start_new_session=True)
    try:
        yield
    finally:
        # RQ: the first SIGTERM is a warm shutdown, a second one a cold one (the build's own
        # deadline machinery then reaps its tree); SIGKILL only if both were ignored.
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGTERM, 20.0),
                          (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            if _group_gone(proc, wait):
                break


def _group_gone(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait for the worker and every process of its group (RQ's scheduler too) to exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _child_exit(_server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def _serve(host: str, port: int, workers: int, threads: int, access_log: bool) -> None:
    from web import create_app

    config = Config.from_env()
    app = create_app(config)
    options: dict[str, Any] = {
        "bind": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        "workers": workers,
        "threads": threads,
        "worker_class": "gthread",
        "accesslog": "-" if access_log else None,
        "errorlog": "-",
        "graceful_timeout": 5,
        "timeout": 120,
        # gunicorn 27 otherwise leaves a control socket in ~/.gunicorn behind.
        "control_socket_disable": True,
        "child_exit": _child_exit,
    }
    click.echo(f"wheelhouse: serving {config.storage} on http://{host}:{port}/", err=True)
    _Gunicorn(app, options).run()
