"""Issue 27 on the pages: with WHEELHOUSE_UNPROVEN_WHEELS=hold the simple index leaves out
wheels without a passing GPU proof; with list the project page says which are proven."""

from __future__ import annotations

from flask import Flask

from web import create_app
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record
from wheelhouse.index.proofs import GpuProof, record_proof
from wheelhouse.index.storage import open_storage

ROOT = "/torch2.8-cu128/simple/demo-ext/"
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}


def _app(config: Config, policy: str) -> Flask:
    app = create_app(config.replace(unproven_wheels=policy))
    app.testing = True
    return app


def _proof(r: Record, passed: bool = True) -> GpuProof:
    return GpuProof(filename=r.filename, sha256=r.sha256, proven=True, passed=passed,
                    gpu="NVIDIA H100 80GB HBM3", capability="90")


def test_hold_leaves_unproven_wheels_out_until_a_proof_passes(
        app_config: Config, published: list[Record]) -> None:
    client = _app(app_config, "hold").test_client()
    one = published[0]
    html, data = client.get(ROOT).text, client.get(ROOT, headers=JSON).get_json()
    assert one.filename not in html and data["files"] == []
    storage = open_storage(app_config)
    record_proof(storage, one, _proof(one, passed=False))  # a failed proof holds it too
    assert one.filename not in client.get(ROOT).text
    record_proof(storage, one, _proof(one))
    assert one.filename in client.get(ROOT).text
    files = client.get(ROOT, headers=JSON).get_json()["files"]
    assert [f["filename"] for f in files] == [one.filename]


def test_list_marks_the_project_page(app_config: Config, published: list[Record]) -> None:
    client = _app(app_config, "list").test_client()
    assert published[0].filename in client.get(ROOT).text
    assert "not proven on a GPU" in client.get("/projects/demo-ext").text
    storage = open_storage(app_config)
    record_proof(storage, published[0], _proof(published[0]))
    record_proof(storage, published[1], _proof(published[1], passed=False))
    page = client.get("/projects/demo-ext").text
    assert "proven on NVIDIA H100 80GB HBM3 (sm_90)" in page
    assert "failed on NVIDIA H100 80GB HBM3 (sm_90)" in page
