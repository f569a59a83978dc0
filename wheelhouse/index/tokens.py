"""API tokens: who may request and cancel builds, upload, yank and delete (and, on private
indexes, read).

A token is shown once, when created, and stored only as its SHA-256 digest: tokens are 256 bits
of randomness, so a plain digest is as good as a slow hash and lets a request be checked with one
Redis read. Every token lives in one Redis hash, ``wheelhouse:tokens``: digest (hex) -> JSON
``{"name", "scopes", "created_at"}`` and, for a token limited to some index roots,
``"variants"`` (variant keys; absent or empty: every root) and, for one limited to some
projects, ``"projects"`` (normalised names; absent or empty: every project). Checking a
token, listing tokens and revoking one by name all read that hash and nothing else, so a
token that authenticates is always listed and revocable (also one written into Redis by
hand); a record whose name or scopes don't validate authenticates nothing and is not listed.

A form login is a session in Redis too: ``wheelhouse:session:<sha256 of the session id>`` ->
the token's digest, expiring with the cookie; the (signed) cookie holds the id. Signing out
deletes the key, so a copy of the cookie kept from before no longer signs anyone in.

Tokens of the format before this one (``wheelhouse:token:<digest>`` keys with a
``wheelhouse:token-name:<name>`` index) no longer authenticate: create them anew.
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

from packaging.utils import canonicalize_name

from wheelhouse import keys
from wheelhouse.errors import InvalidVariant, TokenError
from wheelhouse.variants import parse_variant

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline

_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")
#: What a token may do. ``build`` requests and cancels builds; ``read`` reads a private index;
#: ``upload`` publishes wheels with twine or uv; ``admin`` yanks, unyanks and deletes. Tokens
#: made before ``upload`` and ``admin`` existed keep exactly the scopes they were given.
SCOPES: tuple[str, ...] = ("build", "read", "upload", "admin")
DEFAULT_SCOPES: tuple[str, ...] = ("build", "read")
#: Every token starts with this, so that secret scanners and humans recognise one.
TOKEN_MARK = "whk_"  # noqa: S105 (a public prefix)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_TOKEN = re.compile(r"whk_[A-Za-z0-9_-]{43}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_PROJECT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")


@dataclass(frozen=True)
class TokenInfo:
    """What is known about a token: never the token itself."""

    name: str
    scopes: tuple[str, ...]
    created_at: float
    digest: str
    """SHA-256 of the token (hex): identifies it in sessions and rate-limit keys."""
    variants: tuple[str, ...] = ()
    """The index roots (variant keys) it may upload to, yank or delete in; empty: all."""
    projects: tuple[str, ...] = ()
    """The projects (normalised names) it may publish; empty: any it owns."""

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def allows_variant(self, key: str) -> bool:
        """Whether the token reaches the root ``key`` (its base limit covers narrowed roots)."""
        return not self.variants or any(key == v or key.startswith(v + "-sm")
                                         for v in self.variants)

    def allows_project(self, project: str) -> bool:
        return not self.projects or canonicalize_name(project) in self.projects


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


def check_variants(keys: Iterable[str]) -> tuple[str, ...]:
    """Variant keys a token is limited to, each valid and in its canonical spelling."""
    out: list[str] = []
    for key in keys:
        try:
            out.append(parse_variant(key).key)
        except InvalidVariant as exc:
            raise TokenError(f"--variant {key!r}: {exc}") from None
    return tuple(dict.fromkeys(out))


def check_projects(names: Iterable[str]) -> tuple[str, ...]:
    """Project names a token is limited to, each valid and normalised."""
    out: list[str] = []
    for name in names:
        if not isinstance(name, str) or not _PROJECT.fullmatch(name):
            raise TokenError(f"--project {str(name)[:80]!r} is not a project name")
        out.append(canonicalize_name(name))
    return tuple(dict.fromkeys(out))


def create_token(
    conn: Redis, name: str, scopes: Iterable[str] = DEFAULT_SCOPES, *, replace: bool = False,
    variants: Iterable[str] = (), projects: Iterable[str] = (),
) -> str:
    """Create a token called ``name`` and return it; this is the only time it is visible.

    A name that is taken raises :class:`TokenError` unless ``replace``, which revokes the old one.
    ``variants`` limits what it uploads, yanks and deletes to those index roots, ``projects``
    what it publishes to those projects.
    """

    check_name(name)
    wanted = check_scopes(scopes)
    roots = check_variants(variants)
    limited = check_projects(projects)
    token = TOKEN_MARK + secrets.token_urlsafe(32)
    fields: dict[str, object] = {"name": name, "scopes": list(wanted), "created_at": time.time()}
    if roots:
        fields["variants"] = list(roots)
    if limited:
        fields["projects"] = list(limited)
    record = json.dumps(fields)

    def create(pipe: Pipeline) -> None:
        # Under WATCH: two concurrent creates of one name end with one token.
        taken = [info.digest for info in _records(pipe) if info.name == name]
        if taken and not replace:
            raise TokenError(f"a token called {name!r} exists; revoke it first, or create it "
                             "with --replace")
        pipe.multi()
        if taken:
            pipe.hdel(keys.TOKENS, *taken)
        pipe.hset(keys.TOKENS, digest(token), record)

    conn.transaction(create, keys.TOKENS)
    return token


def revoke_token(conn: Redis, name: str) -> bool:
    """Revoke every token called ``name``; False if there was none."""

    check_name(name)
    revoked: list[str] = []

    def revoke(pipe: Pipeline) -> None:
        revoked[:] = [info.digest for info in _records(pipe) if info.name == name]
        pipe.multi()
        if revoked:
            pipe.hdel(keys.TOKENS, *revoked)

    conn.transaction(revoke, keys.TOKENS)
    return bool(revoked)


def _info(raw: bytes | str, d: str) -> TokenInfo | None:
    """A record as it authenticates: only with a valid name and known scopes."""
    try:
        data = json.loads(raw)
        roots = data.get("variants") or [] if isinstance(data, dict) else None
        if not isinstance(roots, list) or not all(isinstance(v, str) for v in roots):
            return None
        projects = data.get("projects") or []
        if not isinstance(projects, list):
            return None
        info = TokenInfo(name=check_name(data["name"]), scopes=check_scopes(data["scopes"]),
                         created_at=float(data["created_at"]), digest=d,
                         variants=tuple(roots), projects=check_projects(projects))
    except (ValueError, KeyError, TypeError):  # TokenError is a ValueError
        return None
    return info


def _records(conn: Redis | Pipeline) -> list[TokenInfo]:
    out = []
    for key, raw in conn.hgetall(keys.TOKENS).items():
        d = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        info = _info(raw, d) if _DIGEST.fullmatch(d) else None
        if info is not None:
            out.append(info)
    return out


def verify_token(conn: Redis, token: str) -> TokenInfo | None:
    """The token's record if it is a live token, else None. Malformed input is just None."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        return None
    return lookup_digest(conn, digest(token))


def lookup_digest(conn: Redis, d: str) -> TokenInfo | None:
    """The record for a token digest (as kept in a login session), if still live."""
    if not isinstance(d, str) or not _DIGEST.fullmatch(d):
        return None
    raw = conn.hget(keys.TOKENS, d)
    return None if raw is None else _info(raw, d)


def list_tokens(conn: Redis) -> list[TokenInfo]:
    """Every token that authenticates: its name, scopes and age, by name."""
    return sorted(_records(conn), key=lambda i: (i.name, i.created_at))


def legacy_token_keys(conn: Redis) -> int:
    """How many keys of the earlier token format are left in Redis (they authenticate nothing)."""
    return sum(1 for pattern in keys.LEGACY_TOKEN_PATTERNS
               for _ in conn.scan_iter(match=pattern, count=500))


def start_session(conn: Redis, token_digest: str, ttl_seconds: int) -> str:
    """A new login session for the token with this digest; its id, for the cookie."""
    sid = secrets.token_urlsafe(32)
    conn.set(keys.session(digest(sid)), token_digest, ex=max(1, ttl_seconds))
    return sid


def session_token(conn: Redis, sid: object) -> str | None:
    """The token digest a live session was started for; None once it ended or expired."""
    if not isinstance(sid, str) or not _SESSION_ID.fullmatch(sid):
        return None
    raw = conn.get(keys.session(digest(sid)))
    if raw is None:
        return None
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def end_session(conn: Redis, sid: object) -> None:
    """End a login session (signing out): its cookie no longer signs anyone in."""
    if isinstance(sid, str) and _SESSION_ID.fullmatch(sid):
        conn.delete(keys.session(digest(sid)))
