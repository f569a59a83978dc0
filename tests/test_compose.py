"""compose.yaml: valid against the Compose specification, and what the README says it is."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from wheelhouse.cli import main
from wheelhouse.config import documented_settings

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT.parent / "shared" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def test_valid_against_compose_spec(compose: dict[str, Any]) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} is not here (it sits beside the checkout in CI and sessions)")
    schema = json.loads(SCHEMA.read_text())
    # The spec says draft-07 (its $schema URL lacks the '#' jsonschema looks up by).
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_services_and_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "minio", "minio-init", "web", "worker"}
    for name, svc in services.items():
        if name != "minio-init":
            assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (
                f"{name} waits for {dep} to start, not to be healthy")
    assert "--appendonly" in services["redis"]["command"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_commands_are_the_cli_the_tests_exercise(compose: dict[str, Any]) -> None:
    """Every wheelhouse command compose runs parses with the real CLI."""
    runner = CliRunner()
    for name, svc in compose["services"].items():
        for argv in (svc.get("command"), svc.get("healthcheck", {}).get("test", [])[1:]):
            if not argv or argv[0] != "wheelhouse":
                continue
            result = runner.invoke(main, [*argv[1:], "--help"])
            assert result.exit_code == 0, f"{name}: {argv} -> {result.output}"


def test_environment_is_documented(compose: dict[str, Any]) -> None:
    known = {v for v, _d, _doc in documented_settings()}
    for name, svc in compose["services"].items():
        for var in svc.get("environment", {}):
            if var.startswith("WHEELHOUSE_"):
                assert var in known, f"{name} sets {var}, which wheelhouse does not read"


def test_no_secrets_in_the_file() -> None:
    text = (ROOT / "compose.yaml").read_text()
    for line in text.splitlines():
        if re.search(r"(PASSWORD|SECRET|TOKEN|ACCESS_KEY)\w*:\s*\S", line):
            assert "${" in line, f"a literal secret in compose.yaml: {line.strip()}"


def test_readme_operator_section_matches(compose: dict[str, Any]) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running it for real", 1)[1].split("\n## ", 1)[0]
    for name in compose["services"]:
        assert f"`{name}`" in section, f"the README's operator section omits `{name}`"
    for dockerfile in ("web/Dockerfile", "worker/Dockerfile"):
        assert dockerfile in section
