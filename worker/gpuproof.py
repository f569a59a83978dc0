"""The GPU proof: a built wheel run on a GPU before anyone relies on it (issue 27).

A wheel that compiled, holds the right SASS and loads on a CPU host can still fail on the GPU
(a kernel that faults, a miscompiled path). The proof loads the wheel's libraries as the load
check does (:mod:`worker.loadcheck`), then runs :mod:`worker.gpuproof_program` in the wheel's
own Python: the GPU's architecture must be among the wheel's SASS, and the recipe's named proof
(``generic``, ``flash-attn``) must pass. Where torch sees no GPU nothing is proven, and the
result says so; nothing here ever claims a proof that did not run.

A person runs it on a GPU host (``wheelhouse prove``); the fleet runs it as a proof job from a
``prove-sm<arch>`` queue (:mod:`worker.steps.prove`), in the sandbox with the GPU's device
nodes added. Either way a proof that ran is kept beside the published wheel's record with an
attestation of its own, signed under the fleet CA (:func:`wheelhouse.index.proofs.sign_proof`).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
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
    """Prove ``wheel``, installed in ``python``'s environment, with ``recipe``'s proof (the
    operator's ``wheelhouse prove``: their wheel, their Python, on their host)."""
    steps = loadcheck.plan(wheel, (*recipe.import_check, *recipe.load_check))
    loaded = subprocess.run(loadcheck.argv(python, steps), capture_output=True, text=True,
                            timeout=timeout, check=False)
    failed = load_failure(recipe, loadcheck.parse(loaded.stdout, steps, loaded.returncode),
                          wheel.name)
    if failed is not None:
        return failed
    ran = subprocess.run(argv(python, sass_archs(wheel), recipe.gpu_proof), capture_output=True,
                         text=True, timeout=timeout, check=False)
    return result(recipe.gpu_proof, ran.returncode, ran.stdout, ran.stderr)


def load_failure(recipe: Recipe, report: loadcheck.Report, wheel_name: str) -> Proof | None:
    """The proof's verdict where the wheel's libraries do not load (it fails wherever it
    runs, GPU or not); None where they do."""
    try:
        loadcheck.check(report, wheel_name=wheel_name)
    except BuildFailed as exc:
        return Proof(recipe.gpu_proof, proven=True, passed=False,
                     reason=f"its libraries do not load: {exc.reason}")
    return None


def argv(python: Path | str, archs: Sequence[str], proof: str, *,
         site: Path | None = None) -> list[str]:
    """The command that runs the proof in ``python`` (the wheel installed into ``site`` where
    given): ``archs`` are the wheel's SASS architectures."""
    payload = {"archs": list(archs), "proof": proof, **({"site": str(site)} if site else {})}
    return [str(python), "-I", "-c", PROGRAM, json.dumps(payload)]


def result(proof: str, returncode: int | None, stdout: str, stderr: str = "") -> Proof:
    """What one run of :func:`argv`'s command found, from its exit status and the last line it
    marked. From a sandboxed run this is the wheel's own code talking: plain data, checked
    for shape, and trusted no further than the proof of that wheel."""
    code = -1 if returncode is None else returncode
    marked = [line for line in stdout.splitlines() if line.startswith(gpuproof_program.MARK)]
    if not marked:
        tail = (stderr.strip().splitlines() or [f"exit {code}"])[-1]
        return Proof(proof, proven=code != gpuproof_program.NO_GPU, passed=False,
                     reason=f"the proof died: {tail}"[:500])
    try:
        found = json.loads(marked[-1].removeprefix(gpuproof_program.MARK))
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return Proof(proof, proven=code != gpuproof_program.NO_GPU, passed=False,
                     reason="the proof printed no result it can be read from")
    try:
        seconds = float(found.get("seconds", 0.0))
    except (TypeError, ValueError):
        seconds = 0.0
    return Proof(
        proof=proof, proven=code != gpuproof_program.NO_GPU,
        passed=found.get("passed") is True and code == 0,
        reason=str(found.get("reason", ""))[:500], gpu=str(found.get("gpu", ""))[:200],
        capability=str(found.get("capability", ""))[:8],
        driver=str(found.get("driver", ""))[:64], cuda=str(found.get("cuda", ""))[:32],
        torch=str(found.get("torch", ""))[:64], seconds=seconds)
