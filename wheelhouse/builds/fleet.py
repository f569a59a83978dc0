"""The build fleet as Redis sees it: who can build what, and who is alive.

Each worker advertises its capabilities under ``wheelhouse:worker:<name>`` with a TTL and
refreshes it (the heartbeat); a worker that dies simply expires. Queues are one per CUDA version
and CPU architecture (``build-cu130-x86_64``). A toolkit serves every known CUDA version of its
major version up to its own minor, since torch's extension builder only refuses a major
mismatch and a newer nvcc of the same major builds for an older runtime. A toolkit a worker
provisioned itself (``worker.toolkits.provision``) counts only once its ``nvcc --version``
answered; a
version it tried and could not provision is listed in ``unavailable`` with the reason.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from wheelhouse import keys
from wheelhouse.builds.spec import BuildSpec, queue_name
from wheelhouse.shapes import known_fields
from wheelhouse.variants import KNOWN_CUDA

if TYPE_CHECKING:
    from redis import Redis


@dataclass(frozen=True)
class ToolkitInfo:
    cuda: str
    """``13.0``."""
    home: str
    nvcc: str
    release: str = ""
    """The full ``nvcc --version`` release, e.g. ``V13.0.88``."""


@dataclass(frozen=True)
class GpuInfo:
    name: str
    arch: str
    """Compute capability without the dot: ``90``."""


@dataclass(frozen=True)
class WorkerAd:
    """A worker's capability advertisement (what ``/api/workers`` lists)."""

    name: str
    hostname: str
    machine: str
    cores: int
    memory_bytes: int
    toolkits: tuple[ToolkitInfo, ...]
    gpus: tuple[GpuInfo, ...] = ()
    queues: tuple[str, ...] = ()
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    current_job: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    provisionable: tuple[str, ...] = ()
    """CUDA versions whose toolkit it provisioned itself and proved (also in ``toolkits``)."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """CUDA versions it was told to provision and could not, with the one-line reason."""

    @property
    def cuda_versions(self) -> tuple[str, ...]:
        return servable_cuda([t.cuda for t in self.toolkits], self.provisionable)

    def serves(self, spec: BuildSpec) -> bool:
        return spec.queue_name in self.queues

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerAd:
        data = json.loads(raw)
        data["toolkits"] = tuple(ToolkitInfo(**known_fields(ToolkitInfo, t))
                                 for t in data.get("toolkits", []))
        data["gpus"] = tuple(GpuInfo(**known_fields(GpuInfo, g)) for g in data.get("gpus", []))
        data["queues"] = tuple(data.get("queues", []))
        data["provisionable"] = tuple(data.get("provisionable", []))
        data["unavailable"] = {str(k): str(v) for k, v in
                               dict(data.get("unavailable") or {}).items()}
        return cls(**known_fields(cls, data))  # a newer worker's fields: ignored (shapes)


def _major_minor(cuda: str) -> tuple[int, int]:
    major, minor = cuda.split(".")[:2]
    return int(major), int(minor)


def servable_cuda(toolkit_versions: Iterable[str],
                  provisionable: Iterable[str] = ()) -> tuple[str, ...]:
    """Known CUDA versions a worker can build for: those some installed toolkit serves (same
    major, minor up to the toolkit's), and those it can install a toolkit for."""
    have = [_major_minor(v) for v in toolkit_versions]
    extra = set(provisionable)
    out = []
    for known in KNOWN_CUDA:
        kmaj, kmin = _major_minor(known)
        if known in extra or any(maj == kmaj and kmin <= minor for maj, minor in have):
            out.append(known)
    return tuple(out)


def pick_toolkit(toolkits: Iterable[ToolkitInfo], cuda: str) -> ToolkitInfo | None:
    """The toolkit to build for ``cuda``: the exact version, else the nearest newer minor.

    Never one of another major version: torch's extension builder refuses it.
    """
    want = _major_minor(cuda)
    fits = [t for t in toolkits if _major_minor(t.cuda)[0] == want[0]
            and _major_minor(t.cuda)[1] >= want[1]]
    if not fits:
        return None
    return min(fits, key=lambda t: _major_minor(t.cuda))


def queues_for(toolkit_versions: Iterable[str], machine: str,
               provisionable: Iterable[str] = ()) -> tuple[str, ...]:
    return tuple(queue_name(c, machine) for c in servable_cuda(toolkit_versions, provisionable))


def advertise(conn: Redis, ad: WorkerAd, *, ttl: float) -> None:
    """Write (or refresh) the advertisement; it vanishes ``ttl`` seconds after the last beat."""
    fresh = replace(ad, heartbeat_at=time.time())
    conn.set(keys.worker(ad.name), fresh.to_json(), px=max(1, int(ttl * 1000)))


def withdraw(conn: Redis, name: str) -> None:
    conn.delete(keys.worker(name))


def live_workers(conn: Redis) -> list[WorkerAd]:
    """Every worker whose advertisement has not expired, by name."""
    names = sorted(conn.scan_iter(match=keys.WORKERS, count=500))
    if not names:
        return []
    ads = []
    for raw in conn.mget(names):
        if raw is None:
            continue  # expired between SCAN and MGET
        try:
            ads.append(WorkerAd.from_json(raw))
        except (ValueError, TypeError, KeyError):
            continue  # a foreign or older advert must not break the listing
    return sorted(ads, key=lambda a: a.name)


def serving_workers(conn: Redis, spec: BuildSpec) -> list[WorkerAd]:
    return [ad for ad in live_workers(conn) if ad.serves(spec)]


def servable(conn: Redis) -> set[tuple[str, str]]:
    """(CUDA version, CPU architecture) pairs the live fleet can build, for the request form."""
    pairs: set[tuple[str, str]] = set()
    for ad in live_workers(conn):
        for cuda in ad.cuda_versions:
            pairs.add((cuda, ad.machine))
    return pairs


def unavailable_reasons(workers: Iterable[WorkerAd]) -> dict[str, list[str]]:
    """Why CUDA versions no worker offers are missing: each worker's reason, by version."""
    offered = {c for ad in workers for c in ad.cuda_versions}
    reasons: dict[str, list[str]] = {}
    for ad in workers:
        for cuda, why in ad.unavailable.items():
            if cuda not in offered:
                reasons.setdefault(cuda, []).append(f"{ad.name}: {why}")
    return reasons


def source_paths_differ(workers: Iterable[WorkerAd]) -> str | None:
    """One line when live workers' builds see their sources at different paths (``extra``'s
    ``source_path``; adverts without one are left out), else None.

    sccache 0.16.0 hashes the absolute source path nvcc hands cicc, so nvcc's cache entries hit
    only between builds that saw their source at one path: every sandboxed build sees it at
    ``/wheelhouse/src``, an unsandboxed one under its worker's workspace (a torch-scatter build
    resumed at another path compiled all its kernels again)."""
    paths: dict[str, list[str]] = {}
    for ad in workers:
        path = ad.extra.get("source_path")
        if isinstance(path, str) and path:
            paths.setdefault(path, []).append(ad.name)
    if len(paths) < 2:
        return None
    groups = "; ".join(f"{path}: {', '.join(sorted(names))}"
                       for path, names in sorted(paths.items()))
    return (f"workers' builds see their sources at different paths ({groups}): nvcc's compile "
            "cache entries hit only between workers of one path (sandboxed builds all see "
            "/wheelhouse/src; unsandboxed ones <WHEELHOUSE_WORKSPACE>/src)")


def explain_unservable(conn: Redis, spec: BuildSpec) -> str | None:
    """None if a live worker serves ``spec``; else one line saying why not and what would."""
    workers = live_workers(conn)
    if any(ad.serves(spec) for ad in workers):
        return None
    if not workers:
        return (f"no build worker is running, so {spec.describe()} can't be built; "
                "start one with `wheelhouse worker`")
    offered = sorted({f"CUDA {c} on {ad.machine}" for ad in workers for c in ad.cuda_versions})
    tried = unavailable_reasons(workers).get(spec.cuda)
    why = (f"; provisioning it failed on {tried[0]}" if tried else
           f"; a worker provisions it at start when WHEELHOUSE_TOOLKIT_PROVISION names {spec.cuda}")
    return (f"no live worker can build for CUDA {spec.cuda} on {spec.machine} "
            f"(it needs a CUDA {spec.cuda.split('.')[0]}.x toolkit, "
            f"{spec.cuda} or newer); the fleet offers: {', '.join(offered) or 'nothing'}{why}")


def build_id_prefix(conn: Redis) -> str:
    """The prefix of this fleet's build ids (``wh1a2b3c4d-``), the cookie every build carries.

    It is derived from the Redis the fleet shares, so a worker sweeping orphans at start only
    ever touches builds of its own fleet, never those of another deployment on the same host
    (or of ``wheelhouse build``, which runs without Redis).
    """
    kw = conn.connection_pool.connection_kwargs
    where = f"{kw.get('host', '')}:{kw.get('port', '')}/{kw.get('db', 0)}{kw.get('path', '')}"
    return "wh" + hashlib.sha256(where.encode()).hexdigest()[:8] + "-"
