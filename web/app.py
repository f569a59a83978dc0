"""Application factory: defaults, then ``WHEELHOUSE_*`` environment, then explicit config."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from flask import Flask, Request, current_app
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface

from wheelhouse.catalog import Catalog
from wheelhouse.config import Config
from wheelhouse.storage import Storage, open_storage
from wheelhouse.upstream import Router

if TYPE_CHECKING:
    from redis import Redis

#: Modules under ``web`` whose ``bp`` blueprint the app serves, in registration order.
BLUEPRINTS = ("home", "simple", "files", "ops", "auth", "api", "pages")


class _LazySessions(SecureCookieSessionInterface):
    """Sessions only for requests that carry a session cookie.

    uv and pip never do; without this, every index request would build a signing
    serializer (a key derivation) just to find there is no session.
    """

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if self.get_cookie_name(app) not in request.cookies:
            return self.session_class()
        return super().open_session(app, request)


@dataclass
class Services:
    """What request handlers need, built once per application."""

    config: Config
    storage: Storage
    catalog: Catalog
    router: Router
    redis: Redis | None


def services() -> Services:
    return cast(Services, current_app.extensions["wheelhouse"])


def create_app(config: Config | None = None, *, storage: Storage | None = None) -> Flask:
    """Build the WSGI application; gunicorn runs ``web:create_app()``."""
    config = config or Config.from_env()
    app = Flask(__name__)
    app.session_interface = _LazySessions()
    store = storage if storage is not None else open_storage(config)
    redis_conn = None
    if config.redis_url:
        from redis import Redis

        # Short timeouts: a page must not hang because the queue is down.
        redis_conn = Redis.from_url(config.redis_url, socket_timeout=2, socket_connect_timeout=2)
    app.extensions["wheelhouse"] = Services(
        config=config,
        storage=store,
        catalog=Catalog(store, config.catalog_refresh_seconds),
        router=Router(config.upstream, config.upstream_rules),
        redis=redis_conn,
    )
    # Load the catalog now: under gunicorn this runs before the fork, so every worker starts
    # with it instead of each paying a full read on its first request.
    app.extensions["wheelhouse"].catalog.refresh()
    from web import errors

    errors.register(app)
    for name in BLUEPRINTS:
        module = importlib.import_module(f"web.{name}")
        app.register_blueprint(module.bp)
        if hasattr(module, "init_app"):
            module.init_app(app)
    from web.fastpath import CachedPages

    app.wsgi_app = CachedPages(app)  # type: ignore[method-assign]
    return app
