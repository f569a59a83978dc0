"""Where published files live: a local directory (the embedded default) or an S3 bucket.

Keys are ``/``-separated relative paths. Both implementations give the same guarantees:
``put_*`` is atomic per key (a reader sees the old object, or the whole new one),
``put_bytes(..., exclusive=True)`` refuses to overwrite, and :meth:`Storage.replace_bytes`
overwrites only the version a caller read (compare-and-swap), which the publish protocol relies
on. Each translates its own errors at the boundary (see :class:`Storage`): no botocore
exception leaves this module, and every S3 call is bounded by the configured timeouts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat as _stat
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

from botocore.exceptions import BotoCoreError, ClientError

from wheelhouse.errors import StorageError, StorageUnavailable
from wheelhouse.retry import S3_REQUESTS, RetryPolicy

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

    from wheelhouse.config import Config

_CHUNK = 1024 * 1024
_KEY_PART = re.compile(r"[A-Za-z0-9_.+=-]+")


def check_key(key: str) -> str:
    """Refuse keys that could leave the storage root; everything we write is plain ASCII."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or not _KEY_PART.fullmatch(p) for p in parts):
        raise ValueError(f"invalid storage key {key[:100]!r}")
    return key


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float
    etag: str = ""
    """S3's ETag where the listing gives one (it changes with the bytes, also within the second
    that ``mtime`` resolves); empty for local files, whose ``mtime`` is precise."""


@dataclass(frozen=True)
class Tagged:
    """An object's bytes and the tag of that version, for :meth:`Storage.replace_bytes`."""

    data: bytes
    tag: str


class RangeFile:
    """Bytes ``[start, stop)`` of an open file, as a file object a WSGI server's file wrapper
    takes: a real descriptor positioned at ``start`` (gunicorn sends from the descriptor's
    offset with ``sendfile``, as many bytes as the answer's ``Content-Length``), and a
    ``read`` that never passes ``stop``, for servers that copy the file instead."""

    def __init__(self, f: BinaryIO, start: int, stop: int) -> None:
        self._f = f
        f.seek(start)
        self._left = max(stop - start, 0)

    def fileno(self) -> int:
        return self._f.fileno()

    def read(self, size: int = -1) -> bytes:
        n = self._left if size < 0 else min(size, self._left)
        data = self._f.read(n) if n > 0 else b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._f.close()


class ByteStream:
    """An open read of part of an object whose whole size is known before any byte is read,
    so that a server can refuse to start an answer it could not finish.

    ``file`` is the range as a :class:`RangeFile` where the backend has a local file (the
    server may send it instead of iterating the stream; either way, close the stream)."""

    def __init__(self, size: int, chunks: Iterator[bytes], close: Callable[[], None],
                 file: RangeFile | None = None) -> None:
        self.size = size
        self._chunks = chunks
        self._close = close
        self.file = file

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def close(self) -> None:
        self._close()

    def __enter__(self) -> ByteStream:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class Storage(ABC):
    """The storage interface; see the module docstring for its guarantees.

    Every backend raises only these for its own trouble: ``FileNotFoundError`` for a key that
    is not there, ``FileExistsError`` for an exclusive write that lost, and
    :class:`StorageUnavailable` for everything else (unreachable, timed out, throttled,
    refused); a bad key is a ``ValueError``.
    """

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data``; with ``exclusive``, raise ``FileExistsError`` if ``key`` exists."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read a whole (small) object; ``FileNotFoundError`` if absent."""

    @abstractmethod
    def read_tagged(self, key: str) -> Tagged:
        """Read a small object with the tag of the version read; ``FileNotFoundError`` if
        absent."""

    @abstractmethod
    def replace_bytes(self, key: str, data: bytes, *, tag: str) -> None:
        """Overwrite ``key`` only if it is still the version :meth:`read_tagged` tagged
        ``tag``: ``FileExistsError`` if it changed meanwhile, ``FileNotFoundError`` if it is
        gone. Two callers that read the same version cannot both succeed."""

    @abstractmethod
    def open_range(self, key: str, start: int, stop: int) -> ByteStream:
        """Open bytes ``[start, stop)`` of an object for reading; the stream knows the whole
        object's size. ``FileNotFoundError`` if absent (raised here, not while iterating)."""

    def iter_range(self, key: str, start: int, stop: int) -> Iterator[bytes]:
        """Yield bytes ``[start, stop)`` of an object."""
        with self.open_range(key, start, stop) as stream:
            yield from stream

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; ``FileNotFoundError`` if absent."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    def delete(self, key: str, *, tag: str | None = None) -> None:
        """Remove an object; removing one that is not there is fine. With ``tag``, only the
        version :meth:`read_tagged` tagged so: ``FileExistsError`` if it changed meanwhile."""

    @abstractmethod
    def list_partials(self) -> Iterator[ObjectInfo]:
        """What interrupted writes left behind, for ``wheelhouse gc``; never listed as objects."""

    @abstractmethod
    def delete_partial(self, key: str) -> None:
        """Remove one leftover that :meth:`list_partials` named."""

    def presigned_url(self, key: str, seconds: int) -> str | None:
        """A short-lived direct URL, where the backend has such a thing."""
        return None

    def local_path(self, key: str) -> Path | None:
        """The object's file on this host, where the backend is a directory (for a reverse
        proxy to send it: X-Accel-Redirect, X-Sendfile)."""
        return None

    @abstractmethod
    def ping(self) -> None:
        """Raise :class:`StorageUnavailable` unless the backend answers."""

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except FileNotFoundError:
            return False
        return True

    def download(self, key: str, dest: Path) -> None:
        info = self.stat(key)
        with dest.open("wb") as f:
            for chunk in self.iter_range(key, 0, info.size):
                f.write(chunk)


_PARTIAL_PREFIX = ".tmp-"
#: The lock file (in the root) that serializes compare-and-swap writes of local storage.
_SWAP_LOCK = ".swap-lock"


def _content_tag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalStorage(Storage):
    def __init__(self, root: Path) -> None:
        self.root = root

    @contextlib.contextmanager
    def _swap_lock(self) -> Iterator[None]:
        """Compare-and-swap writers take turns on one lock file (flock, so every process on
        this host); readers never take it, since every write is a rename."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / _SWAP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageUnavailable(
                f"storage directory {self.root}: cannot lock: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @contextlib.contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        """The file system's errors as the storage interface promises them."""
        try:
            yield
        except (FileNotFoundError, FileExistsError, StorageError):
            raise
        except (IsADirectoryError, NotADirectoryError):
            # A folder, or a path through a file, is an object on neither backend; S3 answers
            # 404 for "wheels".
            raise FileNotFoundError(key) from None
        except OSError as exc:
            raise StorageUnavailable(
                f"storage directory {self.root}: {op} {key}: {exc.strerror or exc}") from exc

    def _tmp(self, target: Path) -> tuple[int, str]:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            return tempfile.mkstemp(dir=target.parent, prefix=_PARTIAL_PREFIX, suffix=".part")
        except OSError as exc:
            # Also a file where a folder of the key should be: not "the key exists".
            raise StorageUnavailable(
                f"storage directory {self.root}: cannot write under {target.parent}: "
                f"{exc.strerror or exc}") from exc

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        fd, tmp = self._tmp(target)
        try:
            with self._errors("write", key):
                with os.fdopen(fd, "wb") as out, path.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        target = self._path(key)
        fd, tmp = self._tmp(target)
        try:
            with self._errors("write", key):
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                if exclusive:
                    # link() fails if the target exists: an atomic create-if-absent.
                    os.link(tmp, target)
                else:
                    os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        with self._errors("read", key):
            return path.read_bytes()

    def read_tagged(self, key: str) -> Tagged:
        data = self.get_bytes(key)
        # The content's hash: what we swap are small objects whose content is unique (a
        # claim names its holder), so equal tags mean the same version.
        return Tagged(data, _content_tag(data))

    def replace_bytes(self, key: str, data: bytes, *, tag: str) -> None:
        with self._swap_lock():
            if self.read_tagged(key).tag != tag:
                raise FileExistsError(key)
            self.put_bytes(key, data)

    def open_range(self, key: str, start: int, stop: int) -> ByteStream:
        path = self._path(key)
        with self._errors("read", key):
            # Unbuffered: the descriptor's offset is exactly where the range starts, which
            # is where a server's sendfile begins.
            f = path.open("rb", buffering=0)
        try:
            with self._errors("stat", key):
                size = os.fstat(f.fileno()).st_size
                file = RangeFile(f, max(start, 0), stop)
        except BaseException:
            f.close()
            raise
        return ByteStream(size, self._read(file, key), f.close, file)

    def _read(self, file: RangeFile, key: str) -> Iterator[bytes]:
        with self._errors("read", key), contextlib.closing(file):
            while chunk := file.read(_CHUNK):
                yield chunk

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        with self._errors("stat", key):
            st = path.stat()
        if not _stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # A key prefix, as S3 has it: "records/" lists a folder, "records/a" also "records/ab".
        directory = prefix.rpartition("/")[0]
        base = self._path(directory) if directory else self.root
        if not base.is_dir():
            return
        for full in self._walk(base, partials=False):
            key = full.relative_to(self.root).as_posix()
            if not key.startswith(prefix):
                continue
            try:
                st = full.stat()
            except FileNotFoundError:
                continue
            yield ObjectInfo(key, st.st_size, st.st_mtime)

    def _walk(self, base: Path, *, partials: bool) -> Iterator[Path]:
        """Files below ``base``: the objects, or the temporary files of interrupted writes."""

        def fail(exc: OSError) -> None:
            if isinstance(exc, FileNotFoundError):
                return  # removed while we walked: nothing to list there
            raise StorageUnavailable(
                f"storage directory {self.root}: cannot list {exc.filename}: "
                f"{exc.strerror or exc}") from exc

        for dirpath, _dirs, files in os.walk(base, onerror=fail):
            for name in files:
                if name == _SWAP_LOCK and Path(dirpath) == self.root:
                    continue
                if name.startswith(_PARTIAL_PREFIX) == partials:
                    yield Path(dirpath) / name

    def list_partials(self) -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return
        for full in self._walk(self.root, partials=True):
            try:
                st = full.stat()
            except FileNotFoundError:
                continue  # the write just finished
            yield ObjectInfo(full.relative_to(self.root).as_posix(), st.st_size, st.st_mtime)

    def delete(self, key: str, *, tag: str | None = None) -> None:
        path = self._path(key)
        if tag is None:
            with contextlib.suppress(FileNotFoundError), self._errors("delete", key):
                path.unlink()
            return
        with self._swap_lock():
            try:
                current = self.read_tagged(key).tag
            except FileNotFoundError:
                return
            if current != tag:
                raise FileExistsError(key)
            self.delete(key)

    def delete_partial(self, key: str) -> None:
        if not key.rpartition("/")[2].startswith(_PARTIAL_PREFIX):
            raise ValueError(f"{key[:100]!r} is not a partial write")
        self.delete(key)

    def ping(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(
                f"storage directory {self.root} cannot be created: {exc.strerror or exc}"
            ) from exc
        if not os.access(self.root, os.R_OK | os.W_OK):
            raise StorageUnavailable(
                f"storage directory {self.root} is not readable and writable")


#: S3 error codes that mean "no such key" (HEAD answers with the bare status).
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
#: ... and that mean a conditional (create-if-absent) write found the key there.
_PRECONDITION = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
_UPLOAD_ID = "?uploadId="


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


class S3Storage(Storage):
    def __init__(self, client: S3Client, bucket: str, prefix: str = "", *,
                 presign_client: S3Client | None = None) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        #: Signs the URLs clients are redirected to: one for the endpoint as clients reach it.
        self.presign_client = presign_client if presign_client is not None else client

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextlib.contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        """botocore's and boto3's errors as the storage interface promises them."""
        # boto3 costs ~0.3 s to import and only S3 storage needs it (loaded with the client).
        from boto3.exceptions import Boto3Error  # noqa: PLC0415

        try:
            yield
        except ClientError as exc:
            code = _code(exc)
            if code in _MISSING:
                raise FileNotFoundError(key) from None
            if code in _PRECONDITION:
                raise FileExistsError(key) from None
            message = exc.response.get("Error", {}).get("Message") or str(exc)
            raise StorageUnavailable(
                f"S3 bucket {self.bucket!r}: {op} {key}: {code or 'error'}: {message}"
            ) from exc
        except (BotoCoreError, Boto3Error) as exc:
            # Connection refused or reset, timeouts, throttling and 5xx past botocore's own
            # retries, and upload_file's wrapper around any of them.
            raise StorageUnavailable(f"S3 bucket {self.bucket!r}: {op} {key}: {exc}") from exc

    def put_file(self, key: str, path: Path) -> None:
        full = self._key(key)
        # upload_file switches to multipart for big wheels; a multipart object only becomes
        # visible when complete, so readers never see a partial one.
        with self._errors("upload", key):
            self.client.upload_file(str(path), self.bucket, full)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        full = self._key(key)
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}
        with self._errors("put", key):
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data, **extra)

    def get_bytes(self, key: str) -> bytes:
        return self.read_tagged(key).data

    def read_tagged(self, key: str) -> Tagged:
        full = self._key(key)
        with self._errors("get", key):
            obj = self.client.get_object(Bucket=self.bucket, Key=full)
            return Tagged(obj["Body"].read(), obj["ETag"])

    def replace_bytes(self, key: str, data: bytes, *, tag: str) -> None:
        full = self._key(key)
        # S3's conditional write: 412 if the object's ETag is no longer the one we read.
        with self._errors("replace", key):
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfMatch=tag)

    def open_range(self, key: str, start: int, stop: int) -> ByteStream:
        full = self._key(key)
        if stop <= start:
            return ByteStream(self.stat(key).size, iter(()), lambda: None)
        with self._errors("get", key):
            try:
                obj = self.client.get_object(
                    Bucket=self.bucket, Key=full, Range=f"bytes={max(start, 0)}-{stop - 1}")
            except ClientError as exc:
                if _code(exc) != "InvalidRange":
                    raise
                # Starts at or past the end: nothing, as a local file gives.
                return ByteStream(self.stat(key).size, iter(()), lambda: None)
        body = obj["Body"]
        # "bytes 0-99/1234": the whole object's size, from the same answer as the bytes.
        total = obj.get("ContentRange", "").rpartition("/")[2]
        size = int(total) if total.isdigit() else obj["ContentLength"]
        return ByteStream(size, self._read(body, key), body.close)

    def _read(self, body: Any, key: str) -> Iterator[bytes]:
        with self._errors("get", key):
            try:
                yield from body.iter_chunks(_CHUNK)
            finally:
                body.close()

    def stat(self, key: str) -> ObjectInfo:
        full = self._key(key)
        with self._errors("head", key):
            head = self.client.head_object(Bucket=self.bucket, Key=full)
        return ObjectInfo(key, head["ContentLength"], head["LastModified"].timestamp())

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        with self._errors("list", prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(self.prefix):], obj["Size"],
                                     obj["LastModified"].timestamp(), obj.get("ETag", ""))

    def list_partials(self) -> Iterator[ObjectInfo]:
        """Unfinished multipart uploads, each as ``<key>?uploadId=<id>``."""
        paginator = self.client.get_paginator("list_multipart_uploads")
        with self._errors("list uploads", self.prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for up in page.get("Uploads", []):
                    yield ObjectInfo(up["Key"][len(self.prefix):] + _UPLOAD_ID + up["UploadId"],
                                     0, up["Initiated"].timestamp())

    def delete(self, key: str, *, tag: str | None = None) -> None:
        full = self._key(key)
        extra: dict[str, Any] = {"IfMatch": tag} if tag is not None else {}
        with contextlib.suppress(FileNotFoundError), self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=full, **extra)

    def delete_partial(self, key: str) -> None:
        """Abort an unfinished multipart upload that :meth:`list_partials` named."""
        obj_key, sep, upload_id = key.partition(_UPLOAD_ID)
        if not sep or not upload_id:
            raise ValueError(f"{key[:100]!r} is not an unfinished upload")
        full = self._key(obj_key)
        with self._errors("abort upload", obj_key):
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full,
                                                   UploadId=upload_id)
            except ClientError as exc:
                if _code(exc) != "NoSuchUpload":  # finished or aborted meanwhile: gone anyway
                    raise

    def presigned_url(self, key: str, seconds: int) -> str | None:
        full = self._key(key)
        with self._errors("presign", key):
            return self.presign_client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": full}, ExpiresIn=seconds)

    def ping(self) -> None:
        from boto3.exceptions import Boto3Error  # noqa: PLC0415 (boto3 loads with S3 only)

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError, Boto3Error) as exc:
            # Here a 404 is a missing bucket: the storage itself is not there.
            raise StorageUnavailable(
                f"S3 bucket {self.bucket!r} is not reachable: {exc}") from None


def make_s3_client(config: Config, *, policy: RetryPolicy = S3_REQUESTS,
                   endpoint_url: str | None = None) -> S3Client:
    """A boto3 S3 client from configuration and the usual ``AWS_*`` environment.

    ``policy`` sets botocore's attempts per request; each attempt waits at most
    ``storage_connect_timeout`` to connect and ``storage_read_timeout`` for each read (a
    ``policy.timeout`` overrides both). So a hung S3 costs a caller at most about
    attempts x timeout, never botocore's default minute per attempt. ``endpoint_url``
    replaces the configured endpoint (the public one, for presigning).
    """
    # boto3 costs ~0.3 s to import: only processes with S3 storage pay it.
    import boto3  # noqa: PLC0415
    from botocore.config import Config as BotoConfig  # noqa: PLC0415

    connect, read = config.storage_connect_timeout, config.storage_read_timeout
    if policy.timeout is not None:
        connect = read = policy.timeout
    opts: dict[str, Any] = {
        "retries": {"mode": "standard", "total_max_attempts": policy.attempts},
        "signature_version": "s3v4",
        "connect_timeout": connect,
        "read_timeout": read,
    }
    return boto3.client(
        "s3", endpoint_url=endpoint_url or config.s3_endpoint_url, config=BotoConfig(**opts)
    )


def open_storage(config: Config, *, s3_client: S3Client | None = None) -> Storage:
    """The storage that ``config.storage`` names."""
    url = urlsplit(config.storage)
    if url.scheme == "s3":
        if not url.netloc:
            raise ValueError(f"WHEELHOUSE_STORAGE={config.storage!r} names no bucket")
        client = s3_client if s3_client is not None else make_s3_client(config)
        public = config.s3_public_endpoint_url
        presign = make_s3_client(config, endpoint_url=public) if public else None
        return S3Storage(client, url.netloc, url.path, presign_client=presign)
    if url.scheme not in ("", "file"):
        raise ValueError(f"WHEELHOUSE_STORAGE={config.storage!r}: use a directory or s3://bucket")
    return LocalStorage(Path(url.path if url.scheme == "file" else config.storage).resolve())
