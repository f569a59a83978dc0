"""What an upload must pass before anything of it is stored: the text twine and uv send beside
the file, and the wheel itself, which gets the checks a built wheel gets
(:func:`wheelhouse.wheels.validate_wheel`).

An uploader holds a token, but what it sends is as untrusted as a build's output: the index
serves the wheel, its METADATA (PEP 658) and a page that lists it to every installer. So the
zip must be well formed, its member names stay inside the install tree, RECORD list every
member with a matching hash (a ``.pth`` that RECORD does not list would run in every
interpreter of whoever installs it, unseen by ``pip uninstall``), the one ``.dist-info`` be the
wheel's own, METADATA at most :data:`~wheelhouse.wheels.MAX_METADATA_BYTES` with a
``Requires-Python`` that parses; and no field nor the file name may carry a NUL or other control
character (they end up in logs, records and pages).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from packaging.tags import Tag

from wheelhouse.config import Config
from wheelhouse.errors import InvalidUpload, InvalidWheel
from wheelhouse.wheels import MAX_UNPACKED_BYTES, WheelName, validate_wheel

_MIB = 1024 * 1024
MAX_UPLOAD_INFLATION = 20
"""How many times its size an upload may unpack to (capped at ``MAX_UNPACKED_BYTES``): CUDA
wheels inflate 2-5 times; validation hashes every member, so the cap bounds its work."""
#: Where a field's text may break lines: a description (the README) has paragraphs and tabs.
_LAYOUT = frozenset("\t\n\r")


def _control(text: str, allowed: frozenset[str]) -> int | None:
    """The position of the first control character (C0, DEL, C1) not in ``allowed``."""
    for i, c in enumerate(text):
        if (c < " " or "\x7f" <= c <= "\x9f") and c not in allowed:
            return i
    return None


def check_text(fields: Mapping[str, str], filename: str) -> None:
    """Refuse a NUL or other control character in the file name or any field (name or value;
    tabs and line breaks are allowed in values), before anything is written under that name."""
    at = _control(filename, frozenset())
    if at is not None:
        raise InvalidUpload(f"the file name {filename[:80]!r} holds a control character "
                            f"(at {at}): send the wheel under its own name")
    for key, value in fields.items():
        for what, text, allowed in (("name", key, frozenset[str]()), ("value", value, _LAYOUT)):
            at = _control(text, allowed)
            if at is not None:
                raise InvalidUpload(f"the field {key[:40]!r} holds a control character in its "
                                    f"{what} (at {at}): this index takes none but tabs and "
                                    "line breaks")


def _any_tags(_tags: frozenset[Tag]) -> bool:
    return True  # an upload may be for any platform: its root decides nothing about tags


def check_wheel(path: Path, name: WheelName, config: Config) -> None:
    """The build's checks on an uploaded wheel, as :class:`InvalidUpload` (a 400). Where the
    operator has uploads relabelled, METADATA and ``.dist-info`` need only agree with the file
    name's public version: relabelling rewrites them from these checked contents."""
    cap = min(MAX_UNPACKED_BYTES, config.upload_max_mib * _MIB * MAX_UPLOAD_INFLATION)
    try:
        validate_wheel(path, name.project, name.version, _any_tags, max_unpacked_bytes=cap,
                       relabelling=config.upload_relabel)
    except InvalidWheel as exc:
        raise InvalidUpload(str(exc)) from None


def check_upload(fields: Mapping[str, str], path: Path, name: WheelName,
                 config: Config) -> None:
    """Everything above, for the upload stored at ``path`` and parsed as ``name``."""
    check_text(fields, path.name)
    check_wheel(path, name, config)
