"""What a build reports, as one typed stream of events.

A build tells whoever watches it (the RQ job's meta, the console) four things, each an event:
a step began (:class:`PhaseBegan`), ninja's ``[N/M]`` (:class:`Progress`), new lines of its log
(:class:`LogLines`) and what it has measured so far (:class:`Measured`, the whole
:class:`~wheelhouse.builds.facts.BuildFacts` at that moment). A :class:`Reporter` receives them;
the :class:`Journal` is the build's end of the stream: it folds each measurement into the facts
the build records (the wheel's record, a failure) and hands every event on, so the facts a
watcher saw last are the facts recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from wheelhouse.builds.facts import BuildFacts


@dataclass(frozen=True)
class PhaseBegan:
    """A step began: toolkit, fetch, venv, compile, check, publish (or published: nothing to do)."""

    name: str


@dataclass(frozen=True)
class Progress:
    """Ninja's ``[N/M]``."""

    done: int
    total: int


@dataclass(frozen=True)
class LogLines:
    """New lines of the build log."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class Measured:
    """Everything the build has measured so far (a copy: the watcher may keep it)."""

    facts: BuildFacts


BuildEvent = PhaseBegan | Progress | LogLines | Measured


class Reporter:
    """Where a build reports to; the base class reports nowhere and never cancels."""

    def report(self, event: BuildEvent) -> None:
        """One event of the build's stream; called on the build's thread."""

    def should_cancel(self) -> bool:
        return False


class Journal:
    """The build's end of the stream: facts folded from its measurements, events handed on."""

    def __init__(self, reporter: Reporter, facts: BuildFacts,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter = reporter
        self._facts = facts
        self._clock = clock
        self._step: tuple[str, float] | None = None

    @property
    def facts(self) -> BuildFacts:
        """What the build has measured so far (a copy)."""
        return replace(self._facts)

    def phase(self, name: str) -> None:
        """A step began; the one before it ended (its seconds go into ``step_seconds``)."""
        self.end_step()
        self._step = (name, self._clock())
        self.reporter.report(PhaseBegan(name))

    def end_step(self) -> None:
        """The running step ended (the build did, or failed in it): count its seconds, added to
        an earlier run of the same step (a proof's first ``prove`` part, before its venv)."""
        if self._step is None:
            return
        name, began = self._step
        self._step = None
        steps = dict(self._facts.step_seconds or {})
        steps[name] = round(steps.get(name, 0.0) + self._clock() - began, 1)
        self.measured(step_seconds=steps)

    def measured(self, **changes: Any) -> None:
        """Fold new measurements (``BuildFacts`` fields) into the facts and report them."""
        self._facts = replace(self._facts, **changes)
        self.reporter.report(Measured(self.facts))

    def lines(self, lines: list[str]) -> None:
        self.reporter.report(LogLines(tuple(lines)))

    def progress(self, done: int, total: int) -> None:
        self.reporter.report(Progress(done, total))

    def should_cancel(self) -> bool:
        return self.reporter.should_cancel()
