"""The GPU proof: a built wheel run on a GPU before anyone relies on it (issue 27).

A wheel that compiled, holds the right SASS and loads on a CPU host can still fail on the GPU
(a kernel that faults, a miscompiled path). The proof loads the wheel's libraries as the load
check does (:mod:`worker.loadcheck`), then runs :mod:`worker.gpuproof_program` in the wheel's
own Python: the GPU's architecture must be among the wheel's SASS, and the recipe's named proof
(``generic``, ``flash-attn``) must pass. Where torch sees no GPU nothing is proven, and the
result says so; nothing here ever claims a proof that did not run.

This is the proof a person runs on a GPU host (``wheelhouse prove``). The fleet does not run it
yet: no ``prove-sm<arch>`` queue, no proof in the record. With ``--record`` the result is kept
beside the published wheel's record with an attestation of its own, signed under the fleet CA
(:func:`wheelhouse.index.proofs.sign_proof`).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from wheelhouse.devicecode import wheel_device_code
from wheelhouse.errors import BuildFailed
from wheelhouse.recipes.book import Recipe
from worker import gpuproof_program, loadcheck

#: What the program runs: its own source, handed over as ``python -I -c``.
PROGRAM = Path(gpuproof_program.__file__).read_text()


@dataclass(frozen=True)
class Proof:
    """What one run of the proof found."""

    proof: str
    proven: bool
    """Whether a GPU ran it: False where none was visible (then ``passed`` is False too)."""
    passed: bool
    reason: str
    gpu: str = ""
    capability: str = ""
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        if not self.proven:
            return f"not proven: {self.reason}"
        verdict = "proven" if self.passed else "FAILED"
        return (f"{verdict} on {self.gpu} (sm_{self.capability}, driver {self.driver or '?'}, "
                f"torch {self.torch}, {self.seconds:.1f} s): {self.reason}")


def sass_archs(wheel: Path) -> list[str]:
    """Every SASS architecture any library of the wheel holds."""
    return sorted({a for code in wheel_device_code(wheel).values() for a in code.sass})


def prove(python: Path, wheel: Path, recipe: Recipe, *, timeout: float = 900.0) -> Proof:
    """Prove ``wheel``, installed in ``python``'s environment, with ``recipe``'s proof."""
    steps = loadcheck.plan(wheel, (*recipe.import_check, *recipe.load_check))
    loaded = subprocess.run(loadcheck.argv(python, steps), capture_output=True, text=True,
                            timeout=timeout, check=False)
    try:
        loadcheck.check(loadcheck.parse(loaded.stdout, steps, loaded.returncode),
                        wheel_name=wheel.name)
    except BuildFailed as exc:  # a verdict without the GPU: it fails wherever it runs
        return Proof(recipe.gpu_proof, proven=True, passed=False,
                     reason=f"its libraries do not load: {exc.reason}")
    payload = json.dumps({"archs": sass_archs(wheel), "proof": recipe.gpu_proof})
    ran = subprocess.run([str(python), "-I", "-c", PROGRAM, payload], capture_output=True,
                         text=True, timeout=timeout, check=False)
    marked = [line for line in ran.stdout.splitlines()
              if line.startswith(gpuproof_program.MARK)]
    if not marked:
        tail = (ran.stderr.strip().splitlines() or [f"exit {ran.returncode}"])[-1]
        return Proof(recipe.gpu_proof, proven=ran.returncode != gpuproof_program.NO_GPU,
                     passed=False, reason=f"the proof died: {tail}"[:500])
    found = json.loads(marked[-1].removeprefix(gpuproof_program.MARK))
    return Proof(
        proof=recipe.gpu_proof, proven=ran.returncode != gpuproof_program.NO_GPU,
        passed=bool(found.get("passed")) and ran.returncode == 0,
        reason=str(found.get("reason", "")), gpu=str(found.get("gpu", "")),
        capability=str(found.get("capability", "")), driver=str(found.get("driver", "")),
        cuda=str(found.get("cuda", "")), torch=str(found.get("torch", "")),
        seconds=float(found.get("seconds", 0.0)))
