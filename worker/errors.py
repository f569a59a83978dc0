"""Errors only the worker raises: its sandbox, what a build left behind, its toolkits.

Each subclasses :class:`wheelhouse.errors.WheelhouseError` and the builtin that fits, as the
core's do, so a caller that catches those catches these.
"""

from __future__ import annotations

from wheelhouse.errors import WheelhouseError


class SandboxUnavailable(WheelhouseError, RuntimeError):
    """The build sandbox cannot be set up here; the worker must not run builds unsandboxed."""


class UnsafePath(WheelhouseError, OSError):
    """Something a build left where the worker reads or writes is not what it may touch: a
    link (at any level), a FIFO, device or socket, a file over its size cap, a name that
    escapes, or a read past its deadline (``worker.sandbox.safefs``). Never followed, never
    opened."""


class ToolkitUnavailable(WheelhouseError, RuntimeError):
    """A CUDA toolkit can't be provisioned from the configured sources (no such release, a
    component missing, a checksum that does not match, an nvcc that does not answer): another
    attempt gives the same answer, so it is never retried."""
