"""``wheelhouse yank``, ``unyank`` and ``delete``: change what is published, on storage
directly (the operator's credentials), each kept in the audit trail under ``audit/``."""

from __future__ import annotations

import click

from wheelhouse.cli import pass_config, storage_option
from wheelhouse.config import Config
from wheelhouse.errors import WheelhouseError
from wheelhouse.manage import Target, delete, find, operator, unyank, yank
from wheelhouse.storage import open_storage

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
