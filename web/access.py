"""Who may do what, as settings parsed once: read protection, rate limits, the sign-in
lockout, and the tokens.

``web.auth`` applies them to requests; this module knows nothing of Flask. Counters live in
Redis, each key with a TTL of its window, so their memory is bounded by the live windows and
nothing is kept in this process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wheelhouse import keys
from wheelhouse.config import Config, RateLimit, ReadAuth
from wheelhouse.index.tokens import (
    TokenInfo,
    end_session,
    lookup_digest,
    session_token,
    start_session,
    verify_token,
)

if TYPE_CHECKING:
    from redis import Redis



@dataclass(frozen=True)
class Windows:
    """Fixed-window counters in Redis: ``hit`` counts, ``wait`` only looks.

    Both answer the seconds left in the window when its count has reached the limit's, else
    None. Redis errors are the client's (:class:`~wheelhouse.errors.QueueUnavailable` for the
    web's), never swallowed: a limit that can't be checked must not let everyone through.
    """

    conn: Redis

    @staticmethod
    def _key(key: str, limit: RateLimit, now: float) -> tuple[str, int]:
        window = int(now) // limit.seconds
        return keys.rate(key, window), (window + 1) * limit.seconds - int(now) or 1

    def hit(self, key: str, limit: RateLimit) -> int | None:
        """Count one hit; the wait when this hit went over the limit."""
        full, left = self._key(key, limit, time.time())
        with self.conn.pipeline() as pipe:
            pipe.incr(full)
            pipe.expire(full, limit.seconds + 1)
            count, _ = pipe.execute()
        return left if int(count) > limit.count else None

    def wait(self, key: str, limit: RateLimit) -> int | None:
        """The wait if the count already reached the limit (the next hit would be refused)."""
        full, left = self._key(key, limit, time.time())
        raw = self.conn.get(full)
        return left if raw is not None and int(raw) >= limit.count else None


@dataclass(frozen=True)
class AuthSettings:
    read: ReadAuth
    rate: RateLimit
    """Build-costing requests per token."""
    login_rate: RateLimit
    """Failed token checks (sign-in form, Bearer, basic password) per client address; once
    spent, every attempt from that address is refused until the window ends."""

    @classmethod
    def from_config(cls, config: Config) -> AuthSettings:
        return cls(read=config.read_auth, rate=config.build_rate, login_rate=config.login_rate)


@dataclass(frozen=True)
class Tokens:
    """The API tokens kept in the build queue's Redis."""

    conn: Redis

    def verify(self, token: str) -> TokenInfo | None:
        """A live token's record; None for anything else (malformed input too)."""
        return verify_token(self.conn, token)

    def by_digest(self, digest: str) -> TokenInfo | None:
        """The record behind a digest kept in a login session, if the token is still live."""
        return lookup_digest(self.conn, digest)

    def start_session(self, digest: str, ttl_seconds: int) -> str:
        return start_session(self.conn, digest, ttl_seconds)

    def by_session(self, sid: object, digest: object) -> TokenInfo | None:
        """The token behind a login session: only while the session lives (not signed out)
        and was started for that token, and the token is live."""
        if not isinstance(digest, str) or session_token(self.conn, sid) != digest:
            return None
        return lookup_digest(self.conn, digest)

    def end_session(self, sid: object) -> None:
        end_session(self.conn, sid)
