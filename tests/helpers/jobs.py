"""Build jobs planted in Redis as a client or an attacker would."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis import Redis

    from wheelhouse.builds.job import BuildJob



def build_job(conn: Redis, job_id: str) -> BuildJob:
    """The build job ``job_id`` as wheelhouse reads it (JSON); it must exist."""
    from wheelhouse.builds.queue import fetch_job

    job = fetch_job(conn, job_id)
    assert job is not None, f"no job {job_id} in Redis"
    return job


def plant_job(conn: Redis, job_id: str, queue: str, data: bytes, **fields: str) -> None:
    """Write a job straight into Redis, as someone holding the Redis password could: RQ's hash
    (``data`` is what a job's serializer reads), in the queue's list, the queue registered."""
    conn.hset(f"rq:job:{job_id}", mapping={
        "data": data, "origin": queue, "status": "queued", "description": "planted",
        "created_at": "2026-01-01T00:00:00.000000Z",
        "enqueued_at": "2026-01-01T00:00:00.000000Z", **fields})
    conn.rpush(f"rq:queue:{queue}", job_id)
    conn.sadd("rq:queues", f"rq:queue:{queue}")
