"""Prometheus metrics, multiprocess-safe under gunicorn.

Per-request counters live in each process and are merged by ``MultiProcessCollector`` when
``PROMETHEUS_MULTIPROC_DIR`` is set (``wheelhouse serve`` sets it). Catalog size, builds, queue
depth, reaped processes and governor pauses are read from storage and Redis at scrape time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from flask import Flask, Response, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from web.app import Services

REQUESTS = Counter("wheelhouse_http_requests", "HTTP requests by route and status",
                   ["route", "method", "status"])
BYTES = Counter("wheelhouse_http_bytes_served", "Response body bytes by route", ["route"])
PAGE_CACHE = Counter("wheelhouse_page_cache", "Index page cache look-ups", ["result"])


class _LiveCollector(Collector):
    """Values that are facts about shared state, read when Prometheus scrapes."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        catalog = GaugeMetricFamily("wheelhouse_catalog_files", "Published wheels")
        catalog.add_metric([], len(self.svc.catalog))
        yield catalog
        if self.svc.redis is None:
            return
        from redis.exceptions import RedisError

        try:
            yield from self._builds()
        except RedisError:
            return

    def _builds(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        from rq import Queue
        from rq.registry import StartedJobRegistry

        from wheelhouse.stats import snapshot

        conn = self.svc.redis
        assert conn is not None
        depth = GaugeMetricFamily("wheelhouse_queue_depth", "Builds waiting, by queue",
                                  labels=["queue"])
        running = GaugeMetricFamily("wheelhouse_builds_running", "Builds running, by queue",
                                    labels=["queue"])
        for queue in Queue.all(connection=conn):
            depth.add_metric([queue.name], queue.count)
            running.add_metric([queue.name], StartedJobRegistry(queue.name,
                                                                connection=conn).count)
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


_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}


def count_request(route: str, method: str, status: int, size: int | None) -> None:
    """Count one answered request (Flask's hook and the fast path both call this)."""
    key = (route, method, status)
    pair = _children.get(key)
    if pair is None:  # labels() is a locked dict look-up; keep the children at hand
        pair = (REQUESTS.labels(route, method, str(status)), BYTES.labels(route))
        _children[key] = pair
    pair[0].inc()
    if size:
        pair[1].inc(size)


def init_app(app: Flask, svc: Services) -> None:
    @app.after_request
    def _count(resp: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        count_request(route, request.method, resp.status_code, resp.content_length)
        return resp

    live = _LiveCollector(svc)
    app.extensions["wheelhouse_metrics"] = live


def render(svc: Services, live: _LiveCollector) -> Response:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = CollectorRegistry()
        for collector in (REQUESTS, BYTES, PAGE_CACHE):
            registry.register(collector)
    registry.register(live)
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
