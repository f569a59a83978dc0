"""Load while publishing: readers never see a partial, wrong or vanishing publication.

    python bench/load_while_publishing.py [--storage local|s3|both] [--clients 64]
                                          [--duration 60] [--wheels 100] [--publishers 2]
                                          [--json out.json]

For each storage (a local directory; moto's S3 server as a separate process), it starts the
real ``wheelhouse serve`` (gunicorn, 2 workers x 4 threads, no access log), seeds a few wheels,
and for ``--duration`` seconds runs:

- ``--clients`` readers (threads spread over 4 processes, each with its own keep-alive
  session): fetch a project's JSON page, pick a listed file, fetch its ``.metadata`` and (one
  time in four) the wheel, and check everything against the page;
- ``--publishers`` processes that publish ``--wheels`` new wheels between them with the core's
  ``publish()`` (the code ``wheelhouse publish`` runs), spread evenly over the duration.

Figures: requests, 5xx (target 0), p50/p99 latency by kind, and consistency: a listed file that
then 404s, a body whose sha256 differs from the page's, a listing that loses a file it showed
this client before (target 0 each), and whether every published wheel was listed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers import free_port, own_session  # noqa: E402

VARIANT = "torch2.8-cu128"
PROJECTS = ("bench-a", "bench-b", "bench-c", "bench-d")
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}
CLIENT_PROCESSES = 4
SEED_PER_PROJECT = 3


# --------------------------------------------------------------------------- servers


def _wait_for(url: str, timeout: float = 60) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout}s")


@contextlib.contextmanager
def _process_group(argv: list[str], log: Path, env: dict[str, str]) -> Iterator[None]:
    with own_session(argv, log, env=env, grace=20):
        yield


@contextlib.contextmanager
def _storage(kind: str, work: Path) -> Iterator[dict[str, str]]:
    """The ``WHEELHOUSE_*``/``AWS_*`` settings of a fresh storage of ``kind``."""
    if kind == "local":
        yield {"WHEELHOUSE_STORAGE": str(work / "data")}
        return
    port = free_port()
    aws = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    with _process_group([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                         str(port)], work / "moto.log", {**os.environ, **aws}):
        _wait_for(f"http://127.0.0.1:{port}/")
        settings = {**aws, "WHEELHOUSE_STORAGE": "s3://bench/idx",
                    "WHEELHOUSE_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        os.environ.update(aws)
        from wheelhouse.config import Config
        from wheelhouse.index.storage import make_s3_client

        make_s3_client(Config.from_env(settings)).create_bucket(Bucket="bench")
        yield settings


# --------------------------------------------------------------------------- wheels


def _wheels(directory: Path, count: int, first: int, seed: int) -> list[Path]:
    """``count`` wheels over :data:`PROJECTS`, versions from ``first`` on, 20-400 KB each."""
    from tests.helpers import make_wheel
    from wheelhouse.variants import parse_variant

    label = parse_variant(VARIANT).local_label
    rnd = random.Random(seed)
    return [make_wheel(directory / str(n), PROJECTS[n % len(PROJECTS)], f"1.{n}+{label}",
                       payload=rnd.randbytes(rnd.randint(20_000, 400_000)))
            for n in range(first, first + count)]


def _publisher(settings: dict[str, str], wheels: list[str], duration: float,
               started: float) -> list[tuple[str, float]]:
    """Publish ``wheels`` evenly over ``duration``; (file name, seconds it took) each."""
    from wheelhouse.config import Config
    from wheelhouse.index.publish import publish
    from wheelhouse.index.storage import open_storage
    from wheelhouse.variants import parse_variant

    os.environ.update({k: v for k, v in settings.items() if k.startswith("AWS_")})
    storage = open_storage(Config.from_env(settings))
    variant = parse_variant(VARIANT)
    out = []
    step = duration / max(len(wheels), 1)
    for n, path in enumerate(wheels):
        time.sleep(max(0.0, started + n * step - time.time()))
        t0 = time.monotonic()
        publish(storage, Path(path), variant)
        out.append((Path(path).name, time.monotonic() - t0))
    return out


# --------------------------------------------------------------------------- readers


@dataclass
class ClientStats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    """Requests that got no HTTP answer (connection refused, reset, timeout)."""
    listed_then_404: list[str] = field(default_factory=list)
    hash_mismatch: list[str] = field(default_factory=list)
    went_backwards: list[str] = field(default_factory=list)

    def add(self, kind: str, status: int, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)
        key = str(status)
        self.statuses[key] = self.statuses.get(key, 0) + 1

    def merge(self, other: ClientStats) -> None:
        for k, v in other.latencies.items():
            self.latencies.setdefault(k, []).extend(v)
        for k, n in other.statuses.items():
            self.statuses[k] = self.statuses.get(k, 0) + n
        self.errors += other.errors
        self.listed_then_404 += other.listed_then_404
        self.hash_mismatch += other.hash_mismatch
        self.went_backwards += other.went_backwards


def _client(url: str, until: float, seed: int, stats: ClientStats) -> None:
    import requests

    rnd = random.Random(seed)
    seen: dict[str, set[str]] = {}
    with requests.Session() as session:
        n = 0
        while time.time() < until:
            n += 1
            project = rnd.choice(PROJECTS)
            try:
                t0 = time.monotonic()
                r = session.get(f"{url}/{VARIANT}/simple/{project}/", headers=JSON, timeout=30)
                stats.add("page", r.status_code, time.monotonic() - t0)
                if r.status_code != 200:
                    continue
                files = r.json()["files"]
                names = {f["filename"] for f in files}
                lost = seen.get(project, set()) - names
                if lost:
                    stats.went_backwards.append(f"{project}: {sorted(lost)[:3]}")
                seen[project] = seen.get(project, set()) | names
                if not files:
                    continue
                f = rnd.choice(files)
                t0 = time.monotonic()
                m = session.get(url + f["url"] + ".metadata", timeout=30)
                stats.add("metadata", m.status_code, time.monotonic() - t0)
                if m.status_code == 404:
                    stats.listed_then_404.append(f["filename"] + ".metadata")
                elif m.status_code == 200 and hashlib.sha256(m.content).hexdigest() != \
                        f["core-metadata"]["sha256"]:
                    stats.hash_mismatch.append(f["filename"] + ".metadata")
                if n % 4:
                    continue
                t0 = time.monotonic()
                w = session.get(url + f["url"], timeout=60)
                stats.add("wheel", w.status_code, time.monotonic() - t0)
                if w.status_code == 404:
                    stats.listed_then_404.append(f["filename"])
                elif w.status_code == 200 and (
                        len(w.content) != f["size"]
                        or hashlib.sha256(w.content).hexdigest() != f["hashes"]["sha256"]):
                    stats.hash_mismatch.append(f["filename"])
            except requests.RequestException:
                stats.errors += 1


def _client_process(url: str, threads: int, until: float, seed: int) -> ClientStats:
    per_thread = [ClientStats() for _ in range(threads)]
    workers = [threading.Thread(target=_client, args=(url, until, seed * 1000 + i, s))
               for i, s in enumerate(per_thread)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    total = ClientStats()
    for s in per_thread:
        total.merge(s)
    return total


# --------------------------------------------------------------------------- one run


@dataclass
class Result:
    storage: str
    duration: float
    clients: int
    published: int
    requests: int
    requests_per_second: float
    http_5xx: int
    no_answer: int
    statuses: dict[str, int]
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    listed_then_404: int
    hash_mismatch: int
    went_backwards: int
    all_listed_at_end: bool
    publish_p50_ms: float
    examples: dict[str, list[str]]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def run(kind: str, args: argparse.Namespace, work: Path) -> Result:
    import requests

    work.mkdir(parents=True)
    with _storage(kind, work) as settings:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
        env.update(settings)
        seed_wheels = _wheels(work / "seed", SEED_PER_PROJECT * len(PROJECTS), 0, 1)
        _publisher(settings, [str(p) for p in seed_wheels], 0, time.time())
        new = _wheels(work / "new", args.wheels, len(seed_wheels), 2)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        wheelhouse = shutil.which("wheelhouse") or "wheelhouse"
        with _process_group([wheelhouse, "serve", "--port", str(port), "--workers", "2",
                             "--threads", "4", "--no-access-log"], work / "serve.log", env):
            _wait_for(url + "/healthz")
            started = time.time() + 2
            until = started + args.duration
            ctx = multiprocessing.get_context("spawn")
            per_process = max(1, args.clients // CLIENT_PROCESSES)
            shares = [new[i::args.publishers] for i in range(args.publishers)]
            with ctx.Pool(CLIENT_PROCESSES + args.publishers) as pool:
                readers = [pool.apply_async(_client_process, (url, per_process, until, i))
                           for i in range(CLIENT_PROCESSES)]
                publishers = [pool.apply_async(_publisher, (settings, [str(p) for p in share],
                                                            args.duration * 0.9, started))
                              for share in shares]
                stats = ClientStats()
                for r in readers:
                    stats.merge(r.get(timeout=args.duration + 300))
                timings = [t for p in publishers for _, t in p.get(timeout=args.duration + 300)]
            listed = set()
            for project in PROJECTS:
                page = requests.get(f"{url}/{VARIANT}/simple/{project}/", headers=JSON,
                                    timeout=30).json()
                listed |= {f["filename"] for f in page["files"]}
    total = sum(stats.statuses.values())
    lat = stats.latencies
    everything = [x for v in lat.values() for x in v]
    return Result(
        storage=kind, duration=args.duration, clients=per_process * CLIENT_PROCESSES,
        published=len(timings), requests=total,
        requests_per_second=round(total / args.duration, 1),
        http_5xx=sum(n for s, n in stats.statuses.items() if s.startswith("5")),
        no_answer=stats.errors, statuses=stats.statuses,
        p50_ms={k: round(_pct(v, 0.50), 1) for k, v in [*lat.items(), ("all", everything)]},
        p99_ms={k: round(_pct(v, 0.99), 1) for k, v in [*lat.items(), ("all", everything)]},
        listed_then_404=len(stats.listed_then_404), hash_mismatch=len(stats.hash_mismatch),
        went_backwards=len(stats.went_backwards),
        all_listed_at_end={p.name for p in [*seed_wheels, *new]} <= listed,
        publish_p50_ms=round(statistics.median(timings) * 1000, 1) if timings else float("nan"),
        examples={"listed_then_404": stats.listed_then_404[:5],
                  "hash_mismatch": stats.hash_mismatch[:5],
                  "went_backwards": stats.went_backwards[:5]},
    )


def _table(results: list[Result]) -> str:
    head = ("| storage | requests | req/s | 5xx | no answer | p50 ms (page / .metadata / wheel) "
            "| p99 ms (page / .metadata / wheel) | listed then 404 | hash mismatch | "
            "listing went back | published | all listed |")
    rows = [head, "|" + "---|" * 12]
    for r in results:
        p50 = " / ".join(f"{r.p50_ms.get(k, float('nan')):.1f}" for k in
                         ("page", "metadata", "wheel"))
        p99 = " / ".join(f"{r.p99_ms.get(k, float('nan')):.1f}" for k in
                         ("page", "metadata", "wheel"))
        rows.append(f"| {r.storage} | {r.requests:,} | {r.requests_per_second:,.0f} | "
                    f"{r.http_5xx} | {r.no_answer} | {p50} | {p99} | {r.listed_then_404} | "
                    f"{r.hash_mismatch} | {r.went_backwards} | {r.published} | "
                    f"{'yes' if r.all_listed_at_end else 'NO'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", choices=("local", "s3", "both"), default="both")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--wheels", type=int, default=100)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores",
          flush=True)
    kinds = ("local", "s3") if args.storage == "both" else (args.storage,)
    results = []
    with tempfile.TemporaryDirectory(prefix="wheelhouse-load-") as tmp:
        for kind in kinds:
            print(f"{kind}: {args.clients} clients, {args.publishers} publishers adding "
                  f"{args.wheels} wheels over {args.duration:.0f}s ...", flush=True)
            results.append(run(kind, args, Path(tmp) / kind))
    print(_table(results))
    for r in results:
        for what, examples in r.examples.items():
            if examples:
                print(f"{r.storage}: {what}: {examples}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    bad = any(r.http_5xx or r.listed_then_404 or r.hash_mismatch or r.went_backwards
              or not r.all_listed_at_end for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
