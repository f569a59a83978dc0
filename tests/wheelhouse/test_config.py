"""Configuration: defaults, then WHEELHOUSE_* variables, then explicit overrides."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from wheelhouse.config import ENV_PREFIX, Config, documented_settings

HINTS = get_type_hints(Config)
FIELDS = [f for f in dataclasses.fields(Config) if f.name != "extra"]


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _kind(field: str) -> Any:
    hint = HINTS[field]
    rest = [a for a in get_args(hint) if a is not type(None)]
    return rest[0] if len(rest) == 1 else hint


def test_defaults_without_environment() -> None:
    assert Config.from_env({}) == Config()
    config = Config.from_env({"HOME": "/root", "PATH": "/bin", "AWS_REGION": "x"})
    assert config == Config()
    assert config.extra == {}


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHEELHOUSE_PAGE_MAX_AGE", "7")
    monkeypatch.setenv("WHEELHOUSE_STORAGE", "s3://bucket/p")
    config = Config.from_env()
    assert (config.page_max_age, config.storage) == (7, "s3://bucket/p")


@pytest.mark.parametrize(("var", "raw", "field", "value"), [
    ("WHEELHOUSE_STORAGE", "/srv/wheels", "storage", "/srv/wheels"),
    ("WHEELHOUSE_STORAGE", "s3://bucket/prefix", "storage", "s3://bucket/prefix"),
    ("WHEELHOUSE_S3_ENDPOINT_URL", "http://minio:9000", "s3_endpoint_url", "http://minio:9000"),
    ("WHEELHOUSE_S3_ENDPOINT_URL", "", "s3_endpoint_url", None),
    ("WHEELHOUSE_UPSTREAM", "off", "upstream", "off"),
    ("WHEELHOUSE_PRESIGN_SECONDS", "60", "presign_seconds", 60),
    ("WHEELHOUSE_PRESIGN_SECONDS", " 60 ", "presign_seconds", 60),
    ("WHEELHOUSE_PAGE_MAX_AGE", "0", "page_max_age", 0),
    ("WHEELHOUSE_CATALOG_REFRESH_SECONDS", "0.25", "catalog_refresh_seconds", 0.25),
    ("WHEELHOUSE_CATALOG_REFRESH_SECONDS", "2", "catalog_refresh_seconds", 2.0),
    ("WHEELHOUSE_BUILD_TIMEOUT", "600", "build_timeout", 600),
    ("WHEELHOUSE_REDIS_URL", "redis://127.0.0.1:6379/0", "redis_url", "redis://127.0.0.1:6379/0"),
    ("WHEELHOUSE_REDIS_URL", "", "redis_url", None),
    ("WHEELHOUSE_REDIS_URL", "  ", "redis_url", None),
    ("WHEELHOUSE_LOG_JSON", "1", "log_json", True),
    ("WHEELHOUSE_LOG_JSON", "true", "log_json", True),
    ("WHEELHOUSE_LOG_JSON", "TRUE", "log_json", True),
    ("WHEELHOUSE_LOG_JSON", "yes", "log_json", True),
    ("WHEELHOUSE_LOG_JSON", "on", "log_json", True),
    ("WHEELHOUSE_LOG_JSON", "0", "log_json", False),
    ("WHEELHOUSE_LOG_JSON", "false", "log_json", False),
    ("WHEELHOUSE_LOG_JSON", "off", "log_json", False),
    ("WHEELHOUSE_LOG_JSON", "", "log_json", False),
])
def test_environment_values_are_typed(var: str, raw: str, field: str, value: object) -> None:
    config = Config.from_env({var: raw})
    got = getattr(config, field)
    assert got == value
    assert type(got) is type(value)
    # Nothing else moved.
    assert dataclasses.replace(config, **{field: getattr(Config(), field)}) == Config()


#: Settings that are parsed (Config's typed views) need a sample that parses.
VALID = {"auth": ("token", "token"), "rate_limit": ("5/10", "5/10"),
         "login_rate_limit": ("5/10", "5/10"), "upstream_rules": ("a,b-*=https://x/", "a,b-*=https://x/"),
         "unproven_wheels": ("hold", "hold"), "prove_archs": ("80,sm_90", "80,sm_90"),
         "compile_cache_log": ("debug", "debug")}


@pytest.mark.parametrize("field", [f.name for f in FIELDS])
def test_every_field_reads_its_variable(field: str) -> None:
    kind = _kind(field)
    sample: dict[Any, tuple[str, object]] = {
        bool: ("true", True), int: ("42", 42), float: ("4.5", 4.5), str: ("some-text", "some-text"),
    }
    raw, expected = VALID.get(field) or sample[kind]
    default = getattr(Config(), field)
    if expected == default:
        raw, expected = {bool: ("false", False), int: ("43", 43), float: ("5.5", 5.5),
                         str: ("other-text", "other-text")}[kind]
    assert getattr(Config.from_env({_env_name(field): raw}), field) == expected


@pytest.mark.parametrize(("field", "default", "env", "override", "expected"), [
    # defaults < env < overrides
    ("page_max_age", 60, None, None, 60),
    ("page_max_age", 60, "5", None, 5),
    ("page_max_age", 60, None, 9, 9),
    ("page_max_age", 60, "5", 9, 9),
    ("storage", "./wheelhouse-data", "/env", None, "/env"),
    ("storage", "./wheelhouse-data", "/env", "/override", "/override"),
    ("redis_url", None, "redis://env", None, "redis://env"),
    ("redis_url", None, "redis://env", "redis://override", "redis://override"),
    ("log_json", False, "true", False, False),
    ("catalog_refresh_seconds", 1.0, "3", 0.0, 0.0),
])
def test_precedence(
    field: str, default: object, env: str | None, override: object, expected: object
) -> None:
    assert getattr(Config(), field) == default
    environ = {} if env is None else {_env_name(field): env}
    overrides = {} if override is None else {field: override}
    assert getattr(Config.from_env(environ, **overrides), field) == expected


def test_overrides_win_even_over_bad_environment_values_of_other_fields() -> None:
    config = Config.from_env({"WHEELHOUSE_PAGE_MAX_AGE": "5"}, storage="/x", presign_seconds=1)
    assert (config.page_max_age, config.storage, config.presign_seconds) == (5, "/x", 1)


@pytest.mark.parametrize("field", [f.name for f in FIELDS if _kind(f.name) in (int, float)])
@pytest.mark.parametrize("raw", ["", "abc", "5s", "1e", "0x10", "--1", "nan", "inf", "-inf"])
def test_bad_numbers_name_the_variable(field: str, raw: str) -> None:
    var = _env_name(field)
    with pytest.raises(ValueError, match=f"{var} must be a number, got {raw!r}") as exc:
        Config.from_env({var: raw})
    assert exc.value.__cause__ is None  # a plain message, not a chained traceback


@pytest.mark.parametrize("raw", ["1.5", "3.0"])
def test_fractions_are_not_integers(raw: str) -> None:
    with pytest.raises(ValueError, match="WHEELHOUSE_PAGE_MAX_AGE must be a number"):
        Config.from_env({"WHEELHOUSE_PAGE_MAX_AGE": raw})


@pytest.mark.parametrize("raw", ["ture", "enabled", "2", "y es", "-1"])
def test_bad_booleans_name_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="WHEELHOUSE_LOG_JSON must be one of"):
        Config.from_env({"WHEELHOUSE_LOG_JSON": raw})


def test_unknown_variables_are_kept_in_extra() -> None:
    config = Config.from_env({"WHEELHOUSE_NOT_A_SETTING": "x", "WHEELHOUSE_STORAGE": "/d",
                              "OTHER": "y", "wheelhouse_storage": "/lower"})
    assert config.extra == {"WHEELHOUSE_NOT_A_SETTING": "x"}
    assert config.storage == "/d"


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(TypeError):
        Config.from_env({}, no_such_setting=1)


def test_replace_returns_a_new_config() -> None:
    config = Config()
    changed = config.replace(page_max_age=1)
    assert (config.page_max_age, changed.page_max_age) == (60, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_max_age = 2  # type: ignore[misc]


def test_every_setting_is_documented() -> None:
    rows = documented_settings()
    assert [r[0] for r in rows] == [_env_name(f.name) for f in FIELDS]
    for variable, default, doc in rows:
        assert doc.strip(), f"{variable} has no docstring"
        field = variable.removeprefix(ENV_PREFIX).lower()
        value = getattr(Config(), field)
        assert default == ("" if value is None else str(value))


@pytest.mark.parametrize("config", [
    Config(),
    Config(storage="s3://bucket/p", s3_endpoint_url="http://127.0.0.1:9000", redis_url=None,
           catalog_refresh_seconds=0.25, build_reserve_gib=1.5, log_json=True,
           build_on_miss=True, page_max_age=0, secret_key="s", auth="basic:u:p",
           extra={"WHEELHOUSE_NOT_A_SETTING": "x"}),
])
def test_to_env_round_trips(config: Config) -> None:
    env = config.to_env()
    assert all(k.startswith(ENV_PREFIX) and isinstance(v, str) for k, v in env.items())
    assert Config.from_env(env) == config


def test_to_env_leaves_unset_settings_out() -> None:
    env = Config(redis_url=None, log_json=False).to_env()
    assert "WHEELHOUSE_REDIS_URL" not in env
    assert env["WHEELHOUSE_LOG_JSON"] == "false"


def test_settings_of_several_values_are_typed_once_and_fail_at_start() -> None:
    config = Config.from_env({"WHEELHOUSE_AUTH": "basic:team:s3cret",
                              "WHEELHOUSE_RATE_LIMIT": "3/600",
                              "WHEELHOUSE_UPSTREAM_RULES": "torch,nvidia-*=https://t/{cu}/",
                              "WHEELHOUSE_RECIPE_DIRS": "/a::/b",
                              "WHEELHOUSE_ALLOWED_PROJECTS": "Flash_Attn, causal-conv1d",
                              "WHEELHOUSE_COMPILE_CACHE_LOG": " Debug"})
    assert (config.read_auth.mode, config.read_auth.user) == ("basic", "team")
    assert (config.build_rate.count, config.build_rate.seconds) == (3, 600)
    assert [(r.patterns, r.url) for r in config.upstream_routes] == [
        (("torch", "nvidia-*"), "https://t/{cu}/")]
    assert config.extra_recipe_dirs == (Path("/a"), Path("/b"))
    assert config.allowed_project_names == {"flash-attn", "causal-conv1d"}
    assert config.compile_cache_log_level == "debug"
    for variable, bad, says in [("AUTH", "basic:nopassword", "basic:USER:PASSWORD"),
                                ("LOGIN_RATE_LIMIT", "lots", "COUNT/SECONDS"),
                                ("UPSTREAM_RULES", "no-url", "name,name-*=URL"),
                                # It becomes the build's SCCACHE_LOG: one of sccache's levels only.
                                ("COMPILE_CACHE_LOG", "debug,sccache=trace", "error, warn, info")]:
        with pytest.raises(ValueError, match=f"WHEELHOUSE_{variable}: .*{re.escape(says)}"):
            Config.from_env({f"WHEELHOUSE_{variable}": bad})
