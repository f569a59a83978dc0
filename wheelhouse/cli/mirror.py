"""``wheelhouse mirror``: prime the pull-through cache before a cluster needs it.

It resolves the requirements the way an installer on the cluster would (``pip download`` for
the given Python and platform, binary wheels only, dependencies included) against one of the
running index's roots, so every file the resolution picks is fetched through the index, which
keeps it (``wheelhouse.index.mirror``). The downloads themselves are thrown away.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import click
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from wheelhouse.cli.tokens import SERVER_ENV
from wheelhouse.errors import InvalidVariant
from wheelhouse.variants import Variant

#: What cluster nodes run unless ``--platform`` says otherwise.
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64",)


def torch_line(requirements: list[Requirement]) -> str | None:
    """The torch X.Y a ``torch==X.Y.*`` (or ``==X.Y.Z``) requirement names, if any."""
    for req in requirements:
        if canonicalize_name(req.name) != "torch":
            continue
        for spec in req.specifier:
            if spec.operator in ("==", "===", "~="):
                parts = spec.version.split("+")[0].split(".")
                if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
                    return f"{parts[0]}.{parts[1]}"
    return None


def pip_download_args(root_url: str, requirements: list[str], python: str,
                      platforms: tuple[str, ...], dest: Path, deps: bool) -> list[str]:
    """The ``pip download`` command line that resolves ``requirements`` through ``root_url``."""
    args = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
            "--no-cache-dir", "--index-url", root_url, "--dest", str(dest),
            "--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in platforms:
        args += ["--platform", platform]
    if not deps:
        args.append("--no-deps")
    return [*args, *requirements]


@click.command("mirror")
@click.argument("requirements", nargs=-1, required=True)
@click.option("--cuda", required=True, help="CUDA line of the root to prime, e.g. 13.0.")
@click.option("--torch", "torch_version", default=None,
              help="torch X.Y of the root; default: from a torch==X.Y.* requirement.")
@click.option("--python", "python_version", required=True,
              help="Python the cluster runs, e.g. 3.11.")
@click.option("--platform", "platforms", multiple=True, default=DEFAULT_PLATFORMS,
              show_default=True, help="Wheel platform tag of the nodes (repeatable).")
@click.option("--server", envvar=SERVER_ENV, default="http://127.0.0.1:8000", show_default=True,
              help=f"The index whose cache to prime; default: ${SERVER_ENV} if set.")
@click.option("--no-deps", is_flag=True, help="Only the named projects, not what they need.")
def mirror(requirements: tuple[str, ...], cuda: str, torch_version: str | None,
           python_version: str, platforms: tuple[str, ...], server: str, no_deps: bool) -> None:
    """Fetch REQUIREMENTS (and what they need) through the index, so that its pull-through
    cache holds them; e.g. wheelhouse mirror "torch==2.14.*" --cuda 13.0 --python 3.11."""
    try:
        parsed = [Requirement(r) for r in requirements]
    except InvalidRequirement as exc:
        raise click.BadParameter(str(exc), param_hint="REQUIREMENTS") from None
    line = torch_version or torch_line(parsed)
    if line is None:
        raise click.UsageError("name the root's torch with --torch X.Y (no torch==X.Y.* "
                               "requirement says it)")
    try:
        variant = Variant.of(line, cuda)
    except InvalidVariant as exc:
        raise click.UsageError(str(exc)) from None
    root_url = f"{server.rstrip('/')}/{variant.key}/simple/"
    with tempfile.TemporaryDirectory(prefix="wheelhouse-mirror-") as tmp:
        args = pip_download_args(root_url, list(requirements), python_version, platforms,
                                 Path(tmp), deps=not no_deps)
        click.echo(f"resolving {' '.join(requirements)} through {root_url}", err=True)
        done = subprocess.run(args, check=False)
        if done.returncode != 0:
            raise click.ClickException(f"pip download failed (exit {done.returncode}); "
                                       "see its output above")
        names = sorted(p.name for p in Path(tmp).iterdir())
    for name in names:
        click.echo(f"cached {name}")
    click.echo(f"{len(names)} files are in the cache of {server}")
