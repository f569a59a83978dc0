"""The toolkit step: which CUDA toolkit compiles this build."""

from __future__ import annotations

from pathlib import Path

from wheelhouse.errors import BuildFailed, FailureKind, InfrastructureError
from wheelhouse.fleet import ToolkitInfo, pick_toolkit
from worker.buildenv import install_env
from worker.capabilities import DEFAULT_ROOTS, discover_toolkits
from worker.steps.context import BuildContext, uv_binary
from worker.toolkit import ToolkitError, provision, provisionable_cuda, toolkit_root


def choose_toolkit(ctx: BuildContext, toolkits: list[ToolkitInfo] | None) -> ToolkitInfo:
    """A host toolkit of torch's CUDA major.minor; else one installed from NVIDIA's wheels;
    else a newer minor of the same major; else the combination is incompatible here.

    ``toolkits`` defaults to what this host has.
    """
    ctx.journal.phase("toolkit")
    spec = ctx.spec
    root = toolkit_root(ctx.config)
    found = (toolkits if toolkits is not None
             else discover_toolkits(roots=(*DEFAULT_ROOTS, root)))
    toolkit = next((t for t in found if t.cuda == spec.cuda), None)
    if toolkit is None and ctx.config.toolkit_wheels and spec.cuda in provisionable_cuda():
        toolkit = _provision(ctx, root)
    toolkit = toolkit or pick_toolkit(found, spec.cuda)
    if toolkit is None:
        have = ", ".join(f"{t.cuda} ({t.home})" for t in found) or "none"
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"no CUDA {spec.cuda.split('.')[0]}.x toolkit of version "
                          f"{spec.cuda} or newer on this host; found: {have}")
    ctx.say(f"CUDA toolkit {toolkit.release} at {toolkit.home}")
    provisioned = Path(toolkit.home).is_relative_to(root)
    ctx.journal.measured(toolkit=toolkit.release + (" (wheels)" if provisioned else ""))
    return toolkit


def _provision(ctx: BuildContext, root: Path) -> ToolkitInfo:
    cuda = ctx.spec.cuda
    ctx.say(f"no CUDA {cuda} toolkit on this host: installing nvcc, the runtime headers and "
            f"CCCL from NVIDIA's wheels into {root}")
    uv = uv_binary()

    def attempt() -> ToolkitInfo:
        try:
            return provision(cuda, root, uv=uv, index_url=ctx.config.build_index_url,
                             env=install_env())
        except ToolkitError as exc:
            raise InfrastructureError(str(exc)) from None

    return ctx.retried(f"installing the CUDA {cuda} toolkit", attempt)
