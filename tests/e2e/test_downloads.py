"""Wheel downloads through a real ``wheelhouse serve`` (gunicorn): local files go out through
gunicorn's file wrapper with ``sendfile`` (whole and ranged), with the same bytes and headers
as ever; the reverse-proxy modes answer with the proxy's header and no body.

That ``sendfile`` is what sent the bytes is read from the kernel's own count of the server's
read calls (``/proc/<pid>/io`` ``syscr``): copying a file through Python costs one ``read``
per MiB, ``sendfile`` one call for the whole answer, whatever its size.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.helpers import IndexURL, make_wheel, start_index
from wheelhouse.config import Config
from wheelhouse.index.catalog import Record
from wheelhouse.index.publish import publish
from wheelhouse.variants import parse_variant

VARIANT = "torch2.8-cu128"
#: Big enough that copying it through Python would take dozens of reads.
PAYLOAD_MIB = 24


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = parse_variant(VARIANT)
    out = tmp_path_factory.mktemp("big-wheel")
    make_wheel(out, "big-ext", f"1.0+{base.local_label}",
               payload=os.urandom(PAYLOAD_MIB * 1024 * 1024))  # random: the zip stays big
    return out


def _publish(config: Config, wheel_dir: Path) -> tuple[Record, bytes]:
    from wheelhouse.index.storage import open_storage

    wheel = next(wheel_dir.glob("*.whl"))
    record = publish(open_storage(config), wheel, parse_variant(VARIANT))
    return record, wheel.read_bytes()


@pytest.fixture(scope="module")
def local_index(wheel_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[IndexURL, Record,
                                                                            bytes]]:
    tmp = tmp_path_factory.mktemp("downloads")
    # One worker, and no catalog refreshes while reads are counted.
    config = Config(storage=str(tmp / "data"), upstream="off", catalog_refresh_seconds=3600)
    record, data = _publish(config, wheel_dir)
    with start_index(config, tmp, workers=1) as url:
        yield url, record, data


def _url(url: str, r: Record) -> str:
    return f"{url}/files/{VARIANT}/{r.project}/{r.filename}"


def _read_calls(index: IndexURL) -> int:
    """The server's worker processes' ``read`` system calls so far that were not ``sendfile``.

    The kernel counts a ``sendfile`` call as one read and one write (``syscr`` and ``syscw``);
    a copy through Python reads the file (``syscr``) and sends to the socket with ``send``,
    which ``syscw`` does not count. gevent's worker sends with ``sendfile`` on a non-blocking
    socket, so one download is a few dozen calls (one per send buffer), each a read and a
    write: reads less writes leaves the reads that copied the file through Python.
    """
    workers = psutil.Process(index.proc.pid).children(recursive=True)
    counters = [p.io_counters() for p in workers]
    return sum(c.read_count - c.write_count for c in counters)


@pytest.mark.parametrize(("headers", "status", "span"), [
    ({}, 200, (0, None)),
    ({"Range": "bytes=0-99"}, 206, (0, 100)),
    ({"Range": "bytes=1000000-3999999"}, 206, (1_000_000, 4_000_000)),
    ({"Range": "bytes=-70000"}, 206, (-70_000, None)),
    ({"Range": "bytes=5000000-"}, 206, (5_000_000, None)),
])
def test_local_downloads_are_the_right_bytes_and_headers(
        local_index: tuple[IndexURL, Record, bytes], headers: dict[str, str], status: int,
        span: tuple[int, int | None]) -> None:
    url, record, data = local_index
    expected = data[span[0]:span[1]]
    resp = requests.get(_url(url, record), headers=headers, timeout=30)
    assert resp.status_code == status
    assert resp.content == expected
    assert resp.headers["Content-Length"] == str(len(expected))
    assert resp.headers["ETag"] == f'"{record.sha256}"'
    assert resp.headers["Accept-Ranges"] == "bytes"
    if status == 206:
        start = span[0] % len(data)
        assert resp.headers["Content-Range"] == \
            f"bytes {start}-{start + len(expected) - 1}/{len(data)}"
    # A second request on the same connection still works after sendfile (keep-alive).
    with requests.Session() as session:
        first = session.get(_url(url, record), headers=headers, timeout=30)
        second = session.head(_url(url, record), timeout=30)
    assert first.content == expected
    assert second.headers["Content-Length"] == str(len(data))


def test_local_wheel_bytes_never_pass_through_python(
        local_index: tuple[IndexURL, Record, bytes]) -> None:
    url, record, data = local_index
    # A first request imports what a download needs; count only a second one's reads.
    requests.get(_url(url, record), headers={"Range": "bytes=0-9"}, timeout=30)
    before = _read_calls(url)
    body = requests.get(_url(url, record), timeout=30).content
    reads = _read_calls(url) - before
    assert hashlib.sha256(body).hexdigest() == record.sha256
    # Python's copy would read PAYLOAD_MIB times (1 MiB at a time, gevent's own sendfile
    # 8 KiB at a time); sendfile calls are no read of Python's.
    assert reads < PAYLOAD_MIB // 3, f"{reads} read calls for a {len(data)}-byte download"


@pytest.mark.parametrize(("mode", "header"), [
    ("x-accel-redirect", "X-Accel-Redirect"),
    ("x-sendfile", "X-Sendfile"),
])
def test_proxy_modes_answer_with_the_header_and_no_body(
        wheel_dir: Path, tmp_path: Path, mode: str, header: str) -> None:
    config = Config(storage=str(tmp_path / "data"), upstream="off", local_file_mode=mode,
                    accel_redirect_prefix="/_storage/")
    record, data = _publish(config, wheel_dir)
    with start_index(config, tmp_path, workers=1) as url:
        for method in ("GET", "HEAD"):
            resp = requests.request(method, _url(url, record),
                                    headers={"Range": "bytes=0-99"}, timeout=30)
            assert resp.status_code == 200  # the proxy answers the range from the file
            assert resp.content == b""
            assert resp.headers["ETag"] == f'"{record.sha256}"'
            assert resp.headers["Content-Type"] == "application/octet-stream"
            if mode == "x-accel-redirect":
                assert resp.headers[header] == f"/_storage/{record.wheel_key}"
            else:
                target = Path(resp.headers[header])
                assert target.is_absolute()
                assert target.read_bytes() == data
