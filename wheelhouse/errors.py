"""Domain errors, one module for all of them.

Each subclasses the builtin that fits, so callers that only know Python still catch them;
``web.errors`` maps them to HTTP responses in one place.
"""

from __future__ import annotations


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


class InvalidRecipe(WheelhouseError, ValueError):
    """A recipe file that does not parse or names unknown settings."""


class UnservableSpec(WheelhouseError, LookupError):
    """No live worker of the fleet can build this spec (CUDA version and CPU architecture)."""


class BuildFailed(WheelhouseError, RuntimeError):
    """A build that failed; ``kind`` is a ``FailureKind`` value, ``reason`` one line for users."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"[{kind}] {reason}")
        self.kind = kind
        self.reason = reason
        #: What the build had measured when it failed (seconds, reaped, governor pauses).
        self.facts: dict[str, object] = {}
