"""The one reader policy for every shape wheelhouse stores or advertises (records, owner
records, worker adverts, split requests, job metadata): read the fields this release knows,
ignore the ones it doesn't, never refuse a document because a newer writer added a field.

During a rolling upgrade a newer worker writes records and adverts an older web reads: a
reader that raised on an unknown key made such a record "unreadable" (skipped from the index)
and such an advert invisible (409 "no live worker"). Writers still drop optional fields they
don't need (``Record.to_json``), so an older reader sees what it can read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def known_fields(cls: type[Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` without the keys that are no field of the dataclass ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}
