"""The build-request form's validation, shared by the pages and the JSON API.

Validation here is per field, so that a form can show each message next to its field and the
API can name the field; :meth:`BuildSpec.create` validates again in the core.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.utils import InvalidName, canonicalize_name
from packaging.version import InvalidVersion, Version

from wheelhouse.builds.spec import (
    KNOWN_MACHINES,
    KNOWN_PYTHONS,
    MAX_FIELD_LENGTH,
    BuildSpec,
    normalize_machine,
    normalize_python,
)
from wheelhouse.errors import InvalidBuildSpec, InvalidVariant
from wheelhouse.variants import (
    KNOWN_ARCHS,
    KNOWN_CUDA,
    normalize_arch,
    normalize_cuda,
    normalize_torch,
)

#: torch versions the form suggests (any valid major.minor is accepted).
SUGGESTED_TORCH: tuple[str, ...] = ("2.14", "2.10", "2.9", "2.8", "2.7", "2.6", "2.5")
FIELDS = ("project", "version", "torch", "cuda", "python", "archs", "machine", "split_archs")
#: The most builds one request may create (all Pythons of one variant).
MAX_PYTHONS = len(KNOWN_PYTHONS)


# -- validating a request --


@dataclass
class BuildRequest:
    """A validated request: one spec per Python, or the errors by field."""

    specs: list[BuildSpec] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    """What was submitted, normalized where it could be: refills the form."""
    split_archs: bool | None = None
    """One job per GPU architecture (``wheelhouse.builds.fanout``); None: the recipe's default."""


def _as_list(value: Any) -> list[Any]:
    if value is None or value == "":
        return []
    if isinstance(value, list | tuple):
        return [v for v in value if v != ""]
    return [value]


def _text(data: Mapping[str, Any], name: str, errors: dict[str, str]) -> str:
    value = data.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        errors[name] = f"{name} is required"
        return ""
    if not isinstance(value, str):
        errors[name] = f"{name} must be a string"
        return ""
    if len(value) > MAX_FIELD_LENGTH:
        errors[name] = f"{name} is too long ({len(value)} characters, at most {MAX_FIELD_LENGTH})"
        return ""
    return value.strip()


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _known(errors: dict[str, str], name: str, values: list[str],
           normalize: Callable[[str], str], unknown: str, known: Iterable[str]) -> list[str]:
    """The values normalized, up to the first that isn't known: that one is kept as given (the
    form shows what was typed) and the error is set for field ``name``."""
    out = []
    for value in values:
        try:
            out.append(normalize(value))
        except (InvalidBuildSpec, InvalidVariant):
            errors[name] = f"{unknown} {_short(value)!r}; known: " + ", ".join(known)
            out.append(value)
            break
    return out


def parse_request(data: Mapping[str, Any], allowed: Collection[str] = ()) -> BuildRequest:
    """Check every field of a build request against its allow-list; never raises.

    ``allowed`` is the operator's list of projects (``WHEELHOUSE_ALLOWED_PROJECTS``); empty
    means any valid project name (the generic recipe builds those without a recipe).
    """
    req = BuildRequest()
    errors = req.errors
    project = _text(data, "project", errors)
    if project:
        try:
            name = canonicalize_name(project, validate=True)
        except InvalidName:
            errors["project"] = f"{_short(project)!r} is not a valid project name"
        else:
            if allowed and name not in allowed:
                errors["project"] = (f"{_short(project)!r} is not built by this server; it "
                                     f"builds {', '.join(sorted(allowed))}")
    version = _text(data, "version", errors)
    if version:
        try:
            v = Version(version)
            if v.local is not None:
                errors["version"] = "give the public version; the variant's label is added"
        except InvalidVersion:
            errors["version"] = f"{_short(version)!r} is not a PEP 440 version (e.g. 2.8.3)"
    torch = _text(data, "torch", errors)
    if torch:
        try:
            torch = normalize_torch(torch)
        except InvalidVariant as exc:
            errors["torch"] = str(exc)
    cuda = _text(data, "cuda", errors)
    if cuda:
        cuda = _known(errors, "cuda", [cuda], normalize_cuda, "unknown CUDA version",
                      KNOWN_CUDA)[0]
    pythons: list[str] = []
    raw_pythons = _as_list(data.get("python"))
    if not raw_pythons:
        errors["python"] = "choose at least one Python version"
    elif len(raw_pythons) > MAX_PYTHONS or not all(isinstance(p, str) for p in raw_pythons):
        errors["python"] = f"python must be a list of at most {MAX_PYTHONS} version strings"
    else:
        pythons = _known(errors, "python", raw_pythons, normalize_python, "unsupported Python",
                         KNOWN_PYTHONS)
    archs: list[str] = []
    raw_archs = _as_list(data.get("archs"))
    if len(raw_archs) > len(KNOWN_ARCHS) or not all(isinstance(a, str) for a in raw_archs):
        errors["archs"] = "archs must be a short list of architecture strings"
    else:
        archs = _known(errors, "archs", raw_archs, normalize_arch, "unknown GPU architecture",
                       ["sm" + k for k in KNOWN_ARCHS])
    machine = data.get("machine") or "x86_64"
    if not isinstance(machine, str) or len(machine) > MAX_FIELD_LENGTH:
        errors["machine"] = "machine must be a short string"
        machine = "x86_64"
    else:
        machine = _known(errors, "machine", [machine], normalize_machine,
                         "unknown CPU architecture", KNOWN_MACHINES)[0]
    split = data.get("split_archs")
    if split is not None and not isinstance(split, bool):
        errors["split_archs"] = "split_archs must be true or false (absent: the recipe's default)"
    else:
        req.split_archs = split
    unknown = [k for k in data if k not in FIELDS]
    if unknown:
        errors["_"] = "unknown fields: " + ", ".join(_short(k) for k in sorted(unknown)[:5])
    req.values = {"project": project, "version": version, "torch": torch, "cuda": cuda,
                  "python": pythons or [p for p in raw_pythons if isinstance(p, str)],
                  "archs": archs, "machine": machine, "split_archs": req.split_archs}
    if errors:
        return req
    for python in dict.fromkeys(pythons):
        try:
            req.specs.append(BuildSpec.create(project, version, python=python, torch=torch,
                                              cuda=cuda, archs=archs, machine=machine))
        except InvalidBuildSpec as exc:  # the core's second opinion
            errors["_"] = str(exc)
            req.specs.clear()
            break
    return req
