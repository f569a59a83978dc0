"""How every part of wheelhouse (web, workers, CLI) connects to the fleet's Redis.

``WHEELHOUSE_REDIS_URL`` is a redis-py URL: ``redis://``, ``rediss://`` (TLS) or ``unix://``.
Its query carries redis-py's TLS options where needed, e.g. ``ssl_ca_certs=/path/ca.pem`` to
verify a server certificate signed by a private CA (``ssl_certfile``/``ssl_keyfile`` add a
client certificate). The password is in the URL (``redis://:PASSWORD@host``) or, better, in
``WHEELHOUSE_REDIS_PASSWORD_FILE`` (a Docker secret), so that it appears in no URL, log line or
process environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from wheelhouse.config import Config
from wheelhouse.errors import RedisSettingError

if TYPE_CHECKING:
    from redis import Redis


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


def connect(config: Config, *, timeout: float | None = None) -> Redis:
    """A client for ``config.redis_url`` with the password from the password file, if any.

    ``timeout`` bounds connecting and each command (None: redis-py's default, no limit, which
    a worker blocked on its queues needs). Raises :class:`RedisSettingError` for settings that
    can't work; nothing connects until the first command.
    """
    from redis import Redis

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
    if timeout is not None:
        kwargs.update(socket_timeout=timeout, socket_connect_timeout=timeout)
    return Redis.from_url(config.redis_url, **kwargs)
