"""``wheelhouse serve``: the index under gunicorn, the same server production runs."""

from __future__ import annotations

import contextlib
import os
import tempfile
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
def serve(host: str, port: int, workers: int, threads: int, access_log: bool) -> None:
    """Serve the index (and web pages) from the configured storage."""
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Must be set before prometheus_client is imported, in every gunicorn worker.
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="wheelhouse-metrics-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tmp
        _serve(host, port, workers, threads, access_log)


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
