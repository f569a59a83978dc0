"""Index benchmark: our server against pypiserver and a bare Flask ceiling, in one run.

    python bench/index_bench.py [--wheels 5000] [--variants 50] [--duration 10]
                                [--connections 32] [--scale] [--json out.json]

It builds a synthetic catalog (``--wheels`` wheels in ``--variants`` variants, 100 files on
every project page), then starts three servers on loopback under the same gunicorn settings
(``-w 2 -k gthread --threads 4``, no access log) and loads each with ``wrk``:

1. our server, ``gunicorn 'web:create_app()'`` over the catalog's storage directory;
2. pypiserver serving the same wheel files (hard links) from one flat directory;
3. a bare Flask app returning pre-rendered, byte-identical copies of our project pages (and
   ``.metadata`` bodies) from a dict: the ceiling for any Flask index.

Each scenario cycles through every project page (or a sample of ``.metadata`` URLs) with a
small wrk Lua script: project pages, 304 revalidations (``If-None-Match`` with each page's own
ETag) and ``.metadata`` fetches. With ``--scale`` our server is measured again over a catalog
ten times as large (or pass ``--wheels 50000`` alone). Every server runs in its own process
group and is stopped by it, whatever happens.

wrk and the servers share the machine's cores; wrk runs one thread by default
(``--wrk-threads``) so that it takes as little of them as possible.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers import free_port, stop_group  # noqa: E402

FILES_PER_PAGE = 100
TAG = "cp311-cp311-linux_x86_64"
GUNICORN_ARGS = ["-w", "2", "-k", "gthread", "--threads", "4", "--graceful-timeout", "5",
                 "--timeout", "120", "--no-control-socket"]
SCENARIOS = ("project page", "304 revalidation", ".metadata")
BARE_PAGES_ENV = "INDEX_BENCH_BARE_PAGES"
CATALOG_MARKER = "index-bench-catalog.json"
METADATA_SAMPLE = 1000


# --------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class Page:
    """One project page of the synthetic catalog."""

    variant: str
    base: str
    project: str
    filenames: tuple[str, ...]

    @property
    def ours(self) -> str:
        return f"/{self.variant}/simple/{self.project}/"

    @property
    def pypiserver(self) -> str:
        return f"/simple/{self.project}/"

    def metadata_url(self, filename: str) -> str:
        return f"/files/{self.base}/{self.project}/{filename}.metadata"


@dataclass
class Catalog:
    root: Path  # storage directory (WHEELHOUSE_STORAGE)
    flat: Path  # the same wheels, hard-linked into one directory, for pypiserver
    wheels: int
    variants: int
    pages: list[Page]


def bench_variants(count: int) -> list[Any]:
    """``count`` distinct base variants, in a stable order."""
    from wheelhouse.variants import KNOWN_CUDA, Variant

    out: list[Variant] = []
    for abi in (None, False, True):
        for minor in range(0, 40):
            for cuda in KNOWN_CUDA:
                v = Variant.of(f"2.{minor}", cuda, cxx11abi=abi)
                if v not in out:
                    out.append(v)
                if len(out) == count:
                    return out
    raise SystemExit(f"cannot make {count} distinct variants")


def _scratch_storage(root: Path) -> Any:
    """:class:`LocalStorage` without the fsyncs: same keys, same layout, built in seconds.

    A benchmark catalog need not survive a power cut; three fsyncs a wheel would make a
    50,000-wheel catalog take many minutes to write.
    """
    from wheelhouse.index.storage import LocalStorage

    class ScratchStorage(LocalStorage):
        def put_file(self, key: str, path: Path) -> None:
            target = self._path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)

        def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
            target = self._path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("xb" if exclusive else "wb") as out:
                out.write(data)

    return ScratchStorage(root)


def build_catalog(root: Path, wheels: int, variant_count: int, log: Any) -> Catalog:
    """Write ``wheels`` tiny wheels (``FILES_PER_PAGE`` per project) into storage at ``root``.

    The first wheel of every project goes through :func:`wheelhouse.index.publish.publish`; the rest
    are written straight into the same storage layout (wheel, ``.metadata``, record) with the
    core's own key and record helpers, then the generation is bumped once: publishing 50,000
    wheels one by one would take minutes. :func:`check_catalog` then reads it back.
    """
    from tests.helpers import make_wheel
    from wheelhouse.index.layout import Record, record_key, wheel_key
    from wheelhouse.index.publish import bump_generation, publish
    from wheelhouse.wheels import parse_name, read_metadata, sha256_file

    if wheels % (variant_count * FILES_PER_PAGE):
        raise SystemExit(
            f"--wheels must be a multiple of --variants * {FILES_PER_PAGE} "
            f"(= {variant_count * FILES_PER_PAGE}) so that every page has {FILES_PER_PAGE} files"
        )
    projects_per_variant = wheels // (variant_count * FILES_PER_PAGE)
    marker = root / CATALOG_MARKER
    wanted = {"wheels": wheels, "variants": variant_count, "files_per_page": FILES_PER_PAGE}
    storage_dir, flat = root / "storage", root / "flat"
    if marker.exists() and json.loads(marker.read_text()).get("params") == wanted:
        data = json.loads(marker.read_text())
        kept = [Page(p["variant"], p["base"], p["project"], tuple(p["filenames"]))
                for p in data["pages"]]
        log(f"catalog: reusing {wheels} wheels in {root}")
        return Catalog(storage_dir, flat, wheels, variant_count, kept)
    for d in (storage_dir, flat, root / "staging"):
        shutil.rmtree(d, ignore_errors=True)
    flat.mkdir(parents=True)
    storage = _scratch_storage(storage_dir)
    started = time.monotonic()
    pages: list[Page] = []
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    done = 0
    for vi, variant in enumerate(bench_variants(variant_count)):
        for pi in range(projects_per_variant):
            project = f"bench-v{vi:03d}-p{pi:03d}"
            staging = root / "staging"
            names: list[str] = []
            for i in range(FILES_PER_PAGE):
                version = f"1.{i // 10}.{i % 10}+{variant.local_label}"
                path = make_wheel(staging, project, version, tag=TAG)
                name = parse_name(path.name)
                if i == 0:
                    record = publish(storage, path, variant)
                else:
                    metadata = read_metadata(path)
                    record = Record(
                        filename=name.filename, project=name.project,
                        version=str(name.version), variant=variant, archs=None,
                        sha256=sha256_file(path), size=path.stat().st_size,
                        metadata_sha256=_sha256(metadata), requires_python=None,
                        upload_time=stamp,
                    )
                    wkey = wheel_key(variant, name.project, name.filename)
                    storage.put_file(wkey, path)
                    storage.put_bytes(wkey + ".metadata", metadata)
                    storage.put_bytes(record_key(variant, name.project, name.filename),
                                      record.to_json(), exclusive=True)
                os.link(storage_dir / record.wheel_key, flat / record.filename)
                path.unlink()
                names.append(record.filename)
                done += 1
            pages.append(Page(variant.key, variant.base.key, project, tuple(names)))
        if (vi + 1) % 10 == 0 or vi + 1 == variant_count:
            log(f"catalog: {done}/{wheels} wheels ({time.monotonic() - started:.0f}s)")
    bump_generation(storage)
    shutil.rmtree(root / "staging", ignore_errors=True)
    marker.write_text(json.dumps({"params": wanted, "pages": [asdict(p) for p in pages]}))
    return Catalog(storage_dir, flat, wheels, variant_count, pages)


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def check_catalog(catalog: Catalog) -> None:
    """Read the catalog back through the core: every page lists exactly its files."""
    from packaging.utils import canonicalize_name

    from wheelhouse.index.catalog import Catalog as CoreCatalog
    from wheelhouse.index.storage import LocalStorage
    from wheelhouse.variants import parse_variant

    core = CoreCatalog(LocalStorage(catalog.root))
    if len(core) != catalog.wheels:
        raise SystemExit(f"catalog holds {len(core)} records, expected {catalog.wheels}")
    for page in catalog.pages:
        listed = [r.filename for r in core.files(parse_variant(page.variant),
                                                 canonicalize_name(page.project))]
        if sorted(listed) != sorted(page.filenames):
            raise SystemExit(f"{page.ours} lists {len(listed)} files, expected "
                             f"{len(page.filenames)}")


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


_RUNNING: list[Server] = []


def start_server(name: str, app: str, env: dict[str, str], workdir: Path,
                 extra: Sequence[str] = ()) -> Server:
    """Start ``gunicorn app`` in a new session (its own process group) and wait until it answers.

    ``app`` ``wheelhouse serve`` runs our own command instead, which sets the same gunicorn
    options (2 gthread workers, 4 threads each) and what production adds to them.
    """
    port = free_port()
    log = workdir / f"{name}.log"
    if app == "wheelhouse serve":
        cmd = [sys.executable, "-c", "from wheelhouse.cli.main import run; run()", "serve",
               "--host", "127.0.0.1", "--port", str(port), "--workers", "2", "--threads", "4",
               "--no-access-log"]
    else:
        cmd = [sys.executable, "-m", "gunicorn", *GUNICORN_ARGS, *extra,
               "-b", f"127.0.0.1:{port}", app]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(name, port, proc, log)
    _RUNNING.append(server)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.05)
    stop_server(server)
    raise SystemExit(f"{name} does not listen after 60s:\n{log.read_text()[-3000:]}")


def stop_server(server: Server) -> None:
    """Stop the server's whole process group (gunicorn's workers may outlive the arbiter)."""
    if server in _RUNNING:
        _RUNNING.remove(server)
    stop_group(server.proc, grace=10)


@contextlib.contextmanager
def running(name: str, app: str, env: dict[str, str], workdir: Path,
            extra: Sequence[str] = ()) -> Iterator[Server]:
    server = start_server(name, app, env, workdir, extra)
    try:
        yield server
    finally:
        stop_server(server)


def _stop_all(signum: int, _frame: Any) -> None:
    for server in list(_RUNNING):
        stop_server(server)
    raise SystemExit(128 + signum)


def fetch(url: str, headers: dict[str, str] | None = None,
          timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


# --------------------------------------------------------------------------- the bare ceiling


def create_bare_app() -> Any:
    """The ceiling: a Flask app that answers from a dict of pre-rendered bodies.

    gunicorn runs it as ``index_bench:create_bare_app()`` with ``$INDEX_BENCH_BARE_PAGES``
    naming a JSON file of ``{path: [body, etag, mimetype]}``; it honours ``If-None-Match``
    the way any index must, and does nothing else.
    """
    from flask import Flask, Response, abort, request

    raw = json.loads(Path(os.environ[BARE_PAGES_ENV]).read_text())
    bodies: dict[str, tuple[bytes, str, str]] = {
        path: (body.encode("latin-1"), etag, mimetype)
        for path, (body, etag, mimetype) in raw.items()
    }
    app = Flask("index_bench_bare")

    @app.get("/<path:path>")
    def serve(path: str) -> Response:
        hit = bodies.get("/" + path)
        if hit is None:
            abort(404)
        body, etag, mimetype = hit
        headers = {"ETag": etag}
        if request.if_none_match.contains(etag.strip('"')):
            return Response(status=304, headers=headers)
        return Response(body, mimetype=mimetype, headers=headers)

    return app


# --------------------------------------------------------------------------- load


LUA = """\
local paths = {%(paths)s}
local etags = {%(etags)s}
local i = 0
request = function()
  i = i %% #paths + 1
  if #etags > 0 then
    return wrk.format("GET", paths[i], {["If-None-Match"] = etags[i]})
  end
  return wrk.format("GET", paths[i])
end
"""


@dataclass
class Result:
    server: str
    wheels: int
    scenario: str
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests: int = 0
    errors: int = 0
    cpu_us: float | None = None  # server CPU time per request, all its processes
    note: str = ""
    raw: str = field(default="", repr=False)
    rounds: list[dict[str, float | None]] = field(default_factory=list)


def _lua_list(items: Sequence[str]) -> str:
    return ", ".join(json.dumps(s) for s in items)  # JSON strings are valid Lua strings here


def _ms(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m)", text)
    if m is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[m.group(2)]
    return float(m.group(1)) * scale


def parse_wrk(output: str) -> dict[str, Any]:
    """Requests/s, p50, p99, request and error counts from ``wrk --latency`` output."""
    out: dict[str, Any] = {}
    m = re.search(r"^Requests/sec:\s+([0-9.]+)", output, re.M)
    out["rps"] = float(m.group(1)) if m else None
    for pct, key in (("50", "p50_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", output, re.M)
        out[key] = _ms(m.group(1)) if m else None
    m = re.search(r"^\s+(\d+) requests in", output, re.M)
    out["requests"] = int(m.group(1)) if m else 0
    errors = 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    if m:
        errors += sum(int(g) for g in m.groups())
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if m:
        errors += int(m.group(1))
    out["errors"] = errors
    return out


def run_wrk(url: str, paths: Sequence[str], etags: Sequence[str], args: argparse.Namespace,
            workdir: Path, duration: int) -> str:
    script = workdir / "load.lua"
    script.write_text(LUA % {"paths": _lua_list(paths), "etags": _lua_list(etags)})
    cmd = ["wrk", "-t", str(args.wrk_threads), "-c", str(args.connections),
           "-d", f"{duration}s", "--timeout", f"{args.wrk_timeout}s", "--latency",
           "-s", str(script), url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"wrk failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc.stdout


def server_cpu_seconds(server: Server) -> float:
    """User + system CPU time of the server's whole process tree so far."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def measure(server: Server, label: str, wheels: int, scenario: str, paths: Sequence[str],
            etags: Sequence[str], args: argparse.Namespace, workdir: Path,
            log: Any) -> Result:
    if args.warmup > 0:
        run_wrk(server.url, paths, etags, args, workdir, args.warmup)
    cpu_before = server_cpu_seconds(server)
    output = run_wrk(server.url, paths, etags, args, workdir, args.duration)
    cpu = server_cpu_seconds(server) - cpu_before
    parsed = parse_wrk(output)
    result = Result(label, wheels, scenario, parsed["rps"], parsed["p50_ms"], parsed["p99_ms"],
                    parsed["requests"], parsed["errors"], raw=output)
    if result.requests:
        result.cpu_us = 1e6 * cpu / result.requests
    log(f"  {label:<11} {scenario:<16} {_fmt(result.rps, 0):>8} req/s  "
        f"p50 {_fmt(result.p50_ms, 2)} ms  p99 {_fmt(result.p99_ms, 2)} ms  "
        f"server CPU {_fmt(result.cpu_us, 0)} µs/request"
        + (f"  ({result.errors} errors)" if result.errors else ""))
    return result


# --------------------------------------------------------------------------- scenarios


def page_etags(server: Server, paths: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Fetch every page once; check it and that revalidating it answers 304."""
    etags: list[str] = []
    bodies: dict[str, Any] = {}
    for path in paths:
        status, headers, body = fetch(server.url + path)
        if status != 200:
            raise SystemExit(f"{server.name}: GET {path} answered {status}")
        etag = headers.get("ETag", "")
        if etag:
            status, _, _ = fetch(server.url + path, {"If-None-Match": etag})
            if status != 304:
                raise SystemExit(f"{server.name}: revalidating {path} answered {status}")
        etags.append(etag)
        bodies[path] = (body.decode("latin-1"), etag, headers.get("Content-Type", "text/html"))
    return etags, bodies


def metadata_paths(catalog: Catalog) -> list[str]:
    """Up to ``METADATA_SAMPLE`` ``.metadata`` URLs, spread over every page."""
    per_page = max(1, METADATA_SAMPLE // len(catalog.pages))
    out: list[str] = []
    for page in catalog.pages:
        step = max(1, len(page.filenames) // per_page)
        out.extend(page.metadata_url(f) for f in page.filenames[::step][:per_page])
    return out


@dataclass
class Target:
    """A started server and what to load it with; ``None`` marks a scenario it cannot serve."""

    label: str
    wheels: int
    server: Server
    loads: dict[str, tuple[list[str], list[str]] | str]


def prepare_ours(catalog: Catalog, stack: contextlib.ExitStack, workdir: Path,
                 log: Any) -> tuple[Target, dict[str, Any]]:
    paths = [p.ours for p in catalog.pages]
    meta_paths = metadata_paths(catalog)
    env = {"WHEELHOUSE_STORAGE": str(catalog.root), "WHEELHOUSE_UPSTREAM": "off"}
    server = stack.enter_context(running(f"ours-{catalog.wheels}", "wheelhouse serve", env,
                                         workdir))
    started = time.monotonic()
    etags, bodies = page_etags(server, paths)
    log(f"ours @ {catalog.wheels} wheels: {len(paths)} pages checked "
        f"({time.monotonic() - started:.1f}s; the first request loads the catalog)")
    for path in meta_paths:
        status, headers, body = fetch(server.url + path)
        if status != 200 or not body.startswith(b"Metadata-Version"):
            raise SystemExit(f"ours: GET {path} answered {status}")
        bodies[path] = (body.decode("latin-1"), headers.get("ETag", ""),
                        headers.get("Content-Type", "text/plain"))
    target = Target("ours", catalog.wheels, server, {
        "project page": (paths, []),
        "304 revalidation": (paths, etags),
        ".metadata": (meta_paths, []),
    })
    return target, bodies


def prepare_pypiserver(catalog: Catalog, stack: contextlib.ExitStack, workdir: Path) -> Target:
    paths = [p.pypiserver for p in catalog.pages]
    app = f"pypiserver:app(root={str(catalog.flat)!r}, disable_fallback=True)"
    server = stack.enter_context(running(f"pypiserver-{catalog.wheels}", app, {}, workdir))
    status, headers, body = fetch(server.url + paths[0])
    links = body.count(b".whl#")
    if status != 200 or links != FILES_PER_PAGE:
        raise SystemExit(f"pypiserver: GET {paths[0]} answered {status} with {links} "
                         f"wheel links, expected {FILES_PER_PAGE}")
    loads: dict[str, tuple[list[str], list[str]] | str] = {"project page": (paths, [])}
    if headers.get("ETag"):
        etags, _ = page_etags(server, paths)
        loads["304 revalidation"] = (paths, etags)
    else:
        loads["304 revalidation"] = "n/a (no ETag)"
    loads[".metadata"] = "n/a (no PEP 658)"
    return Target("pypiserver", catalog.wheels, server, loads)


def prepare_bare(catalog: Catalog, bodies: dict[str, Any], stack: contextlib.ExitStack,
                 workdir: Path) -> Target:
    pages_file = workdir / f"bare-pages-{catalog.wheels}.json"
    pages_file.write_text(json.dumps(bodies))
    paths = [p.ours for p in catalog.pages]
    server = stack.enter_context(running(
        f"bare-{catalog.wheels}", "index_bench:create_bare_app()",
        {BARE_PAGES_ENV: str(pages_file)}, workdir,
        ["--pythonpath", str(Path(__file__).resolve().parent)]))
    etags, bare_bodies = page_etags(server, paths)
    if any(bare_bodies[p][0] != bodies[p][0] for p in paths):
        raise SystemExit("bare Flask pages differ from ours")
    return Target("bare Flask", catalog.wheels, server, {
        "project page": (paths, []),
        "304 revalidation": (paths, etags),
        ".metadata": (metadata_paths(catalog), []),
    })


def median(values: Sequence[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    mid = len(present) // 2
    return present[mid] if len(present) % 2 else (present[mid - 1] + present[mid]) / 2


def run_rounds(targets: Sequence[Target], args: argparse.Namespace, workdir: Path,
               log: Any) -> list[Result]:
    """Every scenario on every server, interleaved, ``--rounds`` times; medians per row.

    Interleaving spreads whatever else the machine is doing over every server alike.
    """
    runs: dict[tuple[str, int, str], list[Result]] = {}
    notes: dict[tuple[str, int, str], str] = {}
    for rnd in range(args.rounds):
        if args.rounds > 1:
            log(f"round {rnd + 1}/{args.rounds}")
        for scenario in SCENARIOS:
            for t in targets:
                load = t.loads.get(scenario)
                key = (t.label, t.wheels, scenario)
                if isinstance(load, str):
                    notes[key] = load
                    continue
                if load is None:
                    continue
                paths, etags = load
                runs.setdefault(key, []).append(
                    measure(t.server, t.label, t.wheels, scenario, paths, etags, args,
                            workdir, log))
    results: list[Result] = []
    for t in targets:
        for scenario in SCENARIOS:
            key = (t.label, t.wheels, scenario)
            if key in notes:
                results.append(Result(t.label, t.wheels, scenario, note=notes[key]))
            elif key in runs:
                rs = runs[key]
                results.append(Result(
                    t.label, t.wheels, scenario, median([r.rps for r in rs]),
                    median([r.p50_ms for r in rs]), median([r.p99_ms for r in rs]),
                    sum(r.requests for r in rs), sum(r.errors for r in rs),
                    cpu_us=median([r.cpu_us for r in rs]),
                    rounds=[{"rps": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms,
                             "cpu_us": r.cpu_us} for r in rs]))
    return results


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def table(results: Sequence[Result]) -> str:
    ceiling = {(r.wheels, r.scenario): r.rps for r in results
               if r.server == "bare Flask" and r.rps}
    lines = ["| server | wheels | requests | req/s | p50 ms | p99 ms | vs bare Flask "
             "| server CPU µs/req | errors |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base = ceiling.get((r.wheels, r.scenario)) or next(
            (v for (_, s), v in ceiling.items() if s == r.scenario), None)
        share = "n/a" if r.rps is None or base is None else f"{100 * r.rps / base:.0f}%"
        rps = _fmt(r.rps, 0) if r.rps is not None else (r.note or "n/a")
        lines.append(f"| {r.server} | {r.wheels:,} | {r.scenario} | {rps} | "
                     f"{_fmt(r.p50_ms, 2)} | {_fmt(r.p99_ms, 2)} | {share} | {_fmt(r.cpu_us, 0)} | "
                     f"{r.errors} |")
    return "\n".join(lines)


def verdict(results: Sequence[Result], wheels_runs: Sequence[int]) -> list[str]:
    """The issue's targets, each with its measured figure."""
    out: list[str] = []
    ceiling = next((r for r in results if r.server == "bare Flask"
                    and r.scenario == "project page"), None)
    for r in results:
        if r.server != "ours" or r.scenario != "project page" or r.rps is None:
            continue
        if ceiling and ceiling.rps:
            share = r.rps / ceiling.rps
            out.append(f"- {r.wheels:,} wheels: project pages at {100 * share:.0f}% of the bare "
                       f"Flask ceiling (target ≥ 80%): {'met' if share >= 0.8 else 'MISSED'}")
        if r.p99_ms is not None:
            out.append(f"- {r.wheels:,} wheels: project page p99 {r.p99_ms:.1f} ms (target < 30 "
                       f"ms): {'met' if r.p99_ms < 30 else 'MISSED'}")
    ours = {r.wheels: r for r in results if r.server == "ours" and r.scenario == "project page"}
    if len(wheels_runs) > 1 and all(w in ours and ours[w].rps for w in wheels_runs):
        small, large = ours[min(wheels_runs)], ours[max(wheels_runs)]
        ratio = (large.rps or 0) / (small.rps or 1)
        same = "met" if abs(1 - ratio) <= 0.15 else "MISSED"
        out.append(f"- {large.wheels:,} vs {small.wheels:,} wheels: {100 * ratio:.0f}% of the "
                   f"requests/s (same within ±15%: {same})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--wheels", type=int, default=5000)
    parser.add_argument("--variants", type=int, default=50)
    parser.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="seconds before each (0: none)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every row this many times, interleaved; report medians")
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--wrk-timeout", type=int, default=30,
                        help="seconds before wrk counts a request as timed out")
    parser.add_argument("--scale", action="store_true",
                        help="also measure our server over a catalog ten times as large")
    parser.add_argument("--only-ours", action="store_true",
                        help="skip pypiserver and the bare Flask ceiling")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--workdir", type=Path,
                        help="keep catalogs and logs here and reuse them (default: a temp dir)")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is required (apt-get install wrk)")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, _stop_all)
    signal.signal(signal.SIGINT, _stop_all)
    keep = args.workdir is not None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="index-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    wheel_runs = [args.wheels] + ([args.wheels * 10] if args.scale else [])
    load_before = os.getloadavg()
    results: list[Result] = []
    try:
        catalogs = []
        for wheels in wheel_runs:
            catalog = build_catalog(workdir / f"catalog-{wheels}-{args.variants}", wheels,
                                    args.variants, log)
            check_catalog(catalog)
            catalogs.append(catalog)
        with contextlib.ExitStack() as stack:
            targets: list[Target] = []
            for n, catalog in enumerate(catalogs):
                ours, bodies = prepare_ours(catalog, stack, workdir, log)
                targets.append(ours)
                if n == 0 and not args.only_ours:
                    targets.append(prepare_pypiserver(catalog, stack, workdir))
                    targets.append(prepare_bare(catalog, bodies, stack, workdir))
            results = run_rounds(targets, args, workdir, log)
    finally:
        for server in list(_RUNNING):
            stop_server(server)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    # Sort: 5k rows grouped by scenario, then the large catalog.
    order = {"project page": 0, "304 revalidation": 1, ".metadata": 2}
    servers = {"ours": 0, "pypiserver": 1, "bare Flask": 2}
    results.sort(key=lambda r: (r.wheels, order[r.scenario], servers[r.server]))
    cmd = "python bench/index_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"`{cmd.strip()}` — {os.cpu_count()} cores shared by wrk "
              f"({args.wrk_threads} thread) and the server; gunicorn "
              f"{' '.join(GUNICORN_ARGS[:6])}; {args.connections} connections, "
              f"{args.duration}s per row, median of {args.rounds} round(s); "
              f"{args.variants} variants, {FILES_PER_PAGE} files a page; load average before "
              f"{load_before[0]:.2f}")
    print(header + "\n")
    print(table(results))
    print()
    print("\n".join(verdict(results, wheel_runs)))
    if args.json:
        args.json.write_text(json.dumps({
            "command": cmd.strip(),
            "cores": os.cpu_count(),
            "gunicorn": GUNICORN_ARGS,
            "connections": args.connections,
            "duration_s": args.duration,
            "variants": args.variants,
            "files_per_page": FILES_PER_PAGE,
            "load_average_before": load_before,
            "results": [{k: v for k, v in asdict(r).items() if k != "raw"} for r in results],
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
