"""``wheelhouse serve``: the index under gunicorn, the same server production runs."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
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
from gunicorn.errors import AppImportError

from web import create_app
from wheelhouse.cli.main import pass_config, storage_option
from wheelhouse.config import ENV_PREFIX, Config
from wheelhouse.errors import WheelhouseError
from wheelhouse.localredis import LocalRedisError, private_redis

#: ``--worker-class`` choices: gunicorn's worker that ``serve`` runs, by its short name.
WORKER_CLASSES = {"gevent": "web.geventworker.GeventWorker", "gthread": "gthread"}


class _Gunicorn(BaseApplication):  # type: ignore[misc]
    """gunicorn serving the index built from ``config``, with ``options`` as its settings.

    The app is built in each worker as it boots (``load``), before it accepts a connection, so
    every worker starts with the catalog loaded. Not in the master: gevent patches sockets,
    locks and ``ssl`` when its worker starts, and clients made before that (boto3's, which keeps
    the unpatched ``SSLContext``; redis-py's) would block the whole worker on every call. So the
    master imports neither boto3 nor redis. A configuration error stops ``serve`` with its one
    line (gunicorn's "App failed to load"); storage that does not answer does not: the index
    answers 503 until it does.
    """

    def __init__(self, config: Config, options: dict[str, Any]) -> None:
        self.config = config
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Flask:
        try:
            return create_app(self.config)
        except (ValueError, WheelhouseError) as exc:
            # gunicorn prints this one line and stops the server (exit status 4).
            raise AppImportError(f"wheelhouse: {exc}") from None


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port to listen on.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1),
              help="gunicorn worker processes.")
@click.option("--worker-class", type=click.Choice(sorted(WORKER_CLASSES)), default="gevent",
              show_default=True,
              help="gunicorn worker: gevent (a connection waits for its request without holding "
                   "a thread, so slow clients can't starve the index) or gthread (one thread "
                   "per connection, --threads of them per worker).")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(min=1),
              help="Threads per worker process (gthread only).")
@click.option("--worker-connections", default=1000, show_default=True,
              type=click.IntRange(min=1),
              help="Connections each worker process holds at once (gevent only).")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="Log every request to stdout, one line each (gunicorn's access log).")
@click.option("--with-worker", is_flag=True,
              help="Single-box mode: also run a build worker (and a private Redis on a unix "
                   "socket in the workspace when WHEELHOUSE_REDIS_URL is unset).")
@pass_config
@storage_option
def serve(config: Config, host: str, port: int, workers: int, worker_class: str, threads: int,
          worker_connections: int, access_log: bool, with_worker: bool) -> None:
    """Serve the index (and web pages) from the configured storage."""
    _check_port(host, port)
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # prometheus_client's own setting, not ours: it picks its multiprocess mode from
            # this variable when first imported (by create_app, in the gunicorn master), and
            # every gunicorn worker inherits it by fork. Only the environment can carry it.
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="wheelhouse-metrics-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tmp
        if with_worker:
            config = _start_single_box(stack, through_own_cache(config, host, port))
        _serve(config, host, port, access_log, {
            "workers": workers, "worker_class": WORKER_CLASSES[worker_class],
            "threads": threads, "worker_connections": worker_connections})


def _check_port(host: str, port: int) -> None:
    """Refuse in one line, before anything starts or says "serving", an address gunicorn could
    not bind (it would retry for seconds, then exit with a traceback-like log)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.ClickException(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As gunicorn binds: SO_REUSEADDR, so only a listener (not TIME_WAIT) counts as in use.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                why = "is already in use; stop what listens there or choose another --port"
            elif exc.errno == errno.EACCES:
                why = "needs privileges this user lacks; choose a port above 1023"
            elif exc.errno == errno.EADDRNOTAVAIL:
                why = "is not an address of this host; check --host"
            else:
                why = f"can't be listened on: {exc.strerror}"
            raise click.ClickException(f"port {port} on {host} {why}") from None


#: The settings that, left at their defaults, mean builds and the index use the same public
#: upstreams: then a single box's builds may as well go through the index's cache.
_PUBLIC_SOURCES = ("build_index_url", "torch_index_url", "upstream", "upstream_rules")


def through_own_cache(config: Config, host: str, port: int) -> Config:
    """The single box's config: its worker installs build venvs through this index's cache
    (``build_through_index``) unless the operator chose otherwise, the cache is off, or the
    build venvs' indexes are not the public ones the index routes to anyway."""
    defaults = Config()
    if config.build_through_index or not config.cache_patterns or any(
            getattr(config, name) != getattr(defaults, name) for name in _PUBLIC_SOURCES):
        return config
    # A wildcard listens on loopback too: the worker beside it asks there.
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # noqa: S104
    shown = f"[{shown}]" if ":" in shown else shown
    return config.replace(build_through_index=f"http://{shown}:{port}")


def _start_single_box(stack: contextlib.ExitStack, config: Config) -> Config:
    """A private Redis if needed, and ``wheelhouse worker`` beside the index; both are stopped
    when the server exits (the ExitStack unwinds on gunicorn's SystemExit too). Returns the
    config the index and the worker share (with the private Redis's URL)."""
    if not config.redis_url:
        try:
            url = stack.enter_context(private_redis(Path(config.workspace)))
        except LocalRedisError as exc:
            raise click.ClickException(str(exc)) from None
        config = config.replace(redis_url=url)
        click.echo(f"wheelhouse: private Redis on {url}; create a token with\n"
                   f"  WHEELHOUSE_REDIS_URL={url} wheelhouse token create NAME", err=True)
    stack.enter_context(_worker_process(config))
    return config


@contextlib.contextmanager
def _worker_process(config: Config) -> Iterator[None]:
    """``wheelhouse worker`` in its own session; asked to stop warmly, then coldly.

    It runs on this interpreter (whatever ``PATH`` holds), configured by ``config`` through
    its own environment: the ``WHEELHOUSE_*`` variables of this process are replaced. It is a
    new program (fork and exec, from gunicorn's master, which gevent never patches), so no
    gevent patching reaches the build worker: RQ forks its work horses from real threads.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(config.to_env())
    proc = subprocess.Popen([sys.executable, "-m", "wheelhouse", "worker"], env=env,
                            start_new_session=True)
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
    # Not above: prometheus_client reads PROMETHEUS_MULTIPROC_DIR once, on import, and
    # ``serve`` sets it only after this module is loaded.
    from prometheus_client import multiprocess  # noqa: PLC0415

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def _serve(config: Config, host: str, port: int, access_log: bool,
           workers: dict[str, Any]) -> None:
    options: dict[str, Any] = {
        "bind": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        **workers,
        "accesslog": "-" if access_log else None,
        "errorlog": "-",
        "graceful_timeout": 5,
        "timeout": 120,
        # gunicorn 27 otherwise leaves a control socket in ~/.gunicorn behind.
        "control_socket_disable": True,
        "child_exit": _child_exit,
    }
    server = _Gunicorn(config, options)
    click.echo(f"wheelhouse: serving {config.storage} on http://{host}:{port}/", err=True)
    server.run()
