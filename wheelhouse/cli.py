"""The ``wheelhouse`` command.

Subcommands that need Flask or the RQ worker live beside those packages and are imported only
when invoked, so the core never imports them at module level.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import click

from wheelhouse.config import Config
from wheelhouse.errors import WheelhouseError

# name -> "module:attribute" of a click command, loaded on first use.
_LAZY: dict[str, str] = {
    "serve": "web.cli:serve",
    "worker": "worker.cli:worker_command",
    "build": "worker.cli:build_command",
    "workers": "worker.cli:workers_command",
    "token": "wheelhouse.cli_tokens:token",
    "request": "wheelhouse.cli_tokens:request_command",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _LAZY:
            module, attr = _LAZY[cmd_name].split(":")
            try:
                return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
            except ModuleNotFoundError as exc:
                if exc.name is not None and module.startswith(exc.name):
                    return None  # that part of wheelhouse is not installed here
                raise
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="wheelhouse")
def main() -> None:
    """wheelhouse: a self-hosted cache of prebuilt CUDA-extension wheels."""


def load_config(**overrides: Any) -> Config:
    return Config.from_env(**{k: v for k, v in overrides.items() if v is not None})


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                  path_type=Path))
@click.option("--variant", "variant_key", required=True, help="Variant key, e.g. torch2.8-cu128.")
@click.option("--relabel", is_flag=True,
              help="Rewrite each wheel into the variant's local version (METADATA and RECORD too).")
@click.option("--arch", "archs", multiple=True,
              help="GPU architecture the wheel holds (repeatable), where known.")
def publish(
    files: tuple[Path, ...], variant_key: str, relabel: bool, archs: tuple[str, ...]
) -> None:
    """Publish existing wheels into a variant's index."""
    from wheelhouse.publish import publish as do_publish
    from wheelhouse.storage import open_storage
    from wheelhouse.variants import normalize_arch, parse_variant

    try:
        variant = parse_variant(variant_key)
        normalized = tuple(normalize_arch(a) for a in archs) or None
        storage = open_storage(load_config())
        for path in files:
            rec = do_publish(storage, path, variant, relabel_wheel=relabel, archs=normalized)
            click.echo(f"published {rec.filename} to {variant.key} (sha256 {rec.sha256})")
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--older-than", default=24.0, show_default=True, type=float,
              help="Hours before an unpublished leftover counts as abandoned.")
@click.option("--keep-versions", type=click.IntRange(min=1),
              help="Also prune all but the newest N versions per variant and project.")
@click.option("--apply", "do_apply", is_flag=True, help="Delete; without it, only print.")
def gc(older_than: float, keep_versions: int | None, do_apply: bool) -> None:
    """Remove unpublished leftovers (and old versions by policy). Dry-runs unless --apply."""
    from wheelhouse import gc as collector
    from wheelhouse.storage import open_storage

    storage = open_storage(load_config())
    doomed = collector.plan(storage, leftover_age=older_than * 3600, keep_versions=keep_versions)
    for d in doomed:
        click.echo(f"{'delete' if do_apply else 'would delete'} {d.key} ({d.size} bytes): {d.why}")
    if not doomed:
        click.echo("nothing to collect")
    elif do_apply:
        n = collector.apply(storage, doomed)
        click.echo(f"deleted {n} objects")
    else:
        click.echo(f"{len(doomed)} objects; run again with --apply to delete them")


def run() -> None:
    """Entry point that turns domain errors into a one-line message and exit status 1."""
    try:
        main(standalone_mode=True)
    except WheelhouseError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
