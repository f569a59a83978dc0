"""Where published files live: a local directory (the embedded default) or an S3 bucket.

Keys are ``/``-separated relative paths. Both implementations give the same guarantees:
``put_*`` is atomic per key (a reader sees the old object, or the whole new one), and
``put_bytes(..., exclusive=True)`` refuses to overwrite, which the publish protocol relies on.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat as _stat
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from wheelhouse.errors import StorageError

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


class Storage(ABC):
    """The storage interface; see the module docstring for its guarantees."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data``; with ``exclusive``, raise ``FileExistsError`` if ``key`` exists."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read a whole (small) object; ``FileNotFoundError`` if absent."""

    @abstractmethod
    def iter_range(self, key: str, start: int, stop: int) -> Iterator[bytes]:
        """Yield bytes ``[start, stop)`` of an object."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; ``FileNotFoundError`` if absent."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def presigned_url(self, key: str, seconds: int) -> str | None:
        """A short-lived direct URL, where the backend has such a thing."""
        return None

    @abstractmethod
    def ping(self) -> None:
        """Raise :class:`StorageError` unless the backend answers."""

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


class LocalStorage(Storage):
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _tmp(self, target: Path) -> tuple[int, str]:
        target.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".part")

    def put_file(self, key: str, path: Path) -> None:
        target = self._path(key)
        fd, tmp = self._tmp(target)
        try:
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
        try:
            return self._path(key).read_bytes()
        except IsADirectoryError:
            raise FileNotFoundError(key) from None

    def iter_range(self, key: str, start: int, stop: int) -> Iterator[bytes]:
        try:
            f = self._path(key).open("rb")
        except IsADirectoryError:
            raise FileNotFoundError(key) from None
        with f:
            f.seek(start)
            left = stop - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

    def stat(self, key: str) -> ObjectInfo:
        st = self._path(key).stat()
        if not _stat.S_ISREG(st.st_mode):
            # A folder is an object on neither backend; S3 answers 404 for "wheels".
            raise FileNotFoundError(key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # A key prefix, as S3 has it: "records/" lists a folder, "records/a" also "records/ab".
        directory = prefix.rpartition("/")[0]
        base = self._path(directory) if directory else self.root
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def list_partials(self) -> Iterator[ObjectInfo]:
        """Temporary files of interrupted writes, for ``wheelhouse gc``."""
        if not self.root.is_dir():
            return
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".tmp-"):
                    full = Path(dirpath) / name
                    st = full.stat()
                    yield ObjectInfo(full.relative_to(self.root).as_posix(), st.st_size,
                                     st.st_mtime)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def ping(self) -> None:
        if not self.root.exists():
            self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.R_OK | os.W_OK):
            raise StorageError(f"storage directory {self.root} is not readable and writable")


class S3Storage(Storage):
    def __init__(self, client: S3Client, bucket: str, prefix: str = "") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put_file(self, key: str, path: Path) -> None:
        # upload_file switches to multipart for big wheels; a multipart object only becomes
        # visible when complete, so readers never see a partial one.
        self.client.upload_file(str(path), self.bucket, self._key(key))

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        from botocore.exceptions import ClientError

        extra: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise FileExistsError(key) from None
            raise

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            raise
        return obj["Body"].read()

    def iter_range(self, key: str, start: int, stop: int) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        if stop <= start:
            return
        try:
            obj = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{stop - 1}"
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            if code == "InvalidRange":
                return  # start at or past the end: nothing, as a local file gives
            raise
        body = obj["Body"]
        try:
            yield from body.iter_chunks(_CHUNK)
        finally:
            body.close()

    def stat(self, key: str) -> ObjectInfo:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(key) from None
            raise
        return ObjectInfo(key, head["ContentLength"], head["LastModified"].timestamp())

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
            for obj in page.get("Contents", []):
                yield ObjectInfo(
                    obj["Key"][len(self.prefix):], obj["Size"], obj["LastModified"].timestamp()
                )

    def list_partials(self) -> Iterator[ObjectInfo]:
        """Unfinished multipart uploads, for ``wheelhouse gc``."""
        resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        for up in resp.get("Uploads", []):
            yield ObjectInfo(
                up["Key"][len(self.prefix):] + "?uploadId=" + up["UploadId"], 0,
                up["Initiated"].timestamp(),
            )

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def presigned_url(self, key: str, seconds: int) -> str | None:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)},
            ExpiresIn=seconds,
        )

    def ping(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"S3 bucket {self.bucket!r} is not reachable: {exc}") from None


def make_s3_client(config: Config, *, timeout: float | None = None) -> S3Client:
    """A boto3 S3 client from configuration and the usual ``AWS_*`` environment."""
    import boto3
    from botocore.config import Config as BotoConfig

    opts: dict[str, Any] = {"retries": {"mode": "standard", "total_max_attempts": 4},
                            "signature_version": "s3v4"}
    if timeout is not None:
        opts.update(connect_timeout=timeout, read_timeout=timeout,
                    retries={"mode": "standard", "total_max_attempts": 1})
    return boto3.client(
        "s3", endpoint_url=config.s3_endpoint_url, config=BotoConfig(**opts)
    )


def open_storage(config: Config, *, s3_client: S3Client | None = None) -> Storage:
    """The storage that ``config.storage`` names."""
    url = urlsplit(config.storage)
    if url.scheme == "s3":
        if not url.netloc:
            raise ValueError(f"WHEELHOUSE_STORAGE={config.storage!r} names no bucket")
        client = s3_client if s3_client is not None else make_s3_client(config)
        return S3Storage(client, url.netloc, url.path)
    if url.scheme not in ("", "file"):
        raise ValueError(f"WHEELHOUSE_STORAGE={config.storage!r}: use a directory or s3://bucket")
    return LocalStorage(Path(url.path if url.scheme == "file" else config.storage).resolve())
