"""torch-scatter built twice in one run, without and with its recipe's ninja patch.

    python bench/ninja_patch_bench.py [--arch sm80] [--workdir DIR] [--json out.json]
                                      [--no-compile-cache]

torch-scatter's ``setup.py`` turns ninja off, so torch compiles one object at a time whatever
MAX_JOBS says; its recipe's ``ninja`` patch turns it back on (docs/recipes.md). This runs
``bench/torch_scatter_generic.py`` (the real ``wheelhouse build`` from the PyPI sdist, torch
2.14.1+cu130, the device-code and load checks, publishing) first with a copy of the recipe that
has no patch, then with the built-in recipe, each in its own work directory (so neither finds
the other's compile cache), one after the other on the same machine, and reports both wall
times and their ratio, with the load average before and after each.

Each build takes about an hour on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def recipe_without_patches(directory: Path) -> Path:
    """A copy of the built-in torch-scatter recipe with its ``[[patch]]`` tables left out."""
    text = (REPO / "wheelhouse" / "recipes" / "torch-scatter.toml").read_text()
    kept = text.split("[[patch]]", 1)[0]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "torch-scatter.toml").write_text(kept)
    return directory


def build(label: str, work: Path, arch: str, recipe_dir: Path | None,
          cache: bool) -> dict[str, Any]:
    out = work / f"{label}.json"
    argv = [sys.executable, str(REPO / "bench" / "torch_scatter_generic.py"), "--arch", arch,
            "--workdir", str(work / label), "--json", str(out)]
    if recipe_dir is not None:
        argv += ["--recipe-dir", str(recipe_dir)]
    if not cache:
        argv.append("--no-compile-cache")
    load = os.getloadavg()[0]
    print(f"== {label}: load average {load:.1f}\n$ {' '.join(argv)}", flush=True)
    code = subprocess.run(argv, check=False).returncode
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    result.update({"exit": code, "load_average_before": round(load, 1)})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm80")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="both builds without the compile cache, so that only ninja differs")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ninja-patch-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = not args.no_compile_cache
    before = build("without-ninja", work, args.arch, recipe_without_patches(work / "recipes"),
                   cache)
    after = build("with-ninja", work, args.arch, None, cache)
    summary: dict[str, Any] = {"before": before, "after": after}
    if before.get("exit") == 0 and after.get("exit") == 0:
        summary["ratio"] = round(before["seconds"] / after["seconds"], 2)
        print(f"without ninja {before['seconds']:.0f} s, with ninja {after['seconds']:.0f} s: "
              f"{summary['ratio']}x", flush=True)
        if after.get("record", {}).get("patches") != ["torch-scatter/ninja"]:
            print("the second build did not record the ninja patch", flush=True)
            return 1
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if "ratio" in summary else 1


if __name__ == "__main__":
    raise SystemExit(main())
