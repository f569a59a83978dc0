"""The ``wheelhouse`` command: a click group whose subcommands register themselves.

Every subcommand is an entry point of the ``wheelhouse.commands`` group (``pyproject.toml``):
the core's own (``publish``, ``gc``, ``verify``, ``token``, ``request``) and those of ``web`` and
``worker``, which the core never imports; each is imported only when it runs, and one whose
package is not installed is not listed. The group reads the configuration once and hands it
down on the click context (``ctx.obj``): commands take it with :data:`pass_config`.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click

from wheelhouse.config import Config
from wheelhouse.errors import WheelhouseError

#: The entry-point group that subcommands of ``wheelhouse`` are declared in.
COMMANDS_GROUP = "wheelhouse.commands"

_F = TypeVar("_F", bound=Callable[..., Any])

#: Passes the command's :class:`Config` (the group's, with this command's overrides) as the
#: first argument.
pass_config = click.make_pass_decorator(Config)


def _override_storage(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    config = ctx.find_object(Config)
    if config is None:
        raise RuntimeError("--storage works on commands of the wheelhouse group only")
    # The command's own context gets the changed Config; the group's stays as it was.
    ctx.obj = config.replace(storage=value)


def storage_option(command: _F) -> _F:
    """``--storage DIR|s3://BUCKET/PREFIX`` for a command that opens storage.

    It overrides ``WHEELHOUSE_STORAGE`` in the Config that :data:`pass_config` passes.
    """
    option = click.option(
        "--storage", metavar="DIR|s3://BUCKET/PREFIX", default=None, expose_value=False,
        callback=_override_storage,
        help="Where wheels live: a directory, or s3://bucket/prefix "
             "(overrides WHEELHOUSE_STORAGE).")
    return option(command)


def _installed(entry: EntryPoint) -> bool:
    """Whether the package the command lives in is importable here, without importing it."""
    return importlib.util.find_spec(entry.module.partition(".")[0]) is not None


class _EntryPointGroup(click.Group):
    """Subcommands from the ``wheelhouse.commands`` entry points, imported on first use."""

    @functools.cached_property
    def _entries(self) -> dict[str, EntryPoint]:
        return {e.name: e for e in entry_points(group=COMMANDS_GROUP) if _installed(e)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._entries})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        entry = self._entries.get(cmd_name)
        if command is not None or entry is None:
            return command
        loaded = entry.load()
        if not isinstance(loaded, click.Command):
            raise TypeError(f"entry point {entry.value} of {COMMANDS_GROUP} is not a command")
        return loaded


@click.group(cls=_EntryPointGroup)
@click.version_option(package_name="wheelhouse")
@click.pass_context
def main(ctx: click.Context) -> None:
    """wheelhouse: a self-hosted cache of prebuilt CUDA-extension wheels.

    Settings come from WHEELHOUSE_* environment variables (docs/configuration.md lists them); a
    command's options override them.
    """
    try:
        ctx.obj = Config.from_env()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _storage_place(config: Config) -> tuple[str, bool]:
    """Where ``config.storage`` is, in words a user can find (an absolute directory, or the S3
    URL and endpoint), and whether it is a local directory that does not exist yet."""
    url = urlsplit(config.storage)
    if url.scheme == "s3":
        at = f" at {config.s3_endpoint_url}" if config.s3_endpoint_url else ""
        return f"{config.storage}{at}", False
    path = Path(url.path if url.scheme == "file" else config.storage).resolve()
    return str(path), not path.exists()


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                  path_type=Path))
@click.option("--variant", "variant_key", required=True, help="Variant key, e.g. torch2.8-cu128.")
@click.option("--relabel", is_flag=True,
              help="Rewrite each wheel into the variant's local version (METADATA and RECORD too).")
@click.option("--arch", "archs", multiple=True,
              help="GPU architecture the wheel holds (repeatable), where known.")
@pass_config
@storage_option
def publish(config: Config, files: tuple[Path, ...], variant_key: str, relabel: bool,
            archs: tuple[str, ...]) -> None:
    """Publish existing wheels into a variant's index."""
    # Imported when the command runs: every `wheelhouse` call loads this module.
    from wheelhouse.index.manage import operator as operator_name  # noqa: PLC0415
    from wheelhouse.index.ownership import FLEET, Publisher, admit  # noqa: PLC0415
    from wheelhouse.index.publish import publish as do_publish  # noqa: PLC0415
    from wheelhouse.index.storage import open_storage  # noqa: PLC0415
    from wheelhouse.index.upload import upload_signer  # noqa: PLC0415
    from wheelhouse.variants import normalize_arch, parse_variant  # noqa: PLC0415
    from wheelhouse.wheels import parse_name  # noqa: PLC0415

    try:
        variant = parse_variant(variant_key)
        normalized = tuple(normalize_arch(a) for a in archs) or None
        where, new_dir = _storage_place(config)
        if new_dir:
            click.echo(f"warning: {where} does not exist: creating a new, empty storage there "
                       "(set WHEELHOUSE_STORAGE or --storage to the one your server reads)",
                       err=True)
        storage = open_storage(config)
        # The operator on the storage host acts for the fleet: an owner's files included.
        operator = Publisher(FLEET, admin=True)
        for path in files:
            admit(storage, config, parse_name(path.name).project, operator, variant,
                  recipe=False)
            # Attested as an upload is: who published it here, when (wheelhouse.provenance).
            sign = upload_signer(config, Publisher(f"wheelhouse publish by {operator_name()}"),
                                 [], path.name)
            rec = do_publish(storage, path, variant, relabel_wheel=relabel, archs=normalized,
                             claim_timeout=config.publish_timeout, sign=sign)
            click.echo(f"published {rec.filename} to {variant.key} in {where} "
                       f"(sha256 {rec.sha256})")
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option("--older-than", default=24.0, show_default=True, type=float,
              help="Hours before an unpublished leftover counts as abandoned.")
@click.option("--sources-older-than", default=7.0, show_default=True, type=float,
              help="Days before an sdist uploaded for a build (`wheelhouse request PATH`) goes.")
@click.option("--keep-versions", type=click.IntRange(min=1),
              help="Also prune all but the newest N versions per variant and project.")
@click.option("--apply", "do_apply", is_flag=True, help="Delete; without it, only print.")
@pass_config
@storage_option
def gc(config: Config, older_than: float, sources_older_than: float, keep_versions: int | None,
       do_apply: bool) -> None:
    """Remove unpublished leftovers, orphan claims, abandoned uploads and old uploaded sdists
    (and old versions by policy). Dry-runs unless --apply.

    A claim is an orphan when its publication wrote no record within WHEELHOUSE_PUBLISH_TIMEOUT.
    """
    # Imported when the command runs: every `wheelhouse` call loads this module.
    from wheelhouse.index import gc as collector  # noqa: PLC0415
    from wheelhouse.index.storage import open_storage  # noqa: PLC0415

    storage = open_storage(config)
    doomed = collector.plan(storage, leftover_age=older_than * 3600,
                            source_age=sources_older_than * 24 * 3600,
                            keep_versions=keep_versions, claim_timeout=config.publish_timeout)
    for d in doomed:
        click.echo(f"{'delete' if do_apply else 'would delete'} {d.key} ({d.size} bytes): {d.why}")
    if not doomed:
        click.echo("nothing to collect")
    elif do_apply:
        n = collector.apply(storage, doomed)
        click.echo(f"deleted {n} objects")
    else:
        click.echo(f"{len(doomed)} objects; run again with --apply to delete them")


@click.command()
@click.option("--quarantine", "do_quarantine", is_flag=True,
              help="Drop damaged files from the listings until the same bytes are published "
                   "again (and list again quarantined files that match their record).")
@pass_config
@storage_option
def verify(config: Config, do_quarantine: bool) -> None:
    """Re-hash stored wheels and .metadata files against their records.

    Prints each missing, truncated or mismatched file and exits 1 if there is any.
    """
    # Imported when the command runs: every `wheelhouse` call loads this module.
    from wheelhouse.index import verify as checker  # noqa: PLC0415
    from wheelhouse.index.storage import open_storage  # noqa: PLC0415

    storage = open_storage(config)
    report = checker.verify(storage)
    for p in report.problems:
        note = " (quarantined)" if p.quarantined else ""
        click.echo(f"{p.damage.value} {p.key}: {p.detail}{note}")
    for r in report.repaired:
        click.echo(f"whole again {r.wheel_key} (quarantined)")
    damaged = report.damaged
    click.echo(f"checked {report.checked} published files: {len(damaged)} damaged")
    if do_quarantine:
        added, lifted = checker.quarantine(storage, report)
        click.echo(f"quarantined {added}, listed again {lifted}")
    elif damaged:
        click.echo("run again with --quarantine to drop them from the listings until they are "
                   "republished")
    if damaged:
        sys.exit(1)


def run() -> None:
    """Entry point that turns domain errors, and a Redis that can't be reached from any
    command, into a one-line message and exit status 1."""
    from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: PLC0415
    from redis.exceptions import TimeoutError as RedisTimeoutError  # noqa: PLC0415

    try:
        main(standalone_mode=True)
    except WheelhouseError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        click.echo(f"error: Redis can't be reached ({' '.join(str(exc).split())}): check "
                   "WHEELHOUSE_REDIS_URL (`wheelhouse serve --with-worker` prints the URL of "
                   "its private one)", err=True)
        sys.exit(1)
