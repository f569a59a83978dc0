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
"""

from __future__ import annotations

import fnmatch
import json
import logging
import time

from packaging.utils import NormalizedName

from wheelhouse.config import Config
from wheelhouse.errors import StorageError, UpstreamUnavailable
from wheelhouse.layout import upstream_key
from wheelhouse.storage import Storage
from wheelhouse.upstream import Router, fetch_project
from wheelhouse.variants import Variant

log = logging.getLogger(__name__)

#: Seconds publishing waits for the upstream's answer; no answer counts as "not listed".
CHECK_TIMEOUT = 5.0


def pinned(config: Config, project: NormalizedName) -> bool:
    """Whether the operator pins ``project`` as private (``WHEELHOUSE_PRIVATE_PROJECTS``)."""
    patterns = [p.strip().lower() for p in config.private_projects.split(",") if p.strip()]
    return any(fnmatch.fnmatchcase(project, p) for p in patterns)


def check_upstream(storage: Storage, config: Config, project: NormalizedName,
                   variant: Variant) -> bool:
    """At publish: whether ``project``'s upstream (as routed from ``variant``) lists it; when
    it does, remember so in storage. Asked once per project: a marker already there is kept."""
    key = upstream_key(project)
    if storage.exists(key):
        return True
    if pinned(config, project):
        return False
    root = Router(config.upstream, config.upstream_routes).root_for(project, variant)
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
