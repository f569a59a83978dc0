"""The Redis keyspace (``wheelhouse.keys``): every name pinned to the string deployed Redis
servers hold, and no key named anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from wheelhouse import keys

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (keys.TOKENS, "wheelhouse:tokens"),
        (keys.LEGACY_TOKEN_PATTERNS, ("wheelhouse:token:*", "wheelhouse:token-name:*")),
        (keys.SESSION_SECRET, "wheelhouse:secret-key"),
        (keys.SPLITS, "wheelhouse:splits"),
        (keys.STATS, "wheelhouse:stats"),
        (keys.session("ab" * 32), "wheelhouse:session:" + "ab" * 32),
        (keys.rate("build:alice", 123), "wheelhouse:rate:build:alice:123"),
        (keys.onmiss("build-x"), "wheelhouse:onmiss:build-x"),
        (keys.log("build-x"), "wheelhouse:log:build-x"),
        (keys.log_count("build-x"), "wheelhouse:logn:build-x"),
        (keys.cancel("build-x"), "wheelhouse:cancel:build-x"),
        (keys.requester("split-x"), "wheelhouse:requester:split-x"),
        (keys.split("split-x"), "wheelhouse:split:split-x"),
        (keys.worker("gpu-1"), "wheelhouse:worker:gpu-1"),
        (keys.WORKERS, "wheelhouse:worker:*"),
    ],
)
def test_names_are_the_deployed_keys(name: object, expected: object) -> None:
    """Changing one of these orphans what running deployments keep in Redis."""
    assert name == expected


# A string that starts a Redis key of ours: ``wheelhouse:`` and no space (``"wheelhouse: ..."``
# is how messages start).
_KEY_LITERAL = re.compile(r"wheelhouse:(?!\s)")


def _key_literals(path: Path) -> list[str]:
    """Every string constant in ``path`` (f-string parts too) that starts a key of ours."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and _KEY_LITERAL.match(node.value)]


def test_the_scan_sees_key_literals(tmp_path: Path) -> None:
    planted = ROOT / "tests" / "wheelhouse" / "test_keys.py"
    found = _key_literals(planted)
    assert any("'wheelhouse:tokens'" in f for f in found)
    assert not any("'wheelhouse: " in f for f in found)


def test_no_key_is_named_outside_the_keyspace_module() -> None:
    found = [hit for package in ("wheelhouse", "web", "worker")
             for path in sorted((ROOT / package).rglob("*.py"))
             if path != ROOT / "wheelhouse" / "keys.py"
             for hit in _key_literals(path)]
    assert found == []
