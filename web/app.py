"""Application factory: defaults, then ``WHEELHOUSE_*`` environment, then explicit config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from flask import Flask, current_app

from wheelhouse.catalog import Catalog
from wheelhouse.config import Config
from wheelhouse.storage import Storage, open_storage
from wheelhouse.upstream import Router


@dataclass
class Services:
    """What request handlers need, built once per application."""

    config: Config
    storage: Storage
    catalog: Catalog
    router: Router


def services() -> Services:
    return cast(Services, current_app.extensions["wheelhouse"])


def create_app(config: Config | None = None, *, storage: Storage | None = None) -> Flask:
    """Build the WSGI application; gunicorn runs ``web:create_app()``."""
    config = config or Config.from_env()
    app = Flask(__name__)
    app.config["JSON_SORT_KEYS"] = False
    store = storage if storage is not None else open_storage(config)
    app.extensions["wheelhouse"] = Services(
        config=config,
        storage=store,
        catalog=Catalog(store, config.catalog_refresh_seconds),
        router=Router(config.upstream, config.upstream_rules),
    )
    from web import errors, files, home, simple

    errors.register(app)
    app.register_blueprint(home.bp)
    app.register_blueprint(simple.bp)
    app.register_blueprint(files.bp)
    return app
