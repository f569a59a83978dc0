"""A real third-party CUDA extension: torch-scatter 2.1.2 from PyPI.

``wheelhouse build`` builds it with its recipe (``torch-scatter.toml``: the generic recipe's
``FORCE_CUDA=1`` and ``TORCH_CUDA_ARCH_LIST``, plus the patch that turns ninja back on; when this
bench was first run, torch-scatter had no recipe and built with ``generic.toml``, without
ninja; ``--recipe-dir`` puts another recipe first): the real worker pipeline from the
sdist on PyPI (hash-checked) through a fresh venv with torch 2.14.1 (CUDA 13.0, from
``--find-links``), the compile (one sccache server for the build), the device-code check (SASS
for the requested arch in every library that holds device code), the load check (torch-scatter's
libraries have no ``PyInit_*``: ``torch.ops.load_library``) and publishing into a local storage
directory. Afterwards this script reads the published wheel itself and checks that its CUDA
libraries hold SASS for the arch, and reports wall time, the peak memory of the whole process
tree (sampled every 0.5 s here, and as the build measured it) and what the record says.

    python bench/torch_scatter_generic.py [--arch sm80] [--python 3.11] [--workdir DIR]
                                          [--json out.json] [--recipe-dir DIR]
                                          [--no-compile-cache] [--cache-log debug]
                                          [--resume-at 0.9 [--full-seconds S] [--other-path]]

``--cache-log debug`` runs the build's sccache server at debug level
(``WHEELHOUSE_COMPILE_CACHE_LOG``) and keeps its workspace, whose ``sccache.log`` this script
then reads for the cache's time split (``bench/cold_cache_bench.py``'s ``split``: hash keys,
steps, nvcc calls, writes), summed over every compile of the build, the concurrent ones too.
Another ``--python`` in the same ``--workdir`` reuses that work directory's compile cache (the
build for a second Python).

``--resume-at 0.9`` (issue 31) runs three builds on S3 storage (moto's server on loopback, a
bucket per part): a full one (or ``--full-seconds``, measured before), one SIGKILLed at 0.9 of
that time with its whole process group (the sandbox dies with it) while the worker's push sends
its finished cache entries every 30 s, and then another worker's build: an empty workspace at
the same path, as every worker of a compose fleet has (``WHEELHOUSE_WORKSPACE=/work``), which
pulls what the dead one pushed. ``--other-path`` puts that workspace at another path instead
(sccache 0.16.0 hashes nvcc's absolute source path; a sandboxed build sees its source at
``/wheelhouse/src`` whatever the workspace, so nvcc's steps hit there too).

    python bench/torch_scatter_generic.py --resume-at 0.9 [--full-seconds S] [--other-path]

Exit status 0 only when the build published a wheel whose CUDA kernel libraries hold SASS for
that arch. ``--check WHEEL`` only checks a wheel built before.
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
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.cold_cache_bench import split  # noqa: E402
from tests.helpers import moto_s3_server, stop_group  # noqa: E402
from wheelhouse.config import Config  # noqa: E402
from wheelhouse.index import layout  # noqa: E402
from wheelhouse.index.catalog import Catalog  # noqa: E402
from wheelhouse.index.storage import make_s3_client, open_storage  # noqa: E402
from worker.compilecache import namespace  # noqa: E402
from worker.devicecode import wheel_device_code  # noqa: E402

TORCH_FIND_LINKS = os.environ.get("WHEELHOUSE_TEST_TORCH_FIND_LINKS", "/opt/pypi-more/files")
MIB = 1024 * 1024
# moto accepts any credentials; the build command and this script use these.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


class PeakSampler(threading.Thread):
    """Peak RSS of a process and all its descendants, sampled every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.largest: tuple[int, str] = (0, "")
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for proc in procs:
                try:
                    rss = proc.memory_info().rss
                    total += rss
                    if rss > self.largest[0]:
                        self.largest = (rss, proc.name())
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)
            self.stop.wait(self.interval)


def check_wheel(wheel: Path, arch: str) -> tuple[bool, dict[str, str]]:
    """Whether the wheel's CUDA kernels are there for ``arch``: its ``_scatter_cuda``,
    ``_segment_*_cuda`` libraries hold SASS for it (``_version_cuda`` is host code only: it
    reports the CUDA version), no library that holds device code lacks it, and no ``_cuda``
    library holds PTX alone."""
    found = wheel_device_code(wheel)
    arch = arch.removeprefix("sm_").removeprefix("sm")
    kernels = [code for name, code in found.items()
               if "_cuda" in name and not name.endswith(("_version_cuda.so",))]
    ok = bool(kernels) and all(code.covers(arch) for code in kernels) and all(
        code.covers(arch) for code in found.values() if not code.empty)
    return ok, {name: code.describe() for name, code in found.items()}


def cache_logs(work: Path) -> set[Path]:
    """The sccache logs of the builds whose workspaces were kept in ``work``."""
    return set((work / "work").glob("*/sccache/sccache.log"))


def build(args: argparse.Namespace, work: Path, *, storage: str | None = None,
          s3_endpoint: str | None = None, kill_after: float | None = None) -> dict[str, Any]:
    """One ``wheelhouse build`` in ``work`` (its workspace; storage there too, unless
    ``storage`` names a bucket on ``s3_endpoint``); with ``kill_after``, the whole build is
    SIGKILLed that many seconds in, as a dying host would leave it."""
    work.mkdir(parents=True, exist_ok=True)
    config = Config(storage=storage or str(work / "data"), s3_endpoint_url=s3_endpoint,
                    workspace=str(work / "work"),
                    torch_index_url="", torch_find_links=TORCH_FIND_LINKS,
                    recipe_dirs=str(args.recipe_dir or ""),
                    compile_cache=not args.no_compile_cache,
                    compile_cache_log=args.cache_log)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config.to_env())
    if s3_endpoint:
        env.update(S3_ENV)
    wheelhouse = shutil.which("wheelhouse") or "wheelhouse"
    argv = [wheelhouse, "build", f"torch-scatter=={args.version}", "--torch", "2.14",
            "--cuda", "13.0", "--python", args.python, "--arch", args.arch,
            "--timeout", str(args.timeout)]
    # Only the log of this build: an earlier one kept in the same work directory is not it.
    splitting = config.compile_cache and config.compile_cache_log_level == "debug"
    kept = cache_logs(work)
    if splitting:
        argv.append("--keep-workspace")
    print("$ " + " ".join(argv), flush=True)
    print(f"workdir {work}; storage {config.storage}; load average {os.getloadavg()[0]:.1f}; "
          f"{psutil.cpu_count()} cores" + (f"; killed after {kill_after:.0f} s"
                                           if kill_after else ""), flush=True)
    started = time.monotonic()
    killed = False
    survivors = 0
    with (work / "build.out").open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = PeakSampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            # Everything at once, as with a lost host: the build command's group by SIGKILL;
            # the sandbox dies with its parent (bubblewrap's --die-with-parent).
            tree = psutil.Process(proc.pid).children(recursive=True)
            stop_group(proc, (signal.SIGKILL,))
            _, alive = psutil.wait_procs(tree, timeout=60)
            survivors = len(alive)
            for leftover in alive:  # this script's own descendants, by pid
                with contextlib.suppress(psutil.Error):
                    leftover.kill()
            code = proc.returncode
            killed = True
        sampler.stop.set()
        sampler.join()
    seconds = time.monotonic() - started
    tail = (work / "build.out").read_text(errors="replace").strip().splitlines()[-3:]
    result: dict[str, Any] = {
        "command": " ".join(argv[1:]), "exit": code, "seconds": round(seconds, 1),
        "killed": killed, "survivors": survivors,
        "peak_tree_mib": round(sampler.peak / MIB), "largest_process":
        {"name": sampler.largest[1], "mib": round(sampler.largest[0] / MIB)},
        "load_average_after": round(os.getloadavg()[0], 1), "output_tail": tail,
    }
    ok = False
    if code == 0:
        catalog = Catalog(open_storage(config), 0)
        # The wheel as built (publishing also stored its variant form for /simple/), for this
        # Python: an earlier run in the same work directory may have built another.
        tag = "-cp" + args.python.replace(".", "") + "-"
        [record] = [r for r in catalog.all_records()
                    if r.variant_of is None and tag in r.filename]
        wheel = work / record.filename
        open_storage(config).download(record.wheel_key, wheel)
        ok, device_code = check_wheel(wheel, args.arch)
        build = record.build
        result.update({
            "wheel": record.filename, "size_mib": round(record.size / MIB, 1),
            "device_code": device_code,
            "holds_arch": ok,
            "record": {"seconds": build.seconds, "toolkit": build.toolkit, "torch": build.torch,
                       "peak_tree_mib": round((build.peak_tree_bytes or 0) / MIB),
                       "peak_job_mib": round((build.peak_job_bytes or 0) / MIB),
                       "max_jobs": build.max_jobs.reason if build.max_jobs else None,
                       "compile_cache": build.compile_cache.to_dict()
                       if build.compile_cache else None,
                       "patches": [p.ref for p in build.patches or ()],
                       # Each step's seconds up to publishing (the record is written then).
                       "step_seconds": build.step_seconds},
        })
    result["ok"] = ok
    if s3_endpoint:
        prefix = layout.compile_cache_prefix(namespace("torch-scatter", "13.0"))
        result["cache_entries_in_storage"] = sum(1 for _ in open_storage(config).list(prefix))
    if splitting:
        new = sorted(cache_logs(work) - kept)  # one: this build's
        log = new[0] if new else None
        result["cache_split"] = split(log) if log else {}
        result["cache_log"] = str(log) if log else None
    print(json.dumps(result, indent=2), flush=True)
    return result


def bucket(endpoint: str, name: str) -> str:
    """A new, empty bucket on ``endpoint``; the storage URL of a prefix in it."""
    os.environ.update(S3_ENV)
    config = Config(storage=f"s3://{name}/idx", s3_endpoint_url=endpoint)
    make_s3_client(config).create_bucket(Bucket=name)
    return config.storage


def resume(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A build killed at ``--resume-at`` of a full one's time, then built by another worker:
    its own empty workspace, the same S3 storage (what the dead one pushed while compiling)."""
    with moto_s3_server() as endpoint:
        full = args.full_seconds
        reference: dict[str, Any] | None = None
        if full is None:
            reference = build(args, work / "full", storage=bucket(endpoint, "full"),
                              s3_endpoint=endpoint)
            if not reference["ok"]:
                raise SystemExit("the full build failed")
            full = reference["seconds"]
        storage = bucket(endpoint, "resume")
        killed = build(args, work / "killed", storage=storage, s3_endpoint=endpoint,
                       kill_after=args.resume_at * full)
        if not killed["killed"]:
            raise SystemExit("the build ended before it was killed")
        # Another host, configured as the first (compose gives every worker the same
        # WHEELHOUSE_WORKSPACE): the same path, empty; with --other-path, a worker elsewhere
        # (its sandboxed build still sees the source at /wheelhouse/src).
        if args.other_path:
            other = work / "other-worker"
        else:
            other = work / "killed"
            (work / "killed").rename(work / "killed-host")
        resumed = build(args, other, storage=storage, s3_endpoint=endpoint)
    cache = (resumed.get("record") or {}).get("compile_cache") or {}
    return {"full": reference, "full_seconds": full, "killed": killed, "resumed": resumed,
            "resume_at": args.resume_at, "other_path": args.other_path,
            "resumed_of_full": round(resumed["seconds"] / full, 3),
            "hits": cache.get("hits"), "misses": cache.get("misses"),
            "fetched": cache.get("fetched"), "ok": resumed["ok"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="2.1.2")
    parser.add_argument("--arch", default="sm80")
    parser.add_argument("--python", default="3.11")
    parser.add_argument("--timeout", type=int, default=6 * 3600)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--recipe-dir", type=Path,
                        help="a directory of recipes searched first (WHEELHOUSE_RECIPE_DIRS)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="build without the compile cache (WHEELHOUSE_COMPILE_CACHE=false)")
    parser.add_argument("--cache-log", default="warn",
                        help="the build's sccache log level; debug: split its time")
    parser.add_argument("--resume-at", type=float, metavar="FRACTION",
                        help="on S3 storage (moto on loopback): a full build, then one killed "
                             "at FRACTION of its time, then another worker's build")
    parser.add_argument("--full-seconds", type=float,
                        help="with --resume-at: a full build's time measured before, instead of "
                             "building one first")
    parser.add_argument("--other-path", action="store_true",
                        help="with --resume-at: the other worker's workspace at another path")
    parser.add_argument("--check", type=Path, metavar="WHEEL",
                        help="only check an already built wheel's device code")
    args = parser.parse_args()
    if args.check:
        ok, device_code = check_wheel(args.check, args.arch)
        print(json.dumps({"wheel": args.check.name, "holds_arch": ok,
                          "device_code": device_code}, indent=2))
        return 0 if ok else 1
    work = args.workdir or Path(tempfile.mkdtemp(prefix="torch-scatter-bench-"))
    if args.resume_at is not None:
        if args.no_compile_cache:
            raise SystemExit("--resume-at needs the compile cache")
        result = resume(args, work)
        killed, resumed = result["killed"], result["resumed"]
        print(f"full build {result['full_seconds']:.1f} s; killed after {killed['seconds']:.1f}"
              f" s ({killed['cache_entries_in_storage']} cache entries in storage); another "
              f"worker's build {resumed['seconds']:.1f} s = {result['resumed_of_full']:.0%} of "
              f"the full one, {result['fetched']} entries fetched, {result['hits']} hits, "
              f"{result['misses']} misses", flush=True)
    else:
        result = build(args, work)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
