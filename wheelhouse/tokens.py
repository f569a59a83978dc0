"""API tokens: who may request and cancel builds (and, on private indexes, read).

A token is shown once, when created, and stored only as its SHA-256 digest: tokens are 256 bits
of randomness, so a plain digest is as good as a slow hash and lets a request be checked with one
Redis GET. Keys:

- ``wheelhouse:token:<sha256 hex>``  JSON ``{"name", "scopes", "created_at"}``
- ``wheelhouse:token-name:<name>``   the digest, so that a token can be revoked by its name
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wheelhouse.errors import TokenError

if TYPE_CHECKING:
    from redis import Redis

TOKEN_PREFIX = "wheelhouse:token:"  # noqa: S105 (a Redis key prefix)
NAME_PREFIX = "wheelhouse:token-name:"
#: What a token may do. ``build`` requests and cancels builds; ``read`` reads a private index.
SCOPES: tuple[str, ...] = ("build", "read")
DEFAULT_SCOPES: tuple[str, ...] = ("build", "read")
#: Every token starts with this, so that secret scanners and humans recognise one.
TOKEN_MARK = "whk_"  # noqa: S105 (a public prefix)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_TOKEN = re.compile(r"whk_[A-Za-z0-9_-]{43}")


@dataclass(frozen=True)
class TokenInfo:
    """What is known about a token: never the token itself."""

    name: str
    scopes: tuple[str, ...]
    created_at: float
    digest: str
    """SHA-256 of the token (hex): identifies it in sessions and rate-limit keys."""

    def allows(self, scope: str) -> bool:
        return scope in self.scopes


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", errors="replace")).hexdigest()


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TokenError(
            "a token name is 1-64 letters, digits, '.', '_', '@' or '-', starting with a "
            "letter or digit"
        )
    return name


def check_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(scopes))
    unknown = [s for s in out if s not in SCOPES]
    if unknown or not out:
        raise TokenError(f"unknown or no scopes {unknown}; known: {', '.join(SCOPES)}")
    return out


def create_token(
    conn: Redis, name: str, scopes: Iterable[str] = DEFAULT_SCOPES, *, replace: bool = False
) -> str:
    """Create a token called ``name`` and return it; this is the only time it is visible.

    A name that is taken raises :class:`TokenError` unless ``replace``, which revokes the old one.
    """
    check_name(name)
    wanted = check_scopes(scopes)
    token = TOKEN_MARK + secrets.token_urlsafe(32)
    d = digest(token)
    record = json.dumps({"name": name, "scopes": list(wanted), "created_at": time.time()})
    if replace:
        revoke_token(conn, name)
    # NX on the name makes two concurrent creates of one name end with one token.
    if not conn.set(NAME_PREFIX + name, d, nx=True):
        raise TokenError(f"a token called {name!r} exists; revoke it first")
    conn.set(TOKEN_PREFIX + d, record)
    return token


def revoke_token(conn: Redis, name: str) -> bool:
    """Revoke the token called ``name``; False if there was none."""
    check_name(name)
    raw = conn.get(NAME_PREFIX + name)
    if raw is None:
        return False
    d = raw.decode() if isinstance(raw, bytes) else str(raw)
    conn.delete(TOKEN_PREFIX + d, NAME_PREFIX + name)
    return True


def _info(raw: bytes | str, d: str) -> TokenInfo | None:
    try:
        data = json.loads(raw)
        return TokenInfo(name=str(data["name"]), scopes=tuple(data["scopes"]),
                         created_at=float(data["created_at"]), digest=d)
    except (ValueError, KeyError, TypeError):
        return None


def verify_token(conn: Redis, token: str) -> TokenInfo | None:
    """The token's record if it is a live token, else None. Malformed input is just None."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        return None
    return lookup_digest(conn, digest(token))


def lookup_digest(conn: Redis, d: str) -> TokenInfo | None:
    """The record for a token digest (as kept in a login session), if still live."""
    if not re.fullmatch(r"[0-9a-f]{64}", d or ""):
        return None
    raw = conn.get(TOKEN_PREFIX + d)
    return None if raw is None else _info(raw, d)


def list_tokens(conn: Redis) -> list[TokenInfo]:
    """Every live token's name and scopes, by name."""
    out = []
    for key in conn.scan_iter(match=NAME_PREFIX + "*", count=500):
        raw = conn.get(key)
        if raw is None:
            continue
        info = lookup_digest(conn, raw.decode() if isinstance(raw, bytes) else str(raw))
        if info is not None:
            out.append(info)
    return sorted(out, key=lambda i: i.name)
