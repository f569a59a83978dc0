"""wheelhouse verify: stored files re-hashed against their records, and quarantine."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.helpers import make_wheel, run_console
from wheelhouse.config import Config
from wheelhouse.index import verify
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.layout import GENERATION_KEY, Record
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import Storage, open_storage
from wheelhouse.index.verify import Damage
from wheelhouse.variants import parse_variant

V = parse_variant("torch2.8-cu128")
PROJECT = canonicalize_name("demo")


def _published(storage: Storage, tmp_path: Path, versions: tuple[str, ...]) -> list[Record]:
    return [publish(storage, make_wheel(tmp_path / v, "demo", f"{v}+{V.local_label}",
                                        payload=bytes(range(256)) * 8), V)
            for v in versions]


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def _damage(storage: Storage, records: list[Record]) -> None:
    """One of each: a flipped byte, a truncation, a deletion, other METADATA bytes."""
    flipped, truncated, deleted, meta = records
    storage.put_bytes(flipped.wheel_key, _flip(storage.get_bytes(flipped.wheel_key), 100))
    storage.put_bytes(truncated.wheel_key, storage.get_bytes(truncated.wheel_key)[:-10])
    storage.delete(deleted.wheel_key)
    storage.put_bytes(meta.metadata_key, storage.get_bytes(meta.metadata_key) + b"X: y\n")


def test_whole_files_have_no_problems(storage: Storage, tmp_path: Path) -> None:
    _published(storage, tmp_path, ("1.0", "2.0"))
    report = verify.verify(storage)
    assert report.checked == 2 and report.problems == []


def test_damage_is_found_by_kind(storage: Storage, tmp_path: Path) -> None:
    records = _published(storage, tmp_path, ("1.0", "2.0", "3.0", "4.0", "5.0"))
    _damage(storage, records[:4])
    report = verify.verify(storage)
    assert report.checked == 5
    found = {(p.key, p.damage) for p in report.problems}
    assert found == {
        (records[0].wheel_key, Damage.MISMATCHED),
        (records[1].wheel_key, Damage.TRUNCATED),
        (records[2].wheel_key, Damage.MISSING),
        (records[3].metadata_key, Damage.MISMATCHED),
    }
    assert [r.key for r in report.damaged] == [r.key for r in records[:4]]
    truncated = next(p for p in report.problems if p.damage is Damage.TRUNCATED)
    assert truncated.detail == f"{records[1].size - 10} bytes, the record says {records[1].size}"


def test_quarantine_drops_damaged_files_until_republished(storage: Storage,
                                                          tmp_path: Path) -> None:
    records = _published(storage, tmp_path, ("1.0", "2.0", "3.0", "4.0", "5.0"))
    _damage(storage, records[:4])
    generation = storage.get_bytes(GENERATION_KEY)
    catalog = Catalog(storage, refresh_seconds=0)
    assert len(catalog.files(V, PROJECT)) == 5

    assert verify.quarantine(storage, verify.verify(storage)) == (4, 0)
    assert storage.get_bytes(GENERATION_KEY) != generation  # every server re-reads
    assert catalog.files(V, PROJECT) == [records[4]]
    assert catalog.quarantined() == records[:4]
    # Still damaged, still reported (as quarantined), not quarantined twice.
    again = verify.verify(storage)
    assert len(again.damaged) == 4 and all(p.quarantined for p in again.problems)
    assert verify.quarantine(storage, again) == (0, 0)

    # Publishing the same bytes again stores them anew and lists them again.
    for r in records[:4]:
        publish(storage, tmp_path / r.filename.split("-")[1].split("+")[0] / r.filename, V)
    assert catalog.files(V, PROJECT) == records
    assert verify.verify(storage).problems == []


def test_quarantined_files_restored_behind_our_back_are_listed_again(
    storage: Storage, tmp_path: Path
) -> None:
    record = _published(storage, tmp_path, ("1.0",))[0]
    good = storage.get_bytes(record.wheel_key)
    storage.put_bytes(record.wheel_key, good[:-1])
    verify.quarantine(storage, verify.verify(storage))
    assert Catalog(storage, refresh_seconds=0).files(V, PROJECT) == []
    storage.put_bytes(record.wheel_key, good)  # an operator restored it from a backup
    report = verify.verify(storage)
    assert report.problems == [] and report.repaired == [record]
    assert verify.quarantine(storage, report) == (0, 1)
    assert Catalog(storage, refresh_seconds=0).files(V, PROJECT) == [record]


@pytest.mark.parametrize("quarantine", [False, True])
def test_cli_exits_non_zero_on_damage(tmp_path: Path, quarantine: bool) -> None:
    config = Config(storage=str(tmp_path / "data"))
    storage = open_storage(config)
    records = _published(storage, tmp_path, ("1.0", "2.0", "3.0", "4.0", "5.0"))
    clean = run_console("verify", config=config)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.strip() == "checked 5 published files: 0 damaged"

    _damage(storage, records[:4])
    args = ("verify", "--quarantine") if quarantine else ("verify",)
    done = run_console(*args, config=config)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert f"mismatched {records[0].wheel_key}: sha256 " in done.stdout
    assert f"truncated {records[1].wheel_key}: " in done.stdout
    assert f"missing {records[2].wheel_key}: no such object" in lines
    assert f"mismatched {records[3].metadata_key}: sha256 " in done.stdout
    assert "checked 5 published files: 4 damaged" in lines
    listed = Catalog(storage, refresh_seconds=0).files(V, PROJECT)
    assert listed == ([records[4]] if quarantine else records)
    if quarantine:
        assert "quarantined 4, listed again 0" in lines
    else:
        assert "run again with --quarantine" in done.stdout
