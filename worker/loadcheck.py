"""Load a built wheel's libraries the way its package does, in the build's own Python.

Packages load their compiled code in two ways: a Python extension module (it exports
``PyInit_<name>``) is imported; a torch operator library (torch-scatter's ``_scatter_cuda.so``, no
``PyInit_*``) is loaded with ``torch.ops.load_library`` after ``import torch``, and any other
library with ``ctypes``. Importing an operator library as a module fails with "dynamic module does
not define module export function", which says nothing about the build, so :func:`plan` reads each
library's dynamic symbols and picks the loader. A recipe may name modules to import as a user would
(``torch_scatter``), tried after the libraries.

The check runs as ``python -I -c SCRIPT STEPS_JSON`` (:func:`argv`) inside the build's venv (and
later its sandbox): no file to copy in, isolated mode so the source tree and ``PYTHON*`` settings
don't shadow the installed wheel. Library paths are relative to the venv's ``platlib``. The script
prints one JSON line before and after each step, so a step that kills the interpreter (a segfault
in a static initializer) is still named by :func:`parse`. :func:`check` turns the first failure
into ``load-error`` with the loader's own one-line message.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from wheelhouse.errors import BuildFailed, FailureKind
from worker.devicecode import open_library, shared_libraries

#: Libraries whose presence among a library's DT_NEEDED marks it as a torch operator library.
_TORCH_LIBRARIES = re.compile(r"^lib(?:torch|torch_cpu|torch_cuda|c10|c10_cuda)\.so")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class How(StrEnum):
    """How one step loads its target."""

    STATEMENT = "statement"
    """Run a Python statement: never from a recipe (see :func:`recipe_step`)."""
    IMPORT = "import"
    """``importlib.import_module(target)``: a Python extension module or package."""
    TORCH_LIBRARY = "torch_library"
    """``torch.ops.load_library(platlib / target)`` in an interpreter of its own: an operator
    library without ``PyInit_*``; packages load one of several per-device variants, which
    register the same operators."""
    CTYPES = "ctypes"
    """``ctypes.CDLL(platlib / target)``: any other shared library."""


@dataclass(frozen=True)
class Step:
    how: How
    target: str

    def describe(self) -> str:
        if self.how is How.STATEMENT:
            return self.target
        if self.how is How.IMPORT:
            return f"import {self.target}"
        return f"{self.how.value} {self.target}"


@dataclass(frozen=True)
class StepResult:
    step: Step
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class Report:
    results: tuple[StepResult, ...]
    crashed: Step | None = None
    """The step during which the interpreter died, if it did."""
    returncode: int = 0

    @property
    def failures(self) -> list[StepResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return self.crashed is None and not self.failures and self.returncode == 0


# The script runs in the build's Python (any version from 3.9), so it uses nothing newer.
SCRIPT = r"""
import ctypes, importlib, json, subprocess, sys, sysconfig
# The wheel's install tree (argv[2]) first on the path, else the venv's own platlib.
platlib = sys.argv[2] if len(sys.argv) > 2 else sysconfig.get_path("platlib")
if len(sys.argv) > 2:
    sys.path.insert(0, platlib)

def say(**fields):
    # A leading newline, in case a library printed half a line.
    sys.stdout.write("\nwheelhouse-load " + json.dumps(fields) + "\n")
    sys.stdout.flush()

def one_line(exc):
    text = str(exc).strip().splitlines()
    if isinstance(exc, LoadFailed):
        return (text[0] if text else "")[:500]
    return ("%s: %s" % (type(exc).__name__, text[0] if text else ""))[:500]

LOAD_ONE = (
    "import sys, torch\n"
    "try:\n"
    "    torch.ops.load_library(sys.argv[1])\n"
    "except BaseException as exc:\n"
    "    text = str(exc).strip().splitlines()\n"
    "    print('%s: %s' % (type(exc).__name__, text[0] if text else ''))\n"
    "    sys.exit(1)\n"
)

class LoadFailed(Exception):
    # Carries the child's "Type: message" line as it is.
    pass

def run(how, target):
    if how == "statement":
        exec(compile(target, "<load check>", "exec"), {"__name__": "__loadcheck__"})
    elif how == "import":
        importlib.import_module(target)
    elif how == "torch_library":
        # In an interpreter of its own: packages ship a library per device (_scatter_cpu,
        # _scatter_cuda) and load one; both register the same operators, and loading the second
        # into one process fails ("registered multiple times") for no fault of the build.
        path = platlib + "/" + target if target[:1] != "/" else target
        child = subprocess.run([sys.executable, "-I", "-c", LOAD_ONE, path],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if child.returncode != 0:
            lines = child.stdout.decode("utf-8", "replace").strip().splitlines()
            if child.returncode < 0 or not lines:
                raise OSError("the interpreter loading it died (%s)" % (
                    "signal %d" % -child.returncode if child.returncode < 0
                    else "exit %d" % child.returncode))
            raise LoadFailed(lines[-1])
    elif how == "ctypes":
        ctypes.CDLL(platlib + "/" + target if target[:1] != "/" else target)
    else:
        raise ValueError("unknown step kind %r" % how)

for index, (how, target) in enumerate(json.loads(sys.argv[1])):
    say(index=index, state="start")
    try:
        run(how, target)
    except BaseException as exc:  # SystemExit and friends are load failures here, too
        say(index=index, state="failed", error=one_line(exc))
    else:
        say(index=index, state="ok")
"""


def argv(python: Path | str, steps: Sequence[Step], *, site: Path | None = None) -> list[str]:
    """The command that runs the check in ``python``'s environment (with the wheel installed
    into ``site`` where given, ahead of the venv's own packages)."""
    payload = json.dumps([[s.how.value, s.target] for s in steps])
    return [str(python), "-I", "-c", SCRIPT, payload, *([str(site)] if site else [])]


def _is_python_module(elf: ELFFile, archive_path: str) -> bool:
    module = Path(archive_path).name.split(".", 1)[0]
    for section in elf.iter_sections():
        if isinstance(section, SymbolTableSection) and section.name == ".dynsym":
            return section.get_symbol_by_name(f"PyInit_{module}") is not None
    return False


def _links_torch(elf: ELFFile) -> bool:
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            for tag in section.iter_tags():
                needed = str(getattr(tag, "needed", ""))  # set on DT_NEEDED tags only
                if tag.entry.d_tag == "DT_NEEDED" and _TORCH_LIBRARIES.match(needed):
                    return True
    return False


def installed_path(archive_path: str) -> str:
    """Where a wheel member lands relative to platlib: ``x-1.0.data/platlib/a.so`` → ``a.so``."""
    parts = archive_path.split("/")
    if len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("platlib", "purelib"):
        return "/".join(parts[2:])
    return archive_path


def library_step(archive_path: str, stream: IO[bytes]) -> tuple[Step, bool]:
    """How to load one library, and whether it needs ``import torch`` first."""
    target = installed_path(archive_path)
    try:
        elf = ELFFile(stream)
        python_module = _is_python_module(elf, target)
        torch = _links_torch(elf)
    except ELFError:
        return Step(How.CTYPES, target), False
    if python_module:
        path = Path(target)
        dotted = ".".join([*path.parent.parts, path.name.split(".", 1)[0]])
        return Step(How.IMPORT, dotted), torch
    if torch:
        return Step(How.TORCH_LIBRARY, target), True
    return Step(How.CTYPES, target), False


def recipe_step(text: str) -> Step:
    """A recipe's ``load_check`` entry: a dotted module name, imported.

    Recipes are data and never run code (``wheelhouse.recipes.book`` refuses anything but module
    names), so no entry becomes a statement.
    """
    text = text.strip()
    if not _IDENTIFIER.fullmatch(text):
        raise ValueError(f"load_check entry {text!r} is not a module name")
    return Step(How.IMPORT, text)


def plan(wheel: Path, imports: Iterable[str] = ()) -> list[Step]:
    """The steps for a wheel: ``import torch`` when any library links libtorch/libc10 (their
    libraries are found only once torch has loaded them), each library by its loader, then the
    recipe's imports."""
    steps: list[Step] = []
    needs_torch = False
    with zipfile.ZipFile(wheel) as zf:
        for name in shared_libraries(zf):
            if name.split("/", 1)[0].endswith(".data") and installed_path(name) == name:
                continue  # scripts/headers/data of the wheel: not loaded by the package
            with open_library(zf, name) as stream:
                step, torch = library_step(name, stream)
            steps.append(step)
            needs_torch = needs_torch or torch
    head = [Step(How.IMPORT, "torch")] if needs_torch else []
    return head + steps + [recipe_step(text) for text in imports]


def parse(stdout: str, steps: Sequence[Step], returncode: int) -> Report:
    """The script's output back into results; a step that started but never ended crashed."""
    results: list[StepResult] = []
    started: int | None = None
    for line in stdout.splitlines():
        if not line.startswith("wheelhouse-load "):
            continue  # what the libraries themselves printed
        try:
            fields = json.loads(line[len("wheelhouse-load "):])
            index = int(fields["index"])
            step = steps[index]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if fields.get("state") == "start":
            started = index
        else:
            results.append(StepResult(step, fields.get("state") == "ok",
                                      str(fields.get("error", ""))))
            started = None
    crashed = steps[started] if started is not None else None
    if crashed is None and returncode != 0 and len(results) < len(steps):
        crashed = steps[len(results)]
    return Report(tuple(results), crashed, returncode)


def check(report: Report, *, wheel_name: str = "the wheel") -> list[str]:
    """Raise ``load-error`` naming the first failed step and its loader's message; else return
    one log line per step."""
    if report.crashed is not None:
        signal = f" (signal {-report.returncode})" if report.returncode < 0 else (
            f" (exit {report.returncode})")
        raise BuildFailed(FailureKind.LOAD_ERROR,
                          f"{wheel_name}: the interpreter died during "
                          f"`{report.crashed.describe()}`{signal}")
    for result in report.results:
        if not result.ok:
            raise BuildFailed(FailureKind.LOAD_ERROR,
                              f"{wheel_name}: `{result.step.describe()}` failed: {result.error}")
    if report.returncode != 0:
        raise BuildFailed(FailureKind.LOAD_ERROR,
                          f"{wheel_name}: the load check exited {report.returncode}")
    return [f"loaded: {r.step.describe()}" for r in report.results]
