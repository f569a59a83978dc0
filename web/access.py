"""Who may do what, as settings parsed once: read protection, rate limits, and the tokens.

``web.auth`` applies them to requests; this module knows nothing of Flask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wheelhouse.config import Config
from wheelhouse.tokens import TokenInfo, lookup_digest, verify_token

if TYPE_CHECKING:
    from redis import Redis


@dataclass(frozen=True)
class ReadAuth:
    """The parsed ``Config.auth`` setting."""

    mode: str
    """``open``, ``basic`` or ``token``."""
    user: str = ""
    password: str = ""

    @classmethod
    def parse(cls, text: str | None) -> ReadAuth:
        value = (text or "").strip()
        if value in ("", "off", "none"):
            return cls("open")
        if value == "token":
            return cls("token")
        kind, _, rest = value.partition(":")
        user, sep, password = rest.partition(":")
        if kind == "basic" and sep and user and password:
            return cls("basic", user, password)
        raise ValueError("WHEELHOUSE_AUTH must be 'basic:USER:PASSWORD', 'token' or empty")


@dataclass(frozen=True)
class RateLimit:
    """At most ``count`` hits per fixed window of ``seconds``."""

    count: int
    seconds: int

    @classmethod
    def parse(cls, text: str) -> RateLimit:
        m = re.fullmatch(r"\s*([0-9]{1,7})\s*/\s*([0-9]{1,7})\s*", text)
        if m is None or int(m.group(2)) == 0:
            raise ValueError(f"a rate limit looks like COUNT/SECONDS, e.g. 30/60; got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class AuthSettings:
    read: ReadAuth
    rate: RateLimit
    """Build-costing requests per token."""
    login_rate: RateLimit
    """Failed sign-ins per client address."""

    @classmethod
    def from_config(cls, config: Config) -> AuthSettings:
        return cls(read=ReadAuth.parse(config.auth), rate=RateLimit.parse(config.rate_limit),
                   login_rate=RateLimit.parse(config.login_rate_limit))


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
