"""What ``wheelhouse build`` shows on the console while it builds, and Ctrl-C as a cancel."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from worker.events import BuildEvent, LogLines, Measured, PhaseBegan, Progress, Reporter


class ConsoleReporter(Reporter):
    """Phases and a progress bar on stderr; the log too with ``verbose``."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.tty = sys.stderr.isatty()
        self._last_shown = -1
        self._cancel = False
        self._max_jobs_reason: str | None = None

    def report(self, event: BuildEvent) -> None:
        match event:
            case PhaseBegan(name):
                self.end_line()
                click.echo(f"==> {name}", err=True)
            case Progress(done, total):
                self._progress(done, total)
            case LogLines(lines):
                if self.verbose:
                    for line in lines:
                        click.echo(line, err=True)
            case Measured(facts):
                # MAX_JOBS and why, once per decision (an out-of-memory retry halves it).
                reason = facts.max_jobs.reason if facts.max_jobs is not None else None
                if reason is not None and reason != self._max_jobs_reason:
                    self._max_jobs_reason = reason
                    self.end_line()
                    click.echo(reason, err=True)

    def _progress(self, done: int, total: int) -> None:
        if total <= 0:
            return
        width = 30
        filled = int(width * done / total)
        bar = "#" * filled + "-" * (width - filled)
        percent = int(100 * done / total)
        if self.tty and not self.verbose:
            click.echo(f"\r[{bar}] {done}/{total} {percent}%", nl=False, err=True)
            self._last_shown = 0
        elif percent // 10 != self._last_shown // 10 or done == total:
            click.echo(f"[{bar}] {done}/{total} {percent}%", err=True)
            self._last_shown = percent

    def cancel(self) -> None:
        """Ask the build to stop; it kills its whole process tree at its next check."""
        self._cancel = True

    def should_cancel(self) -> bool:
        return self._cancel

    def end_line(self) -> None:
        """End the progress bar's line, so that what follows starts on a line of its own."""
        if self.tty and self._last_shown == 0:
            click.echo("", err=True)
            self._last_shown = -1


@contextmanager
def cancel_on_interrupt(reporter: ConsoleReporter) -> Iterator[None]:
    """Turn Ctrl-C (and SIGTERM) into a cancel, so the build's whole tree is killed rather
    than orphaned."""

    def handler(signum: int, frame: Any) -> None:
        reporter.cancel()

    previous = signal.signal(signal.SIGINT, handler)
    previous_term = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
