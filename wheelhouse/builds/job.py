"""A build job in Redis is data that asks for one build, never code.

RQ keeps a job as a Redis hash whose ``data`` names a function by dotted path, with its
arguments, and a worker imports and calls whatever is named there; with RQ's default
serializer, pickle, loading the job alone runs code. Whoever could write to Redis could so run
code in every worker. Here instead:

- every job is JSON (:data:`SERIALIZER`), in every place that writes or reads one;
- :class:`BuildJob`, the job class of the workers and of every lookup, never imports what a job
  names: its function is :data:`JOB_FUNCTION` or nothing; callbacks and webhooks are dropped;
- its arguments must be a build request, one :class:`JobCall` (the spec checked as strictly as
  an API request): the queue writes it (:meth:`JobCall.to_args`), the worker checks it before
  it forks and the job function reads it back (:meth:`JobCall.parse`); or, on a
  ``prove-sm<arch>`` queue, a GPU proof of a published wheel (:class:`ProveCall`, calling
  :data:`PROVE_FUNCTION`). A job that is neither is failed as ``refused-job`` without being
  run.

So a write to Redis can at most ask for a build that anyone with a token could ask for, or
for a proof of a wheel the index already publishes.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import import_attribute

from wheelhouse.builds.meta import Failure, JobMeta
from wheelhouse.builds.spec import BuildSpec, prove_queue_name
from wheelhouse.errors import FailureKind, InvalidBuildSpec, RefusedJob

#: The one function a build job may name. By path, so that the web never imports the worker.
JOB_FUNCTION = "worker.jobs.run_build"
#: The one function a proof job may name (on a ``prove-sm<arch>`` queue).
PROVE_FUNCTION = "worker.jobs.run_proof"
#: How jobs, their meta and their results are stored: JSON, which loads as data only.
SERIALIZER = JSONSerializer
#: What a refused job's call reads as afterwards (in RQ's logs and process title).
REFUSED_CALL = "refused-job"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class JobCall:
    """What a build job asks its worker to do: the job's arguments, typed.

    On the wire (RQ's ``args``) it is ``[spec, source, timeout]``: the spec as
    :meth:`BuildSpec.to_dict` writes it; ``source`` None or an absolute path to an sdist named
    for the spec's project and version (single-box mode and tests); ``timeout`` None or a
    positive number of seconds, the worker's own deadline for the build.
    """

    spec: BuildSpec
    source: str | None = None
    timeout: int | None = None

    def to_args(self) -> tuple[dict[str, Any], str | None, int | None]:
        """The job's RQ ``args``, as :meth:`parse` reads them back."""
        return (self.spec.to_dict(), self.source, self.timeout)

    @classmethod
    def parse(cls, job_id: str, queue: str, func_name: object, instance: object,
              args: object, kwargs: object) -> JobCall:
        """The call a job makes, if it is one a worker runs; else :class:`RefusedJob`.

        It must call :data:`JOB_FUNCTION` with the arguments :meth:`to_args` writes, its spec
        one :meth:`BuildSpec.from_dict` accepts and whose job id and queue are this job's.
        """
        if func_name != JOB_FUNCTION or instance is not None:
            raise RefusedJob(f"the job calls {_short(func_name)}, not {JOB_FUNCTION} (nor "
                             f"{PROVE_FUNCTION})")
        if kwargs or not isinstance(args, list | tuple) or not 1 <= len(args) <= 3:
            raise RefusedJob("the job's arguments are not (spec, source, timeout)")
        data, source, timeout = (*args, None, None)[:3]
        spec = _spec_of(data)
        # The id names the build's workspace and log; the queue says which workers may take it.
        if job_id != spec.job_id or queue != spec.queue_name:
            raise RefusedJob(f"the job's id or queue ({_short(job_id)} on {_short(queue)}) is "
                             f"not its spec's ({spec.job_id} on {spec.queue_name})")
        if source is not None:
            _check_source(source, spec)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)
                                    or timeout <= 0):
            raise RefusedJob(f"the job's timeout {_short(timeout)} is not a positive whole "
                             "number")
        return cls(spec, source, timeout)


def _check_source(source: object, spec: BuildSpec) -> None:
    """A local sdist must be the spec's own, so that a job can't point a worker at any file."""
    if not isinstance(source, str) or not posixpath.isabs(source):
        raise RefusedJob(f"the job's source {_short(source)} is not an absolute path")
    try:
        name, version = parse_sdist_filename(posixpath.basename(source))
    except InvalidSdistFilename:
        raise RefusedJob(f"the job's source {_short(source)} is not an sdist") from None
    if name != spec.project or version != Version(spec.version):
        raise RefusedJob(f"the job's source {_short(source)} is not an sdist of "
                         f"{spec.project} {spec.version}")


def _spec_of(data: object) -> BuildSpec:
    """The job's spec, checked as strictly as an API request's; :class:`RefusedJob` if not."""
    if not isinstance(data, dict):
        raise RefusedJob("the job's spec is not a JSON object")
    try:
        return BuildSpec.from_dict(data)
    except InvalidBuildSpec as exc:
        raise RefusedJob(f"the job's spec is invalid: {exc}") from None


_SHA256 = re.compile(r"[0-9a-f]{64}")
_ARCH = re.compile(r"[0-9]{2,3}[af]?")


@dataclass(frozen=True)
class ProveCall:
    """What a proof job asks a GPU worker: run the GPU proof of one published wheel.

    On the wire (RQ's ``args``) it is ``[spec, filename, sha256, arch]``: the spec of the build
    that published the wheel (its venv is made the same way), the wheel's file name and the
    sha256 of its bytes (a proof of other bytes is never recorded), and the SASS architecture
    whose queue it is on. Its job id is :meth:`job_id`, so one wheel is queued once per arch.
    """

    spec: BuildSpec
    filename: str
    sha256: str
    arch: str

    @property
    def job_id(self) -> str:
        return f"prove-sm{self.arch}-{self.sha256}"

    @property
    def queue_name(self) -> str:
        return prove_queue_name(self.arch, self.spec.machine)

    def to_args(self) -> tuple[dict[str, Any], str, str, str]:
        return (self.spec.to_dict(), self.filename, self.sha256, self.arch)

    @classmethod
    def parse(cls, job_id: str, queue: str, args: object, kwargs: object) -> ProveCall:
        """The proof a job asks for; :class:`RefusedJob` unless every part is of its shape
        and the job's id and queue are the call's own."""
        if kwargs or not isinstance(args, list | tuple) or len(args) != 4:
            raise RefusedJob("the job's arguments are not (spec, filename, sha256, arch)")
        data, filename, sha256, arch = args
        spec = _spec_of(data)
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise RefusedJob(f"the job's sha256 {_short(sha256)} is not a sha256")
        if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
            raise RefusedJob(f"the job's arch {_short(arch)} is not a GPU architecture")
        if not isinstance(filename, str) or "/" in filename or "\\" in filename:
            raise RefusedJob(f"the job's wheel {_short(filename)} is not a file name")
        try:
            name, _, _, _ = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            raise RefusedJob(f"the job's wheel {_short(filename)} is not a wheel") from None
        if name != spec.project:
            raise RefusedJob(f"the job's wheel {_short(filename)} is not of {spec.project}")
        call = cls(spec, filename, sha256, arch)
        if job_id != call.job_id or queue != call.queue_name:
            raise RefusedJob(f"the job's id or queue ({_short(job_id)} on {_short(queue)}) is "
                             f"not its call's ({call.job_id} on {call.queue_name})")
        return call


def parse_call(job_id: str, queue: str, func_name: object, instance: object, args: object,
               kwargs: object) -> JobCall | ProveCall:
    """A build's call or a proof's, by the function the job names."""
    if func_name == PROVE_FUNCTION and instance is None:
        return ProveCall.parse(job_id, queue, args, kwargs)
    return JobCall.parse(job_id, queue, func_name, instance, args, kwargs)


class BuildJob(Job):
    """An RQ job that can only ever run :data:`JOB_FUNCTION` with a valid build request.

    Its callbacks and webhooks are dropped as it is read from Redis. Its call is checked once,
    the first time :attr:`refusal` is asked (the worker asks before it forks the work horse;
    pages that only show jobs don't pay for it), and :attr:`call` is what it asks for; running
    a refused job records a ``refused-job`` failure and raises :class:`RefusedJob` without
    importing anything the job names.
    """

    _checked: bool = False
    _refusal: str | None = None
    _call: JobCall | ProveCall | None = None

    def restore(self, raw_data: Any) -> None:
        try:
            super().restore(raw_data)
        except NoSuchJobError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # A hash RQ itself can't read (bad dates, status): for a worker, no job at all.
            raise NoSuchJobError(f"job {self.id} is malformed in Redis "
                                 f"({type(exc).__name__})") from None
        # Nothing here runs what a job names besides the build: no callbacks, no webhooks.
        self.webhooks = []
        self._checked = False
        self._call = None

    @property
    def refusal(self) -> str | None:
        """Why this job is not run, or None for a build request."""
        if not self._checked:
            try:
                self._call = parse_call(self.id, self.origin, self.func_name, self.instance,
                                        self.args, self.kwargs)
            except DeserializationError:
                self._refuse("the job's data is not JSON (pickled jobs are never loaded)")
            except RefusedJob as exc:
                self._refuse(str(exc))
            self._checked = True
        return self._refusal

    @property
    def call(self) -> JobCall:
        """The build this job asks for; :class:`RefusedJob` for a job that is not one."""
        if self.refusal is not None or not isinstance(self._call, JobCall):
            raise RefusedJob(self.refusal or "the job is not a build request")
        return self._call

    @property
    def is_proof(self) -> bool:
        """Whether this job asks for a GPU proof (:class:`ProveCall`), not a build."""
        return self.refusal is None and isinstance(self._call, ProveCall)

    def _refuse(self, why: str) -> None:
        self._refusal = why
        # RQ's own logging and process title read the call: give them this, not the job's.
        self.data = json.dumps([REFUSED_CALL, None, [why], {}]).encode()

    @property
    def func(self) -> Callable[..., Any]:
        if self.refusal is not None or self._call is None:
            raise RefusedJob(self.refusal or f"the job calls {_short(self.func_name)}, "
                             f"not {JOB_FUNCTION}")
        # What the checked call is, never what the job's data names.
        name = PROVE_FUNCTION if isinstance(self._call, ProveCall) else JOB_FUNCTION
        function: Callable[..., Any] = import_attribute(name)
        return function

    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    def perform(self) -> Any:
        if self.refusal is not None:
            # Recorded first, so that the worker doesn't retry it and the build page says why.
            self.meta = JobMeta(phase="failed",
                                failure=Failure(FailureKind.REFUSED_JOB, self.refusal)).to_meta()
            self.save_meta()  # type: ignore[no-untyped-call]
            raise RefusedJob(self.refusal)
        return super().perform()
