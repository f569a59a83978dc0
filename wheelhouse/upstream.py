"""Upstream routing: where the index sends clients for projects it does not host.

Rules are ``pattern[,pattern...]=URL`` joined by ``;``. Patterns are shell-style globs on
normalized names (``nvidia-*``). URLs are simple-index roots and may name the variant with
``{cu}`` (``cu128``), ``{cuda}`` (``12.8``) and ``{torch}`` (``2.8``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from packaging.utils import NormalizedName, canonicalize_name

from wheelhouse.variants import Variant


@dataclass(frozen=True)
class Route:
    patterns: tuple[str, ...]
    url: str

    def matches(self, project: NormalizedName) -> bool:
        return any(fnmatch.fnmatchcase(project, p) for p in self.patterns)


def parse_rules(text: str) -> tuple[Route, ...]:
    routes = []
    for chunk in text.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        names, sep, url = chunk.partition("=")
        if not sep or not url.strip():
            raise ValueError(f"upstream rule {chunk!r} must look like name,name-*=URL")
        patterns = tuple(canonicalize_name(n.strip()) if "*" not in n else n.strip().lower()
                         for n in names.split(",") if n.strip())
        if not patterns:
            raise ValueError(f"upstream rule {chunk!r} names no project")
        routes.append(Route(patterns, url.strip()))
    return tuple(routes)


class Router:
    """Picks the upstream simple-index page for a project in a variant, or None when off."""

    def __init__(self, default: str, rules: str) -> None:
        self.default = None if default.strip().lower() in ("", "off", "none") else default.strip()
        self.routes = parse_rules(rules) if self.default is not None else ()

    @property
    def enabled(self) -> bool:
        return self.default is not None

    def url_for(self, project: NormalizedName, variant: Variant) -> str | None:
        if self.default is None:
            return None
        root = self.default
        for route in self.routes:
            if route.matches(project):
                root = route.url.format(cu=variant.cu, cuda=variant.cuda, torch=variant.torch)
                break
        return f"{root.rstrip('/')}/{project}/"
