"""``wheelhouse worker``, ``build``, ``workers`` and ``prove``: the click commands.

The worker's life cycle lives in ``worker.lifecycle``, the console output of a local build in
``worker.console``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidSdistFilename, parse_sdist_filename

from wheelhouse.builds.fleet import live_workers, source_paths_differ
from wheelhouse.builds.sourcedir import pack_directory
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.cli.main import pass_config, storage_option
from wheelhouse.config import Config
from wheelhouse.errors import BuildFailed, InvalidBuildSpec, InvalidVariant, WheelhouseError
from wheelhouse.index.catalog import Catalog, Record
from wheelhouse.index.manage import operator
from wheelhouse.index.proofs import GpuProof, now, record_proof, sign_proof
from wheelhouse.index.storage import Storage, open_storage
from wheelhouse.provenance.ca import Identity, signer_for
from wheelhouse.recipes.book import check_allowed, load_recipe, recipe_dirs
from wheelhouse.redisconn import connect
from wheelhouse.wheels import parse_name, sha256_file
from worker import build, gpuproof
from worker.capabilities import DEFAULT_ROOTS, discover
from worker.console import ConsoleReporter, cancel_on_interrupt
from worker.errors import SandboxUnavailable
from worker.lifecycle import (
    check_sandbox,
    default_name,
    prove_queues,
    run_worker,
    select_queues,
)
from worker.steps.context import uv_binary
from worker.supervision.reaper import become_subreaper
from worker.toolkits.provision import Sources, prepare, toolkit_root, wanted_versions


@click.command("worker")
@click.option("--name", default=None, help="Worker name (default: host-pid).")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty.")
@click.option("--cuda", "only_cuda", multiple=True,
              help="Serve only these CUDA versions (repeatable; default: all the toolkits allow).")
@pass_config
def worker_command(config: Config, name: str | None, burst: bool,
                   only_cuda: tuple[str, ...]) -> None:
    """Build wheels from the queues this host can serve (CUDA version x CPU architecture)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not config.redis_url:
        raise click.ClickException("WHEELHOUSE_REDIS_URL is not set; a worker needs Redis")
    root = toolkit_root(config)
    roots = (*DEFAULT_ROOTS, root)
    try:
        wanted = wanted_versions(config.toolkit_provision)
    except InvalidVariant as exc:
        raise click.ClickException(f"WHEELHOUSE_TOOLKIT_PROVISION: {exc}") from None
    caps = discover(roots=roots)
    # Advertise only what works: a toolkit to provision counts once it is installed and its
    # nvcc answered (proof kept in the workspace, so later starts reuse it at once).
    prepared = prepare(wanted, caps.toolkits, root,
                       Sources.from_config(config, uv=shutil.which("uv") or "uv"),
                       say=click.echo)
    if prepared.provisioned:
        caps = discover(roots=roots)
    ours = tuple(t.cuda for t in caps.toolkits if Path(t.home).is_relative_to(root))
    caps = dataclasses.replace(caps, provisionable=ours, unavailable=prepared.unavailable)
    # Proofs first: one takes minutes where a build takes hours.
    queues = (*prove_queues(caps, config), *select_queues(caps, only_cuda))
    if not queues:
        found = ", ".join(f"{t.cuda} ({t.home})" for t in caps.toolkits) or "none"
        raise click.ClickException(
            f"this host can serve no build queue: CUDA toolkits found: {found}")
    name = name or default_name()
    wheels = (f", provisioned CUDA {' '.join(caps.provisionable)}" if caps.provisionable
              else "")
    click.echo(f"wheelhouse worker {name}: {caps.machine}, {caps.cores} cores, "
               f"{caps.memory_bytes / 1024**3:.1f} GiB, toolkits "
               f"{', '.join(t.release for t in caps.toolkits) or 'none'}{wheels}, GPUs "
               f"{', '.join(g.name for g in caps.gpus) or 'none'}")
    try:
        run_worker(config, caps, queues, name=name, burst=burst, say=click.echo)
    except SandboxUnavailable as exc:
        # Fail closed: no queue was listened on, no advert was made; one line says why.
        raise click.ClickException(str(exc)) from None


def parse_target(target: str) -> tuple[str, str, Path | None]:
    """``flash-attn==2.8.3`` or a local sdist path → (project, version, path or None)."""
    path = Path(target)
    if path.is_file():
        try:
            name, version = parse_sdist_filename(path.name)
        except InvalidSdistFilename:
            raise InvalidBuildSpec(
                f"{path.name} is not an sdist file name (name-version.tar.gz)") from None
        return str(name), str(version), path.resolve()
    try:
        req = Requirement(target)
    except InvalidRequirement:
        raise InvalidBuildSpec(
            f"{target!r} is neither an existing sdist nor a requirement like flash-attn==2.8.3"
        ) from None
    pins = [s for s in req.specifier if s.operator in ("==", "===")]
    if len(pins) != 1 or len(req.specifier) != 1 or "*" in pins[0].version:
        raise InvalidBuildSpec(f"{target!r} must pin one exact version, e.g. {req.name}==2.8.3")
    return req.name, pins[0].version, None


@click.command("build")
@click.argument("target")
@click.option("--torch", "torch_version", required=True, help="torch version, e.g. 2.8.")
@click.option("--cuda", required=True, help="CUDA version torch was built with, e.g. 12.8.")
@click.option("--python", "python_version", default=None,
              help="Python version (default: this interpreter's).")
@click.option("--arch", "archs", multiple=True,
              help="GPU architecture, e.g. sm90 (repeatable; default: the recipe's set).")
@click.option("--cxx11abi/--no-cxx11abi", default=None, help="C++ ABI (default: torch's).")
@click.option("--timeout", type=int, default=None, help="Build deadline in seconds.")
@click.option("--max-jobs", type=click.IntRange(min=1), default=None,
              help="Override the RAM-aware MAX_JOBS.")
@click.option("--keep-workspace", is_flag=True, help="Keep the venv and build tree.")
@click.option("-v", "--verbose", is_flag=True, help="Stream the build log.")
@pass_config
@storage_option
def build_command(config: Config, target: str, torch_version: str, cuda: str,
                  python_version: str | None, archs: tuple[str, ...], cxx11abi: bool | None,
                  timeout: int | None, max_jobs: int | None, keep_workspace: bool,
                  verbose: bool) -> None:
    """Build TARGET (flash-attn==2.8.3, a local sdist, or a project directory) here, without
    Redis, and publish it."""
    with tempfile.TemporaryDirectory(prefix="wheelhouse-sdist-") as packed:
        if Path(target).is_dir():
            try:
                target = str(pack_directory(Path(target), Path(packed)))
            except WheelhouseError as exc:
                raise click.UsageError(str(exc)) from None
            click.echo(f"packed the directory as {Path(target).name}", err=True)
        _build(config, target, torch_version, cuda, python_version, archs, cxx11abi, timeout,
               max_jobs, keep_workspace, verbose)


def _build(config: Config, target: str, torch_version: str, cuda: str,
           python_version: str | None, archs: tuple[str, ...], cxx11abi: bool | None,
           timeout: int | None, max_jobs: int | None, keep_workspace: bool,
           verbose: bool) -> None:
    try:
        project, version, source = parse_target(target)
        check_allowed(config, project)
        spec = BuildSpec.create(
            project, version,
            python=python_version or f"{sys.version_info.major}.{sys.version_info.minor}",
            torch=torch_version, cuda=cuda, archs=archs, cxx11abi=cxx11abi)
    except WheelhouseError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        check_sandbox(config, lambda line: click.echo(line, err=True))
    except SandboxUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"building {spec.describe()}", err=True)
    become_subreaper()
    reporter = ConsoleReporter(verbose)
    try:
        with cancel_on_interrupt(reporter):
            result = build.run_build(
                spec, config=config, storage=open_storage(config),
                reporter=reporter,
                source=source, timeout=timeout, max_jobs=max_jobs,
                keep_workspace=keep_workspace)
    except BuildFailed as exc:
        reporter.end_line()
        raise click.ClickException(f"build failed [{exc.kind}]: {exc.reason}") from None
    reporter.end_line()
    if result.already_published:
        click.echo(f"{result.record.filename} is already published in {result.record.variant}")
    else:
        click.echo(f"published {result.record.filename} to {result.record.variant} "
                   f"in {result.seconds:.0f} s")
        if steps := result.build.steps_summary():
            click.echo(f"steps: {steps}", err=True)


@click.command("workers")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per worker.")
@click.option("--this-host", is_flag=True,
              help="Only this host's workers; exit 1 if there is none (for healthchecks).")
@pass_config
def workers_command(config: Config, as_json: bool, this_host: bool) -> None:
    """List the live build workers and what they can build."""
    if not config.redis_url:
        raise click.ClickException("WHEELHOUSE_REDIS_URL is not set (`wheelhouse serve "
                                   "--with-worker` prints the URL of its private Redis)")
    conn = connect(config, timeout=5)
    ads = live_workers(conn)
    if this_host:
        # A container healthcheck: healthy while a worker of this host keeps its heartbeat.
        ads = [ad for ad in ads if ad.hostname == socket.gethostname()]
        if not ads:
            raise click.ClickException(f"no live worker on {socket.gethostname()}")
    if as_json:
        for ad in ads:
            click.echo(ad.to_json())
        return
    if not ads:
        click.echo("no live workers")
        return
    now = time.time()
    for ad in ads:
        toolkits = ", ".join(t.release for t in ad.toolkits)
        job = ad.current_job or "idle"
        click.echo(f"{ad.name}  {ad.hostname} {ad.machine}  {ad.cores} cores  "
                   f"{ad.memory_bytes / 1024**3:.0f} GiB  toolkits {toolkits}  "
                   f"queues {' '.join(ad.queues)}  {job}  beat {now - ad.heartbeat_at:.0f}s ago")
        for cuda, why in sorted(ad.unavailable.items()):
            click.echo(f"  not offered: CUDA {cuda}: {why}")
    if note := source_paths_differ(ads):
        click.echo(f"warning: {note}")


@click.command("prove")
@click.argument("wheel", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--python", "python", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The interpreter of a venv holding the wheel's torch; the wheel is "
                   "installed into it first (uv pip install --no-deps --reinstall).")
@click.option("--json", "as_json", is_flag=True, help="The result as one JSON object.")
@click.option("--record", is_flag=True,
              help="Keep the result (passed or failed), signed under the fleet CA, in the "
                   "index beside the published wheel of that file name; a run where no GPU "
                   "ran records nothing.")
@pass_config
@storage_option
def prove_command(config: Config, wheel: Path, python: Path, as_json: bool,
                  record: bool) -> None:
    """Prove WHEEL on this host's GPU: its libraries load, the GPU's architecture is among its
    SASS, and its recipe's proof passes. Exit 0 proven, 1 failed, 3 nothing proven (no GPU),
    2 with --record for a wheel not published here (checked before the proof runs)."""
    try:
        project = parse_name(wheel.name).project
        recipe = load_recipe(project, recipe_dirs(config))
    except (WheelhouseError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    storage = open_storage(config) if record else None
    published = _published(storage, wheel) if storage is not None else []
    installed = subprocess.run([uv_binary(), "pip", "install", "-q", "--python", str(python),
                                "--no-deps", "--reinstall", str(wheel)], capture_output=True,
                               text=True, check=False)
    if installed.returncode != 0:
        tail = (installed.stderr.strip().splitlines() or ["no output"])[-1]
        raise click.ClickException(f"could not install {wheel.name} into {python}: {tail}")
    result = gpuproof.prove(python, wheel, recipe)
    click.echo(json.dumps(dataclasses.asdict(result)) if as_json else
               f"{wheel.name}: {result.line()}")
    if storage is not None:
        _record(config, storage, published, result)
    sys.exit(0 if result.passed else (1 if result.proven else 3))


def _published(storage: Storage, wheel: Path) -> list[Record]:
    """The published records of ``wheel``'s file name and bytes; else one line and exit 2."""
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    records = [r for r in catalog.all_records() if r.filename == wheel.name]
    if not records:
        click.echo(f"{wheel.name} is not published in this index: nothing to record a proof "
                   "for (publish it first, or leave out --record)", err=True)
        sys.exit(2)
    sha256 = sha256_file(wheel)
    if not any(r.sha256 == sha256 for r in records):
        click.echo(f"{wheel.name} here has sha256 {sha256}, but the published file has "
                   f"{records[0].sha256}: prove the published bytes", err=True)
        sys.exit(2)
    return [r for r in records if r.sha256 == sha256]


#: The name ``prove --record`` signs with where the workspace's own CA issues its certificate
#: (with WHEELHOUSE_PROVENANCE_CERT, the certificate's name); the proof names the host and user.
PROVER_SIGNER = "prover"


def _record(config: Config, storage: Storage, records: list[Record],
            result: gpuproof.Proof) -> None:
    """Keep a proof that ran, signed, beside each record; say so either way (stderr: --json's
    stdout stays one object)."""
    if not result.proven:
        click.echo("nothing recorded: no GPU ran the proof", err=True)
        return
    for r in records:
        try:
            # Per record, after the run: the certificate is valid when the proof says it was.
            signer = signer_for(config, PROVER_SIGNER)
            _record_one(storage, r, result, signer)
        except WheelhouseError as exc:  # deleted or replaced since the look-up; can't sign
            click.echo(f"not recorded: {exc}", err=True)
            sys.exit(2)
        click.echo(f"recorded the proof ({'passed' if result.passed else 'failed'}) of "
                   f"{r.filename} in {r.variant.key}, signed by {signer.name}", err=True)


def _record_one(storage: Storage, r: Record, result: gpuproof.Proof, signer: Identity) -> None:
    # What the run found, field by field, plus which bytes it ran on, when, and by whom.
    proof = GpuProof(filename=r.filename, sha256=r.sha256, proven_at=now(), host=operator(),
                     **dataclasses.asdict(result))
    record_proof(storage, r, sign_proof(proof, signer))
