"""Readiness: each dependency checked on a thread of its own, within a deadline; its last error.

``/readyz`` must answer within a few seconds even when a dependency hangs, and must not pile up
threads when it is asked again while one still hangs. So each :class:`Probe` runs at most one
check at a time: a caller waits for the check in flight (or starts one) for at most the
probe's deadline, and a check that outlives it keeps running in the background until the
dependency's own timeout ends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class CheckResult:
    """What one check found: ``error`` is None when the dependency answered."""

    error: str | None
    at: float
    """Wall-clock time the check ended."""


class Probe:
    """One dependency's check, its deadline, and the last error seen."""

    def __init__(self, name: str, check: Callable[[], object], *, deadline: float,
                 describe: Callable[[BaseException], str] = str,
                 details: Callable[[], dict[str, object]] | None = None) -> None:
        self.name = name
        self.check = check
        self.deadline = deadline
        self.describe = describe
        #: More to report (read without waiting: never a call to the dependency).
        self.details = details
        self._lock = threading.Lock()
        self._done: threading.Event | None = None
        self._started = 0.0
        self._last: CheckResult | None = None
        self._last_ok: float | None = None
        self._last_error: CheckResult | None = None

    def _run(self, done: threading.Event) -> None:
        try:
            self.check()
            result = CheckResult(None, time.time())
        except Exception as exc:  # whatever failed is the answer: reported, not raised
            result = CheckResult(self.describe(exc) or type(exc).__name__, time.time())
        with self._lock:
            self._last = result
            if result.error is None:
                self._last_ok = result.at
            else:
                self._last_error = result
        done.set()

    def start(self) -> tuple[threading.Event, float]:
        """Start a check unless one is in flight; the event it sets, and when it began."""
        with self._lock:
            done = self._done
            if done is None or done.is_set():
                done = self._done = threading.Event()
                self._started = time.monotonic()
                threading.Thread(target=self._run, args=(done,), daemon=True,
                                 name=f"readyz-{self.name}").start()
            return done, self._started

    def report(self, begun: tuple[threading.Event, float] | None = None,
               asked: float | None = None) -> dict[str, Any]:
        """Wait for the check (``begun`` by :meth:`start`, else now) until the deadline after
        ``asked`` (a ``time.monotonic()``; default now), and say what was seen."""
        asked = time.monotonic() if asked is None else asked
        done, started = begun if begun is not None else self.start()
        finished = done.wait(max(0.0, asked + self.deadline - time.monotonic()))
        with self._lock:
            if finished and self._last is not None:
                error = self._last.error
            else:
                error = (f"no answer within {self.deadline:g} s "
                         f"(the check in flight began {time.monotonic() - started:.1f} s ago)")
                self._last_error = CheckResult(error, time.time())
            last_error = self._last_error
            last_ok = self._last_ok
        report: dict[str, Any] = {
            "ok": error is None,
            "error": error,
            "last_ok": _iso(last_ok),
            "last_error": last_error.error if last_error is not None else None,
            "last_error_at": _iso(last_error.at if last_error is not None else None),
        }
        if self.details is not None:
            report.update(self.details())
        return report


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


class Readiness:
    """The probes ``/readyz`` runs, all at once."""

    def __init__(self, probes: list[Probe]) -> None:
        self.probes = probes

    def report(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        """Whether every dependency answered, and what each probe saw; the checks run in
        parallel, so this takes at most the longest deadline."""
        asked = time.monotonic()
        begun = [(p, p.start()) for p in self.probes]
        checks = {p.name: p.report(b, asked) for p, b in begun}
        return all(r["ok"] for r in checks.values()), checks
