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

``--cache-log debug`` runs the build's sccache server at debug level
(``WHEELHOUSE_COMPILE_CACHE_LOG``) and keeps its workspace, whose ``sccache.log`` this script
then reads for the cache's time split (``bench/cold_cache_bench.py``'s ``split``: hash keys,
steps, nvcc calls, writes), summed over every compile of the build, the concurrent ones too.
Another ``--python`` in the same ``--workdir`` reuses that work directory's compile cache (the
build for a second Python).

Exit status 0 only when the build published a wheel whose CUDA kernel libraries hold SASS for
that arch. ``--check WHEEL`` only checks a wheel built before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from wheelhouse.config import Config  # noqa: E402
from wheelhouse.index.catalog import Catalog  # noqa: E402
from wheelhouse.index.storage import open_storage  # noqa: E402
from worker.devicecode import wheel_device_code  # noqa: E402

TORCH_FIND_LINKS = os.environ.get("WHEELHOUSE_TEST_TORCH_FIND_LINKS", "/opt/pypi-more/files")
MIB = 1024 * 1024


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
    parser.add_argument("--check", type=Path, metavar="WHEEL",
                        help="only check an already built wheel's device code")
    args = parser.parse_args()
    if args.check:
        ok, device_code = check_wheel(args.check, args.arch)
        print(json.dumps({"wheel": args.check.name, "holds_arch": ok,
                          "device_code": device_code}, indent=2))
        return 0 if ok else 1
    work = args.workdir or Path(tempfile.mkdtemp(prefix="torch-scatter-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    config = Config(storage=str(work / "data"), workspace=str(work / "work"),
                    torch_index_url="", torch_find_links=TORCH_FIND_LINKS,
                    recipe_dirs=str(args.recipe_dir or ""),
                    compile_cache=not args.no_compile_cache,
                    compile_cache_log=args.cache_log)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update(config.to_env())
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
    print(f"workdir {work}; load average {os.getloadavg()[0]:.1f}; "
          f"{psutil.cpu_count()} cores", flush=True)
    started = time.monotonic()
    with (work / "build.out").open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        sampler = PeakSampler(proc.pid)
        sampler.start()
        code = proc.wait()
        sampler.stop.set()
        sampler.join()
    seconds = time.monotonic() - started
    tail = (work / "build.out").read_text(errors="replace").strip().splitlines()[-3:]
    result: dict[str, Any] = {
        "command": " ".join(argv[1:]), "exit": code, "seconds": round(seconds, 1),
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
                       "patches": [p.ref for p in build.patches or ()]},
        })
    if splitting:
        new = sorted(cache_logs(work) - kept)  # one: this build's
        log = new[0] if new else None
        result["cache_split"] = split(log) if log else {}
        result["cache_log"] = str(log) if log else None
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
