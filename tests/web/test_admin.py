"""The project page's Yank/Unyank buttons (an admin's login session, with CSRF), what the
pages and their ETags say at once, and the relabel policy of uploads."""

from __future__ import annotations

import hashlib
from pathlib import Path

from flask.testing import FlaskClient
from redis import Redis

from tests.helpers import make_wheel
from tests.web.buildhelpers import bearer, close_redis, csrf_of, make_app, sign_in, token
from web.services import services
from wheelhouse.config import Config
from wheelhouse.index.manage import audit_entries
from wheelhouse.index.ownership import Publisher
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import create_token
from wheelhouse.index.upload import accept
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


SM90 = parse_variant("torch2.14-cu130-sm90")


def _listed(client: FlaskClient, root: str, project: str) -> dict[str, object]:
    resp = client.get(f"/{root}/simple/{project}/",
                      headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    return {f["filename"]: f["yanked"] for f in resp.json["files"]} if resp.json else {}


def test_an_admin_token_limited_to_a_narrowed_root_reaches_its_files_only(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    """A target names files by their base root: a token limited to the sm90 root that names
    the base's file "in sm90" is refused (the file stays listed), by the API and by the
    project page's buttons; its own root's file it yanks, unyanks and deletes."""
    app = make_app(redis_url, tmp_path)
    with app.app_context():
        storage = services().storage
    base = publish(storage, make_wheel(tmp_path / "b", "demo", f"1.0+{V.local_label}"), V)
    narrow = publish(storage, make_wheel(tmp_path / "n", "demo", f"1.0+{SM90.local_label}"),
                     SM90)
    limited = create_token(conn, "sm90-ops", ["admin"], variants=[SM90.key])
    client = app.test_client()
    for action in ("yank", "unyank", "delete"):
        for spec in (base.filename, "demo==1.0"):
            refused = client.post(f"/api/{action}", headers=bearer(limited),
                                  json={"target": spec, "variant": SM90.key, "reason": "x"})
            assert refused.status_code == 403, refused.text
            assert V.key in refused.json["error"] and "nothing was changed" in refused.json["error"]
        in_base = client.post(f"/api/{action}", headers=bearer(limited),
                              json={"target": base.filename, "variant": V.key})
        assert in_base.status_code == 403
    assert _listed(client, V.key, "demo")[base.filename] is False
    assert storage.exists(base.key) and storage.exists(base.wheel_key)
    # The project page's buttons, signed in with the same token.
    sign_in(client, limited)
    form = client.get("/projects/demo").text
    for path in ("/projects/demo/yank", "/projects/demo/delete"):
        page = client.post(path, data={"filename": base.filename, "variant": SM90.key,
                                       "confirm": base.filename, "csrf_token": csrf_of(form)})
        assert page.status_code == 403
    assert _listed(client, V.key, "demo")[base.filename] is False
    assert audit_entries(storage) == []
    # Its own root's file: yanked in its own root (200), then deleted.
    done = client.post("/api/yank", headers=bearer(limited),
                       json={"target": narrow.filename, "variant": SM90.key, "reason": "bad"})
    assert done.status_code == 200, done.text
    assert [f["variant"] for f in done.json["files"]] == [SM90.key]
    assert _listed(client, SM90.key, "demo")[narrow.filename] == "bad"
    assert _listed(client, V.key, "demo")[base.filename] is False
    gone = client.post("/api/delete", headers=bearer(limited),
                       json={"target": narrow.filename, "variant": SM90.key})
    assert gone.status_code == 200 and not storage.exists(narrow.wheel_key)
    assert storage.exists(base.wheel_key)
    close_redis(app)


def test_signing_out_ends_the_session_for_every_copy_of_its_cookie(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    """A cookie copied before sign-out (another tab's, a stolen one) unyanks nothing after."""
    app = make_app(redis_url, tmp_path)
    with app.app_context():
        storage = services().storage
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{V.local_label}")
    publish(storage, wheel, V)
    client = app.test_client()
    sign_in(client, token(conn, "ops", ("admin",)))
    form = client.get("/projects/demo").text
    assert client.post("/projects/demo/yank", data={
        "filename": wheel.name, "variant": V.key, "reason": "bad",
        "csrf_token": csrf_of(form)}).status_code == 303
    cookie = client.get_cookie("wheelhouse_session")
    assert cookie is not None
    copy = app.test_client()
    copy.set_cookie("wheelhouse_session", cookie.value)
    assert ">Unyank</button>" in copy.get("/projects/demo").text  # the copy works, for now
    assert client.post("/logout", data={"csrf_token": csrf_of(form)}).status_code == 302
    replayed = copy.post("/projects/demo/yank", data={
        "filename": wheel.name, "variant": V.key, "undo": "1", "csrf_token": csrf_of(form)})
    assert replayed.status_code == 401
    assert 'data-yanked="bad"' in copy.get(f"/{V.key}/simple/demo/").text
    assert [e["action"] for e in audit_entries(storage)] == ["yank"]
    assert not conn.keys("wheelhouse:session:*")
    close_redis(app)


def test_the_session_cookie_is_secure_over_tls(redis_url: str, tmp_path: Path) -> None:
    app = make_app(redis_url, tmp_path)
    over_tls = app.test_client().get("/login", base_url="https://index.example")
    plain = app.test_client().get("/login", base_url="http://127.0.0.1")
    assert "Secure" in over_tls.headers["Set-Cookie"]
    assert "Secure" not in plain.headers["Set-Cookie"]
    close_redis(app)
