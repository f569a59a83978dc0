"""Clients of the build queue's Redis whose connection failures are :class:`QueueUnavailable`.

The web (and anything else that must answer while Redis is down) talks to Redis through
:func:`connect`. Every command such a client sends, whoever builds it (our modules, RQ's
``Job.fetch`` and ``Queue.enqueue``, a pipeline, a ``SCAN``), is bounded by the policy's timeout
and retried by redis-py as the policy says; a connection that still fails raises
:class:`~wheelhouse.errors.QueueUnavailable` instead of redis-py's own errors. Errors that are
not about the connection (``ResponseError``, ``WatchError``) pass through unchanged.

redis-py opens connections lazily and re-makes a broken one on the next command, so a client
made while Redis was down, or one that lived through a Redis restart, works again as soon as
Redis answers: nothing here reconnects by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from wheelhouse.errors import QueueUnavailable
from wheelhouse.retry import QUEUE_COMMANDS, RetryPolicy


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


def connect(url: str, policy: RetryPolicy = QUEUE_COMMANDS) -> QueueClient:
    """A :class:`QueueClient` for ``url`` (``redis://``, ``rediss://`` or ``unix://``).

    Connecting and each read wait at most ``policy.timeout`` seconds; redis-py retries the
    errors in ``policy.retry_on`` ``policy.retries`` times, without backoff. Nothing is sent
    until the first command.
    """
    timeout = policy.timeout
    errors = tuple(e for e in policy.retry_on if issubclass(e, Exception))
    retry = Retry(NoBackoff(), policy.retries, supported_errors=errors)
    client = QueueClient.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                  retry=retry)
    assert isinstance(client, QueueClient)
    return client
