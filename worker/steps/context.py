"""What every step of one build reads: the request, the host's settings and where to write."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from uv import find_uv_bin

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.index.storage import Storage
from wheelhouse.recipes.book import Recipe, load_recipe, recipe_dirs
from wheelhouse.retry import RetryPolicy
from worker.events import Journal, Reporter
from worker.failures import with_retries
from worker.supervision.buildlog import MIB, BuildLog

T = TypeVar("T")


@dataclass(frozen=True)
class BuildContext:
    """One build of one spec: fixed when it starts, read by every step.

    The log and the journal are the two things steps add to: the log what they say, the
    journal what they measured.
    """

    spec: BuildSpec
    config: Config
    storage: Storage
    recipe: Recipe
    build_id: str
    """Unique to this build (:func:`worker.supervision.reaper.unique_build_id`): it names the
    workspace."""
    workspace: Path
    source_root: Path
    """Where the sdist is unpacked: one path per project version on this host
    (:mod:`worker.steps.source`)."""
    log: BuildLog
    journal: Journal
    retry: RetryPolicy
    """The policy of the steps that talk to the network and storage."""
    keep_workspace: bool

    @classmethod
    def create(cls, spec: BuildSpec, *, config: Config, storage: Storage, reporter: Reporter,
               build_id: str, retry: RetryPolicy, keep_workspace: bool) -> BuildContext:
        recipe = load_recipe(spec.project, recipe_dirs(config))
        work = Path(config.workspace).resolve()
        workspace = work / build_id
        journal = Journal(reporter, BuildFacts(build_id=build_id, recipe=recipe.name,
                                               host=socket.gethostname()))
        log = BuildLog(workspace / "build.log", on_lines=journal.lines,
                       on_progress=journal.progress,
                       limit_bytes=int(config.build_log_max_mib * MIB))
        return cls(spec=spec, config=config, storage=storage, recipe=recipe, build_id=build_id,
                   workspace=workspace, source_root=work / "src" / f"{spec.project}-{spec.version}",
                   log=log, journal=journal, retry=retry, keep_workspace=keep_workspace)

    @property
    def venv_root(self) -> Path:
        """Where the build venv is made (:mod:`worker.steps.venv`), in the build's workspace."""
        return self.workspace / "venv"

    def say(self, line: str) -> None:
        """A note of the worker's own into the build log."""
        self.log.write(line)

    def retried(self, what: str, attempt: Callable[[], T]) -> T:
        """``attempt()``, retried under the build's policy on infrastructure trouble."""
        return with_retries(self.retry, what, attempt, say=self.log.write)


def uv_binary() -> str:
    """The uv package's own binary: a worker's PATH needn't have it."""
    return find_uv_bin()
