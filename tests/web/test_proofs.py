"""Issue 27 on the pages: with WHEELHOUSE_UNPROVEN_WHEELS=hold the simple index leaves out
wheels without a passing GPU proof; with list the project page says which are proven, and
whether the proof's signature holds. A wheel's proof is served beside it as ``<file>.proof``."""

from __future__ import annotations

import json

from flask import Flask

from web import create_app
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record
from wheelhouse.index.proofs import GpuProof, now, record_proof, sign_proof
from wheelhouse.index.storage import open_storage
from wheelhouse.provenance.ca import signer_for

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


def test_hold_serves_no_held_wheel_by_its_url(app_config: Config,
                                              published: list[Record]) -> None:
    """A link kept from before, or guessed, gets no held wheel either: 404 saying why. Its
    metadata and provenance stay readable, and the wheel is served once a proof passes."""
    client = _app(app_config, "hold").test_client()
    one = published[0]
    url = f"/files/{one.variant.base.key}/{one.project}/{one.filename}"
    held = client.get(url)
    assert held.status_code == 404
    assert f"{one.filename} is held until a GPU proof passes on it" in held.text
    assert client.get(url + ".metadata").status_code == 200
    storage = open_storage(app_config)
    record_proof(storage, one, _proof(one, passed=False))
    assert client.get(url).status_code == 404
    record_proof(storage, one, _proof(one))
    served = client.get(url)
    assert served.status_code == 200 and len(served.data) == one.size
    assert _app(app_config, "list").test_client().get(
        f"/files/{one.variant.base.key}/{one.project}/{published[1].filename}").status_code == 200


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


def test_the_proof_is_served_beside_the_wheel_and_its_signer_shown(
        app_config: Config, published: list[Record]) -> None:
    client = _app(app_config, "list").test_client()
    one, other = published[0], published[1]
    url = f"/files/{one.variant.base.key}/{one.project}/{one.filename}.proof"
    missing = client.get(url)
    assert missing.status_code == 404
    assert f"{one.filename} has no recorded GPU proof" in missing.text
    assert client.get(f"/files/{one.variant.base.key}/{one.project}/nope-1.0-py3-none-any.whl"
                      ".proof").status_code == 404

    storage = open_storage(app_config)
    signed = sign_proof(_proof(one), signer_for(app_config, "prover"))
    record_proof(storage, one, signed)
    record_proof(storage, other, _proof(other, passed=False))  # unsigned, as before attesting
    served = client.get(url)
    assert served.status_code == 200 and served.mimetype == "application/json"
    assert served.headers["Cache-Control"] == "no-cache"  # a later proof replaces it
    assert GpuProof.from_json(served.data) == signed
    assert client.get(url, headers={"If-None-Match": served.headers["ETag"]}).status_code == 304
    page = client.get("/projects/demo-ext").text
    assert "signed by prover" in page and "unsigned" in page
    assert f"{one.filename}.proof" in page

    # Changed in storage after signing: the page does not vouch for it.
    data = json.loads(storage.get_bytes(one.proof_key))
    data["gpu"] = "NVIDIA A100"
    data["proven_at"] = now()
    storage.put_bytes(one.proof_key, json.dumps(data).encode())
    record_proof(storage, other, _proof(other, passed=False))  # a new generation: re-read
    page = client.get("/projects/demo-ext").text
    assert "signature does not verify" in page and "signed by prover" not in page
