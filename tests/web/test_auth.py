"""Tokens, API auth, sign-in sessions, CSRF, rate limits and read protection, on real Redis."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from flask.testing import FlaskClient
from redis import Redis

from tests.helpers import clean_env, make_venv, make_wheel, start_index
from tests.web.buildhelpers import (
    GOOD,
    advertise_worker,
    bearer,
    csrf_of,
    make_app,
    sign_in,
    token,
)
from wheelhouse.cli.main import main
from wheelhouse.config import Config
from wheelhouse.errors import TokenError
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import (
    create_token,
    digest,
    list_tokens,
    revoke_token,
    verify_token,
)
from wheelhouse.variants import parse_variant


def _all_redis_bytes(conn: Redis) -> bytes:
    out = []
    for key in conn.keys():
        out.append(key)
        kind = conn.type(key)
        if kind == b"string":
            out.append(conn.get(key) or b"")
        elif kind == b"hash":
            for k, v in conn.hgetall(key).items():
                out += [k, v]
        elif kind == b"list":
            out += conn.lrange(key, 0, -1)
    return b"\n".join(out)


# -- tokens --


def test_tokens_are_stored_hashed_verified_and_revoked(conn: Redis) -> None:
    tok = create_token(conn, "ci-bot", ["build"])
    assert tok.startswith("whk_") and len(tok) > 40
    stored = _all_redis_bytes(conn)
    assert tok.encode() not in stored and tok[4:].encode() not in stored
    assert digest(tok).encode() in stored
    info = verify_token(conn, tok)
    assert info is not None and info.name == "ci-bot" and info.scopes == ("build",)
    assert verify_token(conn, tok + "x") is None
    assert verify_token(conn, "whk_" + "A" * 43) is None
    assert [i.name for i in list_tokens(conn)] == ["ci-bot"]
    with pytest.raises(TokenError, match="exists"):
        create_token(conn, "ci-bot")
    assert revoke_token(conn, "ci-bot") is True
    assert verify_token(conn, tok) is None
    assert revoke_token(conn, "ci-bot") is False
    assert list_tokens(conn) == []


@pytest.mark.parametrize("name", ["", "a b", "../x", "x" * 65, "-lead", "a;b", "ü"])
def test_bad_token_names_are_refused(conn: Redis, name: str) -> None:
    with pytest.raises(TokenError):
        create_token(conn, name)


def test_unknown_scopes_are_refused(conn: Redis) -> None:
    with pytest.raises(TokenError, match="scope"):
        create_token(conn, "x", ["root"])


def test_token_cli_prints_once_and_revokes(
        redis_url: str, conn: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHEELHOUSE_REDIS_URL", redis_url)
    runner = CliRunner()
    made = runner.invoke(main, ["token", "create", "alice", "--scope", "read"])
    assert made.exit_code == 0, made.output
    tok = made.stdout.strip()
    info = verify_token(conn, tok)
    assert info is not None and info.scopes == ("read",)
    listed = runner.invoke(main, ["token", "list"])
    assert "alice\tread" in listed.stdout and tok not in listed.stdout
    assert runner.invoke(main, ["token", "create", "alice"]).exit_code == 1
    gone = runner.invoke(main, ["token", "revoke", "alice"])
    assert gone.exit_code == 0 and verify_token(conn, tok) is None
    assert runner.invoke(main, ["token", "revoke", "alice"]).exit_code == 1
    ci = runner.invoke(main, ["token", "create", "ci", "--scope", "upload", "--scope", "admin",
                              "--variant", "torch2.14-cu130"])
    assert ci.exit_code == 0, ci.output
    info = verify_token(conn, ci.stdout.strip())
    assert info is not None and info.scopes == ("upload", "admin")
    assert info.variants == ("torch2.14-cu130",)
    assert "ci\tupload,admin\t" in runner.invoke(main, ["token", "list"]).stdout


# -- API auth --


def test_api_without_token_is_401_with_a_challenge(fleet_client: FlaskClient) -> None:
    resp = fleet_client.post("/api/builds", json=GOOD)
    assert resp.status_code == 401 and resp.is_json
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "needs an API token" in resp.json["error"]


@pytest.mark.parametrize("header", [
    "Bearer whk_" + "A" * 43, "Bearer nonsense", "Bearer " + "x" * 10_000, "Basic !!!",
    "Token abc", "Bearer whk_$(id)",
])
def test_api_with_a_bad_token_is_401(fleet_client: FlaskClient, header: str) -> None:
    resp = fleet_client.post("/api/builds", json=GOOD, headers={"Authorization": header})
    assert resp.status_code == 401 and resp.is_json


def test_api_with_a_revoked_token_is_401(fleet_client: FlaskClient, conn: Redis) -> None:
    tok = token(conn)
    revoke_token(conn, "alice")
    resp = fleet_client.post("/api/builds", json=GOOD, headers=bearer(tok))
    assert resp.status_code == 401 and "invalid or revoked" in resp.json["error"]


def test_api_with_the_wrong_scope_is_403(fleet_client: FlaskClient, conn: Redis) -> None:
    reader = token(conn, "reader", ("read",))
    builder = token(conn, "builder", ("build",))
    resp = fleet_client.post("/api/builds", json=GOOD, headers=bearer(reader))
    assert resp.status_code == 403 and "'build' scope" in resp.json["error"]
    [b] = fleet_client.post("/api/builds", json=GOOD, headers=bearer(builder)).json["builds"]
    resp = fleet_client.post(f"/api/builds/{b['id']}/cancel", headers=bearer(reader))
    assert resp.status_code == 403
    assert fleet_client.get(f"/api/builds/{b['id']}").json["state"] == "queued"


# -- sign-in sessions and CSRF --


def test_sign_in_with_a_token_then_revocation_ends_the_session(
        fleet_client: FlaskClient, conn: Redis) -> None:
    tok = token(conn)
    assert fleet_client.get("/request").status_code == 302  # to the login page
    sign_in(fleet_client, tok)
    page = fleet_client.get("/request")
    assert page.status_code == 200 and "signed in as" in page.text
    assert tok not in page.text  # never shown back
    revoke_token(conn, "alice")
    assert fleet_client.get("/request").status_code == 302


def test_a_wrong_token_at_sign_in_is_shown_next_to_the_field(fleet_client: FlaskClient) -> None:
    page = fleet_client.get("/login")
    resp = fleet_client.post("/login",
                             data={"token": "whk_wrong", "csrf_token": csrf_of(page.text)})
    assert resp.status_code == 401
    assert 'class="field-error" id="token-error"' in resp.text
    assert "whk_wrong" not in resp.text


#: Targets a sign-in must not follow: other hosts, however spelled. Browsers drop tabs, CR and
#: LF and read "\\" as "/", so "/\t/evil.example" is "//evil.example" to them.
OFF_SITE = [
    "https://evil.example/", "//evil.example/", "/\\evil.example", "/\t/evil.example",
    "/\r\n/evil.example", "\t//evil.example", "/\x00/evil.example", "http:/evil.example",
    "javascript:alert(1)", "evil.example", "///evil.example", "/\x7f/evil.example",
    " //evil.example", "/\u0085/evil.example", "[", "//[::1]/", "https:evil.example",
]


@pytest.mark.parametrize("target", OFF_SITE)
def test_sign_in_never_redirects_off_site(fleet_client: FlaskClient, conn: Redis,
                                          target: str) -> None:
    tok = token(conn)
    page = fleet_client.get("/login")
    resp = fleet_client.post("/login", data={"token": tok, "csrf_token": csrf_of(page.text),
                                             "next": target})
    assert resp.status_code == 302
    assert resp.headers["Location"] == "/matrix", target


@pytest.mark.parametrize("query", ["/%09/evil.example", "/%0d%0a/evil.example",
                                   "%0d%0aSet-Cookie:%20x=1", "/%5Cevil.example"])
def test_next_from_the_query_is_checked_too(fleet_client: FlaskClient, conn: Redis,
                                            query: str) -> None:
    page = fleet_client.get(f"/login?next={query}")
    assert page.status_code == 200
    assert 'name="next" value="/matrix"' in page.text
    resp = fleet_client.post(f"/login?next={query}", data={"token": token(conn),
                                                      "csrf_token": csrf_of(page.text)})
    assert resp.status_code == 302 and resp.headers["Location"] == "/matrix"


@pytest.mark.parametrize("target", ["/request", "/builds/x?tab=log", "/caf\u00e9",
                                    "/matrix?project=flash-attn#row"])
def test_sign_in_follows_same_site_paths(fleet_client: FlaskClient, conn: Redis,
                                         target: str) -> None:
    page = fleet_client.get("/login")
    resp = fleet_client.post("/login", data={"token": token(conn), "csrf_token": csrf_of(page.text),
                                             "next": target})
    assert resp.status_code == 302
    assert resp.headers["Location"].startswith(target.split("\u00e9")[0])


@pytest.mark.parametrize("csrf", [None, "", "forged"])
def test_forms_refuse_a_missing_or_forged_csrf_token(
        fleet_client: FlaskClient, conn: Redis, csrf: str | None) -> None:
    tok = token(conn)
    login = {"token": tok} | ({"csrf_token": csrf} if csrf is not None else {})
    fleet_client.get("/login")  # a session with a real CSRF token exists
    assert fleet_client.post("/login", data=login).status_code == 400
    sign_in(fleet_client, tok)
    form = {**GOOD, "python": "3.11"} | ({"csrf_token": csrf} if csrf is not None else {})
    resp = fleet_client.post("/request", data=form)
    assert resp.status_code == 400 and "CSRF" in resp.text
    assert not any(k.startswith(b"rq:job:") for k in conn.keys())
    assert fleet_client.post("/logout", data={} if csrf is None else {"csrf_token": csrf}
                             ).status_code == 400


def test_cancel_form_needs_csrf(fleet_client: FlaskClient, conn: Redis) -> None:
    tok = token(conn)
    [b] = fleet_client.post("/api/builds", json=GOOD, headers=bearer(tok)).json["builds"]
    csrf = sign_in(fleet_client, tok)
    assert fleet_client.post(f"/builds/{b['id']}/cancel").status_code == 400
    assert fleet_client.get(f"/api/builds/{b['id']}").json["state"] == "queued"
    resp = fleet_client.post(f"/builds/{b['id']}/cancel", data={"csrf_token": csrf})
    assert resp.status_code == 303
    assert fleet_client.get(f"/api/builds/{b['id']}").json["state"] == "cancelled"


def test_session_cookie_on_the_api_needs_the_csrf_header(
        fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    assert fleet_client.post("/api/builds", json=GOOD).status_code == 400
    resp = fleet_client.post("/api/builds", json=GOOD, headers={"X-CSRF-Token": csrf})
    assert resp.status_code == 201


# -- rate limits --


def test_tokens_are_rate_limited_each_on_its_own(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    app = make_app(redis_url, tmp_path, rate_limit="3/3600")
    client = app.test_client()
    advertise_worker(conn)
    alice, bob = token(conn, "alice"), token(conn, "bob")
    for _ in range(3):
        assert client.post("/api/builds", json=GOOD, headers=bearer(alice)).status_code in (
            200, 201)
    resp = client.post("/api/builds", json=GOOD, headers=bearer(alice))
    assert resp.status_code == 429 and resp.is_json
    assert 0 < int(resp.headers["Retry-After"]) <= 3600
    assert "alice" in resp.json["error"]
    # The budget is per token: bob still has his.
    assert client.post("/api/builds", json=GOOD, headers=bearer(bob)).status_code == 200


def test_failed_sign_ins_are_rate_limited(redis_url: str, tmp_path: Path) -> None:
    app = make_app(redis_url, tmp_path, login_rate_limit="2/600")
    client = app.test_client()
    csrf = csrf_of(client.get("/login").text)
    codes = [client.post("/login", data={"token": "whk_guess", "csrf_token": csrf}).status_code
             for _ in range(3)]
    assert codes == [401, 401, 429]


def test_a_lockout_refuses_the_right_token_too(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    """Once locked out, a client learns nothing from its attempts: the right token gets the
    same 429 as a wrong one, on the form and on the API, until the window ends."""
    app = make_app(redis_url, tmp_path, login_rate_limit="2/600")
    advertise_worker(conn)
    client = app.test_client()
    tok = token(conn)
    csrf = csrf_of(client.get("/login").text)
    for _ in range(2):
        assert client.post("/login", data={"token": "whk_guess", "csrf_token": csrf}
                           ).status_code == 401
    resp = client.post("/login", data={"token": tok, "csrf_token": csrf})
    assert resp.status_code == 429 and "too many failed sign-ins" in resp.text
    assert 0 < int(resp.headers["Retry-After"]) <= 600
    api = client.post("/api/builds", json=GOOD, headers=bearer(tok))
    assert api.status_code == 429 and api.is_json and "Retry-After" in api.headers
    # Another address is not locked out by this one's failures.
    other = app.test_client()
    other.environ_base["REMOTE_ADDR"] = "192.0.2.7"
    assert other.post("/api/builds", json=GOOD, headers=bearer(tok)).status_code == 201


@pytest.mark.parametrize("how", ["bearer", "basic"])
def test_failed_api_tokens_count_toward_the_lockout(
        redis_url: str, tmp_path: Path, conn: Redis, how: str) -> None:
    app = make_app(redis_url, tmp_path, login_rate_limit="3/600", auth="token")
    advertise_worker(conn)
    client = app.test_client()
    tok = token(conn)

    def send(secret: str) -> int:
        headers = bearer(secret) if how == "bearer" else _basic("ci", secret)
        return client.post("/api/builds", json=GOOD, headers=headers).status_code

    assert [send("whk_" + "A" * 43), send("whk_wrong"), send("not-even-a-token")] == [401] * 3
    assert send(tok) == 429
    assert send("whk_wrong") == 429
    # Reads of a private index with a token are token checks too.
    headers = bearer(tok) if how == "bearer" else _basic("ci", tok)
    assert client.get("/torch2.8-cu128/simple/", headers=headers).status_code == 429


def test_no_credentials_is_not_a_failed_attempt(redis_url: str, tmp_path: Path) -> None:
    """uv and pip ask without credentials first; the 401 challenge must not count."""
    client = make_app(redis_url, tmp_path, login_rate_limit="2/600",
                      auth="token").test_client()
    for _ in range(5):
        assert client.get("/torch2.8-cu128/simple/").status_code == 401


def test_bad_rate_limit_setting_fails_at_start(redis_url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="COUNT/SECONDS"):
        make_app(redis_url, tmp_path, rate_limit="lots")


# -- read protection --


def _basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


def test_basic_read_protection(redis_url: str, tmp_path: Path, conn: Redis) -> None:
    client = make_app(redis_url, tmp_path, auth="basic:team:s3cret").test_client()
    for path in ("/", "/matrix", "/torch2.8-cu128/simple/", "/api/workers"):
        resp = client.get(path)
        assert resp.status_code == 401, path
        assert resp.headers["WWW-Authenticate"].startswith("Basic")
        assert client.get(path, headers=_basic("team", "wrong")).status_code == 401
        assert client.get(path, headers=_basic("team", "s3cret")).status_code in (200, 404)
    assert client.get("/healthz").status_code == 200
    assert client.get("/login").status_code == 200


def test_token_read_protection(redis_url: str, tmp_path: Path, conn: Redis) -> None:
    client = make_app(redis_url, tmp_path, auth="token").test_client()
    reader = token(conn, "reader", ("read",))
    builder = token(conn, "builder", ("build",))
    assert client.get("/matrix").status_code == 401
    assert client.get("/matrix", headers=_basic("anyone", reader)).status_code == 200
    assert client.get("/matrix", headers=bearer(reader)).status_code == 200
    assert client.get("/matrix", headers=_basic("anyone", builder)).status_code == 401
    # A signed-in reader browses the pages without basic auth.
    csrf = csrf_of(client.get("/login").text)
    client.post("/login", data={"token": reader, "csrf_token": csrf})
    assert client.get("/matrix").status_code == 200


def test_bad_auth_setting_fails_at_start(redis_url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="WHEELHOUSE_AUTH"):
        make_app(redis_url, tmp_path, auth="basic:nopassword")


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not installed")
@pytest.mark.parametrize("mode", ["basic", "token"])
def test_uv_and_pip_install_from_a_private_index(
        redis_url: str, conn: Redis, tmp_path: Path, mode: str) -> None:
    """Credentials in the index URL: what uv and pip send as basic auth."""
    variant = parse_variant("torch2.8-cu128")
    if mode == "basic":
        config = Config(storage=str(tmp_path / "data"), redis_url=redis_url, upstream="off",
                        auth="basic:team:s3cret")
        creds = "team:s3cret"
    else:
        config = Config(storage=str(tmp_path / "data"), redis_url=redis_url, upstream="off",
                        auth="token")
        creds = "ci:" + token(conn, "ci", ("read",))
    wheel = make_wheel(tmp_path / "w", "demo-ext", f"1.0+{variant.local_label}",
                       tag="py3-none-any", module_body="VALUE = 7\n")
    publish(open_storage(config), wheel, variant)
    python = make_venv(tmp_path / "venv")
    env = clean_env(UV_CACHE_DIR=str(tmp_path / "uv-cache"))
    with start_index(config, tmp_path) as url:
        host = url.removeprefix("http://")
        denied = subprocess.run(
            ["uv", "pip", "install", "--python", str(python), "--index-url",
             f"{url}/{variant.key}/simple", "demo-ext"], env=env, capture_output=True, text=True)
        assert denied.returncode != 0
        private = f"http://{creds}@{host}/{variant.key}/simple"
        subprocess.run(["uv", "pip", "install", "--python", str(python), "--index-url", private,
                        "demo-ext"], env=env, check=True, capture_output=True)
        subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", "--force-reinstall",
                        "--index-url", private, "demo-ext"], env=env, check=True,
                       capture_output=True)
        assert creds.split(":")[1] not in url.access_log()  # never logged
    got = subprocess.run([str(python), "-c", "import demo_ext; print(demo_ext.VALUE)"],
                         capture_output=True, text=True, check=True).stdout
    assert got.strip() == "7"


@pytest.mark.parametrize(("hops", "locked_out"), [(1, False), (0, True)])
def test_behind_a_proxy_the_lockout_counts_per_forwarded_client(
        redis_url: str, tmp_path: Path, hops: int, locked_out: bool) -> None:
    """compose's nginx is every client's address: with WHEELHOUSE_PROXY_HOPS=1 the lockout
    counts the client's X-Forwarded-For instead, so one guesser locks out only itself. With 0
    (the default, no proxy) the header is the client's own word and is ignored."""
    app = make_app(redis_url, tmp_path, login_rate_limit="2/600", proxy_hops=hops)
    guesser, other = app.test_client(), app.test_client()
    for client, addr in ((guesser, "198.51.100.1"), (other, "198.51.100.2")):
        client.environ_base["REMOTE_ADDR"] = "172.18.0.5"  # the proxy, for both
        client.environ_base["HTTP_X_FORWARDED_FOR"] = addr
    csrf = csrf_of(guesser.get("/login").text)
    codes = [guesser.post("/login", data={"token": "whk_guess", "csrf_token": csrf}).status_code
             for _ in range(3)]
    assert codes == [401, 401, 429]
    csrf = csrf_of(other.get("/login").text)
    resp = other.post("/login", data={"token": "whk_guess", "csrf_token": csrf})
    assert resp.status_code == (429 if locked_out else 401)


def test_only_the_requester_or_an_admin_cancels_a_build(fleet_client: FlaskClient,
                                                        conn: Redis) -> None:
    """A build token cancels the builds it requested, not another token's; an admin token
    cancels any; a build nobody's token requested (made on a miss) only an admin."""
    alice, bob = token(conn, "alice", ("build",)), token(conn, "bob", ("build",))
    ops = token(conn, "ops", ("admin",))
    [b] = fleet_client.post("/api/builds", json=GOOD, headers=bearer(alice)).json["builds"]
    refused = fleet_client.post(f"/api/builds/{b['id']}/cancel", headers=bearer(bob))
    assert refused.status_code == 403 and "requested by token 'alice'" in refused.json["error"]
    csrf = sign_in(fleet_client, bob)
    page = fleet_client.get(f"/builds/{b['id']}").text
    assert "/cancel" not in page  # no button for what it may not cancel
    form = fleet_client.post(f"/builds/{b['id']}/cancel", data={"csrf_token": csrf})
    assert form.status_code == 403
    assert fleet_client.get(f"/api/builds/{b['id']}").json["state"] == "queued"
    # The same spec asked again by bob joins alice's build: it stays hers.
    [same] = fleet_client.post("/api/builds", json=GOOD, headers=bearer(bob)).json["builds"]
    assert same["id"] == b["id"] and not same["created"]
    assert fleet_client.post(f"/api/builds/{b['id']}/cancel",
                             headers=bearer(bob)).status_code == 403
    done = fleet_client.post(f"/api/builds/{b['id']}/cancel", headers=bearer(alice))
    assert done.status_code == 200
    assert fleet_client.get(f"/api/builds/{b['id']}").json["state"] == "cancelled"
    # Rerun by bob: now bob's; an admin cancels it all the same.
    [again] = fleet_client.post("/api/builds", json={**GOOD, "rerun_failed": True},
                                headers=bearer(bob)).json["builds"]
    assert again["created"]
    assert fleet_client.post(f"/api/builds/{b['id']}/cancel",
                             headers=bearer(alice)).status_code == 403
    by_admin = fleet_client.post(f"/api/builds/{b['id']}/cancel", headers=bearer(ops))
    assert by_admin.status_code == 200
    assert fleet_client.get(f"/api/builds/{b['id']}").json["state"] == "cancelled"


def test_a_build_with_no_recorded_requester_is_an_admins_to_cancel(
        fleet_client: FlaskClient, conn: Redis) -> None:
    [b] = fleet_client.post("/api/builds", json=GOOD,
                            headers=bearer(token(conn, "alice"))).json["builds"]
    conn.delete(f"wheelhouse:requester:{b['id']}")  # as for a build made on a miss
    other = fleet_client.post(f"/api/builds/{b['id']}/cancel", headers=bearer(token(conn, "bob")))
    assert other.status_code == 403 and "no recorded token" in other.json["error"]
    ops = fleet_client.post(f"/api/builds/{b['id']}/cancel",
                            headers=bearer(token(conn, "ops", ("admin",))))
    assert ops.status_code == 200
