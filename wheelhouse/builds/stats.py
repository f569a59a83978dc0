"""Fleet-wide build counters kept in Redis, so that any web process can export them.

Workers call :func:`record_build` when a build ends; ``/metrics`` reads :func:`snapshot`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from wheelhouse import keys

if TYPE_CHECKING:
    from redis import Redis

#: Upper bounds (seconds) of the build-duration histogram buckets.
DURATION_BUCKETS = (60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, float("inf"))


@dataclass(frozen=True)
class Snapshot:
    builds_ended: dict[str, int]
    duration_buckets: dict[float, int]
    duration_sum: float
    duration_count: int
    reaped_processes: int
    governor_pauses: int


def record_build(conn: Redis, *, state: str, seconds: float, reaped: int = 0,
                 pauses: int = 0) -> None:
    """Count one ended build (``state`` is a BuildState value or failure kind)."""
    pipe = conn.pipeline(transaction=False)
    pipe.hincrby(keys.STATS, f"ended:{state}", 1)
    pipe.hincrbyfloat(keys.STATS, "duration_sum", seconds)
    pipe.hincrby(keys.STATS, "duration_count", 1)
    for bound in DURATION_BUCKETS:
        if seconds <= bound:
            pipe.hincrby(keys.STATS, f"le:{bound}", 1)
    if reaped:
        pipe.hincrby(keys.STATS, "reaped_processes", reaped)
    if pauses:
        pipe.hincrby(keys.STATS, "governor_pauses", pauses)
    pipe.execute()


def snapshot(conn: Redis) -> Snapshot:
    raw = {k.decode(): v.decode() for k, v in conn.hgetall(keys.STATS).items()}  # type: ignore[union-attr]
    ended = {k.split(":", 1)[1]: int(v) for k, v in raw.items() if k.startswith("ended:")}
    buckets = {b: int(raw.get(f"le:{b}", 0)) for b in DURATION_BUCKETS}
    return Snapshot(
        builds_ended=ended,
        duration_buckets=buckets,
        duration_sum=float(raw.get("duration_sum", 0)),
        duration_count=int(raw.get("duration_count", 0)),
        reaped_processes=int(raw.get("reaped_processes", 0)),
        governor_pauses=int(raw.get("governor_pauses", 0)),
    )
