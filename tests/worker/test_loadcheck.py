"""Load checks that load each library the way its package does, in a real torch venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from wheelhouse.errors import BuildFailed, FailureKind
from worker.loadcheck import How, Step, argv, check, installed_path, parse, plan, recipe_step


def run_check(python: Path, steps: list[Step]) -> tuple[str, int]:
    done = subprocess.run(argv(python, steps), capture_output=True, text=True, timeout=300,
                          check=False)
    return done.stdout, done.returncode


def install(python: Path, wheel: Path) -> None:
    import shutil

    subprocess.run([shutil.which("uv") or "uv", "pip", "install", "-q", "--python", str(python),
                    "--no-deps", "--reinstall", str(wheel)], check=True)


@pytest.mark.nvcc
def test_a_python_extension_is_imported(session_torch_python: Path,
                                        cudaext_sm80_wheel: Path) -> None:
    steps = plan(cudaext_sm80_wheel, ["cudaext"])
    name = next(s.target for s in steps if s.how is How.IMPORT and s.target != "torch")
    assert steps == [Step(How.IMPORT, "torch"), Step(How.IMPORT, "cudaext._C"),
                     Step(How.IMPORT, "cudaext")]
    assert name == "cudaext._C"
    install(session_torch_python, cudaext_sm80_wheel)
    stdout, code = run_check(session_torch_python, steps)
    report = parse(stdout, steps, code)
    assert report.ok, stdout
    assert check(report) == ["loaded: import torch", "loaded: import cudaext._C",
                             "loaded: import cudaext"]


@pytest.mark.nvcc
def test_a_torch_operator_library_is_loaded_with_torch_ops(session_torch_python: Path,
                                                           opsext_wheel: Path) -> None:
    # The package's own loader as a recipe names it, then a use of its operator (a statement
    # only tests can add: recipes name modules).
    steps = [*plan(opsext_wheel, ["opsext"]),
             Step(How.STATEMENT, "import opsext, torch; "
                                 "assert opsext.twice(torch.ones(2)).tolist() == [2.0, 2.0]")]
    library, twin = [s for s in steps if s.how is How.TORCH_LIBRARY]
    assert library.target.startswith("opsext/_ops.cpython-311-")
    assert twin.target.startswith("opsext/_ops_twin.cpython-311-")
    assert steps[0] == Step(How.IMPORT, "torch") and steps[-2] == Step(How.IMPORT, "opsext")
    install(session_torch_python, opsext_wheel)
    # Both register opsext::twice, as torch-scatter's _cpu and _cuda libraries register the same
    # operators: each is loaded in an interpreter of its own, so both load.
    stdout, code = run_check(session_torch_python, steps)
    report = parse(stdout, steps, code)
    assert report.ok, stdout
    assert len(check(report)) == 5
    # In one interpreter the second registration fails, for no fault of the build.
    same = [Step(How.IMPORT, "torch"),
            Step(How.STATEMENT, "import torch, sysconfig; p = sysconfig.get_path('platlib'); "
                                f"torch.ops.load_library(p + '/{library.target}'); "
                                f"torch.ops.load_library(p + '/{twin.target}')")]
    stdout, code = run_check(session_torch_python, same)
    assert not parse(stdout, same, code).ok

    # What the old import check did to torch-scatter: importing it as a module fails.
    module = library.target.split(".", 1)[0].replace("/", ".")
    wrong = [Step(How.IMPORT, "torch"), Step(How.IMPORT, module)]
    stdout, code = run_check(session_torch_python, wrong)
    with pytest.raises(BuildFailed) as err:
        check(parse(stdout, wrong, code), wheel_name="opsext.whl")
    assert err.value.kind == FailureKind.LOAD_ERROR == "load-error"
    assert err.value.reason == (
        "opsext.whl: `import opsext._ops` failed: ImportError: dynamic module does not define "
        "module export function (PyInit__ops)")


@pytest.fixture(scope="module")
def broken_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared library with an unresolved symbol, as a library missing a linked object is."""
    root = tmp_path_factory.mktemp("broken")
    (root / "broken.c").write_text("extern int missing_function(void);\n"
                                   "int entry(void) { return missing_function(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", "libbroken.so", "broken.c"], cwd=root,
                   check=True)
    return root / "libbroken.so"


def test_a_library_that_does_not_load_fails_with_the_loaders_message(
        broken_library: Path) -> None:
    import sys

    steps = [Step(How.CTYPES, str(broken_library)), Step(How.IMPORT, "json")]
    stdout, code = run_check(Path(sys.executable), steps)
    report = parse(stdout, steps, code)
    assert [r.ok for r in report.results] == [False, True]  # every step runs and is reported
    with pytest.raises(BuildFailed) as err:
        check(report, wheel_name="x.whl")
    assert err.value.kind == FailureKind.LOAD_ERROR
    assert err.value.reason.startswith(f"x.whl: `ctypes {broken_library}` failed: OSError: ")
    assert "undefined symbol: missing_function" in err.value.reason


def test_an_interpreter_that_dies_names_the_step(tmp_path: Path) -> None:
    import sys

    steps = [Step(How.IMPORT, "json"),
             Step(How.STATEMENT, "import os; os.kill(os.getpid(), 11)"),
             Step(How.IMPORT, "csv")]
    stdout, code = run_check(Path(sys.executable), steps)
    report = parse(stdout, steps, code)
    assert code == -11 and report.crashed == steps[1]
    with pytest.raises(BuildFailed, match=r"died during `import os; os.kill\(os.getpid\(\), "
                                          r"11\)` \(signal 11\)"):
        check(report)


def test_library_output_does_not_confuse_the_parser() -> None:
    import sys

    steps = [Step(How.STATEMENT, "import sys; sys.stdout.write('half a line')"),
             Step(How.STATEMENT, "raise SystemExit('setup is broken\\nsecond line')")]
    stdout, code = run_check(Path(sys.executable), steps)
    report = parse(stdout, steps, code)
    assert [r.ok for r in report.results] == [True, False]
    assert report.results[1].error == "SystemExit: setup is broken"


@pytest.mark.parametrize(("text", "step"), [
    ("torch_scatter", Step(How.IMPORT, "torch_scatter")),
    ("  flash_attn.flash_attn_interface ", Step(How.IMPORT, "flash_attn.flash_attn_interface")),
])
def test_recipe_entries(text: str, step: Step) -> None:
    assert recipe_step(text) == step


@pytest.mark.parametrize("text", ["import torch_scatter", "from flash_attn import f",
                                  "os.system('x')", ""])
def test_recipe_entries_are_never_statements(text: str) -> None:
    with pytest.raises(ValueError, match="is not a module name"):
        recipe_step(text)


@pytest.mark.parametrize(("member", "installed"), [
    ("torch_scatter/_scatter_cuda.so", "torch_scatter/_scatter_cuda.so"),
    ("x-1.0.data/platlib/x/_C.so", "x/_C.so"),
    ("x-1.0.data/purelib/libfoo.so.1", "libfoo.so.1"),
    ("x-1.0.data/scripts/tool.so", "x-1.0.data/scripts/tool.so"),
])
def test_installed_path(member: str, installed: str) -> None:
    assert installed_path(member) == installed
