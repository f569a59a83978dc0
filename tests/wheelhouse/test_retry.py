"""RetryPolicy: how often, how patiently, and on what wheelhouse tries again."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from wheelhouse import retry
from wheelhouse.errors import InfrastructureError, StorageUnavailable
from wheelhouse.retry import RetryPolicy

POLICY = RetryPolicy(attempts=4, delays=(1, 5), retry_on=(InfrastructureError, OSError))


def _failing(*errors: BaseException | None) -> tuple[Callable[[], str], list[int]]:
    """A callable that raises the given errors in turn, then returns "ok"; and its call count."""
    calls: list[int] = []
    queue = list(errors)

    def fn() -> str:
        calls.append(1)
        error = queue.pop(0) if queue else None
        if error is not None:
            raise error
        return "ok"

    return fn, calls


def test_success_needs_no_retry() -> None:
    fn, calls = _failing()
    slept: list[float] = []
    assert POLICY.run("x", fn, sleep=slept.append) == "ok"
    assert (len(calls), slept) == (1, [])


def test_retryable_errors_back_off_and_the_last_delay_repeats(
        caplog: pytest.LogCaptureFixture) -> None:
    fn, calls = _failing(InfrastructureError("reset"), StorageUnavailable("S3: SlowDown"),
                         ConnectionResetError("peer"))
    slept: list[float] = []
    said: list[str] = []
    with caplog.at_level(logging.WARNING, logger="wheelhouse.retry"):
        assert POLICY.run("uploading", fn, say=said.append, sleep=slept.append) == "ok"
    assert len(calls) == 4 and slept == [1, 5, 5]
    assert said[0] == "uploading failed (reset); retrying in 1s"
    assert said[1] == "uploading failed (S3: SlowDown); retrying in 5s"
    assert [r.getMessage() for r in caplog.records] == said  # the log says it too


def test_spent_attempts_raise_the_last_error_as_it_was() -> None:
    last = StorageUnavailable("still down")
    fn, calls = _failing(*[InfrastructureError("down")] * 3, last)
    slept: list[float] = []
    with pytest.raises(StorageUnavailable) as err:
        POLICY.run("x", fn, sleep=slept.append)
    assert err.value is last and len(calls) == 4 and slept == [1, 5, 5]


def test_other_errors_are_not_retried() -> None:
    fn, calls = _failing(ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        POLICY.run("x", fn, sleep=lambda _: pytest.fail("slept"))
    assert len(calls) == 1


@pytest.mark.parametrize(("policy", "retries", "delays"), [
    (RetryPolicy(attempts=1), 0, []),
    (RetryPolicy(attempts=2), 1, [0.0]),
    (RetryPolicy(attempts=4, delays=(2, 10, 30)), 3, [2, 10, 30]),
    (RetryPolicy(attempts=5, delays=(3,)), 4, [3, 3, 3, 3]),
])
def test_retries_and_delays(policy: RetryPolicy, retries: int, delays: list[float]) -> None:
    assert policy.retries == retries
    assert [policy.delay(i) for i in range(policy.retries)] == delays


def test_a_policy_makes_at_least_one_attempt() -> None:
    with pytest.raises(ValueError, match="at least one attempt"):
        RetryPolicy(attempts=0)


def test_the_named_policies() -> None:
    # The numbers every retrying place used before there was one policy object.
    assert (retry.BUILD_STEPS.attempts, retry.BUILD_STEPS.delays) == (4, (2, 10, 30))
    assert (retry.LOG_UPLOAD.attempts, retry.LOG_UPLOAD.delays) == (2, (2,))
    # Each S3 request: one retry; its timeouts come from the Config (storage_*_timeout).
    assert retry.S3_REQUESTS.attempts == 2 and retry.S3_REQUESTS.timeout is None
    assert retry.ABANDONED_JOBS.retries == 1
    assert retry.OOM_COMPILE.attempts == 2
    for policy in (retry.BUILD_STEPS, retry.LOG_UPLOAD):
        # Storage trouble of either backend is retried by the worker's steps.
        assert isinstance(StorageUnavailable("x"), policy.retry_on)
        assert isinstance(InfrastructureError("x"), policy.retry_on)
