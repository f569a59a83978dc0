"""Domain errors, one module for all of them.

Each subclasses the builtin that fits, so callers that only know Python still catch them;
``web.errors`` maps them to HTTP responses in one place.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wheelhouse.buildfacts import BuildFacts


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


class InvalidBuildSpec(WheelhouseError, ValueError):
    """A build request that names unknown or malformed values."""


class StorageError(WheelhouseError, OSError):
    """Storage could not be reached or answered unexpectedly."""


class UpstreamUnavailable(WheelhouseError, OSError):
    """An upstream index could not be reached, answered an error, or sent no simple-index page."""


class StorageUnavailable(StorageError):
    """The storage backend is unreachable, timed out, throttled us or failed on its side.

    Each storage backend raises this for its own errors (botocore's, the file system's), so
    callers never see a vendor exception; another attempt may succeed.
    """


class InvalidRecipe(WheelhouseError, ValueError):
    """A recipe file that does not parse or names unknown settings."""


class UnservableSpec(WheelhouseError, LookupError):
    """No live worker of the fleet can build this spec (CUDA version and CPU architecture)."""


class TokenError(WheelhouseError, ValueError):
    """A token name or scope that is not allowed, or a name that is already taken."""


class InfrastructureError(WheelhouseError, RuntimeError):
    """A failure outside the build itself (network, index, installer): worth retrying."""


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
    PATCH_FAILED = "patch-failed"
    """A recipe patch no longer applies to the sdist (it changed upstream): not retried."""
    NO_DEVICE_CODE = "no-device-code"
    """The wheel lacks GPU code (SASS) for a requested architecture: never published."""
    LOAD_ERROR = "load-error"
    """A built library does not load the way its package loads it: not retried."""

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
