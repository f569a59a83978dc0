"""Which projects this index owns, so that it never shadows them with a stranger's upstream
package, and never hides an upstream project behind a root that happens not to hold it.

A root that lists no file of a project answers one of two ways:

- **404, never upstream**, for a project this index owns: one with a recipe here, one the
  operator pins (``WHEELHOUSE_PRIVATE_PROJECTS``, globs allowed), and one published here that
  was not found on its upstream index when it was published. Sending such a name upstream
  would hand installers whatever a stranger registered under it (dependency confusion), or an
  sdist to compile.
- **a redirect upstream** for every other project, including one published here into other
  roots whose upstream lists it too (``iniconfig`` uploaded into one root must not make
  ``pytest`` uninstallable from the others).

What publishing found is remembered in storage: ``upstream/<project>`` says "its upstream
index listed it when it was published" (:func:`check_upstream`). A project published here
without that marker (published before this check existed, or while the upstream could not
be asked, or with routing off) counts as owned: the safe side.

**Owners and stickiness.** Who may publish a project is its owner record, ``owners/<project>``
(:class:`Owners`), written once by its first publisher (:func:`admit`): an upload token's
name, or :data:`FLEET` for recipe projects and builds. Only an owner, or an admin token,
publishes a new file of it afterwards; admins grant, revoke and transfer with
``wheelhouse projects`` (audited). The upstream is asked once, when the record is written: a
project it did not list then gets ``private/<project>`` and stays this index's own, never
sent upstream from any root, until an admin releases it (:func:`release`). Nothing later
(a publish, an outsider registering the name upstream) re-asks: an owned name never flips.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from packaging.utils import NormalizedName, canonicalize_name

from wheelhouse.builds.spec import check_sdist_filename
from wheelhouse.config import Config
from wheelhouse.errors import NotOwner, StorageError, UpstreamUnavailable
from wheelhouse.index.layout import OWNERS, RECORDS, owner_key, private_key, upstream_key
from wheelhouse.index.storage import Storage
from wheelhouse.index.tokens import TokenInfo
from wheelhouse.index.upstream import Router, fetch_project
from wheelhouse.variants import Variant

log = logging.getLogger(__name__)

#: Seconds publishing waits for the upstream's answer; no answer counts as "not listed".
CHECK_TIMEOUT = 5.0


def pinned(config: Config, project: NormalizedName) -> bool:
    """Whether the operator pins ``project`` as private (``WHEELHOUSE_PRIVATE_PROJECTS``)."""
    patterns = [p.strip().lower() for p in config.private_projects.split(",") if p.strip()]
    return any(fnmatch.fnmatchcase(project, p) for p in patterns)


def check_upstream(storage: Storage, config: Config, project: NormalizedName,
                   variant: Variant | None) -> bool:
    """At a project's first publication: whether ``project``'s upstream (as routed from
    ``variant``) lists it; when it does, remember so in storage. Asked once per project: a
    marker already there is kept, and a project kept private is never asked about again."""
    key = upstream_key(project)
    if storage.exists(key):
        return True
    if pinned(config, project) or storage.exists(private_key(project)):
        return False
    router = Router(config.upstream, config.upstream_routes)
    root = router.default if variant is None else router.root_for(project, variant)
    if root is None:
        return False
    try:
        page = fetch_project(root, project, timeout=CHECK_TIMEOUT)
    except UpstreamUnavailable as exc:
        log.warning("could not ask %s whether it lists %s (%s): %s stays private to this "
                    "index", root, project, exc, project)
        return False
    if not page.files:
        return False
    try:
        storage.put_bytes(key, json.dumps({"index": root, "checked_at": time.time()}).encode())
    except StorageError as exc:
        # A publisher whose credentials may write only wheels, records and claims (deploy/s3):
        # the project stays private, the safe side.
        log.warning("could not remember that %s lists %s: %s", root, project, exc)
        return False
    return True


#: The owner name of the build fleet (recipe projects, and what builds publish). No token can
#: be called this: token names start with a letter or digit.
FLEET = ":fleet"


@dataclass(frozen=True)
class Publisher:
    """Who publishes: a token (its name, whether it is an admin, the projects it is limited
    to) or :data:`FLEET`."""

    name: str
    admin: bool = False
    projects: tuple[str, ...] = ()
    """Normalised names the token may publish; empty: any it owns."""

    def __str__(self) -> str:
        return "the build fleet" if self.name == FLEET else f"token {self.name!r}"

    @classmethod
    def of(cls, info: TokenInfo) -> Publisher:
        """The token ``info`` as a publisher (an upload, or the build of an uploaded sdist)."""
        return cls(info.name, admin=info.allows("admin"), projects=info.projects)


@dataclass(frozen=True)
class Owners:
    """The content of ``owners/<project>``: who may publish new files of the project."""

    project: NormalizedName
    owners: tuple[str, ...]
    private: bool
    """Its upstream did not list it when it was first published here."""
    created_at: float
    history: tuple[dict[str, Any], ...] = field(default=())
    """Every change: ``{"at", "by", "action", "owners"}``."""

    def to_json(self) -> bytes:
        return json.dumps({"project": self.project, "owners": list(self.owners),
                           "private": self.private, "created_at": self.created_at,
                           "history": list(self.history)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Owners:
        data = json.loads(raw)
        owners = data["owners"]
        if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
            raise ValueError("owners is not a list of names")
        history = data.get("history") or []
        return cls(project=canonicalize_name(str(data["project"])), owners=tuple(owners),
                   private=bool(data.get("private", False)),
                   created_at=float(data.get("created_at", 0.0)),
                   history=tuple(h for h in history if isinstance(h, dict)))

    def changed(self, action: str, by: str, owners: tuple[str, ...]) -> Owners:
        entry = {"at": time.time(), "by": by, "action": action, "owners": list(owners)}
        return replace(self, owners=owners, history=(*self.history, entry))


def read_owners(storage: Storage, project: NormalizedName) -> tuple[Owners, str] | None:
    """The owner record of ``project`` and its version's tag; None when it has none. A
    record that does not parse counts as owned by nobody but admins (the safe side)."""
    try:
        tagged = storage.read_tagged(owner_key(project))
    except FileNotFoundError:
        return None
    try:
        return Owners.from_json(tagged.data), tagged.tag
    except (ValueError, KeyError, TypeError):
        log.warning("the owner record of %s does not parse: only admins publish it", project)
        return Owners(project, (), True, 0.0), tagged.tag


def _published_here(storage: Storage, project: NormalizedName) -> bool:
    """Whether any root holds a record of ``project``: asked once per project, at its first
    claim."""
    return any(o.key.removeprefix(RECORDS).split("/")[1:2] == [project]
               for o in storage.list(RECORDS))


def admit(storage: Storage, config: Config, project: NormalizedName, publisher: Publisher,
          variant: Variant | None, *, recipe: bool, claim: bool = True) -> Owners:
    """Before anything of a new file is stored: refuse (:class:`NotOwner`) a publisher that
    may not publish ``project``; the first publisher of a project becomes its owner.

    ``recipe``: the project has a recipe here, so the fleet owns it until an admin grants an
    uploader. A project published before owner records existed is claimed only by the fleet or
    an admin (an uploader is told to ask one). The upstream is asked here, once: see the
    module's docstring (``variant`` None: the default upstream's answer). Without ``claim`` an
    unowned project is refused too: only owners and admins pass."""
    if publisher.projects and project not in publisher.projects:
        raise NotOwner(f"{publisher} may publish only {', '.join(publisher.projects)}, "
                       f"not {project}")
    for _ in range(3):  # a record written concurrently: read it and decide again
        found = read_owners(storage, project)
        if found is not None:
            record = found[0]
            if publisher.admin or publisher.name in record.owners:
                return record
            raise NotOwner(_not_owner(project, publisher, record))
        if not claim and not publisher.admin:
            raise NotOwner(f"{project} has no owner here, and {publisher} may not become it "
                           "this way: an admin grants it (`wheelhouse projects grant "
                           f"{project} {publisher.name}`)")
        if recipe and not publisher.admin and publisher.name != FLEET:
            raise NotOwner(f"{project} has a recipe here: only its builds publish it, unless an "
                           f"admin grants {publisher} (`wheelhouse projects grant {project} "
                           f"{publisher.name}`)")
        legacy = _published_here(storage, project)
        if legacy and not publisher.admin and publisher.name != FLEET:
            raise NotOwner(f"{project} was published here before projects had owners: an admin "
                           f"grants it to {publisher} with `wheelhouse projects grant "
                           f"{project} {publisher.name}`")
        if legacy:
            public = storage.exists(upstream_key(project))
        else:
            public = check_upstream(storage, config, project, variant)
        record = Owners(project, (publisher.name,), not public, time.time()).changed(
            "claim", publisher.name, (publisher.name,))
        if record.private:
            storage.put_bytes(private_key(project), b"{}")
        try:
            storage.put_bytes(owner_key(project), record.to_json(), exclusive=True)
        except FileExistsError:
            continue
        log.info("%s owns %s now (%s)", publisher, project,
                 "private to this index" if record.private else "its upstream lists it")
        return record
    raise NotOwner(f"the owner record of {project} keeps changing; try again")


def _not_owner(project: NormalizedName, publisher: Publisher, record: Owners) -> str:
    owners = ", ".join("the build fleet" if o == FLEET else o for o in record.owners)
    return (f"{project} is owned here by {owners or 'nobody (admins only)'}: {publisher} may "
            f"not publish it; an admin can grant it (`wheelhouse projects grant {project} "
            f"{publisher.name}`)")


def change_owners(storage: Storage, project: NormalizedName, action: str, names: tuple[str, ...],
                  *, by: str) -> Owners:
    """An admin's change to who owns ``project``: ``grant`` adds ``names``, ``revoke`` removes
    them, ``transfer`` makes them the only owners. A project without a record gets one (kept
    private: what was never asked stays on the safe side)."""
    if action not in ("grant", "revoke", "transfer"):
        raise ValueError(f"unknown ownership change {action!r}")
    for _ in range(3):
        found = read_owners(storage, project)
        if found is None:
            current = Owners(project, (), not storage.exists(upstream_key(project)), time.time())
        else:
            current = found[0]
        if action == "grant":
            owners = tuple(dict.fromkeys((*current.owners, *names)))
        elif action == "revoke":
            owners = tuple(o for o in current.owners if o not in names)
        else:
            owners = tuple(dict.fromkeys(names))
        new = current.changed(action, by, owners)
        try:
            if found is None:
                if new.private:
                    storage.put_bytes(private_key(project), b"{}")
                storage.put_bytes(owner_key(project), new.to_json(), exclusive=True)
            else:
                storage.replace_bytes(owner_key(project), new.to_json(), tag=found[1])
        except (FileExistsError, FileNotFoundError):
            continue
        return new
    raise NotOwner(f"the owner record of {project} keeps changing; try again")


def release(storage: Storage, config: Config, project: NormalizedName,
            variant: Variant) -> bool:
    """An admin's release of ``project``: its owner record and private marker go, and its
    upstream is asked again (True: the upstream lists it, so roots without it send
    installers there). Its next publisher becomes its owner anew."""
    storage.delete(owner_key(project))
    storage.delete(private_key(project))
    return check_upstream(storage, config, project, variant)


def owned_projects(storage: Storage) -> list[Owners]:
    """Every owner record, by project (records that don't parse are left out)."""
    out = []
    for o in storage.list(OWNERS):
        name = canonicalize_name(o.key.rpartition("/")[2])
        found = read_owners(storage, name)
        if found is not None:
            out.append(found[0])
    return sorted(out, key=lambda r: r.project)


def admit_source(storage: Storage, config: Config, filename: str, sha256: str,
                 publisher: Publisher, *, recipe: bool) -> None:
    """Before an uploaded sdist is stored or built (``wheelhouse request PATH``): refuse one
    that would publish a release under a name and version it has no right to.

    A release its upstream has must be byte-identical to the upstream's sdist (sha256 from the
    upstream's page): else anyone with a build token would publish their own code as that
    release for everyone. Another version of a project the upstream has is built only for the
    project's owners here; a project the upstream doesn't have, only for its owners (its first
    requester becomes one, as its first publisher would: :func:`admit`). The upstream not
    answering refuses the upload (:class:`UpstreamUnavailable`, a 503): never built unchecked.
    """
    project, version = check_sdist_filename(filename)
    listed = False
    if config.upstream != "off" and not pinned(config, project):
        page = fetch_project(config.upstream, project, timeout=CHECK_TIMEOUT)
        listed = bool(page.files)
        same = [f for f in page.sdists if f.version == version]
        if any(f.sha256 == sha256 for f in same):
            return  # the upstream's own bytes: what a build without the file would fetch
        if same:
            raise NotOwner(
                f"{filename} is not the sdist of {project} {version} that {config.upstream} "
                f"publishes (its sha256 is {same[0].sha256 or 'not published'}, this one's "
                f"{sha256}): an uploaded sdist of a released version must be byte-identical; "
                "request the build without the file to build the upstream's")
    # Not a release the upstream has: the project's owners' code, built for them only.
    admit(storage, config, project, publisher, None, recipe=recipe, claim=not listed)
