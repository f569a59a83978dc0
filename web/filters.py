"""What every template may use: the ``duration`` and ``bytes`` filters, and ``build_queue``
(whether this server has a build queue)."""

from __future__ import annotations

from typing import Any

from flask import Flask

from web.services import services


def init_app(app: Flask) -> None:
    app.add_template_filter(duration, "duration")
    app.add_template_filter(human_bytes, "bytes")
    app.context_processor(_build_queue)


def _build_queue() -> dict[str, Any]:
    """Whether this server has a build queue: without one, nobody can sign in or request."""
    return {"build_queue": services().redis is not None}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"
