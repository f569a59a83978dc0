"""The venv step: a fresh build venv with torch and the build requirements, and the torch check."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.variants import Variant
from worker.buildenv import install_env, sanitized_env
from worker.sandbox import safefs
from worker.sandbox.wrapper import python_prefix
from worker.steps.context import BuildContext, uv_binary
from worker.supervision.runner import Runner

_TORCH_INFO = "wheelhouse-torch-info: "


@dataclass(frozen=True)
class BuildVenv:
    """The build venv, and what the worker learned of it before anything the sdist chose was
    installed into it (a wheel may overwrite ``pyvenv.cfg`` and ``bin/python``)."""

    python: Path
    """``<venv>/bin/python``: only ever run inside the sandbox once requirements are in."""
    interpreter: Path
    """The interpreter the venv was made from: the worker's ``uv`` installs into the venv with
    it (``--prefix``), never with the venv's own Python, whose ``.pth`` files the sdist chose."""
    prefix: Path | None
    """The installation ``interpreter`` belongs to, mounted read-only into the sandbox."""
    seen: Path
    """``python`` where sandboxed programs see it (``/wheelhouse/venv/bin/python``,
    :meth:`Runner.seen`): what they are started as, and what their paths derive from."""

    @property
    def root(self) -> Path:
        return self.python.parent.parent

    @property
    def read_only(self) -> tuple[Path, ...]:
        """What a sandboxed program needs to run this venv's Python."""
        return (self.root, *([self.prefix] if self.prefix is not None else []))


def create_venv(ctx: BuildContext, run: Runner, src: Path | None) -> BuildVenv:
    """Create the build venv, install torch and the build requirements, check torch.

    ``src`` is the unpacked sdist whose ``pyproject.toml`` names more build requirements; a
    GPU proof, which builds nothing, passes None and gets torch and the recipe's.

    The worker does this with its network, before any code of the sdist runs: wheels only
    (``--no-build``), in one ``uv`` call, since from then on the venv's Python runs code
    the sdist chose and only the sandbox may start it.
    """
    ctx.journal.phase("venv")
    spec, config = ctx.spec, ctx.config
    uv = uv_binary()
    root = ctx.venv_root
    env = install_env()
    # Relocatable: its scripts (ninja's, pip's) start the Python beside them, wherever the
    # sandbox shows the venv (Runner.seen), rather than the path written here.
    run.install([uv, "venv", "--seed", "--clear", "--relocatable", "--python", spec.python,
                 str(root)], env=env, what="creating the venv")
    python = root / "bin" / "python"
    venv = BuildVenv(python=python, interpreter=Path(os.path.realpath(python)),
                     prefix=python_prefix(python), seen=run.seen(python))
    argv = [uv, "pip", "install", "--python", str(python), "--no-build",
            *index_args(config, spec.variant)]
    requires = [f"torch=={spec.torch}.*", *ctx.recipe.build_requires,
                *(_pyproject_requires(src) if src is not None else [])]
    run.install([*argv, *requires], env=env,
                what="installing torch and the build requirements")
    _check_torch(ctx, run, venv)
    return venv


def index_args(config: Config, variant: Variant) -> list[str]:
    """Where a build venv's torch and build requirements come from: the index's root of the
    build's variant where ``build_through_index`` names the index (its pull-through cache then
    fetches each file once for the fleet; what it doesn't cache it redirects upstream), else
    the build index with the torch index beside it; torch find-links either way."""
    cu = variant.cu
    if config.build_through_index:
        argv = ["--index-url", f"{config.build_through_index.rstrip('/')}/{variant.key}/simple/"]
    else:
        argv = ["--index-url", config.build_index_url]
        if config.torch_index_url:
            argv += ["--extra-index-url", config.torch_index_url.format(cu=cu)]
    for link in config.torch_find_links.split():
        argv += ["--find-links", link.format(cu=cu)]
    return argv


def _check_torch(ctx: BuildContext, run: Runner, venv: BuildVenv) -> None:
    """torch imports in the sandbox, built for the spec's CUDA and C++ ABI."""
    spec = ctx.spec
    code = (f"import json, torch; print({_TORCH_INFO!r} + json.dumps({{"
            "'version': torch.__version__, 'cuda': torch.version.cuda, "
            "'abi': bool(torch.compiled_with_cxx11_abi())}), flush=True)")
    ran = run.sandboxed([str(venv.seen), "-c", code], env=sanitized_env(os.environ),
                        cwd=ctx.workspace / "home", what="checking torch",
                        read_only=venv.read_only)
    tail = [line for line in ctx.log.tail(100_000).splitlines() if line.strip()]
    found = [line for line in tail if line.startswith(_TORCH_INFO)]
    if ran.returncode != 0 or not found:
        raise BuildFailed(FailureKind.INFRASTRUCTURE,
                          f"torch does not import in the build venv: {(tail or [''])[-1][:300]}")
    # Printed from inside the sandbox, where the sdist's requirements could print anything:
    # parsed as data, never trusted beyond this check of the venv.
    try:
        info = json.loads(found[-1].removeprefix(_TORCH_INFO))
    except ValueError:
        info = None
    if not (isinstance(info, dict) and isinstance(info.get("version"), str)
            and isinstance(info.get("cuda"), str | None)
            and isinstance(info.get("abi"), bool)):
        raise BuildFailed(FailureKind.INFRASTRUCTURE,
                          f"the torch check printed {found[-1][:200]!r}")
    ctx.say(f"torch {info['version']} (CUDA {info['cuda']}, cxx11abi {info['abi']})")
    ctx.journal.measured(torch=info["version"])
    if info["cuda"] != spec.cuda:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"the configured torch source gave torch {info['version']} built "
                          f"for CUDA {info['cuda'] or 'none (CPU)'}, not {spec.cuda}")
    if info["abi"] != spec.cxx11abi:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"torch {info['version']} uses cxx11abi={int(info['abi'])}, the "
                          f"spec asks for {int(spec.cxx11abi)}")


MAX_PYPROJECT_BYTES = 1024 * 1024


def _pyproject_requires(src: Path) -> list[str]:
    """``[build-system] requires`` of the sdist, minus torch (which the spec pins).

    The worker installs these outside the sandbox, so each must be a name and version
    specifiers: a direct reference (``name @ file:///…``, ``name @ https://…``) or a local path
    would make it read its own disk into the build or connect where the sdist says, and fails
    the build at once (``unsafe-requirement``).
    """
    try:
        text = safefs.read_text(src, "pyproject.toml", max_bytes=MAX_PYPROJECT_BYTES)
    except FileNotFoundError:
        return []
    except OSError as exc:  # UnsafePath among them: a link, a FIFO, too big
        raise BuildFailed(FailureKind.UNSAFE_ARCHIVE, f"pyproject.toml: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return []
    requires = data.get("build-system", {}).get("requires", [])
    out = []
    for raw in requires if isinstance(requires, list) else []:
        try:
            req = Requirement(str(raw))
        except InvalidRequirement:
            raise BuildFailed(FailureKind.UNSAFE_REQUIREMENT,
                              f"build requirement {str(raw)[:200]!r} is not a name and version "
                              "specifiers (a local path?); workers install only those") from None
        if req.url is not None:
            raise BuildFailed(FailureKind.UNSAFE_REQUIREMENT,
                              f"build requirement {str(raw)[:200]!r} is a direct reference; "
                              "workers install only names and version specifiers from the "
                              "configured index")
        if req.name.lower() != "torch":
            out.append(str(req))
    return out
