"""Split requests through the API, the form, the pages and ``wheelhouse request``: one job
per GPU architecture, tied together by one request (real Redis, real storage, real server)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from redis import Redis
from rq import Queue

from tests.helpers import make_wheel, start_index
from tests.web.buildhelpers import GOOD, advertise_worker, bearer, sign_in, token
from wheelhouse.builds.fanout import load_request, part_spec, request_id
from wheelhouse.builds.queue import BuildState, get_build
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.config import Config
from wheelhouse.index.publish import publish

TWO = {**GOOD, "archs": ["sm80", "sm90"]}
#: The request TWO makes for Python 3.11, before it is split.
WHOLE = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8",
                         archs=["80", "90"])
SM80, SM90 = part_spec(WHOLE, "80"), part_spec(WHOLE, "90")


@pytest.fixture
def tok(conn: Redis) -> str:
    advertise_worker(conn)
    return token(conn)


def _queued(conn: Redis) -> list[str]:
    return Queue("build-cu128-x86_64", connection=conn).get_job_ids()


def test_a_two_arch_request_is_two_single_arch_jobs_and_one_request(
        queue_client: FlaskClient, tok: str, conn: Redis) -> None:
    # flash-attn's recipe splits by default; the request says nothing about it.
    resp = queue_client.post("/api/builds", json=TWO, headers=bearer(tok))
    assert resp.status_code == 201, resp.json
    [req] = resp.json["builds"]
    assert req["id"] == request_id(WHOLE) and req["variant"] == "torch2.8-cu128-sm80-sm90"
    assert req["state"] == "queued" and req["url"].endswith(f"/builds/{req['id']}")
    assert [(p["arch"], p["id"], p["variant"], p["created"]) for p in req["parts"]] == [
        ("80", SM80.job_id, "torch2.8-cu128-sm80", True),
        ("90", SM90.job_id, "torch2.8-cu128-sm90", True)]
    assert sorted(_queued(conn)) == sorted([SM80.job_id, SM90.job_id])
    for spec in (SM80, SM90):
        status = get_build(conn, spec.job_id)
        assert status is not None and status.spec is not None and status.spec.archs == spec.archs
    record = load_request(conn, req["id"])
    assert record is not None and [p.job_id for p in record.parts] == [SM80.job_id, SM90.job_id]

    again = queue_client.post("/api/builds", json=TWO, headers=bearer(tok))
    assert again.status_code == 200
    [same] = again.json["builds"]
    assert same["id"] == req["id"] and not any(p["created"] for p in same["parts"])
    assert len(_queued(conn)) == 2  # nothing new

    view = queue_client.get(f"/api/builds/{req['id']}", headers=bearer(tok)).json
    assert view["kind"] == "split" and view["state"] == "queued" and not view["finished"]
    assert [(p["arch"], p["id"], p["state"]) for p in view["parts"]] == [
        ("80", SM80.job_id, "queued"), ("90", SM90.job_id, "queued")]
    assert view["parts"][0]["api"] == f"/api/builds/{SM80.job_id}"

    cancelled = queue_client.post(f"/api/builds/{req['id']}/cancel", headers=bearer(tok))
    assert cancelled.status_code == 200
    assert cancelled.json["parts"] == [SM80.job_id, SM90.job_id]
    assert cancelled.json["state"] == "cancelled"
    assert all(get_build(conn, s.job_id).state is BuildState.CANCELLED  # type: ignore[union-attr]
               for s in (SM80, SM90))
    ended = queue_client.post(f"/api/builds/{req['id']}/cancel", headers=bearer(tok))
    assert ended.status_code == 409 and "already ended" in ended.json["error"]
    assert queue_client.get("/api/builds/split-nope", headers=bearer(tok)).status_code == 404


def test_a_part_already_published_is_not_queued(
        queue_client: FlaskClient, tok: str, conn: Redis, queue_app: Flask,
        tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(SM80.wheel_version),
                       tag="cp311-cp311-linux_x86_64")
    publish(queue_app.extensions["wheelhouse"].storage, wheel, SM80.variant)
    resp = queue_client.post("/api/builds", json=TWO, headers=bearer(tok))
    assert resp.status_code == 201
    [req] = resp.json["builds"]
    sm80, sm90 = req["parts"]
    assert sm80["state"] == "built" and sm80["wheel"] == wheel.name and not sm80["created"]
    assert sm90["state"] == "queued" and sm90["created"]
    assert _queued(conn) == [SM90.job_id] and get_build(conn, SM80.job_id) is None
    view = queue_client.get(f"/api/builds/{req['id']}", headers=bearer(tok)).json
    assert view["state"] == "queued"
    assert view["parts"][0]["state"] == "built" and view["parts"][0]["wheel"] == wheel.name
    assert view["parts"][0]["install"].endswith(
        f"'flash-attn=={SM80.wheel_version}' 'torch==2.8.*'")


@pytest.mark.parametrize(("body", "ids"), [
    # The recipe's default: flash-attn splits, a project without a recipe (generic) does not.
    ({}, "split"),
    ({"project": "my-cuda-ext"}, "one"),
    ({"project": "my-cuda-ext", "split_archs": True}, "split"),
    ({"split_archs": False}, "one"),
    ({"archs": ["sm90"]}, "one"),  # one arch is one job, split or not
    ({"archs": ["sm90"], "split_archs": True}, "one"),
    ({"archs": []}, "four"),  # flash-attn's default archs: 80, 90, 100, 120
])
def test_whether_a_request_splits(queue_client: FlaskClient, tok: str, conn: Redis,
                                  body: dict[str, object], ids: str) -> None:
    resp = queue_client.post("/api/builds", json={**TWO, **body}, headers=bearer(tok))
    assert resp.status_code == 201, resp.json
    [b] = resp.json["builds"]
    if ids == "one":
        assert b["id"].startswith("build-") and "parts" not in b
        assert _queued(conn) == [b["id"]]
    else:
        assert b["id"].startswith("split-")
        archs = [p["arch"] for p in b["parts"]]
        assert archs == (["80", "90"] if ids == "split" else ["80", "90", "100", "120"])
        assert sorted(_queued(conn)) == sorted(p["id"] for p in b["parts"])


@pytest.mark.parametrize("value", ["yes", 1, None, ["x"]])
def test_split_archs_must_be_a_boolean(queue_client: FlaskClient, tok: str, conn: Redis,
                                       value: object) -> None:
    if value is None:  # null is absent: the recipe's default
        resp = queue_client.post("/api/builds", json={**TWO, "split_archs": value},
                                 headers=bearer(tok))
        assert resp.status_code == 201
        return
    resp = queue_client.post("/api/builds", json={**TWO, "split_archs": value},
                             headers=bearer(tok))
    assert resp.status_code == 400
    assert resp.json["fields"]["split_archs"].startswith("split_archs must be true or false")
    assert _queued(conn) == []


def test_the_form_defaults_to_the_recipe_and_the_pages_show_the_parts(
        fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    checkbox = 'name="split_archs" value="1" id="split-archs"'
    assert f"{checkbox} checked" in fleet_client.get("/request?project=flash-attn").text
    assert f"{checkbox}>" in fleet_client.get("/request?project=my-cuda-ext").text
    form = {**TWO, "python": "3.11", "csrf_token": csrf}
    # Unchecked: the hidden 0 alone; one job of both archs.
    resp = fleet_client.post("/request", data={**form, "split_archs": "0"})
    assert resp.status_code == 303
    assert resp.headers["Location"] == f"/builds/{WHOLE.job_id}"
    # Checked: the hidden 0, then the box's 1; the request's page.
    resp = fleet_client.post("/request", data={**form, "split_archs": ["0", "1"]})
    assert resp.status_code == 303
    assert resp.headers["Location"] == f"/builds/{request_id(WHOLE)}"
    page = fleet_client.get(resp.headers["Location"]).text
    assert "one job per architecture: sm80, sm90" in page
    assert f'href="/builds/{SM80.job_id}" class="state queued"' in page
    assert f'href="/builds/{SM90.job_id}" class="state queued"' in page
    assert 'id="cancel-form"' in page
    matrix = fleet_client.get("/matrix").text
    section = matrix[matrix.index('id="split-requests"'):]
    assert f'data-request="{request_id(WHOLE)}" data-state="queued"' in section
    assert f'href="/builds/{SM90.job_id}">sm90 queued</a>' in section

    bad = fleet_client.post("/request", data={**form, "split_archs": "maybe"})
    assert bad.status_code == 400 and "split_archs must be true or false" in bad.text
    cancel = fleet_client.post(f"/builds/{request_id(WHOLE)}/cancel",
                               data={"csrf_token": csrf})
    assert cancel.status_code == 303
    assert all(get_build(conn, s.job_id).state is BuildState.CANCELLED  # type: ignore[union-attr]
               for s in (SM80, SM90))
    assert get_build(conn, WHOLE.job_id).state is BuildState.QUEUED  # type: ignore[union-attr]
    forged = fleet_client.post(f"/builds/{request_id(WHOLE)}/cancel", data={})
    assert forged.status_code == 400
    assert fleet_client.get("/builds/split-nope").status_code == 404


def test_wheelhouse_request_split_archs_against_a_running_server(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    advertise_worker(conn)
    config = Config(storage=str(tmp_path / "data"), redis_url=redis_url, upstream="off",
                    torch_check=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHEELHOUSE_")}
    wheelhouse = shutil.which("wheelhouse") or "wheelhouse"
    with start_index(config, tmp_path, workers=1) as url:
        env |= {"WHEELHOUSE_TOKEN": token(conn, "cli"), "WHEELHOUSE_SERVER": url}
        argv = [wheelhouse, "request", "my-cuda-ext==2.8.3", "--torch", "2.8", "--cuda", "12.8",
                "--python", "3.11", "--arch", "sm80", "--arch", "sm90"]
        whole = BuildSpec.create("my-cuda-ext", "2.8.3", python="3.11", torch="2.8",
                                 cuda="12.8", archs=["80", "90"])
        out = subprocess.run([*argv, "--split-archs"], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert f"{request_id(whole)}\tPython 3.11\tcreated, queued" in out
        assert f"  {part_spec(whole, '90').job_id}\tsm90\tcreated, queued\t" in out
        # The generic recipe's default is one job; --no-split-archs says so explicitly.
        for flag in ((), ("--no-split-archs",)):
            out = subprocess.run([*argv, *flag], env=env, capture_output=True, text=True,
                                 check=True).stdout
            assert out.startswith(f"{whole.job_id}\tPython 3.11\t")
