"""Build on miss (a policy, off by default): the index notices which Python is asking.

uv's and pip's User-Agent carries JSON with the installer's Python and CPU. When a project page
of a project with a recipe is served and that Python has no wheel of the newest version on it,
the build is enqueued (the spec's job id deduplicates it; a Redis key rate-limits repeats) and
the page is still answered at once. Errors here never fail the page.
"""

from __future__ import annotations

import json
import logging

from packaging.utils import NormalizedName
from packaging.version import Version
from redis.exceptions import RedisError

from web.services import Services
from wheelhouse import keys
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.builds.submission import submit
from wheelhouse.errors import WheelhouseError
from wheelhouse.index.catalog import Record
from wheelhouse.variants import Variant

log = logging.getLogger(__name__)
#: One build-on-miss attempt per spec at most this often.
RATE_SECONDS = 600


def installer_python(user_agent: str) -> tuple[str, str] | None:
    """(``3.11``, ``x86_64``) from a uv or pip User-Agent, or None."""
    _, _, data = user_agent.partition(" ")
    if not data.startswith("{") or len(data) > 4096:
        return None
    try:
        info = json.loads(data)
        version = Version(str(info["python"]))
        cpu = str(info.get("cpu") or "x86_64")
    except (ValueError, KeyError, TypeError):
        return None
    return f"{version.major}.{version.minor}", cpu


def maybe_build(svc: Services, variant: Variant, project: NormalizedName,
                files: list[Record], user_agent: str) -> str | None:
    """Enqueue the newest version for the installer's Python if it has no wheel; the job id."""
    if svc.redis is None or not files:
        return None
    asked = installer_python(user_agent)
    if asked is None:
        return None
    python, cpu = asked
    newest = max(Version(r.version) for r in files).public
    try:
        # The spec says which wheel this installer needs; its tags_match is the one rule.
        spec = BuildSpec.create(project, newest, python=python, torch=variant.torch,
                                cuda=variant.cuda, archs=variant.archs,
                                cxx11abi=variant.cxx11abi, machine=cpu)
        if any(spec.served_by(r.filename) for r in files):
            return None
        if project not in svc.recipes:
            return None
        if not svc.redis.set(keys.onmiss(spec.job_id), "1", nx=True, ex=RATE_SECONDS):
            return None
        # As any other build: the fleet asked, the operator's deadline (no torch check, no
        # requester: nobody asked for it).
        [job] = submit(svc.redis, svc.catalog, svc.config, [spec])
    except (WheelhouseError, RedisError) as exc:
        log.info("build on miss for %s %s (Python %s) not enqueued: %s", project, newest,
                 python, exc)
        return None
    if job.created:
        log.info("build on miss: enqueued %s", job.job_id)
    return job.job_id
