"""How every part of wheelhouse (web, workers, CLI) connects to the fleet's Redis.

``WHEELHOUSE_REDIS_URL`` is a redis-py URL: ``redis://``, ``rediss://`` (TLS) or ``unix://``.
Its query carries redis-py's TLS options where needed, e.g. ``ssl_ca_certs=/path/ca.pem`` to
verify a server certificate signed by a private CA (``ssl_certfile``/``ssl_keyfile`` add a
client certificate). The password is in the URL (``redis://:PASSWORD@host``) or, better, in
``WHEELHOUSE_REDIS_PASSWORD_FILE`` (a Docker secret), so that it appears in no URL, log line or
process environment.

Two kinds of client: :func:`connect` (redis-py's own, for workers and the CLI, which wait on
their queues and report errors themselves) and :func:`queue_client` (for the web), whose every
command, whoever builds it (our modules, RQ's ``Job.fetch`` and ``Queue.enqueue``, a pipeline,
a ``SCAN``), is bounded by ``retry.QUEUE_COMMANDS`` and raises
:class:`~wheelhouse.errors.QueueUnavailable` instead of redis-py's connection errors; errors
that are not about the connection (``ResponseError``, ``WatchError``) pass through unchanged.
Neither reconnects by hand: redis-py opens connections lazily and re-makes a broken one on the
next command, so a client made while Redis was down, or one that lived through a Redis
restart, works again as soon as Redis answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from redis import Redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from wheelhouse.config import Config
from wheelhouse.errors import QueueUnavailable, RedisSettingError
from wheelhouse.retry import QUEUE_COMMANDS, RetryPolicy


def read_password(config: Config) -> str | None:
    """The password from ``config.redis_password_file``, or None when no file is set.

    The file holds the password alone; a trailing newline (as ``echo`` writes) is not part of it.
    """
    if not config.redis_password_file:
        return None
    path = Path(config.redis_password_file)
    try:
        password = path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        # The error names the file, never its contents.
        raise RedisSettingError(f"cannot read the Redis password file {path}: "
                                f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    if not password:
        raise RedisSettingError(f"the Redis password file {path} is empty")
    return password


def _options(config: Config) -> tuple[str, dict[str, Any]]:
    """The URL, and redis-py's keyword arguments for ``config``'s password."""
    if not config.redis_url:
        raise RedisSettingError("no Redis is configured: set WHEELHOUSE_REDIS_URL")
    kwargs: dict[str, Any] = {}
    password = read_password(config)
    if password is not None:
        # redis-py lets a password in the URL win silently; two sources are a mistake to report.
        if urlsplit(config.redis_url).password:
            raise RedisSettingError("the Redis password is given twice: in WHEELHOUSE_REDIS_URL "
                                    "and in WHEELHOUSE_REDIS_PASSWORD_FILE; keep one")
        kwargs["password"] = password
    return config.redis_url, kwargs


def connect(config: Config, *, timeout: float | None = None) -> Redis:
    """A client for ``config.redis_url`` with the password from the password file, if any.

    ``timeout`` bounds connecting and each command (None: redis-py's default, no limit, which
    a worker blocked on its queues needs). Raises :class:`RedisSettingError` for settings that
    can't work; nothing connects until the first command.
    """
    url, kwargs = _options(config)
    if timeout is not None:
        kwargs.update(socket_timeout=timeout, socket_connect_timeout=timeout)
    return Redis.from_url(url, **kwargs)


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Turn redis-py's connection errors raised inside into :class:`QueueUnavailable`."""
    try:
        yield
    except BusyLoadingError as exc:
        raise QueueUnavailable("the build queue (Redis) is still loading its data") from exc
    except RedisTimeoutError as exc:
        raise QueueUnavailable("the build queue (Redis) did not answer in time") from exc
    except RedisConnectionError as exc:
        raise QueueUnavailable("the build queue (Redis) is unreachable") from exc


class _Pipeline(Pipeline):
    """A pipeline whose network round trips translate connection errors."""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        with translated():
            return super().execute(raise_on_error)

    def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        # WATCH and the reads between WATCH and MULTI go out at once.
        with translated():
            return super().immediate_execute_command(*args, **options)  # type: ignore[no-untyped-call]


class QueueClient(Redis):
    """A Redis client whose commands raise :class:`QueueUnavailable` on connection failures."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        with translated():
            return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        return _Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def queue_client(config: Config, policy: RetryPolicy = QUEUE_COMMANDS) -> QueueClient:
    """The web's client for ``config``'s Redis (password and TLS as :func:`connect`).

    Connecting and each read wait at most ``policy.timeout`` seconds; redis-py retries the
    errors in ``policy.retry_on`` ``policy.retries`` times, without backoff (its own default
    would retry ten times, 20 s and more against a hung Redis). Nothing is sent until the
    first command.
    """
    url, kwargs = _options(config)
    errors = tuple(e for e in policy.retry_on if issubclass(e, Exception))
    client = QueueClient.from_url(
        url, socket_timeout=policy.timeout, socket_connect_timeout=policy.timeout,
        retry=Retry(NoBackoff(), policy.retries, supported_errors=errors), **kwargs)
    assert isinstance(client, QueueClient)
    return client
