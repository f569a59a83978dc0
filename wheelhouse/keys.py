"""The Redis keyspace: every key the web, the workers and the CLI keep in Redis, named here and
nowhere else (as :mod:`wheelhouse.index.layout` names every storage key).

The names are what deployed Redis servers hold: changing one orphans that data, so
``tests/wheelhouse/test_keys.py`` pins each. RQ's own keys (``rq:*``: queues, jobs, registries)
are RQ's. "Kept as long as the build" is ``wheelhouse.builds.queue.KEEP_SECONDS``.

- ``wheelhouse:tokens``                 hash, no TTL: every API token, digest -> JSON record
  (``wheelhouse.index.tokens``)
- ``wheelhouse:session:<digest>``       string, TTL of the cookie: a form login's token digest
- ``wheelhouse:token:*``, ``wheelhouse:token-name:*``  the earlier token format, only counted
- ``wheelhouse:secret-key``             string, no TTL: the web's shared session secret
- ``wheelhouse:rate:<name>:<window>``   string counter, TTL one window: a rate limit's count
- ``wheelhouse:onmiss:<job id>``        string, TTL ``web.onmiss.RATE_SECONDS``: a build on a
  miss was tried for that spec
- ``wheelhouse:log:<job id>``           list, kept as long as the build: the live log, capped
- ``wheelhouse:logn:<job id>``          string counter, as long as the build: live-log lines ever
  appended (the offset clients page by)
- ``wheelhouse:cancel:<job id>``        string, as long as the build: a running build was asked
  to stop (the worker polls it)
- ``wheelhouse:requester:<build id>``   string, as long as the build: the token name that
  requested a build or split request
- ``wheelhouse:split:<request id>``     string (JSON), as long as the build: a split request
  (``wheelhouse.builds.fanout``)
- ``wheelhouse:splits``                 sorted set, pruned to the same age: split request ids
  by creation time
- ``wheelhouse:worker:<name>``          string (JSON), TTL a few heartbeats: a live worker's
  advertisement (``wheelhouse.builds.fleet``)
- ``wheelhouse:stats``                  hash, no TTL: fleet-wide build counters
  (``wheelhouse.builds.stats``)
"""

from __future__ import annotations

#: Hash: token digest (hex) -> JSON token record.
TOKENS = "wheelhouse:tokens"
#: Key patterns of the earlier token format, which authenticates nothing (only counted).
LEGACY_TOKEN_PATTERNS: tuple[str, ...] = ("wheelhouse:token:*", "wheelhouse:token-name:*")
#: String, no TTL: the session secret every web process shares.
SESSION_SECRET = "wheelhouse:secret-key"  # noqa: S105 (a key name, not the secret)
#: Sorted set: split request ids, scored by creation time.
SPLITS = "wheelhouse:splits"
#: Hash: fleet-wide build counters (``ended:<state>``, ``le:<bound>``, sums).
STATS = "wheelhouse:stats"


def session(session_digest: str) -> str:
    """String, TTL of the cookie: the digest of the token a login session was started for."""
    return f"wheelhouse:session:{session_digest}"


def rate(name: str, window: int) -> str:
    """String counter, TTL one window: hits of ``name`` in fixed window number ``window``."""
    return f"wheelhouse:rate:{name}:{window}"


def onmiss(job_id: str) -> str:
    """String, TTL the on-miss rate: a build on a miss was tried for this job id lately."""
    return f"wheelhouse:onmiss:{job_id}"


def log(job_id: str) -> str:
    """List, kept as long as the build: the live log's latest lines."""
    return f"wheelhouse:log:{job_id}"


def log_count(job_id: str) -> str:
    """String counter, kept as long as the build: how many live-log lines were ever appended."""
    return f"wheelhouse:logn:{job_id}"


def cancel(job_id: str) -> str:
    """String (the time asked), kept as long as the build: stop this running build."""
    return f"wheelhouse:cancel:{job_id}"


def requester(build_id: str) -> str:
    """String, kept as long as the build: the token name that requested the build (or split)."""
    return f"wheelhouse:requester:{build_id}"


def split(request_id: str) -> str:
    """String (JSON), kept as long as the build: one split request's record."""
    return f"wheelhouse:split:{request_id}"


def worker(name: str) -> str:
    """String (JSON), TTL a few heartbeats: the advertisement of the live worker ``name``."""
    return f"wheelhouse:worker:{name}"


#: The pattern that matches every worker's advertisement (for SCAN).
WORKERS = worker("*")
