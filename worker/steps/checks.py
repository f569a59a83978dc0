"""The checks step: the wheel is well-formed and the one asked for, holds device code for every
requested architecture, names its patches, and each library loads the way its package loads it."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from wheelhouse.buildfacts import AppliedPatch
from wheelhouse.errors import BuildFailed, FailureKind, InvalidWheel
from wheelhouse.patches import note_wheel
from wheelhouse.wheels import parse_name, relabel, validate_wheel
from worker import devicecode, loadcheck
from worker.buildenv import install_env, sanitized_env
from worker.runner import Runner
from worker.steps.context import BuildContext, uv_binary
from worker.steps.venv import BuildVenv


def check_wheel(ctx: BuildContext, run: Runner, wheel: Path, venv: BuildVenv,
                patches: tuple[AppliedPatch, ...]) -> Path:
    """Check the worker's copy of the built wheel; return the wheel to publish (relabelled and
    noted where the recipe and ``patches`` say so). Nothing failing here is published."""
    ctx.journal.phase("check")
    wheel = validated(ctx, wheel)
    modules = extension_modules(wheel)
    missing = [m for m in ctx.recipe.import_check if m not in modules]
    if missing:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{wheel.name} lacks {', '.join(missing)}; the CUDA build was skipped")
    _check_device_code(ctx, wheel)
    if patches:
        out = ctx.workspace / "noted"
        out.mkdir(exist_ok=True)
        wheel = note_wheel(wheel, patches, out)
        ctx.say(f"METADATA names the patches: {', '.join(p.ref for p in patches)}")
    _install_for_check(run, wheel, venv)
    _load_check(ctx, run, wheel, venv)
    return wheel


def validated(ctx: BuildContext, wheel: Path) -> Path:
    """The wheel is well-formed and the one asked for; relabelled when the recipe says so.

    What the build left is untrusted: :func:`validate_wheel` checks it as it came out (the
    public version, when the recipe relabels) and again after relabelling; any failure is
    ``invalid-wheel``.
    """
    spec = ctx.spec
    try:
        name = parse_name(wheel.name)
        if name.version.public != spec.wheel_version.public:
            raise InvalidWheel(f"{wheel.name}: built version {name.version}, expected "
                               f"{spec.wheel_version}")
        validate_wheel(wheel, spec.project, name.version, spec.tags_match)
        if ctx.recipe.relabel and name.version != spec.wheel_version:
            out = ctx.workspace / "relabelled"
            out.mkdir(exist_ok=True)
            wheel = relabel(wheel, spec.variant.local_label, out)
            ctx.say(f"relabelled into {wheel.name}")
        elif name.version != spec.wheel_version:
            raise InvalidWheel(f"{wheel.name}: built version {name.version}, expected "
                               f"{spec.wheel_version} (does the recipe put the label into "
                               "METADATA?)")
        validate_wheel(wheel, spec.project, spec.wheel_version, spec.tags_match)
    except InvalidWheel as exc:
        raise BuildFailed(FailureKind.INVALID_WHEEL, str(exc)) from None
    ctx.say(f"wheel checked: {wheel.name} (zip, RECORD hashes, names, metadata, tags)")
    return wheel


def extension_modules(wheel: Path) -> list[str]:
    """Importable names of the compiled modules in a wheel (``pkg/_C.cpython-311-….so``)."""
    names = []
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if not member.endswith(".so") or ".dist-info/" in member or ".data/" in member:
                continue
            module = member[: -len(".so")].split(".", 1)[0]
            names.append(module.replace("/", "."))
    return sorted(set(names))


def _check_device_code(ctx: BuildContext, wheel: Path) -> None:
    """No CUDA label without device code: SASS for every requested architecture."""
    found = devicecode.wheel_device_code(wheel)
    ctx.journal.measured(device_code=devicecode.archs_found(found))
    for name, code in sorted(found.items()):
        ctx.say(f"device code in {name}: {code.describe()}")
    devicecode.check_device_code(found, ctx.recipe.archs_for(ctx.spec.variant),
                                 wheel_name=wheel.name)


def _install_for_check(run: Runner, wheel: Path, venv: BuildVenv) -> None:
    """Install the checked wheel into the build venv, from outside the sandbox.

    ``uv`` runs with the interpreter the venv was made from and ``--prefix``: asked for the
    venv's own Python, it would start it, and the ``.pth`` files of what the sdist chose
    would run as the worker.
    """
    run.install([uv_binary(), "pip", "install", "--python", str(venv.interpreter),
                 "--prefix", str(venv.root), "--no-deps", "--reinstall", "--offline",
                 str(wheel)], env=install_env(), what="installing the wheel for the load check")


def _load_check(ctx: BuildContext, run: Runner, wheel: Path, venv: BuildVenv) -> None:
    """Load each library of the installed wheel as its package does, in the sandbox.

    What it prints comes from inside the sandbox: it is parsed as data, and a build that
    fakes it fools only the check of its own wheel.
    """
    steps = loadcheck.plan(wheel, ctx.recipe.load_check)
    # Without a GPU only loading can be checked: libcudart comes with torch's wheels and the
    # driver is needed only when a kernel runs.
    check_dir = ctx.workspace / "load-check"
    start = ctx.log.size()
    ran = run.sandboxed(loadcheck.argv(venv.python, steps), env=sanitized_env(os.environ),
                        cwd=check_dir, what="the load check", read_only=venv.read_only,
                        writable=[check_dir])
    report = loadcheck.parse(ctx.log.since(start), steps,
                             -1 if ran.returncode is None else ran.returncode)
    for line in loadcheck.check(report, wheel_name=wheel.name):
        ctx.say(line)
