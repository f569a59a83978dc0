"""Pull-through cache benchmark: one large wheel direct from an upstream, then through the
index's cache the first time (streamed from the upstream and kept) and the second time (from
storage, gunicorn's sendfile), in one run.

    python bench/mirror_bench.py [--size-mib 512] [--rounds 3] [--json out.json]

The upstream is Python's ``http.server`` over a directory that looks like PyTorch's index
(``whl/cu130/torch/index.html`` with an absolute link and the sha256). The index is
``wheelhouse serve`` (its default worker class, 2 workers) over local storage, routing torch to
that upstream. Each round starts with an empty cache. For each step it reports wall time,
MB/s (10^6 bytes) and CPU seconds per GB (10^9 bytes) of the index's process tree and of the
upstream's, from ``psutil`` before and after (the first download's include keeping the file,
which the index does after the last byte); every download is checked by sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.download_bench import tree_cpu_seconds  # noqa: E402
from tests.helpers import free_port, make_wheel, stop_group, wait_for_port  # noqa: E402

ROOT = "torch2.14-cu130"


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc, grace=20)


def _get(url: str, sha256: str, size: int) -> float:
    started = time.monotonic()
    done = subprocess.run(["curl", "-sf", "-o", "-", url], capture_output=True, check=True)
    wall = time.monotonic() - started
    if len(done.stdout) != size or hashlib.sha256(done.stdout).hexdigest() != sha256:
        raise SystemExit(f"{url}: wrong bytes")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    # A SIGTERM (timeout(1), kill) unwinds like Ctrl-C, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="wheelhouse-mirror-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_dir = tmp / "upstream" / "whl" / "cu130"
        wheel = make_wheel(up_dir, "torch", "2.14.1+cu130",
                           payload=os.urandom(opts.size_mib * 1024**2))
        size = wheel.stat().st_size
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        (up_dir / "torch").mkdir()
        (up_dir / "torch" / "index.html").write_text(
            f'<a href="{upstream}/whl/cu130/{wheel.name.replace("+", "%2B")}#sha256={sha}">'
            f"{wheel.name}</a>\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
        procs.append(up := _start([sys.executable, "-m", "http.server", str(up_port), "--bind",
                                   "127.0.0.1", "--directory", str(tmp / "upstream")],
                                  env, tmp / "upstream.log"))
        wait_for_port(up_port)
        rows: dict[str, list[tuple[float, float, float]]] = {
            "direct from the upstream": [], "first, through the cache": [],
            "second, from the cache": []}
        for n in range(opts.rounds):
            port = free_port()
            storage = tmp / f"data-{n}"
            index_env = {**env, "WHEELHOUSE_STORAGE": str(storage),
                         "WHEELHOUSE_UPSTREAM_RULES": f"torch={upstream}/whl/{{cu}}/",
                         "WHEELHOUSE_CACHE_SPOOL": str(tmp / "spool"),
                         "PYTHONPATH": str(REPO)}
            index = _start([sys.executable, "-c", "from wheelhouse.cli.main import run; run()",
                            "serve", "--host", "127.0.0.1", "--port", str(port),
                            "--workers", "2"], index_env, tmp / f"index-{n}.log")
            procs.append(index)
            wait_for_port(port, timeout=60)
            page = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/{ROOT}/simple/torch/"],
                                  capture_output=True, text=True, check=True).stdout
            link = page.split('href="')[1].split("#")[0]
            steps = [("direct from the upstream", f"{upstream}/whl/cu130/{wheel.name}"),
                     ("first, through the cache", f"http://127.0.0.1:{port}{link}"),
                     ("second, from the cache", f"http://127.0.0.1:{port}{link}")]
            kept = storage / "mirror" / "files" / sha / wheel.name
            for name, url in steps:
                cpu_index, cpu_up = tree_cpu_seconds(index), tree_cpu_seconds(up)
                wall = _get(url, sha, size)
                # The index keeps the file after its last byte: its CPU for the first
                # download includes that, and the second starts once it is done.
                deadline = time.monotonic() + 120
                while url.startswith(f"http://127.0.0.1:{port}") and not kept.exists():
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the index did not keep {wheel.name}")
                    time.sleep(0.01)
                time.sleep(0.2)  # the spool file is removed after the store
                rows[name].append((wall, tree_cpu_seconds(index) - cpu_index,
                                   tree_cpu_seconds(up) - cpu_up))
            _stop(index)
            shutil.rmtree(storage)
        gb = size / 1e9
        print(f"{size / 1e6:.0f} MB wheel, {opts.rounds} rounds, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.2f}; medians")
        print(f"{'download':<28}{'wall s':>8}{'MB/s':>8}{'index CPU s/GB':>16}"
              f"{'upstream CPU s/GB':>19}")
        report = {}
        for name, values in rows.items():
            wall, cpu_i, cpu_u = (sorted(v[i] for v in values)[len(values) // 2]
                                  for i in range(3))
            report[name] = {"wall_s": wall, "mb_per_s": size / 1e6 / wall,
                            "index_cpu_s_per_gb": cpu_i / gb, "upstream_cpu_s_per_gb": cpu_u / gb}
            print(f"{name:<28}{wall:>8.2f}{size / 1e6 / wall:>8.0f}{cpu_i / gb:>16.2f}"
                  f"{cpu_u / gb:>19.2f}")
        if opts.json:
            opts.json.write_text(json.dumps({"size_bytes": size, "rounds": opts.rounds,
                                             "results": report}, indent=1))
    finally:
        for proc in procs:
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
