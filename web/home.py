"""The front page: the variants, a copyable install command for each, and the URL snippet."""

from __future__ import annotations

from flask import Blueprint, render_template, request

from web.services import services

bp = Blueprint("home", __name__)

# Prints this server's index URL for the torch installed where it runs.
SNIPPET = (
    "python -c \"import torch;v=torch.__version__.split('+')[0].split('.');"
    "print('{base}/torch%s.%s-cu%s/simple' % (v[0], v[1], (torch.version.cuda or '')"
    ".replace('.', '')))\""
)


@bp.get("/")
def index() -> str:
    base = request.host_url.rstrip("/") + request.script_root
    catalog = services().catalog
    rows = []
    for variant in catalog.variants():
        projects = catalog.projects(variant)
        rows.append({
            "variant": variant,
            "url": f"{base}/{variant.key}/simple",
            "projects": projects,
        })
    return render_template("home.html", rows=rows, snippet=SNIPPET.format(base=base),
                           base=base)
