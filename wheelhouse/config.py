"""One configuration object for web, worker and CLI.

Defaults are defined once here; each can be overridden from the environment as
``WHEELHOUSE_<FIELD>`` (upper case), and then by explicit overrides (tests, CLI flags).
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
import inspect
import itertools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, get_args, get_type_hints

from packaging.utils import NormalizedName, canonicalize_name

ENV_PREFIX = "WHEELHOUSE_"

DEFAULT_UPSTREAM = "https://pypi.org/simple/"
#: ``Config.publish_timeout``'s default, for library callers that have no configuration.
DEFAULT_PUBLISH_TIMEOUT = 3600
#: ``Config.cache_projects``'s default: the torch family from PyTorch's index, what torch and
#: torchvision require (torch 2.14's METADATA: cuda-bindings, cuda-toolkit and its nvidia-*
#: parts, cuda-pathfinder, triton, sympy, ...; so that torch installs with the upstream down
#: once cached), and what build venvs install (build backends, ninja, numpy, pybind11, cmake).
DEFAULT_CACHE_PROJECTS = (
    "torch,torchvision,torchaudio,triton,pytorch-triton,nvidia-*,cuda-*,"
    "filelock,typing-extensions,sympy,mpmath,networkx,jinja2,markupsafe,fsspec,pillow,"
    "setuptools,wheel,ninja,packaging,numpy,pybind11,cmake"
)
DEFAULT_UPSTREAM_RULES = (
    "torch,torchvision,torchaudio,triton,pytorch-triton,nvidia-*"
    "=https://download.pytorch.org/whl/{cu}/"
)



# -- settings that are more than one value, parsed once (Config's typed views) --


@dataclass(frozen=True)
class ReadAuth:
    """The parsed ``Config.auth`` setting."""

    mode: str
    """``open``, ``basic`` or ``token``."""
    user: str = ""
    password: str = ""

    @classmethod
    def parse(cls, text: str | None) -> ReadAuth:
        value = (text or "").strip()
        if value in ("", "off", "none"):
            return cls("open")
        if value == "token":
            return cls("token")
        kind, _, rest = value.partition(":")
        user, sep, password = rest.partition(":")
        if kind == "basic" and sep and user and password:
            return cls("basic", user, password)
        raise ValueError("must be 'basic:USER:PASSWORD', 'token' or empty")


class Unproven(StrEnum):
    """The parsed ``Config.unproven_wheels`` setting (issue 27)."""

    LIST = "list"
    """Listed; the project page says "not proven on a GPU" (or that its proof failed)."""
    HOLD = "hold"
    """Left out of the index pages until a proof passed on it (a failed proof holds it too)."""

    @classmethod
    def parse(cls, text: str) -> Unproven:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"must be 'list' or 'hold', got {text!r}") from None


@dataclass(frozen=True)
class RateLimit:
    """At most ``count`` hits per fixed window of ``seconds``."""

    count: int
    seconds: int

    @classmethod
    def parse(cls, text: str) -> RateLimit:
        m = re.fullmatch(r"\s*([0-9]{1,7})\s*/\s*([0-9]{1,7})\s*", text)
        if m is None or int(m.group(2)) == 0:
            raise ValueError(f"a rate limit looks like COUNT/SECONDS, e.g. 30/60; got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class Route:
    """One upstream rule: projects matching ``patterns`` go to ``url``."""

    patterns: tuple[str, ...]
    url: str

    def matches(self, project: NormalizedName) -> bool:
        return any(fnmatch.fnmatchcase(project, p) for p in self.patterns)


def parse_rules(text: str) -> tuple[Route, ...]:
    routes = []
    for chunk in text.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        names, sep, url = chunk.partition("=")
        if not sep or not url.strip():
            raise ValueError(f"upstream rule {chunk!r} must look like name,name-*=URL")
        patterns = tuple(canonicalize_name(n.strip()) if "*" not in n else n.strip().lower()
                         for n in names.split(",") if n.strip())
        if not patterns:
            raise ValueError(f"upstream rule {chunk!r} names no project")
        routes.append(Route(patterns, url.strip()))
    return tuple(routes)


@dataclass(frozen=True)
class Config:
    """All tunables. Field docstrings are the documentation the settings table mirrors
    (docs/configuration.md)."""

    storage: str = "./wheelhouse-data"
    """Where wheels live: a directory, or ``s3://bucket/prefix``."""

    s3_endpoint_url: str | None = None
    """S3 endpoint for MinIO and other S3-compatible servers; AWS when unset."""

    s3_file_mode: str = "stream"
    """How S3-stored files are served: ``stream`` through the index or ``redirect`` (presigned)."""

    presign_seconds: int = 300
    """Lifetime of presigned URLs when ``s3_file_mode`` is ``redirect``."""

    s3_public_endpoint_url: str | None = None
    """S3 endpoint as clients reach it, for presigned URLs (when not ``s3_endpoint_url``)."""

    local_file_mode: str = "sendfile"
    """Local files: ``sendfile`` (the index sends them) or ``x-accel-redirect``/``x-sendfile``."""

    accel_redirect_prefix: str = "/_wheelhouse_storage/"
    """nginx ``internal`` location that maps to the storage directory (``x-accel-redirect``)."""

    upstream: str = DEFAULT_UPSTREAM
    """Default upstream simple index for projects not hosted here, or ``off`` to answer 404."""

    upstream_rules: str = DEFAULT_UPSTREAM_RULES
    """Per-project routes ``a,b-*=URL`` joined by ``;``; URLs may use {cu}, {cuda}, {torch}."""

    cache_projects: str = DEFAULT_CACHE_PROJECTS
    """Projects served through the pull-through cache (comma-separated globs; ``*``: all)."""

    cache_max_gib: float = 0.0
    """Most the pull-through cache keeps in storage per CUDA line (``cu130``; files of no line
    are one more), in GiB, evicting LRU files (0: no cap)."""

    cache_page_max_age: int = 600
    """Seconds a cached upstream project page is served before it is revalidated (ETag)."""

    cache_spool: str = ""
    """Local directory for files being fetched into the cache; empty: the system temp dir."""

    upstream_offline: bool = False
    """Never ask an upstream: serve cached pages and files only (cached projects), marked stale."""

    page_max_age: int = 60
    """``Cache-Control: max-age`` of index pages, in seconds."""

    catalog_refresh_seconds: float = 1.0
    """How often each server process checks storage for newly published wheels."""

    redis_url: str | None = None
    """Redis for the build queue; unset means index-only."""

    workspace: str = "./wheelhouse-work"
    """Scratch directory for builds on a worker host."""

    build_timeout: int = 4 * 3600
    """Default build deadline in seconds, enforced by the worker on the whole process tree."""

    secret_key: str | None = None
    """Flask secret for sessions and CSRF; unset: one generated and shared through Redis."""

    auth: str | None = None
    """Optional read protection for the index: ``basic:user:password`` or ``token``."""

    log_json: bool = False
    """Log one JSON object per line."""

    build_index_url: str = "https://pypi.org/simple"
    """Index the build environment installs build requirements (not torch) from."""

    torch_index_url: str = "https://download.pytorch.org/whl/{cu}"
    """Index torch is installed from into builds; may use {cu}; empty: the build index."""

    build_through_index: str = ""
    """This index as workers reach it: builds install torch and build requirements via its cache."""

    torch_find_links: str = ""
    """Extra find-links for torch and its CUDA wheels (space-separated dirs/URLs, may use {cu})."""

    torch_check: bool = True
    """Check torch and CUDA against the torch index and find-links before a build is queued."""

    recipe_dirs: str = ""
    """Extra directories of recipe TOML files (``:``-separated), searched before the built-ins."""

    worker_heartbeat_seconds: int = 15
    """Seconds between a worker's capability adverts in Redis (an advert expires after 4 beats)."""

    build_reserve_gib: float = 0.0
    """Memory kept free beside builds, in GiB; 0: max(8 GiB, 15%), scaled down on small hosts."""

    build_sandbox: str = "on"
    """``on``: builds run sandboxed (no sandbox, no builds); ``off``: unsandboxed, unsafe."""

    build_sandbox_bwrap: str = "bwrap"
    """The bubblewrap program that sandboxes builds: a name on ``PATH`` or a path."""

    build_uid_range: str = "65500-65531"
    """Unused uids (and gids) root workers run builds as, FIRST-LAST: one per concurrent build."""

    build_uid_lock_dir: str = "/run/wheelhouse/uids"
    """Host-wide directory of the build uids' claim locks, shared by every worker on the host."""

    build_max_processes: int = 8192
    """Most processes and threads one build may run at once (its uid's RLIMIT_NPROC)."""

    build_memory_limit_gib: float = 0.0
    """Most memory a build's processes may hold together, in GiB (0: the host's memory)."""

    build_disk_limit_gib: float = 50.0
    """Most a build may write into its workspace, in GiB; killed past it (0: no cap)."""

    sdist_max_mib: int = 2048
    """Largest sdist archive a worker accepts, in MiB."""

    sdist_max_members: int = 100_000
    """Most files and directories an sdist archive may hold."""

    sdist_max_unpacked_mib: int = 10_240
    """Most an sdist may unpack to, in MiB (the sum of its members' sizes)."""

    build_log_max_mib: float = 64.0
    """Largest stored build log, in MiB: past it, its first and last halves and a note (0: none)."""

    build_on_miss: bool = False
    """Enqueue a build when an installer's Python has no wheel on a recipe project's page."""

    unproven_wheels: str = "list"
    """Wheels with no passing GPU proof: ``list`` them (marked on the project page) or ``hold``."""

    prove_archs: str = ""
    """The ``prove-sm<arch>`` queues a worker takes GPU proofs from: empty for the archs of the
    GPUs ``nvidia-smi`` lists (none without a GPU), ``none``, or archs such as ``80,90``."""

    rate_limit: str = "30/60"
    """Build API requests allowed per token, as ``COUNT/SECONDS``."""

    login_rate_limit: str = "10/60"
    """Failed token sign-ins allowed per client address, as ``COUNT/SECONDS``."""

    redis_password_file: str | None = None
    """File holding the Redis password (e.g. a Docker secret), for a Redis URL without one."""

    storage_connect_timeout: float = 2.0
    """Seconds to wait for S3 to accept a connection, per attempt, before storage counts as down."""

    storage_read_timeout: float = 5.0
    """Seconds S3 may stay silent during a request, per attempt, before storage counts as down."""

    publish_timeout: int = DEFAULT_PUBLISH_TIMEOUT
    """Seconds a publication may hold its file name; an older claim with no record is taken over."""

    private_projects: str = ""
    """Projects never sent upstream from any root (comma-separated, ``*`` globs), beside recipes."""

    sdist_upload_max_mib: int = 256
    """Largest sdist ``wheelhouse request PATH`` may upload to build, in MiB (larger: 413)."""

    upload_max_mib: int = 2048
    """Largest wheel ``twine upload`` / ``uv publish`` may send, in MiB (larger: 413)."""

    upload_relabel: bool = False
    """Relabel uploaded wheels that lack the root's local version label instead of refusing them."""

    proxy_hops: int = 0
    """Reverse proxies in front whose X-Forwarded-For/-Proto to trust (compose's nginx: 1)."""

    allowed_projects: str = ""
    """Projects builds may be requested for (comma-separated); empty: any (generic recipe)."""

    compile_cache: bool = True
    """Cache compiles with sccache: on disk in the workspace, shared via S3 storage's sccache/."""

    compile_cache_max_gib: float = 20.0
    """Most one project's compile cache (per CUDA version) holds, on a worker and in storage."""

    compile_cache_log: str = "warn"
    """sccache's log level in a build (error, warn, info, debug, trace); debug times each step."""

    toolkit_wheels: bool = True
    """Provision CUDA 13.x toolkits from NVIDIA's wheels (12.x wheels hold no nvcc)."""

    toolkit_redist_url: str = "https://developer.download.nvidia.com/compute/cuda/redist/"
    """Base URL of NVIDIA's redistributable CUDA archives (or a mirror); empty: not used."""

    toolkit_provision: str = ""
    """CUDA versions a worker provisions and proves at start (``12.8 13.0``, ``auto``)."""

    provenance_ca: str = ""
    """The fleet CA's certificate (PEM) provenance chains to; empty: the workspace's own CA."""

    provenance_cert: str = ""
    """Signing certificate (PEM, ``wheelhouse ca issue``); empty: one the workspace CA issues."""

    provenance_key: str = ""
    """The private key (PEM, mode 0600) of ``provenance_cert``."""

    extra: Mapping[str, str] = field(default_factory=dict)
    """Settings this version does not know; kept so that callers can inspect them."""

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> Config:
        """Defaults, then ``WHEELHOUSE_*`` variables, then ``overrides``."""
        env = os.environ if environ is None else environ
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "extra":
                continue
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _coerce(raw, hints[f.name], f.name)
        known = {ENV_PREFIX + f.name.upper() for f in fields(cls)}
        values["extra"] = {
            k: v for k, v in env.items() if k.startswith(ENV_PREFIX) and k not in known
        }
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The ``WHEELHOUSE_*`` variables from which :meth:`from_env` rebuilds this config.

        For a child process (the single-box worker, tests): pass them as its environment
        rather than writing them into this process's ``os.environ``. Unset (``None``)
        settings are left out, so that the child sees their defaults.
        """
        env: dict[str, str] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            text = str(value).lower() if isinstance(value, bool) else str(value)
            env[ENV_PREFIX + f.name.upper()] = text
        env.update(self.extra)
        return env

    # -- typed views of the settings that are more than one value: parsed once, when the
    # config is made, so that a bad value fails at start-up, naming its variable --

    def __post_init__(self) -> None:
        for view, setting in _VIEWS.items():
            try:
                getattr(self, view)
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}{setting.upper()}: {exc}") from None

    @functools.cached_property
    def unproven(self) -> Unproven:
        """``unproven_wheels``: whether index pages list wheels no GPU proof passed on."""
        return Unproven.parse(self.unproven_wheels)

    @functools.cached_property
    def prove_arch_list(self) -> tuple[str, ...] | None:
        """``prove_archs``: the archs named (``()`` for ``none``), or None to ask the GPUs."""
        text = self.prove_archs.strip().lower()
        if not text:
            return None
        if text == "none":
            return ()
        archs = tuple(dict.fromkeys(a.strip().removeprefix("sm_") for a in
                                    text.replace(",", " ").split()))
        bad = [a for a in archs if not re.fullmatch(r"[0-9]{2,3}[af]?", a)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a GPU architecture (e.g. 90 or sm_90)")
        return archs

    @functools.cached_property
    def read_auth(self) -> ReadAuth:
        """``auth``: who may read the index."""
        return ReadAuth.parse(self.auth)

    @functools.cached_property
    def build_rate(self) -> RateLimit:
        """``rate_limit``: build-costing requests per token."""
        return RateLimit.parse(self.rate_limit)

    @functools.cached_property
    def login_rate(self) -> RateLimit:
        """``login_rate_limit``: failed token checks per client address."""
        return RateLimit.parse(self.login_rate_limit)

    @functools.cached_property
    def upstream_routes(self) -> tuple[Route, ...]:
        """``upstream_rules``, in order; the first that matches a project wins."""
        return parse_rules(self.upstream_rules)

    @functools.cached_property
    def cache_patterns(self) -> tuple[str, ...]:
        """``cache_projects``: normalized names and ``*`` globs; empty: the cache is off."""
        return tuple(canonicalize_name(n) if "*" not in n else n.lower()
                     for n in (p.strip() for p in self.cache_projects.split(",")) if n)

    @functools.cached_property
    def compile_cache_log_level(self) -> str:
        """``compile_cache_log``: one of sccache's log levels (its ``SCCACHE_LOG``)."""
        level = self.compile_cache_log.strip().lower()
        if level not in COMPILE_CACHE_LOG_LEVELS:
            raise ValueError(f"{self.compile_cache_log!r} is not one of "
                             f"{', '.join(COMPILE_CACHE_LOG_LEVELS)}")
        return level

    @functools.cached_property
    def extra_recipe_dirs(self) -> tuple[Path, ...]:
        """``recipe_dirs``, first one first; the built-in recipes are searched after them."""
        return tuple(Path(d) for d in self.recipe_dirs.split(":") if d.strip())

    @functools.cached_property
    def allowed_project_names(self) -> frozenset[NormalizedName]:
        """``allowed_projects``, normalized; empty means any project."""
        names = self.allowed_projects.replace(",", " ").split()
        return frozenset(canonicalize_name(n) for n in names)


#: sccache's log levels, quietest first.
COMPILE_CACHE_LOG_LEVELS = ("error", "warn", "info", "debug", "trace")

#: Config's typed views, and the setting each reads.
_VIEWS = {"unproven": "unproven_wheels", "prove_arch_list": "prove_archs",
          "read_auth": "auth", "build_rate": "rate_limit",
          "login_rate": "login_rate_limit",
          "upstream_routes": "upstream_rules", "cache_patterns": "cache_projects",
          "extra_recipe_dirs": "recipe_dirs", "compile_cache_log_level": "compile_cache_log",
          "allowed_project_names": "allowed_projects"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _coerce(raw: str, hint: Any, name: str) -> Any:
    args = get_args(hint)
    if type(None) in args:
        # ``X | None``: empty means None, anything else is read as an X.
        if raw.strip() == "":
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            hint = rest[0]
    text = str(hint)
    if hint is bool or text == "bool":
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(
                f"{ENV_PREFIX}{name.upper()} must be one of 1/0, true/false, yes/no, on/off, "
                f"got {raw!r}"
            )
        return word in _TRUE
    if hint is int or text == "int":
        return _number(int, raw, name)
    if hint is float or text == "float":
        return _number(float, raw, name)
    return raw


def _number(kind: type[int] | type[float], raw: str, name: str) -> int | float:
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise ValueError(f"{ENV_PREFIX}{name.upper()} must be a number, got {raw!r}")
    return value


def documented_settings() -> list[tuple[str, str, str]]:
    """(variable, default, description) for every setting, for the docs and ``--help``."""
    source = inspect.getsource(Config)
    tree = ast.parse(source)
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    rows = []
    for f in fields(Config):
        if f.name == "extra":
            continue
        default = f.default if f.default is not dataclasses.MISSING else ""
        rows.append((ENV_PREFIX + f.name.upper(), "" if default is None else str(default),
                     docs.get(f.name, "")))
    return rows
