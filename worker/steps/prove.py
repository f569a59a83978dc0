"""The proof step: a published wheel run on this host's GPU, in the sandbox (issue 27).

A proof job (:class:`wheelhouse.builds.job.ProveCall`, from a ``prove-sm<arch>`` queue) names
the wheel by its build's spec, file name and sha256. The worker reads the wheel's record, copies
the published bytes into the workspace and checks their sha256, makes a venv with torch as the
build did, then hands everything that touches the wheel to the sandbox, as the build's checks
do: the ``wheel`` operation of :mod:`worker.sandbox.untrusted` validates it, reads its device
code and load plan and installs it; the load check and the proof program
(:mod:`worker.gpuproof_program`) run sandboxed with the GPU's device nodes added
(:func:`gpu_devices`; the driver's libraries are in the system paths the sandbox mounts).

What the proof prints is the wheel's own code talking: it is parsed as data
(:func:`worker.gpuproof.result`), and it is worth as much as the wheel's load check is. Where no
GPU ran it, nothing is recorded; otherwise the result is kept beside the record
(:func:`wheelhouse.index.proofs.record_proof`), passed or failed.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from contextlib import closing
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from wheelhouse.builds.job import ProveCall
from wheelhouse.config import Config
from wheelhouse.errors import (
    BuildFailed,
    FailureKind,
    InfrastructureError,
    NothingPublished,
    ProofMismatch,
    ProvenanceUnavailable,
    StorageError,
)
from wheelhouse.index.layout import Record
from wheelhouse.index.proofs import GpuProof, now, read_proof, record_proof, sign_proof
from wheelhouse.index.storage import Storage
from wheelhouse.provenance import ca
from wheelhouse.retry import BUILD_STEPS
from wheelhouse.wheels import sha256_file
from worker import gpuproof, loadcheck
from worker.buildenv import sanitized_env
from worker.errors import SandboxUnavailable
from worker.events import Reporter
from worker.sandbox import safefs
from worker.steps.checks import report_device_code, report_load_steps, unpacked_cap
from worker.steps.context import BuildContext
from worker.steps.publish import WORKSPACE_SIGNER, read_record
from worker.steps.venv import create_venv
from worker.supervision.reaper import unique_build_id
from worker.supervision.runner import Runner

#: Where a host's NVIDIA driver puts the GPU's device nodes.
_DEV = Path("/dev")


def gpu_devices(dev: Path = _DEV) -> list[Path]:
    """The NVIDIA device nodes of this host (``/dev/nvidiactl``, ``/dev/nvidia0``,
    ``/dev/nvidia-uvm``, ...): character devices, never links; none without a GPU."""
    found = []
    for path in sorted(dev.glob("nvidia*")):
        try:
            mode = os.lstat(path).st_mode  # one look, of the entry itself: a link is no node
        except OSError:
            continue  # gone since the listing
        if stat.S_ISCHR(mode):
            found.append(path)
    return found


@dataclass(frozen=True)
class ProofOutcome:
    """What a proof job did."""

    proof: gpuproof.Proof
    recorded: bool
    """Whether the result is now kept beside the wheel's record (never where no GPU ran)."""
    already: bool = False
    """A passing proof on this arch was already recorded: nothing ran."""


def run_proof(call: ProveCall, *, config: Config, storage: Storage,
              reporter: Reporter | None = None, build_id: str | None = None,
              timeout: float = 3600.0) -> ProofOutcome:
    """Prove the published wheel ``call`` names on this host's GPU; record what ran.

    Raises :class:`BuildFailed`: ``incompatible`` where the wheel is no longer published with
    those bytes, and the sandbox's and the steps' own failures.
    """
    ctx = BuildContext.create(call.spec, config=config, storage=storage,
                              reporter=reporter or Reporter(),
                              build_id=unique_build_id(build_id or call.job_id),
                              retry=BUILD_STEPS, keep_workspace=False)
    try:
        return _run(ctx, call, timeout)
    except SandboxUnavailable as exc:
        raise BuildFailed(FailureKind.SANDBOX_UNAVAILABLE, str(exc)) from exc
    except (StorageError, InfrastructureError, ProvenanceUnavailable) as exc:
        raise BuildFailed(FailureKind.INFRASTRUCTURE, str(exc)) from exc
    except (NothingPublished, ProofMismatch) as exc:  # deleted or replaced meanwhile
        raise BuildFailed(FailureKind.INCOMPATIBLE, str(exc)) from exc
    finally:
        safefs.discard_tree(ctx.workspace)  # the sandbox wrote in it: by descriptor


def _run(ctx: BuildContext, call: ProveCall, timeout: float) -> ProofOutcome:
    record = _published(ctx, call)
    earlier = read_proof(ctx.storage, record)
    if earlier is not None and earlier.passed and earlier.capability == call.arch:
        ctx.say(f"{call.filename} already {earlier.describe()}: nothing to run")
        return ProofOutcome(_as_run(earlier), recorded=False, already=True)
    started = time.monotonic()
    with closing(Runner.start(ctx, deadline=started + timeout, timeout=timeout)) as run:
        try:
            proof = _prove(ctx, run, record)
        finally:
            ctx.journal.end_step()  # the last prove part counts, however it ended
    ctx.say(proof.line())
    if not proof.proven:
        return ProofOutcome(proof, recorded=False)
    if proof.capability != call.arch:  # WHEELHOUSE_PROVE_ARCHS names a GPU this host lacks
        raise BuildFailed(FailureKind.INFRASTRUCTURE,
                          f"this host's GPU is sm_{proof.capability}, the proof job is for "
                          f"sm_{call.arch}: nothing recorded (check WHEELHOUSE_PROVE_ARCHS)")
    # Signed after the run, by this worker: its certificate is valid when the proof says so.
    signer = ca.signer_for(ctx.config, WORKSPACE_SIGNER)
    record_proof(ctx.storage, record, sign_proof(GpuProof(
        filename=record.filename, sha256=record.sha256, proven_at=now(),
        host=f"{socket.gethostname()} ({ctx.build_id})", **asdict(proof)), signer))
    ctx.say(f"recorded the proof of {record.filename}, signed by {signer.name}")
    return ProofOutcome(proof, recorded=True)


def _published(ctx: BuildContext, call: ProveCall) -> Record:
    record = read_record(ctx, call.filename)
    if record is None or record.sha256 != call.sha256:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{call.filename} with sha256 {call.sha256} is not published in "
                          f"{call.spec.variant.key} (any more): nothing to prove")
    return record


def _prove(ctx: BuildContext, run: Runner, record: Record) -> gpuproof.Proof:
    ctx.journal.phase("prove")
    wheel = _fetch(ctx, record)  # before anything runs in the workspace
    ctx.journal.phase("venv")
    venv = create_venv(ctx, run, None)
    ctx.journal.phase("prove")
    out = ctx.workspace / "inspect" / "out"
    check_dir = ctx.workspace / "load-check"
    site = check_dir / "site"
    check_dir.mkdir()
    spec = ctx.spec
    report = run.untrusted(
        {"op": "wheel", "wheel": str(wheel), "out": str(out), "site": str(site),
         "project": spec.project, "version": record.version, "python": spec.python,
         "machine": spec.machine, "relabel": False, "label": spec.variant.local_label,
         "patches": [], "load_check": list(ctx.recipe.load_check),
         "variant": spec.variant.key, "variant_form": False,
         "max_unpacked_bytes": unpacked_cap(ctx)},
        what="checking the wheel", failure=FailureKind.INVALID_WHEEL,
        read_only=[wheel.parent], writable=[check_dir])
    archs = sorted({a for code in report_device_code(report.get("device_code")).values()
                    for a in code.sass})
    steps = report_load_steps(report.get("load_steps"), ctx.recipe.load_check)
    devices = gpu_devices()
    ctx.say(f"GPU device nodes for the sandbox: {' '.join(map(str, devices)) or 'none'}")
    env = sanitized_env(os.environ)
    start = ctx.log.size()
    ran = run.sandboxed(loadcheck.argv(venv.seen, steps, site=site), env=env, cwd=check_dir,
                        what="the load check", read_only=venv.read_only, writable=[check_dir])
    failed = gpuproof.load_failure(
        ctx.recipe, loadcheck.parse(ctx.log.since(start), steps,
                                    -1 if ran.returncode is None else ran.returncode),
        record.filename)
    if failed is not None:
        return failed
    start = ctx.log.size()
    ran = run.sandboxed(gpuproof.argv(venv.seen, archs, ctx.recipe.gpu_proof, site=site),
                        env=env, cwd=check_dir, what="the GPU proof", read_only=venv.read_only,
                        writable=[check_dir], devices=devices)
    return gpuproof.result(ctx.recipe.gpu_proof, ran.returncode, ctx.log.since(start))


def _fetch(ctx: BuildContext, record: Record) -> Path:
    """The published bytes, copied into the workspace and checked against the record."""
    dest = ctx.workspace / "wheel" / record.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    ctx.retried("downloading the wheel", lambda: ctx.storage.download(record.wheel_key, dest))
    if sha256_file(dest) != record.sha256:
        raise BuildFailed(FailureKind.INFRASTRUCTURE,
                          f"storage gave other bytes for {record.filename} than its record's "
                          "sha256")
    return dest


def _as_run(proof: GpuProof) -> gpuproof.Proof:
    """A recorded proof as the run that made it."""
    return gpuproof.Proof(**{f.name: getattr(proof, f.name) for f in fields(gpuproof.Proof)})
