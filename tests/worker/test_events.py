"""The build's journal: each step's seconds, from one step's start to the next's."""

from __future__ import annotations

from wheelhouse.builds.facts import BuildFacts
from worker.events import BuildEvent, Journal, Measured, PhaseBegan, Reporter


class _Recorder(Reporter):
    def __init__(self) -> None:
        self.events: list[BuildEvent] = []

    def report(self, event: BuildEvent) -> None:
        self.events.append(event)


class _Clock:
    """Time that moves only when the test says: the journal's seconds are then exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_step_counts_from_its_start_to_the_next_and_a_repeated_step_adds_up() -> None:
    recorder, clock = _Recorder(), _Clock()
    journal = Journal(recorder, BuildFacts(build_id="b"), clock=clock)
    journal.phase("prove")
    clock.now += 1.25
    journal.phase("venv")
    clock.now += 10.0
    journal.phase("prove")
    clock.now += 3.0
    assert journal.facts.step_seconds == {"prove": 1.2, "venv": 10.0}  # the last one runs
    journal.end_step()
    journal.end_step()  # nothing runs any more: nothing changes
    assert journal.facts.step_seconds == {"prove": 4.2, "venv": 10.0}
    # A watcher saw the ended steps before each new step began, and the last at the end.
    kinds = [type(e).__name__ if isinstance(e, Measured) else e.name
             for e in recorder.events if isinstance(e, Measured | PhaseBegan)]
    assert kinds == ["prove", "Measured", "venv", "Measured", "prove", "Measured"]
    last = [e.facts for e in recorder.events if isinstance(e, Measured)][-1]
    assert last == journal.facts and last.build_id == "b"


def test_a_build_that_never_began_a_step_has_no_step_seconds() -> None:
    journal = Journal(_Recorder(), BuildFacts())
    journal.end_step()
    assert journal.facts.step_seconds is None
