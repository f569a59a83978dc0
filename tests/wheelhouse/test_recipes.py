"""Recipes are data: TOML files that set a project's build environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from wheelhouse.config import Config
from wheelhouse.errors import InvalidRecipe
from wheelhouse.recipes import (
    GENERIC,
    available_recipes,
    load_recipe,
    recipe_dirs,
    recipe_projects,
)
from wheelhouse.variants import Variant

FIXTURE_RECIPES = Path(__file__).parent.parent / "fixtures" / "recipes"


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
        "NVCC_THREADS": "4",
    }
    fat = recipe.environment(Variant.of("2.8", "12.8"), max_jobs=1)
    assert fat["FLASH_ATTN_CUDA_ARCHS"] == "80;90;100;120"
    assert fat["FLASH_ATTN_LOCAL_VERSION"] == "cu128torch2.8"


def test_unknown_projects_use_the_generic_recipe_and_get_relabelled() -> None:
    recipe = load_recipe("causal-conv1d")
    assert recipe.name == GENERIC and recipe.relabel
    env = recipe.environment(Variant.of("2.8", "12.8", ["90a", "120"]), max_jobs=2)
    assert env == {"TORCH_CUDA_ARCH_LIST": "9.0a;12.0"}


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
        ('project = "x"\njob_memory_gib = -1\n', "job_memory_gib"),
        ('project = "x"\nbuild_requires = "ninja"\n', "list of strings"),
        ('project = "x"\n[env]\nA = 1\n', "map names to strings"),
        ("project = \n", "Invalid value"),
    ],
)
def test_bad_recipes_are_refused_at_load_time(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(InvalidRecipe, match=message):
        load_recipe("x", [tmp_path])
