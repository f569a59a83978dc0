"""``wheelhouse token create|revoke|list`` and ``wheelhouse request``.

Tokens live in the build queue's Redis (``WHEELHOUSE_REDIS_URL``). ``request`` talks to a
running server's JSON API with a token, the way any client would.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import click
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidSdistFilename, parse_sdist_filename

from wheelhouse import keys
from wheelhouse.builds.queue import BuildState
from wheelhouse.builds.responses import (
    BuildsCreated,
    BuildView,
    RequestView,
    SourceStored,
    SubmittedBuild,
    parse_view,
)
from wheelhouse.builds.sourcedir import pack_directory
from wheelhouse.cli.main import pass_config
from wheelhouse.config import Config
from wheelhouse.errors import InvalidResponse, WheelhouseError
from wheelhouse.index.tokens import (
    DEFAULT_SCOPES,
    SCOPES,
    create_token,
    legacy_token_keys,
    list_tokens,
    revoke_token,
)
from wheelhouse.redisconn import connect

if TYPE_CHECKING:
    from redis import Redis

TOKEN_ENV = "WHEELHOUSE_TOKEN"  # noqa: S105 (a variable name)
SERVER_ENV = "WHEELHOUSE_SERVER"
POLL_ENV = "WHEELHOUSE_POLL_SECONDS"

_Answer = TypeVar("_Answer")

#: States of a build that will not bring a wheel unless it is run again.
_ENDED_WITHOUT_WHEEL = (BuildState.FAILED.value, BuildState.CANCELLED.value)


def _redis(config: Config) -> Redis:
    if not config.redis_url:
        raise click.ClickException(
            "tokens live in Redis: set WHEELHOUSE_REDIS_URL (`wheelhouse serve --with-worker` "
            "prints the URL of its private Redis when it starts)")
    return connect(config, timeout=5)


@click.group()
def token() -> None:
    """Create and revoke API tokens (who may request and cancel builds)."""


@token.command("create")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, type=click.Choice(SCOPES),
              help=f"What the token may do (repeatable); default: {', '.join(DEFAULT_SCOPES)}.")
@click.option("--variant", "variants", multiple=True,
              help="Limit uploads, yanks and deletes to this index root (repeatable), e.g. "
                   "torch2.14-cu130; default: every root.")
@click.option("--project", "projects", multiple=True,
              help="Limit what it publishes to this project (repeatable); default: any project "
                   "it owns or is the first to publish.")
@click.option("--replace", is_flag=True, help="Revoke an existing token of this name first.")
@pass_config
def token_create(config: Config, name: str, scopes: tuple[str, ...], variants: tuple[str, ...],
                 projects: tuple[str, ...], replace: bool) -> None:
    """Create a token called NAME and print it, once: it is stored only as a hash.

    Scopes: build (request and cancel builds), read (read a private index), upload (twine
    upload, uv publish), admin (yank, unyank, delete).
    """
    try:
        value = create_token(_redis(config), name, scopes or DEFAULT_SCOPES, replace=replace,
                             variants=variants, projects=projects)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(value)
    click.echo(f"token {name!r} created ({', '.join(scopes or DEFAULT_SCOPES)}); it will not be "
               "shown again", err=True)


@token.command("revoke")
@click.argument("name")
@pass_config
def token_revoke(config: Config, name: str) -> None:
    """Revoke the token called NAME; sessions signed in with it end too."""
    try:
        found = revoke_token(_redis(config), name)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    if not found:
        raise click.ClickException(f"no token called {name!r}")
    click.echo(f"token {name!r} revoked")


@token.command("list")
@pass_config
def token_list(config: Config) -> None:
    """List token names and scopes (never the tokens): every token that authenticates."""
    conn = _redis(config)
    for info in list_tokens(conn):
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.created_at))
        roots = f"\tvariants {','.join(info.variants)}" if info.variants else ""
        roots += f"\tprojects {','.join(info.projects)}" if info.projects else ""
        click.echo(f"{info.name}\t{','.join(info.scopes)}\tcreated {created} UTC{roots}")
    legacy = legacy_token_keys(conn)
    if legacy:
        click.echo(f"note: Redis holds {legacy} key(s) of the earlier token format "
                   f"({' and '.join(keys.LEGACY_TOKEN_PATTERNS)}); those tokens no longer "
                   "work: create them anew, then delete the keys", err=True)


def _call(method: str, url: str, token: str, body: dict[str, Any] | None = None,
          timeout: float = 30.0, *, upload: Path | None = None) -> tuple[int, dict[str, Any]]:
    """``body`` as JSON, or the file ``upload`` as raw bytes; the answer's status and JSON."""
    if not url.startswith(("http://", "https://")):
        raise click.ClickException(f"the server URL must be http(s): {url!r}")
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json",
               "Content-Type": "application/json"}
    data: Any = json.dumps(body).encode() if body is not None else None
    try:
        if upload is not None:
            headers["Content-Type"] = "application/octet-stream"
            headers["Content-Length"] = str(upload.stat().st_size)
            data = upload.open("rb")
        req = urllib.request.Request(url, data=data, method=method,  # noqa: S310
                                     headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read() or b"{}")
        except ValueError:
            payload = {"error": exc.reason}
        return exc.code, payload if isinstance(payload, dict) else {"error": str(payload)}
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"cannot reach {url}: {exc} (is the server running there? "
                                   "point --server or WHEELHOUSE_SERVER at it)") from None
    finally:
        if upload is not None and hasattr(data, "close"):
            data.close()


def _local_sdist(server: str, token: str, path: Path) -> tuple[str, str, dict[str, str]]:
    """A local sdist's project and version, once uploaded (its ``source`` for the request)."""
    try:
        name, version = parse_sdist_filename(path.name)
    except InvalidSdistFilename:
        raise click.ClickException(f"{path.name} is not an sdist file name "
                                   "(name-version.tar.gz)") from None
    return str(name), str(version), _upload_sdist(server, token, path)


def _upload_sdist(server: str, token: str, path: Path) -> dict[str, str]:
    """Upload the sdist at ``path`` (``PUT /api/sources/<name>``); its ``source`` reference."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    url = f"{server.rstrip('/')}/api/sources/{quote(path.name)}"
    status, payload = _call("PUT", url, token, upload=path, timeout=300.0)
    if status >= 400:
        raise click.ClickException(f"uploading {path.name}: {status}: "
                                   f"{payload.get('error', payload)}")
    stored = _parse(SourceStored.from_json, payload)
    if stored.sha256 != digest.hexdigest():
        raise click.ClickException(f"the server stored {path.name} as sha256 "
                                   f"{stored.sha256!r}, not {digest.hexdigest()}")
    click.echo(f"uploaded {path.name} (sha256 {digest.hexdigest()})", err=True)
    return {"sha256": digest.hexdigest(), "filename": path.name}


@click.command("request")
@click.argument("requirement")
@click.option("--torch", required=True, help="torch major.minor, e.g. 2.8.")
@click.option("--cuda", required=True, help="CUDA version, e.g. 12.8.")
@click.option("--python", "pythons", multiple=True, required=True,
              help="Python version (repeatable), e.g. 3.11.")
@click.option("--arch", "archs", multiple=True, help="GPU architecture (repeatable), e.g. sm90.")
@click.option("--machine", default="x86_64", show_default=True, help="CPU architecture.")
@click.option("--split-archs/--no-split-archs", "split_archs", default=None,
              help="One job per GPU architecture, each publishing a single-arch wheel, built "
                   "side by side across the fleet; default: the project's recipe's.")
@click.option("--server", envvar=SERVER_ENV, default="http://127.0.0.1:8000", show_default=True,
              help=f"The wheelhouse server; default: ${SERVER_ENV} if set.")
@click.option("--token", "api_token", envvar=TOKEN_ENV, default=None,
              help=f"API token with the build scope; default: ${TOKEN_ENV}, which keeps the "
                   "token out of the process list and shell history.")
@click.option("--retry", "--rerun-failed", "retry", is_flag=True,
              help="Run again the builds of this request that failed or were cancelled.")
@click.option("--wait", is_flag=True, help="Wait for the builds to end; exit 1 if any failed.")
@click.option("--poll-seconds", envvar=POLL_ENV, default=5.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help=f"With --wait: seconds between status checks (or ${POLL_ENV}).")
def request_command(requirement: str, torch: str, cuda: str, pythons: tuple[str, ...],
                    archs: tuple[str, ...], machine: str, split_archs: bool | None, server: str,
                    api_token: str | None, retry: bool, wait: bool, poll_seconds: float) -> None:
    """Ask a wheelhouse server to build REQUIREMENT (e.g. flash-attn==2.8.3), or a local
    sdist (e.g. vecadd-0.1.0.tar.gz) or project directory (packed as its sdist without running
    its code: wheelhouse.builds.sourcedir), which is uploaded to the server first
    (WHEELHOUSE_SDIST_UPLOAD_MAX_MIB) and built from there.

    Prints one line per Python version: the build id, its state and its page; a request split
    into one job per GPU architecture (--split-archs, or the recipe's default) is followed by a
    line per part. A build that
    already failed is not run again unless --retry is given: its reason is printed and the
    command exits 1.
    """
    if not api_token:
        raise click.UsageError(f"no API token: set {TOKEN_ENV} (or pass --token); an operator "
                               "creates one with `wheelhouse token create NAME`")
    source: dict[str, str] | None = None
    local = Path(requirement)
    if local.is_dir():
        with tempfile.TemporaryDirectory(prefix="wheelhouse-sdist-") as packed:
            try:
                sdist = pack_directory(local, Path(packed))
            except WheelhouseError as exc:
                raise click.ClickException(str(exc)) from None
            click.echo(f"packed the directory as {sdist.name}", err=True)
            project, pin, source = _local_sdist(server, api_token, sdist)
    elif requirement.endswith((".tar.gz", ".zip")) and local.is_file():
        project, pin, source = _local_sdist(server, api_token, local)
    else:
        try:
            req = Requirement(requirement)
        except InvalidRequirement as exc:
            raise click.ClickException(f"not a requirement: {exc}") from None
        pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        if len(pins) != 1 or "*" in pins[0]:
            raise click.ClickException("pin exactly one version: PROJECT==VERSION")
        project, pin = req.name, pins[0]
    body: dict[str, Any] = {"project": project, "version": pin, "torch": torch, "cuda": cuda,
                            "python": list(pythons), "archs": list(archs), "machine": machine,
                            "rerun_failed": retry}
    if source is not None:
        body["source"] = source
    if split_archs is not None:
        body["split_archs"] = split_archs
    status, payload = _call("POST", server.rstrip("/") + "/api/builds", api_token, body)
    if status >= 400:
        raise click.ClickException(f"{status}: {payload.get('error', payload)}")
    created = _parse(BuildsCreated.from_json, payload)
    builds = created.builds
    for warning in created.warnings:
        click.echo(f"warning: {warning}", err=True)
    ended = {b.id for b in builds if b.state in _ENDED_WITHOUT_WHEEL}
    for b in builds:
        if b.id in ended:
            what = f"{b.state} earlier: {_failure(b, api_token)}"
        elif b.wheel:
            what = "already built: " + b.wheel
        else:
            what = ("created" if b.created else "exists") + f", {b.state}"
        click.echo(f"{b.id}\tPython {b.python}\t{what}\t{b.url}")
        for part in b.parts or ():  # a request split into one job per architecture
            state = ("already built: " + part.wheel) if part.wheel else \
                ("created" if part.created else "exists") + f", {part.state}"
            click.echo(f"  {part.id}\tsm{part.arch}\t{state}\t{part.url}")
    if wait:
        _wait([b for b in builds if b.id not in ended], api_token, poll_seconds)
    if ended:
        pages = "its page says" if len(ended) == 1 else "their pages say"
        raise click.ClickException(
            f"{len(ended)} of these builds ended without a wheel ({pages} more); "
            "run again with --retry to build again")


def _parse(reader: Callable[[object], _Answer], payload: object) -> _Answer:
    """The server's answer read as its type; one line (no traceback) where it isn't one."""
    try:
        return reader(payload)
    except InvalidResponse as exc:
        raise click.ClickException(f"the server's answer is not understood: {exc}") from None


def _failure(build: SubmittedBuild, api_token: str) -> str:
    """``[kind] reason`` of a build that ended without a wheel, from the server's API."""
    if build.api is None:
        return "(its reason could not be read: the answer names no API link)"
    status, payload = _call("GET", build.api, api_token)
    if status >= 400:
        return f"(its reason could not be read: {status} {payload.get('error', '')})".strip()
    view = _parse(parse_view, payload)
    kind = view.failure_kind if isinstance(view, BuildView) else None
    reason = (view.reason if isinstance(view, BuildView) else None) or "no reason was recorded"
    return f"[{kind}] {reason}" if kind else str(reason)


def _wait(builds: list[SubmittedBuild], api_token: str, poll_seconds: float) -> None:
    pending = {b.id: b.api for b in builds if not b.wheel and b.api is not None}
    failed = False
    while pending:
        time.sleep(poll_seconds)
        for job_id, url in list(pending.items()):
            status, payload = _call("GET", url, api_token)
            if status >= 400:
                continue
            view = _parse(parse_view, payload)
            if not view.finished:
                continue
            del pending[job_id]
            line = f"{job_id}: {view.state}"
            if view.state == "built":
                installs = [p.install for p in view.parts] if isinstance(view, RequestView) \
                    else [view.install]
                line += "".join(f"\n  {i}" for i in installs)
            elif isinstance(view, RequestView):
                failed = True
                line += "".join(f"\n  sm{p.arch} {p.state}: [{p.failure_kind}] {p.reason}"
                                for p in view.parts if p.state != "built")
            else:
                failed = True
                line += f" [{view.failure_kind}] {view.reason}"
            click.echo(line)
    if failed:
        raise SystemExit(1)
