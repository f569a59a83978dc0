"""The index and web pages: a Flask application built by :func:`create_app`."""

from __future__ import annotations

from web.app import create_app

__all__ = ["create_app"]
