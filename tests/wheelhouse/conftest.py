"""Fixtures for core tests that need real upstream sdists from PyPI."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import pypi_sdist


@pytest.fixture(scope="session")
def real_sdist() -> Callable[[str, str], Path]:
    """Downloads (once per machine, see ``SDIST_CACHE``) a real sdist from PyPI; skips with the
    reason when PyPI can't be reached."""

    import requests

    def get(project: str, version: str) -> Path:
        try:
            return pypi_sdist(project, version)
        except (requests.ConnectionError, requests.Timeout) as exc:
            pytest.skip(f"PyPI is unreachable, so {project} {version}'s sdist can't be had: {exc}")

    return get


@pytest.fixture
def unpacked(real_sdist: Callable[[str, str], Path], tmp_path: Path) -> Callable[[str, str], Path]:
    """A fresh unpacked copy of a real sdist for one test; returns its top directory."""

    def unpack(project: str, version: str) -> Path:
        with tarfile.open(real_sdist(project, version)) as tf:
            tf.extractall(tmp_path, filter="data")
            top = {Path(n).parts[0] for n in tf.getnames()}
        assert len(top) == 1, top
        return tmp_path / top.pop()

    return unpack
