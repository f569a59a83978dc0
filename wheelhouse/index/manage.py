"""Changing what is published: yank, unyank and delete, each kept in the audit trail.

Records are immutable, so a yank is a marker beside the record
(``yanks/<base>/<project>/<file>.json``, :func:`wheelhouse.index.layout.yank_key`) that the catalog
reads on every new generation: pages list the file with PEP 592's ``yanked`` and its reason,
and, since a page's ETag is the hash of its body, caches and CDNs see the change through the
ETag. Deleting removes the record first (so the file is unlisted before its bytes go), then
the wheel, its ``.metadata``, the claim on its name and any yank or quarantine marker; the name
can then be published again, with any bytes.

Every change writes one JSON object under ``audit/`` (:func:`audit`): what, which files, who
(a token's name, or the operator's user on the host for the CLI) and when.
"""

from __future__ import annotations

import getpass
import json
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from wheelhouse.errors import InvalidTarget, NothingPublished, OutOfReach
from wheelhouse.index.layout import (
    AUDIT,
    RECORDS,
    Record,
    yank_key,
)
from wheelhouse.index.publish import bump_generation
from wheelhouse.index.storage import Storage
from wheelhouse.variants import Variant, parse_variant
from wheelhouse.wheels import parse_name


class Action(StrEnum):
    YANK = "yank"
    UNYANK = "unyank"
    DELETE = "delete"
    # Who owns a project (``wheelhouse projects``, module ``ownership``).
    GRANT = "grant"
    REVOKE = "revoke"
    TRANSFER = "transfer"
    RELEASE = "release"


@dataclass(frozen=True)
class Target:
    """What a yank or delete applies to: one version of a project, or one file, optionally
    in one index root (its base: a narrowed root's files live in their base)."""

    project: str
    version: str | None = None
    filename: str | None = None
    variant: Variant | None = None

    @classmethod
    def parse(cls, spec: str, variant: str | None = None) -> Target:
        """``PROJECT==VERSION`` or a wheel's file name; ``variant`` a variant key."""
        root = parse_variant(variant) if variant else None
        if spec.endswith(".whl"):
            name = parse_name(spec)
            return cls(project=name.project, filename=name.filename, variant=root)
        project, sep, version = spec.partition("==")
        if not sep or not project.strip() or not version.strip():
            raise InvalidTarget(f"{spec!r}: name a version as PROJECT==VERSION, or a wheel's "
                                 "file name")
        try:
            Version(version.strip())
        except InvalidVersion:
            raise InvalidTarget(f"{spec!r}: {version.strip()!r} is not a version") from None
        return cls(project=canonicalize_name(project.strip()), version=version.strip(),
                   variant=root)

    def matches(self, record: Record) -> bool:
        if record.project != self.project:
            return False
        if self.variant is not None and record.variant.base != self.variant.base:
            return False
        if self.filename is not None:
            return record.filename == self.filename
        assert self.version is not None
        wanted, have = Version(self.version), Version(record.version)
        # ``1.0`` names every build of 1.0 (each root's label); ``1.0+cu130torch2.14`` one.
        return have == wanted if wanted.local else have.public == wanted.public

    def __str__(self) -> str:
        what = self.filename or f"{self.project}=={self.version}"
        return what + (f" in {self.variant.key}" if self.variant else "")


#: Whether the caller may change files in the root of this exact variant key (an admin
#: token's ``TokenInfo.allows_variant``); None: every root (the operator's CLI).
Reach = Callable[[str], bool]


def find(storage: Storage, target: Target, *, reach: Reach | None = None,
         who: str = "") -> list[Record]:
    """The published records ``target`` names (read from storage, not a catalog: the CLI
    has none, and a change must act on what is stored now).

    A target names files by their base root, so one named in a narrowed root matches the
    base's files too: each file's own variant key must be within ``reach``, or
    :class:`OutOfReach` is raised before anything changes."""
    prefixes = ([f"{RECORDS}{target.variant.base.key}/{target.project}/"]
                if target.variant is not None else [RECORDS])
    out = []
    forms: list[Record] = []  # variant forms (``/simple/``): they go with their source
    for prefix in prefixes:
        for o in storage.list(prefix):
            parts = o.key.removeprefix(RECORDS).split("/")
            if len(parts) != 3 or parts[1] != target.project or not o.key.endswith(".json"):
                continue
            try:
                record = Record.from_json(storage.get_bytes(o.key))
            except FileNotFoundError:
                continue
            except (ValueError, TypeError, KeyError):
                continue  # unreadable: the catalog does not list it either
            if target.matches(record):
                out.append(record)
            elif record.variant_of is not None:
                forms.append(record)
    sources = {(r.variant.base.key, r.filename) for r in out}
    out += [r for r in forms if (r.variant.base.key, r.variant_of) in sources]
    if not out:
        raise NothingPublished(f"nothing published matches {target}")
    beyond = sorted({r.variant.key for r in out if reach is not None and not reach(r.variant.key)})
    if beyond:
        raise OutOfReach(f"{who or 'this caller'} may not change files in {', '.join(beyond)}, "
                         f"which {target} names; nothing was changed (name a file of a root "
                         "it reaches)")
    return sorted(out, key=lambda r: (r.variant.key, r.filename))


def yank(storage: Storage, target: Target, *, who: str, reason: str = "",
         reach: Reach | None = None) -> list[Record]:
    """Mark every file ``target`` names as yanked (again, with this reason, if it was)."""
    records = find(storage, target, reach=reach, who=who)
    marker = json.dumps({"reason": reason, "by": who, "at": _now()}).encode()
    for r in records:
        storage.put_bytes(yank_key(r.key), marker)
    _done(storage, Action.YANK, records, who, reason)
    return records


def unyank(storage: Storage, target: Target, *, who: str,
           reach: Reach | None = None) -> list[Record]:
    """List every file ``target`` names as installable again."""
    records = find(storage, target, reach=reach, who=who)
    for r in records:
        _delete_quietly(storage, yank_key(r.key))
    _done(storage, Action.UNYANK, records, who, "")
    return records


def delete(storage: Storage, target: Target, *, who: str, reason: str = "",
           reach: Reach | None = None) -> list[Record]:
    """Remove every file ``target`` names: the record first, so nothing is listed whose
    bytes are going."""
    records = find(storage, target, reach=reach, who=who)
    for r in records:
        _delete_quietly(storage, r.key)
    bump_generation(storage)  # unlisted now, before the bytes go
    for r in records:
        for key in r.keys():  # every key the publication owns (wheelhouse.index.layout)
            if key != r.key:
                _delete_quietly(storage, key)
    _done(storage, Action.DELETE, records, who, reason)
    return records


def _delete_quietly(storage: Storage, key: str) -> None:
    try:
        storage.delete(key)
    except FileNotFoundError:
        pass


def _done(storage: Storage, action: Action, records: Iterable[Record], who: str,
          reason: str) -> None:
    audit(storage, action, [r.key for r in records], who=who, reason=reason)
    bump_generation(storage)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def audit(storage: Storage, action: Action, keys: list[str], *, who: str,
          reason: str = "") -> str:
    """Write one audit entry and return its key; keys sort by time."""
    now = datetime.now(UTC)
    at = now.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    key = f"{AUDIT}{now:%Y%m%dT%H%M%S.%f}Z-{uuid.uuid4().hex[:8]}.json"
    entry = {"action": action.value, "records": keys, "by": who, "at": at, "reason": reason,
             "host": socket.gethostname()}
    storage.put_bytes(key, json.dumps(entry, sort_keys=True).encode(), exclusive=True)
    return key


def audit_entries(storage: Storage) -> list[dict[str, object]]:
    """Every audit entry, oldest first."""
    out = []
    for o in sorted(storage.list(AUDIT), key=lambda o: o.key):
        try:
            out.append(json.loads(storage.get_bytes(o.key)))
        except (FileNotFoundError, ValueError):
            continue
    return out


def operator() -> str:
    """Who runs a CLI command: the user on this host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()} (cli)"
