"""Application factory: defaults, then ``WHEELHOUSE_*`` environment, then explicit config."""

from __future__ import annotations

import logging

from flask import Flask, Request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface
from werkzeug.middleware.proxy_fix import ProxyFix

from web import (
    admin,
    api,
    auth,
    buildpage,
    errors,
    files,
    filters,
    guard,
    home,
    matrixpage,
    mirror,
    ops,
    provenance,
    requestpage,
    signin,
    simple,
    upload,
)
from web.fastpath import CachedPages
from web.guard import RequestGuard
from web.services import Services
from wheelhouse.config import Config
from wheelhouse.errors import StorageError
from wheelhouse.index.storage import Storage

log = logging.getLogger(__name__)

#: The blueprints the app serves, in registration order.
BLUEPRINTS = (home.bp, simple.bp, files.bp, ops.bp, api.bp, signin.bp, matrixpage.bp,
              requestpage.bp, buildpage.bp, upload.bp, admin.bp, provenance.bp, mirror.bp)


class _LazySessions(SecureCookieSessionInterface):
    """Sessions only for requests that carry a session cookie.

    uv and pip never do; without this, every index request would build a signing
    serializer (a key derivation) just to find there is no session.
    """

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if self.get_cookie_name(app) not in request.cookies:
            return self.session_class()
        return super().open_session(app, request)


def create_app(config: Config | None = None, *, storage: Storage | None = None) -> Flask:
    """Build the WSGI application; gunicorn runs ``web:create_app()``."""
    config = config or Config.from_env()
    files.check_modes(config)
    svc = Services.create(config, storage)
    app = Flask(__name__)
    app.session_interface = _LazySessions()
    guard.configure(app)
    svc.install(app)
    # Load the catalog now: under gunicorn this runs before the fork, so every worker starts
    # with it instead of each paying a full read on its first request. Storage being down is
    # no reason not to start: until a refresh succeeds, what needs the catalog answers 503.
    try:
        svc.catalog.refresh()
    except StorageError as exc:
        log.warning("the catalog could not be read at start-up; answering 503 until storage "
                    "answers: %s", exc)
    errors.register(app, svc)
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    filters.init_app(app)
    # Request ids first: even a request that read protection refuses carries one.
    ops.init_app(app, svc)
    auth.init_app(app, svc)
    app.wsgi_app = CachedPages(app.wsgi_app, svc)  # type: ignore[method-assign]
    # Outermost: a bad Host or URL is refused before the fast path or Flask looks at it.
    app.wsgi_app = RequestGuard(app.wsgi_app, svc.metrics)  # type: ignore[method-assign]
    if config.proxy_hops:
        # The client's address (the sign-in lockout counts per address) and scheme from the
        # proxy's headers, the last ``proxy_hops`` of them only: what a client puts there itself
        # is ignored. Off by default: without a proxy, a client would choose its own address.
        app.wsgi_app = ProxyFix(  # type: ignore[method-assign]
            app.wsgi_app, x_for=config.proxy_hops, x_proto=config.proxy_hops, x_host=0)
    return app
