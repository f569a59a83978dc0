"""The environment a build runs in: an allow-list of the worker's variables, and the probe.

The build must not see storage or Redis credentials, tokens or worker settings, nor inherited
CUDA or torch build switches: only the recipe decides how it builds. The compile runs with a
``ninja`` wrapper first on its ``PATH`` that compiles one translation unit alone before the
rest (the probe), so an incompatible combination fails in minutes, not hours.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from wheelhouse.builds.facts import MaxJobs
from wheelhouse.builds.fleet import ToolkitInfo
from wheelhouse.errors import BuildFailed, FailureKind
from wheelhouse.recipes.book import Recipe
from wheelhouse.variants import Variant

#: Variables a build may see from the worker's environment; everything else is dropped.
_KEEP_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ",
             "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "UV_CACHE_DIR",
             "UV_PYTHON_INSTALL_DIR", "PYENV_ROOT", "CC", "CXX", "CUDAHOSTCXX")
_KEEP_PREFIXES = ("LC_",)
#: Network settings only the installer sees, never setup.py.
_INSTALL_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")

PROBE_SCRIPT = """#!/bin/sh
# wheelhouse: compile one translation unit alone before the full build, so that an incompatible
# combination fails within minutes instead of after hours of other kernels.
real="{real}"
if [ "$1" = "-v" ] && [ -f build.ninja ]; then
  target=$("$real" -t targets all 2>/dev/null | sed -n 's/: cuda_compile$//p' | head -n 1)
  if [ -n "$target" ]; then
    echo "wheelhouse: probe: compiling $target alone first"
    NINJA_STATUS="[probe %f/%t] " "$real" -v -j 1 "$target" || exit $?
  fi
fi
exec "$real" "$@"
"""


def sanitized_env(environ: dict[str, str] | os._Environ[str], *, install: bool = False
                  ) -> dict[str, str]:
    """The worker's environment minus everything a build must not see.

    An allow-list: storage and Redis credentials, tokens, ``WHEELHOUSE_*`` and any inherited
    CUDA or torch build switches are dropped, so only the recipe decides how the build runs.
    """
    keep = set(_KEEP_ENV) | (set(_INSTALL_ENV) if install else set())
    return {k: v for k, v in environ.items() if k in keep or k.startswith(_KEEP_PREFIXES)}


def install_env() -> dict[str, str]:
    """For ``uv``: the sanitized environment, with the proxy settings the installer needs."""
    env = sanitized_env(os.environ, install=True)
    env["UV_NO_PROGRESS"] = "1"
    return env


def compile_env(workspace: Path, python: Path, toolkit: ToolkitInfo, jobs: MaxJobs,
                recipe: Recipe, variant: Variant, *, seen_python: Path | None = None,
                ) -> dict[str, str]:
    """The compile's environment: the build venv and toolkit first on ``PATH`` behind the
    probe wrapper, MAX_JOBS, a private TMPDIR, no compiler wrapper of torch's choosing, the CUDA
    library headers of torch's wheels as system include directories, and the
    recipe's ``[env]`` for ``variant``. The compile cache's launchers are added by its wrapper
    while its server runs (``worker.compilecache``). ``seen_python`` is the venv's ``python``
    where the compile sees it (the sandbox shows the venv elsewhere): the paths into the venv
    name that place."""
    seen_root = (seen_python or python).parent.parent
    venv_bin = seen_root / "bin"
    probe_bin = workspace / "probe-bin"
    probe_bin.mkdir(exist_ok=True)
    real_ninja = venv_bin / "ninja"
    if not (python.parent / "ninja").exists():
        found = shutil.which("ninja")
        if found is None:
            raise BuildFailed(FailureKind.INCOMPATIBLE,
                              "ninja is neither in the recipe's requirements nor installed")
        real_ninja = Path(found)
    wrapper = probe_bin / "ninja"
    wrapper.write_text(PROBE_SCRIPT.format(real=real_ninja))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = sanitized_env(os.environ)
    tmp = workspace / "tmp"
    tmp.mkdir(exist_ok=True)
    env.update({
        "PATH": os.pathsep.join([str(probe_bin), str(venv_bin),
                                 str(Path(toolkit.home) / "bin"), env.get("PATH", "")]),
        "VIRTUAL_ENV": str(venv_bin.parent),
        "CUDA_HOME": toolkit.home,
        "CUDA_PATH": toolkit.home,
        "MAX_JOBS": str(jobs.jobs),
        "TMPDIR": str(tmp),
        "PYTHONUNBUFFERED": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        # torch would otherwise put a ccache or sccache it finds on PATH in front of every
        # compile on its own; the compile cache is the worker's choice (worker.compilecache).
        "TORCH_NO_COMPILER_WRAPPER": "1",
    })
    env.update(library_header_env(python.parent.parent, seen=seen_root))
    env.update(recipe.environment(variant, max_jobs=jobs.jobs))
    return env


def library_header_env(venv: Path, *, seen: Path | None = None) -> dict[str, str]:
    """:func:`library_headers` as system include directories: after ``-I`` (so a toolkit's own
    headers win), for the host compiler and nvcc alike; nothing where torch's wheels have none.
    ``seen`` is where the compile sees ``venv``."""
    headers = os.pathsep.join(str((seen or venv) / h.relative_to(venv))
                              for h in library_headers(venv))
    return {var: headers for var in ("CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")} if headers else {}


def library_headers(venv: Path) -> list[Path]:
    """The CUDA library headers torch's own wheels installed into the build venv.

    torch's ``ATen/cuda`` headers include cuBLAS, cuSPARSE and cuSOLVER headers, which a
    minimal toolkit (nvcc and the runtime, as NVIDIA's toolkit wheels provide) lacks; torch's
    ``nvidia-*`` dependencies carry them in ``site-packages/nvidia/*/include`` (``cu13/`` for
    CUDA 13, one directory per library for 12), matching the libraries torch loads.
    """
    return sorted(p for p in venv.glob("lib/python*/site-packages/nvidia/*/include")
                  if p.is_dir())
