"""Publishing into both storages: validation, idempotency, immutability, write order."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.helpers import make_wheel, metadata_bomb
from tests.wheelhouse.conftest import ForwardingStorage
from tests.wheelhouse.test_wheels import assert_record_matches
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.errors import (
    AlreadyPublished,
    InvalidVariant,
    InvalidWheel,
    StorageUnavailable,
    VersionMismatch,
)
from wheelhouse.index import gc
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import GENERATION_KEY, Record, record_key, wheel_key
from wheelhouse.index.publish import Claim, publish
from wheelhouse.index.storage import Storage
from wheelhouse.variants import Variant, parse_variant
from wheelhouse.wheels import read_metadata, sha256_file

V = parse_variant("torch2.8-cu128")
V_SM90 = parse_variant("torch2.8-cu128-sm90")
TAG = "cp312-cp312-linux_x86_64"


def _keys(storage: Storage) -> set[str]:
    return {o.key for o in storage.list("")}


def test_publish_writes_wheel_metadata_record_and_generation(
    storage: Storage, tmp_path: Path
) -> None:
    path = make_wheel(tmp_path, "flash-attn", "2.8.3+cu128torch2.8", tag=TAG,
                      requires=["torch", "einops"], requires_python=">=3.9")
    record = publish(storage, path, V, build=BuildFacts(build_id="test", seconds=1.5))

    assert record.filename == path.name
    assert record.project == "flash-attn"
    assert record.version == "2.8.3+cu128torch2.8"
    assert record.variant == V and record.variant.key == "torch2.8-cu128"
    assert record.archs is None
    assert record.sha256 == sha256_file(path)
    assert record.size == path.stat().st_size
    assert record.metadata_sha256 == hashlib.sha256(read_metadata(path)).hexdigest()
    assert record.requires_python == ">=3.9"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record.upload_time)
    assert record.yanked is False
    assert record.build == BuildFacts(build_id="test", seconds=1.5)

    wkey = wheel_key(V, "flash-attn", path.name)
    rkey = record_key(V, "flash-attn", path.name)
    assert wkey == f"wheels/torch2.8-cu128/flash-attn/{path.name}"
    assert record.wheel_key == wkey and record.metadata_key == wkey + ".metadata"
    claim = f"claims/torch2.8-cu128/{path.name}"
    assert _keys(storage) == {wkey, wkey + ".metadata", rkey, GENERATION_KEY, claim}
    held = Claim.parse(storage.get_bytes(claim), 0.0)
    # The claim says for which bytes, who (host, pid) and when: enough to expire it.
    assert held.sha256 == record.sha256
    assert (held.host, held.pid) == (socket.gethostname(), os.getpid())
    assert time.time() - 60 < held.claimed_at <= time.time()
    assert storage.get_bytes(wkey) == path.read_bytes()
    assert storage.get_bytes(wkey + ".metadata") == read_metadata(path)
    assert Record.from_json(storage.get_bytes(rkey)) == record
    assert len(storage.get_bytes(GENERATION_KEY)) == 32


def test_publish_is_idempotent_for_identical_bytes(storage: Storage, tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    first = publish(storage, path, V)
    generation = storage.get_bytes(GENERATION_KEY)
    again = publish(storage, path, V)
    assert again == first  # the existing record, upload time included
    assert storage.get_bytes(GENERATION_KEY) == generation  # nothing changed, nothing to tell


def test_publish_refuses_different_bytes_under_a_published_name(
    storage: Storage, tmp_path: Path
) -> None:
    original = make_wheel(tmp_path / "a", "pkg", "1.0+cu128torch2.8", payload=b"original")
    record = publish(storage, original, V)
    other = make_wheel(tmp_path / "b", "pkg", "1.0+cu128torch2.8", payload=b"something else")
    assert other.name == original.name
    with pytest.raises(AlreadyPublished, match="immutable") as exc:
        publish(storage, other, V)
    assert isinstance(exc.value, FileExistsError)
    assert storage.get_bytes(record.wheel_key) == original.read_bytes()
    assert Record.from_json(storage.get_bytes(record_key(V, "pkg", original.name))) == record


@pytest.mark.parametrize(("version", "variant", "hint"), [
    ("1.0", "torch2.8-cu128", None),
    ("1.0+local", "torch2.8-cu128", None),
    ("1.0+cu126torch2.7", "torch2.8-cu128", "torch2.7-cu126"),
    ("1.0+cu128torch2.8", "torch2.8-cu128-sm90", "torch2.8-cu128"),
    ("1.0+cu128torch2.8.sm90", "torch2.8-cu128", "torch2.8-cu128-sm90"),
    ("1.0+cu128torch2.8.cxx11abi0", "torch2.8-cu128", "torch2.8-cu128-cxx11abi0"),
])
def test_publish_refuses_wheels_without_the_variant_label(
    storage: Storage, tmp_path: Path, version: str, variant: str, hint: str | None
) -> None:
    path = make_wheel(tmp_path, "pkg", version)
    with pytest.raises(InvalidWheel, match="--relabel") as exc:
        publish(storage, path, parse_variant(variant))
    if hint:
        assert f"labelled for {hint})" in str(exc.value)
    else:
        assert "labelled for" not in str(exc.value)
    assert _keys(storage) == set()


@pytest.mark.parametrize(("version", "metadata_version"), [
    ("1.0", None),
    ("1.0+local", None),
    ("1.0+cu126torch2.7", None),
    ("1.0+cu12torch2.8cxx11abiTRUE", "1.0"),   # the upstream flash-attn defect
    ("1.0+cu128torch2.8", "1.0"),              # ... renamed, with METADATA still unlabelled
    ("1.0+cu128torch2.8", "1.0+cu126torch2.7"),
])
def test_publish_relabels(
    storage: Storage, tmp_path: Path, version: str, metadata_version: str | None
) -> None:
    path = make_wheel(tmp_path / "src", "pkg", version, metadata_version=metadata_version)
    record = publish(storage, path, V, relabel_wheel=True)
    assert record.filename == "pkg-1.0+cu128torch2.8-py3-none-any.whl"
    assert record.version == "1.0+cu128torch2.8"
    stored = tmp_path / record.filename
    storage.download(record.wheel_key, stored)
    assert_record_matches(stored)
    assert b"Version: 1.0+cu128torch2.8\n" in storage.get_bytes(record.metadata_key)
    assert record.sha256 == sha256_file(stored)
    # Relabelling is deterministic: the same source publishes as the same file again.
    assert publish(storage, path, V, relabel_wheel=True) == record


def test_publish_refuses_the_flash_attn_defect_without_relabel(
    storage: Storage, tmp_path: Path
) -> None:
    path = make_wheel(tmp_path, "flash-attn", "2.8.3+cu12torch2.8cxx11abiTRUE",
                      metadata_version="2.8.3", tag=TAG)
    with pytest.raises(VersionMismatch, match="--relabel"):
        publish(storage, path, V)
    assert _keys(storage) == set()
    record = publish(storage, path, V, relabel_wheel=True)
    assert record.filename == f"flash_attn-2.8.3+cu128torch2.8-{TAG}.whl"


@pytest.mark.parametrize("relabel_wheel", [False, True])
def test_publish_refuses_a_metadata_bomb_and_stores_nothing(
        local_storage: Storage, tmp_path: Path, relabel_wheel: bool) -> None:
    """``wheelhouse publish`` reads METADATA capped, as uploads do: a ~400 KiB wheel whose
    METADATA inflates to 400 MiB is refused, and no 400 MiB ``.metadata`` is ever stored."""
    bomb = metadata_bomb(tmp_path, "bomb", "1.0+cu128torch2.8", 400 << 20)
    with pytest.raises(InvalidWheel, match="METADATA is larger than"):
        publish(local_storage, bomb, V, relabel_wheel=relabel_wheel)
    assert _keys(local_storage) == set()


def test_publish_relabel_leaves_a_correct_wheel_alone(storage: Storage, tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    record = publish(storage, path, V, relabel_wheel=True)
    assert record.sha256 == sha256_file(path)  # the very bytes, not a rewritten copy
    assert publish(storage, path, V) == record


def test_publish_refuses_relabel_across_public_versions(storage: Storage, tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0", metadata_version="1.1")
    with pytest.raises(VersionMismatch):
        publish(storage, path, V, relabel_wheel=True)
    assert _keys(storage) == set()


@pytest.mark.parametrize(("variant", "archs", "expected"), [
    ("torch2.8-cu128", None, None),
    ("torch2.8-cu128", ("80", "90"), ("80", "90")),
    ("torch2.8-cu128-sm90", None, ("90",)),
    ("torch2.8-cu128-sm80-sm90", None, ("80", "90")),
    ("torch2.8-cu128-sm90", ("80", "90"), ("90",)),  # a narrowed variant implies its own
    ("torch2.8-cu128", (), None),                      # nothing known is unknown
    ("torch2.8-cu128", ("sm_90", "8.0", "sm90"), ("80", "90")),  # canonical, as in keys
])
def test_publish_records_archs(
    storage: Storage, tmp_path: Path, variant: str, archs: tuple[str, ...] | None,
    expected: tuple[str, ...] | None,
) -> None:
    v = parse_variant(variant)
    path = make_wheel(tmp_path, "pkg", f"1.0+{v.local_label}", tag=TAG)
    record = publish(storage, path, v, archs=archs)
    assert record.archs == expected
    assert record.variant == v and record.variant.key == variant
    # Narrowed wheels live with their base variant's, so that one page read finds them all.
    assert record.wheel_key == f"wheels/torch2.8-cu128/pkg/{path.name}"
    assert storage.exists(record_key(v.base, "pkg", path.name))


def test_publish_refuses_unknown_archs(storage: Storage, tmp_path: Path) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    with pytest.raises(InvalidVariant, match="unknown GPU architecture"):
        publish(storage, path, V, archs=("sm91",))
    assert _keys(storage) == set()


def test_record_json_round_trip() -> None:
    for archs in (None, ("80", "90")):
        record = Record(filename="p-1.0+cu128torch2.8-py3-none-any.whl",
                        project=canonicalize_name("p"),
                        version="1.0+cu128torch2.8", variant=V, archs=archs,
                        sha256="0" * 64, size=10, metadata_sha256="1" * 64,
                        requires_python=None, upload_time="2025-01-01T00:00:00.000Z",
                        yanked="broken build", build=BuildFacts(log_key="logs/x", seconds=3.0))
        raw = record.to_json()
        assert json.loads(raw)["archs"] == (None if archs is None else list(archs))
        assert json.loads(raw)["variant"] == "torch2.8-cu128"
        assert json.loads(raw)["build"] == {"log_key": "logs/x", "seconds": 3.0}
        assert Record.from_json(raw) == record


class _Watched(ForwardingStorage):
    """A real storage with a hook before each write, to see the order and to fail mid-way."""

    def __init__(self, inner: Storage, before_write: Callable[[str], None]) -> None:
        super().__init__(inner)
        self.hook = before_write

    def before_write(self, key: str) -> None:
        self.hook(key)


def test_record_is_written_last(storage: Storage, tmp_path: Path) -> None:
    order: list[str] = []
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    publish(_Watched(storage, order.append), path, V)
    wkey = wheel_key(V, "pkg", path.name)
    claim = f"claims/torch2.8-cu128/{path.name}"
    assert order == [claim, wkey, wkey + ".metadata", record_key(V, "pkg", path.name),
                     GENERATION_KEY]


class _Crash(Exception):
    pass


@pytest.mark.parametrize("crash_before", ["metadata", "record"])
def test_interrupted_publish_is_not_listed_and_can_be_retried(
    storage: Storage, tmp_path: Path, crash_before: str
) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    wkey = wheel_key(V, "pkg", path.name)
    stop_at = wkey + ".metadata" if crash_before == "metadata" else record_key(V, "pkg", path.name)

    def crash(key: str) -> None:
        if key == stop_at:
            raise _Crash

    catalog = Catalog(storage, refresh_seconds=0)
    with pytest.raises(_Crash):
        publish(_Watched(storage, crash), path, V)
    assert storage.exists(wkey)  # a leftover for gc...
    catalog.refresh()
    assert catalog.files(V, canonicalize_name("pkg")) == []  # ...that nobody sees
    assert catalog.projects(V) == []
    assert len(catalog) == 0

    record = publish(storage, path, V)
    catalog.refresh()
    assert catalog.files(V, record.project) == [record]


def test_concurrent_publication_of_the_same_name_is_refused(
    storage: Storage, tmp_path: Path
) -> None:
    """A second publisher of different bytes, arriving mid-publication, is refused and can't
    overwrite the wheel: the stored wheel always matches the record's sha256."""
    ours = make_wheel(tmp_path / "ours", "pkg", "1.0+cu128torch2.8", payload=b"ours")
    theirs = make_wheel(tmp_path / "theirs", "pkg", "1.0+cu128torch2.8", payload=b"theirs")
    wkey = wheel_key(V, "pkg", ours.name)
    rkey = record_key(V, "pkg", ours.name)
    refused: list[Exception] = []

    def someone_else_publishes_meanwhile(key: str) -> None:
        if key == rkey and not refused:
            try:
                publish(storage, theirs, V)
            except AlreadyPublished as exc:
                refused.append(exc)

    publish(_Watched(storage, someone_else_publishes_meanwhile), ours, V)
    assert refused and "different contents" in str(refused[0])
    assert Record.from_json(storage.get_bytes(rkey)).sha256 == sha256_file(ours)
    assert storage.get_bytes(wkey) == ours.read_bytes()


def test_variant_of_a_record(tmp_path: Path, storage: Storage) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8.sm90")
    record = publish(storage, path, V_SM90)
    assert record.variant == V_SM90
    assert record.variant.base == Variant.of("2.8", "12.8")
    # Stored as its key, so records of older versions read back the same.
    stored = json.loads(storage.get_bytes(record_key(V_SM90.base, "pkg", path.name)))
    assert stored["variant"] == "torch2.8-cu128-sm90"
    assert Record.from_json(json.dumps(stored).encode()) == record


# --- claims expire ------------------------------------------------------------------------------


def _dead_claim(storage: Storage, path: Path, *, age: float, payload: bytes = b"dead") -> str:
    """The claim a publisher of other bytes left ``age`` seconds ago before it died."""
    key = f"claims/torch2.8-cu128/{path.name}"
    claim = Claim(sha256=hashlib.sha256(payload).hexdigest(), id="dead", host="gone-host",
                  pid=4242, claimed_at=time.time() - age, by="worker gpu-7")
    storage.put_bytes(key, claim.to_json(), exclusive=True)
    return key


def test_a_fresh_claim_of_other_bytes_is_refused_and_says_whose(
    storage: Storage, tmp_path: Path
) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    _dead_claim(storage, path, age=60)
    with pytest.raises(AlreadyPublished, match=r"worker gpu-7 on gone-host \(pid 4242\), "
                                               r"claimed 6\ds ago\); if that publisher on "
                                               r"gone-host is gone, run `wheelhouse gc --apply` "
                                               r"there .* retry in 35\d\ds"):
        publish(storage, path, V, claim_timeout=3600)
    assert not storage.exists(record_key(V, "pkg", path.name))


def _exited_pid() -> int:
    """The pid of a process of this host that has run and ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_claim_whose_publisher_died_on_this_host_is_taken_over_at_once(
    storage: Storage, tmp_path: Path
) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    key = f"claims/torch2.8-cu128/{path.name}"
    dead = Claim(sha256="0" * 64, id="dead", host=socket.gethostname(), pid=_exited_pid(),
                 claimed_at=time.time() - 5)
    storage.put_bytes(key, dead.to_json(), exclusive=True)
    assert [d.key for d in gc.plan(storage, claim_timeout=3600)] == [key]  # listed at once
    record = publish(storage, path, V, claim_timeout=3600)
    assert Claim.parse(storage.get_bytes(key), 0.0).sha256 == record.sha256
    # A live publisher of this host is waited for.
    alive = make_wheel(tmp_path / "b", "pkg", "2.0+cu128torch2.8")
    live = Claim(sha256="0" * 64, id="live", host=socket.gethostname(), pid=os.getppid(),
                 claimed_at=time.time() - 5)
    storage.put_bytes(f"claims/torch2.8-cu128/{alive.name}", live.to_json(), exclusive=True)
    with pytest.raises(AlreadyPublished, match="retry in"):
        publish(storage, alive, V, claim_timeout=3600)


def test_an_expired_claim_without_a_record_is_taken_over(
    storage: Storage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    key = _dead_claim(storage, path, age=7200)
    with caplog.at_level("WARNING", logger="wheelhouse.index.publish"):
        record = publish(storage, path, V, claim_timeout=3600, by="alice")
    assert "took over the expired claim on" in caplog.text and "gone-host" in caplog.text
    held = Claim.parse(storage.get_bytes(key), 0.0)
    assert (held.sha256, held.by, held.host) == (record.sha256, "alice", socket.gethostname())
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.files(V, record.project) == [record]
    assert storage.get_bytes(record.wheel_key) == path.read_bytes()


def test_an_old_style_claim_expires_by_its_age_in_storage(storage: Storage,
                                                          tmp_path: Path) -> None:
    """Claims written before they said who and when hold a bare sha256: dated by mtime."""
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    key = f"claims/torch2.8-cu128/{path.name}"
    storage.put_bytes(key, b"0" * 64, exclusive=True)
    with pytest.raises(AlreadyPublished, match="claimed"):
        publish(storage, path, V, claim_timeout=3600)
    record = publish(storage, path, V, claim_timeout=0)
    assert Claim.parse(storage.get_bytes(key), 0.0).sha256 == record.sha256


def test_two_successors_racing_for_an_expired_claim_one_wins(
    storage: Storage, tmp_path: Path
) -> None:
    """Both read the dead claim; the second one's swap finds it changed and is refused, and
    the stored wheel is the winner's."""
    ours = make_wheel(tmp_path / "ours", "pkg", "1.0+cu128torch2.8", payload=b"ours")
    theirs = make_wheel(tmp_path / "theirs", "pkg", "1.0+cu128torch2.8", payload=b"theirs")
    key = _dead_claim(storage, ours, age=7200)
    writes: list[str] = []
    winner: list[Record] = []

    def they_take_over_first(k: str) -> None:
        writes.append(k)
        # Our second write of the claim is the swap: we have read the dead claim by now.
        if writes.count(key) == 2 and not winner:
            winner.append(publish(storage, theirs, V, claim_timeout=3600))

    with pytest.raises(AlreadyPublished, match="took over its expired claim first"):
        publish(_Watched(storage, they_take_over_first), ours, V, claim_timeout=3600)
    assert winner and Claim.parse(storage.get_bytes(key), 0.0).sha256 == winner[0].sha256
    assert storage.get_bytes(winner[0].wheel_key) == theirs.read_bytes()
    assert Catalog(storage, refresh_seconds=0).files(V, winner[0].project) == winner


def test_a_publisher_whose_claim_was_taken_over_stops_before_the_record(
    storage: Storage, tmp_path: Path
) -> None:
    """A publisher that outlived the publish timeout: another took the name over while it
    uploaded. It stops at its next step and lists nothing; the one upload it finished meanwhile
    is the damage no claim can prevent, and verify finds it."""
    slow = make_wheel(tmp_path / "slow", "pkg", "1.0+cu128torch2.8", payload=b"slow")
    fast = make_wheel(tmp_path / "fast", "pkg", "1.0+cu128torch2.8", payload=b"fast")
    wkey = wheel_key(V, "pkg", slow.name)
    taken: list[Record] = []

    def overtaken_while_uploading(k: str) -> None:
        if k == wkey and not taken:
            taken.append(publish(storage, fast, V, claim_timeout=0))

    with pytest.raises(AlreadyPublished, match="ran past the publish timeout"):
        publish(_Watched(storage, overtaken_while_uploading), slow, V, claim_timeout=3600)
    record = Record.from_json(storage.get_bytes(record_key(V, "pkg", slow.name)))
    assert record == taken[0] and record.sha256 == sha256_file(fast)
    assert storage.get_bytes(record.metadata_key) == read_metadata(fast)
    from wheelhouse.index.verify import check

    assert [p.key for p in check(storage, record)] == [record.wheel_key]


def test_publishing_the_same_bytes_repairs_a_quarantined_record(
    storage: Storage, tmp_path: Path
) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    record = publish(storage, path, V)
    storage.put_bytes(record.wheel_key, b"damaged")
    storage.put_bytes(f"quarantine/torch2.8-cu128/pkg/{path.name}.json", b"{}")
    bump = storage.get_bytes(GENERATION_KEY)
    assert publish(storage, path, V) == record
    assert storage.get_bytes(record.wheel_key) == path.read_bytes()
    assert not storage.exists(f"quarantine/torch2.8-cu128/pkg/{path.name}.json")
    assert storage.get_bytes(GENERATION_KEY) != bump  # every server lists it again
    assert Catalog(storage, refresh_seconds=0).files(V, record.project) == [record]


def test_the_same_bytes_published_concurrently_are_one_publication(
    storage: Storage, tmp_path: Path
) -> None:
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    rkey = record_key(V, "pkg", path.name)
    other: list[Record] = []

    def same_bytes_meanwhile(k: str) -> None:
        if k == rkey and not other:
            other.append(publish(storage, path, V))

    assert publish(_Watched(storage, same_bytes_meanwhile), path, V) == other[0]


def test_a_retry_announces_a_publication_whose_generation_bump_failed(
    storage: Storage, tmp_path: Path
) -> None:
    """Storage failed right after the record (a full disk): the retry of the same bytes tells
    the servers, which would otherwise never list it."""
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.files(V, canonicalize_name("pkg")) == []

    def disk_full_at_the_generation(key: str) -> None:
        if key == GENERATION_KEY:
            raise StorageUnavailable("No space left on device")

    with pytest.raises(StorageUnavailable):
        publish(_Watched(storage, disk_full_at_the_generation), path, V)
    assert catalog.files(V, canonicalize_name("pkg")) == []  # recorded, but nobody was told
    record = publish(storage, path, V)
    assert catalog.files(V, record.project) == [record]


def test_retrying_the_same_bytes_renews_an_expired_claim(storage: Storage,
                                                         tmp_path: Path) -> None:
    """Otherwise a publisher of other bytes could take the name over mid-upload."""
    path = make_wheel(tmp_path, "pkg", "1.0+cu128torch2.8")
    key = f"claims/torch2.8-cu128/{path.name}"
    old = Claim(sha256=sha256_file(path), id="dead", host="gone-host", pid=1,
                claimed_at=time.time() - 7200)
    storage.put_bytes(key, old.to_json(), exclusive=True)
    publish(storage, path, V, claim_timeout=3600, by="retry")
    renewed = Claim.parse(storage.get_bytes(key), 0.0)
    assert renewed.by == "retry" and time.time() - renewed.claimed_at < 60
