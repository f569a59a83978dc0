"""Everything request handlers share, in one typed object built once per application.

:func:`web.app.create_app` builds a :class:`Services`, keeps it in
``app.extensions["wheelhouse"]`` and hands it to the fast-path middleware; blueprints read it
with :func:`services`. Nothing else in ``web`` keeps state between requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from flask import Flask, current_app

from web.access import AuthSettings, Tokens
from web.caches import FormatCache, MetadataCache, PageCache, VersionsCache
from web.metrics import Metrics
from web.readiness import Probe, Readiness
from wheelhouse.builds.torchindex import TorchIndex
from wheelhouse.config import Config, Unproven
from wheelhouse.errors import StorageUnavailable
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import Record
from wheelhouse.index.mirror import Pages
from wheelhouse.index.storage import Storage, open_storage
from wheelhouse.index.upstream import Router
from wheelhouse.recipes.book import GENERIC, Recipe, available_recipes, pick_recipe
from wheelhouse.redisconn import queue_client

if TYPE_CHECKING:
    from redis import Redis

#: Where the application keeps its :class:`Services`.
EXTENSION = "wheelhouse"


@dataclass(frozen=True)
class Services:
    """What request handlers need; the caches inside are this process's own."""

    config: Config
    storage: Storage
    catalog: Catalog
    router: Router
    recipes: frozenset[str]
    """Projects with a recipe of their own, read once (every 404 and /matrix asks)."""
    recipe_book: Mapping[str, Recipe]
    """Every recipe by name, read once with ``recipes`` (the request form and the build API
    take a project's ``split_archs`` default from it)."""
    redis: Redis | None
    """The build queue's Redis; None in index-only mode."""
    tokens: Tokens | None
    """None without a build queue: then nobody can sign in."""
    auth: AuthSettings
    metrics: Metrics
    pages: PageCache
    formats: FormatCache
    metadata: MetadataCache
    versions: VersionsCache
    readiness: Readiness
    """What ``/readyz`` checks: storage, the catalog's refresh and (if configured) Redis."""
    torch: TorchIndex | None = None
    """The torch and CUDA check before a build queues; None when ``torch_check`` is off."""
    mirror: Pages | None = None
    """The pull-through cache's pages (``wheelhouse.index.mirror``); None when it is off."""

    def held(self, record: Record) -> bool:
        """Whether ``record``'s wheel is held back (``WHEELHOUSE_UNPROVEN_WHEELS=hold``): no
        recorded GPU proof passed on it. Held wheels are left off the pages and not served."""
        if self.config.unproven is not Unproven.HOLD:
            return False
        proof = self.catalog.proof(record)
        return proof is None or not proof.passed

    def recipe_for(self, project: str) -> Recipe:
        """``project``'s recipe, or the generic one (read at start-up, never per request)."""
        return pick_recipe(self.recipe_book, project)

    @classmethod
    def create(cls, config: Config, storage: Storage | None = None) -> Services:
        store = storage if storage is not None else open_storage(config)
        redis_conn = None
        if config.redis_url:
            # Short timeouts, and QueueUnavailable (503) instead of redis-py's errors: a page
            # must not hang or fail because the queue is down.
            redis_conn = queue_client(config)
        catalog = Catalog(store, config.catalog_refresh_seconds)
        book = available_recipes(config.extra_recipe_dirs)
        return cls(
            config=config,
            storage=store,
            catalog=catalog,
            router=Router(config.upstream, config.upstream_routes),
            recipes=frozenset(n for n in book if n != GENERIC),
            recipe_book=book,
            redis=redis_conn,
            tokens=Tokens(redis_conn) if redis_conn is not None else None,
            auth=AuthSettings.from_config(config),
            metrics=Metrics(),
            pages=PageCache(),
            formats=FormatCache(),
            metadata=MetadataCache(),
            versions=VersionsCache(),
            readiness=_readiness(store, catalog, redis_conn),
            torch=TorchIndex(config) if config.torch_check else None,
            mirror=Pages(store, config) if config.cache_patterns else None,
        )

    def install(self, app: Flask) -> None:
        """Keep this as ``app``'s services; an app gets them once."""
        if EXTENSION in app.extensions:
            raise RuntimeError("this application already has its services")
        app.extensions[EXTENSION] = self


#: Seconds ``/readyz`` waits for each dependency (they are checked in parallel).
READY_DEADLINE = 2.5


def _readiness(storage: Storage, catalog: Catalog, redis: Redis | None) -> Readiness:
    probes = [Probe("storage", storage.ping, deadline=READY_DEADLINE),
              Probe("catalog", lambda: _catalog_fresh(catalog), deadline=READY_DEADLINE,
                    details=lambda: _catalog_details(catalog))]
    if redis is not None:
        probes.append(Probe("redis", redis.ping, deadline=READY_DEADLINE,
                            describe=lambda exc: f"{exc} ({exc.__cause__ or exc})"))
    return Readiness(probes)


def _catalog_fresh(catalog: Catalog) -> None:
    """Raise unless this process's catalog is as fresh as storage says (a refresh is started
    if one is due; readers never wait on storage, and neither does this)."""
    catalog.maybe_refresh()
    state = catalog.state()
    if not state.loaded:
        raise StorageUnavailable(f"the catalog has not been read from storage yet: {state.error}")
    if state.stale:
        raise StorageUnavailable(f"the catalog is stale ({state.age:.0f} s since storage "
                                 f"confirmed it): {state.error or 'its refresh hangs'}")


def _catalog_details(catalog: Catalog) -> dict[str, object]:
    state = catalog.state()
    return {"age_seconds": round(state.age, 1), "generation": state.generation,
            "files": state.files}


def services() -> Services:
    """The current application's services (inside a request or app context)."""
    return cast(Services, current_app.extensions[EXTENSION])
