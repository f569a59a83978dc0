"""Recipes: per-project build knowledge as data (``wheelhouse/recipes/<project>.toml``).

A recipe names the build requirements, the environment the project's ``setup.py`` honours, the
architectures built by default, the per-job memory that sizes MAX_JOBS, the modules to load after
the build, and the patches its sdist needs (``wheelhouse.recipes.patches``). Environment values are
``string.Template`` strings over a fixed set of names (``${archs}``, ``${local_label}``, …), so a
recipe can't run code. A project without its own recipe builds with ``generic.toml``. The schema
and the facts behind each built-in recipe are in docs/recipes.md.
"""

from __future__ import annotations

import keyword
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

from wheelhouse.builds.maxjobs import effective_threads
from wheelhouse.errors import InvalidBuildSpec, InvalidRecipe, InvalidVariant
from wheelhouse.recipes.patches import Patch, parse_patches
from wheelhouse.variants import Variant, normalize_arch

if TYPE_CHECKING:
    from wheelhouse.config import Config

BUILTIN_DIR = Path(__file__).parent
GENERIC = "generic"
#: The GPU proofs a recipe may name (``worker.gpuproof_program.PROOFS`` runs them): ``generic``
#: (the GPU's architecture among the wheel's SASS, a kernel run), ``flash-attn`` (then
#: ``flash_attn_func`` forward and backward against a reference attention, fp16 and bf16).
GPU_PROOFS = ("generic", "flash-attn")
GIB = 1024**3

#: Names a recipe's ``[env]`` values may use.
TEMPLATE_NAMES = (
    "archs",  # 80;90  (flash-attn's FLASH_ATTN_CUDA_ARCHS)
    "torch_cuda_arch_list",  # 8.0;9.0  (torch's TORCH_CUDA_ARCH_LIST)
    # 8.0;9.0 for a variant narrowed to archs, empty for a default (fat) one: for setup.py files
    # whose own architecture list is the better default
    "variant_torch_cuda_arch_list",
    "local_label",  # cu130torch2.14
    "nvcc_threads",
    "max_jobs",
    "cuda",  # 13.0
    "torch",  # 2.14
)


@dataclass(frozen=True)
class Recipe:
    name: str
    """The recipe's name: the project it is for, or ``generic``."""
    description: str = ""
    build_requires: tuple[str, ...] = ()
    import_check: tuple[str, ...] = ()
    """Extension modules that must be in the wheel (the load check loads every library)."""
    load_check: tuple[str, ...] = ()
    """Modules to import (after ``import torch``) as a user would, to check the wheel loads."""
    relabel: bool = True
    """Rewrite the built wheel into the variant's local version (when METADATA lacks it)."""
    default_archs: tuple[str, ...] = ("80", "90")
    job_memory_gib: float = 2.0
    """Peak memory of one compile job per nvcc thread, before any learned figure exists."""
    nvcc_threads: int = 1
    """nvcc's ``--threads``: at most one per device target is ever busy (``threads_for``)."""
    ptx_target: bool = False
    """setup.py adds a PTX target (``code=compute_XX``) to the SASS ones: one more target."""
    split_archs: bool = False
    """A request for several architectures becomes one job per architecture by default
    (``wheelhouse.builds.fanout``), each publishing a single-arch wheel: for projects where each
    architecture is a long build, so that a fleet builds them side by side."""
    gpu_proof: str = "generic"
    """The named proof a GPU runs on its wheels (one of :data:`GPU_PROOFS`, code of the
    product: a recipe runs no code of its own)."""
    env: Mapping[str, str] = field(default_factory=dict)
    patches: tuple[Patch, ...] = ()
    """Changes to the sdist, each scoped to project and torch versions."""
    path: Path | None = None

    @property
    def job_memory_bytes(self) -> int:
        return int(self.job_memory_gib * GIB)

    def archs_for(self, variant: Variant) -> tuple[str, ...]:
        """The architectures to build: the variant's narrowed set, else the recipe's default."""
        return variant.archs or self.default_archs

    def targets_for(self, variant: Variant) -> int:
        """Device targets each compile job compiles: a ``-gencode`` pair per architecture,
        plus the PTX one where the recipe's setup.py adds it."""
        return len(self.archs_for(variant)) + int(self.ptx_target)

    def threads_for(self, variant: Variant) -> int:
        """The NVCC_THREADS to build ``variant`` with: no more than its targets, since nvcc
        runs one target per thread."""
        return effective_threads(self.nvcc_threads, self.targets_for(variant))

    def patches_for(self, version: Version, torch: Version) -> tuple[Patch, ...]:
        """The patches to apply to ``version``'s sdist when building against ``torch``.

        ``torch`` is the installed torch's version where known (``2.14.1+cu130``), else the
        variant's (``2.14``); ranges like ``>=2.14`` match both.
        """
        return tuple(p for p in self.patches if p.applies_to(version, torch))

    def environment(self, variant: Variant, *, max_jobs: int) -> dict[str, str]:
        """The recipe's ``[env]`` with its templates filled in for ``variant``."""
        archs = self.archs_for(variant)
        values = {
            "archs": ";".join(archs),
            "torch_cuda_arch_list": ";".join(_dotted(a) for a in archs),
            "variant_torch_cuda_arch_list": ";".join(_dotted(a) for a in variant.archs),
            "local_label": variant.local_label,
            "nvcc_threads": str(self.threads_for(variant)),
            "max_jobs": str(max_jobs),
            "cuda": variant.cuda,
            "torch": variant.torch,
        }
        out: dict[str, str] = {}
        for key, raw in self.env.items():
            try:
                out[key] = Template(raw).substitute(values)
            except (KeyError, ValueError) as exc:
                raise InvalidRecipe(
                    f"recipe {self.name}: env {key}={raw!r} uses an unknown or malformed "
                    f"template ({exc}); known: {', '.join(TEMPLATE_NAMES)}"
                ) from None
        return out


def _dotted(arch: str) -> str:
    """``90a`` → ``9.0a``, ``120`` → ``12.0`` (TORCH_CUDA_ARCH_LIST spelling)."""
    suffix = "a" if arch.endswith("a") else ""
    digits = arch.rstrip("a")
    return f"{digits[:-1]}.{digits[-1]}{suffix}"


def _strings(name: str, value: Any, path: Path) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRecipe(f"{path}: {name} must be a list of strings")
    return tuple(value)


def _module_names(value: Any, path: Path) -> tuple[str, ...]:
    names = _strings("load_check", value, path)
    for name in names:
        # Module names, not statements: the check imports them itself, so a recipe runs no code.
        if not all(part.isidentifier() and not keyword.iskeyword(part)
                   for part in name.split(".")):
            raise InvalidRecipe(f"{path}: load_check {name!r} is not a module name "
                                "(e.g. torch_scatter or mamba_ssm.ops)")
    return names


def parse_recipe(path: Path) -> Recipe:
    """Read and validate one recipe file."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRecipe(f"{path}: {exc}") from None
    known = {"project", "description", "build_requires", "import_check", "load_check",
             "relabel", "default_archs", "job_memory_gib", "nvcc_threads", "ptx_target",
             "split_archs", "gpu_proof", "env", "patch"}
    unknown = set(data) - known
    if unknown:
        raise InvalidRecipe(f"{path}: unknown keys {sorted(unknown)}")
    name = data.get("project")
    if not isinstance(name, str) or not name:
        raise InvalidRecipe(f"{path}: 'project' is required")
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidRecipe(f"{path}: [env] must map names to strings")
    try:
        archs = tuple(normalize_arch(a) for a in _strings(
            "default_archs", data.get("default_archs", ["80", "90"]), path))
    except InvalidVariant as exc:
        raise InvalidRecipe(f"{path}: {exc}") from None
    memory = data.get("job_memory_gib", 2.0)
    threads = data.get("nvcc_threads", 1)
    if not isinstance(memory, int | float) or memory <= 0:
        raise InvalidRecipe(f"{path}: job_memory_gib must be a positive number")
    if not isinstance(threads, int) or not 1 <= threads <= 64:
        raise InvalidRecipe(f"{path}: nvcc_threads must be an integer from 1 to 64")
    relabel = data.get("relabel", True)
    ptx = data.get("ptx_target", False)
    split = data.get("split_archs", False)
    for key, value in (("relabel", relabel), ("ptx_target", ptx), ("split_archs", split)):
        if not isinstance(value, bool):
            raise InvalidRecipe(f"{path}: {key} must be true or false")
    gpu_proof = data.get("gpu_proof", "generic")
    if gpu_proof not in GPU_PROOFS:
        raise InvalidRecipe(f"{path}: gpu_proof must be one of {', '.join(GPU_PROOFS)}, "
                            f"not {gpu_proof!r}")
    recipe_name = canonicalize_name(name) if name != GENERIC else GENERIC
    recipe = Recipe(
        name=recipe_name,
        description=str(data.get("description", "")),
        build_requires=_strings("build_requires", data.get("build_requires", []), path),
        import_check=_strings("import_check", data.get("import_check", []), path),
        load_check=_module_names(data.get("load_check", []), path),
        relabel=relabel,
        default_archs=archs,
        job_memory_gib=float(memory),
        nvcc_threads=threads,
        ptx_target=ptx,
        split_archs=split,
        gpu_proof=gpu_proof,
        env=dict(env),
        patches=parse_patches(data.get("patch"), recipe=recipe_name, recipe_path=path),
        path=path,
    )
    # Fail at load time, not mid-build, on a template typo.
    recipe.environment(Variant.of("2.8", "12.8"), max_jobs=1)
    return recipe


def recipe_dirs(config: Config) -> list[Path]:
    """The configured extra recipe directories (``WHEELHOUSE_RECIPE_DIRS``), first one first;
    the built-in recipes are searched after them."""
    return list(config.extra_recipe_dirs)


def _search_path(extra_dirs: Iterable[Path | str]) -> list[Path]:
    return [*(Path(d) for d in extra_dirs if str(d)), BUILTIN_DIR]


def available_recipes(extra_dirs: Iterable[Path | str] = ()) -> dict[str, Recipe]:
    """Every recipe by name; files in ``extra_dirs`` win over the built-in ones."""
    found: dict[str, Recipe] = {}
    for directory in reversed(_search_path(extra_dirs)):
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.toml")):
            recipe = parse_recipe(path)
            found[recipe.name] = recipe
    return found


def load_recipe(project: str, extra_dirs: Iterable[Path | str] = ()) -> Recipe:
    """The recipe for ``project``, or the generic one."""
    return pick_recipe(available_recipes(extra_dirs), project)


def pick_recipe(recipes: Mapping[str, Recipe], project: str) -> Recipe:
    """``project``'s recipe among ``recipes`` (:func:`available_recipes`), or the generic one."""
    name = canonicalize_name(project)
    if name in recipes:
        return recipes[name]
    if GENERIC not in recipes:
        raise InvalidRecipe("no generic recipe found")
    return recipes[GENERIC]


def recipe_projects(extra_dirs: Iterable[Path | str] = ()) -> list[str]:
    """Projects with a recipe of their own (what the request form offers)."""
    return sorted(n for n in available_recipes(extra_dirs) if n != GENERIC)


# -- which projects may be built --


def allowed_projects(config: Config) -> frozenset[NormalizedName]:
    """The projects builds may be requested for (``WHEELHOUSE_ALLOWED_PROJECTS``); empty means
    any project: those without a recipe of their own build with the generic one."""
    return config.allowed_project_names


def check_allowed(config: Config, project: str) -> None:
    """Raise :class:`InvalidBuildSpec` when the operator's allowlist leaves ``project`` out."""
    allowed = allowed_projects(config)
    if allowed and canonicalize_name(project) not in allowed:
        raise InvalidBuildSpec(
            f"{project[:80]!r} is not built by this server; it builds "
            f"{', '.join(sorted(allowed))} (WHEELHOUSE_ALLOWED_PROJECTS)")

