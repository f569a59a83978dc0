"""Fixtures for core tests: real upstream sdists from PyPI, and a real storage behind hooks."""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import pypi_sdist
from wheelhouse.index.storage import ByteStream, ObjectInfo, Storage, Tagged


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


class ForwardingStorage(Storage):
    """A real storage with hooks: every call goes on to ``inner``, after :meth:`before_read`
    (reads, listings, ping) or :meth:`before_write` (writes) where a test wants to watch,
    block or fail a call. Deletions go straight through."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def before_read(self, key: str) -> None:
        """Called before each read of ``key`` (a prefix for a listing, "" for ping)."""

    def before_write(self, key: str) -> None:
        """Called before each write of ``key``."""

    def put_file(self, key: str, path: Path) -> None:
        self.before_write(key)
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        self.before_write(key)
        self.inner.put_bytes(key, data, exclusive=exclusive)

    def replace_bytes(self, key: str, data: bytes, *, tag: str) -> None:
        self.before_write(key)
        self.inner.replace_bytes(key, data, tag=tag)

    def get_bytes(self, key: str) -> bytes:
        self.before_read(key)
        return self.inner.get_bytes(key)

    def read_tagged(self, key: str) -> Tagged:
        self.before_read(key)
        return self.inner.read_tagged(key)

    def open_range(self, key: str, start: int, stop: int) -> ByteStream:
        self.before_read(key)
        return self.inner.open_range(key, start, stop)

    def stat(self, key: str) -> ObjectInfo:
        self.before_read(key)
        return self.inner.stat(key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.before_read(prefix)
        return self.inner.list(prefix)

    def delete(self, key: str, *, tag: str | None = None) -> None:
        self.inner.delete(key, tag=tag)

    def list_partials(self) -> Iterator[ObjectInfo]:
        return self.inner.list_partials()

    def delete_partial(self, key: str) -> None:
        self.inner.delete_partial(key)

    def ping(self) -> None:
        self.before_read("")
        self.inner.ping()
