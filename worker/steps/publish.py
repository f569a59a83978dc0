"""The publish step: the checked wheel into storage (:func:`wheelhouse.index.publish.publish`) with
what the build measured and its signed provenance, and the build's log beside its record.

The provenance is made from what this process already holds (the spec, the journal's facts,
the sha256 the publish computes), never from the wheel's contents (docs/security.md)."""

from __future__ import annotations

from datetime import UTC, datetime

from wheelhouse.builds.spec import BuildSpec
from wheelhouse.errors import AlreadyPublished, BuildFailed, FailureKind, InvalidWheel
from wheelhouse.index import layout
from wheelhouse.index.layout import Record
from wheelhouse.index.publish import Signer, publish_checked
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.retry import LOG_UPLOAD
from worker.failures import with_retries
from worker.steps.checks import CheckedWheel
from worker.steps.context import BuildContext


def log_key(spec: BuildSpec) -> str:
    """Where the full log is stored: beside the wheel's record, under the same name."""
    return layout.log_key(spec.variant.base, spec.project, spec.expected_wheel_name)


def already_published(ctx: BuildContext) -> Record | None:
    """The record of the wheel this build would publish, if there is one."""
    return read_record(ctx, ctx.spec.expected_wheel_name)


def read_record(ctx: BuildContext, filename: str) -> Record | None:
    """The record of ``filename`` in the build's variant and project, if it is published."""
    spec = ctx.spec
    key = layout.record_key(spec.variant.base, spec.project, filename)

    def look() -> Record | None:
        try:
            return Record.from_json(ctx.storage.get_bytes(key))
        except FileNotFoundError:
            return None

    return ctx.retried("reading storage", look)


#: The name a worker signs with where the workspace's own CA issues its certificate.
WORKSPACE_SIGNER = "worker"


def provenance_signer(ctx: BuildContext) -> Signer:
    """Signs each published file's SLSA provenance with this worker's certificate."""
    identity = ca.signer_for(ctx.config, WORKSPACE_SIGNER)
    spec = ctx.spec
    archs = ctx.recipe.archs_for(spec.variant)

    def sign(filename: str, sha256: str) -> bytes:
        facts = ctx.journal.facts  # replaced, not changed, by each measurement
        predicate = predicates.build(
            project=spec.project, version=spec.version, python=spec.python,
            machine=spec.machine, variant=spec.variant, archs=archs, facts=facts,
            signer=identity.name, finished=datetime.now(UTC))
        signed = attest.sign(identity, filename, sha256, predicates.SLSA_PROVENANCE, predicate)
        return attest.document([attest.Bundle({"kind": "wheelhouse-worker",
                                               "claims": {"worker": identity.name,
                                                          "host": facts.host}},
                                              (signed,))])

    return sign


def publish_wheel(ctx: BuildContext, checked: CheckedWheel, *, seconds: float) -> Record:
    """Publish the checked wheel (and its variant form) with the build's facts (``seconds`` so
    far), never opening its zip here; a wheel of the same name published meanwhile, by
    another build of this spec, is this build's result too."""
    ctx.journal.phase("publish")
    ctx.journal.measured(seconds=round(seconds, 1), log_key=log_key(ctx.spec))
    facts = ctx.journal.facts
    archs = ctx.recipe.archs_for(ctx.spec.variant)
    sign = provenance_signer(ctx)

    def attempt() -> Record:
        try:
            return publish_checked(ctx.storage, checked.wheel, ctx.spec.variant, archs=archs,
                                   build=facts, claim_timeout=ctx.config.publish_timeout,
                                   by=f"build {facts.build_id}" if facts.build_id else None,
                                   variant_form=checked.variant, sign=sign)
        except AlreadyPublished:
            existing = already_published(ctx)
            if existing is None:
                raise
            return existing

    try:
        record = ctx.retried("publishing", attempt)
    except InvalidWheel as exc:
        raise BuildFailed(FailureKind.INCOMPATIBLE, str(exc)) from None
    ctx.say(f"published {record.filename} into {ctx.spec.variant.key}")
    return record


def store_log(ctx: BuildContext) -> None:
    """The build's log into storage, beside the record; a log that can't be stored is lost,
    never the build's outcome."""
    if not ctx.log.path.exists():
        return
    ctx.log.seal()
    try:
        with_retries(LOG_UPLOAD, "storing the log",
                     lambda: ctx.storage.put_file(log_key(ctx.spec), ctx.log.path))
    except BuildFailed:
        return  # the log is a convenience; the build's own outcome stands
