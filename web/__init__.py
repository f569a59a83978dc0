"""The index and web pages: a Flask application built by :func:`create_app`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flask import Flask

    from wheelhouse.config import Config
    from wheelhouse.index.storage import Storage


def create_app(config: Config | None = None, *, storage: Storage | None = None) -> Flask:
    """Build the WSGI application; gunicorn runs ``web:create_app()``."""
    # Imported here, not above: ``wheelhouse serve`` (web.cli) sets PROMETHEUS_MULTIPROC_DIR
    # before the app's modules import prometheus_client, which reads it once, on import.
    from web.app import create_app as build  # noqa: PLC0415 (see above)

    return build(config, storage=storage)


__all__ = ["create_app"]
