"""Classify a failed build in one line, instead of burying the cause in 10,000 lines of nvcc.

The order matters: an incompatible combination (C++ standard, toolkit, architecture) explains
every compile error that follows it; memory kills come next; then the first compiler error.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.retry import RetryPolicy

T = TypeVar("T")


@dataclass(frozen=True)
class Classified:
    kind: FailureKind
    reason: str

    def error(self) -> BuildFailed:
        return BuildFailed(self.kind, self.reason)


_INCOMPATIBLE: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"C\+\+20 or later compatible compiler is required|"
                r"has no member \"?strong_ordering|strong_ordering.* (?:is not|not a) member"),
     "{project} {version} compiles as C++17, but torch {torch}'s headers need C++20 "
     "(std::strong_ordering); this combination needs a newer {project}"),
    (re.compile(r"detected CUDA version \((?P<nvcc>[0-9.]+)\) mismatches the version that was "
                r"used to compile\s+PyTorch \((?P<torch_cuda>[0-9.]+)\)"),
     "nvcc {nvcc} does not match the CUDA {torch_cuda} torch was built with"),
    (re.compile(r"Unsupported gpu architecture '(?P<arch>[a-z_0-9]+)'"),
     "the CUDA {cuda} toolkit does not support GPU architecture {arch}"),
    (re.compile(r"unsupported GNU version|unsupported clang version|"
                r"-allow-unsupported-compiler"),
     "the host C++ compiler is not supported by this CUDA toolkit"),
]

_OOM = re.compile(
    r"Killed signal terminated program|died due to signal 9|out of memory|"
    r"Cannot allocate memory|std::bad_alloc|virtual memory exhausted|\bMemoryError\b",
    re.IGNORECASE,
)
#: A write the kernel refused for lack of space: the build filled the disk (or its tmpfs)
#: before the disk cap's next look.
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|\bENOSPC\b")
_ERROR_LINE = re.compile(
    r"(?P<line>(?:\S+\(\d+\)|\S+:\d+(?::\d+)?):? (?:fatal )?error[: ].*|"
    r"nvcc fatal\s*:.*|error: command .* failed.*)"
)
_NINJA_FAILED = re.compile(r"^\s*FAILED: (?:\[code=\d+\] )?(?P<target>\S+)", re.MULTILINE)
# Where pip's own account of a failed build backend begins: what the backend printed last,
# just before it, says why; pip's lines after it ("hint: See above for details.") never do.
_PIP_EPILOGUE = re.compile(r"^\s*error: subprocess-exited-with-error", re.MULTILINE)


def classify_log(log: str, spec: BuildSpec, *, oom: bool = False) -> Classified:
    """Why a build whose main process failed (not timed out, not cancelled) failed."""
    values = {"project": spec.project, "version": spec.version, "torch": spec.torch,
              "cuda": spec.cuda, "torch_cuda": spec.cuda}
    for pattern, template in _INCOMPATIBLE:
        m = pattern.search(log)
        if m is not None:
            return Classified(FailureKind.INCOMPATIBLE,
                              template.format(**{**values, **m.groupdict()}))
    if _NO_SPACE.search(log):
        return Classified(FailureKind.TOO_LARGE,
                          "the build ran out of disk space writing its workspace "
                          "(No space left on device; WHEELHOUSE_BUILD_DISK_LIMIT_GIB)")
    if oom or _OOM.search(log):
        target = _NINJA_FAILED.search(log)
        where = f" while compiling {_short(target.group('target'))}" if target else ""
        return Classified(FailureKind.OOM, f"a compile was killed for lack of memory{where}")
    for line in log.splitlines():
        m = _ERROR_LINE.search(line)
        if m is not None:
            return Classified(FailureKind.COMPILE_ERROR, _short(m.group("line"), 300))
    target = _NINJA_FAILED.search(log)
    if target is not None:
        return Classified(FailureKind.COMPILE_ERROR,
                          f"compiling {_short(target.group('target'))} failed")
    epilogue = _PIP_EPILOGUE.search(log)
    body = log[:epilogue.start()] if epilogue is not None and epilogue.start() > 0 else log
    tail = [line.strip() for line in body.splitlines() if line.strip()]
    last = tail[-1] if tail else "no output"
    return Classified(FailureKind.COMPILE_ERROR, f"the build failed: {_short(last, 300)}")


_UNSATISFIABLE = re.compile(r"No solution found when resolving|not found in the package registry|"
                            r"requirements are unsatisfiable|No matching distribution found")
_BECAUSE = re.compile(r"Because (?P<why>.*?)(?:\n\s*\n|$)", re.DOTALL)


def classify_install(log: str, what: str) -> Classified | None:
    """An installer that failed because no version satisfies the requirements at the configured
    indexes: deterministic (another attempt resolves the same), so not ``infrastructure``."""
    if not _UNSATISFIABLE.search(log):
        return None
    # uv wraps its explanation over lines; it is one sentence.
    m = _BECAUSE.search(log)
    lines = [line.strip() for line in log.splitlines() if _UNSATISFIABLE.search(line)]
    detail = _short(" ".join(m.group("why").split()) if m else lines[-1] if lines else "", 300)
    return Classified(FailureKind.INCOMPATIBLE,
                      f"{what}: no version satisfies the requirements at the configured indexes "
                      f"(WHEELHOUSE_BUILD_INDEX_URL, WHEELHOUSE_TORCH_INDEX_URL, "
                      f"WHEELHOUSE_TORCH_FIND_LINKS): {detail}")


#: uv's and pip's words for a host name that does not resolve.
_UNRESOLVED = re.compile(r"dns error|failed to lookup address information|Name or service not "
                         r"known|Temporary failure in name resolution|nodename nor servname",
                         re.I)
_URL = re.compile(r"https?://[^\s`'\")>]+")


def classify_unreachable(log: str, what: str, *, torch_index: str) -> Classified | None:
    """An installer that failed because an index's host name does not resolve: the worker's
    setting, not the network's mood, so not retried; one line that says which URL it tried and
    which setting points elsewhere (``torch_index``: the torch index's URL as configured)."""
    line = next((ln for ln in log.splitlines() if _UNRESOLVED.search(ln)), None)
    if line is None:
        return None
    near = log[:log.find(line) + len(line)]
    urls = _URL.findall(near)
    url = urls[-1].rstrip(".,:;") if urls else "an index"
    host = url.split("/")[2] if "://" in url else url
    torch_host = torch_index.split("/")[2] if "://" in torch_index else ""
    setting = ("WHEELHOUSE_TORCH_INDEX_URL" if torch_host and host == torch_host
               else "WHEELHOUSE_BUILD_INDEX_URL")
    return Classified(FailureKind.MISCONFIGURED,
                      f"{what}: {host} does not resolve (tried {_short(url, 200)}): set "
                      f"{setting} to an index this worker reaches")


def _short(text: str, limit: int = 160) -> str:
    """Drop the workspace path prefix of a file name and cap the length."""
    text = re.sub(r"/\S*/(?=[^/\s]+\.(?:cu|cpp|cc|h|cuh|hpp|o)\b)", "", text.strip())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def with_retries(policy: RetryPolicy, what: str, fn: Callable[[], T], *,
                 say: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``fn`` under ``policy``; once its attempts are spent, the last error becomes an
    ``infrastructure`` :class:`BuildFailed` (which RQ's retry of the job then honours)."""
    try:
        return policy.run(what, fn, say=say, sleep=sleep)
    except policy.retry_on as exc:
        raise BuildFailed(FailureKind.INFRASTRUCTURE,
                          f"{what} failed after {policy.attempts} attempts: {exc}") from exc
