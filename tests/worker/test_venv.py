"""Where a build venv installs from (``worker.steps.venv.index_args``)."""

from __future__ import annotations

import pytest

from wheelhouse.config import Config
from wheelhouse.variants import parse_variant
from worker.steps.venv import index_args

VARIANT = parse_variant("torch2.14-cu130")


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, ["--index-url", "https://pypi.org/simple",
          "--extra-index-url", "https://download.pytorch.org/whl/cu130"]),
    ({"torch_index_url": "", "torch_find_links": "/w/{cu} /x"},
     ["--index-url", "https://pypi.org/simple", "--find-links", "/w/cu130", "--find-links", "/x"]),
    # Through the index: its variant root alone (torch routed by its rules, cached once).
    ({"build_through_index": "http://web:8000/"},
     ["--index-url", "http://web:8000/torch2.14-cu130/simple/"]),
    ({"build_through_index": "http://web:8000", "torch_find_links": "/w"},
     ["--index-url", "http://web:8000/torch2.14-cu130/simple/", "--find-links", "/w"]),
])
def test_index_args(settings: dict[str, str], expected: list[str]) -> None:
    assert index_args(Config(**settings), VARIANT) == expected  # type: ignore[arg-type]
