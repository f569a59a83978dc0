"""Recipe patches: declared, version-scoped changes to an upstream sdist, applied before a build.

A recipe lists its patches as ``[[patch]]`` tables (see docs/recipes.md). Each applies only where
the project's version and the torch version it is built against fall in its ranges (PEP 440
specifier sets), and is one of two kinds:

- literal replacements in named files, each with the number of occurrences it expects, so that
  a patch written for one ``setup.py`` fails instead of silently doing nothing on another;
- a unified diff kept beside the recipe, applied with ``git apply`` (atomic: all hunks or none,
  no fuzz), never through a shell.

A patch that does not apply raises :class:`~wheelhouse.errors.PatchFailed` (failure kind
``patch-failed``) with one line saying which patch and why. What was applied is returned as
:class:`AppliedPatch` values (id, description, sha256 of the patch) for the build record, the
build page and the wheel's METADATA (:func:`metadata_note`, :func:`note_wheel`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from wheelhouse.builds.facts import AppliedPatch
from wheelhouse.errors import InvalidRecipe, PatchFailed
from wheelhouse.wheels import add_description_note

#: Patch ids: short, stable names that appear in records, pages and METADATA.
PATCH_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?")
MAX_DESCRIPTION = 200
#: How long ``git apply`` may take on one diff before it counts as failed.
GIT_APPLY_TIMEOUT = 60
#: The line each applied patch gets in a wheel's METADATA description.
NOTE_PREFIX = "wheelhouse-patch: "
_NOTE = re.compile(
    r"^wheelhouse-patch: (?P<recipe>[a-z0-9._-]+)/(?P<id>[a-z0-9-]+) "
    r"sha256=(?P<sha256>[0-9a-f]{64}) (?P<description>.*)$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Replacement:
    """Replace every occurrence of ``old`` with ``new`` in ``file``, which must hold ``count``."""

    file: str
    old: str
    new: str
    count: int


@dataclass(frozen=True)
class Patch:
    """One declared change to a project's sdist."""

    recipe: str
    id: str
    description: str
    versions: SpecifierSet
    """The project versions it applies to (empty: all)."""
    torch: SpecifierSet
    """The torch versions it applies to (empty: all)."""
    replacements: tuple[Replacement, ...] = ()
    diff: bytes = b""
    """A unified diff (``-p1`` paths), read from beside the recipe when the recipe is loaded."""
    diff_name: str = ""

    @property
    def sha256(self) -> str:
        """The digest of what the patch changes: the diff's bytes, or its replacements."""
        if self.diff:
            return hashlib.sha256(self.diff).hexdigest()
        canonical = json.dumps(
            [{"file": r.file, "old": r.old, "new": r.new, "count": r.count}
             for r in self.replacements],
            sort_keys=True, separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def applied(self) -> AppliedPatch:
        """What the build record and METADATA say of this patch once it applied."""
        return AppliedPatch(recipe=self.recipe, id=self.id, description=self.description,
                            sha256=self.sha256)

    def applies_to(self, version: Version, torch: Version) -> bool:
        """Whether this patch is for ``version`` of the project built against ``torch``.

        Pre-releases match (a torch nightly is as affected as its release), and so do local
        versions (``2.14.1+cu130``).
        """
        return (self.versions.contains(version, prereleases=True)
                and self.torch.contains(torch, prereleases=True))


# --- parsing (called by wheelhouse.recipes.book)
# ---------------------------------------------------


def _specifiers(value: object, what: str, where: str) -> SpecifierSet:
    if not isinstance(value, str):
        raise InvalidRecipe(f"{where}: {what} must be a string of version specifiers")
    try:
        return SpecifierSet(value)
    except InvalidSpecifier as exc:
        raise InvalidRecipe(f"{where}: {what} {value!r} is not a version range ({exc})") from None


def _relative_path(value: object, where: str) -> str:
    """A plain relative POSIX path that stays inside the directory it is resolved against."""
    if not isinstance(value, str) or not value:
        raise InvalidRecipe(f"{where}: file must be a non-empty string")
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or "\\" in value or "\0" in value:
        raise InvalidRecipe(f"{where}: file {value!r} must be a relative path inside the sdist")
    return str(path)


def _replacement(data: object, where: str) -> Replacement:
    if not isinstance(data, dict):
        raise InvalidRecipe(f"{where}: each [[patch.replace]] must be a table")
    unknown = set(data) - {"file", "old", "new", "count"}
    if unknown:
        raise InvalidRecipe(f"{where}: unknown keys {sorted(unknown)}")
    old, new, count = data.get("old"), data.get("new"), data.get("count")
    if not isinstance(old, str) or not old or not isinstance(new, str):
        raise InvalidRecipe(f"{where}: old (non-empty) and new must be strings")
    if old == new:
        raise InvalidRecipe(f"{where}: old and new are the same")
    # A count is required: "replace whatever is there" is what lets a patch rot unnoticed.
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidRecipe(f"{where}: count (how many occurrences to expect) must be >= 1")
    return Replacement(file=_relative_path(data.get("file"), where), old=old, new=new,
                       count=count)


def _diff(value: object, recipe_path: Path, where: str) -> tuple[str, bytes]:
    name = _relative_path(value, where)
    base = recipe_path.parent.resolve()
    path = (base / name).resolve()
    if not path.is_relative_to(base):
        raise InvalidRecipe(f"{where}: diff {name!r} must lie beside the recipe")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidRecipe(f"{where}: diff {name!r} cannot be read ({exc.strerror})") from None
    if not re.search(rb"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@", data, re.MULTILINE):
        raise InvalidRecipe(f"{where}: {name!r} is not a unified diff (no @@ hunk)")
    return name, data


def parse_patches(entries: object, *, recipe: str, recipe_path: Path) -> tuple[Patch, ...]:
    """Validate a recipe's ``[[patch]]`` array; every mistake is an ``InvalidRecipe`` at load."""
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise InvalidRecipe(f"{recipe_path}: patch must be an array of tables ([[patch]])")
    patches: list[Patch] = []
    for index, data in enumerate(entries):
        where = f"{recipe_path}: patch {index + 1}"
        if not isinstance(data, dict):
            raise InvalidRecipe(f"{where} must be a table")
        unknown = set(data) - {"id", "description", "versions", "torch", "replace", "diff"}
        if unknown:
            raise InvalidRecipe(f"{where}: unknown keys {sorted(unknown)}")
        patch_id = data.get("id")
        if not isinstance(patch_id, str) or not PATCH_ID.fullmatch(patch_id):
            raise InvalidRecipe(f"{where}: id must be lower-case letters, digits and '-' "
                                "(at most 40)")
        where = f"{recipe_path}: patch {patch_id!r}"
        if any(p.id == patch_id for p in patches):
            raise InvalidRecipe(f"{where} is declared twice")
        description = data.get("description")
        if (not isinstance(description, str) or not description.strip()
                or "\n" in description or len(description) > MAX_DESCRIPTION):
            raise InvalidRecipe(f"{where}: description must be one line of at most "
                                f"{MAX_DESCRIPTION} characters")
        if ("replace" in data) == ("diff" in data):
            raise InvalidRecipe(f"{where}: give either [[patch.replace]] or diff, not both "
                                "or neither")
        replacements: tuple[Replacement, ...] = ()
        diff_name, diff = "", b""
        if "replace" in data:
            raw = data["replace"]
            if not isinstance(raw, list) or not raw:
                raise InvalidRecipe(f"{where}: replace must be a non-empty array of tables")
            replacements = tuple(_replacement(r, where) for r in raw)
        else:
            diff_name, diff = _diff(data["diff"], recipe_path, where)
        patches.append(Patch(
            recipe=recipe, id=patch_id, description=description.strip(),
            versions=_specifiers(data.get("versions", ""), "versions", where),
            torch=_specifiers(data.get("torch", ""), "torch", where),
            replacements=replacements, diff=diff, diff_name=diff_name,
        ))
    return tuple(patches)


# --- applying -----------------------------------------------------------------------------------


def _failed(patch: Patch, why: str) -> PatchFailed:
    return PatchFailed(f"patch {patch.recipe}/{patch.id} {why}")


def _target(source_dir: Path, name: str, patch: Patch) -> Path:
    base = source_dir.resolve()
    path = (base / name).resolve()
    # A symlink in the sdist must not lead a replacement outside the source tree.
    if not path.is_relative_to(base):
        raise _failed(patch, f"refuses {name!r}: it leads outside the sdist")
    if not path.is_file():
        raise _failed(patch, f"does not apply: the sdist has no file {name!r}")
    return path


def _apply_replacements(patch: Patch, source_dir: Path) -> None:
    # Check every replacement before writing any, so a failed patch leaves its files as they were.
    edits: dict[Path, bytes] = {}
    for r in patch.replacements:
        path = _target(source_dir, r.file, patch)
        data = edits.get(path)
        if data is None:
            data = path.read_bytes()
        old = r.old.encode()
        found = data.count(old)
        if found != r.count:
            raise _failed(patch, f"does not apply: {r.file} holds {r.old!r} {found} time(s), "
                                 f"the recipe expects {r.count}; the sdist changed, so update "
                                 "the patch or narrow its versions")
        edits[path] = data.replace(old, r.new.encode())
    for path, data in edits.items():
        path.write_bytes(data)


def _git(args: list[str], patch: Patch, source_dir: Path) -> subprocess.CompletedProcess[bytes]:
    git = shutil.which("git")
    if git is None:
        raise _failed(patch, "cannot be applied: git is not installed on this worker")
    base = source_dir.resolve()
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "LC_ALL": "C",
        # No repository at all: not one around the workspace (git apply would take paths from
        # its top and silently skip files outside the current directory), nor a .git shipped in
        # the sdist (its config is not ours to read). Nor the host's configuration
        # (apply.whitespace and friends change what applies).
        "GIT_DIR": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "HOME": str(base.parent),
    }
    try:
        return subprocess.run(
            [git, "apply", "-p1", "--whitespace=nowarn", *args, "-"],
            input=patch.diff, cwd=base, env=env, capture_output=True,
            timeout=GIT_APPLY_TIMEOUT, check=False,
        )
    except subprocess.TimeoutExpired:
        raise _failed(patch, f"did not apply within {GIT_APPLY_TIMEOUT}s") from None


def _apply_diff(patch: Patch, source_dir: Path) -> None:
    done = _git([], patch, source_dir)
    if done.returncode == 0:
        return
    if _git(["--check", "--reverse"], patch, source_dir).returncode == 0:
        raise _failed(patch, "is already in the sdist (its change went upstream): narrow its "
                             "versions")
    lines = [ln for ln in done.stderr.decode(errors="replace").splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "does not apply" in ln or "No such file" in ln),
                  lines[-1] if lines else f"git apply exited {done.returncode}")
    raise _failed(patch, f"does not apply ({detail.removeprefix('error: ')[:200]}); the sdist "
                         "changed, so update the diff or narrow its versions")


def apply_patches(patches: Sequence[Patch], source_dir: Path) -> list[AppliedPatch]:
    """Apply ``patches`` in order to the unpacked sdist in ``source_dir``.

    Raises ``PatchFailed`` on the first that does not apply exactly; each replacement patch and
    each diff is all-or-nothing, but patches before the failing one stay applied (the tree is
    discarded with the failed build).
    """
    applied: list[AppliedPatch] = []
    for patch in patches:
        if patch.diff:
            _apply_diff(patch, source_dir)
        else:
            _apply_replacements(patch, source_dir)
        applied.append(patch.applied())
    return applied


# --- telling users --------------------------------------------------------------------------------


def metadata_note(applied: Sequence[AppliedPatch]) -> str:
    """The paragraphs a patched wheel's METADATA description ends with, one per patch."""
    return "\n\n".join(f"{NOTE_PREFIX}{a.ref} sha256={a.sha256} {a.description}"
                       for a in applied)


def read_metadata_note(metadata: bytes) -> list[AppliedPatch]:
    """The patches a wheel's METADATA says were applied (empty for an unpatched wheel)."""
    text = metadata.decode("utf-8", errors="replace").replace("\r\n", "\n")
    _headers, _, body = text.partition("\n\n")
    return [AppliedPatch(recipe=m["recipe"], id=m["id"], description=m["description"],
                         sha256=m["sha256"]) for m in _NOTE.finditer(body)]


def note_wheel(path: Path, applied: Sequence[AppliedPatch], dest_dir: Path) -> Path:
    """Write a copy of the wheel at ``path`` into ``dest_dir`` whose METADATA lists ``applied``.

    The note goes at the end of the description (the METADATA body), which every installer
    ignores and the core metadata specification allows; a custom header would not be valid
    core metadata (``packaging.metadata`` rejects unknown fields). RECORD is rewritten to match.
    """
    if not applied:
        raise ValueError("no patches to note")
    return add_description_note(path, metadata_note(applied), dest_dir)
