"""Tokens against a real Redis: the check, the list and revocation read the same data, so a
token written into Redis by hand, as an intruder with the Redis password could, is either
listed and revocable or refused."""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest
import redis
from click.testing import CliRunner

from wheelhouse import keys
from wheelhouse.cli.main import main
from wheelhouse.errors import TokenError
from wheelhouse.index.tokens import (
    TOKEN_MARK,
    create_token,
    digest,
    legacy_token_keys,
    list_tokens,
    lookup_digest,
    revoke_token,
    verify_token,
)


def _forge() -> str:
    return TOKEN_MARK + secrets.token_urlsafe(32)


def _record(name: object, scopes: object = ("build",)) -> str:
    return json.dumps({"name": name, "scopes": scopes, "created_at": time.time()})


def test_one_hash_of_digests(conn: redis.Redis) -> None:
    tok = create_token(conn, "ci-bot", ["build"])
    assert conn.keys() == [keys.TOKENS.encode()]
    assert conn.hkeys(keys.TOKENS) == [digest(tok).encode()]
    info = verify_token(conn, tok)
    assert info is not None and info == lookup_digest(conn, digest(tok))
    assert list_tokens(conn) == [info]


def test_a_token_planted_in_the_hash_is_listed_and_revocable(conn: redis.Redis) -> None:
    """Today's attack: a record written straight into the tokens hash."""
    create_token(conn, "alice")
    planted = _forge()
    conn.hset(keys.TOKENS, digest(planted), _record("intruder", ["build", "read"]))
    # It authenticates, so it must be visible and revocable like any other.
    info = verify_token(conn, planted)
    assert info is not None and info.name == "intruder"
    assert [i.name for i in list_tokens(conn)] == ["alice", "intruder"]
    assert revoke_token(conn, "intruder")
    assert verify_token(conn, planted) is None
    assert [i.name for i in list_tokens(conn)] == ["alice"]


def test_a_planted_twin_of_a_name_goes_with_it(conn: redis.Redis) -> None:
    real = create_token(conn, "alice")
    twin = _forge()
    conn.hset(keys.TOKENS, digest(twin), _record("alice"))
    assert [i.name for i in list_tokens(conn)] == ["alice", "alice"]
    with pytest.raises(TokenError, match="exists"):
        create_token(conn, "alice")
    assert revoke_token(conn, "alice")
    assert verify_token(conn, real) is None and verify_token(conn, twin) is None
    assert list_tokens(conn) == []


def test_a_token_planted_the_old_way_is_refused(conn: redis.Redis) -> None:
    """The attack as the issue reports it: keys of the earlier format, written directly."""
    planted = _forge()
    conn.set(f"wheelhouse:token:{digest(planted)}", _record("ghost"))
    conn.set("wheelhouse:token-name:ghost", digest(planted))
    assert verify_token(conn, planted) is None
    assert lookup_digest(conn, digest(planted)) is None
    assert list_tokens(conn) == []
    assert legacy_token_keys(conn) == 2


@pytest.mark.parametrize("record", [
    _record("../../etc"), _record(""), _record(None), _record("x" * 65),
    _record("ok", ["root"]), _record("ok", []), _record("ok", "build"),
    json.dumps({"name": "ok", "scopes": ["build"]}), "{not json", json.dumps(["ok"]),
    json.dumps({"name": "ok", "scopes": ["upload"], "created_at": 1.0, "variants": "x"}),
])
def test_records_that_do_not_validate_authenticate_nothing(conn: redis.Redis,
                                                          record: str) -> None:
    planted = _forge()
    conn.hset(keys.TOKENS, digest(planted), record)
    assert verify_token(conn, planted) is None
    assert list_tokens(conn) == []


def test_fields_that_are_not_digests_are_ignored(conn: redis.Redis) -> None:
    conn.hset(keys.TOKENS, "not-a-digest", _record("ok"))
    conn.hset(keys.TOKENS, "A" * 64, _record("ok"))
    assert list_tokens(conn) == []
    assert lookup_digest(conn, "not-a-digest") is None


def test_replace_revokes_the_old_one(conn: redis.Redis) -> None:
    old = create_token(conn, "bot", ["read"])
    new = create_token(conn, "bot", ["build"], replace=True)
    assert verify_token(conn, old) is None
    info = verify_token(conn, new)
    assert info is not None and info.scopes == ("build",)
    assert [i.name for i in list_tokens(conn)] == ["bot"]


def test_concurrent_creates_of_one_name_make_one_token(redis_url: str,
                                                       conn: redis.Redis) -> None:
    made: list[str] = []
    refused: list[str] = []
    start = threading.Barrier(8)

    def create() -> None:
        own = redis.Redis.from_url(redis_url)
        start.wait()
        try:
            made.append(create_token(own, "racer"))
        except TokenError:
            refused.append("racer")

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(refused) == 7
    assert [i.name for i in list_tokens(conn)] == ["racer"]


def test_the_cli_lists_what_authenticates_and_notes_old_keys(
        redis_url: str, conn: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHEELHOUSE_REDIS_URL", redis_url)
    planted = _forge()
    conn.hset(keys.TOKENS, digest(planted), _record("intruder"))
    conn.set("wheelhouse:token:" + "0" * 64, _record("ghost"))
    listed = CliRunner().invoke(main, ["token", "list"])
    assert listed.exit_code == 0
    assert listed.stdout.startswith("intruder\tbuild\tcreated ")
    assert "ghost" not in listed.stdout
    assert "1 key(s) of the earlier token format" in listed.stderr
    assert CliRunner().invoke(main, ["token", "revoke", "intruder"]).exit_code == 0
    assert verify_token(conn, planted) is None


def test_upload_and_admin_tokens_may_be_limited_to_roots(conn: redis.Redis) -> None:
    token = create_token(conn, "ci", ["upload", "admin"], variants=["torch2.14-cu130"])
    info = verify_token(conn, token)
    assert info is not None and info.scopes == ("upload", "admin")
    assert info.allows_variant("torch2.14-cu130") and info.allows_variant("torch2.14-cu130-sm90")
    assert not info.allows_variant("torch2.14-cu128")
    everywhere = verify_token(conn, create_token(conn, "ops", ["admin"]))
    assert everywhere is not None and everywhere.allows_variant("torch2.14-cu128")
    with pytest.raises(TokenError, match="--variant 'cu130'"):
        create_token(conn, "bad", ["upload"], variants=["cu130"])
