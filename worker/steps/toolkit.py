"""The toolkit step: which CUDA toolkit compiles this build."""

from __future__ import annotations

from pathlib import Path

from wheelhouse.builds.fleet import ToolkitInfo, pick_toolkit
from wheelhouse.errors import BuildFailed, FailureKind
from worker.buildenv import install_env
from worker.capabilities import DEFAULT_ROOTS, discover_toolkits
from worker.errors import ToolkitUnavailable
from worker.steps.context import BuildContext, uv_binary
from worker.toolkits.provision import Sources, proof, provision, toolkit_root, wanted_versions


def choose_toolkit(ctx: BuildContext, toolkits: list[ToolkitInfo] | None) -> ToolkitInfo:
    """A host toolkit of torch's CUDA major.minor; else the one this worker provisions for it
    (``WHEELHOUSE_TOOLKIT_PROVISION``); else a newer minor of the same major; else the
    combination is incompatible here.

    ``toolkits`` defaults to what this host has.
    """
    ctx.journal.phase("toolkit")
    spec = ctx.spec
    root = toolkit_root(ctx.config)
    found = (toolkits if toolkits is not None
             else discover_toolkits(roots=(*DEFAULT_ROOTS, root)))
    toolkit = next((t for t in found if t.cuda == spec.cuda), None)
    if toolkit is None and spec.cuda in wanted_versions(ctx.config.toolkit_provision):
        toolkit = _provision(ctx, root)
    toolkit = toolkit or pick_toolkit(found, spec.cuda)
    if toolkit is None:
        have = ", ".join(f"{t.cuda} ({t.home})" for t in found) or "none"
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"no CUDA {spec.cuda.split('.')[0]}.x toolkit of version "
                          f"{spec.cuda} or newer on this host; found: {have} "
                          f"(WHEELHOUSE_TOOLKIT_PROVISION={spec.cuda} provisions one)")
    ctx.say(f"CUDA toolkit {toolkit.release} at {toolkit.home}")
    provisioned = proof(Path(toolkit.home)) if Path(toolkit.home).is_relative_to(root) else None
    ctx.journal.measured(toolkit=toolkit.release + (f" ({provisioned.get('source')})"
                                                    if provisioned else ""))
    return toolkit


def _provision(ctx: BuildContext, root: Path) -> ToolkitInfo:
    cuda = ctx.spec.cuda
    ctx.say(f"no CUDA {cuda} toolkit on this host: provisioning one into {root}")
    sources = Sources.from_config(ctx.config, uv=uv_binary(), env=install_env())

    def attempt() -> ToolkitInfo:
        try:
            return provision(cuda, root, sources=sources, say=ctx.say)
        except ToolkitUnavailable as exc:
            # The same sources give the same answer: not an infrastructure failure.
            raise BuildFailed(FailureKind.INCOMPATIBLE, str(exc)) from None

    return ctx.retried(f"installing the CUDA {cuda} toolkit", attempt)
