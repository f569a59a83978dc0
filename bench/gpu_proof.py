"""The GPU proof on a real GPU, prepared for a host that has one (issue 27).

Builds the vecadd example (``examples/vecadd-0.1.0``, one real kernel) for this host's GPU
architecture with the real worker pipeline (``wheelhouse build``: sandboxed, checked, published
into a local index in ``--workdir``), makes a venv with the wheel's torch, runs the product's
own proof on it (``wheelhouse prove --record``: the libraries load, the GPU's architecture is
among the wheel's SASS, the recipe's proof passes) and prints the proof the index keeps
(``proofs/…json``, with its signed attestation).

    python bench/gpu_proof.py [--arch 90] [--workdir DIR] [--find-links DIR]
                              [--python 3.11] [--json out.json]

The architecture comes from ``nvidia-smi`` (``--arch`` names it, e.g. to try the script on a
host without a GPU, where the proof says "not proven: no GPU visible to torch" and exits 3).
Needs nvcc 13.0 and torch 2.14.1 for CUDA 13.0 from ``--find-links`` (default
/opt/pypi-more/files) or the configured index. Exits with ``wheelhouse prove``'s code: 0
proven, 1 failed, 3 nothing proven.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "vecadd-0.1.0"
TORCH = "2.14.1"


def gpu_arch() -> str | None:
    """The compute capability of the first GPU ``nvidia-smi`` lists (``90``), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    done = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False, timeout=60)
    lines = done.stdout.split()
    return lines[0].replace(".", "") if done.returncode == 0 and lines else None


def wheelhouse() -> str:
    found = shutil.which("wheelhouse", path=str(Path(sys.executable).parent))
    return found or shutil.which("wheelhouse") or "wheelhouse"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help="e.g. 90 (default: the GPU's, from nvidia-smi)")
    parser.add_argument("--workdir", type=Path, help="kept; default: a temporary directory")
    parser.add_argument("--find-links", default="/opt/pypi-more/files")
    parser.add_argument("--python", default="3.11")
    parser.add_argument("--json", type=Path, help="write the recorded proof here")
    args = parser.parse_args()

    arch = (args.arch or gpu_arch() or "").removeprefix("sm_").removeprefix("sm")
    if not arch:
        raise SystemExit("no GPU found by nvidia-smi; name one with --arch to try the script")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    env.update({"WHEELHOUSE_STORAGE": str(work / "data"),
                "WHEELHOUSE_WORKSPACE": str(work / "work"),
                "WHEELHOUSE_TORCH_INDEX_URL": "", "WHEELHOUSE_TORCH_FIND_LINKS": args.find_links})
    print(f"arch sm_{arch}; workdir {work}", flush=True)

    built = subprocess.run([wheelhouse(), "build", str(EXAMPLE), "--torch", "2.14", "--cuda",
                            "13.0", "--python", args.python, "--arch", f"sm{arch}"], env=env,
                           check=False)
    if built.returncode != 0:
        raise SystemExit(f"wheelhouse build exited {built.returncode}: nothing to prove")
    # The plain wheel (its variant form, "-cu130sm80.whl", is published beside it).
    [wheel] = sorted((work / "data" / "wheels").rglob("vecadd-*+cu130torch*.whl"))
    print(f"built {wheel.name}", flush=True)

    venv = work / "venv"
    uv = shutil.which("uv") or "uv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([uv, "venv", "-q", "-p", args.python, str(venv)], check=True)
        subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                        "--find-links", args.find_links, f"torch=={TORCH}"], check=True)

    proved = subprocess.run([wheelhouse(), "prove", str(wheel), "--python",
                             str(venv / "bin" / "python"), "--record", "--json"], env=env,
                            check=False, capture_output=True, text=True)
    sys.stderr.write(proved.stderr)
    print(f"wheelhouse prove exited {proved.returncode}: {proved.stdout.strip()}", flush=True)
    recorded = sorted((work / "data" / "proofs").rglob("*.json"))
    for path in recorded:
        proof = json.loads(path.read_text())
        shown = {k: v for k, v in proof.items() if k != "attestation"}
        signed = "signed" if proof.get("attestation") else "unsigned"
        print(f"recorded {path.relative_to(work / 'data')} ({signed}):\n"
              f"{json.dumps(shown, indent=2)}")
        if args.json:
            args.json.write_text(json.dumps(proof, indent=2))
    if not recorded:
        print("nothing recorded (no GPU ran the proof)")
    return proved.returncode


if __name__ == "__main__":
    sys.exit(main())
