"""Prometheus metrics, multiprocess-safe under gunicorn.

Per-request counters live in each process and are merged by ``MultiProcessCollector`` when
``PROMETHEUS_MULTIPROC_DIR`` is set (``wheelhouse serve`` sets it). Catalog size, builds, queue
depth, reaped processes and governor pauses are read from storage and Redis at scrape time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from wheelhouse.builds.queue import BuildQueues
from wheelhouse.builds.stats import snapshot
from wheelhouse.errors import QueueUnavailable
from wheelhouse.index.catalog import Catalog

if TYPE_CHECKING:
    from redis import Redis


#: Methods counted under their own name; any other is counted as ``other``, so that a client
#: inventing methods can't add label values (each one a time series, kept forever).
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Metrics:
    """This process's request counters, and the scrape that adds the shared facts.

    The counters belong to no global registry: in multiprocess mode each process's values go
    to its files in ``PROMETHEUS_MULTIPROC_DIR`` and a scrape merges every process's; otherwise
    a scrape reads this object's counters.
    """

    def __init__(self) -> None:
        multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # prometheus_client chose where values live from that variable when it was imported.
        if multiprocess and not getattr(values.ValueClass, "_multiprocess", False):
            raise RuntimeError("PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was "
                               "imported, so this process's metrics would never be merged")
        self.multiprocess = multiprocess
        self.requests = Counter("wheelhouse_http_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=None)
        self.bytes = Counter("wheelhouse_http_bytes_served", "Response body bytes by route",
                             ["route"], registry=None)
        self.page_cache = Counter("wheelhouse_page_cache", "Index page cache look-ups",
                                  ["result"], registry=None)
        self.page_hit = self.page_cache.labels("hit")
        self.page_miss = self.page_cache.labels("miss")
        # Storage trouble (web.errors): 503s by kind (unavailable, damaged), and answers
        # served from a catalog whose refresh failed.
        self.storage_errors = Counter("wheelhouse_storage_errors",
                                      "Answers that storage trouble turned into 503s, by kind",
                                      ["kind"], registry=None)
        self.stale_answers = Counter("wheelhouse_catalog_stale_answers",
                                     "Answers served from the last good catalog while its "
                                     "refresh fails", registry=None)
        # labels() is a locked dict look-up; keep each (route, method, status)'s pair at hand.
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def count_request(self, route: str, method: str, status: int, size: int | None) -> None:
        """Count one answered request (Flask's hook, the fast path and the guard call this).

        ``route`` must come from a closed set (a URL rule, or ``unmatched``), never from the
        request; the method is folded into :data:`METHODS` or ``other`` here.
        """
        if method not in METHODS:
            method = "other"
        key = (route, method, status)
        pair = self._children.get(key)
        if pair is None:
            pair = (self.requests.labels(route, method, str(status)), self.bytes.labels(route))
            self._children[key] = pair
        pair[0].inc()
        if size:
            pair[1].inc(size)

    def scrape(self, catalog: Catalog, redis: Redis | None) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        registry = CollectorRegistry()
        if self.multiprocess:
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        else:
            for collector in (self.requests, self.bytes, self.page_cache,
                              self.storage_errors, self.stale_answers):
                registry.register(collector)
        registry.register(_LiveCollector(catalog, redis))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _LiveCollector(Collector):
    """Values that are facts about shared state, read when Prometheus scrapes."""

    def __init__(self, catalog: Catalog, redis: Redis | None) -> None:
        self.catalog = catalog
        self.redis = redis

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        # A process that only answers scrapes reads nothing else that would refresh its
        # catalog: ask for a refresh (bounded, as any reader's), so the gauge follows storage.
        self.catalog.maybe_refresh()
        state = self.catalog.state()
        if state.loaded:
            catalog = GaugeMetricFamily("wheelhouse_catalog_files", "Published wheels")
            catalog.add_metric([], state.files)
            yield catalog
        # Of the process that answers the scrape: each refreshes on its own.
        stale = GaugeMetricFamily("wheelhouse_catalog_stale",
                                  "1 while the catalog's refresh fails (or it was never read)")
        stale.add_metric([], 1 if state.stale or not state.loaded else 0)
        yield stale
        age = GaugeMetricFamily("wheelhouse_catalog_age_seconds",
                                "Seconds since storage last confirmed the catalog")
        age.add_metric([], state.age)
        yield age
        if self.redis is None:
            return
        try:
            yield from self._builds()
        except (QueueUnavailable, RedisError):
            return  # the build figures are missing from this scrape; the rest still counts

    def _builds(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        conn = self.redis
        assert conn is not None
        depth = GaugeMetricFamily("wheelhouse_queue_depth", "Builds waiting, by queue",
                                  labels=["queue"])
        running = GaugeMetricFamily("wheelhouse_builds_running", "Builds running, by queue",
                                    labels=["queue"])
        queues = BuildQueues(conn)
        for name in queues.names():
            depth.add_metric([name], queues.queue(name).count)
            running.add_metric([name], queues.started(name).count)
        yield depth
        yield running
        snap = snapshot(conn)
        ended = CounterMetricFamily("wheelhouse_builds_ended", "Ended builds by final state",
                                    labels=["state"])
        for state, n in sorted(snap.builds_ended.items()):
            ended.add_metric([state], n)
        yield ended
        cumulative = []
        for bound, n in sorted(snap.duration_buckets.items()):
            cumulative.append(("+Inf" if bound == float("inf") else str(bound), n))
        yield HistogramMetricFamily("wheelhouse_build_duration_seconds", "Build wall time",
                                    buckets=cumulative, sum_value=snap.duration_sum)
        reaped = CounterMetricFamily("wheelhouse_reaped_processes",
                                     "Processes killed when builds were stopped")
        reaped.add_metric([], snap.reaped_processes)
        yield reaped
        pauses = CounterMetricFamily("wheelhouse_governor_pauses",
                                     "Compile jobs paused by the memory governor")
        pauses.add_metric([], snap.governor_pauses)
        yield pauses
