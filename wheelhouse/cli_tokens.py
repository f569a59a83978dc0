"""``wheelhouse token create|revoke|list`` and ``wheelhouse request``.

Tokens live in the build queue's Redis (``WHEELHOUSE_REDIS_URL``). ``request`` talks to a
running server's JSON API with a token, the way any client would.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import click
from packaging.requirements import InvalidRequirement, Requirement

from wheelhouse.config import Config
from wheelhouse.errors import WheelhouseError
from wheelhouse.tokens import DEFAULT_SCOPES, SCOPES, create_token, list_tokens, revoke_token

if TYPE_CHECKING:
    from redis import Redis

TOKEN_ENV = "WHEELHOUSE_TOKEN"  # noqa: S105 (a variable name)
SERVER_ENV = "WHEELHOUSE_SERVER"


def _redis() -> Redis:
    from redis import Redis

    config = Config.from_env()
    if not config.redis_url:
        raise click.ClickException("tokens live in Redis: set WHEELHOUSE_REDIS_URL")
    return Redis.from_url(config.redis_url, socket_timeout=5, socket_connect_timeout=5)


@click.group()
def token() -> None:
    """Create and revoke API tokens (who may request and cancel builds)."""


@token.command("create")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, type=click.Choice(SCOPES),
              help=f"What the token may do (repeatable); default: {', '.join(DEFAULT_SCOPES)}.")
@click.option("--replace", is_flag=True, help="Revoke an existing token of this name first.")
def token_create(name: str, scopes: tuple[str, ...], replace: bool) -> None:
    """Create a token called NAME and print it, once: it is stored only as a hash."""
    try:
        value = create_token(_redis(), name, scopes or DEFAULT_SCOPES, replace=replace)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(value)
    click.echo(f"token {name!r} created ({', '.join(scopes or DEFAULT_SCOPES)}); it will not be "
               "shown again", err=True)


@token.command("revoke")
@click.argument("name")
def token_revoke(name: str) -> None:
    """Revoke the token called NAME; sessions signed in with it end too."""
    try:
        found = revoke_token(_redis(), name)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    if not found:
        raise click.ClickException(f"no token called {name!r}")
    click.echo(f"token {name!r} revoked")


@token.command("list")
def token_list() -> None:
    """List token names and scopes (never the tokens)."""
    for info in list_tokens(_redis()):
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.created_at))
        click.echo(f"{info.name}\t{','.join(info.scopes)}\tcreated {created} UTC")


def _call(method: str, url: str, token: str, body: dict[str, Any] | None = None,
          timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    if not url.startswith(("http://", "https://")):
        raise click.ClickException(f"the server URL must be http(s): {url!r}")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={  # noqa: S310
        "Authorization": f"Bearer {token}", "Accept": "application/json",
        "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read() or b"{}")
        except ValueError:
            payload = {"error": exc.reason}
        return exc.code, payload if isinstance(payload, dict) else {"error": str(payload)}
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(f"cannot reach {url}: {exc}") from None


@click.command("request")
@click.argument("requirement")
@click.option("--torch", required=True, help="torch major.minor, e.g. 2.8.")
@click.option("--cuda", required=True, help="CUDA version, e.g. 12.8.")
@click.option("--python", "pythons", multiple=True, required=True,
              help="Python version (repeatable), e.g. 3.11.")
@click.option("--arch", "archs", multiple=True, help="GPU architecture (repeatable), e.g. sm90.")
@click.option("--machine", default="x86_64", show_default=True, help="CPU architecture.")
@click.option("--server", envvar=SERVER_ENV, default="http://127.0.0.1:8000", show_default=True,
              help=f"The wheelhouse server (or ${SERVER_ENV}).")
@click.option("--token", "api_token", envvar=TOKEN_ENV, required=True,
              help=f"API token with the build scope (better: ${TOKEN_ENV}).")
@click.option("--rerun-failed", is_flag=True, help="Run a failed build of the same spec again.")
@click.option("--wait", is_flag=True, help="Wait for the builds to end; exit 1 if any failed.")
def request_command(requirement: str, torch: str, cuda: str, pythons: tuple[str, ...],
                    archs: tuple[str, ...], machine: str, server: str, api_token: str,
                    rerun_failed: bool, wait: bool) -> None:
    """Ask a wheelhouse server to build REQUIREMENT (``flash-attn==2.8.3``)."""
    try:
        req = Requirement(requirement)
    except InvalidRequirement as exc:
        raise click.ClickException(f"not a requirement: {exc}") from None
    pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
    if len(pins) != 1 or "*" in pins[0]:
        raise click.ClickException("pin exactly one version: PROJECT==VERSION")
    body: dict[str, Any] = {"project": req.name, "version": pins[0], "torch": torch, "cuda": cuda,
                            "python": list(pythons), "archs": list(archs), "machine": machine,
                            "rerun_failed": rerun_failed}
    status, payload = _call("POST", server.rstrip("/") + "/api/builds", api_token, body)
    if status >= 400:
        raise click.ClickException(f"{status}: {payload.get('error', payload)}")
    builds = payload.get("builds", [])
    for b in builds:
        what = ("already built: " + b["wheel"]) if b.get("wheel") else (
            ("created" if b.get("created") else "exists") + f", {b.get('state')}")
        click.echo(f"{b.get('id')}\tPython {b.get('python')}\t{what}\t{b.get('url')}")
    if wait:
        _wait(builds, api_token)


def _wait(builds: list[dict[str, Any]], api_token: str) -> None:
    pending = {b["id"]: b["api"] for b in builds if not b.get("wheel")}
    failed = False
    while pending:
        time.sleep(float(os.environ.get("WHEELHOUSE_POLL_SECONDS", "5")))
        for job_id, url in list(pending.items()):
            status, view = _call("GET", url, api_token)
            if status >= 400 or not view.get("finished"):
                continue
            del pending[job_id]
            line = f"{job_id}: {view.get('state')}"
            if view.get("state") == "built":
                line += f"\n  {view.get('install')}"
            else:
                failed = True
                line += f" [{view.get('failure_kind')}] {view.get('reason')}"
            click.echo(line)
    if failed:
        raise SystemExit(1)
