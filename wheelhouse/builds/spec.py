"""Build specs: exactly which wheel a build must produce, validated before anything runs.

A spec is (project, version, Python, torch, CUDA, GPU architectures, C++ ABI, CPU architecture).
It maps to one variant (the index root the wheel is published into), one expected wheel file
name, and one deterministic RQ job id, so that asking twice for the same wheel finds the same job.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from wheelhouse.errors import InvalidBuildSpec, InvalidVariant
from wheelhouse.variants import Variant

#: Python versions a build may target (``uv`` provides the interpreter).
KNOWN_PYTHONS: tuple[str, ...] = ("3.9", "3.10", "3.11", "3.12", "3.13", "3.14")
#: CPU architectures, as ``platform.machine()`` and wheel platform tags spell them.
KNOWN_MACHINES: tuple[str, ...] = ("x86_64", "aarch64")

MAX_FIELD_LENGTH = 100
#: The newest glibc (2.N) and musl (1.N) a wheel's manylinux or musllinux tag may name and still
#: count. The index serves many hosts and can't know an installer's libc, so every level up to
#: these counts; they only need to stay ahead of what wheels are built for.
NEWEST_GLIBC_MINOR = 50
NEWEST_MUSL_MINOR = 9
_PROJECT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_JOB_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The longest sdist file name accepted for an uploaded source.
MAX_SDIST_FILENAME = 200


def normalize_python(python: str) -> str:
    """``3.11``, ``3.11.7``, ``cp311`` or ``311`` → ``3.11``, for known versions only."""
    text = python.strip().lower().removeprefix("cp").removeprefix("py")
    if re.fullmatch(r"3[0-9]{1,2}", text):
        text = f"3.{text[1:]}"
    try:
        v = Version(text)
    except InvalidVersion:
        raise InvalidBuildSpec(f"Python version {python[:40]!r} is not a version") from None
    short = f"{v.major}.{v.minor}" if len(v.release) >= 2 else ""
    if short not in KNOWN_PYTHONS:
        raise InvalidBuildSpec(
            f"unsupported Python version {python[:40]!r}; known: {', '.join(KNOWN_PYTHONS)}"
        )
    return short


def normalize_machine(machine: str) -> str:
    text = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.strip().lower(), machine.strip())
    if text not in KNOWN_MACHINES:
        raise InvalidBuildSpec(
            f"unknown CPU architecture {machine[:40]!r}; known: {', '.join(KNOWN_MACHINES)}"
        )
    return text


def _check_length(name: str, value: str) -> None:
    if len(value) > MAX_FIELD_LENGTH:
        raise InvalidBuildSpec(f"{name} is too long ({len(value)} characters)")


@dataclass(frozen=True)
class BuildSpec:
    """One wheel to build. Create with :meth:`create`, which validates and normalizes."""

    project: NormalizedName
    version: str
    python: str
    variant: Variant
    machine: str = "x86_64"
    source: SourceRef | None = None
    """An uploaded sdist to build instead of the upstream index's (``wheelhouse request PATH``);
    part of the job id, so that another upload of the same version is another build."""

    @classmethod
    def create(
        cls,
        project: str,
        version: str,
        *,
        python: str,
        torch: str,
        cuda: str,
        archs: Iterable[str] = (),
        cxx11abi: bool | None = None,
        machine: str = "x86_64",
        source: Mapping[str, Any] | None = None,
    ) -> BuildSpec:
        """Validate loose user input; raise :class:`InvalidBuildSpec` with a plain message."""
        for name, value in (("project", project), ("version", version), ("python", python),
                            ("torch", torch), ("cuda", cuda), ("machine", machine)):
            if not isinstance(value, str):
                raise InvalidBuildSpec(f"{name} must be a string")
            _check_length(name, value)
        if not _PROJECT.fullmatch(project):
            raise InvalidBuildSpec(f"{project[:40]!r} is not a valid project name")
        try:
            v = Version(version)
        except InvalidVersion:
            raise InvalidBuildSpec(
                f"version {version[:40]!r} is not a valid PEP 440 version"
            ) from None
        if v.local is not None:
            raise InvalidBuildSpec(
                f"version {version[:40]!r} has a local label; ask for the public version, "
                "the variant's label is added by the build"
            )
        arch_list = list(archs)
        if len(arch_list) > 20 or not all(isinstance(a, str) for a in arch_list):
            raise InvalidBuildSpec("archs must be a short list of strings")
        try:
            variant = Variant.of(torch, cuda, arch_list, cxx11abi)
        except InvalidVariant as exc:
            raise InvalidBuildSpec(str(exc)) from None
        name = canonicalize_name(project)
        return cls(
            project=name,
            version=str(v),
            python=normalize_python(python),
            variant=variant,
            machine=normalize_machine(machine),
            source=None if source is None else SourceRef.create(source, name, v),
        )

    # -- derived names --

    @property
    def torch(self) -> str:
        return self.variant.torch

    @property
    def cuda(self) -> str:
        return self.variant.cuda

    @property
    def archs(self) -> tuple[str, ...]:
        return self.variant.archs

    @property
    def cxx11abi(self) -> bool:
        return self.variant.cxx11abi

    @property
    def dist_name(self) -> str:
        return self.project.replace("-", "_")

    @property
    def python_tag(self) -> str:
        """``cp311``."""
        return "cp" + self.python.replace(".", "")

    @property
    def wheel_version(self) -> Version:
        """The version the published wheel carries: the public version plus the variant label."""
        return Version(f"{self.version}+{self.variant.local_label}")

    @property
    def expected_tag(self) -> Tag:
        return Tag(self.python_tag, self.python_tag, f"linux_{self.machine}")

    @property
    def expected_wheel_name(self) -> str:
        """What ``setup.py bdist_wheel`` names the wheel once labelled (no manylinux repair)."""
        t = self.expected_tag
        return f"{self.dist_name}-{self.wheel_version}-{t.interpreter}-{t.abi}-{t.platform}.whl"

    def tags_match(self, tags: Iterable[Tag]) -> bool:
        """Whether a wheel with these tags installs into this spec's Python and CPU: the one
        rule of which wheels serve which interpreter (see :func:`tags_serve`)."""
        return tags_serve(tags, self.python, self.machine)

    def served_by(self, filename: str) -> bool:
        """Whether the wheel called ``filename`` is one this spec asks for (its version, and
        tags that install into its Python and CPU: :meth:`tags_match`, the one rule)."""
        try:
            _, version, _, tags = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            return False
        return version.public == self.version and self.tags_match(tags)

    @property
    def queue_name(self) -> str:
        """The RQ queue of workers that can build this: one per CUDA version and CPU arch."""
        return queue_name(self.cuda, self.machine)

    @property
    def job_id(self) -> str:
        """A deterministic RQ job id (``[A-Za-z0-9_-]`` only): readable prefix + digest."""
        readable = f"build-{self.project}-{self.version}-py{self.python}-{self.variant.key}"
        readable = _JOB_ID_UNSAFE.sub("_", readable.replace(".", "_"))[:120]
        digest = hashlib.sha256(self.canonical_json().encode()).hexdigest()[:12]
        return f"{readable}-{self.machine}-{digest}"

    def with_source(self, source: Any) -> BuildSpec:
        """This spec, building the uploaded sdist ``{"sha256", "filename"}`` (validated)."""
        return dataclasses.replace(
            self, source=SourceRef.create(source, self.project, Version(self.version)))

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form; :meth:`from_dict` validates it again. ``source`` appears
        only when set, so that the job ids of upstream builds stay what they were."""
        data: dict[str, Any] = {
            "project": str(self.project),
            "version": self.version,
            "python": self.python,
            "torch": self.torch,
            "cuda": self.cuda,
            "archs": list(self.archs),
            "cxx11abi": self.cxx11abi,
            "machine": self.machine,
        }
        if self.source is not None:
            data["source"] = {"sha256": self.source.sha256, "filename": self.source.filename}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BuildSpec:
        try:
            return cls.create(
                data["project"], data["version"], python=data["python"], torch=data["torch"],
                cuda=data["cuda"], archs=data.get("archs") or (),
                cxx11abi=data.get("cxx11abi"), machine=data.get("machine", "x86_64"),
                source=data.get("source"),
            )
        except (KeyError, TypeError) as exc:
            raise InvalidBuildSpec(f"build spec is missing or mistypes a field: {exc}") from None

    def describe(self) -> str:
        """``flash-attn 2.8.3 for Python 3.11, torch2.8-cu128 (x86_64)`` (plus ``from the
        uploaded sdist <sha256 prefix>`` for an uploaded source)."""
        text = (f"{self.project} {self.version} for Python {self.python}, "
                f"{self.variant.key} ({self.machine})")
        if self.source is not None:
            text += f", from the uploaded sdist {self.source.sha256[:12]}"
        return text

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class SourceRef:
    """An uploaded sdist, named by its sha256 (never by a path a client chose) and its file
    name, which must be an sdist's of the spec's project and version."""

    sha256: str
    filename: str

    @classmethod
    def create(cls, data: Mapping[str, Any], project: NormalizedName,
               version: Version) -> SourceRef:
        """Validate ``{"sha256", "filename"}``; raise :class:`InvalidBuildSpec` saying why."""
        if not isinstance(data, Mapping):
            raise InvalidBuildSpec('source must be an object: {"sha256", "filename"}')
        sha256, filename = data.get("sha256"), data.get("filename")
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise InvalidBuildSpec("source.sha256 must be 64 lowercase hex digits")
        if set(data) - {"sha256", "filename"}:
            raise InvalidBuildSpec('source has fields besides "sha256" and "filename"')
        check_sdist_filename(filename, project, version)
        assert isinstance(filename, str)
        return cls(sha256, filename)


def check_sdist_filename(filename: object, project: str | None = None,
                         version: Version | None = None) -> tuple[NormalizedName, Version]:
    """The project and version an sdist's file name names (``vecadd-0.1.0.tar.gz``), checked
    against ``project`` and ``version`` when given; :class:`InvalidBuildSpec` otherwise."""
    if not isinstance(filename, str) or not filename:
        raise InvalidBuildSpec("the sdist's file name must be a non-empty string")
    if (len(filename) > MAX_SDIST_FILENAME or "/" in filename or "\\" in filename
            or filename.startswith(".") or not filename.isascii() or not filename.isprintable()):
        raise InvalidBuildSpec(f"{filename[:60]!r} is not an sdist file name")
    try:
        name, parsed = parse_sdist_filename(filename)
    except InvalidSdistFilename:
        raise InvalidBuildSpec(f"{filename[:60]!r} is not an sdist file name "
                               "(name-version.tar.gz or .zip)") from None
    if project is not None and name != canonicalize_name(project):
        raise InvalidBuildSpec(f"{filename[:60]!r} is not an sdist of {project}")
    if version is not None and parsed != version:
        raise InvalidBuildSpec(f"{filename[:60]!r} is not an sdist of version {version}")
    return name, parsed


def tags_serve(tags: Iterable[Tag], python: str, machine: str) -> bool:
    """Whether a wheel with these tags installs into CPython ``python`` (``3.11``) on a Linux
    ``machine`` (``x86_64``, ``aarch64``, as ``platform.machine()`` spells it).

    The interpreter's tags come from :mod:`packaging.tags`, as pip and uv derive them: its own
    ``cpXY-cpXY``, ``abi3`` of it and older CPythons, ``py3-none-any`` and the like, on
    ``linux_<machine>`` or any manylinux or musllinux level.
    """
    return not supported_tags(python, machine).isdisjoint(tags)


@functools.cache
def supported_tags(python: str, machine: str) -> frozenset[Tag]:
    """Every tag CPython ``python`` on a Linux ``machine`` installs (see :func:`tags_serve`)."""
    try:
        v = Version(python)
    except InvalidVersion:
        raise InvalidBuildSpec(f"Python version {python[:40]!r} is not a version") from None
    version = (v.major, v.minor)
    interpreter = f"cp{v.major}{v.minor}"
    platforms = [
        f"linux_{machine}",
        *(f"manylinux_2_{minor}_{machine}" for minor in range(NEWEST_GLIBC_MINOR, 4, -1)),
        # PEP 600 names these aliases of manylinux_2_17, _2_12 and _2_5.
        *(f"{legacy}_{machine}" for legacy in ("manylinux2014", "manylinux2010", "manylinux1")),
        *(f"musllinux_1_{minor}_{machine}" for minor in range(NEWEST_MUSL_MINOR, -1, -1)),
    ]
    return frozenset(chain(
        cpython_tags(version, abis=[interpreter], platforms=platforms),
        compatible_tags(version, interpreter=interpreter, platforms=platforms),
    ))


def queue_name(cuda: str, machine: str) -> str:
    """``build-cu130-x86_64``."""
    return f"build-cu{cuda.replace('.', '')}-{machine}"


def prove_queue_name(arch: str, machine: str) -> str:
    """``prove-sm90-x86_64``: the GPU proofs that a host with an sm_90 GPU takes."""
    return f"prove-sm{arch}-{machine}"
