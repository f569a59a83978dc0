"""Download benchmark: one big wheel through wheelhouse, nginx and pypiserver, in one run.

    python bench/download_bench.py [--size-mib 192] [--clients 1,8,32] [--json out.json]
                                   [--workdir DIR]

One generated wheel (random payload, so its size is its stored size) is served on loopback by:

- **wheelhouse local**: ``wheelhouse serve`` over a storage directory (gunicorn, 2 gthread
  workers x 4 threads, no access log): the file goes to gunicorn's ``sendfile``;
- **wheelhouse S3 stream**: the same over moto's S3 server (``WHEELHOUSE_S3_FILE_MODE=stream``):
  every byte passes through the web;
- **wheelhouse S3 redirect**: the same with ``redirect``: the web answers 302 to a presigned URL
  and the client fetches from S3;
- **wheelhouse behind nginx (X-Accel-Redirect)**: nginx in front of ``wheelhouse serve`` with
  ``WHEELHOUSE_LOCAL_FILE_MODE=x-accel-redirect``: nginx sends the file;
- **nginx**: ``sendfile on``, serving the file from a directory (the reference);
- **pypiserver**: serving the same file (a hard link) under the same gunicorn settings.

For each of ``--clients`` (1, 8 and 32 concurrent ``curl`` processes; at least 8 downloads per
cell, one per client where there are more), it reports throughput (MB/s, 10^6 bytes, over the
cell's wall time) and the server's CPU seconds per GB (10^9 bytes) served: user + system time of
every process of the server's tree (``psutil``), before and after the cell. Rows through S3 also
give the S3 server's (moto's) own CPU per GB, which is S3's cost, not the index's. Every download
is checked for its status and length; one download from each server is checked by sha256.

The machine's load average is printed before and after: other load shows in MB/s far more than
in CPU per GB. Every server runs in its own process group and is stopped by it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers import free_port, own_session  # noqa: E402

VARIANT = "torch2.14-cu130"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
GUNICORN_ARGS = ["-w", "2", "-k", "gthread", "--threads", "4", "--graceful-timeout", "5",
                 "--timeout", "300", "--no-control-socket"]
ACCEL_PREFIX = "/_wheelhouse_storage/"
MIN_DOWNLOADS = 8


# --------------------------------------------------------------------------- processes


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def running(name: str, cmd: Sequence[str], workdir: Path, env: dict[str, str] | None = None,
            port: int | None = None) -> Iterator[Server]:
    """``cmd`` in its own session, until the block ends; waits until ``port`` accepts."""
    port = port or free_port()
    log = workdir / f"{name}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    argv = [c.replace("{port}", str(port)) for c in cmd]
    with own_session(argv, log, env=full_env, cwd=workdir, grace=10) as proc:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} does not listen after 60s")
            time.sleep(0.05)
        yield Server(name, port, proc, log)


def tree_cpu_seconds(proc: subprocess.Popen[bytes]) -> float:
    """User + system CPU of the process and all its descendants (living ones)."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def wheelhouse_cmd() -> list[str]:
    return [sys.executable, "-c", "from wheelhouse.cli.main import run; run()", "serve",
            "--host", "127.0.0.1", "--port", "{port}", "--workers", "2", "--threads", "4",
            # The worker class the figures in docs/downloads.md were measured with; `serve`'s
            # default is gevent's since issue 26 (its sendfile path is the kernel's too).
            "--worker-class", "gthread", "--no-access-log"]


# --------------------------------------------------------------------------- the wheel


def make_big_wheel(directory: Path, size_mib: int) -> Path:
    """A complete wheel whose payload is random (incompressible), ``size_mib`` MiB."""
    from tests.helpers import make_wheel
    from wheelhouse.variants import parse_variant

    label = parse_variant(VARIANT).local_label
    existing = list(directory.glob("*.whl"))
    if existing and abs(existing[0].stat().st_size - size_mib * 2**20) < 2**20:
        return existing[0]
    for old in existing:
        old.unlink()
    return make_wheel(directory, "bench-big", f"1.0+{label}",
                      payload=os.urandom(size_mib * 2**20))


def publish_to(config: Any, wheel: Path) -> Any:
    from wheelhouse.index.publish import publish
    from wheelhouse.index.storage import open_storage
    from wheelhouse.variants import parse_variant

    return publish(open_storage(config), wheel, parse_variant(VARIANT))


# --------------------------------------------------------------------------- nginx


NGINX_CONF = """\
{user}
worker_processes 2;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 30;
    types {{ application/octet-stream whl; }}
    default_type application/octet-stream;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location /files/ {{ alias {flat}/; }}
    }}
    server {{
        listen 127.0.0.1:{accel_port};
        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_set_header Host $http_host;
            proxy_buffering on;
        }}
        location {accel_prefix} {{
            internal;
            alias {storage}/;
            etag off;
            add_header ETag $upstream_http_etag;
            add_header Cache-Control $upstream_http_cache_control;
        }}
    }}
}}
"""


def nginx_config(workdir: Path, flat: Path, storage: Path, port: int, accel_port: int,
                 upstream_port: int) -> Path:
    conf = workdir / "nginx.conf"
    # As root, nginx's workers would otherwise drop to nobody, who can't read the temp dir.
    user = "user root;" if os.geteuid() == 0 else ""
    conf.write_text(NGINX_CONF.format(user=user, dir=workdir, port=port, flat=flat,
                                      accel_port=accel_port, upstream_port=upstream_port,
                                      accel_prefix=ACCEL_PREFIX, storage=storage))
    return conf


# --------------------------------------------------------------------------- load


@dataclass
class Cell:
    server: str
    clients: int
    downloads: int
    bytes: int
    seconds: float
    mb_s: float
    cpu_s_per_gb: float
    s3_cpu_s_per_gb: float | None = None
    errors: list[str] = field(default_factory=list)


def download_all(url: str, clients: int, size: int, follow: bool) -> tuple[float, int,
                                                                           list[str]]:
    """``clients`` concurrent curl processes, together at least MIN_DOWNLOADS downloads of
    ``url``; returns the wall time, the bytes received and what went wrong."""
    downloads = max(clients, MIN_DOWNLOADS)
    per_client = [downloads // clients + (1 if i < downloads % clients else 0)
                  for i in range(clients)]
    procs = []
    started = time.monotonic()
    for n in per_client:
        cmd = ["curl", "-s", "-w", "%{http_code} %{size_download}\\n"]
        if follow:
            cmd.append("-L")
        for _ in range(n):
            cmd += ["-o", "/dev/null", url]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    received, errors = 0, []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        for line in out.decode().split("\n"):
            if not line:
                continue
            status, got = line.split()
            received += int(got)
            if status not in ("200",) or int(got) != size:
                errors.append(f"HTTP {status}, {got} bytes")
        if proc.returncode:
            errors.append(f"curl exited {proc.returncode}: {err.decode()[-200:]}")
    return time.monotonic() - started, received, errors


def check_once(url: str, sha256: str, follow: bool) -> None:
    """One download, hashed: the server serves the right bytes."""
    cmd = ["curl", "-s", "-f", *(["-L"] if follow else []), url]
    digest = hashlib.sha256()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(2**20):
            digest.update(chunk)
    if proc.returncode or digest.hexdigest() != sha256:
        raise SystemExit(f"{url}: curl exited {proc.returncode}, sha256 "
                         f"{digest.hexdigest()[:12]}… (expected {sha256[:12]}…)")


def index_bytes_of_a_redirect(url: str) -> int:
    """One request not followed: the index must answer 302 (to S3) and send no wheel bytes;
    returns the size of the body it sent."""
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download}",
                          url], capture_output=True, text=True, timeout=60, check=False).stdout
    status, body = out.split()
    if status != "302" or int(body) > 1024:
        raise SystemExit(f"{url}: redirect mode answered HTTP {status} with {body} bytes")
    return int(body)


def check_accel(url: str, sha256: str, size: int) -> None:
    """Through nginx's X-Accel-Redirect: a range is nginx's to answer, with wheelhouse's ETag and
    Cache-Control; a matching If-None-Match is wheelhouse's 304."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Range": "bytes=100-199"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        body, headers, status = resp.read(), resp.headers, resp.status
    problems = []
    if status != 206 or len(body) != 100:
        problems.append(f"range: HTTP {status}, {len(body)} bytes")
    if headers.get("Content-Range") != f"bytes 100-199/{size}":
        problems.append(f"Content-Range {headers.get('Content-Range')!r}")
    if headers.get("ETag") != f'"{sha256}"':
        problems.append(f"ETag {headers.get('ETag')!r}")
    if "immutable" not in (headers.get("Cache-Control") or ""):
        problems.append(f"Cache-Control {headers.get('Cache-Control')!r}")
    if "X-Accel-Redirect" in headers:
        problems.append("X-Accel-Redirect reached the client")
    try:
        urllib.request.urlopen(urllib.request.Request(
            url, headers={"If-None-Match": f'"{sha256}"'}), timeout=60)
        problems.append("If-None-Match: not a 304")
    except urllib.error.HTTPError as exc:
        if exc.code != 304:
            problems.append(f"If-None-Match: HTTP {exc.code}")
    if problems:
        raise SystemExit(f"{url} through nginx: " + "; ".join(problems))


def measure(name: str, url: str, servers: Sequence[subprocess.Popen[bytes]],
            s3: subprocess.Popen[bytes] | None, clients: int, size: int, follow: bool,
            log: Any) -> Cell:
    cpu0 = sum(tree_cpu_seconds(p) for p in servers)
    s3_0 = tree_cpu_seconds(s3) if s3 is not None else 0.0
    seconds, received, errors = download_all(url, clients, size, follow)
    cpu = sum(tree_cpu_seconds(p) for p in servers) - cpu0
    s3_cpu = tree_cpu_seconds(s3) - s3_0 if s3 is not None else None
    gb = received / 1e9
    cell = Cell(name, clients, max(clients, MIN_DOWNLOADS), received, round(seconds, 2),
                round(received / 1e6 / seconds, 1), round(cpu / gb, 3) if gb else 0.0,
                round(s3_cpu / gb, 3) if s3_cpu is not None and gb else None, errors[:5])
    log(f"  {name:<46} {clients:>3} clients: {cell.mb_s:>8.1f} MB/s, "
        f"{cell.cpu_s_per_gb:.3f} CPU s/GB"
        + (f" (S3 server {cell.s3_cpu_s_per_gb:.3f})" if cell.s3_cpu_s_per_gb is not None
           else "") + (f"  ERRORS: {errors[:3]}" if errors else ""))
    return cell


# --------------------------------------------------------------------------- the run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=192)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--skip", default="", help="comma-separated rows to leave out "
                        "(local, python-copy, accel, nginx, pypiserver, s3-stream, s3-redirect)")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    for tool in ("curl", *(["nginx"] if not {"nginx", "accel"} <= skip else [])):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not on PATH (apt-get install {tool}-light / {tool})")

    from wheelhouse.config import Config

    def log(msg: str) -> None:
        print(msg, flush=True)

    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="download-bench-")) if own else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    log(f"download bench: {args.size_mib} MiB wheel, clients {clients}, "
        f"{psutil.cpu_count()} CPUs, load average {load_before[0]:.2f} {load_before[1]:.2f} "
        f"{load_before[2]:.2f}")
    cells: list[Cell] = []
    try:
        wheel = make_big_wheel(workdir / "wheel", args.size_mib)
        size = wheel.stat().st_size
        storage = workdir / "storage"
        shutil.rmtree(storage, ignore_errors=True)
        local = Config(storage=str(storage), upstream="off")
        record = publish_to(local, wheel)
        flat = workdir / "flat"
        shutil.rmtree(flat, ignore_errors=True)
        flat.mkdir()
        os.link(storage / record.wheel_key, flat / record.filename)
        from wheelhouse.variants import parse_variant

        path = f"/files/{parse_variant(VARIANT).base.key}/{record.project}/{record.filename}"

        def run_rows(name: str, url: str, servers: Sequence[subprocess.Popen[bytes]],
                     s3: subprocess.Popen[bytes] | None = None, follow: bool = False) -> None:
            check_once(url, record.sha256, follow)
            if follow:
                log(f"  {name}: the index answered 302 with a {index_bytes_of_a_redirect(url)}-"
                    "byte body (no wheel bytes); the clients followed it to S3")
            for c in clients:
                cells.append(measure(name, url, servers, s3, c, size, follow, log))

        if "local" not in skip:
            with running("wheelhouse-local", wheelhouse_cmd(), workdir,
                         local.to_env()) as srv:
                run_rows("wheelhouse local (sendfile)", srv.url + path, [srv.proc])
        if "python-copy" not in skip:
            # gunicorn's own switch: its file wrapper is then iterated, 1 MiB reads and writes
            # in Python, which is what every download cost before the file wrapper was used.
            with running("wheelhouse-copy", wheelhouse_cmd(), workdir,
                         {**local.to_env(), "SENDFILE": "0"}) as srv:
                run_rows("wheelhouse local, SENDFILE=0 (Python copies)", srv.url + path,
                         [srv.proc])
        if "nginx" not in skip or "accel" not in skip:
            nginx_port, accel_port, upstream_port = free_port(), free_port(), free_port()
            conf = nginx_config(workdir, flat, storage, nginx_port, accel_port, upstream_port)
            accel = local.replace(local_file_mode="x-accel-redirect",
                                  accel_redirect_prefix=ACCEL_PREFIX)
            with running("nginx", ["nginx", "-p", str(workdir), "-c", str(conf)], workdir,
                         port=nginx_port) as ngx, \
                    running("wheelhouse-accel", wheelhouse_cmd(), workdir, accel.to_env(),
                            port=upstream_port) as upstream:
                if "nginx" not in skip:
                    run_rows("nginx (sendfile)", f"{ngx.url}/files/{record.filename}",
                             [ngx.proc])
                if "accel" not in skip:
                    check_accel(f"http://127.0.0.1:{accel_port}{path}", record.sha256, size)
                    run_rows("wheelhouse behind nginx (X-Accel)",
                             f"http://127.0.0.1:{accel_port}{path}", [ngx.proc, upstream.proc])
        if "pypiserver" not in skip:
            app = f"pypiserver:app(root={str(flat)!r}, disable_fallback=True)"
            with running("pypiserver", [sys.executable, "-m", "gunicorn", *GUNICORN_ARGS,
                                        "-b", "127.0.0.1:{port}", app], workdir) as pps:
                run_rows("pypiserver (gunicorn)", f"{pps.url}/packages/{record.filename}",
                         [pps.proc])
        if not {"s3-stream", "s3-redirect"} <= skip:
            s3_port = free_port()
            with running("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                  "-p", str(s3_port)], workdir, AWS_ENV, port=s3_port) as s3:
                s3_config = Config(storage="s3://bench/idx", upstream="off",
                                   s3_endpoint_url=s3.url)
                os.environ.update(AWS_ENV)
                from wheelhouse.index.storage import make_s3_client

                make_s3_client(s3_config).create_bucket(Bucket="bench")
                publish_to(s3_config, wheel)
                for mode in ("stream", "redirect"):
                    if f"s3-{mode}" in skip:
                        continue
                    config = s3_config.replace(s3_file_mode=mode)
                    with running(f"wheelhouse-s3-{mode}", wheelhouse_cmd(), workdir,
                                 {**AWS_ENV, **config.to_env()}) as srv:
                        run_rows(f"wheelhouse S3 {mode}", srv.url + path, [srv.proc], s3.proc,
                                 follow=mode == "redirect")
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()
    log(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    log("")
    log(table(cells))
    if args.json:
        args.json.write_text(json.dumps({
            "size_bytes": size, "clients": clients, "cpus": psutil.cpu_count(),
            "load_before": load_before, "load_after": load_after,
            "cells": [asdict(c) for c in cells]}, indent=2))
    return 1 if any(c.errors for c in cells) else 0


def table(cells: Sequence[Cell]) -> str:
    """A Markdown table: one row per server, MB/s and CPU s/GB per client count."""
    counts = sorted({c.clients for c in cells})
    names = list(dict.fromkeys(c.server for c in cells))
    head = "| server | " + " | ".join(f"{n} clients MB/s | CPU s/GB" for n in counts) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(counts)]
    for name in names:
        row = [f"| {name} |"]
        for n in counts:
            cell = next((c for c in cells if c.server == name and c.clients == n), None)
            if cell is None:
                row.append(" | |")
                continue
            cpu = f"{cell.cpu_s_per_gb:.3f}"
            if cell.s3_cpu_s_per_gb is not None:
                cpu += f" (+S3 {cell.s3_cpu_s_per_gb:.2f})"
            row.append(f" {cell.mb_s:,.0f} | {cpu} |")
        lines.append("".join(row))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
