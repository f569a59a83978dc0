"""How often, how patiently and on what failures wheelhouse tries again: one policy object.

Every place that retries names one of the policies below, so that the numbers live here and
nowhere else:

- :data:`BUILD_STEPS`: a worker's network and storage steps (sdist fetch, installs, publishing);
- :data:`LOG_UPLOAD`: storing a build's log, a convenience that must not hold up the outcome;
- :data:`S3_REQUESTS`: each S3 request, retried by botocore itself (``make_s3_client``);
- :data:`QUEUE_COMMANDS`: each command the web (or CLI) sends to the build queue's Redis;
- :data:`WORKER_RECONNECT`: a worker waiting for its Redis to come back;
- :data:`ABANDONED_JOBS`: an RQ job whose worker died, handed to RQ's own retry (``queue.py``);
- :data:`OOM_COMPILE`: a compile killed for memory, tried again at half the MAX_JOBS.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from wheelhouse.errors import InfrastructureError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Try up to ``attempts`` times, sleeping ``delays[i]`` after failed attempt ``i``.

    Only exceptions in ``retry_on`` are retried; anything else passes through at once. Past the
    end of ``delays`` its last value repeats. ``timeout`` bounds one attempt where the caller can
    say so (an S3 client's connect and read timeouts); None keeps the library's own.
    """

    attempts: int
    delays: tuple[float, ...] = ()
    retry_on: tuple[type[BaseException], ...] = ()
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("a retry policy makes at least one attempt")

    @property
    def retries(self) -> int:
        """Attempts after the first, as RQ's ``Retry(max=...)`` and botocore count them."""
        return self.attempts - 1

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        if not self.delays:
            return 0.0
        return self.delays[min(attempt, len(self.delays) - 1)]

    def run(self, what: str, fn: Callable[[], T], *,
            say: Callable[[str], None] | None = None,
            sleep: Callable[[float], None] = time.sleep) -> T:
        """Call ``fn`` until it returns, backing off on the retryable errors.

        Each retry is logged (to ``say`` as well, e.g. a build's log); after the last attempt
        the last error is raised as it was. ``what`` names the operation in those lines.
        """
        for attempt in range(self.retries):
            try:
                return fn()
            except self.retry_on as exc:
                wait = self.delay(attempt)
                line = f"{what} failed ({exc}); retrying in {wait:g}s"
                log.warning("%s", line)
                if say is not None:
                    say(line)
                sleep(wait)
        return fn()


#: A worker's steps that talk to the network or storage: the index, uv, S3. ``OSError`` covers
#: :class:`~wheelhouse.errors.StorageUnavailable` and connection errors.
BUILD_STEPS = RetryPolicy(attempts=4, delays=(2, 10, 30), retry_on=(InfrastructureError, OSError))
#: Storing the build log: one quick second try; the build's own outcome stands either way.
LOG_UPLOAD = RetryPolicy(attempts=2, delays=(2,), retry_on=(InfrastructureError, OSError))
#: One S3 request: one retry, by botocore's "standard" mode (connection errors, timeouts,
#: throttling, 5xx), each attempt bounded by ``Config.storage_connect_timeout`` and
#: ``storage_read_timeout``. Small on purpose: a web request waits on it, and the callers that
#: can afford patience (a worker's steps, under :data:`BUILD_STEPS`) retry around it.
S3_REQUESTS = RetryPolicy(attempts=2)
#: An RQ job abandoned by a worker that died runs once more; the worker refuses that retry for
#: failures another attempt can't fix (compile errors, timeouts, incompatible combinations).
ABANDONED_JOBS = RetryPolicy(attempts=2)
#: A compile killed for lack of memory runs once more, at half the MAX_JOBS.
OOM_COMPILE = RetryPolicy(attempts=2)
#: One command to the build queue's Redis from the web: each attempt bounded by ``timeout``
#: (connect and read). A dropped connection (Redis restarted since the pooled connection was
#: made) is re-made once, at once; a timeout is not retried, so a hung Redis costs a request
#: ``timeout`` seconds, not a multiple of it. redis-py does the retrying
#: (``wheelhouse.redisconn.queue_client``).
QUEUE_COMMANDS = RetryPolicy(attempts=2, retry_on=(RedisConnectionError,), timeout=2.0)
#: A worker whose Redis went away pings it until it answers, then serves again; after about
#: 18 minutes it gives up and exits, for its supervisor to restart.
WORKER_RECONNECT = RetryPolicy(attempts=40, delays=(1, 2, 5, 10, 30),
                               retry_on=(RedisConnectionError, RedisTimeoutError))
