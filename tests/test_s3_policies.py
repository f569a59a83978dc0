"""deploy/s3/*-policy.json, the S3 users of compose's minio-init and the AWS IAM policies of
docs/security.md, enforced by moto's S3 server with IAM authorization switched on: the web
reads the index and writes only the pull-through cache; workers publish wheels, logs and build
statistics and cannot delete.

moto checks each request's signature, action and resource against the user's policies (not
policy conditions, which these policies don't use). It calls a HEAD on the bucket
``s3:HeadBucket``, which AWS and MinIO authorize as ``s3:ListBucket``: the test users get that
one extra moto-only action.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import boto3
import pytest
import requests
from botocore.exceptions import ClientError

from tests.helpers import free_port, make_wheel, run_console, start_index, wait_for_port
from wheelhouse.config import Config
from wheelhouse.errors import StorageError
from wheelhouse.index import layout
from wheelhouse.index.storage import open_storage

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "deploy" / "s3"
BUCKET = "wheels"
ROLES = ("web", "worker")
#: Each role's policy files, as compose's minio-init attaches them.
POLICY_FILES = {"web": ("web-policy.json", "web-cache-policy.json"),
                "worker": ("worker-policy.json",)}
#: moto's name for HEAD on a bucket (the storage's ping): see the module's docstring.
MOTO_HEAD_BUCKET = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Action": "s3:HeadBucket", "Resource": f"arn:aws:s3:::{BUCKET}"}]}


@dataclass(frozen=True)
class PolicedS3:
    url: str
    keys: dict[str, dict[str, str]]
    """Each role's ``AWS_*`` variables."""

    def config(self) -> Config:
        """The storage as compose configures web and workers."""
        return Config(storage=f"s3://{BUCKET}/index", s3_endpoint_url=self.url, upstream="off")

    def client(self, role: str) -> Any:
        keys = self.keys[role]
        session = boto3.session.Session(aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
                                        region_name="us-east-1")
        return session.client("s3", endpoint_url=self.url)


@pytest.fixture(scope="module")
def policed_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicedS3]:
    """A moto server of its own (IAM enforcement is process-wide), with the bucket and one IAM
    user per role under the repository's policy; enforcement starts after this set-up."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, timeout=60)
        url = f"http://127.0.0.1:{port}"
        admin = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                      region_name="us-east-1")
        admin.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        iam = admin.client("iam", endpoint_url=url)
        keys = {}
        for role in ROLES:
            user = f"wheelhouse-{role}"
            iam.create_user(UserName=user)
            for name in POLICY_FILES[role]:
                iam.put_user_policy(UserName=user, PolicyName=name.removesuffix(".json"),
                                    PolicyDocument=(POLICIES / name).read_text())
            iam.put_user_policy(UserName=user, PolicyName="moto-head-bucket",
                                PolicyDocument=json.dumps(MOTO_HEAD_BUCKET))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[role] = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                          "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                          "AWS_DEFAULT_REGION": "us-east-1"}
        requests.post(f"{url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        yield PolicedS3(url=url, keys=keys)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def _denied(call: Any, **kwargs: Any) -> None:
    with pytest.raises(ClientError) as err:
        call(**kwargs)
    assert err.value.response["Error"]["Code"] in ("AccessDenied", "403"), err.value.response


def test_the_policies_are_aws_policies() -> None:
    for name in (n for names in POLICY_FILES.values() for n in names):
        doc = json.loads((POLICIES / name).read_text())
        assert doc["Version"] == "2012-10-17"
        for statement in doc["Statement"]:
            assert statement["Effect"] == "Allow" and "Condition" not in statement
            actions = set(statement["Action"])
            assert actions <= {"s3:ListBucket", "s3:GetObject", "s3:PutObject",
                               "s3:AbortMultipartUpload", "s3:DeleteObject"}, actions
            assert all(r.startswith(f"arn:aws:s3:::{BUCKET}") for r in statement["Resource"])
            if "s3:DeleteObject" in actions:  # deleting is the operator's, but for the cache
                assert statement["Resource"] == [f"arn:aws:s3:::{BUCKET}/index/{layout.MIRROR}*"]
    web = json.loads((POLICIES / "web-policy.json").read_text())
    assert not any("s3:PutObject" in s["Action"] for s in web["Statement"])
    cache = json.loads((POLICIES / "web-cache-policy.json").read_text())
    assert {r for s in cache["Statement"] for r in s["Resource"]} == {
        f"arn:aws:s3:::{BUCKET}/index/{prefix}*" for prefix in layout.WEB_CACHE_WRITES}


def test_the_security_docs_give_the_same_policies() -> None:
    security = (ROOT / "docs" / "security.md").read_text()
    shown = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", security, re.S)]
    for name in (n for names in POLICY_FILES.values() for n in names):
        assert json.loads((POLICIES / name).read_text()) in shown, name


def test_workers_publish_and_the_web_serves(policed_s3: PolicedS3, tmp_path: Path) -> None:
    config = policed_s3.config()
    wheel = make_wheel(tmp_path / "dist", "demo-ext", "1.0")
    published = run_console("publish", str(wheel), "--variant", "torch2.8-cu128", "--relabel",
                            config=config, env=policed_s3.keys["worker"])
    assert published.returncode == 0, published.stderr
    # What a build writes besides the wheel: its log and the learned per-job memory.
    wrote = subprocess.run(
        [sys.executable, "-c", "from wheelhouse.config import Config\n"
         "from wheelhouse.builds.maxjobs import record_peaks\n"
         "from wheelhouse.index.storage import open_storage\n"
         "storage = open_storage(Config.from_env())\n"
         "storage.put_bytes('logs/torch2.8-cu128/demo-ext/x.log', b'the log')\n"
         "record_peaks(storage, 'generic', 'demo-ext', '12.8', [2**30], 2, archs=2,\n"
         "             recipe_per_thread=2**30)\n"],
        env={**os.environ, **config.to_env(), **policed_s3.keys["worker"]},
        capture_output=True, text=True, timeout=120)
    assert wrote.returncode == 0, wrote.stderr

    with start_index(config, tmp_path, extra_env=policed_s3.keys["web"]) as url:
        assert requests.get(f"{url}/readyz", timeout=10).status_code == 200
        page = requests.get(f"{url}/torch2.8-cu128/simple/demo-ext/", timeout=10,
                            headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        assert page.status_code == 200, url.access_log()
        [file] = page.json()["files"]
        href, sha256 = file["url"], file["hashes"]["sha256"]
        assert href.endswith("/demo_ext-1.0+cu128torch2.8-py3-none-any.whl")
        served = requests.get(urljoin(page.url, href), timeout=10)
        assert served.status_code == 200, url.access_log()
        assert hashlib.sha256(served.content).hexdigest() == sha256
        metadata = requests.get(urljoin(page.url, href) + ".metadata", timeout=10)
        assert metadata.status_code == 200 and b"Name: demo-ext" in metadata.content


def test_the_web_reads_the_index_and_writes_only_the_cache(policed_s3: PolicedS3) -> None:
    web = policed_s3.client("web")
    web.list_objects_v2(Bucket=BUCKET, Prefix="index/")
    for key in ("index/wheels/x.whl", "index/records/x.json", "index/generation", "outside",
                "index/mirrored/x", "mirror/files/x"):
        _denied(web.put_object, Bucket=BUCKET, Key=key, Body=b"x")
    _denied(web.delete_object, Bucket=BUCKET, Key="index/generation")
    _denied(web.get_object, Bucket=BUCKET, Key="outside/secret")
    # Through the storage layer: a write is an error, never a silent success.
    storage = open_storage(policed_s3.config(), s3_client=web)
    with pytest.raises(StorageError, match="AccessDenied"):
        storage.put_bytes("generation", b"x")
    with pytest.raises(StorageError, match="AccessDenied"):
        storage.delete("generation")


def test_the_web_keeps_and_evicts_the_pull_through_cache(policed_s3: PolicedS3) -> None:
    """What the cache writes (a page, a file, its use marker) and eviction's deletes pass the
    web's cache policy; its files are then served as the web reads any stored file."""
    from wheelhouse.index import mirror

    storage = open_storage(policed_s3.config(), s3_client=policed_s3.client("web"))
    sha = hashlib.sha256(b"torch").hexdigest()
    file_key = layout.mirror_file_key(sha, "torch-2.14.1+cu130-cp311-cp311-linux_x86_64.whl")
    page_key = layout.mirror_page_key("0" * 16, "torch")
    for key in (file_key, page_key, layout.mirror_used_key(sha)):
        assert any(key.startswith(prefix) for prefix in layout.WEB_CACHE_WRITES), key
        storage.put_bytes(key, b"torch")
    assert storage.get_bytes(file_key) == b"torch"
    assert [c.sha256 for c in mirror.evict(storage, budget=0)] == [sha]
    assert not storage.exists(file_key) and not storage.exists(layout.mirror_used_key(sha))
    # The worker's policy has no business there.
    worker = policed_s3.client("worker")
    _denied(worker.put_object, Bucket=BUCKET, Key=f"index/{file_key}", Body=b"x")


def test_workers_write_the_index_prefix_only_and_never_delete(policed_s3: PolicedS3) -> None:
    worker = policed_s3.client("worker")
    worker.put_object(Bucket=BUCKET, Key="index/claims/probe", Body=b"x")
    for key in ("outside/x", "index/config.json", "indexed/wheels/x.whl"):
        _denied(worker.put_object, Bucket=BUCKET, Key=key, Body=b"x")
    _denied(worker.delete_object, Bucket=BUCKET, Key="index/claims/probe")


def test_unknown_keys_are_refused(policed_s3: PolicedS3) -> None:
    stranger = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                     region_name="us-east-1").client(
        "s3", endpoint_url=policed_s3.url)
    with pytest.raises(ClientError) as err:
        stranger.list_objects_v2(Bucket=BUCKET)
    assert err.value.response["Error"]["Code"] in ("InvalidAccessKeyId", "AccessDenied", "403")


def test_workers_may_write_everything_a_worker_writes(policed_s3: PolicedS3) -> None:
    """Every prefix of the storage layout that a build writes, the compile cache's included
    (which the policy once left out, so sharing it failed quietly)."""
    worker = policed_s3.client("worker")
    for prefix in layout.WORKER_WRITES:
        key = f"index/{prefix}" if not prefix.endswith("/") else f"index/{prefix}probe"
        worker.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    _denied(worker.put_object, Bucket=BUCKET, Key=f"index/{layout.QUARANTINE}probe", Body=b"x")


def test_uploaded_sdists_need_a_web_write_the_shipped_policy_leaves_out(
        policed_s3: PolicedS3) -> None:
    """docs/security.md: with the shipped (read-only) web policy, storing an uploaded sdist is
    a storage error (503 to the client), never a silent success; workers only read it."""
    storage = open_storage(policed_s3.config(), s3_client=policed_s3.client("web"))
    key = layout.source_key("0" * 64, "vecadd-0.1.0.tar.gz")
    assert all(key.startswith(prefix) for prefix in layout.WEB_SOURCE_WRITES)
    with pytest.raises(StorageError, match="AccessDenied"):
        storage.put_bytes(key, b"sdist")
    # Workers may read it (a missing one is absent, not forbidden) and not write it.
    worker = open_storage(policed_s3.config(), s3_client=policed_s3.client("worker"))
    assert not worker.exists(key)
    assert not any(key.startswith(prefix) for prefix in layout.WORKER_WRITES)
    security = (ROOT / "docs" / "security.md").read_text()
    assert f"arn:aws:s3:::{BUCKET}/index/{layout.SOURCES}*" in security
