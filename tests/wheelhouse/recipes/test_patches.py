"""Recipe patches: parsing, version scoping, applying (real trees, real sdists), METADATA notes."""

from __future__ import annotations

import email.parser
import hashlib
import os
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from packaging.version import Version

from tests.helpers import clean_env, make_venv, make_wheel
from tests.wheelhouse.test_wheels import assert_record_matches
from wheelhouse.errors import BuildFailed, FailureKind, InvalidRecipe, PatchFailed
from wheelhouse.recipes.book import load_recipe, parse_recipe
from wheelhouse.recipes.patches import (
    AppliedPatch,
    Patch,
    apply_patches,
    metadata_note,
    note_wheel,
    read_metadata_note,
)
from wheelhouse.wheels import read_metadata

SETUP = """\
nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math"]
cxx_flags = ["-O3", "-std=c++17"]
"""

DIFF = """\
--- a/setup.py
+++ b/setup.py
@@ -1,2 +1,3 @@
 nvcc_flags = ["-O3", "-std=c++17", "--use_fast_math"]
+nvcc_flags += ["--threads", "4"]
 cxx_flags = ["-O3", "-std=c++17"]
"""


def _recipe(tmp_path: Path, body: str, *, diff: str | None = None) -> Path:
    if diff is not None:
        (tmp_path / "thing.diff").write_text(diff)
    path = tmp_path / "thing.toml"
    path.write_text('project = "thing"\n' + body)
    return path


def _patches(tmp_path: Path, body: str, *, diff: str | None = DIFF) -> tuple[Patch, ...]:
    return parse_recipe(_recipe(tmp_path, body, diff=diff)).patches


def _subdir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def _tree(tmp_path: Path, text: str = SETUP) -> Path:
    src = tmp_path / "thing-1.0"
    src.mkdir()
    (src / "setup.py").write_text(text)
    return src


REPLACE = """
[[patch]]
id = "cxx20"
description = "Compile as C++20"
versions = ">=1.0,<2"
torch = ">=2.14"
[[patch.replace]]
file = "setup.py"
old = "-std=c++17"
new = "-std=c++20"
count = 2
"""

DIFF_PATCH = """
[[patch]]
id = "threads"
description = "Four nvcc threads"
diff = "thing.diff"
"""


# --- parsing -----------------------------------------------------------------------------------


def test_a_recipe_declares_replacements_and_diffs(tmp_path: Path) -> None:
    cxx20, threads = _patches(tmp_path, REPLACE + DIFF_PATCH)
    assert (cxx20.recipe, cxx20.id, cxx20.description) == ("thing", "cxx20", "Compile as C++20")
    assert str(cxx20.versions) == "<2,>=1.0" and str(cxx20.torch) == ">=2.14"
    assert [(r.file, r.old, r.new, r.count) for r in cxx20.replacements] == [
        ("setup.py", "-std=c++17", "-std=c++20", 2)]
    assert not cxx20.diff
    assert threads.diff == DIFF.encode() and threads.diff_name == "thing.diff"
    assert threads.sha256 == hashlib.sha256(DIFF.encode()).hexdigest()
    assert str(threads.versions) == "" and str(threads.torch) == ""  # all versions


def test_a_replacement_patch_digest_names_exactly_what_it_changes(tmp_path: Path) -> None:
    (a,) = _patches(_subdir(tmp_path, "a"), REPLACE)
    (same,) = _patches(_subdir(tmp_path, "b"), REPLACE.replace(
        'description = "Compile as C++20"', 'description = "Reworded"'))
    (other,) = _patches(_subdir(tmp_path, "c"), REPLACE.replace("count = 2", "count = 3"))
    assert len(a.sha256) == 64
    assert a.sha256 == same.sha256, "the description is not part of the change"
    assert a.sha256 != other.sha256


@pytest.mark.parametrize(("body", "message"), [
    ('patch = "setup.py"\n', "array of tables"),
    ("[patch]\nid = 'x'\n", "array of tables"),
    ('[[patch]]\ndescription = "d"\ndiff = "thing.diff"\n', "id must be"),
    ('[[patch]]\nid = "Bad_Id"\ndescription = "d"\ndiff = "thing.diff"\n', "id must be"),
    ('[[patch]]\nid = "x"\ndiff = "thing.diff"\n', "description must be one line"),
    ('[[patch]]\nid = "x"\ndescription = "a\\nb"\ndiff = "thing.diff"\n', "one line"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n', "not both or neither"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\n'
     '[[patch.replace]]\nfile = "s"\nold = "a"\nnew = "b"\ncount = 1\n', "not both or neither"),
    ('[[patch]]\nid = "x"\ndescription = "d"\nreplace = []\n', "non-empty array"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "s"\nold = "a"\n'
     'new = "b"\n', "count"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "s"\nold = "a"\n'
     'new = "b"\ncount = 0\n', "count"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "s"\nold = "a"\n'
     'new = "b"\ncount = true\n', "count"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "s"\nold = ""\n'
     'new = "b"\ncount = 1\n', "old \\(non-empty\\)"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "s"\nold = "a"\n'
     'new = "a"\ncount = 1\n', "the same"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "/etc/passwd"\n'
     'old = "a"\nnew = "b"\ncount = 1\n', "relative path inside the sdist"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "a/../../x"\n'
     'old = "a"\nnew = "b"\ncount = 1\n', "relative path inside the sdist"),
    ('[[patch]]\nid = "x"\ndescription = "d"\n[[patch.replace]]\nfile = "s"\nold = "a"\n'
     'new = "b"\ncount = 1\nshell = "rm"\n', "unknown keys"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "missing.diff"\n', "cannot be read"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "../thing.diff"\n', "relative path"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.toml"\n', "not a unified diff"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\nversions = "two"\n',
     "not a version range"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\ntorch = ">=2.14,<"\n',
     "not a version range"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\ntorch = 2.14\n',
     "must be a string"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\nrun = "make"\n',
     "unknown keys"),
    ('[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\n'
     '[[patch]]\nid = "x"\ndescription = "e"\ndiff = "thing.diff"\n', "declared twice"),
])
def test_bad_patches_are_refused_when_the_recipe_loads(
    tmp_path: Path, body: str, message: str
) -> None:
    with pytest.raises(InvalidRecipe, match=message):
        _patches(tmp_path, body)


def test_a_diff_must_lie_beside_its_recipe_even_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside.diff"
    outside.write_text(DIFF)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "link.diff").symlink_to(outside)
    with pytest.raises(InvalidRecipe, match="beside the recipe"):
        _patches(recipes, '[[patch]]\nid = "x"\ndescription = "d"\ndiff = "link.diff"\n',
                 diff=None)


# --- scoping ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("versions", "torch", "version", "torch_version", "applies"), [
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.8.3.post2", "2.14", True),
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.7.4.post1", "2.14.1+cu130", True),
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.8.3", "2.15.0.dev20260801+cu130", True),
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.8.3.post2", "2.13", False),
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.8.3.post2", "2.13.1+cu128", False),
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.8.4", "2.14", False),
    (">=2.7.4,<=2.8.3.post2", ">=2.14", "2.7.3", "2.14", False),
    ("", "", "0.1", "1.0", True),
    ("==1.7.*", "", "1.7.0", "2.8", True),
    ("==1.7.*", "", "1.8.0", "2.8", False),
])
def test_a_patch_applies_only_within_its_versions(
    versions: str, torch: str, version: str, torch_version: str, applies: bool, tmp_path: Path
) -> None:
    body = f'[[patch]]\nid = "x"\ndescription = "d"\ndiff = "thing.diff"\n' \
           f'versions = "{versions}"\ntorch = "{torch}"\n'
    (patch,) = _patches(tmp_path, body)
    assert patch.applies_to(Version(version), Version(torch_version)) is applies


def test_a_recipe_selects_its_patches_for_a_build(tmp_path: Path) -> None:
    recipe = parse_recipe(_recipe(tmp_path, REPLACE + DIFF_PATCH, diff=DIFF))
    assert [p.id for p in recipe.patches_for(Version("1.2"), Version("2.14.1"))] == [
        "cxx20", "threads"]
    assert [p.id for p in recipe.patches_for(Version("1.2"), Version("2.13"))] == ["threads"]
    assert [p.id for p in recipe.patches_for(Version("2.0"), Version("2.14"))] == ["threads"]


# --- applying ----------------------------------------------------------------------------------


def test_replacements_change_the_file_and_report_what_was_applied(tmp_path: Path) -> None:
    (patch,) = _patches(tmp_path, REPLACE)
    src = _tree(tmp_path)
    applied = apply_patches([patch], src)
    assert (src / "setup.py").read_text() == SETUP.replace("c++17", "c++20")
    assert applied == [AppliedPatch(recipe="thing", id="cxx20", description="Compile as C++20",
                                    sha256=patch.sha256)]
    assert AppliedPatch.from_dict(applied[0].to_dict()) == applied[0]
    assert applied[0].ref == "thing/cxx20"


@pytest.mark.parametrize(("text", "found"), [
    (SETUP.replace('cxx_flags = ["-O3", "-std=c++17"]', 'cxx_flags = ["-O3"]'), 1),
    (SETUP.replace("c++17", "c++20"), 0),  # fixed upstream, or applied twice
    (SETUP + 'extra = ["-std=c++17"]\n', 3),
])
def test_a_replacement_that_no_longer_matches_fails_and_changes_nothing(
    tmp_path: Path, text: str, found: int
) -> None:
    (patch,) = _patches(tmp_path, REPLACE)
    src = _tree(tmp_path, text)
    with pytest.raises(PatchFailed) as caught:
        apply_patches([patch], src)
    assert isinstance(caught.value, BuildFailed)
    assert caught.value.kind == FailureKind.PATCH_FAILED == "patch-failed"
    reason = caught.value.reason
    assert "\n" not in reason
    assert reason.startswith("patch thing/cxx20 does not apply: setup.py holds '-std=c++17' "
                             f"{found} time(s), the recipe expects 2")
    assert (src / "setup.py").read_text() == text


def test_a_patch_with_several_replacements_is_all_or_nothing(tmp_path: Path) -> None:
    body = REPLACE + '[[patch.replace]]\nfile = "csrc/api.h"\nold = "C10_API"\nnew = "X"\n' \
                     "count = 1\n"
    (patch,) = _patches(tmp_path, body)
    src = _tree(tmp_path)
    (src / "csrc").mkdir()
    (src / "csrc" / "api.h").write_text("// no such macro here\n")
    with pytest.raises(PatchFailed, match=r"csrc/api\.h holds 'C10_API' 0 time"):
        apply_patches([patch], src)
    assert (src / "setup.py").read_text() == SETUP, "the first replacement was not written"


def test_a_replacement_in_a_missing_file_fails(tmp_path: Path) -> None:
    (patch,) = _patches(tmp_path, REPLACE)
    src = tmp_path / "empty-1.0"
    src.mkdir()
    with pytest.raises(PatchFailed, match=r"the sdist has no file 'setup\.py'"):
        apply_patches([patch], src)


def test_a_replacement_never_follows_a_symlink_out_of_the_sdist(tmp_path: Path) -> None:
    (patch,) = _patches(tmp_path, REPLACE)
    victim = tmp_path / "victim.py"
    victim.write_text(SETUP)
    src = tmp_path / "evil-1.0"
    src.mkdir()
    (src / "setup.py").symlink_to(victim)
    with pytest.raises(PatchFailed, match="leads outside the sdist"):
        apply_patches([patch], src)
    assert victim.read_text() == SETUP


def test_a_diff_is_applied_with_git_apply(tmp_path: Path) -> None:
    (patch,) = _patches(tmp_path, DIFF_PATCH)
    src = _tree(tmp_path)
    applied = apply_patches([patch], src)
    assert (src / "setup.py").read_text().splitlines()[1] == 'nvcc_flags += ["--threads", "4"]'
    assert applied[0].sha256 == hashlib.sha256(DIFF.encode()).hexdigest()
    assert sorted(p.name for p in src.iterdir()) == ["setup.py"], "no .orig or .rej left"


def test_patches_apply_in_order(tmp_path: Path) -> None:
    cxx20, threads = _patches(tmp_path, REPLACE + DIFF_PATCH)
    src = _tree(tmp_path)
    # The diff's context names c++17, so it must run before the replacement.
    with pytest.raises(PatchFailed, match="patch thing/threads does not apply"):
        apply_patches([cxx20, threads], src)
    src2 = _tree(_subdir(tmp_path, "again"))
    assert [a.id for a in apply_patches([threads, cxx20], src2)] == ["threads", "cxx20"]


def test_a_diff_that_no_longer_applies_fails_and_changes_nothing(tmp_path: Path) -> None:
    two_files = DIFF + """\
--- a/README
+++ b/README
@@ -1 +1 @@
-old readme
+new readme
"""
    (patch,) = _patches(tmp_path, DIFF_PATCH, diff=two_files)
    src = _tree(tmp_path)
    (src / "README").write_text("a readme that changed upstream\n")
    with pytest.raises(PatchFailed) as caught:
        apply_patches([patch], src)
    assert caught.value.kind == FailureKind.PATCH_FAILED
    assert caught.value.reason == (
        "patch thing/threads does not apply (README: patch does not apply); the sdist changed, "
        "so update the diff or narrow its versions")
    # git apply is atomic: the hunk that would have applied to setup.py was not applied either.
    assert (src / "setup.py").read_text() == SETUP
    assert sorted(p.name for p in src.iterdir()) == ["README", "setup.py"]


def test_a_diff_already_in_the_sdist_says_so(tmp_path: Path) -> None:
    (patch,) = _patches(tmp_path, DIFF_PATCH)
    src = _tree(tmp_path)
    apply_patches([patch], src)
    with pytest.raises(PatchFailed, match=r"is already in the sdist .* narrow its versions"):
        apply_patches([patch], src)


def test_a_diff_for_a_missing_file_fails(tmp_path: Path) -> None:
    (patch,) = _patches(tmp_path, DIFF_PATCH)
    src = tmp_path / "empty-1.0"
    src.mkdir()
    with pytest.raises(PatchFailed, match=r"does not apply \(setup.py: No such file"):
        apply_patches([patch], src)


def test_a_repository_around_the_workspace_is_not_what_gets_patched(tmp_path: Path) -> None:
    # Run inside a git repository, git apply would take paths relative to its top and skip
    # files outside the current directory; the sdist must be patched as a tree of its own.
    (patch,) = _patches(tmp_path, DIFF_PATCH)
    repo = tmp_path / "repo"
    (repo / "work").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=clean_env())
    src = _tree(repo / "work")
    apply_patches([patch], src)
    assert "--threads" in (src / "setup.py").read_text()



# --- the built-in recipes on the real sdists from PyPI --------------------------------------------


def test_flash_attn_recipe_patches_the_real_sdist_for_torch_2_14(
    unpacked: Callable[[str, str], Path]
) -> None:
    recipe = load_recipe("flash-attn")
    src = unpacked("flash-attn", "2.8.3.post2")
    setup = (src / "setup.py").read_text()
    assert setup.count("-std=c++17") == 4 and "-std=c++20" not in setup

    assert recipe.patches_for(Version("2.8.3.post2"), Version("2.13.0+cu130")) == ()
    patches = recipe.patches_for(Version("2.8.3.post2"), Version("2.14.1+cu130"))
    applied = apply_patches(patches, src)
    assert [a.ref for a in applied] == ["flash-attn/cxx20"]
    patched = (src / "setup.py").read_text()
    assert patched == setup.replace("-std=c++17", "-std=c++20")
    # The two CUDA flags the build uses: nvcc's list and the host compiler's.
    assert '    "-std=c++20",\n    "-U__CUDA_NO_HALF_OPERATORS__",' in patched
    assert 'compiler_c17_flag=["-O3", "-std=c++20"]' in patched
    compile(patched, "setup.py", "exec")

    # Applied again (or to a release that fixed it upstream) it fails with its own kind.
    with pytest.raises(PatchFailed, match="holds '-std=c\\+\\+17' 0 time\\(s\\), the recipe "
                                          "expects 4") as caught:
        apply_patches(patches, src)
    assert caught.value.kind == FailureKind.PATCH_FAILED


@pytest.mark.parametrize(("project", "version", "refs"), [
    ("causal-conv1d", "1.7.0", ["causal-conv1d/cuda-archs"]),
    ("mamba-ssm", "2.3.2.post1", ["mamba-ssm/cxx20", "mamba-ssm/cuda-archs"]),
])
def test_recipe_patches_apply_to_the_real_sdists(
    unpacked: Callable[[str, str], Path], project: str, version: str, refs: list[str]
) -> None:
    src = unpacked(project, version)
    patches = load_recipe(project).patches_for(Version(version), Version("2.14.1+cu130"))
    assert [a.ref for a in apply_patches(patches, src)] == refs
    patched = (src / "setup.py").read_text()
    compile(patched, "setup.py", "exec")
    assert 'arch_list = os.getenv("TORCH_CUDA_ARCH_LIST", "")' in patched
    assert "-std=c++17" not in patched.split("if HIP_BUILD:")[-1]
    # The arch diff's code, run on its own, turns a variant's list into exactly its -gencodes.
    start = patched.index("    arch_list = os.getenv")
    block = patched[start:patched.index("    # HACK", start)]
    scope = {"os": os, "HIP_BUILD": False, "cc_flag": ["-gencode", "x"]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        exec(textwrap.dedent(block), scope)  # the recipe's own patch code, under test
    assert scope["cc_flag"] == ["-gencode", "arch=compute_80,code=sm_80",
                                "-gencode", "arch=compute_90a,code=sm_90a"]


@pytest.mark.parametrize(("project", "version"), [
    ("torch-scatter", "2.1.2"), ("torch-cluster", "1.6.3"), ("torch-spline-conv", "1.2.2"),
])
def test_ninja_patches_apply_to_the_real_sdists(
    unpacked: Callable[[str, str], Path], project: str, version: str
) -> None:
    """setup.py turned ninja off for torch's BuildExtension; patched, it is on, and nothing
    else changed."""
    src = unpacked(project, version)
    setup = (src / "setup.py").read_text()
    patches = load_recipe(project).patches_for(Version(version), Version("2.14.1+cu130"))
    assert [a.ref for a in apply_patches(patches, src)] == [f"{project}/ninja"]
    patched = (src / "setup.py").read_text()
    assert "use_ninja=False" in setup and "use_ninja" not in setup.replace("use_ninja=False", "")
    assert patched == setup.replace("use_ninja=False", "use_ninja=True")
    compile(patched, "setup.py", "exec")


def test_a_diff_for_another_project_does_not_apply_to_a_real_sdist(
    unpacked: Callable[[str, str], Path]
) -> None:
    mamba_archs = next(p for p in load_recipe("mamba-ssm").patches if p.id == "cuda-archs")
    src = unpacked("causal-conv1d", "1.7.0")
    before = (src / "setup.py").read_bytes()
    with pytest.raises(PatchFailed, match="patch mamba-ssm/cuda-archs does not apply"):
        apply_patches([mamba_archs], src)
    assert (src / "setup.py").read_bytes() == before


# --- telling users: METADATA ------------------------------------------------------------------

APPLIED = [
    AppliedPatch("flash-attn", "cxx20", "Compile as C++20 instead of C++17", "ab" * 32),
    AppliedPatch("flash-attn", "cuda-archs", "Build only the archs asked for", "cd" * 32),
]


def test_the_metadata_note_reads_back() -> None:
    note = metadata_note(APPLIED)
    assert note.splitlines()[0] == (
        f"wheelhouse-patch: flash-attn/cxx20 sha256={'ab' * 32} Compile as C++20 instead of C++17")
    metadata = b"Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n\n# README\n\n" \
               + note.encode() + b"\n"
    assert read_metadata_note(metadata) == APPLIED
    assert read_metadata_note(b"Metadata-Version: 2.1\nName: x\nVersion: 1\n\nplain\n") == []


def test_a_patched_wheel_lists_its_patches_in_metadata(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "flash-attn", "2.8.3.post2+cu130torch2.14",
                     requires=["torch"], requires_python=">=3.9")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = note_wheel(src, APPLIED, out_dir)
    assert out.name == src.name and out.parent == out_dir
    metadata = read_metadata(out)
    assert read_metadata_note(metadata) == APPLIED
    # Still valid core metadata by packaging's strictest reading (a custom header would not be).
    meta = Metadata.from_email(metadata, validate=True)
    assert (meta.name, str(meta.version)) == ("flash-attn", "2.8.3.post2+cu130torch2.14")
    assert [str(r) for r in meta.requires_dist or []] == ["torch"]
    assert metadata_note(APPLIED) in (meta.description or "")
    assert_record_matches(out)
    with pytest.raises(ValueError, match="no patches"):
        note_wheel(src, [], out_dir)


def _installed_description(python: Path, project: str) -> str:
    return subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, sys; "
         f"print(m.metadata({project!r}).get_payload())"],
        capture_output=True, text=True, check=True, env=clean_env(), timeout=60,
    ).stdout


def test_pip_and_uv_install_a_noted_wheel_and_show_the_note(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "noted-pkg", "1.0+cu130torch2.14",
                     module_body="VALUE = 42\n")
    (tmp_path / "out").mkdir()
    out = note_wheel(src, APPLIED, tmp_path / "out")
    uv = shutil.which("uv")
    assert uv is not None
    for installer in ("pip", "uv"):
        python = make_venv(tmp_path / f"venv-{installer}")
        argv = ([str(python), "-m", "pip", "install", "--no-index", "--no-deps"] if installer
                == "pip" else [uv, "pip", "install", "--python", str(python), "--no-index",
                               "--no-deps", "--no-cache"])
        done = subprocess.run([*argv, str(out)], capture_output=True, text=True,
                              env=clean_env(), timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        description = _installed_description(python, "noted-pkg")
        assert read_metadata_note(b"H: x\n\n" + description.encode()) == APPLIED, installer
        value = subprocess.run([str(python), "-c", "import noted_pkg; print(noted_pkg.VALUE)"],
                               capture_output=True, text=True, check=True, env=clean_env(),
                               timeout=60).stdout.strip()
        assert value == "42"
    parsed = email.parser.BytesParser().parsebytes(read_metadata(out))
    assert parsed["Version"] == "1.0+cu130torch2.14"
