"""One configuration object for web, worker and CLI.

Defaults are defined once here; each can be overridden from the environment as
``WHEELHOUSE_<FIELD>`` (upper case), and then by explicit overrides (tests, CLI flags).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_type_hints

ENV_PREFIX = "WHEELHOUSE_"

DEFAULT_UPSTREAM = "https://pypi.org/simple/"
DEFAULT_UPSTREAM_RULES = (
    "torch,torchvision,torchaudio,triton,pytorch-triton,nvidia-*"
    "=https://download.pytorch.org/whl/{cu}/"
)


@dataclass(frozen=True)
class Config:
    """All tunables. Field docstrings are the documentation the README table mirrors."""

    storage: str = "./wheelhouse-data"
    """Where wheels live: a directory, or ``s3://bucket/prefix``."""

    s3_endpoint_url: str | None = None
    """S3 endpoint for MinIO and other S3-compatible servers; AWS when unset."""

    s3_file_mode: str = "stream"
    """How S3-stored files are served: ``stream`` through the index or ``redirect`` (presigned)."""

    presign_seconds: int = 300
    """Lifetime of presigned URLs when ``s3_file_mode`` is ``redirect``."""

    upstream: str = DEFAULT_UPSTREAM
    """Default upstream simple index for projects not hosted here, or ``off`` to answer 404."""

    upstream_rules: str = DEFAULT_UPSTREAM_RULES
    """Per-project routes ``a,b-*=URL`` joined by ``;``; URLs may use {cu}, {cuda}, {torch}."""

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

    torch_find_links: str = ""
    """Extra find-links for torch and its CUDA wheels (space-separated dirs/URLs, may use {cu})."""

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

    publish_timeout: int = 3600
    """Seconds a publication may hold its file name; an older claim with no record is taken over."""

    allowed_projects: str = ""
    """Projects builds may be requested for (comma-separated); empty: any (generic recipe)."""

    compile_cache: bool = True
    """Cache compiles with sccache: on disk in the workspace, shared via S3 storage's sccache/."""

    compile_cache_max_gib: float = 20.0
    """Most one project's compile cache (per CUDA version) holds, on a worker and in storage."""

    toolkit_wheels: bool = True
    """Install a CUDA toolkit from NVIDIA's wheels when no host toolkit matches torch's CUDA."""

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
    """(variable, default, description) for every setting, for the README and ``--help``."""
    import ast
    import inspect

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
