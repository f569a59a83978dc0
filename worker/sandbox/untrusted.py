"""The parses of a build's hostile bytes, run as the build's uid inside its sandbox.

An sdist, a wheel and everything a build wrote are the attacker's bytes. The root worker only
moves them as opaque files (hash, size-capped copy by descriptor, upload); every parse of them
happens here, in a program the worker starts through
:meth:`worker.supervision.runner.Runner.untrusted`:
the build's uid, its namespaces (the writable places of this one build and nothing else), its
deadline, memory cap and disk quota. A bug in ``tarfile`` (CVE-2025-4517's filter bypass), a zip
bomb or an ELF that declares gigabytes can then at most spoil this build's own places.

Two operations, each given one JSON request (``argv[1]``) and answering with one JSON report,
written last into the request's ``report`` file (a fresh file, no link followed):

- ``unpack``: the sdist (mounted read-only) into the project version's source path, within
  :class:`SdistLimits`, then the recipe's patches; the report names the project directory;
- ``wheel``: the built wheel (a worker's copy, read-only) checked as the spec asks
  (:func:`wheelhouse.wheels.validate_wheel`), relabelled and noted where the recipe says, pinned
  to the torch it was built against (``Requires-Dist: torch==X.Y.*``), again
  checked, its device code read (:mod:`wheelhouse.devicecode`), its compiled modules and load
  steps listed (:mod:`worker.loadcheck`), its variant form made, the final wheel unpacked into the
  load check's ``site`` directory; the wheels and their METADATA are left in ``out``.

What a report says is data: the worker re-checks it (:mod:`worker.steps.source`,
:mod:`worker.steps.checks`) before any of it counts, and a build that fakes one fools only the
checks of its own wheel.

This module runs in the worker's own interpreter inside the sandbox, so it imports only the
standard library, ``packaging``, ``pyelftools`` and the core modules that read wheels.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import stat
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from wheelhouse.builds.facts import AppliedPatch
from wheelhouse.builds.spec import tags_serve
from wheelhouse.config import Config
from wheelhouse.devicecode import wheel_device_code
from wheelhouse.errors import BuildFailed, FailureKind, InvalidWheel, PatchFailed
from wheelhouse.index.variantwheels import make_variant_wheel, sass_archs, torch_requirement
from wheelhouse.recipes.patches import Patch, Replacement, apply_patches, note_wheel
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import parse_name, pin_torch, read_metadata, relabel, validate_wheel
from worker import loadcheck

_MIB = 1024 * 1024


@dataclass(frozen=True)
class SdistLimits:
    """What an sdist may weigh, hold and unpack to (``WHEELHOUSE_SDIST_MAX_*``)."""

    max_bytes: int = 2048 * _MIB
    max_members: int = 100_000
    max_unpacked_bytes: int = 10_240 * _MIB

    @classmethod
    def from_config(cls, config: Config) -> SdistLimits:
        return cls(max_bytes=config.sdist_max_mib * _MIB,
                   max_members=config.sdist_max_members,
                   max_unpacked_bytes=config.sdist_max_unpacked_mib * _MIB)

    def to_dict(self) -> dict[str, int]:
        return {"max_bytes": self.max_bytes, "max_members": self.max_members,
                "max_unpacked_bytes": self.max_unpacked_bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SdistLimits:
        return cls(int(data["max_bytes"]), int(data["max_members"]),
                   int(data["max_unpacked_bytes"]))


# --- unpacking ------------------------------------------------------------------------------


def unpack(sdist: Path, dest: Path, *, limits: SdistLimits | None = None) -> Path:
    """Unpack into ``dest`` without letting members escape it; return the project directory.

    Every member is checked before anything is written: one that would land outside ``dest``
    (``..``, an absolute path, a link out of the tree, a device) fails the build as
    ``unsafe-archive``; an archive over ``limits`` (size, members, unpacked size) as
    ``too-large``, each with its own one-line reason. These checks are a courtesy to the
    user (one clear reason): the safety is that this runs in the sandbox, where the only
    places writable are the build's own, so a filter that can be bypassed (CVE-2025-4517 on
    the Pythons before 3.11.13) has nowhere to write to.
    """
    limits = limits or SdistLimits()
    dest.mkdir(parents=True, exist_ok=True)
    if sdist.is_dir():
        shutil.copytree(sdist, dest / sdist.name, symlinks=True)
    elif sdist.name.endswith((".tar.gz", ".tgz", ".tar", ".zip")):
        size = sdist.stat().st_size
        if size > limits.max_bytes:
            raise BuildFailed(FailureKind.TOO_LARGE,
                              f"{sdist.name} is {size / _MIB:.0f} MiB, over the "
                              f"{limits.max_bytes / _MIB:.0f} MiB limit (WHEELHOUSE_SDIST_MAX_MIB)")
        try:
            if sdist.name.endswith(".zip"):
                _unpack_zip(sdist, dest, limits)
            else:
                _unpack_tar(sdist, dest, limits)
        except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            if isinstance(exc, tarfile.FilterError):
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  _unsafe_member(sdist.name, exc)) from None
            if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile):
                if exc.errno in (13, 30):  # EACCES, EROFS: a write outside the build's places
                    raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                      f"{sdist.name} writes outside its directory "
                                      f"({exc.strerror})") from None
                raise  # the disk, not the archive
            raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                              f"{sdist.name} is not a readable archive: "
                              f"{' '.join(str(exc).split())[:200] or type(exc).__name__}"
                              ) from None
    else:
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          f"{sdist.name} is not an sdist (.tar.gz or .zip)")
    entries = [p for p in dest.iterdir() if not p.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    if (dest / "setup.py").exists() or (dest / "pyproject.toml").exists():
        return dest
    raise BuildFailed(FailureKind.INCOMPATIBLE,
                      f"{sdist.name} does not unpack into one project directory")


def _too_many(name: str, limits: SdistLimits) -> BuildFailed:
    return BuildFailed(FailureKind.TOO_LARGE,
                       f"{name} holds more than {limits.max_members} members "
                       "(WHEELHOUSE_SDIST_MAX_MEMBERS)")


def _too_big(name: str, limits: SdistLimits) -> BuildFailed:
    return BuildFailed(FailureKind.TOO_LARGE,
                       f"{name} unpacks to more than {limits.max_unpacked_bytes / _MIB:.0f} MiB "
                       "(WHEELHOUSE_SDIST_MAX_UNPACKED_MIB)")


def _unpack_tar(sdist: Path, dest: Path, limits: SdistLimits) -> None:
    members: list[tarfile.TarInfo] = []
    total = 0
    with tarfile.open(sdist) as tf:
        # Headers are read one by one, so a bomb is refused once it passes a limit, and every
        # member passes the "data" filter before the first byte is written.
        for member in tf:
            if member.name.startswith("/"):  # the data filter would only strip the slash
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  f"{sdist.name}: member {member.name[:200]!r} has an absolute "
                                  "path")
            members.append(tarfile.data_filter(member, str(dest)))
            total += member.size if member.isreg() else 0
            if len(members) > limits.max_members:
                raise _too_many(sdist.name, limits)
            if total > limits.max_unpacked_bytes:
                raise _too_big(sdist.name, limits)
        tf.extractall(dest, members=members, filter="data")


def _unpack_zip(sdist: Path, dest: Path, limits: SdistLimits) -> None:
    root = dest.resolve()
    with zipfile.ZipFile(sdist) as zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise _too_many(sdist.name, limits)
        # zipfile reads no more than a member's declared size, so the sum bounds what is written.
        if sum(info.file_size for info in infos) > limits.max_unpacked_bytes:
            raise _too_big(sdist.name, limits)
        for info in infos:
            name = info.filename
            if name.startswith("/"):
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  f"{sdist.name}: member {name[:200]!r} has an absolute path")
            if not (dest / name).resolve().is_relative_to(root):
                raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                  f"{sdist.name}: member {name[:200]!r} would land outside the "
                                  "project directory")
            if stat.S_ISLNK(info.external_attr >> 16):
                target = zf.read(info).decode(errors="replace")
                if target.startswith("/") or not (
                        dest / name).parent.joinpath(target).resolve().is_relative_to(root):
                    raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                                      f"{sdist.name}: member {name[:200]!r} links out of the "
                                      f"tree (to {target[:200]!r})")
        zf.extractall(dest)  # noqa: S202 (every member checked above)


def _unsafe_member(archive: str, exc: tarfile.FilterError) -> str:
    member = exc.tarinfo.name[:200]
    if isinstance(exc, tarfile.AbsolutePathError):
        why = "has an absolute path"
    elif isinstance(exc, tarfile.OutsideDestinationError):
        why = "would land outside the project directory"
    elif isinstance(exc, tarfile.AbsoluteLinkError | tarfile.LinkOutsideDestinationError):
        why = f"links out of the tree (to {exc.tarinfo.linkname[:200]!r})"
    elif isinstance(exc, tarfile.SpecialFileError):
        why = "is a device or FIFO"
    else:
        why = f"is refused: {str(exc)[:200]}"
    return f"{archive}: member {member!r} {why}"


# --- requests and reports -----------------------------------------------------------------


def patch_to_dict(patch: Patch) -> dict[str, Any]:
    """A recipe patch as the unpack request carries it (what applying it needs)."""
    return {"recipe": patch.recipe, "id": patch.id, "description": patch.description,
            "replacements": [asdict(r) for r in patch.replacements],
            "diff": base64.b64encode(patch.diff).decode(), "diff_name": patch.diff_name}


def _patch_from_dict(data: Mapping[str, Any]) -> Patch:
    return Patch(recipe=data["recipe"], id=data["id"], description=data["description"],
                 versions=SpecifierSet(), torch=SpecifierSet(),
                 replacements=tuple(Replacement(**r) for r in data["replacements"]),
                 diff=base64.b64decode(data["diff"]), diff_name=data["diff_name"])


def _unpack_op(request: Mapping[str, Any]) -> dict[str, Any]:
    dest = Path(request["dest"])
    project = unpack(Path(request["sdist"]), dest,
                     limits=SdistLimits.from_dict(request["limits"]))
    applied = apply_patches([_patch_from_dict(p) for p in request["patches"]], project)
    return {"ok": True, "project": "" if project == dest else project.name,
            "applied": [a.sha256 for a in applied]}


def _wheel_op(request: Mapping[str, Any]) -> dict[str, Any]:
    wheel = Path(request["wheel"])
    out = Path(request["out"])
    project, version = request["project"], Version(request["version"])
    python, machine = request["python"], request["machine"]

    def accepts(tags: frozenset[Any]) -> bool:
        return tags_serve(tags, python, machine)

    cap = int(request["max_unpacked_bytes"])
    try:
        name = parse_name(wheel.name)
        if name.version.public != version.public:
            raise InvalidWheel(f"{wheel.name}: built version {name.version}, expected {version}")
        validate_wheel(wheel, project, name.version, accepts, max_unpacked_bytes=cap)
        if request["relabel"] and name.version != version:
            wheel = relabel(wheel, request["label"], _fresh(out / "relabelled"))
        elif name.version != version:
            raise InvalidWheel(f"{wheel.name}: built version {name.version}, expected "
                               f"{version} (does the recipe put the label into METADATA?)")
        validate_wheel(wheel, project, version, accepts, max_unpacked_bytes=cap)
    except InvalidWheel as exc:
        raise BuildFailed(FailureKind.INVALID_WHEEL, str(exc)) from None
    modules = extension_modules(wheel)
    found = wheel_device_code(wheel)
    applied = [AppliedPatch(**p) for p in request["patches"]]
    if applied:
        wheel = note_wheel(wheel, applied, _fresh(out / "noted"))
    variant = parse_variant(request["variant"])
    # Built against this torch: its roots' wheel says so, as its variant form does.
    wheel = pin_torch(wheel, torch_requirement(variant), _fresh(out / "pinned"))
    final = _fresh(out / "wheel") / wheel.name
    shutil.copyfile(wheel, final)
    report: dict[str, Any] = {
        "ok": True, "wheel": final.name,
        "metadata": _keep_metadata(final, out / "wheel"),
        "modules": modules,
        "device_code": {lib: code.to_dict() for lib, code in sorted(found.items())},
    }
    steps = loadcheck.plan(final, request["load_check"])
    report["load_steps"] = [[s.how.value, s.target] for s in steps]
    archs = sass_archs(a for code in found.values() for a in code.sass)
    if archs and request["variant_form"]:
        vdir = _fresh(out / "variant")
        vpath, label = make_variant_wheel(final, variant, archs, vdir)
        report["variant"] = {"wheel": vpath.name, "label": label, "archs": list(archs),
                             "metadata": _keep_metadata(vpath, vdir)}
    _install(final, Path(request["site"]))
    return report


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=False)
    return path


def _keep_metadata(wheel: Path, where: Path) -> str:
    """The wheel's METADATA, byte for byte, beside it (PEP 658 serves it); return its name."""
    name = wheel.name + ".metadata"
    (where / name).write_bytes(read_metadata(wheel))
    return name


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


def _install(wheel: Path, site: Path) -> None:
    """Install the checked wheel into ``site`` as an installer lays out platlib and purelib.

    The wheel passed :func:`validate_wheel` (member names inside the tree, declared sizes
    within the cap, RECORD matching), and this runs under the build's disk quota: what it
    unpacks is bounded twice.
    """
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("platlib", "purelib"):
                    continue  # scripts, headers, data: not what loading needs
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, _MIB)


_OPS = {"unpack": _unpack_op, "wheel": _wheel_op}


def main(argv: list[str]) -> int:
    """``python -I -c BOOT REQUEST_JSON``: run one operation and write its report."""
    request = json.loads(argv[0])
    try:
        report = _OPS[request["op"]](request)
    except PatchFailed as exc:
        report = {"ok": False, "kind": exc.kind.value, "reason": exc.reason}
    except BuildFailed as exc:
        report = {"ok": False, "kind": exc.kind.value, "reason": exc.reason}
    _write_report(Path(request["report"]), report)
    return 0


def _write_report(path: Path, report: Mapping[str, Any]) -> None:
    """A fresh file: whatever an archive planted at that name is removed, never written
    through."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
