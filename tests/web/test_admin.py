"""The project page's Yank/Unyank buttons (an admin's login session, with CSRF), what the
pages and their ETags say at once, and the relabel policy of uploads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from redis import Redis

from tests.helpers import make_wheel
from tests.web.buildhelpers import close_redis, csrf_of, make_app, sign_in, token
from web.services import services
from wheelhouse.config import Config
from wheelhouse.manage import audit_entries
from wheelhouse.ownership import Publisher
from wheelhouse.publish import publish
from wheelhouse.storage import open_storage
from wheelhouse.upload import accept
from wheelhouse.variants import parse_variant

V = parse_variant("torch2.14-cu130")


def test_an_admin_yanks_and_unyanks_from_the_project_page(redis_url: str, tmp_path: Path,
                                                          conn: Redis) -> None:
    app = make_app(redis_url, tmp_path)
    with app.app_context():
        storage = services().storage
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    publish(storage, wheel, V)
    client = app.test_client()
    page = f"/{V.key}/simple/demo/"
    before = client.get(page).headers["ETag"]
    assert "Yank" not in client.get("/projects/demo").text  # signed out: no buttons
    sign_in(client, token(conn, "reader", ("read",)))
    form = client.get("/projects/demo").text
    assert "Sign in with an admin token" in form and ">Yank</button>" not in form
    refused = client.post("/projects/demo/yank", data={
        "filename": wheel.name, "variant": V.key, "csrf_token": csrf_of(form)})
    assert refused.status_code == 403
    client.post("/logout", data={"csrf_token": csrf_of(form)})
    sign_in(client, token(conn, "ops", ("admin",)))
    form = client.get("/projects/demo").text
    assert ">Yank</button>" in form
    done = client.post("/projects/demo/yank", data={
        "filename": wheel.name, "variant": V.key, "reason": "bad build",
        "csrf_token": csrf_of(form)})
    assert done.status_code == 303
    assert "yanked: bad build" in client.get("/projects/demo").text
    yanked = client.get(page)
    assert 'data-yanked="bad build"' in yanked.text and yanked.headers["ETag"] != before
    assert client.get(page, headers={"If-None-Match": before}).status_code == 200
    form = client.get("/projects/demo").text
    client.post("/projects/demo/yank", data={"filename": wheel.name, "variant": V.key,
                                             "undo": "1", "csrf_token": csrf_of(form)})
    assert "data-yanked" not in client.get(page).text
    assert [e["by"] for e in audit_entries(storage)] == ["token ops", "token ops"]
    # Without the form's CSRF token nothing changes.
    assert client.post("/projects/demo/yank", data={"filename": wheel.name}).status_code == 400
    close_redis(app)


def test_an_admin_deletes_from_the_project_page_only_when_confirmed(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    app = make_app(redis_url, tmp_path)
    with app.app_context():
        storage = services().storage
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    record = publish(storage, wheel, V)
    client = app.test_client()
    sign_in(client, token(conn, "ops", ("admin",)))
    form = client.get("/projects/demo").text
    assert ">Delete</button>" in form
    fields = {"filename": wheel.name, "variant": V.key, "csrf_token": csrf_of(form)}
    unconfirmed = client.post("/projects/demo/delete", data=fields)
    assert unconfirmed.status_code == 400 and "confirm" in unconfirmed.text
    assert storage.exists(record.wheel_key)
    done = client.post("/projects/demo/delete", data={**fields, "confirm": wheel.name})
    assert done.status_code == 303
    assert not storage.exists(record.key) and not storage.exists(record.wheel_key)
    assert client.get(f"/{V.key}/simple/demo/").status_code == 404
    assert [(e["action"], e["by"]) for e in audit_entries(storage)] == [("delete", "token ops")]
    close_redis(app)


def test_uploads_are_relabelled_when_the_operator_says_so(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "ws"),
                    upstream="off", upload_relabel=True)
    wheel = make_wheel(tmp_path, "plain", "1.0")
    fields = {":action": "file_upload", "name": "plain", "version": "1.0",
              "sha256_digest": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    record = accept(open_storage(config), config, V, fields, wheel,
                    publisher=Publisher("test"))
    assert record.version == f"1.0+{V.local_label}"
    assert record.filename == f"plain-1.0+{V.local_label}-py3-none-any.whl"
