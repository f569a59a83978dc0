"""The checks step: the wheel is well-formed and the one asked for, holds device code for every
requested architecture, names its patches, and each library loads the way its package loads it.

The built wheel is the attacker's bytes, so every parse of it (the zip and RECORD, relabelling,
the patch note, ELF sections, the variant form, installing it for the load check) runs in the
sandbox (:mod:`worker.sandbox.untrusted`, the ``wheel`` operation). What comes back is a report and
files;
the worker copies the files out by descriptor, hashes them, and re-checks what it relies on:
names, versions and tags by their file names, METADATA within a byte cap, the device code and
the load plan as plain data of a known shape.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wheelhouse.builds.facts import AppliedPatch
from wheelhouse.errors import BuildFailed, FailureKind, InvalidWheel
from wheelhouse.index.publish import Checked, CheckedVariant
from wheelhouse.index.variantwheels import label_for, sass_archs, variant_filename
from wheelhouse.wheels import (
    MAX_METADATA_BYTES,
    MAX_UNPACKED_BYTES,
    consistent_metadata,
    parse_name,
)
from worker import devicecode, loadcheck
from worker.buildenv import sanitized_env
from worker.errors import UnsafePath
from worker.sandbox import safefs
from worker.sandbox.limits import GIB
from worker.sandbox.takeout import MAX_WHEEL_BYTES
from worker.steps.context import BuildContext
from worker.steps.venv import BuildVenv
from worker.supervision.runner import Runner

_ARCH = re.compile(r"[0-9]{2,3}[af]?")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_MAX_LIBRARIES = 10_000


@dataclass(frozen=True)
class CheckedWheel:
    """What the checks made of the built wheel: the wheel to publish, and its variant form."""

    wheel: Checked
    variant: CheckedVariant | None = None


def check_wheel(ctx: BuildContext, run: Runner, wheel: Path, venv: BuildVenv,
                patches: tuple[AppliedPatch, ...]) -> CheckedWheel:
    """Check the worker's copy of the built wheel (in the sandbox); return what to publish
    (relabelled and noted where the recipe and ``patches`` say so). Nothing failing here is
    published."""
    ctx.journal.phase("check")
    spec, recipe = ctx.spec, ctx.recipe
    out = ctx.workspace / "inspect" / "out"
    site = ctx.workspace / "load-check" / "site"
    safefs.discard_tree(ctx.workspace / "load-check")
    (ctx.workspace / "load-check").mkdir()
    report = run.untrusted(
        {"op": "wheel", "wheel": str(wheel), "out": str(out), "site": str(site),
         "project": spec.project, "version": str(spec.wheel_version),
         "python": spec.python, "machine": spec.machine,
         "relabel": recipe.relabel, "label": spec.variant.local_label,
         "patches": [asdict(p) for p in patches],
         "load_check": list(recipe.load_check), "variant": spec.variant.key,
         "variant_form": True, "max_unpacked_bytes": unpacked_cap(ctx)},
        what="checking the wheel", failure=FailureKind.INVALID_WHEEL,
        read_only=[wheel.parent], writable=[ctx.workspace / "load-check"])
    checked = _take(ctx, report, out)
    name = checked.path.name
    ctx.say(f"wheel checked: {name} (zip, RECORD hashes, names, metadata, tags)")
    if patches:
        ctx.say(f"METADATA names the patches: {', '.join(p.ref for p in patches)}")
    modules = _names(report.get("modules"), "modules")
    missing = [m for m in recipe.import_check if m not in modules]
    if missing:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{name} lacks {', '.join(missing)}; the CUDA build was skipped")
    found = report_device_code(report.get("device_code"))
    ctx.journal.measured(device_code=devicecode.archs_found(found))
    for lib, code in sorted(found.items()):
        ctx.say(f"device code in {lib}: {code.describe()}")
    devicecode.check_device_code(found, recipe.archs_for(spec.variant), wheel_name=name)
    steps = report_load_steps(report.get("load_steps"), recipe.load_check)
    _load_check(ctx, run, steps, venv, site, wheel_name=name)
    return _with_variant(ctx, report, out, checked, found)


def unpacked_cap(ctx: BuildContext) -> int:
    """What the wheel may unpack to: the disk cap bounds the load check's install too."""
    disk = int(ctx.config.build_disk_limit_gib * GIB)
    return min(MAX_UNPACKED_BYTES, disk) if disk > 0 else MAX_UNPACKED_BYTES


def _take(ctx: BuildContext, report: Mapping[str, Any], out: Path) -> Checked:
    """The checked wheel and its METADATA out of the check, re-checked by name: the spec's
    project, the exact version asked for, tags that serve its Python and CPU."""
    spec = ctx.spec
    checked = _copy_out(ctx, out / "wheel", report.get("wheel"), report.get("metadata"),
                        ctx.workspace / "checked")
    try:
        name = parse_name(checked.path.name)
        consistent_metadata(checked.metadata, name)
    except InvalidWheel as exc:
        raise BuildFailed(FailureKind.INVALID_WHEEL, str(exc)) from None
    if (name.project != spec.project or name.version != spec.wheel_version
            or not spec.tags_match(name.tags)):
        raise BuildFailed(FailureKind.INVALID_WHEEL,
                          f"the check gave back {checked.path.name[:120]!r}, not a wheel of "
                          f"{spec.project} {spec.wheel_version} for this Python")
    return checked


def _copy_out(ctx: BuildContext, where: Path, wheel: object, metadata: object,
              dest: Path, *, variant_form: bool = False) -> Checked:
    """Copy a wheel the check left in ``where`` and read its METADATA, by descriptor and
    size-capped. The name must be a wheel's; a variant form's (a label after the tags, no
    wheel file name to ``packaging``) is the caller's, compared with the one it expects."""
    if not isinstance(wheel, str) or not isinstance(metadata, str) or (
            metadata != wheel + ".metadata"):
        raise BuildFailed(FailureKind.INVALID_WHEEL, "the wheel's check named no wheel")
    try:
        if not variant_form:
            parse_name(wheel)
        dirfd = safefs.open_dir(where)
    except (InvalidWheel, OSError, UnsafePath) as exc:
        raise BuildFailed(FailureKind.INVALID_WHEEL, f"the wheel's check: {exc}") from None
    try:
        dest.mkdir(parents=True, exist_ok=True)
        safefs.copy_out(dirfd, wheel, dest / wheel, max_bytes=MAX_WHEEL_BYTES)
        data = safefs.read_bytes(dirfd, metadata, max_bytes=MAX_METADATA_BYTES)
    except (OSError, UnsafePath) as exc:
        raise BuildFailed(FailureKind.UNSAFE_RESULT, f"the wheel's check: {exc}") from None
    finally:
        os.close(dirfd)
    return Checked(dest / wheel, data)


def _with_variant(ctx: BuildContext, report: Mapping[str, Any], out: Path,
                  checked: Checked, found: Mapping[str, devicecode.DeviceCode]
                  ) -> CheckedWheel:
    """The variant form the check made, where its name is the one this wheel's SASS gives."""
    made = report.get("variant")
    archs = sass_archs(a for code in found.values() for a in code.sass)
    if not archs:
        return CheckedWheel(checked)
    label = label_for(ctx.spec.variant.cuda, archs)
    expected = variant_filename(checked.path.name, ctx.spec.variant, label)
    try:
        if not isinstance(made, dict) or made.get("wheel") != expected or (
                made.get("label") != label):
            raise BuildFailed(FailureKind.INVALID_WHEEL, f"it made no {expected}")
        variant = _copy_out(ctx, out / "variant", made.get("wheel"), made.get("metadata"),
                            ctx.workspace / "checked-variant", variant_form=True)
    except BuildFailed as exc:
        # The variant form is an extra: without it the wheel still publishes, and
        # `wheelhouse variants backfill` can make it later.
        ctx.say(f"no variant form of {checked.path.name}: {exc.reason}")
        return CheckedWheel(checked)
    return CheckedWheel(checked, CheckedVariant(variant, label, archs))


def _names(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and _MODULE.fullmatch(v)
                                              for v in value):
        raise BuildFailed(FailureKind.INVALID_WHEEL, f"the wheel's check listed no {what}")
    return list(value)


def report_device_code(value: object) -> dict[str, devicecode.DeviceCode]:
    """The report's device code, as plain data of the one known shape."""
    if not isinstance(value, dict) or len(value) > _MAX_LIBRARIES:
        raise BuildFailed(FailureKind.INVALID_WHEEL, "the wheel's check gave no device code")
    found: dict[str, devicecode.DeviceCode] = {}
    for lib, code in value.items():
        if not (isinstance(lib, str) and len(lib) < 1000 and isinstance(code, dict)):
            raise BuildFailed(FailureKind.INVALID_WHEEL, "the wheel's check gave no device code")
        sass, ptx = code.get("sass"), code.get("ptx")
        if not all(isinstance(x, list) and all(isinstance(a, str) and _ARCH.fullmatch(a)
                                               for a in x) for x in (sass, ptx)):
            raise BuildFailed(FailureKind.INVALID_WHEEL,
                              f"the wheel's check gave bad device code for {lib[:100]!r}")
        assert isinstance(sass, list) and isinstance(ptx, list)
        found[lib] = devicecode.DeviceCode(frozenset(sass), frozenset(ptx))
    return found


def report_load_steps(value: object, imports: tuple[str, ...]) -> list[loadcheck.Step]:
    """The report's load plan: loaders the worker knows, targets that are module names or
    relative paths inside the install tree, and never a statement."""
    if not isinstance(value, list):
        raise BuildFailed(FailureKind.INVALID_WHEEL, "the wheel's check gave no load plan")
    steps = []
    for item in value:
        try:
            how, target = loadcheck.How(item[0]), item[1]
        except (ValueError, TypeError, IndexError, KeyError):
            raise BuildFailed(FailureKind.INVALID_WHEEL,
                              "the wheel's check gave a bad load step") from None
        if not isinstance(target, str) or how is loadcheck.How.STATEMENT or not (
                _MODULE.fullmatch(target) if how is loadcheck.How.IMPORT
                else _relative(target)):
            raise BuildFailed(FailureKind.INVALID_WHEEL,
                              f"the wheel's check gave a bad load step {str(item)[:100]!r}")
        steps.append(loadcheck.Step(how, target))
    wanted = [loadcheck.recipe_step(text) for text in imports]
    if steps[len(steps) - len(wanted):] != wanted:
        steps += wanted  # the recipe's imports are the worker's, whatever the report says
    return steps


def _relative(target: str) -> bool:
    parts = target.split("/")
    return bool(target) and not target.startswith("/") and ".." not in parts and (
        "\0" not in target) and len(target) < 1000


def _load_check(ctx: BuildContext, run: Runner, steps: list[loadcheck.Step], venv: BuildVenv,
                site: Path, *, wheel_name: str) -> None:
    """Load each library of the installed wheel as its package does, in the sandbox.

    The check itself installed the wheel into ``site`` (as the build's uid); the build venv's
    Python runs with it first on its path. What it prints comes from inside the sandbox: it
    is parsed as data, and a build that fakes it fools only the check of its own wheel.
    """
    # Without a GPU only loading can be checked: libcudart comes with torch's wheels and the
    # driver is needed only when a kernel runs.
    check_dir = ctx.workspace / "load-check"
    start = ctx.log.size()
    ran = run.sandboxed(loadcheck.argv(venv.seen, steps, site=site),
                        env=sanitized_env(os.environ), cwd=check_dir, what="the load check",
                        read_only=venv.read_only, writable=[check_dir])
    report = loadcheck.parse(ctx.log.since(start), steps,
                             -1 if ran.returncode is None else ran.returncode)
    for line in loadcheck.check(report, wheel_name=wheel_name):
        ctx.say(line)
