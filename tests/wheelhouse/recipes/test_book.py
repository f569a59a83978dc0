"""Recipes are data: TOML files that set a project's build environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from wheelhouse.config import Config
from wheelhouse.errors import InvalidRecipe
from wheelhouse.recipes.book import (
    GENERIC,
    available_recipes,
    load_recipe,
    recipe_dirs,
    recipe_projects,
)
from wheelhouse.variants import Variant

FIXTURE_RECIPES = Path(__file__).parents[2] / "fixtures" / "recipes"


def test_flash_attn_recipe_sets_what_its_setup_py_reads() -> None:
    recipe = load_recipe("Flash_Attn")
    assert recipe.name == "flash-attn"
    assert not recipe.relabel  # the label goes into METADATA itself
    env = recipe.environment(Variant.of("2.14", "13.0", ["sm90", "sm80"]), max_jobs=3)
    assert env == {
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",
        "FLASH_ATTENTION_SKIP_CUDA_BUILD": "FALSE",
        "FLASH_ATTN_CUDA_ARCHS": "80;90",
        "FLASH_ATTN_LOCAL_VERSION": "cu130torch2.14.sm80.sm90",
        "NVCC_THREADS": "2",  # two targets keep two of the recipe's four threads busy
    }
    fat = recipe.environment(Variant.of("2.8", "12.8"), max_jobs=1)
    assert fat["FLASH_ATTN_CUDA_ARCHS"] == "80;90;100;120" and fat["NVCC_THREADS"] == "4"
    assert fat["FLASH_ATTN_LOCAL_VERSION"] == "cu128torch2.8"
    # Each arch is hours of nvcc: a request for several is one job per arch unless it says not.
    assert recipe.split_archs and not load_recipe("some-other-ext").split_archs


@pytest.mark.parametrize(("text", "archs", "targets", "threads"), [
    ("nvcc_threads = 4", ["sm90"], 1, 1),  # nvcc runs one target per thread: one is busy
    ("nvcc_threads = 4", ["sm80", "sm90"], 2, 2),
    ("nvcc_threads = 4", [], 2, 2),  # a default variant: the recipe's default_archs (80, 90)
    ("nvcc_threads = 4", ["75", "80", "87", "90", "100", "120"], 6, 4),
    ("nvcc_threads = 4\nptx_target = true", ["sm90"], 2, 2),  # the PTX is a target of its own
    ("nvcc_threads = 1", ["sm80", "sm90"], 2, 1),
])
def test_nvcc_threads_never_exceed_the_device_targets(
        tmp_path: Path, text: str, archs: list[str], targets: int, threads: int) -> None:
    (tmp_path / "fa.toml").write_text(f'project = "flash-attn"\n{text}\n'
                                      '[env]\nNVCC_THREADS = "${nvcc_threads}"\n')
    recipe = load_recipe("flash-attn", [tmp_path])
    variant = Variant.of("2.14", "13.0", archs)
    assert recipe.targets_for(variant) == targets and recipe.threads_for(variant) == threads
    assert recipe.environment(variant, max_jobs=1) == {"NVCC_THREADS": str(threads)}


def test_unknown_projects_use_the_generic_recipe_and_get_relabelled() -> None:
    recipe = load_recipe("torch-sparse")
    assert recipe.name == GENERIC and recipe.relabel and recipe.patches == ()
    env = recipe.environment(Variant.of("2.8", "12.8", ["90a", "120"]), max_jobs=2)
    # FORCE_CUDA: builders have no GPU, and torch-sparse & co. skip their CUDA code without it.
    assert env == {"FORCE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "9.0a;12.0"}
    fat = recipe.environment(Variant.of("2.14", "13.0"), max_jobs=2)
    assert fat == {"FORCE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "8.0;9.0"}


@pytest.mark.parametrize(("project", "prefix", "extension", "load"), [
    ("causal-conv1d", "CAUSAL_CONV1D", "causal_conv1d_cuda", "causal_conv1d"),
    ("mamba-ssm", "MAMBA", "selective_scan_cuda", "selective_scan_cuda"),
])
def test_tri_dao_style_recipes_force_the_build_and_label_metadata(
    project: str, prefix: str, extension: str, load: str
) -> None:
    recipe = load_recipe(project)
    assert recipe.name == project and not recipe.relabel
    assert recipe.import_check == (extension,) and recipe.load_check == (load,)
    assert recipe.nvcc_threads == 4  # setup.py hard-codes --threads 4
    narrowed = recipe.environment(Variant.of("2.14", "13.0", ["sm90", "sm80"]), max_jobs=3)
    assert narrowed == {
        f"{prefix}_FORCE_BUILD": "TRUE",
        f"{prefix}_SKIP_CUDA_BUILD": "FALSE",
        f"{prefix}_LOCAL_VERSION": "cu130torch2.14.sm80.sm90",
        "TORCH_CUDA_ARCH_LIST": "8.0;9.0",  # read by the recipe's cuda-archs patch
    }
    # A default variant leaves setup.py's own architecture list alone.
    fat = recipe.environment(Variant.of("2.14", "13.0"), max_jobs=3)
    assert fat["TORCH_CUDA_ARCH_LIST"] == "" and fat[f"{prefix}_LOCAL_VERSION"] == "cu130torch2.14"


@pytest.mark.parametrize("project", ["torch-scatter", "torch-cluster", "torch-spline-conv"])
def test_pyg_recipes_build_like_generic_and_check_their_cuda_libraries(project: str) -> None:
    recipe = load_recipe(project)
    generic = load_recipe(GENERIC)
    assert recipe.name == project and recipe.relabel
    variant = Variant.of("2.14", "13.0", ["sm90"])
    assert recipe.environment(variant, max_jobs=2) == generic.environment(variant, max_jobs=2)
    package = project.replace("-", "_")
    assert recipe.load_check == (package,)
    assert f"{package}._version_cuda" in recipe.import_check
    assert all(m.startswith(f"{package}._") and m.endswith("_cuda") for m in recipe.import_check)


@pytest.mark.parametrize(("project", "version", "torch", "ids"), [
    ("flash-attn", "2.8.3.post2", "2.14.1+cu130", ["cxx20"]),
    ("flash-attn", "2.7.4.post1", "2.14", ["cxx20"]),
    ("flash-attn", "2.8.3.post2", "2.13.0", []),  # 2.13's headers still accept C++17
    ("flash-attn", "2.7.3", "2.14", []),
    ("mamba-ssm", "2.3.2.post1", "2.14", ["cxx20", "cuda-archs"]),
    ("mamba-ssm", "2.3.2.post1", "2.12", ["cuda-archs"]),
    ("mamba-ssm", "2.2.4", "2.14", ["cxx20"]),
    ("causal-conv1d", "1.7.0", "2.14", ["cuda-archs"]),
    ("causal-conv1d", "1.5.2", "2.14", []),
    ("torch-scatter", "2.1.2", "2.14", ["ninja"]),
    ("torch-scatter", "2.1.2", "2.8", ["ninja"]),  # whatever the torch
    ("torch-scatter", "2.0.8", "2.14", []),
    ("torch-cluster", "1.6.3", "2.14", ["ninja"]),
    ("torch-spline-conv", "1.2.2", "2.14", ["ninja"]),
    ("torch-spline-conv", "1.2.1", "2.14", []),  # already builds with ninja
])
def test_builtin_recipes_pick_their_patches_by_version(
    project: str, version: str, torch: str, ids: list[str]
) -> None:
    patches = load_recipe(project).patches_for(Version(version), Version(torch))
    assert [p.id for p in patches] == ids


def test_extra_recipe_dirs_add_projects() -> None:
    assert "cudaext" not in recipe_projects()
    assert "cudaext" in recipe_projects([FIXTURE_RECIPES])
    recipe = load_recipe("cudaext", [FIXTURE_RECIPES])
    assert recipe.default_archs == ("80",) and recipe.import_check == ("cudaext._C",)
    assert set(available_recipes([FIXTURE_RECIPES])) >= {"flash-attn", "generic", "cudaext"}


@pytest.mark.parametrize(("setting", "dirs"), [
    ("", []),
    ("/srv/recipes", [Path("/srv/recipes")]),
    ("/srv/a:/srv/b", [Path("/srv/a"), Path("/srv/b")]),
    ("/srv/a::/srv/b:", [Path("/srv/a"), Path("/srv/b")]),
])
def test_recipe_dirs_come_from_the_config(setting: str, dirs: list[Path]) -> None:
    assert recipe_dirs(Config(recipe_dirs=setting)) == dirs


def test_configured_recipe_dirs_are_searched_first() -> None:
    config = Config(recipe_dirs=f"/nonexistent:{FIXTURE_RECIPES}")
    assert "cudaext" in recipe_projects(recipe_dirs(config))
    assert load_recipe("cudaext", recipe_dirs(config)).path == FIXTURE_RECIPES / "cudaext.toml"


def test_extra_dirs_override_builtin_recipes(tmp_path: Path) -> None:
    (tmp_path / "fa.toml").write_text(
        'project = "flash-attn"\nnvcc_threads = 2\njob_memory_gib = 6\n[env]\nX = "${cuda}"\n')
    recipe = load_recipe("flash-attn", [tmp_path])
    assert recipe.nvcc_threads == 2 and recipe.job_memory_bytes == 6 * 1024**3
    assert recipe.environment(Variant.of("2.8", "12.8"), max_jobs=1) == {"X": "12.8"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('project = "x"\n[env]\nA = "${nope}"\n', "unknown or malformed template"),
        ('project = "x"\n[env]\nA = "${archs"\n', "unknown or malformed template"),
        ('project = "x"\nshell = "rm -rf /"\n', "unknown keys"),
        ('description = "no project"\n', "'project' is required"),
        ('project = "x"\ndefault_archs = ["61"]\n', "unknown GPU architecture"),
        ('project = "x"\nnvcc_threads = 0\n', "nvcc_threads"),
        ('project = "x"\nptx_target = 1\n', "ptx_target must be true or false"),
        ('project = "x"\nsplit_archs = "yes"\n', "split_archs must be true or false"),
        ('project = "x"\njob_memory_gib = -1\n', "job_memory_gib"),
        ('project = "x"\nbuild_requires = "ninja"\n', "list of strings"),
        ('project = "x"\n[env]\nA = 1\n', "map names to strings"),
        ("project = \n", "Invalid value"),
        ('project = "x"\nload_check = ["import torch_scatter"]\n', "not a module name"),
        ('project = "x"\nload_check = ["os; os.system(1)"]\n', "not a module name"),
        ('project = "x"\nload_check = ["a.class"]\n', "not a module name"),
        ('project = "x"\nload_check = "torch_scatter"\n', "list of strings"),
        ('project = "x"\n[[patch]]\nid = "x"\n', "description"),
    ],
)
def test_bad_recipes_are_refused_at_load_time(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(InvalidRecipe, match=message):
        load_recipe("x", [tmp_path])


def test_load_check_names_modules(tmp_path: Path) -> None:
    (tmp_path / "ts.toml").write_text(
        'project = "torch-scatter"\nload_check = ["torch_scatter", "torch_scatter.utils"]\n')
    recipe = load_recipe("torch_scatter", [tmp_path])
    assert recipe.load_check == ("torch_scatter", "torch_scatter.utils")
    assert load_recipe("flash-attn").load_check == ("flash_attn",)
    assert load_recipe("anything-else").load_check == ()
