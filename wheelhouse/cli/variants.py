"""``wheelhouse variants backfill``: the variant form of wheels published before there was one."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from wheelhouse.cli.main import pass_config, storage_option
from wheelhouse.config import Config
from wheelhouse.errors import WheelhouseError
from wheelhouse.index.catalog import Catalog, Record
from wheelhouse.index.publish import publish_variant_form
from wheelhouse.index.storage import Storage, open_storage
from wheelhouse.wheels import parse_name, split_variant_label


@dataclass(frozen=True)
class Backfilled:
    source: Record
    made: Record | None
    """The variant wheel now published; None where the source holds no SASS (or its name was
    taken by an equivalent build: see ``publish_variant_form``)."""


def _form_key(r: Record) -> tuple[str, str, str, frozenset[object]]:
    """What a wheel and its variant form share: variant, project, public version, tags."""
    name = parse_name(split_variant_label(r.filename)[0])
    return r.variant.key, r.project, name.version.public, frozenset(name.tags)


def backfill(storage: Storage, *, claim_timeout: float,
             dry_run: bool = False) -> list[Backfilled]:
    """Publish the variant form of every listed wheel that has none; idempotent. Wheels are
    downloaded one at a time to read their device code (the build's findings where recorded)."""
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    records = list(catalog.all_records())
    have = {_form_key(r) for r in records if r.variant_label is not None}
    out = []
    for source in records:
        if source.variant_label is not None or _form_key(source) in have:
            continue
        if dry_run:
            out.append(Backfilled(source, None))
            continue
        with tempfile.TemporaryDirectory(prefix="wheelhouse-backfill-") as tmp:
            path = Path(tmp) / source.filename
            storage.download(source.wheel_key, path)
            made = publish_variant_form(storage, path, source, claim_timeout=claim_timeout,
                                        by="wheelhouse variants backfill")
        out.append(Backfilled(source, made))
    return out


@click.group()
def variants() -> None:
    """Wheel variants: the plain root /simple/ (see docs/variants.md)."""


@variants.command("backfill")
@click.option("--dry-run", is_flag=True, help="Only list the wheels that have no variant form.")
@pass_config
@storage_option
def backfill_command(config: Config, dry_run: bool) -> None:
    """Publish the variant form of wheels published before variant wheels existed."""
    try:
        done = backfill(open_storage(config), claim_timeout=config.publish_timeout,
                        dry_run=dry_run)
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    for b in done:
        if dry_run:
            click.echo(f"would make the variant form of {b.source.filename}")
        elif b.made is not None:
            click.echo(f"published {b.made.filename} (from {b.source.filename})")
        else:
            click.echo(f"no variant form of {b.source.filename}: no GPU code, or an "
                       "equivalent build has its name")
    made = sum(1 for b in done if b.made is not None)
    click.echo(f"{len(done)} wheels without a variant form; {made} published")
