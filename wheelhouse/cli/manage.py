"""``wheelhouse yank``, ``unyank``, ``delete`` and ``projects``: change what is published and
who may publish it, on storage directly (the operator's credentials), each kept in the audit
trail under ``audit/``."""

from __future__ import annotations

import click
from packaging.utils import NormalizedName

from wheelhouse.cli.main import pass_config, storage_option
from wheelhouse.config import Config
from wheelhouse.errors import WheelhouseError
from wheelhouse.index.layout import owner_key
from wheelhouse.index.manage import Action, Target, audit, delete, find, operator, unyank, yank
from wheelhouse.index.ownership import FLEET, Owners, change_owners, owned_projects, release
from wheelhouse.index.publish import bump_generation
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import check_name, check_projects
from wheelhouse.variants import parse_variant

_TARGET = click.argument("target", metavar="PROJECT==VERSION|FILE.whl")
_VARIANT = click.option("--variant", "variant_key", default=None,
                        help="Only in this index root (variant key); default: every root.")


def _target(spec: str, variant_key: str | None) -> Target:
    try:
        return Target.parse(spec, variant_key)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("yank")
@_TARGET
@_VARIANT
@click.option("--reason", default="", help="Why (shown by pip and uv to who installs it).")
@pass_config
@storage_option
def yank_command(config: Config, target: str, variant_key: str | None, reason: str) -> None:
    """Mark a version (or one file) as yanked (PEP 592): installers skip it unless pinned."""
    try:
        records = yank(open_storage(config), _target(target, variant_key), who=operator(),
                       reason=reason)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    for r in records:
        click.echo(f"yanked {r.filename} in {r.variant.key}")


@click.command("unyank")
@_TARGET
@_VARIANT
@pass_config
@storage_option
def unyank_command(config: Config, target: str, variant_key: str | None) -> None:
    """List a yanked version (or one file) as installable again."""
    try:
        records = unyank(open_storage(config), _target(target, variant_key), who=operator())
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    for r in records:
        click.echo(f"unyanked {r.filename} in {r.variant.key}")


@click.command("delete")
@_TARGET
@_VARIANT
@click.option("--reason", default="", help="Why, for the audit trail.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_config
@storage_option
def delete_command(config: Config, target: str, variant_key: str | None, reason: str,
                   yes: bool) -> None:
    """Delete a version (or one file) for good: its record, wheel, .metadata and claim.

    Asks first. Prefer `wheelhouse yank`: installs pinned to a deleted file break.
    """
    storage = open_storage(config)
    wanted = _target(target, variant_key)
    try:
        found = find(storage, wanted)
        for r in found:
            click.echo(f"{r.filename} in {r.variant.key}")
        if not yes:
            click.confirm(f"delete these {len(found)} file(s)?", abort=True)
        records = delete(storage, wanted, who=operator(), reason=reason)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    for r in records:
        click.echo(f"deleted {r.filename} in {r.variant.key}")


@click.group("projects")
def projects() -> None:
    """Who owns which project: only an owner's token (or an admin's) publishes new files."""


def _project(name: str) -> NormalizedName:
    try:
        return check_projects([name])[0]  # type: ignore[return-value]
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None


def _owners_line(record: Owners) -> str:
    owners = ", ".join("(the build fleet)" if o == FLEET else o for o in record.owners)
    where = "private (never upstream)" if record.private else "public (on its upstream)"
    return f"{record.project}\t{owners or '(admins only)'}\t{where}"


@projects.command("list")
@pass_config
@storage_option
def projects_list(config: Config) -> None:
    """Every owned project, its owners and whether it is kept private."""
    for record in owned_projects(open_storage(config)):
        click.echo(_owners_line(record))


def _change(config: Config, project: str, action: Action, names: tuple[str, ...]) -> None:
    storage = open_storage(config)
    name = _project(project)
    try:
        record = change_owners(storage, name, action.value, names, by=operator())
        audit(storage, action, [owner_key(name)], who=operator(), reason=", ".join(names))
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(_owners_line(record))


_TOKENS = click.argument("tokens", nargs=-1, required=True, metavar="TOKEN_NAME...")


@projects.command("grant")
@click.argument("project")
@_TOKENS
@pass_config
@storage_option
def projects_grant(config: Config, project: str, tokens: tuple[str, ...]) -> None:
    """Let the tokens called TOKEN_NAME publish PROJECT too (`:fleet` is the build fleet)."""
    _change(config, project, Action.GRANT, _names(tokens))


@projects.command("revoke")
@click.argument("project")
@_TOKENS
@pass_config
@storage_option
def projects_revoke(config: Config, project: str, tokens: tuple[str, ...]) -> None:
    """Stop the tokens called TOKEN_NAME publishing PROJECT."""
    _change(config, project, Action.REVOKE, _names(tokens))


@projects.command("transfer")
@click.argument("project")
@_TOKENS
@pass_config
@storage_option
def projects_transfer(config: Config, project: str, tokens: tuple[str, ...]) -> None:
    """Make the tokens called TOKEN_NAME the only owners of PROJECT."""
    _change(config, project, Action.TRANSFER, _names(tokens))


@projects.command("release")
@click.argument("project")
@click.option("--variant", "variant_key", default="torch2.8-cu128", show_default=True,
              help="The root whose upstream route is asked whether it lists PROJECT.")
@pass_config
@storage_option
def projects_release(config: Config, project: str, variant_key: str) -> None:
    """Forget PROJECT's owners and its privacy: its upstream is asked again, and its next
    publisher becomes its owner."""
    storage = open_storage(config)
    name = _project(project)
    try:
        public = release(storage, config, name, parse_variant(variant_key))
        audit(storage, Action.RELEASE, [owner_key(name)], who=operator())
        bump_generation(storage)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"released {name}: " + ("its upstream lists it, so roots without it send "
                                       "installers there" if public else
                                       "its upstream does not list it"))


def _names(tokens: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(t if t == FLEET else check_name(t) for t in tokens)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
