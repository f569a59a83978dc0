"""The source step: the sdist fetched (hash verified) or given, unpacked within limits at this
host's one path for the project version, under a lock, with the recipe's patches applied; the
unpack and the patches run in the sandbox (:mod:`worker.sandbox.untrusted`)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from wheelhouse.builds.facts import AppliedPatch
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.index import layout
from wheelhouse.recipes.patches import Patch
from wheelhouse.wheels import sha256_file
from worker.errors import UnsafePath
from worker.sandbox import safefs
from worker.sandbox.untrusted import patch_to_dict
from worker.sdist import SdistLimits, download_sdist, fetch_stored_sdist, find_sdist
from worker.steps.context import BuildContext
from worker.supervision.runner import Runner


@dataclass(frozen=True)
class Source:
    """The unpacked, patched sdist."""

    path: Path
    patches: tuple[AppliedPatch, ...]
    """The recipe patches applied, in order (the wheel's METADATA will name them)."""


@contextmanager
def unpacked(ctx: BuildContext, run: Runner, given: Path | None) -> Iterator[Source]:
    """The sdist (``given``, else the uploaded one the spec names, else the upstream index's;
    either one's hash verified), unpacked and
    patched; this host's lock on the source path is held until the block ends, when the
    unpacked tree is removed (unless the workspace is kept)."""
    ctx.journal.phase("fetch")
    limits = SdistLimits.from_config(ctx.config)
    if given is not None:
        sdist = given
        ctx.say(f"source: local {sdist}")
        # Hashing reads the bytes without parsing them: safe in the worker's own process.
        ctx.journal.measured(sdist_sha256=sha256_file(sdist), sdist_url=sdist.resolve().as_uri())
    elif ctx.spec.source is not None:
        sdist = _fetch_uploaded(ctx, limits)
    else:
        sdist = _download(ctx, limits)
    ctx.journal.measured(sdist=sdist.name)
    lock = _lock(ctx, run)
    try:
        safefs.discard_tree(ctx.source_root)  # a crashed build's leftovers, by descriptor
        yield _unpack(ctx, run, sdist, limits)
    finally:
        if not ctx.keep_workspace:
            safefs.discard_tree(ctx.source_root)  # the build wrote it: by descriptor
        os.close(lock)  # closing the descriptor releases the lock


def _download(ctx: BuildContext, limits: SdistLimits) -> Path:
    index = ctx.config.upstream
    if index == "off":
        raise BuildFailed(FailureKind.INCOMPATIBLE,
                          "no upstream index is configured, so the sdist must be given")
    spec = ctx.spec
    link = ctx.retried("looking up the sdist",
                       lambda: find_sdist(index, spec.project, spec.version))
    ctx.say(f"source: {link.url} (sha256 {link.sha256})")
    sdist = ctx.retried("downloading the sdist",
                        lambda: download_sdist(link, ctx.workspace / "sdist",
                                               max_bytes=limits.max_bytes))
    ctx.say(f"sha256 verified: {sdist.name}")
    ctx.journal.measured(sdist_sha256=link.sha256, sdist_url=link.url)
    return sdist


def _fetch_uploaded(ctx: BuildContext, limits: SdistLimits) -> Path:
    ref = ctx.spec.source
    assert ref is not None
    ctx.say(f"source: the uploaded {ref.filename} (sha256 {ref.sha256})")
    sdist = ctx.retried("reading the uploaded sdist",
                        lambda: fetch_stored_sdist(ctx.storage, ref.sha256, ref.filename,
                                                   ctx.workspace / "sdist",
                                                   max_bytes=limits.max_bytes))
    ctx.say(f"sha256 verified: {sdist.name}")
    ctx.journal.measured(sdist_sha256=ref.sha256,
                         sdist_url=layout.source_key(ref.sha256, ref.filename))
    return sdist


def _lock(ctx: BuildContext, run: Runner) -> int:
    """Take this host's lock on the project version's source path; return its descriptor.

    nvcc hands the source path to cicc, which the compile cache hashes verbatim, so every
    build of one project version unpacks to the same path (a sandboxed build sees it at
    :data:`~worker.sandbox.wrapper.SOURCE_INSIDE`, an unsandboxed one here): a second Python
    then hits for every kernel. Two such builds on one host take turns (the second one's
    kernels hit).
    """
    root = ctx.source_root
    root.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(root.with_name(root.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    said = False

    def taken() -> bool:
        nonlocal said
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not said:
                said = True
                ctx.say(f"waiting for another build of {ctx.spec.project} {ctx.spec.version} "
                        f"on this host to finish (its source path is shared, so this build's "
                        f"compiles will hit its cache)")
            return False

    try:
        run.wait_until(taken, what="another build of the same version")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unpack(ctx: BuildContext, run: Runner, sdist: Path, limits: SdistLimits) -> Source:
    """Unpack the sdist and apply the recipe's patches in the sandbox, as the build's uid
    (:mod:`worker.sandbox.untrusted`): the archive is the attacker's, and only the build's own
    places
    are writable there. The report names the project directory, which is checked here to be
    one real directory right below the source path."""
    patches = _patches(ctx)
    root = ctx.source_root
    if sdist.is_dir():
        inputs = sdist.resolve()  # a local project directory (`wheelhouse build DIR`)
    else:
        inputs = ctx.workspace / "sdist"  # the worker's copy, whatever was given
        if sdist.parent.resolve() != inputs:
            _copy_in(sdist, inputs, limits)
        sdist = inputs / sdist.name
    report = run.untrusted(
        {"op": "unpack", "sdist": str(sdist), "dest": str(run.seen(root)),
         "limits": limits.to_dict(), "patches": [patch_to_dict(p) for p in patches]},
        what="unpacking the sdist", failure=FailureKind.UNSAFE_ARCHIVE,
        read_only=[inputs], writable=[root])
    project = report.get("project")
    if not isinstance(project, str) or "/" in project or project in (".", "..") or (
            project.startswith(".")):
        raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                          f"unpacking {sdist.name} reported no project directory")
    src = root
    if project:
        try:
            _is_directory(root, project)
        except (OSError, UnsafePath) as exc:
            raise BuildFailed(FailureKind.UNSAFE_ARCHIVE,
                              f"{sdist.name}: {project[:100]!r} is no directory: {exc}") from None
        src = root / project
    applied = tuple(p.applied() for p in patches)
    if report.get("applied") != [p.sha256 for p in applied]:
        raise BuildFailed(FailureKind.PATCH_FAILED,
                          "the recipe's patches were not all applied to the sdist")
    for patch in applied:
        ctx.say(f"patch {patch.ref} applied: {patch.description}")
    ctx.journal.measured(patches=applied)
    return Source(src, applied)


def _is_directory(root: Path, name: str) -> None:
    """``root/name`` is a real directory (no link on the way); raise otherwise."""
    dirfd = safefs.open_dir(root)
    try:
        os.close(safefs.open_subdir(dirfd, name))
    finally:
        os.close(dirfd)


def _patches(ctx: BuildContext) -> tuple[Patch, ...]:
    """The recipe's patches for this version and torch."""
    try:
        version = Version(ctx.spec.version)
    except InvalidVersion:
        return ()
    # Before the venv, the variant's torch (``2.14``) stands for the installed one.
    return tuple(ctx.recipe.patches_for(version, Version(ctx.spec.torch)))


def _copy_in(sdist: Path, inputs: Path, limits: SdistLimits) -> None:
    """A given sdist file into the build's inputs, as opaque bytes within the size cap."""
    inputs.mkdir(parents=True, exist_ok=True)
    try:
        dirfd = safefs.open_dir(sdist.parent)
    except (OSError, UnsafePath) as exc:
        raise BuildFailed(FailureKind.INCOMPATIBLE, f"{sdist}: {exc}") from None
    try:
        safefs.copy_out(dirfd, sdist.name, inputs / sdist.name, max_bytes=limits.max_bytes)
    except UnsafePath as exc:
        kind = FailureKind.TOO_LARGE if " over the " in str(exc) else FailureKind.INCOMPATIBLE
        raise BuildFailed(kind, f"{sdist.name}: {exc}") from None
    except FileNotFoundError:
        raise BuildFailed(FailureKind.INCOMPATIBLE, f"{sdist} does not exist") from None
    finally:
        os.close(dirfd)
