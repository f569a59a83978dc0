"""The source step: the sdist fetched (hash verified) or given, unpacked within limits at this
host's one path for the project version, under a lock, with the recipe's patches applied."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from wheelhouse.buildfacts import AppliedPatch
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.patches import apply_patches
from worker import safefs
from worker.runner import Runner
from worker.sdist import SdistLimits, download_sdist, fetch_stored_sdist, find_sdist, unpack
from worker.steps.context import BuildContext


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
    elif ctx.spec.source is not None:
        sdist = _fetch_uploaded(ctx, limits)
    else:
        sdist = _download(ctx, limits)
    ctx.journal.measured(sdist=sdist.name)
    lock = _lock(ctx, run)
    try:
        safefs.discard_tree(ctx.source_root)  # a crashed build's leftovers, by descriptor
        src = unpack(sdist, ctx.source_root, limits=limits)
        yield Source(src, _patch(ctx, src))
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
    ctx.journal.measured(sdist_sha256=link.sha256)
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
    ctx.journal.measured(sdist_sha256=ref.sha256)
    return sdist


def _lock(ctx: BuildContext, run: Runner) -> int:
    """Take this host's lock on the project version's source path; return its descriptor.

    nvcc hands the source path to cicc, which the compile cache hashes verbatim, so every
    build of one project version unpacks to the same path: a second Python then hits for
    every kernel. Two such builds on one host take turns (the second one's kernels hit).
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


def _patch(ctx: BuildContext, src: Path) -> tuple[AppliedPatch, ...]:
    """Apply the recipe's patches for this version and torch; record what was applied."""
    try:
        version = Version(ctx.spec.version)
    except InvalidVersion:
        ctx.journal.measured(patches=())
        return ()
    # Before the venv, the variant's torch (``2.14``) stands for the installed one.
    applied = tuple(apply_patches(ctx.recipe.patches_for(version, Version(ctx.spec.torch)), src))
    for patch in applied:
        ctx.say(f"patch {patch.ref} applied: {patch.description}")
    ctx.journal.measured(patches=applied)
    return applied
