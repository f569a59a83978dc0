"""Both storages, LocalStorage and S3Storage on a real S3 API server, give the same guarantees."""

from __future__ import annotations

import hashlib
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from wheelhouse.config import Config
from wheelhouse.errors import StorageError
from wheelhouse.storage import (
    LocalStorage,
    ObjectInfo,
    S3Storage,
    Storage,
    check_key,
    make_s3_client,
    open_storage,
)

DATA = bytes(range(256)) * 40  # 10 KiB, every byte value


@pytest.mark.parametrize("key", [
    "generation",
    "a/b",
    "wheels/torch2.8-cu128/flash-attn/flash_attn-2.8.3+cu128torch2.8-cp312-cp312-linux_x86_64.whl",
    "wheels/torch2.8-cu128/flash-attn/flash_attn-2.8.3+cu128torch2.8-cp312-cp312-linux_x86_64"
    ".whl.metadata",
    "records/torch2.8-cu128-sm90/x/x-1.0-py3-none-any.whl.json",
    "a=b/c_d/...",
])
def test_check_key_accepts(key: str) -> None:
    assert check_key(key) == key


BAD_KEYS = [
    "", "/", "/etc/passwd", "a/", "/a", "a//b", ".", "..", "../a", "a/../b", "a/..", "a/./b",
    "a\\b", "..\\a", "%2e%2e/a", "a%2fb", "a b", "a\nb", "a\x00b", "caf\u00e9", "a?b", "a#b",
    "a:b", "~", "a/~/b", "*",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_check_key_refuses(key: str) -> None:
    with pytest.raises(ValueError, match="invalid storage key"):
        check_key(key)


@pytest.mark.parametrize("key", ["../escaped", "a/../../escaped", "/tmp/escaped", ""])
def test_every_method_refuses_a_bad_key(storage: Storage, tmp_path: Path, key: str) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x")
    calls: list[Callable[[], object]] = [
        lambda: storage.put_bytes(key, b"x"),
        lambda: storage.put_bytes(key, b"x", exclusive=True),
        lambda: storage.put_file(key, src),
        lambda: storage.get_bytes(key),
        lambda: list(storage.iter_range(key, 0, 1)),
        lambda: storage.stat(key),
        lambda: storage.exists(key),
        lambda: storage.delete(key),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="invalid storage key"):
            call()
    assert not (tmp_path / "escaped").exists()


def test_local_delete_and_list_stay_inside_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    storage = LocalStorage(tmp_path / "data")
    storage.put_bytes("a/b", b"x")
    with pytest.raises(ValueError):
        storage.delete("../outside")
    with pytest.raises(ValueError):
        list(storage.list("../"))
    assert outside.read_bytes() == b"keep me"


def test_put_get_stat(storage: Storage) -> None:
    before = time.time()
    storage.put_bytes("dir/sub/obj", DATA)
    assert storage.get_bytes("dir/sub/obj") == DATA
    info = storage.stat("dir/sub/obj")
    assert info.key == "dir/sub/obj"
    assert info.size == len(DATA)
    assert before - 5 <= info.mtime <= time.time() + 5
    assert storage.exists("dir/sub/obj")


def test_put_bytes_overwrites_unless_exclusive(storage: Storage) -> None:
    storage.put_bytes("k", b"one")
    storage.put_bytes("k", b"two")
    assert storage.get_bytes("k") == b"two"
    with pytest.raises(FileExistsError):
        storage.put_bytes("k", b"three", exclusive=True)
    assert storage.get_bytes("k") == b"two"


def test_exclusive_put_creates_once(storage: Storage) -> None:
    storage.put_bytes("records/x.json", b"first", exclusive=True)
    for attempt in (b"first", b"second"):
        with pytest.raises(FileExistsError):
            storage.put_bytes("records/x.json", attempt, exclusive=True)
    assert storage.get_bytes("records/x.json") == b"first"
    assert [o.key for o in storage.list("records/")] == ["records/x.json"]


def test_put_file_and_download(storage: Storage, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(DATA)
    storage.put_file("files/src.bin", src)
    dest = tmp_path / "dest.bin"
    storage.download("files/src.bin", dest)
    assert dest.read_bytes() == DATA
    assert storage.stat("files/src.bin").size == len(DATA)


def test_big_put_file_round_trips(storage: Storage, tmp_path: Path) -> None:
    # Past boto3's 8 MiB multipart threshold: the stored object is whole, and its size and
    # bytes are the file's.
    src = tmp_path / "big.whl"
    data = os.urandom(9 * 1024 * 1024 + 123)
    src.write_bytes(data)
    storage.put_file("big/big.whl", src)
    assert storage.stat("big/big.whl").size == len(data)
    h = hashlib.sha256()
    for chunk in storage.iter_range("big/big.whl", 0, len(data)):
        h.update(chunk)
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("start", "stop"), [
    (0, len(DATA)),
    (0, 1),
    (1, 2),
    (100, 5000),
    (len(DATA) - 1, len(DATA)),
    (len(DATA) - 10, len(DATA) + 100),   # past the end: what there is
    (0, len(DATA) * 2),
    (5, 5),                              # empty
    (7, 3),                              # inverted: empty
    (len(DATA), len(DATA) + 10),         # starts at the end: empty
    (len(DATA) + 10, len(DATA) + 20),
])
def test_iter_range(storage: Storage, start: int, stop: int) -> None:
    storage.put_bytes("r", DATA)
    assert b"".join(storage.iter_range("r", start, stop)) == DATA[start:stop]


def _keys(infos: list[ObjectInfo]) -> set[str]:
    return {o.key for o in infos}


@pytest.mark.parametrize(("prefix", "expected"), [
    ("", {"a/x", "a/b/y", "ab/z", "c"}),
    ("a/", {"a/x", "a/b/y"}),
    ("a/b/", {"a/b/y"}),
    ("a/b", {"a/b/y"}),
    ("a", {"a/x", "a/b/y", "ab/z"}),
    ("ab/", {"ab/z"}),
    ("a/x", {"a/x"}),
    ("c", {"c"}),
    ("nothing/", set()),
    ("nothing", set()),
    ("a/b/y/", set()),
])
def test_list_by_key_prefix(storage: Storage, prefix: str, expected: set[str]) -> None:
    for key in ("a/x", "a/b/y", "ab/z", "c"):
        storage.put_bytes(key, key.encode())
    infos = list(storage.list(prefix))
    assert _keys(infos) == expected
    assert len(infos) == len(expected)
    for info in infos:
        assert info.size == len(info.key)


def test_list_many(storage: Storage) -> None:
    # More than one page of list_objects_v2 (1000 keys) on S3.
    keys = {f"many/{i:05d}" for i in range(1010)}
    if isinstance(storage, S3Storage):
        for key in keys:
            storage.client.put_object(Bucket=storage.bucket, Key=storage.prefix + key, Body=b"")
    else:
        for key in keys:
            storage.put_bytes(key, b"")
    assert _keys(list(storage.list("many/"))) == keys


def test_delete(storage: Storage) -> None:
    storage.put_bytes("d/one", b"1")
    storage.put_bytes("d/two", b"2")
    storage.delete("d/one")
    assert not storage.exists("d/one")
    assert _keys(list(storage.list("d/"))) == {"d/two"}
    storage.delete("d/one")  # deleting what is gone is fine
    storage.delete("never/was")


@pytest.mark.parametrize("key", ["missing", "no/such/key", "dir"])
def test_missing_keys_raise_file_not_found(storage: Storage, tmp_path: Path, key: str) -> None:
    storage.put_bytes("dir/inside", b"x")  # "dir" is a folder locally, but never an object
    with pytest.raises(FileNotFoundError):
        storage.get_bytes(key)
    with pytest.raises(FileNotFoundError):
        storage.stat(key)
    with pytest.raises(FileNotFoundError):
        list(storage.iter_range(key, 0, 10))
    with pytest.raises(FileNotFoundError):
        storage.download(key, tmp_path / "dest")
    assert not storage.exists(key)


def test_ping(storage: Storage) -> None:
    storage.ping()


def test_ping_missing_bucket(s3_config: Config) -> None:
    storage = S3Storage(make_s3_client(s3_config), "no-such-bucket-here")
    with pytest.raises(StorageError, match="no-such-bucket-here"):
        storage.ping()


def test_local_ping_creates_the_root(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "new" / "root")
    storage.ping()
    assert (tmp_path / "new" / "root").is_dir()


def test_local_has_no_presigned_url(local_storage: LocalStorage) -> None:
    local_storage.put_bytes("f", b"x")
    assert local_storage.presigned_url("f", 60) is None


def test_s3_presigned_url_downloads_the_object(s3_storage: S3Storage) -> None:
    s3_storage.put_bytes("wheels/v/p/p-1.0+cu128torch2.8-py3-none-any.whl", DATA)
    url = s3_storage.presigned_url("wheels/v/p/p-1.0+cu128torch2.8-py3-none-any.whl", 60)
    assert url is not None and url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=30) as resp:  # a plain GET, no credentials
        assert resp.status == 200
        assert resp.read() == DATA
    ranged = requests.get(url, headers={"Range": "bytes=10-19"}, timeout=30)
    assert ranged.status_code == 206
    assert ranged.content == DATA[10:20]
    # Without the signature the bucket is not readable.
    bare = requests.get(url.split("?", 1)[0], timeout=30)
    assert bare.status_code == 403


def test_s3_prefix_isolates_indexes(s3_config: Config) -> None:
    client = make_s3_client(s3_config)
    bucket = s3_config.storage.removeprefix("s3://").split("/")[0]
    one = S3Storage(client, bucket, "one")
    two = S3Storage(client, bucket, "/two/")
    one.put_bytes("k", b"1")
    two.put_bytes("k", b"2")
    assert (one.get_bytes("k"), two.get_bytes("k")) == (b"1", b"2")
    assert [o.key for o in one.list("")] == ["k"]
    stored = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert stored == {"one/k", "two/k"}


def test_local_skips_partial_writes(local_storage: LocalStorage) -> None:
    local_storage.put_bytes("w/a", b"a")
    (local_storage.root / "w" / ".tmp-abc.part").write_bytes(b"half")
    assert _keys(list(local_storage.list("w/"))) == {"w/a"}
    assert [o.key for o in local_storage.list_partials()] == ["w/.tmp-abc.part"]


def test_s3_lists_unfinished_multipart_uploads(s3_storage: S3Storage) -> None:
    up = s3_storage.client.create_multipart_upload(Bucket=s3_storage.bucket,
                                                   Key=s3_storage.prefix + "w/big.whl")
    assert [o.key for o in s3_storage.list_partials()] == [f"w/big.whl?uploadId={up['UploadId']}"]
    assert list(s3_storage.list("w/")) == []


@pytest.mark.parametrize(("url", "kind", "where"), [
    ("s3://bucket-a/some/prefix", S3Storage, ("bucket-a", "some/prefix/")),
    ("s3://bucket-a", S3Storage, ("bucket-a", "")),
    ("s3://bucket-a/", S3Storage, ("bucket-a", "")),
    ("{tmp}/data", LocalStorage, None),
    ("file://{tmp}/data", LocalStorage, None),
])
def test_open_storage(
    tmp_path: Path, s3_env: dict[str, str], url: str, kind: type[Storage],
    where: tuple[str, str] | None,
) -> None:
    storage = open_storage(Config(storage=url.format(tmp=tmp_path),
                                  s3_endpoint_url="http://127.0.0.1:9"))
    assert isinstance(storage, kind)
    if isinstance(storage, S3Storage):
        assert (storage.bucket, storage.prefix) == where
    else:
        assert isinstance(storage, LocalStorage)
        assert storage.root == tmp_path / "data"


def test_open_storage_resolves_relative_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    storage = open_storage(Config(storage="./rel"))
    assert isinstance(storage, LocalStorage)
    assert storage.root == tmp_path / "rel"


@pytest.mark.parametrize("url", ["s3://", "s3:///prefix", "http://example.com/x", "gs://b/p"])
def test_open_storage_refuses(url: str) -> None:
    with pytest.raises(ValueError, match="WHEELHOUSE_STORAGE"):
        open_storage(Config(storage=url))
