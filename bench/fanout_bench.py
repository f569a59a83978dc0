"""Split-arch bench (issue 20): one request for two GPU architectures, built as one job and as
one job per architecture, on two real workers; the makespans and their ratio.

Everything is real: a redis-server, ``wheelhouse serve`` (gunicorn) over local storage, two
``wheelhouse worker`` processes with their own workspaces, and sandboxed builds of a real CUDA
extension (``examples/vecadd-0.1.0``: a kernel and its torch bindings) compiled by real nvcc
against torch 2.14.1 (CUDA 13.0) from the local wheels. The sdist is uploaded through the API
(``PUT /api/sources``) and both requests are made through ``POST /api/builds``, the first with
``"split_archs": true``, the second with ``false`` (in that order: the one-job wheel holds both
archs, so the ``-smXX`` roots would list it and the split request would find nothing to build);
the two make different wheels (``-sm80`` and ``-sm90``, then ``-sm80-sm90``), and the compile
cache is off, so neither run reuses the other's compiles. A makespan is RQ's own: the last
part's end minus the request's first enqueue.

On one host the two workers share its cores; ``--pin`` gives each worker its own share of them
(``taskset``), as two hosts would have, which is what the fan-out is for. Without it, the ratio
says how much one host gains from running the two architectures' compiles side by side.

    python bench/fanout_bench.py [--archs 80 90] [--pin] [--workdir DIR] [--json out.json]
                                 [--sdist PATH | --kernels N]

Uses every core of the machine for minutes; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
import requests
from packaging.utils import parse_sdist_filename

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import free_port, own_session, wait_for_port  # noqa: E402
from wheelhouse.builds.queue import fetch_job  # noqa: E402
from wheelhouse.config import Config  # noqa: E402
from wheelhouse.index.tokens import create_token  # noqa: E402

EXAMPLE = ROOT / "examples" / "vecadd-0.1.0"
TORCH_FIND_LINKS = os.environ.get("WHEELHOUSE_TEST_TORCH_FIND_LINKS", "/opt/pypi-more/files")


@contextlib.contextmanager
def _process(argv: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session, stopped by its process group (SIGTERM twice: a warm then a
    cold worker shutdown; then SIGKILL)."""
    with own_session(argv, log, env=env, grace=30,
                     signals=(signal.SIGTERM, signal.SIGTERM, signal.SIGKILL)) as proc:
        yield proc


def _sdist(dest: Path, kernels: int = 0) -> Path:
    """The vecadd example as an sdist; with ``kernels``, vecadd 0.2.0: the example plus that
    many generated kernel files (``bench/sccache_bench.py``'s templated kernel, 24
    instantiations each), so that nvcc's time per architecture outweighs a job's fixed cost."""
    if not kernels:
        path = dest / "vecadd-0.1.0.tar.gz"
        with tarfile.open(path, "w:gz") as tf:
            tf.add(EXAMPLE, arcname="vecadd-0.1.0",
                   filter=lambda i: None if "__pycache__" in i.name else i)
        return path
    from sccache_bench import write_kernels  # only for --kernels

    tree = dest / "vecadd-0.2.0"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(EXAMPLE, tree, ignore=shutil.ignore_patterns("__pycache__"))
    sources = ["csrc/bindings.cpp", "csrc/add.cu", *write_kernels(tree, kernels)]
    setup = (tree / "setup.py").read_text()
    setup = setup.replace('version="0.1.0"', 'version="0.2.0"').replace(
        '["csrc/bindings.cpp", "csrc/add.cu"]', repr(sources))
    (tree / "setup.py").write_text(setup)
    info = tree / "PKG-INFO"
    info.write_text(info.read_text().replace("Version: 0.1.0", "Version: 0.2.0"))
    path = dest / "vecadd-0.2.0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        tf.add(tree, arcname="vecadd-0.2.0")
    return path


def _cpu_sets(workers: int) -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // workers)
    return [",".join(str(c) for c in cpus[i * share:(i + 1) * share] or cpus[-1:])
            for i in range(workers)]


def _makespan(conn: redis.Redis, job_ids: list[str]) -> dict[str, Any]:
    jobs = [fetch_job(conn, j) for j in job_ids]
    assert all(j is not None for j in jobs)
    starts = [j.enqueued_at for j in jobs if j is not None]
    ends = [j.ended_at for j in jobs if j is not None]
    if None in starts or None in ends:
        raise SystemExit(f"a job has no times: {job_ids}")
    first, last = min(s for s in starts if s), max(e for e in ends if e)
    return {"seconds": round((last - first).total_seconds(), 1),
            "jobs": {j.id: {"worker": j.worker_name,
                            "seconds": round((j.ended_at - j.started_at).total_seconds(), 1)
                            if j.ended_at and j.started_at else None}
                     for j in jobs if j is not None}}


def _request(url: str, headers: dict[str, str], body: dict[str, Any], conn: redis.Redis,
             timeout: float) -> dict[str, Any]:
    resp = requests.post(f"{url}/api/builds", json=body, headers=headers, timeout=60)
    if resp.status_code != 201:
        raise SystemExit(f"the request was refused: {resp.status_code} {resp.text}")
    [build] = resp.json()["builds"]
    ids = [p["id"] for p in build["parts"]] if "parts" in build else [build["id"]]
    deadline = time.monotonic() + timeout
    while True:
        view = requests.get(f"{url}/api/builds/{build['id']}", headers=headers,
                            timeout=30).json()
        if view["finished"]:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{build['id']} did not finish in {timeout} s")
        time.sleep(2)
    if view["state"] != "built":
        raise SystemExit(f"{build['id']} ended {view['state']}: {json.dumps(view)[:2000]}")
    return {"id": build["id"], **_makespan(conn, ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs=2, default=["80", "90"])
    parser.add_argument("--pin", action="store_true",
                        help="give each worker its own share of this host's cores (taskset)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sdist", type=Path, default=None,
                        help="another sdist to build (name-version.tar.gz); default: "
                             "examples/vecadd-0.1.0")
    parser.add_argument("--kernels", type=int, default=0,
                        help="build vecadd 0.2.0: the example plus N generated kernel files")
    args = parser.parse_args()
    for tool in ("redis-server", "nvcc", "bwrap", "wheelhouse"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not on PATH")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fanout-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    redis_port, index_port = free_port(), free_port()
    config = Config(storage=str(work / "data"), workspace=str(work / "work-index"),
                    redis_url=f"redis://127.0.0.1:{redis_port}/0", upstream="off",
                    torch_check=False, torch_index_url="", torch_find_links=TORCH_FIND_LINKS,
                    compile_cache=False, worker_heartbeat_seconds=1,
                    catalog_refresh_seconds=0.5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    cuda_home = str(Path(shutil.which("nvcc") or "").resolve().parent.parent)
    (work / "redis").mkdir(exist_ok=True)
    cpu_sets = _cpu_sets(2)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_process(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(work / "redis")], work / "redis.log", env))
        wait_for_port(redis_port, timeout=60)
        conn = redis.Redis(port=redis_port)
        headers = {"Authorization": f"Bearer {create_token(conn, 'bench')}"}
        stack.enter_context(_process(
            ["wheelhouse", "serve", "--host", "127.0.0.1", "--port", str(index_port),
             "--workers", "2"], work / "index.log", env | config.to_env()))
        wait_for_port(index_port, timeout=60)
        url = f"http://127.0.0.1:{index_port}"
        for name, cpus in zip(("a", "b"), cpu_sets, strict=True):
            worker_env = env | replace(config, workspace=str(work / f"work-{name}")).to_env()
            argv = ["wheelhouse", "worker", "--name", f"bench-{name}", "--cuda", "13.0"]
            if args.pin:
                argv = ["taskset", "-c", cpus, *argv]
            stack.enter_context(_process(argv, work / f"worker-{name}.log",
                                         worker_env | {"CUDA_HOME": cuda_home}))
        deadline = time.monotonic() + 120
        while len(requests.get(f"{url}/api/workers", timeout=10).json()["workers"]) < 2:
            if time.monotonic() > deadline:
                sys.exit(f"the workers did not come up; see {work}/worker-*.log")
            time.sleep(1)
        sdist = args.sdist or _sdist(work, args.kernels)
        project, version = parse_sdist_filename(sdist.name)
        with sdist.open("rb") as f:
            put = requests.put(f"{url}/api/sources/{sdist.name}", data=f, headers=headers,
                               timeout=120)
        source = {"sha256": put.json()["sha256"], "filename": sdist.name}
        body = {"project": project, "version": str(version), "torch": "2.14", "cuda": "13.0",
                "python": ["3.11"], "archs": args.archs, "source": source}
        load = os.getloadavg()
        print(f"host: {os.cpu_count()} cores, load average {load[0]:.2f} before the runs; "
              f"workers pinned: {cpu_sets if args.pin else 'no'}", flush=True)
        # Split first: the one-job wheel holds both archs, so each -smXX root would list it
        # and the split request would find its parts published (no job made).
        split = _request(url, headers, body | {"split_archs": True}, conn, args.timeout)
        per_part = ", ".join(f"{v['worker']} {v['seconds']} s" for v in split["jobs"].values())
        print(f"one job per arch: {split['seconds']} s ({per_part})", flush=True)
        unsplit = _request(url, headers, body | {"split_archs": False}, conn, args.timeout)
        print(f"one job, sm{' + sm'.join(args.archs)}: {unsplit['seconds']} s", flush=True)
        ratio = round(unsplit["seconds"] / split["seconds"], 2)
        print(f"makespan ratio (one job / split): {ratio}")
    result = {"archs": args.archs, "pinned": cpu_sets if args.pin else None,
              "cores": os.cpu_count(), "load_before": load, "unsplit": unsplit, "split": split,
              "ratio": ratio}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
