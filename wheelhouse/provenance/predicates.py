"""What an attestation says: a build's SLSA Provenance v1, the index's record of an upload, or a
GPU proof of a published wheel.

The build predicate is made from what the worker already holds (the spec, the build's
:class:`~wheelhouse.builds.facts.BuildFacts`, the signer's name), never from the wheel's bytes:
the worker's root process does not parse what a build produced (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.variants import Variant

SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
#: The index's attestation of an upload: who sent it, when (the file's sha256 is the subject).
PUBLISH = "urn:wheelhouse:publish:v1"
BUILD_TYPE = "urn:wheelhouse:build:cuda-extension:v1"
#: A GPU proof of the subject (``wheelhouse prove --record``): where it ran and what it found.
GPU_PROOF_TYPE = "urn:wheelhouse:gpu-proof:v1"


def _time(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_time(text: object) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def build(*, project: str, version: str, python: str, machine: str, variant: Variant,
          archs: tuple[str, ...] | None, facts: BuildFacts, signer: str,
          finished: datetime) -> dict[str, Any]:
    """SLSA Provenance v1 of one build: its request, its inputs by digest, who ran it, when."""
    deps: list[dict[str, Any]] = []
    if facts.sdist_url or facts.sdist:
        sdist: dict[str, Any] = {"name": "sdist", "uri": facts.sdist_url or facts.sdist}
        if facts.sdist_sha256:
            sdist["digest"] = {"sha256": facts.sdist_sha256}
        deps.append(sdist)
    if facts.torch:
        deps.append({"name": "torch", "uri": f"pkg:pypi/torch@{facts.torch}"})
    if facts.toolkit:
        deps.append({"name": "cuda-toolkit", "uri": f"pkg:generic/cuda-toolkit@{facts.toolkit}"})
    if facts.recipe:
        deps.append({"name": "recipe", "uri": f"urn:wheelhouse:recipe:{facts.recipe}"})
    deps.extend({"name": f"patch {p.ref}", "uri": f"urn:wheelhouse:patch:{p.ref}",
                 "digest": {"sha256": p.sha256}, "annotations": {"description": p.description}}
                for p in facts.patches or ())
    started = finished - timedelta(seconds=facts.seconds or 0.0)
    internal: dict[str, Any] = {"host": facts.host, "worker": signer}
    if facts.max_jobs is not None:
        internal["max_jobs"] = facts.max_jobs.jobs
    if facts.sandbox:
        internal["sandbox"] = facts.sandbox
    byproducts: list[dict[str, Any]] = []
    if facts.device_code is not None:
        byproducts.append({"name": "device-code", "annotations": {
            "sass": facts.sass_archs, "ptx": facts.ptx_archs, "libraries": facts.device_code}})
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {
                "project": project, "version": version, "python": python, "machine": machine,
                "torch": variant.torch, "cuda": variant.cuda,
                "archs": list(archs) if archs else None, "variant": variant.key},
            "internalParameters": internal,
            "resolvedDependencies": deps,
        },
        "runDetails": {
            "builder": {"id": f"urn:wheelhouse:worker:{signer}"},
            "metadata": {"invocationId": facts.build_id, "startedOn": _time(started),
                         "finishedOn": _time(finished)},
            "byproducts": byproducts,
        },
    }


def publish(*, publisher: str, index: str, when: datetime) -> dict[str, Any]:
    """The index's attestation that ``publisher`` uploaded the subject at ``when``."""
    return {"publisher": publisher, "index": index, "publishedOn": _time(when)}


def gpu_proof(*, gpu: str, capability: str, driver: str, cuda: str, torch: str, proof: str,
              proven: bool, passed: bool, reason: str, seconds: float, proven_at: str,
              host: str) -> dict[str, Any]:
    """What one run of a wheel's GPU proof found (:class:`wheelhouse.index.proofs.GpuProof`'s
    fields, under their own names), on which GPU and software, when and by whom."""
    return {"gpu": gpu, "capability": capability, "driver": driver, "cuda": cuda,
            "torch": torch, "proof": proof, "proven": proven, "passed": passed,
            "reason": reason, "seconds": seconds, "proven_at": proven_at, "host": host}


def signed_at(predicate_type: str, predicate: Mapping[str, Any]) -> datetime | None:
    """When the statement says it was signed: a build's finish, an upload's time, a proof's."""
    if predicate_type == SLSA_PROVENANCE:
        run = predicate.get("runDetails")
        meta = run.get("metadata") if isinstance(run, Mapping) else None
        return parse_time(meta.get("finishedOn")) if isinstance(meta, Mapping) else None
    if predicate_type == GPU_PROOF_TYPE:
        return parse_time(predicate.get("proven_at"))
    return parse_time(predicate.get("publishedOn"))


def _proof_line(p: Mapping[str, Any], signer: str) -> str:
    verdict = "proven" if p.get("passed") is True else "FAILED"
    seconds = p.get("seconds")
    took = f", {seconds:.1f} s" if isinstance(seconds, int | float) else ""
    why = f": {p.get('reason')}" if p.get("passed") is not True and p.get("reason") else ""
    return (f"{verdict} on {p.get('gpu') or 'a GPU'} (sm_{p.get('capability') or '?'}), "
            f"driver {p.get('driver') or '?'}, CUDA {p.get('cuda') or '?'}, "
            f"torch {p.get('torch') or '?'} ({p.get('proof') or '?'} proof{took}, "
            f"{p.get('proven_at')} on {p.get('host') or '?'}){why}, by {signer}")


def summary(predicate_type: str, predicate: Mapping[str, Any], signer: str) -> list[str]:
    """Who made the file from what, in a few lines (``wheelhouse verify-provenance``, pages);
    a GPU proof in one."""
    if predicate_type == GPU_PROOF_TYPE:
        return [_proof_line(predicate, signer)]
    if predicate_type != SLSA_PROVENANCE:
        return [f"uploaded by {predicate.get('publisher')} at {predicate.get('publishedOn')}, "
                f"attested by {signer}"]
    definition = predicate.get("buildDefinition") or {}
    run = predicate.get("runDetails") or {}
    ext = definition.get("externalParameters") or {}
    internal = definition.get("internalParameters") or {}
    meta = run.get("metadata") or {}
    lines = [f"built by {signer} on {internal.get('host')} (build {meta.get('invocationId')}, "
             f"{meta.get('startedOn')} to {meta.get('finishedOn')})",
             f"request: {ext.get('project')} {ext.get('version')} for torch {ext.get('torch')}, "
             f"CUDA {ext.get('cuda')}, {ext.get('python')}, archs {ext.get('archs') or 'all'}"]
    for dep in definition.get("resolvedDependencies") or []:
        if isinstance(dep, Mapping):
            sha = (dep.get("digest") or {}).get("sha256")
            lines.append(f"from {dep.get('name')}: {dep.get('uri')}"
                         + (f" (sha256 {sha})" if sha else ""))
    for item in run.get("byproducts") or []:
        if isinstance(item, Mapping) and item.get("name") == "device-code":
            code = item.get("annotations") or {}
            lines.append(f"device code: SASS {code.get('sass')}, PTX {code.get('ptx')}")
    if "max_jobs" in internal:
        lines.append(f"MAX_JOBS={internal['max_jobs']}")
    return lines
