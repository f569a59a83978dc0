"""Domain errors of the core, one module for all of them (the worker's own: ``worker.errors``).

Each subclasses the builtin that fits, so callers that only know Python still catch them;
``web.errors`` maps them to HTTP responses in one place.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wheelhouse.builds.facts import BuildFacts


class WheelhouseError(Exception):
    """Base of every error wheelhouse raises on purpose."""


class InvalidVariant(WheelhouseError, ValueError):
    """A variant key that does not parse or names unknown values."""


class InvalidProjectName(WheelhouseError, ValueError):
    """A project or file name that is not a valid distribution name."""


class InvalidWheel(WheelhouseError, ValueError):
    """A wheel whose file name or contents cannot be published as they are."""


class VersionMismatch(InvalidWheel):
    """The METADATA version differs from the version in the wheel's file name."""


class AlreadyPublished(WheelhouseError, FileExistsError):
    """A different file was already published under the same name; published files are immutable."""


class InvalidUpload(WheelhouseError, ValueError):
    """An upload (twine, uv publish) that can't be published as sent: not a wheel, fields that
    disagree with the file, a digest that does not match, a wheel without the root's label."""


class ProvenanceInvalid(WheelhouseError, ValueError):
    """A provenance document, attestation or certificate that does not verify against the fleet
    CA, or does not describe the file it is offered for."""


class ProvenanceUnavailable(WheelhouseError, RuntimeError):
    """This process can't sign provenance or name its CA: the configured certificate or key is
    unreadable, or the workspace can't hold the box's own CA. Nothing is published unsigned."""


class NotOwner(WheelhouseError, PermissionError):
    """A publisher that does not own the project it publishes into (or a token limited to
    other projects): nothing is stored."""


class UploadTooLarge(InvalidUpload):
    """An upload larger than ``WHEELHOUSE_UPLOAD_MAX_MIB``."""


class InvalidTarget(WheelhouseError, ValueError):
    """What a yank, unyank or delete names is neither ``PROJECT==VERSION`` nor a wheel's name."""


class NothingPublished(WheelhouseError, LookupError):
    """A yank, unyank or delete names no published file."""


class OutOfReach(WheelhouseError, PermissionError):
    """A yank, unyank or delete names a file in a root the caller's token does not reach."""


class ProofDidNotRun(WheelhouseError, ValueError):
    """A GPU proof result where no GPU ran (``proven`` False): nothing is recorded, since nothing
    may claim a proof that did not run."""


class ProofMismatch(WheelhouseError, ValueError):
    """A GPU proof of other bytes than the published wheel of that name (its sha256 or file
    name differs from the record's): not recorded."""


class InvalidBuildSpec(WheelhouseError, ValueError):
    """A build request that names unknown or malformed values."""


class StorageError(WheelhouseError, OSError):
    """Storage could not be reached or answered unexpectedly."""


class UpstreamUnavailable(WheelhouseError, OSError):
    """An upstream index could not be reached, answered an error, or sent no simple-index page."""


class NotOnUpstream(WheelhouseError, LookupError):
    """The upstream does not list the project (a cached page of it would be empty)."""


class UpstreamMismatch(UpstreamUnavailable):
    """A file's bytes from the upstream do not match the sha256 its upstream page lists."""


class StorageUnavailable(StorageError):
    """The storage backend is unreachable, timed out, throttled us or failed on its side.

    Each storage backend raises this for its own errors (botocore's, the file system's), so
    callers never see a vendor exception; another attempt may succeed.
    """


class DamagedFile(StorageError):
    """A published file that storage no longer holds as its record says: missing, truncated or
    other bytes. Serving it would break the index's promise; ``wheelhouse verify`` finds these.
    """


class QueueUnavailable(WheelhouseError, ConnectionError):
    """The build queue's Redis refused the connection, timed out or is still loading its data.

    Raised by the clients :func:`wheelhouse.redisconn.queue_client` makes, for every command they
    send (ours and RQ's alike), so that callers never see a redis-py connection error; another
    attempt may succeed once Redis is back.
    """


class InvalidRecipe(WheelhouseError, ValueError):
    """A recipe file that does not parse or names unknown settings."""


class UnservableSpec(WheelhouseError, LookupError):
    """No live worker of the fleet can build this spec (CUDA version and CPU architecture)."""


class TokenError(WheelhouseError, ValueError):
    """A token name or scope that is not allowed, or a name that is already taken."""


class InvalidResponse(WheelhouseError, ValueError):
    """An API answer lacks a field this release needs, or has it of the wrong type."""


class RedisSettingError(WheelhouseError, ValueError):
    """Redis settings that cannot be used: a password file that can't be read, or two passwords."""


class RefusedJob(WheelhouseError, ValueError):
    """A job in the build queue that is not a build request: another function, arguments that
    do not validate as one, or data that is not JSON. It is failed without being run."""


class InfrastructureError(WheelhouseError, RuntimeError):
    """A failure outside the build itself (network, index, installer): worth retrying."""


class TorchUnavailable(WheelhouseError, ValueError):
    """The torch index has no build of the requested torch version for the requested CUDA."""


class FailureKind(StrEnum):
    """Why a build failed; decides whether it is retried and what the user is told.

    Values are lower-case words joined by hyphens (``compile-error``, ``unsafe-archive``).
    """

    COMPILE_ERROR = "compile-error"
    """The sources do not compile: not retried."""
    OOM = "oom"
    """A compile was killed for memory: retried once at half the MAX_JOBS."""
    TIMEOUT = "timeout"
    """The build ran past its deadline and was killed."""
    INCOMPATIBLE = "incompatible"
    """This combination cannot be built (C++ standard, toolkit, torch source): not retried."""
    INFRASTRUCTURE = "infrastructure"
    """Storage, network or Redis failed: retried with backoff."""
    CANCELLED = "cancelled"
    """Someone cancelled the build."""
    REFUSED_JOB = "refused-job"
    """The queue held a job that is not a build request (see ``RefusedJob``): never run, not
    retried."""
    UNVERIFIED_SOURCE = "unverified-source"
    """The upstream index publishes no sha256 for the sdist, or the download does not match
    it: wheelhouse builds only source it can verify. Not retried."""
    UNSAFE_ARCHIVE = "unsafe-archive"
    """The sdist holds members that would land outside its directory (``..``, absolute paths,
    links out of the tree), or is not a readable archive: not retried."""
    TOO_LARGE = "too-large"
    """The sdist, its unpacked tree or what the build wrote is over a configured limit: not
    retried."""
    INVALID_WHEEL = "invalid-wheel"
    """What the build left is not a well-formed wheel of the spec's project, version and tags
    (a bad zip, RECORD hashes that don't match, names that escape): never published, not
    retried."""
    SANDBOX_UNAVAILABLE = "sandbox-unavailable"
    """The worker could not set up the build sandbox for this build: nothing of the sdist ran
    unsandboxed; not retried (the operator must fix the host, see docs/security.md)."""

    PATCH_FAILED = "patch-failed"
    """A recipe patch no longer applies to the sdist (it changed upstream): not retried."""
    NO_DEVICE_CODE = "no-device-code"
    """The wheel lacks GPU code (SASS) for a requested architecture: never published."""
    LOAD_ERROR = "load-error"
    """A built library does not load the way its package loads it: not retried."""
    UNSAFE_RESULT = "unsafe-result"
    """What the build left where the worker reads its results (the wheel, statistics, cache
    entries) is a link, FIFO, device or socket, or over its size cap: never followed or read,
    nothing published, not retried."""
    MISCONFIGURED = "misconfigured"
    """The worker's settings point at something that does not exist from where it runs (an
    index whose host name does not resolve): not retried; the reason names the setting."""
    UNSAFE_REQUIREMENT = "unsafe-requirement"
    """A build requirement of the sdist is not a name and version specifiers (a direct
    reference ``name @ url`` or a local path): never installed, not retried."""

    @property
    def retryable(self) -> bool:
        return self in (FailureKind.INFRASTRUCTURE, FailureKind.OOM)

    @classmethod
    def parse(cls, value: object) -> FailureKind | None:
        """The kind a job's meta names, or None for none or one this version doesn't know.

        Records written before kinds were hyphenated (``compile_error``) still parse.
        """
        try:
            return cls(str(value).replace("_", "-")) if value is not None else None
        except ValueError:
            return None


class BuildFailed(WheelhouseError, RuntimeError):
    """A build that failed: why (``kind``), and one line for users (``reason``)."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(f"[{kind.value}] {reason}")
        self.kind = kind
        self.reason = reason
        #: What the build had measured when it failed (seconds, reaped, governor pauses); set
        #: by the builder on the way out.
        self.facts: BuildFacts | None = None


class PatchFailed(BuildFailed):
    """A recipe patch that does not apply to the sdist (kind ``patch-failed``): not retried."""

    def __init__(self, reason: str) -> None:
        super().__init__(FailureKind.PATCH_FAILED, reason)
