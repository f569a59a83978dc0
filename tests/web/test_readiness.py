"""Readiness probes: a deadline per dependency, one check in flight, the last error kept."""

from __future__ import annotations

import threading
import time

from web.readiness import Probe, Readiness


def test_a_hung_check_costs_the_deadline_once_and_is_not_started_twice() -> None:
    release = threading.Event()
    calls: list[float] = []

    def hangs() -> None:
        calls.append(time.monotonic())
        release.wait(30)

    probe = Probe("slow", hangs, deadline=0.2)
    try:
        first = probe.report()
        second = probe.report()  # the first check still hangs: it is waited for, not repeated
        assert len(calls) == 1
        for report in (first, second):
            assert report["ok"] is False and report["error"].startswith("no answer within 0.2 s")
            assert report["last_error"] == report["error"] and report["last_ok"] is None
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while not probe.report()["ok"]:  # the check ended; the next report starts a fresh one
        assert time.monotonic() < deadline
    recovered = probe.report()
    assert recovered["ok"] is True and recovered["error"] is None and recovered["last_ok"]
    assert recovered["last_error"] is not None  # what went wrong last stays visible


def test_a_failing_check_reports_its_error() -> None:
    def refuses() -> None:
        raise ConnectionRefusedError("refused")

    report = Probe("db", refuses, deadline=1, describe=lambda e: f"down: {e}").report()
    assert report["ok"] is False and report["error"] == "down: refused"
    assert report["last_error"] == "down: refused" and report["last_error_at"]


def test_checks_run_in_parallel_within_the_longest_deadline() -> None:
    release = threading.Event()
    probes = [Probe(f"p{i}", lambda: release.wait(30), deadline=0.3) for i in range(4)]
    probes.append(Probe("fine", lambda: None, deadline=0.3))
    started = time.monotonic()
    try:
        ok, checks = Readiness(probes).report()
    finally:
        release.set()
    assert time.monotonic() - started < 0.3 * 4  # not one deadline after another
    assert ok is False and checks["fine"]["ok"] is True
    assert [name for name, c in checks.items() if not c["ok"]] == ["p0", "p1", "p2", "p3"]
