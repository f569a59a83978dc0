"""The JSON build API against a real Redis: requests, look-ups, logs, cancel, hostile input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from redis import Redis

from tests.helpers import QuietHandler, free_port, make_wheel, serve_http
from tests.web.buildhelpers import GOOD, advertise_worker, bearer, make_app, token
from wheelhouse.builds.queue import BuildState, append_log, get_build
from wheelhouse.builds.responses import (
    BuildsCreated,
    BuildView,
    CancelRequested,
    FleetView,
    LogPage,
    RequestView,
    SourceStored,
    parse_view,
)
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.index.layout import source_key
from wheelhouse.index.publish import publish


@pytest.fixture
def tok(conn: Redis) -> str:
    advertise_worker(conn)
    return token(conn)


def test_request_creates_one_build_per_python_and_finds_them_again(
        queue_client: FlaskClient, tok: str, conn: Redis) -> None:
    body = {**GOOD, "python": ["3.11", "3.12", "cp311"]}
    resp = queue_client.post("/api/builds", json=body, headers=bearer(tok))
    assert resp.status_code == 201, resp.json
    builds = resp.json["builds"]
    assert [b["python"] for b in builds] == ["3.11", "3.12"]  # cp311 is 3.11: deduplicated
    assert all(b["created"] and b["state"] == "queued" for b in builds)
    spec = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8",
                            archs=["90"])
    assert builds[0]["id"] == spec.job_id
    assert builds[0]["variant"] == "torch2.8-cu128-sm90"
    assert builds[0]["url"].endswith(f"/builds/{spec.job_id}")
    status = get_build(conn, spec.job_id)
    assert status is not None and status.state is BuildState.QUEUED

    again = queue_client.post("/api/builds", json=body, headers=bearer(tok))
    assert again.status_code == 200
    assert [b["id"] for b in again.json["builds"]] == [b["id"] for b in builds]
    assert not any(b["created"] for b in again.json["builds"])


def test_torch_and_cuda_are_checked_before_a_build_queues(
        redis_url: str, tmp_path: Path, conn: Redis, tok: str) -> None:
    """Issue 21: a torch version the torch index lacks is refused in one line, nothing queued;
    an index that does not answer is said, and the build queued unchecked."""
    from tests.wheelhouse.builds.test_torchindex import FakeTorchIndex

    with serve_http(FakeTorchIndex) as index:
        client = make_app(redis_url, tmp_path, torch_check=True,
                          torch_index_url=index + "/{cu}").test_client()
        resp = client.post("/api/builds", json={**GOOD, "torch": "2.88"}, headers=bearer(tok))
        assert resp.status_code == 400
        assert resp.json["error"].startswith("torch 2.88 has no build for CUDA 12.8 at http://")
        assert resp.json["error"].endswith("; nearest: 2.9, 2.8")
        assert client.post("/api/builds", json=GOOD, headers=bearer(tok)).status_code == 201
    refused = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.88", cuda="12.8",
                               archs=["90"])
    assert get_build(conn, refused.job_id) is None  # nothing queued
    closed = make_app(redis_url, tmp_path, torch_check=True,
                      torch_index_url=f"http://127.0.0.1:{free_port()}/{{cu}}").test_client()
    resp = closed.post("/api/builds", json={**GOOD, "python": ["3.12"]}, headers=bearer(tok))
    assert resp.status_code == 201
    [warning] = resp.json["warnings"]
    assert "was not checked" in warning and "WHEELHOUSE_TORCH_INDEX_URL" in warning


def test_archs_may_be_omitted_for_the_recipe_default(queue_client: FlaskClient, tok: str) -> None:
    body = {k: v for k, v in GOOD.items() if k != "archs"}
    resp = queue_client.post("/api/builds", json=body, headers=bearer(tok))
    assert resp.status_code == 201
    assert resp.json["builds"][0]["variant"] == "torch2.8-cu128"


def test_a_published_wheel_is_linked_not_rebuilt(
        queue_client: FlaskClient, tok: str, conn: Redis, queue_app: Flask, tmp_path: Path) -> None:
    spec = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8")
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(spec.wheel_version),
                       tag="cp311-cp311-linux_x86_64")
    publish(queue_app.extensions["wheelhouse"].storage, wheel, spec.variant)
    body = {**GOOD, "archs": [], "python": ["3.11"], "split_archs": False}
    resp = queue_client.post("/api/builds", json=body, headers=bearer(tok))
    assert resp.status_code == 200
    [b] = resp.json["builds"]
    assert b["state"] == "built" and not b["created"] and b["wheel"] == wheel.name
    assert get_build(conn, spec.job_id) is None  # nothing was enqueued


def test_any_project_builds_with_the_generic_recipe(queue_client: FlaskClient, tok: str) -> None:
    """No recipe of its own is needed: the README's promise, kept by the API."""
    resp = queue_client.post("/api/builds", json={**GOOD, "project": "Some_CUDA.Ext"},
                             headers=bearer(tok))
    assert resp.status_code == 201, resp.json
    [b] = resp.json["builds"]
    assert b["created"] and b["id"].startswith("build-some-cuda-ext-2_8_3-")


def test_the_operators_allowlist_restricts_projects(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    advertise_worker(conn)
    client = make_app(redis_url, tmp_path, allowed_projects="flash-attn, causal_conv1d"
                      ).test_client()
    tok = token(conn)
    refused = client.post("/api/builds", json={**GOOD, "project": "some-ext"},
                          headers=bearer(tok))
    assert refused.status_code == 400
    assert refused.json["fields"]["project"] == (
        "'some-ext' is not built by this server; it builds causal-conv1d, flash-attn")
    assert not any(k.startswith(b"rq:job:") for k in conn.keys())
    allowed = client.post("/api/builds", json={**GOOD, "project": "Causal-Conv1D"},
                          headers=bearer(tok))
    assert allowed.status_code == 201, allowed.json


def test_unservable_combination_is_a_clear_409(queue_client: FlaskClient, tok: str) -> None:
    resp = queue_client.post("/api/builds", json={**GOOD, "cuda": "13.0"}, headers=bearer(tok))
    assert resp.status_code == 409
    assert "CUDA 13.0" in resp.json["error"] and "12.8" in resp.json["error"]


def test_no_worker_at_all_is_explained(queue_client: FlaskClient, conn: Redis) -> None:
    tok = token(conn)  # no worker advertised
    resp = queue_client.post("/api/builds", json=GOOD, headers=bearer(tok))
    assert resp.status_code == 409
    assert "no build worker is running" in resp.json["error"]


def test_build_status_progress_log_and_cancel(queue_client: FlaskClient, tok: str,
                                              conn: Redis) -> None:
    [b] = queue_client.post("/api/builds", json=GOOD, headers=bearer(tok)).json["builds"]
    job_id = b["id"]
    view = queue_client.get(f"/api/builds/{job_id}").json
    assert view["state"] == "queued" and view["position"] == 0
    assert view["spec"]["project"] == "flash-attn"
    assert view["urls"]["page"] == f"/builds/{job_id}"

    append_log(conn, job_id, [f"[{i}/10] nvcc kernel_{i}.cu" for i in range(1, 4)])
    log = queue_client.get(f"/api/builds/{job_id}/log").json
    assert log["lines"][-1] == "[3/10] nvcc kernel_3.cu" and log["next"] == 3
    append_log(conn, job_id, ["[4/10] nvcc kernel_4.cu"])
    more = queue_client.get(f"/api/builds/{job_id}/log?offset={log['next']}").json
    assert more["lines"] == ["[4/10] nvcc kernel_4.cu"] and more["next"] == 4

    resp = queue_client.post(f"/api/builds/{job_id}/cancel", headers=bearer(tok))
    assert resp.status_code == 200 and resp.json["state"] == "cancelled"
    assert queue_client.get(f"/api/builds/{job_id}").json["state"] == "cancelled"
    again = queue_client.post(f"/api/builds/{job_id}/cancel", headers=bearer(tok))
    assert again.status_code == 409


def test_every_answer_the_api_gives_parses_as_its_type(
        queue_client: FlaskClient, tok: str, conn: Redis) -> None:
    """The CLI reads what this web writes: each real answer through its ``from_json``, and
    back through ``to_json`` to the very JSON that was sent."""
    made = queue_client.post("/api/builds", json=GOOD, headers=bearer(tok))
    created = BuildsCreated.from_json(made.json)
    assert created.to_json() == made.json
    [b] = created.builds
    assert b.created and b.state == "queued" and b.api is not None
    raw = queue_client.get(b.api).json
    view = parse_view(raw)
    assert isinstance(view, BuildView) and view.id == b.id and view.state == "queued"
    assert view.urls is not None and view.to_json() == raw

    append_log(conn, b.id, ["[1/2] nvcc a.cu"])
    raw = queue_client.get(f"/api/builds/{b.id}/log").json
    page = LogPage.from_json(raw)
    assert page == LogPage(lines=("[1/2] nvcc a.cu",), next=1) and page.to_json() == raw
    raw = queue_client.post(f"/api/builds/{b.id}/cancel", headers=bearer(tok)).json
    cancelled = CancelRequested.from_json(raw)
    assert cancelled.state == "cancelled" and cancelled.to_json() == raw

    split = queue_client.post("/api/builds", json={**GOOD, "archs": ["sm80", "sm90"],
                                                   "split_archs": True}, headers=bearer(tok))
    [whole] = BuildsCreated.from_json(split.json).builds
    assert whole.parts is not None and [p.arch for p in whole.parts] == ["80", "90"]
    assert BuildsCreated.from_json(split.json).to_json() == split.json
    raw = queue_client.get(f"/api/builds/{whole.id}").json
    request = parse_view(raw)
    assert isinstance(request, RequestView) and request.to_json() == raw
    assert [p.api for p in request.parts] == [f"/api/builds/{p.id}" for p in whole.parts]
    raw = queue_client.post(f"/api/builds/{whole.id}/cancel", headers=bearer(tok)).json
    cancelled = CancelRequested.from_json(raw)
    # The sm90 part is the one-arch build cancelled above: only sm80 is told to stop.
    assert cancelled.parts == (whole.parts[0].id,)
    assert cancelled.to_json() == raw

    body = b"\x1f\x8b pretend sdist bytes"
    raw = queue_client.put(f"/api/sources/{SDIST}", data=body, headers=bearer(tok)).json
    stored = SourceStored.from_json(raw)
    assert stored == SourceStored(sha256=hashlib.sha256(body).hexdigest(), filename=SDIST,
                                  size=len(body))


def test_unknown_build_is_404(queue_client: FlaskClient, tok: str) -> None:
    assert queue_client.get("/api/builds/build-nope-1").status_code == 404
    assert queue_client.get("/api/builds/bad.id").status_code == 404
    resp = queue_client.post("/api/builds/build-nope-1/cancel", headers=bearer(tok))
    assert resp.status_code == 404


def test_workers_lists_the_fleet(queue_client: FlaskClient, tok: str) -> None:
    data = queue_client.get("/api/workers").json
    assert [w["name"] for w in data["workers"]] == ["gpu-1"]
    assert {"cuda": "12.8", "machine": "x86_64"} in data["servable"]
    assert {"cuda": "12.1", "machine": "x86_64"} in data["servable"]  # older minor of 12.x
    assert {"cuda": "13.0", "machine": "x86_64"} not in data["servable"]
    assert data["unavailable"] == {}
    fleet = FleetView.from_json(data)
    assert fleet.to_json() == data and ("12.8", "x86_64") in fleet.servable


def test_workers_say_why_a_version_is_not_offered(queue_client: FlaskClient, conn: Redis) -> None:
    """Issue 21: a version a worker could not provision is not offered, and the API says why
    (the form: ``test_pages``)."""
    from dataclasses import replace

    from wheelhouse.builds.fleet import advertise

    ad = advertise_worker(conn, name="gpu-2")
    why = "no CUDA 13.0 release at http://mirror/ (no redistrib_13.0.0.json)"
    advertise(conn, replace(ad, unavailable={"13.0": why}), ttl=120)
    data = queue_client.get("/api/workers").json
    assert data["unavailable"] == {"13.0": [f"gpu-2: {why}"]}
    assert [w["unavailable"] for w in data["workers"] if w["name"] == "gpu-2"] == [{"13.0": why}]


def test_without_redis_the_api_says_so(tmp_path: Path) -> None:
    from web import create_app
    from wheelhouse.config import Config

    app = create_app(Config(storage=str(tmp_path / "d")))
    resp = app.test_client().get("/api/workers")
    assert resp.status_code == 503 and "WHEELHOUSE_REDIS_URL" in resp.json["error"]


# -- hostile input: always a JSON 4xx naming the field, never a 500 --

HUGE = "x" * 10_000


@pytest.mark.parametrize(("change", "field"), [
    ({"project": "flash-attn; rm -rf /"}, "project"),
    ({"project": "$(reboot)"}, "project"),
    ({"project": "../../etc/passwd"}, "project"),
    ({"project": HUGE}, "project"),
    ({"project": "-not-a-name-"}, "project"),
    ({"project": "two words"}, "project"),
    ({"project": None}, "project"),
    ({"project": 42}, "project"),
    ({"version": "2.8.3; touch /tmp/pwned"}, "version"),
    ({"version": "`id`"}, "version"),
    ({"version": "../../../x"}, "version"),
    ({"version": "latest"}, "version"),
    ({"version": "2.8.3+cu128torch2.8"}, "version"),
    ({"version": HUGE}, "version"),
    ({"version": ["2.8.3"]}, "version"),
    ({"torch": "2"}, "torch"),
    ({"torch": "nightly && curl evil"}, "torch"),
    ({"cuda": "99.9"}, "cuda"),
    ({"cuda": "12.8 | sh"}, "cuda"),
    ({"cuda": HUGE}, "cuda"),
    ({"python": []}, "python"),
    ({"python": ["2.7"]}, "python"),
    ({"python": ["3.11; id"]}, "python"),
    ({"python": [HUGE]}, "python"),
    ({"python": ["3.11"] * 50}, "python"),
    ({"python": [{"a": 1}]}, "python"),
    ({"archs": ["sm_999"]}, "archs"),
    ({"archs": ["../sm90"]}, "archs"),
    ({"archs": [HUGE]}, "archs"),
    ({"archs": "sm90$(x)"}, "archs"),
    ({"archs": [["nested"]]}, "archs"),
    ({"machine": "riscv64"}, "machine"),
    ({"machine": "x86_64\nrm"}, "machine"),
    ({"surprise": "field"}, "_"),
])
def test_hostile_fields_get_a_json_400_naming_the_field(
        queue_client: FlaskClient, tok: str, conn: Redis, change: dict[str, object],
        field: str) -> None:
    resp = queue_client.post("/api/builds", json={**GOOD, **change}, headers=bearer(tok))
    assert resp.status_code == 400, resp.text
    assert resp.is_json
    assert field in resp.json["fields"]
    assert len(resp.json["error"]) < 2000  # never echoes a 10 kB value back
    assert not any(k.startswith(b"rq:job:") for k in conn.keys())  # nothing enqueued


@pytest.mark.parametrize("body", [
    b"not json", b"[1, 2]", b'"string"', b"null", b"{" * 5000, b'{"project": "\xff\xfe"}',
])
def test_malformed_bodies_are_400(queue_client: FlaskClient, tok: str, body: bytes) -> None:
    resp = queue_client.post("/api/builds", data=body, headers={**bearer(tok),
                                                                "Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.is_json


def test_oversized_body_is_refused(queue_client: FlaskClient, tok: str) -> None:
    resp = queue_client.post("/api/builds", json={**GOOD, "pad": "x" * 100_000},
                             headers=bearer(tok))
    assert resp.status_code == 413 and resp.is_json
    assert "too large" in resp.json["error"].lower() or "exceeds" in resp.json["error"]


@pytest.mark.parametrize("path", [
    "/api/builds/..%2F..%2Fetc%2Fpasswd", "/api/builds/" + "a" * 10_000,
    "/api/builds/x;rm%20-rf/log", "/api/builds/%00/log",
])
def test_hostile_build_ids_are_404(queue_client: FlaskClient, path: str) -> None:
    resp = queue_client.get(path)
    assert resp.status_code == 404 and resp.is_json


@pytest.mark.parametrize("offset", ["-1", "abc", "1e9", "9" * 40])
def test_bad_log_offsets_are_400(queue_client: FlaskClient, offset: str) -> None:
    resp = queue_client.get(f"/api/builds/build-x/log?offset={offset}")
    assert resp.status_code == 400 and resp.is_json


def test_wheelhouse_request_command_against_a_running_server(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess

    from tests.helpers import start_index
    from wheelhouse.config import Config

    advertise_worker(conn)
    tok = token(conn, "cli")
    config = Config(storage=str(tmp_path / "data"), redis_url=redis_url, upstream="off")
    wheelhouse = shutil.which("wheelhouse") or "wheelhouse"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    with start_index(config, tmp_path) as url:
        env |= {"WHEELHOUSE_TOKEN": tok, "WHEELHOUSE_SERVER": url}
        argv = [wheelhouse, "request", "flash-attn==2.8.3", "--torch", "2.8", "--cuda", "12.8",
                "--python", "3.11", "--python", "3.12", "--arch", "sm90"]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        spec = BuildSpec.create("flash-attn", "2.8.3", python="3.12", torch="2.8", cuda="12.8",
                                archs=["90"])
        assert f"{spec.job_id}\tPython 3.12\tcreated, queued\t{url}/builds/{spec.job_id}" in out
        again = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        assert "exists, queued" in again
        bad = subprocess.run([*argv[:3], "--torch", "2.8", "--cuda", "99.1", "--python", "3.11"],
                             env=env, capture_output=True, text=True)
        assert bad.returncode == 1 and "unknown CUDA version '99.1'" in bad.stderr
        denied = subprocess.run(argv, env=env | {"WHEELHOUSE_TOKEN": "whk_nope"},
                                capture_output=True, text=True)
        assert denied.returncode == 1 and "401" in denied.stderr
        assert tok not in url.access_log()


# -- uploaded sdists (issue 21: ``wheelhouse request PATH``) --

SDIST = "vecadd-0.1.0.tar.gz"
VECADD = {**GOOD, "project": "vecadd", "version": "0.1.0"}


def test_an_uploaded_sdist_is_stored_by_sha256_and_a_build_names_it(
        queue_client: FlaskClient, tok: str, queue_app: Flask) -> None:
    body = b"\x1f\x8b pretend sdist bytes"
    sha = hashlib.sha256(body).hexdigest()
    put = queue_client.put(f"/api/sources/{SDIST}", data=body, headers=bearer(tok))
    assert put.status_code == 201, put.json
    assert put.json == {"sha256": sha, "filename": SDIST, "size": len(body)}
    storage = queue_app.extensions["wheelhouse"].storage
    assert storage.get_bytes(source_key(sha, SDIST)) == body
    again = queue_client.put(f"/api/sources/{SDIST}", data=body, headers=bearer(tok))
    assert again.status_code == 200

    made = queue_client.post("/api/builds",
                             json={**VECADD, "source": {"sha256": sha, "filename": SDIST}},
                             headers=bearer(tok))
    assert made.status_code == 201, made.json
    spec = BuildSpec.create("vecadd", "0.1.0", python="3.11", torch="2.8", cuda="12.8",
                            archs=["sm90"], source={"sha256": sha, "filename": SDIST})
    assert made.json["builds"][0]["id"] == spec.job_id
    # The upstream build of the same version is another build.
    assert spec.job_id != BuildSpec.from_dict({**spec.to_dict(), "source": None}).job_id


@pytest.mark.parametrize(("source", "why"), [
    ({"sha256": "0" * 64, "filename": SDIST}, "was uploaded here: PUT it"),
    ({"sha256": "0" * 64, "filename": "vecadd-0.2.0.tar.gz"}, "not an sdist of version 0.1.0"),
    ({"sha256": "0" * 64, "filename": "other-0.1.0.tar.gz"}, "not an sdist of vecadd"),
    ({"sha256": "../../etc", "filename": SDIST}, "64 lowercase hex digits"),
    ({"sha256": "0" * 64, "filename": "../vecadd-0.1.0.tar.gz"}, "is not an sdist file name"),
    ("vecadd-0.1.0.tar.gz", "source must be an object"),
])
def test_a_build_of_a_source_not_uploaded_or_not_its_own_is_refused(
        queue_client: FlaskClient, tok: str, source: object, why: str) -> None:
    resp = queue_client.post("/api/builds", json={**VECADD, "source": source}, headers=bearer(tok))
    assert resp.status_code == 400 and why in resp.json["error"], resp.json


def test_source_uploads_need_a_build_token_a_real_sdist_name_and_stay_under_the_limit(
        redis_url: str, tmp_path: Path, conn: Redis, tok: str) -> None:
    queue_app = make_app(redis_url, tmp_path, sdist_upload_max_mib=1,
                   allowed_projects="vecadd")
    queue_client = queue_app.test_client()
    url = f"/api/sources/{SDIST}"
    assert queue_client.put(url, data=b"x").status_code == 401
    reader = token(conn, "reader", ("read",))
    assert queue_client.put(url, data=b"x", headers=bearer(reader)).status_code == 403
    for name, why in (("notes.txt", "is not an sdist file name"),
                      ("flash_attn-2.8.3.tar.gz", "is not built by this server")):
        resp = queue_client.put(f"/api/sources/{name}", data=b"x", headers=bearer(tok))
        assert resp.status_code == 400 and why in resp.json["error"], resp.json
    empty = queue_client.put(url, data=b"", headers=bearer(tok))
    assert empty.status_code == 400 and "empty" in empty.json["error"]
    big = queue_client.put(url, data=b"x" * (1024 * 1024 + 1), headers=bearer(tok))
    assert big.status_code == 413
    assert "WHEELHOUSE_SDIST_UPLOAD_MAX_MIB=1" in big.json["error"]
    # Just under: the 64 KiB limit of every other route is raised for this one.
    fits = queue_client.put(url, data=b"x" * (1024 * 1024), headers=bearer(tok))
    assert fits.status_code == 201, fits.json


def _sdist_upstream(sdists: dict[str, bytes]) -> type[QuietHandler]:
    """A PEP 691 upstream listing these sdists (file name -> bytes) under their projects."""

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            name = self.path.strip("/").removeprefix("simple/")
            files = [{"filename": f, "url": f"/files/{f}",
                      "hashes": {"sha256": hashlib.sha256(b).hexdigest()}}
                     for f, b in sdists.items() if f.split("-")[0].replace("_", "-") == name]
            if not files:
                self.send_error(404)
                return
            page = {"meta": {"api-version": "1.1"}, "name": name, "files": files}
            self.send_body(json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json")

    return Handler


def test_an_uploaded_sdist_cannot_impersonate_a_release(redis_url: str, conn: Redis,
                                                        tmp_path: Path) -> None:
    """Issue 25, item 8: a build token holder uploads their own bytes under a released name."""
    real = b"\x1f\x8b the real imp-victim 1.0"
    with serve_http(_sdist_upstream({"imp_victim-1.0.tar.gz": real})) as index:
        app = make_app(redis_url, tmp_path, upstream=index + "/simple/",
                       allowed_projects="imp-victim,own-proj")
        client = app.test_client()
        storage = app.extensions["wheelhouse"].storage
        mallory, alice = token(conn, "mallory"), token(conn, "alice")
        fake = b"\x1f\x8b mallory's code"
        for name, body in (("imp_victim-1.0.tar.gz", fake), ("imp_victim-9.9.tar.gz", fake)):
            refused = client.put(f"/api/sources/{name}", data=body, headers=bearer(mallory))
            assert refused.status_code == 403, refused.json
            assert not storage.exists(source_key(hashlib.sha256(body).hexdigest(), name))
        assert "must be byte-identical" in client.put(
            "/api/sources/imp_victim-1.0.tar.gz", data=fake, headers=bearer(mallory)).json["error"]
        # The upstream's own bytes are fine: they are what a build without the file fetches.
        same = client.put("/api/sources/imp_victim-1.0.tar.gz", data=real, headers=bearer(mallory))
        assert same.status_code == 201, same.json
        # A project the upstream doesn't have: its first requester owns it, others are refused,
        # also when they name the stored sdist in a build request.
        mine = b"\x1f\x8b alice's own project"
        first = client.put("/api/sources/own_proj-1.0.tar.gz", data=mine, headers=bearer(alice))
        assert first.status_code == 201, first.json
        other = client.put("/api/sources/own_proj-1.0.tar.gz", data=b"\x1f\x8b x",
                           headers=bearer(mallory))
        assert other.status_code == 403
        ref = {"sha256": hashlib.sha256(mine).hexdigest(), "filename": "own_proj-1.0.tar.gz"}
        build = {**GOOD, "project": "own-proj", "version": "1.0", "source": ref}
        advertise_worker(conn)
        assert client.post("/api/builds", json=build, headers=bearer(mallory)).status_code == 403
        assert client.post("/api/builds", json=build, headers=bearer(alice)).status_code == 201
    # The upstream down: nothing unchecked is stored (503, never built on trust).
    down = make_app(redis_url, tmp_path, upstream=f"http://127.0.0.1:{free_port()}/simple/",
                    allowed_projects="imp-victim").test_client()
    gone = down.put("/api/sources/imp_victim-2.0.tar.gz", data=fake, headers=bearer(alice))
    assert gone.status_code == 503


@pytest.mark.parametrize("split", [False, True])
def test_the_configured_build_timeout_reaches_every_job_the_api_and_form_queue(
        redis_url: str, conn: Redis, tmp_path: Path, split: bool) -> None:
    """Issue 29: WHEELHOUSE_BUILD_TIMEOUT was documented as enforced, but API and form builds
    got the queue's default of four hours."""
    from tests.helpers import build_job
    from tests.web.buildhelpers import sign_in
    from wheelhouse.builds.queue import RQ_TIMEOUT_MARGIN

    advertise_worker(conn)
    client = make_app(redis_url, tmp_path, build_timeout=1234).test_client()
    tok = token(conn)
    body = {**GOOD, "archs": ["sm80", "sm90"], "split_archs": split}
    made = client.post("/api/builds", json=body, headers=bearer(tok))
    assert made.status_code == 201, made.json
    [build] = made.json["builds"]
    ids = [p["id"] for p in build["parts"]] if split else [build["id"]]
    csrf = sign_in(client, tok)
    form = client.post("/request", data={**GOOD, "python": "3.12", "csrf_token": csrf})
    assert form.status_code == 303
    ids.append(form.headers["Location"].rsplit("/", 1)[1])
    for job_id in ids:
        job = build_job(conn, job_id)
        assert job.args[2] == 1234, job_id  # the worker's own deadline
        assert job.timeout == 1234 + RQ_TIMEOUT_MARGIN
