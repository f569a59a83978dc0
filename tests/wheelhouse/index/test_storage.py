"""Both storages, LocalStorage and S3Storage on a real S3 API server, give the same guarantees."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import pytest
import requests

from tests.helpers import QuietHandler, free_port, serve_http
from wheelhouse.config import Config
from wheelhouse.errors import StorageUnavailable
from wheelhouse.index.storage import (
    LocalStorage,
    ObjectInfo,
    S3Storage,
    Storage,
    check_key,
    make_s3_client,
    open_storage,
)
from wheelhouse.retry import S3_REQUESTS, RetryPolicy

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

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


def test_ping_tells_a_working_storage_from_a_broken_one(storage: Storage, tmp_path: Path) -> None:
    storage.ping()  # answers: no exception
    storage.put_bytes("after-ping", b"x")
    assert storage.get_bytes("after-ping") == b"x"
    broken = _broken_twin(storage, tmp_path)
    with pytest.raises(StorageUnavailable):
        broken.ping()


def _broken_twin(storage: Storage, tmp_path: Path) -> Storage:
    """The same kind of storage, unusable: a root that is a file, or nothing at the endpoint."""
    if isinstance(storage, LocalStorage):
        (tmp_path / "not-a-dir").write_bytes(b"")
        return LocalStorage(tmp_path / "not-a-dir")
    assert isinstance(storage, S3Storage)
    return S3Storage(_client(f"http://127.0.0.1:{free_port()}"), storage.bucket, storage.prefix)


def test_ping_missing_bucket(s3_config: Config) -> None:
    storage = S3Storage(make_s3_client(s3_config), "no-such-bucket-here")
    with pytest.raises(StorageUnavailable, match="no-such-bucket-here"):
        storage.ping()


# --- every backend error becomes a project error ---------------------------------------------

#: One attempt, short timeouts: failures show at once.
_IMPATIENT = RetryPolicy(attempts=1, timeout=1)


def _client(endpoint: str, policy: RetryPolicy = _IMPATIENT) -> S3Client:
    return make_s3_client(Config(storage="s3://b", s3_endpoint_url=endpoint), policy=policy)


def _operations(storage: Storage, tmp_path: Path) -> dict[str, Callable[[], object]]:
    src = tmp_path / "src.whl"
    src.write_bytes(DATA)
    return {
        "upload": lambda: storage.put_file("w/a.whl", src),
        "put": lambda: storage.put_bytes("w/a", b"x"),
        "put exclusive": lambda: storage.put_bytes("w/a", b"x", exclusive=True),
        "get": lambda: storage.get_bytes("w/a"),
        "range": lambda: list(storage.iter_range("w/a", 0, 10)),
        "head": lambda: storage.stat("w/a"),
        "exists": lambda: storage.exists("w/a"),
        "download": lambda: storage.download("w/a", tmp_path / "dest"),
        "list": lambda: list(storage.list("w/")),
        "delete": lambda: storage.delete("w/a"),
        "list uploads": lambda: list(storage.list_partials()),
        "abort upload": lambda: storage.delete_partial("w/a?uploadId=1"),
    }


def _assert_unavailable(call: Callable[[], object], *, bucket: str = "wheels") -> None:
    with pytest.raises(StorageUnavailable) as err:
        call()
    assert f"S3 bucket {bucket!r}" in str(err.value)
    # The vendor's exception is kept as the cause, for the logs, but is never what is raised.
    assert not type(err.value).__module__.startswith(("botocore", "boto3"))


def test_s3_unreachable_endpoint_is_unavailable_for_every_operation(tmp_path: Path,
                                                                    s3_env: dict[str, str]) -> None:
    storage = S3Storage(_client(f"http://127.0.0.1:{free_port()}"), "wheels", "idx")
    for name, call in _operations(storage, tmp_path).items():
        with pytest.raises(StorageUnavailable, match="Could not connect") as err:
            call()
        assert "S3 bucket 'wheels'" in str(err.value), name


def test_s3_silent_endpoint_times_out_into_unavailable(tmp_path: Path,
                                                       s3_env: dict[str, str]) -> None:
    # A socket that listens but never answers: connections succeed (the kernel's backlog),
    # requests never get a reply, so only the read timeout ends them.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        storage = S3Storage(_client(f"http://127.0.0.1:{silent.getsockname()[1]}"), "wheels")
        started = time.monotonic()
        with pytest.raises(StorageUnavailable, match="timeout"):
            storage.get_bytes("w/a")
        assert time.monotonic() - started < 30


class _Overloaded(QuietHandler):
    """An S3 endpoint that answers every request with 503 SlowDown."""

    requests: ClassVar[int] = 0

    def _answer(self) -> None:
        type(self).requests += 1
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>")
        self.send_body(body if self.command != "HEAD" else b"", "application/xml", status=503)

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _answer


def test_s3_throttling_is_retried_by_the_policy_then_unavailable(tmp_path: Path,
                                                                 s3_env: dict[str, str]) -> None:
    with serve_http(_Overloaded) as url:
        storage = S3Storage(_client(url, RetryPolicy(attempts=3, timeout=5)), "wheels")
        _Overloaded.requests = 0
        with pytest.raises(StorageUnavailable, match="SlowDown") as err:
            storage.put_bytes("w/a", b"x")
        assert _Overloaded.requests == 3  # the policy's attempts, by botocore's own backoff
        assert "put w/a" in str(err.value)
        once = S3Storage(_client(url), "wheels")
        for call in _operations(once, tmp_path).values():
            _assert_unavailable(call)


def test_s3_missing_bucket_is_unavailable_but_a_missing_key_is_not_found(
        s3_storage: S3Storage, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        s3_storage.get_bytes("no/such/key")
    gone = S3Storage(s3_storage.client, "no-such-bucket-here", "idx")
    for name, call in _operations(gone, tmp_path).items():
        if name in ("delete", "abort upload"):
            continue  # moto answers these without looking for the bucket
        if name in ("head", "exists", "download"):
            continue  # a HEAD's 404 has no body to tell a bucket from a key: see ping
        with pytest.raises(StorageUnavailable, match="NoSuchBucket"):
            call()


def test_s3_client_attempts_and_timeouts_come_from_the_policy() -> None:
    client = _client("http://127.0.0.1:9", RetryPolicy(attempts=3, timeout=7))
    assert client.meta.config.retries["total_max_attempts"] == 3
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (7, 7)
    default = make_s3_client(Config(storage="s3://b", s3_endpoint_url="http://127.0.0.1:9"))
    assert default.meta.config.retries["total_max_attempts"] == S3_REQUESTS.attempts == 2
    # The Config's few seconds, never botocore's own minute: a hung S3 must not hang the index.
    assert (default.meta.config.connect_timeout, default.meta.config.read_timeout) == (2, 5)
    tuned = make_s3_client(Config(storage="s3://b", s3_endpoint_url="http://127.0.0.1:9",
                                  storage_connect_timeout=0.5, storage_read_timeout=1.5))
    assert (tuned.meta.config.connect_timeout, tuned.meta.config.read_timeout) == (0.5, 1.5)


def test_local_storage_whose_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    storage = LocalStorage(tmp_path / "file")
    src = tmp_path / "src"
    src.write_bytes(b"x")
    for write in (lambda: storage.put_bytes("a/b", b"x"),
                  lambda: storage.put_bytes("a", b"x", exclusive=True),
                  lambda: storage.put_file("a", src)):
        with pytest.raises(StorageUnavailable, match="cannot write"):
            write()
    # Reading through a file finds nothing, as on S3.
    with pytest.raises(FileNotFoundError):
        storage.get_bytes("a")
    with pytest.raises(FileNotFoundError):
        storage.stat("a/b")
    assert not storage.exists("a") and list(storage.list("")) == []


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
    local_storage.delete_partial("w/.tmp-abc.part")
    assert list(local_storage.list_partials()) == []
    assert local_storage.get_bytes("w/a") == b"a"
    with pytest.raises(ValueError, match="not a partial write"):
        local_storage.delete_partial("w/a")
    assert local_storage.exists("w/a")


def test_s3_lists_unfinished_multipart_uploads(s3_storage: S3Storage) -> None:
    up = s3_storage.client.create_multipart_upload(Bucket=s3_storage.bucket,
                                                   Key=s3_storage.prefix + "w/big.whl")
    assert [o.key for o in s3_storage.list_partials()] == [f"w/big.whl?uploadId={up['UploadId']}"]
    assert list(s3_storage.list("w/")) == []
    s3_storage.delete_partial(f"w/big.whl?uploadId={up['UploadId']}")
    assert list(s3_storage.list_partials()) == []
    s3_storage.delete_partial(f"w/big.whl?uploadId={up['UploadId']}")  # already gone: fine
    with pytest.raises(ValueError, match="not an unfinished upload"):
        s3_storage.delete_partial("w/big.whl")


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


# --- compare-and-swap, and reads that know their size -----------------------------------------


def test_replace_bytes_swaps_only_the_version_read(storage: Storage) -> None:
    storage.put_bytes("claims/x", b"first")
    seen = storage.read_tagged("claims/x")
    assert seen.data == b"first"
    also_seen = storage.read_tagged("claims/x")
    assert also_seen.tag == seen.tag
    storage.replace_bytes("claims/x", b"second", tag=seen.tag)
    assert storage.get_bytes("claims/x") == b"second"
    # Whoever read "first" too has lost: the object changed under it.
    with pytest.raises(FileExistsError):
        storage.replace_bytes("claims/x", b"third", tag=also_seen.tag)
    assert storage.get_bytes("claims/x") == b"second"
    with pytest.raises(FileNotFoundError):
        storage.replace_bytes("claims/never", b"x", tag=seen.tag)
    with pytest.raises(FileNotFoundError):
        storage.read_tagged("claims/never")


def test_delete_with_a_tag_deletes_only_that_version(storage: Storage) -> None:
    storage.put_bytes("claims/y", b"one")
    old = storage.read_tagged("claims/y")
    storage.put_bytes("claims/y", b"two")
    with pytest.raises(FileExistsError):
        storage.delete("claims/y", tag=old.tag)
    assert storage.get_bytes("claims/y") == b"two"
    storage.delete("claims/y", tag=storage.read_tagged("claims/y").tag)
    assert not storage.exists("claims/y")
    storage.delete("claims/y", tag=old.tag)  # gone already: fine, as a plain delete


def test_racing_local_swaps_have_exactly_one_winner(local_storage: LocalStorage) -> None:
    """Eight threads read the same version and all try to replace it: one succeeds. (Local
    storage only: on S3 the atomicity is the server's If-Match, and moto's check-then-write
    is not atomic itself; the sequential test above covers our side of it.)"""
    storage = local_storage
    storage.put_bytes("claims/race", b"stale")
    tag = storage.read_tagged("claims/race").tag
    start = threading.Barrier(8)
    won: list[int] = []
    lost: list[int] = []

    def contend(n: int) -> None:
        start.wait()
        try:
            storage.replace_bytes("claims/race", f"holder {n}".encode(), tag=tag)
            won.append(n)
        except FileExistsError:
            lost.append(n)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(won) == 1 and len(lost) == 7
    assert storage.get_bytes("claims/race") == f"holder {won[0]}".encode()
    # The lock file of local storage is never an object.
    assert _keys(list(storage.list(""))) == {"claims/race"}


@pytest.mark.parametrize(("start", "stop"), [(0, len(DATA)), (10, 20), (0, 0),
                                             (len(DATA) + 5, len(DATA) + 9)])
def test_open_range_knows_the_whole_size_first(storage: Storage, start: int, stop: int) -> None:
    storage.put_bytes("w/r", DATA)
    with storage.open_range("w/r", start, stop) as stream:
        assert stream.size == len(DATA)
        assert b"".join(stream) == DATA[start:stop]


def test_open_range_of_a_missing_key_fails_before_any_byte(storage: Storage) -> None:
    with pytest.raises(FileNotFoundError):
        storage.open_range("w/none", 0, 10)  # at the call, not on the first iteration
    with pytest.raises(FileNotFoundError):
        storage.open_range("w/none", 0, 0)


def test_s3_calls_are_bounded_by_the_configured_timeouts(tmp_path: Path,
                                                        s3_env: dict[str, str]) -> None:
    """A silent S3 (accepts connections, never answers) fails each call as StorageUnavailable
    within about attempts x read timeout, whatever the call."""
    config = Config(storage="s3://wheels", storage_connect_timeout=1, storage_read_timeout=1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        config = config.replace(s3_endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}")
        storage = open_storage(config)
        bound = S3_REQUESTS.attempts * config.storage_read_timeout + 3  # + botocore's backoff
        for name, call in [("get", lambda: storage.get_bytes("w/a")),
                           ("range", lambda: storage.open_range("w/a", 0, 10)),
                           ("list", lambda: list(storage.list("records/"))),
                           ("ping", storage.ping)]:
            started = time.monotonic()
            with pytest.raises(StorageUnavailable):
                call()
            assert time.monotonic() - started < bound, name


def test_s3_presigned_urls_name_the_public_endpoint(s3_config: Config) -> None:
    """Inside compose the web reaches MinIO as ``minio:9000``; clients need the URL they can
    reach, signed for that host."""
    internal = s3_config.s3_endpoint_url or ""
    public = internal.replace("127.0.0.1", "localhost")
    storage = open_storage(s3_config.replace(s3_public_endpoint_url=public))
    key = "wheels/v/p/p-1.0+cu128torch2.8-py3-none-any.whl"
    storage.put_bytes(key, DATA)
    url = storage.presigned_url(key, 60)
    assert url is not None and url.startswith(public + "/")
    assert requests.get(url, timeout=30).content == DATA


@pytest.mark.parametrize(("start", "stop"), [(0, len(DATA)), (10, 20), (5, 10**9), (90, 90)])
def test_local_ranges_are_also_bounded_files(local_storage: LocalStorage, start: int,
                                             stop: int) -> None:
    """What a server's file wrapper gets: a descriptor at the range's start, and reads that
    end with the range."""
    local_storage.put_bytes("f", DATA)
    with local_storage.open_range("f", start, stop) as stream:
        file = stream.file
        assert file is not None
        assert os.lseek(file.fileno(), 0, os.SEEK_CUR) == start
        got = b"".join(iter(lambda: file.read(7), b""))
    assert got == DATA[start:stop]
