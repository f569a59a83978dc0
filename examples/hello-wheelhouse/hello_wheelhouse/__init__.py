"""A pure-Python package whose only job is to be published and installed in the quick start."""

from __future__ import annotations


def hello() -> str:
    return "hello from a wheelhouse index"
