"""The storage layout: every key below the storage root, built here and nowhere else.

- ``wheels/<base variant>/<project>/<file>``           the wheel
- ``wheels/<base variant>/<project>/<file>.metadata``  its METADATA (PEP 658)
- ``wheels/<base variant>/<project>/<file>.provenance``  its signed provenance (PEP 740;
  :mod:`wheelhouse.provenance`), written before the record, which holds its sha256
- ``records/<base variant>/<project>/<file>.json``     the record (:class:`Record`); written
  last, so it *is* the publication: only files with a record are listed
- ``claims/<base variant>/<file>``                    who is publishing that name (see publish)
- ``quarantine/<base variant>/<project>/<file>.json``  ``wheelhouse verify --quarantine``
  found the stored files damaged: the record is not listed until republished
- ``yanks/<base variant>/<project>/<file>.json``       PEP 592: the record is listed as yanked,
  with the marker's reason (``wheelhouse yank``; module ``manage``)
- ``proofs/<base variant>/<project>/<file>.json``      the last GPU proof that ran on the wheel
  (``wheelhouse prove --record``; module ``proofs``), with its sha256
- ``upstream/<project>``                              its upstream listed it when it was
  published (module ``ownership``): roots without it may send installers there
- ``owners/<project>``                                who may publish new files of it (module
  ``ownership``): written by its first publisher, changed by admins (``wheelhouse projects``)
- ``private/<project>``                               it was not on its upstream when it was first
  published here: never sent upstream from any root until an admin releases it (``ownership``)
- ``audit/<time>-<id>.json``                          who yanked, unyanked or deleted what (manage)
- ``logs/<base variant>/<project>/<file>.log``         the full log of the build of that wheel
- ``stats/<recipe>-cu<XYZ>.json``                      learned compile-job memory (maxjobs)
- ``sccache/<project>/cu<XYZ>/...``                    the shared compile cache (compilecache)
- ``sources/<sha256>/<sdist file>``                    an sdist uploaded with ``wheelhouse
  request PATH`` (the web writes it, workers read it and check its sha256 before unpacking)
- ``mirror/pages/<root id>/<project>.json``             an upstream project page the
  pull-through cache serves (module ``mirror``; the root id names the upstream root URL)
- ``mirror/files/<sha256>/<file>``                     a file fetched through the cache,
  kept only once its bytes matched the upstream page's sha256 (and ``<file>.metadata``)
- ``mirror/used/<sha256>``                             touched when that file is served: the
  cache's least recently used files go first past ``WHEELHOUSE_CACHE_MAX_GIB``
- ``generation``                                       changes on every publication

A published wheel owns the keys :meth:`Record.keys` names; ``wheelhouse gc`` removes exactly
those when it prunes one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from packaging.utils import NormalizedName, canonicalize_name

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.shapes import known_fields
from wheelhouse.variants import Variant, parse_variant

GENERATION_KEY = "generation"
WHEELS = "wheels/"
RECORDS = "records/"
CLAIMS = "claims/"
QUARANTINE = "quarantine/"
YANKS = "yanks/"
PROOFS = "proofs/"
UPSTREAM = "upstream/"
OWNERS = "owners/"
PRIVATE = "private/"
AUDIT = "audit/"
LOGS = "logs/"
STATS = "stats/"
COMPILE_CACHE = "sccache/"
SOURCES = "sources/"
MIRROR = "mirror/"
MIRROR_PAGES = "mirror/pages/"
MIRROR_FILES = "mirror/files/"
MIRROR_USED = "mirror/used/"
METADATA_SUFFIX = ".metadata"
PROVENANCE_SUFFIX = ".provenance"
#: What build workers (and ``wheelhouse publish`` with their credentials) write: their S3
#: policy (``deploy/s3/worker-policy.json``) must allow each, and nothing else (quarantine
#: markers and deletions are the operator's). A first publication writes its project's owner
#: record and, for a project its upstream doesn't list, the private marker; a GPU host's proof
#: job, the proof it ran.
WORKER_WRITES = (WHEELS, RECORDS, CLAIMS, GENERATION_KEY, LOGS, STATS, COMPILE_CACHE, OWNERS,
                 PRIVATE, PROOFS)
#: What the web writes when a build is requested with a local sdist (``PUT /api/sources/...``);
#: with the read-only web policy of ``deploy/s3/web-policy.json`` those uploads answer 503.
WEB_SOURCE_WRITES = (SOURCES,)
#: What the web writes and deletes for the pull-through cache (pages, files, use markers,
#: eviction): ``deploy/s3/web-cache-policy.json``, which compose gives the web beside its
#: read-only policy, allows these and nothing else.
WEB_CACHE_WRITES = (MIRROR,)


#: Where a record's JSON keeps ``Record.provenance_sha256`` (see :meth:`Record.to_json`).
_PROVENANCE_IN_BUILD = "provenance_sha256"


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _base(base: Variant | str) -> str:
    return base if isinstance(base, str) else base.key


def wheel_key(base: Variant | str, project: str, filename: str) -> str:
    """Where a wheel is stored; ``base`` is its base variant (or that variant's key)."""
    return f"{WHEELS}{_base(base)}/{project}/{filename}"


def metadata_key(base: Variant | str, project: str, filename: str) -> str:
    """Where a wheel's METADATA is stored, served as ``<file>.metadata`` (PEP 658)."""
    return wheel_key(base, project, filename) + METADATA_SUFFIX


def provenance_key(base: Variant | str, project: str, filename: str) -> str:
    """Where a wheel's provenance document is stored, served as ``<file>.provenance``."""
    return wheel_key(base, project, filename) + PROVENANCE_SUFFIX


def record_key(base: Variant | str, project: str, filename: str) -> str:
    return f"{RECORDS}{_base(base)}/{project}/{filename}.json"


def claim_key(base: Variant | str, filename: str) -> str:
    return f"{CLAIMS}{_base(base)}/{filename}"


def log_key(base: Variant | str, project: str, filename: str) -> str:
    """Where the full log of the build of ``filename`` is stored: beside its record."""
    return f"{LOGS}{_base(base)}/{project}/{filename}.log"


def quarantine_key(rkey: str) -> str:
    """The marker that hides the record stored under ``rkey``."""
    return QUARANTINE + rkey.removeprefix(RECORDS)


def yank_key(rkey: str) -> str:
    """The marker that lists the record stored under ``rkey`` as yanked."""
    return YANKS + rkey.removeprefix(RECORDS)


def proof_key(rkey: str) -> str:
    """Where the GPU proof of the wheel whose record is stored under ``rkey`` is kept."""
    return PROOFS + rkey.removeprefix(RECORDS)


def proved_record_key(marker: str) -> str:
    """The record a proof belongs to (:func:`proof_key` read backwards)."""
    return RECORDS + marker.removeprefix(PROOFS)


def yanked_record_key(marker: str) -> str:
    """The record a yank marker marks (:func:`yank_key` read backwards)."""
    return RECORDS + marker.removeprefix(YANKS)


def upstream_key(project: str) -> str:
    """The marker that says ``project``'s upstream listed it when it was published here."""
    return f"{UPSTREAM}{project}"


def owner_key(project: str) -> str:
    """The record of who owns ``project`` here (:class:`wheelhouse.index.ownership.Owners`)."""
    return f"{OWNERS}{project}"


def private_key(project: str) -> str:
    """The marker that keeps ``project`` this index's own, never sent upstream."""
    return f"{PRIVATE}{project}"


def quarantined_record_key(marker: str) -> str:
    """The record a quarantine marker hides (:func:`quarantine_key` read backwards)."""
    return RECORDS + marker.removeprefix(QUARANTINE)


def stats_key(recipe: str, project: str, cuda: str) -> str:
    """Learned compile-job memory of one project built by a recipe under a CUDA version
    (``maxjobs``)."""
    return f"{STATS}{recipe}/{project}-cu{cuda.replace('.', '')}.json"


def compile_cache_prefix(space: str) -> str:
    """The shared compile cache's entries of one namespace (``flash-attn/cu130``)."""
    return f"{COMPILE_CACHE}{space}/"


def source_key(sha256: str, filename: str) -> str:
    """Where an uploaded sdist is stored: by its sha256 (content-addressed), then its name."""
    return f"{SOURCES}{sha256}/{filename}"


def mirror_page_key(root_id: str, project: str) -> str:
    """Where the pull-through cache keeps ``project``'s page from the upstream ``root_id``."""
    return f"{MIRROR_PAGES}{root_id}/{project}.json"


def mirror_file_key(sha256: str, filename: str) -> str:
    """Where a file fetched through the cache is kept: by its sha256, then its name."""
    return f"{MIRROR_FILES}{sha256}/{filename}"


def mirror_used_key(sha256: str) -> str:
    """The marker whose modification time says when a cached file was last served."""
    return f"{MIRROR_USED}{sha256}"


@dataclass(frozen=True)
class Record:
    """What publishing a wheel promises about it; serialized as the ``.json`` record.

    In JSON the variant is its key and the build facts a plain object, so records written by
    older versions read back unchanged.
    """

    filename: str
    project: NormalizedName
    version: str
    variant: Variant
    archs: tuple[str, ...] | None
    sha256: str
    size: int
    metadata_sha256: str
    requires_python: str | None
    upload_time: str
    yanked: bool | str = False
    build: BuildFacts = field(default_factory=BuildFacts)
    variant_label: str | None = None
    """Set on the variant form of a wheel (:mod:`wheelhouse.index.variantwheels`): listed by the
    plain root ``/simple/`` only, never by a variant root. Stored beside the wheel it was made
    from (the same base variant)."""
    variant_of: str | None = None
    """On a variant form: the file name of the wheel it was made from, so that yanking or
    deleting that wheel takes its variant form along (:mod:`wheelhouse.index.manage`)."""
    provenance_sha256: str | None = None
    """Of the signed provenance document stored beside the wheel; None for a wheel published
    without one (before provenance, or by ``wheelhouse publish`` with no signer)."""

    @property
    def wheel_key(self) -> str:
        return wheel_key(self.variant.base, self.project, self.filename)

    @property
    def metadata_key(self) -> str:
        return metadata_key(self.variant.base, self.project, self.filename)

    @property
    def provenance_key(self) -> str:
        return provenance_key(self.variant.base, self.project, self.filename)

    @property
    def key(self) -> str:
        """Where this record itself is stored."""
        return record_key(self.variant.base, self.project, self.filename)

    @property
    def claim_key(self) -> str:
        return claim_key(self.variant.base, self.filename)

    @property
    def log_key(self) -> str:
        """Where the log of the build that made this wheel is (if a worker built it)."""
        return log_key(self.variant.base, self.project, self.filename)

    @property
    def quarantine_key(self) -> str:
        return quarantine_key(self.key)

    @property
    def yank_key(self) -> str:
        return yank_key(self.key)

    @property
    def proof_key(self) -> str:
        return proof_key(self.key)

    def keys(self) -> dict[str, str]:
        """Every key this wheel's publication owns, with what it holds; the record first
        (removing it first unlists the wheel before its files go). Only some wheels have a
        quarantine marker, a yank marker, a GPU proof or a build log."""
        return {self.key: "record", self.quarantine_key: "quarantine marker",
                self.yank_key: "yank marker", self.proof_key: "GPU proof",
                self.metadata_key: "metadata", self.provenance_key: "provenance",
                self.wheel_key: "wheel",
                self.log_key: "build log", self.claim_key: "claim"}

    def to_json(self) -> bytes:
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["variant"] = self.variant.key
        data["archs"] = None if self.archs is None else list(self.archs)
        data["build"] = self.build.to_dict()
        # Readers older than provenance take every top-level key as a field (and fail on one
        # they don't know), but ignore unknown keys of the build object: the digest rides
        # there, so that every record a newer publisher writes stays readable by them.
        provenance = data.pop("provenance_sha256")
        if provenance is not None:
            data["build"][_PROVENANCE_IN_BUILD] = provenance
        for optional in ("variant_label", "variant_of"):
            if data[optional] is None:
                del data[optional]  # so that servers older than variant wheels read it
        return json.dumps(data, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        data = json.loads(raw)
        archs = data.get("archs")
        data["archs"] = None if archs is None else tuple(archs)
        data["project"] = canonicalize_name(data["project"])
        data["variant"] = parse_variant(data["variant"])
        build = data.get("build")
        if "provenance_sha256" not in data and isinstance(build, dict):
            data["provenance_sha256"] = _str_or_none(build.get(_PROVENANCE_IN_BUILD))
        data["build"] = BuildFacts.from_dict(build)
        return cls(**known_fields(cls, data))  # a newer writer's fields: ignored (shapes)
