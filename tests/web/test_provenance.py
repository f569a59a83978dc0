"""PEP 740 served: ``<file>.provenance`` beside each file, ``data-provenance`` and the JSON
``provenance`` key agreeing on it, the fleet CA at ``/api/provenance/ca.pem``, and uploads
attested by the index (a client's own attestations verified against the fleet CA, or refused)."""

from __future__ import annotations

import hashlib
import io
import json
import re
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from flask import Flask
from flask.testing import FlaskClient
from redis import Redis

from tests.helpers import make_wheel
from tests.web.buildhelpers import bearer, make_app, token
from web.services import services
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.index.layout import Record
from wheelhouse.index.publish import publish
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import sha256_file

V = parse_variant("torch2.14-cu130")
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}


def _app(redis_url: str, tmp_path: Path) -> Flask:
    return make_app(redis_url, tmp_path, workspace=str(tmp_path / "ws"))


def _upload(client: FlaskClient, tok: str, wheel: Path,
            attestations: list[attest.Attestation] | None = None) -> tuple[int, str]:
    data: dict[str, object] = {
        ":action": "file_upload", "name": "demo", "version": "1.0",
        "sha256_digest": sha256_file(wheel),
        "content": (io.BytesIO(wheel.read_bytes()), wheel.name)}
    if attestations is not None:
        data["attestations"] = json.dumps([a.to_dict() for a in attestations])
    resp = client.post(f"/{V.key}/legacy/", data=data, headers=bearer(tok),
                       content_type="multipart/form-data")
    return resp.status_code, resp.text


def _listed(client: FlaskClient, filename: str) -> tuple[str | None, str | None]:
    """The provenance URL of ``filename`` on the JSON page and on the HTML page."""
    page = f"/{V.key}/simple/demo/"
    entry = next(f for f in client.get(page, headers=JSON).json["files"]  # type: ignore[index]
                 if f["filename"] == filename)
    html = client.get(page, headers={"Accept": "text/html"}).text
    link = next(line for line in html.splitlines() if f">{filename}<" in line)
    attr = re.search(r'data-provenance="([^"]*)"', link)
    return entry["provenance"], attr.group(1) if attr else None


def _ca(client: FlaskClient) -> x509.Certificate:
    resp = client.get("/api/provenance/ca.pem")
    assert resp.status_code == 200 and resp.mimetype == "application/x-pem-file"
    return x509.load_pem_x509_certificate(resp.data)


def _client_attestation(identity: ca.Identity, wheel: Path) -> attest.Attestation:
    return attest.sign(identity, wheel.name, sha256_file(wheel), predicates.PUBLISH,
                       predicates.publish(publisher="ci", index="ci",
                                          when=datetime.now(UTC)))


def test_an_upload_is_attested_by_the_index_and_both_pages_agree(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    client = app.test_client()
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    status, text = _upload(client, token(conn, "uploader", ("upload",)), wheel)
    assert status == 200, text
    json_url, html_url = _listed(client, wheel.name)
    assert json_url is not None and json_url == html_url
    assert json_url.startswith("http://localhost/")  # fully qualified (PEP 740)
    served = client.get(json_url)
    assert served.status_code == 200 and served.mimetype == "application/json"
    assert served.headers["ETag"] == f'"{hashlib.sha256(served.data).hexdigest()}"'
    (verified,) = attest.verify_document(served.data, _ca(client), wheel.name,
                                         sha256_file(wheel))
    assert verified.signer == "index"
    assert verified.predicate_type == predicates.PUBLISH
    assert verified.predicate["publisher"] == "uploader"
    with app.app_context():
        storage = services().storage
    rkey = next(o.key for o in storage.list("records/"))
    record = Record.from_json(storage.get_bytes(rkey))
    assert storage.get_bytes(record.provenance_key) == served.data


def test_a_client_attestation_signed_by_another_ca_is_refused(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    client = app.test_client()
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    stranger = ca.issue(ca.init_ca(tmp_path / "other", "not the fleet"), "ci")
    status, text = _upload(client, token(conn, "uploader", ("upload",)), wheel,
                           [_client_attestation(stranger, wheel)])
    assert status == 400
    assert "not issued by the fleet CA" in text
    with app.app_context():
        assert list(services().storage.list("records/")) == []
        assert list(services().storage.list("wheels/")) == []


def test_a_client_attestation_of_the_fleet_is_served_beside_the_index_one(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    client = app.test_client()
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    fleet_ca = _ca(client)  # made on first use, in the workspace
    ci = ca.local_identity(tmp_path / "ws" / ca.WORKSPACE_DIR, "ci")
    assert ci.cert.issuer == fleet_ca.subject
    status, text = _upload(client, token(conn, "uploader", ("upload",)), wheel,
                           [_client_attestation(ci, wheel)])
    assert status == 200, text
    json_url, _ = _listed(client, wheel.name)
    assert json_url is not None
    raw = client.get(json_url).data
    signers = [v.signer for v in attest.verify_document(raw, fleet_ca, wheel.name,
                                                         sha256_file(wheel))]
    assert signers == ["ci", "index"]
    kinds = [b["publisher"]["kind"] for b in json.loads(raw)["attestation_bundles"]]
    assert kinds == ["client", "wheelhouse-index"]


def test_an_attestation_of_other_bytes_is_refused(redis_url: str, conn: Redis,
                                                  tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    client = app.test_client()
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    other = make_wheel(tmp_path / "o", "demo", f"1.0+{V.local_label}", payload=b"x")
    _ca(client)
    ci = ca.local_identity(tmp_path / "ws" / ca.WORKSPACE_DIR, "ci")
    status, text = _upload(client, token(conn, "uploader", ("upload",)), wheel,
                           [_client_attestation(ci, other)])
    assert status == 400 and "with sha256" in text


def test_a_wheel_published_without_provenance_lists_none(redis_url: str, tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    with app.app_context():
        storage = services().storage
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    record = publish(storage, wheel, V)
    client = app.test_client()
    assert _listed(client, wheel.name) == (None, None)
    url = f"/files/{V.key}/demo/{wheel.name}.provenance"
    assert client.get(url).status_code == 404
    assert not storage.exists(record.provenance_key)


def test_a_damaged_provenance_document_is_not_served(redis_url: str, conn: Redis,
                                                     tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    client = app.test_client()
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    assert _upload(client, token(conn, "uploader", ("upload",)), wheel)[0] == 200
    with app.app_context():
        storage = services().storage
    key = next(o.key for o in storage.list("wheels/") if o.key.endswith(".provenance"))
    # Even a change outside what is signed (a bundle's publisher: PEP 740 does not sign it).
    storage.put_bytes(key, storage.get_bytes(key).replace(b"wheelhouse-index", b"someone"))
    json_url, _ = _listed(client, wheel.name)
    assert json_url is not None
    assert client.get(json_url).status_code == 503


def test_the_project_page_says_who_built_what_from_what(redis_url: str, conn: Redis,
                                                        tmp_path: Path) -> None:
    app = _app(redis_url, tmp_path)
    client = app.test_client()
    with app.app_context():
        storage = services().storage
        config = services().config
    identity = ca.signer_for(config, "worker")
    facts = BuildFacts(build_id="b-9", host="gpu-box", toolkit="V13.0.48",
                       torch="2.14.1+cu130", sdist_url="https://files.example/demo-2.0.tar.gz",
                       sdist_sha256="ef" * 32)

    def sign(filename: str, sha256: str) -> bytes:
        predicate = predicates.build(project="demo", version="2.0", python="3.12",
                                     machine="x86_64", variant=V, archs=None, facts=facts,
                                     signer=identity.name, finished=datetime.now(UTC))
        return attest.document([attest.Bundle({}, (attest.sign(
            identity, filename, sha256, predicates.SLSA_PROVENANCE, predicate),))])

    uploaded = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    assert _upload(client, token(conn, "uploader", ("upload",)), uploaded)[0] == 200
    built = make_wheel(tmp_path / "b", "demo", f"2.0+{V.local_label}")
    record = publish(storage, built, V, build=facts, sign=sign)
    page = client.get("/projects/demo").text
    row = next(line for line in page.split("<tr>") if built.name in line)
    assert "built on gpu-box (build <code>b-9</code>) from" in row
    assert "https://files.example/demo-2.0.tar.gz" in row and "nvcc V13.0.48" in row
    link = re.search(r'<a href="([^"]+)">signed provenance</a>', row)
    assert link is not None
    assert attest.digest(client.get(link.group(1)).data) == record.provenance_sha256
    upload_row = next(line for line in page.split("<tr>") if uploaded.name in line)
    assert "uploaded" in upload_row and "signed provenance" in upload_row


def test_an_index_that_cannot_sign_refuses_uploads_with_503(redis_url: str, conn: Redis,
                                                            tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_bytes(b"")
    app = make_app(redis_url, tmp_path, workspace=str(tmp_path / "not-a-dir"))
    client = app.test_client()
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    status, text = _upload(client, token(conn, "uploader", ("upload",)), wheel)
    assert status == 503 and "provenance can't be signed" in text
    assert client.get("/api/provenance/ca.pem").status_code == 503
    with app.app_context():
        assert list(services().storage.list("records/")) == []
