"""Who may do what: API tokens, form logins, CSRF, rate limits, optional read protection.

- The API takes ``Authorization: Bearer <token>``. Forms take a login: the token is typed once
  into ``/login`` and the session keeps only its digest, so revoking the token ends the session;
  the session also lives in Redis (:func:`wheelhouse.index.tokens.start_session`), so signing out
  ends it for every copy of the cookie. The cookie is ``Secure`` on requests that came over
  TLS.
- Every form POST carries a CSRF token bound to the session; API calls that authenticate with
  the session cookie instead of a Bearer token must send it as ``X-CSRF-Token``.
- Requests that cost build hours are counted per token in Redis (fixed windows), and failed
  token checks per client address (the sign-in form, Bearer tokens, basic-auth passwords):
  once a client's failures reach ``WHEELHOUSE_LOGIN_RATE_LIMIT``, every attempt it makes is
  refused with 429 until the window ends, the right token too.
- A token check that can't reach Redis is a 503 (``QueueUnavailable``), never a 401: the
  caller's token may well be good.
- ``Config.auth`` optionally protects reading: ``basic:USER:PASSWORD``, or ``token`` (any token
  with the ``read`` scope, as Bearer or as the password of basic auth, which uv and pip send
  from credentials in the index URL).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import secrets
from typing import TYPE_CHECKING

from flask import Flask, current_app, g, request, session
from flask.sessions import SecureCookieSessionInterface
from werkzeug.datastructures import WWWAuthenticate
from werkzeug.exceptions import (
    BadRequest,
    Forbidden,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
)

from web.access import Windows
from web.services import Services, services
from wheelhouse import keys
from wheelhouse.builds.queue import requester_of
from wheelhouse.errors import QueueUnavailable
from wheelhouse.index.tokens import TokenInfo

if TYPE_CHECKING:
    from redis import Redis

log = logging.getLogger(__name__)

CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
#: Paths that never need read credentials (probes, the login form, static files).
_OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/login", "/static/")


def init_app(app: Flask, svc: Services) -> None:
    app.secret_key = svc.config.secret_key or _shared_secret(svc.redis)
    app.config.update(SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax",
                      SESSION_COOKIE_NAME="wheelhouse_session")
    app.session_interface = _Sessions()
    app.before_request(_protect_reads)
    app.context_processor(lambda: {"csrf_token": csrf_token, "current_token": shown_token})


class _Sessions(SecureCookieSessionInterface):
    """Flask's signed cookie, ``Secure`` whenever the request came over TLS: the same server
    may also answer plain HTTP on loopback (probes, tests), where a Secure cookie is never
    sent back."""

    def get_cookie_secure(self, app: Flask) -> bool:
        return super().get_cookie_secure(app) or request.is_secure


def _shared_secret(conn: Redis | None) -> str:
    """One session secret for every server process: kept in Redis, else per process."""
    if conn is not None:
        try:
            conn.set(keys.SESSION_SECRET, secrets.token_hex(32), nx=True)
            raw = conn.get(keys.SESSION_SECRET)
            if raw is not None:
                return raw.decode() if isinstance(raw, bytes) else str(raw)
        except QueueUnavailable as exc:
            log.warning("no shared session secret (%s); sessions are per process", exc)
    return secrets.token_hex(32)


# -- identifying the caller --


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _basic() -> tuple[str, str] | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or len(value) > 4096:
        return None
    try:
        user, sep, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


def _presented() -> str | None:
    """The token the request presents: a Bearer token, or the password of basic auth."""
    bearer = _bearer()
    if bearer is not None:
        return bearer
    basic = _basic()
    return basic[1] if basic is not None else None


def current_token() -> TokenInfo | None:
    """The token behind this request (Bearer, basic password, or the login session).

    A presented token is refused with 429 while its client is locked out, and a wrong one
    counts toward that lockout. Raises :class:`QueueUnavailable` (a 503) when Redis, which keeps
    the tokens, can't be asked.
    """
    if "wh_token" in g:
        return g.wh_token  # type: ignore[no-any-return]
    info = None
    tokens = services().tokens
    presented = _presented()
    if tokens is not None:
        if presented is not None:
            refuse_if_locked_out()
            info = tokens.verify(presented)
            if info is None:
                failed_sign_in()
        elif isinstance(session.get("token"), str):
            info = tokens.by_session(session.get("sid"), session["token"])
            if info is None:  # signed out (this cookie may be a copy), expired or revoked
                session.pop("token", None)
                session.pop("sid", None)
    g.wh_token = info
    g.wh_via_session = info is not None and presented is None
    return info


def shown_token() -> TokenInfo | None:
    """:func:`current_token` for templates, which only show who is signed in: None (signed
    out) when the queue can't be asked, so that a page that needs no Redis still renders."""
    try:
        return current_token()
    except QueueUnavailable:
        return None


def require_scope(scope: str) -> TokenInfo:
    """The caller's token, which must allow ``scope``: 401 without one, 403 with the wrong one."""
    if services().redis is None:
        raise ServiceUnavailable("this server has no build queue (WHEELHOUSE_REDIS_URL is unset)")
    presented = _bearer() is not None or _basic() is not None
    info = current_token()
    if info is None:
        what = "invalid or revoked token" if presented else "this needs an API token"
        raise Unauthorized(
            f"{what}: send 'Authorization: Bearer <token>' "
            "(create one with `wheelhouse token create NAME`)",
            www_authenticate=_challenge("Bearer"),
        )
    if not info.allows(scope):
        raise Forbidden(f"token {info.name!r} lacks the {scope!r} scope")
    if g.get("wh_via_session") and request.method not in ("GET", "HEAD", "OPTIONS"):
        check_csrf()
    return info


def require_upload(variant_key: str) -> TokenInfo:
    """The token an upload presents (the password of basic auth, as twine and uv send it with
    username ``__token__``, or Bearer), which must allow ``upload`` into ``variant_key``.

    A login session does not count: a browser's cookie must not publish for a cross-site form.
    """
    if services().redis is None:
        raise ServiceUnavailable("uploads need API tokens, which live in the build queue's "
                                 "Redis: this server has none (WHEELHOUSE_REDIS_URL is unset)")
    if _presented() is None:
        raise Unauthorized(
            "uploading needs an API token with the upload scope: username __token__, the token "
            "as password (create one with `wheelhouse token create NAME --scope upload`)",
            www_authenticate=_challenge("Basic"))
    info = current_token()
    if info is None:
        raise Unauthorized("invalid or revoked token (username __token__, the token as "
                           "password)", www_authenticate=_challenge("Basic"))
    if not info.allows("upload"):
        raise Forbidden(f"token {info.name!r} lacks the 'upload' scope (create one with "
                        "`wheelhouse token create NAME --scope upload`)")
    if not info.allows_variant(variant_key):
        raise Forbidden(f"token {info.name!r} may not upload to {variant_key} (it is limited "
                        f"to {', '.join(info.variants)})")
    return info


def require_admin(variant_key: str | None) -> TokenInfo:
    """An ``admin`` token (Bearer, basic or a login session with CSRF) that reaches the root
    ``variant_key`` (every root it is limited to none, when None)."""
    info = require_scope("admin")
    if info.variants and (variant_key is None or not info.allows_variant(variant_key)):
        where = variant_key or "every root"
        raise Forbidden(f"token {info.name!r} may not act on {where} (it is limited to "
                        f"{', '.join(info.variants)}); name a --variant it reaches")
    return info


def may_cancel(info: TokenInfo | None, build_id: str) -> bool:
    """Whether ``info`` may cancel the build or split request ``build_id``: the token that
    requested it (by name, with the ``build`` scope), or an admin token. One whose requester
    was never recorded (made on a miss, or before requesters were kept) only an admin may."""
    conn = services().redis
    if info is None or conn is None:
        return False
    if info.allows("admin"):
        return True
    return info.allows("build") and requester_of(conn, build_id) == info.name


def require_canceller() -> TokenInfo:
    """A token that may cancel some builds: one with the ``build`` scope, or an admin's."""
    info = current_token()
    return require_scope("admin" if info is not None and info.allows("admin") else "build")


def require_cancel(info: TokenInfo, build_id: str) -> None:
    """403, saying who may, unless ``info`` may cancel ``build_id`` (:func:`may_cancel`)."""
    if not may_cancel(info, build_id):
        conn = services().redis
        who = requester_of(conn, build_id) if conn is not None else None
        by = f"token {who!r}" if who else "no recorded token"
        raise Forbidden(f"token {info.name!r} may not cancel {build_id}: it was requested by "
                        f"{by}; only that token or an admin token may cancel it")


def _challenge(scheme: str) -> WWWAuthenticate:
    # The realm as a quoted string, as RFC 9110 (11.5) has senders write it: Werkzeug's own
    # parameters would write a bare token (realm=wheelhouse), which some clients don't take.
    return WWWAuthenticate(scheme, token='realm="wheelhouse"')  # noqa: S106 (not a secret)


# -- CSRF --


def csrf_token() -> str:
    """This session's CSRF token, made on first use."""
    token = session.get("csrf")
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        session["csrf"] = token
    return token


def check_csrf() -> None:
    """Refuse a state-changing request whose CSRF token is missing or not this session's."""
    sent = request.form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or ""
    expected = session.get("csrf")
    if not isinstance(expected, str) or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise BadRequest("the form's CSRF token is missing or expired; reload the page and retry")


def login(info: TokenInfo) -> None:
    tokens = services().tokens
    assert tokens is not None  # signing in needs the build queue: the form says so first
    end_session()
    session.clear()  # a new identity gets a new CSRF token too
    lifetime = current_app.permanent_session_lifetime.total_seconds()
    session["sid"] = tokens.start_session(info.digest, int(lifetime))
    session["token"] = info.digest
    session["name"] = info.name
    session.permanent = True
    g.wh_token = info


def logout() -> None:
    end_session()
    session.clear()
    g.wh_token = None


def end_session() -> None:
    """End this request's login session in Redis, if it has one."""
    tokens = services().tokens
    if tokens is not None and "sid" in session:
        tokens.end_session(session["sid"])


# -- rate limits and the sign-in lockout --


def _windows() -> Windows | None:
    conn = services().redis
    return Windows(conn) if conn is not None else None


def _client() -> str:
    return "login:" + (request.remote_addr or "unknown")[:64]


def rate_limit(info: TokenInfo) -> None:
    """Count a build-costing request against ``info``'s budget; 429 once it is spent."""
    windows = _windows()
    limit = services().auth.rate
    wait = windows.hit("token:" + info.digest[:32], limit) if windows is not None else None
    if wait is not None:
        raise TooManyRequests(
            f"token {info.name!r} made more than {limit.count} requests in {limit.seconds} s; "
            f"retry in {wait} s", retry_after=wait)


def refuse_if_locked_out() -> None:
    """429 while this client's failed token checks have reached the limit, whatever it sends."""
    windows = _windows()
    wait = windows.wait(_client(), services().auth.login_rate) if windows is not None else None
    if wait is not None:
        raise TooManyRequests(f"too many failed sign-ins from this address; retry in {wait} s",
                              retry_after=wait)


def failed_sign_in() -> None:
    """Count one failed token check (a wrong or malformed token) against this client."""
    windows = _windows()
    if windows is not None:
        windows.hit(_client(), services().auth.login_rate)


# -- read protection --


def _protect_reads() -> None:
    read = services().auth.read
    if read.mode == "open" or request.path.startswith(_OPEN_PATHS):
        return
    if read.mode == "basic":
        creds = _basic()
        if creds is not None and hmac.compare_digest(creds[0].encode(), read.user.encode()) \
                and hmac.compare_digest(creds[1].encode(), read.password.encode()):
            return
    info = current_token()
    if info is not None and info.allows("read"):
        return
    raise Unauthorized("this index is private: give credentials (basic auth or a read token)",
                       www_authenticate=_challenge("Basic"))
