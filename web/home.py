"""The front page: the variants, a copyable install command for each project in each, the URL
snippet, and this version's README and docs."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, metadata
from pathlib import Path
from typing import Any

from flask import Blueprint, Response, render_template, request
from werkzeug.exceptions import NotFound

from web.services import services
from wheelhouse.variants import parse_variant

bp = Blueprint("home", __name__)

# Prints this server's index URL for the torch installed where it runs.
SNIPPET = (
    "python -c \"import torch;v=torch.__version__.split('+')[0].split('.');"
    "print('{base}/torch%s.%s-cu%s/simple' % (v[0], v[1], (torch.version.cuda or '')"
    ".replace('.', '')))\""
)
#: The variant the page's examples use when nothing is published yet.
EXAMPLE_VARIANT = "torch2.8-cu128"


def install_command(index_url: str, project: str) -> str:
    return f"uv pip install --index-url {index_url} {project}"


def variant_command(base: str, project: str, torch: str) -> str:
    """The one command for any GPU: uv picks the build from ``/simple/`` (docs/variants.md)."""
    return (f"uv pip install --preview-features wheel-variants --index-url {base}/simple "
            f'{project} "torch=={torch}.*"')


@bp.get("/")
def index() -> str:
    base = request.host_url.rstrip("/") + request.script_root
    catalog = services().catalog
    rows: list[dict[str, Any]] = []
    for variant in catalog.variants():
        url = f"{base}/{variant.key}/simple"
        projects = catalog.projects(variant)
        # Wheels narrowed to some GPU architectures are not in their base root: a user who
        # takes the base root (the snippet prints it) must learn where they are.
        in_base = set(catalog.projects(variant.base)) if variant.archs else set(projects)
        rows.append({
            "variant": variant, "url": url,
            "commands": [(p, install_command(url, p)) for p in projects],
            "narrow_only": [p for p in projects if p not in in_base],
        })
    example_url = f"{base}/{EXAMPLE_VARIANT}/simple"
    # The plain root's command, for the first project with variant wheels and its newest torch.
    plain = catalog.variant_projects()
    if plain:
        newest = max((r.variant for r in catalog.variant_files(plain[0])), key=lambda v: tuple(
            int(p) for p in v.torch.split(".")))
        one = variant_command(base, plain[0], newest.torch)
    else:
        one = variant_command(base, "PROJECT", parse_variant(EXAMPLE_VARIANT).torch)
    return render_template(
        "home.html", rows=rows, snippet=SNIPPET.format(base=base), base=base,
        one_command=one, plain_projects=plain,
        example_variant=parse_variant(EXAMPLE_VARIANT),
        example=install_command(rows[0]["url"] if rows else example_url,
                                rows[0]["commands"][0][0] if rows else "PROJECT"),
        narrowed=[r for r in rows if r["narrow_only"]])


#: The README beside the packages, in a clone or an editable install.
_SOURCE_README = Path(__file__).resolve().parent.parent / "README.md"


@bp.get("/readme")
def readme() -> Response:
    """This version's README as plain text: the pages link to its sections. It travels with
    every install as the distribution's description; a clone's own file wins (it is newer
    than what an editable install recorded)."""
    if _SOURCE_README.is_file():
        text: object = _SOURCE_README.read_text(encoding="utf-8")
    else:
        try:
            text = metadata("wheelhouse").get_payload()  # type: ignore[attr-defined]
        except PackageNotFoundError:
            text = None
    if not text:
        raise NotFound("this installation carries no README")
    return Response(str(text), mimetype="text/plain")


#: The docs: inside ``web`` once installed (package data, see pyproject), beside the packages
#: in a clone or an editable install.
_DOCS = (Path(__file__).resolve().parent / "docs", _SOURCE_README.parent / "docs")


def _doc_pages() -> dict[str, Path]:
    for directory in _DOCS:
        if directory.is_dir():
            return {p.name: p for p in directory.glob("*.md")}
    return {}


@bp.get("/docs/")
def docs() -> Response:
    """The docs this version carries, one name a line (``/docs/NAME``)."""
    pages = _doc_pages()
    if not pages:
        raise NotFound("this installation carries no docs")
    return Response("".join(f"{name}\n" for name in sorted(pages)), mimetype="text/plain")


@bp.get("/docs/<name>")
def doc(name: str) -> Response:
    """One page of the docs (``docs/NAME`` of the README's links) as plain text."""
    page = _doc_pages().get(name)  # only names listed there: nothing else is reachable
    if page is None:
        raise NotFound(f"no such page of the docs: {name}; /docs/ lists them")
    return Response(page.read_text(encoding="utf-8"), mimetype="text/plain")
