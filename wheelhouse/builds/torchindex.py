"""Which torch and CUDA builds exist, asked of the torch index before a build is queued.

The sources are those a worker installs torch from (``worker.build``): the torch index
(``WHEELHOUSE_TORCH_INDEX_URL`` with ``{cu}`` filled in; empty: ``WHEELHOUSE_BUILD_INDEX_URL``)
and every ``WHEELHOUSE_TORCH_FIND_LINKS`` entry (a directory, or a page of links). A torch wheel
counts for a CUDA version when its local label names it (``2.8.0+cu128``) or it has none (PyPI's
own torch: its CUDA is not in the name, so it is not refused on that ground).

Answers are kept per CUDA version for :attr:`TorchIndex.TTL` seconds, and a source that did not
answer for :attr:`TorchIndex.FAILED_TTL`. When a source does not answer, a request is queued
unchecked with a warning (the worker installs from the same sources, and a flaky index must not
block requests that would build); when every source answered without the version, it is refused
in one line naming the nearest versions that exist.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from wheelhouse.config import Config
from wheelhouse.errors import TorchUnavailable, UpstreamUnavailable
from wheelhouse.index.upstream import fetch_page, project_url
from wheelhouse.variants import KNOWN_CUDA

_WHEEL = re.compile(r"torch-[A-Za-z0-9_.+%-]+\.whl")


@dataclass(frozen=True)
class TorchBuilds:
    """What the sources list for one CUDA version."""

    cuda: str
    versions: frozenset[str]
    """torch ``major.minor`` versions with a build for it."""
    sources: tuple[str, ...]
    unreachable: tuple[str, ...] = ()
    """One line per source that did not answer."""


def _cu(cuda: str) -> str:
    return "cu" + cuda.replace(".", "")


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def _matching(filenames: list[str], cu: str) -> set[str]:
    found: set[str] = set()
    for name in filenames:
        try:
            project, version, _, _ = parse_wheel_filename(unquote(name))
        except InvalidWheelFilename:
            continue
        if project != "torch" or len(version.release) < 2:
            continue
        if version.local is None or version.local == cu:
            found.add(f"{version.major}.{version.minor}")
    return found


def _local_names(path: Path) -> list[str]:
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    index = path / "index.html"
    if index.is_file():
        names += _WHEEL.findall(index.read_text(errors="replace"))
    return names


def nearest(wanted: str, known: set[str], count: int = 2) -> list[str]:
    """The ``count`` versions of ``known`` closest to ``wanted`` (``2.88`` → ``2.9, 2.8``)."""
    def scalar(v: str) -> int:
        major, minor = _major_minor(v)
        return major * 1000 + minor

    want = scalar(wanted)
    newest_first = sorted(known, key=Version, reverse=True)
    return sorted(newest_first, key=lambda v: abs(scalar(v) - want))[:count]


class TorchIndex:
    """The torch and CUDA check, with its answers cached in this process."""

    TTL = 600.0
    FAILED_TTL = 60.0

    def __init__(self, config: Config, *, timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[float, TorchBuilds]] = {}

    def sources(self, cuda: str) -> list[str]:
        cu = _cu(cuda)
        index = self.config.torch_index_url or self.config.build_index_url
        return [project_url(index.format(cu=cu), "torch"),
                *(link.format(cu=cu) for link in self.config.torch_find_links.split())]

    def builds(self, cuda: str) -> TorchBuilds:
        with self._lock:
            cached = self._answers.get(cuda)
        now = self._clock()
        if cached is not None:
            ttl = self.FAILED_TTL if cached[1].unreachable else self.TTL
            if now - cached[0] < ttl:
                return cached[1]
        answer = self._ask(cuda)
        with self._lock:
            self._answers[cuda] = (now, answer)
        return answer

    def _ask(self, cuda: str) -> TorchBuilds:
        cu = _cu(cuda)
        versions: set[str] = set()
        unreachable: list[str] = []
        sources = self.sources(cuda)
        for source in sources:
            scheme = urlsplit(source).scheme
            try:
                if scheme in ("http", "https"):
                    page = fetch_page(source, timeout=self.timeout)
                    names = [f.filename for f in page.files]
                else:
                    names = _local_names(Path(unquote(urlsplit(source).path)
                                              if scheme == "file" else source))
            except (UpstreamUnavailable, OSError) as exc:
                unreachable.append(str(exc).splitlines()[0][:300])
                continue
            versions |= _matching(names, cu)
        return TorchBuilds(cuda, frozenset(versions), tuple(sources), tuple(unreachable))

    def check(self, torch: str, cuda: str) -> str | None:
        """None when torch ``torch`` is built for CUDA ``cuda``; a warning line when a source
        did not answer; raises :class:`TorchUnavailable` when every source answered without it."""
        builds = self.builds(cuda)
        if torch in builds.versions:
            return None
        if builds.unreachable:
            return (f"torch {torch} for CUDA {cuda} was not checked: {builds.unreachable[0]} "
                    "(WHEELHOUSE_TORCH_INDEX_URL); queued unchecked")
        where = builds.sources[0]
        if builds.versions:
            near = ", ".join(nearest(torch, set(builds.versions)))
            raise TorchUnavailable(f"torch {torch} has no build for CUDA {cuda} at {where}; "
                                   f"nearest: {near}")
        others = [c for c in KNOWN_CUDA if c != cuda and not self.builds(c).unreachable
                  and torch in self.builds(c).versions]
        also = (f"; torch {torch} is built for CUDA {', '.join(others)}" if others
                else "")
        raise TorchUnavailable(f"no torch build exists for CUDA {cuda} at {where}{also}")
