"""File downloads: integrity, caching headers, HEAD, ranges, and names that must not resolve."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import make_wheel
from tests.web.conftest import VARIANT, Outage
from wheelhouse.config import Config
from wheelhouse.index.catalog import CATCH_UP, Record
from wheelhouse.index.layout import wheel_key
from wheelhouse.index.storage import open_storage
from wheelhouse.variants import parse_variant


def _url(r: Record) -> str:
    return f"/files/{VARIANT}/{r.project}/{r.filename}"


def test_download_matches_record(client: FlaskClient, published: list[Record]) -> None:
    r = published[0]
    resp = client.get(_url(r))
    assert resp.status_code == 200
    assert hashlib.sha256(resp.data).hexdigest() == r.sha256
    assert resp.headers["Content-Length"] == str(r.size)
    assert resp.headers["Accept-Ranges"] == "bytes"
    assert resp.headers["ETag"] == f'"{r.sha256}"'
    assert resp.headers["Cache-Control"] == "max-age=31536000, immutable, public"


def test_metadata_file(client: FlaskClient, published: list[Record]) -> None:
    r = published[0]
    resp = client.get(_url(r) + ".metadata")
    assert resp.status_code == 200
    assert hashlib.sha256(resp.data).hexdigest() == r.metadata_sha256
    assert resp.data.startswith(b"Metadata-Version:")
    assert b"Version: 1.0+cu128torch2.8" in resp.data


def test_head_has_length_and_no_body(client: FlaskClient, published: list[Record]) -> None:
    r = published[0]
    resp = client.head(_url(r))
    assert resp.status_code == 200
    assert resp.headers["Content-Length"] == str(r.size)
    assert resp.data == b""


@pytest.mark.parametrize(
    ("header", "status", "span"),
    [
        ("bytes=0-99", 206, (0, 100)),
        ("bytes=100-", 206, (100, None)),
        ("bytes=-50", 206, (-50, None)),
        ("bytes=0-0", 206, (0, 1)),
        ("bytes=0-999999999", 206, (0, None)),  # clamped to the end
        ("bytes=-999999999", 206, (0, None)),  # a suffix longer than the file: all of it
        ("bytes=999999999-", 416, None),
        ("bytes=5-2", 200, (0, None)),  # malformed: ignored, whole file
        ("bytes=0-1,5-6", 200, (0, None)),  # multipart ranges: served whole
        ("items=0-1", 200, (0, None)),
    ],
)
def test_ranges(client: FlaskClient, published: list[Record], header: str, status: int,
                span: tuple[int, int | None] | None) -> None:
    r = published[0]
    whole = client.get(_url(r)).data
    resp = client.get(_url(r), headers={"Range": header})
    assert resp.status_code == status, resp.data[:200]
    if status == 416:
        assert resp.headers["Content-Range"] == f"bytes */{r.size}"
        return
    assert span is not None
    expected = whole[span[0]:span[1]] if span[0] >= 0 else whole[span[0]:]
    assert resp.data == expected
    assert resp.headers["Content-Length"] == str(len(expected))
    if status == 206:
        start = span[0] if span[0] >= 0 else r.size + span[0]
        end = start + len(expected) - 1
        assert resp.headers["Content-Range"] == f"bytes {start}-{end}/{r.size}"


def test_if_range_mismatch_serves_whole_file(client: FlaskClient, published: list[Record]) -> None:
    r = published[0]
    resp = client.get(_url(r), headers={"Range": "bytes=0-9", "If-Range": '"stale"'})
    assert resp.status_code == 200
    assert len(resp.data) == r.size


def test_304_on_matching_etag(client: FlaskClient, published: list[Record]) -> None:
    r = published[0]
    resp = client.get(_url(r), headers={"If-None-Match": f'"{r.sha256}"'})
    assert resp.status_code == 304


def test_unpublished_wheel_is_not_served(app_config: Config, client: FlaskClient,
                                         published: list[Record], tmp_path: Path) -> None:
    """A wheel whose record was never written (an interrupted publish) does not exist."""
    base = parse_variant(VARIANT)
    w = make_wheel(tmp_path / "p", "demo-ext", "9.9+cu128torch2.8")
    open_storage(app_config).put_file(wheel_key(base, "demo-ext", w.name), w)
    assert client.get(f"/files/{VARIANT}/demo-ext/{w.name}").status_code == 404
    page = client.get(f"/{VARIANT}/simple/demo-ext/").get_data(as_text=True)
    assert w.name not in page


@pytest.mark.parametrize(
    "path",
    [
        "/files/torch2.8-cu128/demo-ext/..%2F..%2Fgeneration",
        "/files/torch2.8-cu128/demo-ext/%2e%2e",
        "/files/torch2.8-cu128/demo-ext/../../generation",
        "/files/torch2.8-cu128/..%2Frecords/x.whl",
        "/files/torch2.8-cu128/demo-ext/demo_ext-1.0.tar.gz",
        "/files/torch2.8-cu128/demo-ext/" + "a" * 4000 + ".whl",
        "/files/torch2.8-cu128/Demo_Ext/demo_ext-1.0+cu128torch2.8-cp311-cp311-linux_x86_64.whl",
        "/files/torch2.8-cu128-sm90/demo-ext/demo_ext-1.0+cu128torch2.8-cp311-cp311-linux_x86_64.whl",
        "/files/torch2.8-cu128/other/demo_ext-1.0+cu128torch2.8-cp311-cp311-linux_x86_64.whl",
        "/files/nope/demo-ext/x.whl",
        "/files/torch2.8-cu128/demo-ext/demo_ext-1.0+cu128torch2.8-cp311-cp311-linux_x86_64.whl.json",
    ],
)
def test_hostile_file_names(client: FlaskClient, published: list[Record], path: str) -> None:
    resp = client.get(path)
    assert 400 <= resp.status_code < 500, (path, resp.status_code)
    assert b"Traceback" not in resp.data


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@pytest.mark.parametrize(("damage", "what"), [
    ("truncate", "is {n} bytes in storage, {size} in its record"),
    ("extend", "is {n} bytes in storage, {size} in its record"),
    ("delete", "is missing from storage"),
])
@pytest.mark.parametrize(("method", "headers"), [
    ("GET", {}), ("HEAD", {}), ("GET", {"Range": "bytes=0-99"}), ("GET", {"Range": "bytes=-10"}),
])
def test_a_wheel_whose_stored_size_is_wrong_answers_503(
    app_config: Config, client: FlaskClient, published: list[Record],
    caplog: pytest.LogCaptureFixture, damage: str, what: str, method: str,
    headers: dict[str, str],
) -> None:
    """Never a short 200, never a closed connection: 503 before the first byte, and a log."""
    r = published[0]
    storage = open_storage(app_config)
    if damage == "delete":
        storage.delete(r.wheel_key)
    else:
        whole = storage.get_bytes(r.wheel_key)
        storage.put_bytes(r.wheel_key, whole[:-7] if damage == "truncate" else whole + b"x")
        what = what.format(n=r.size - 7 if damage == "truncate" else r.size + 1, size=r.size)
    with caplog.at_level(logging.ERROR, logger="web.errors"):
        resp = client.open(_url(r), method=method, headers=headers)
    assert resp.status_code == 503
    assert resp.headers["Retry-After"] == "10"
    if method == "GET":
        assert what in resp.get_data(as_text=True) and "republished" in resp.get_data(as_text=True)
    assert f"503 on {method} {_url(r)}: {r.wheel_key} {what}" in caplog.text


def test_a_flipped_byte_of_the_same_size_is_served_for_the_client_to_catch(
    app_config: Config, client: FlaskClient, published: list[Record]
) -> None:
    """Hashing every download would cost the index its speed: the size is checked, the hash is
    the client's (uv and pip check it against the page) and wheelhouse verify's."""
    r = published[0]
    storage = open_storage(app_config)
    storage.put_bytes(r.wheel_key, _flip(storage.get_bytes(r.wheel_key), 50))
    resp = client.get(_url(r))
    assert resp.status_code == 200 and len(resp.data) == r.size
    assert hashlib.sha256(resp.data).hexdigest() != r.sha256


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_damaged_metadata_answers_503_and_is_never_kept(
    app_config: Config, client: FlaskClient, published: list[Record], damage: str
) -> None:
    r = published[0]
    storage = open_storage(app_config)
    good = storage.get_bytes(r.metadata_key)
    if damage == "delete":
        storage.delete(r.metadata_key)
    else:
        storage.put_bytes(r.metadata_key, _flip(good, 3))
    for _ in range(2):
        resp = client.get(_url(r) + ".metadata")
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "10"
    storage.put_bytes(r.metadata_key, good)
    resp = client.get(_url(r) + ".metadata")
    assert resp.status_code == 200 and hashlib.sha256(resp.data).hexdigest() == r.metadata_sha256


def test_downloads_answer_503_while_storage_is_down(
    app: Flask, client: FlaskClient, published: list[Record], outage: Outage
) -> None:
    r = published[0]
    client.get(f"/{VARIANT}/simple/demo-ext/")  # the catalog is loaded
    outage.begin()
    for path in (_url(r), _url(r) + ".metadata", _url(published[1])):
        resp = client.get(path)
        assert resp.status_code == 503, path
        assert resp.headers["Retry-After"] == "10"
        assert b"Traceback" not in resp.data
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'wheelhouse_storage_errors_total{kind=' in metrics
    outage.end()
    # The first request after storage returns starts a refresh and, storage having failed,
    # does not wait for it: downloads are back once it has succeeded.
    deadline = time.monotonic() + 10
    while (resp := client.get(_url(r))).status_code == 503:
        assert time.monotonic() < deadline, "downloads did not come back"
        time.sleep(0.05)
    assert resp.status_code == 200 and hashlib.sha256(resp.data).hexdigest() == r.sha256


def test_a_file_another_worker_just_listed_is_served(app_config: Config, tmp_path: Path,
                                                     published: list[Record]) -> None:
    """Two gunicorn workers refresh on their own: a page from one lists a new wheel, and the
    other, not yet due for a refresh, serves it instead of a 404."""
    from web import create_app

    worker_a = create_app(app_config).test_client()
    worker_b = create_app(app_config.replace(catalog_refresh_seconds=3600)).test_client()
    assert worker_b.get(_url(published[0])).status_code == 200  # B has read the catalog
    w = make_wheel(tmp_path / "new", "demo-ext", "2.0+cu128torch2.8")
    from wheelhouse.index.publish import publish

    record = publish(open_storage(app_config), w, parse_variant(VARIANT))
    assert record.filename in worker_a.get(f"/{VARIANT}/simple/demo-ext/").get_data(as_text=True)
    time.sleep(CATCH_UP)  # B's own refresh (at its start) may be that recent: no sooner
    for suffix in (".metadata", ""):
        resp = worker_b.get(_url(record) + suffix)
        assert resp.status_code == 200, suffix


@pytest.mark.parametrize("mode", ["x-accel-redirect", "x-sendfile"])
def test_proxy_modes_check_the_stored_size_and_leave_s3_alone(
    app_config: Config, published: list[Record], mode: str
) -> None:
    """A proxy is sent only to a file whose size is its record's; S3 objects, which no proxy
    can read from a path, still stream."""
    from web import create_app

    r = published[0]
    client = create_app(app_config.replace(local_file_mode=mode)).test_client()
    resp = client.get(_url(r), headers={"Range": "bytes=0-99"})
    storage = open_storage(app_config)
    if storage.local_path(r.wheel_key) is None:
        assert resp.status_code == 206 and len(resp.data) == 100
        assert "X-Accel-Redirect" not in resp.headers and "X-Sendfile" not in resp.headers
        return
    assert resp.status_code == 200 and resp.data == b""
    assert ("X-Accel-Redirect" in resp.headers) == (mode == "x-accel-redirect")
    assert ("X-Sendfile" in resp.headers) == (mode == "x-sendfile")
    storage.put_bytes(r.wheel_key, storage.get_bytes(r.wheel_key)[:-1])
    resp = client.get(_url(r))
    assert resp.status_code == 503
    assert f"is {r.size - 1} bytes in storage, {r.size} in its record" in resp.get_data(True)


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("local_file_mode", "nginx", "WHEELHOUSE_LOCAL_FILE_MODE must be one of sendfile"),
    ("s3_file_mode", "presign", "WHEELHOUSE_S3_FILE_MODE must be one of stream, redirect"),
    ("accel_redirect_prefix", "internal", "WHEELHOUSE_ACCEL_REDIRECT_PREFIX must start and end"),
])
def test_unknown_file_modes_are_refused_at_start(tmp_path: Path, setting: str, value: str,
                                                 message: str) -> None:
    from web import create_app

    config = Config(storage=str(tmp_path / "data"), local_file_mode="x-accel-redirect")
    with pytest.raises(ValueError, match=message):
        create_app(config.replace(**{setting: value}))
