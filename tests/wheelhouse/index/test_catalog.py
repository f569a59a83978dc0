"""The catalog over both storages: what each index root lists, and refresh across processes."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.utils import NormalizedName, canonicalize_name, parse_wheel_filename

from tests.helpers import free_port, make_wheel
from tests.wheelhouse.conftest import ForwardingStorage
from wheelhouse.config import Config
from wheelhouse.errors import StorageUnavailable
from wheelhouse.index.catalog import CATCH_UP, Catalog
from wheelhouse.index.layout import Record, quarantine_key, record_key
from wheelhouse.index.publish import Checked, bump_generation, publish, publish_checked
from wheelhouse.index.storage import (
    LocalStorage,
    ObjectInfo,
    S3Storage,
    Storage,
    make_s3_client,
)
from wheelhouse.retry import RetryPolicy
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import read_metadata

FA = canonicalize_name("flash-attn")
CP312 = "cp312-cp312-linux_x86_64"
CP311 = "cp311-cp311-linux_x86_64"


def _publish(
    storage: Storage,
    tmp_path: Path,
    variant: str,
    version: str = "2.8.3",
    *,
    tag: str = CP312,
    archs: tuple[str, ...] | None = None,
    project: str = "flash-attn",
    build_tag: str | None = None,
) -> Record:
    v = parse_variant(variant)
    directory = tmp_path / "src" / f"{variant}-{version}-{tag}-{build_tag}"
    path = make_wheel(directory, project, f"{version}+{v.local_label}", tag=tag,
                      payload=variant.encode())
    if build_tag:
        dist, ver, rest = path.name.split("-", 2)
        path = path.rename(path.with_name(f"{dist}-{ver}-{build_tag}-{rest}"))
        # A rebuild under a build tag is the fleet's to publish (publish_checked, as the
        # worker does): publish() refuses other bytes for a release's identity (issue 26).
        return publish_checked(storage, Checked(path, read_metadata(path)), v, archs=archs)
    return publish(storage, path, v, archs=archs)


def _assert_one_file_per_version_and_tags(records: list[Record]) -> None:
    keys: Counter[tuple[str, frozenset[object]]] = Counter()
    for r in records:
        _, version, _, tags = parse_wheel_filename(r.filename)
        keys[(version.public, tags)] += 1
    assert all(n == 1 for n in keys.values()), keys


def _names(records: list[Record]) -> list[str]:
    return [r.filename for r in records]


def test_empty_catalog(storage: Storage) -> None:
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.variants() == []
    assert catalog.projects(parse_variant("torch2.8-cu128")) == []
    assert catalog.files(parse_variant("torch2.8-cu128"), FA) == []
    assert len(catalog) == 0
    assert catalog.generation == "empty"


def test_catalog_lists_what_is_published(storage: Storage, tmp_path: Path) -> None:
    fat = _publish(storage, tmp_path, "torch2.8-cu128")
    older = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    other = _publish(storage, tmp_path, "torch2.8-cu128", "0.1", project="other-ext")
    narrow = _publish(storage, tmp_path, "torch2.8-cu128-sm90", "2.8.3")
    elsewhere = _publish(storage, tmp_path, "torch2.7-cu126")
    catalog = Catalog(storage, refresh_seconds=60)

    base = parse_variant("torch2.8-cu128")
    assert [v.key for v in catalog.variants()] == [
        "torch2.7-cu126", "torch2.8-cu128", "torch2.8-cu128-sm90"]
    assert catalog.projects(base) == ["flash-attn", "other-ext"]
    assert catalog.files(base, FA) == [older, fat]  # by version
    assert catalog.files(parse_variant("torch2.7-cu126"), FA) == [elsewhere]
    assert catalog.files(parse_variant("torch2.6-cu126"), FA) == []
    assert catalog.files(base, canonicalize_name("unknown")) == []
    assert catalog.find(base, FA, fat.filename) == fat
    assert catalog.find(base, FA, narrow.filename) == narrow  # stored with its base variant
    assert catalog.find(base, FA, "nope-1.0-py3-none-any.whl") is None
    assert catalog.find(parse_variant("torch2.7-cu126"), FA, fat.filename) is None
    assert sorted(r.filename for r in catalog.all_records()) == sorted(
        r.filename for r in (fat, older, other, narrow, elsewhere))
    assert len(catalog) == 5
    assert catalog.generation == storage.get_bytes("generation").decode()


# (published: (variant, version, tag, archs)), root, expected (variant, version, tag) listed
SELECTION = [
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, None), ("torch2.8-cu128-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128-sm90", "2.8.3", CP312)],
        id="sm90-only wheel preferred over the fat one",
    ),
    pytest.param(
        [("torch2.8-cu128-sm90", "2.8.3", CP312, None), ("torch2.8-cu128", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128-sm90", "2.8.3", CP312)],
        id="preferred whatever the publication order",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, None), ("torch2.8-cu128-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128", [("torch2.8-cu128", "2.8.3", CP312)],
        id="base root lists only the fat wheel",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128", "2.8.3", CP312)],
        id="fat wheel used when no narrowed one exists",
    ),
    pytest.param(
        [("torch2.8-cu128-sm80", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [],
        id="sm80-only wheel is not listed on sm90",
    ),
    pytest.param(
        [("torch2.8-cu128-sm80", "2.8.3", CP312, None)],
        "torch2.8-cu128", [],
        id="sm80-only wheel is not on the base root",
    ),
    pytest.param(
        [("torch2.8-cu128-sm80", "2.8.3", CP312, None), ("torch2.8-cu128", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128", "2.8.3", CP312)],
        id="sm80-only wheel never beats a fat one on sm90",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, None),
         ("torch2.8-cu128-sm80-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128-sm80-sm90", "2.8.3", CP312)],
        id="narrowed superset preferred over an unknown fat set",
    ),
    pytest.param(
        [("torch2.8-cu128-sm80-sm90", "2.8.3", CP312, None),
         ("torch2.8-cu128-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128-sm90", "2.8.3", CP312)],
        id="exact arch set preferred over a superset",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, ("80", "90", "100"))],
        "torch2.8-cu128-sm120", [],
        id="fat wheel with known archs missing the root's is not listed",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, ("80", "90", "100"))],
        "torch2.8-cu128-sm90", [("torch2.8-cu128", "2.8.3", CP312)],
        id="fat wheel with known archs holding the root's is listed",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, None), ("torch2.8-cu128", "2.8.3", CP311, None),
         ("torch2.8-cu128-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90",
        [("torch2.8-cu128", "2.8.3", CP311), ("torch2.8-cu128-sm90", "2.8.3", CP312)],
        id="per tags: narrowed for cp312, fat for cp311",
    ),
    pytest.param(
        [("torch2.8-cu128", "2.8.3", CP312, None), ("torch2.8-cu128-sm90", "2.8.2", CP312, None)],
        "torch2.8-cu128-sm90",
        [("torch2.8-cu128-sm90", "2.8.2", CP312), ("torch2.8-cu128", "2.8.3", CP312)],
        id="per version: narrowed 2.8.2 and fat 2.8.3",
    ),
    pytest.param(
        [("torch2.8-cu128-sm90", "2.8.3", CP312, None),
         ("torch2.8-cu128-cxx11abi0", "2.8.3", CP312, None),
         ("torch2.8-cu128-cxx11abi0-sm90", "2.8.3", CP312, None),
         ("torch2.7-cu128-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128-sm90", [("torch2.8-cu128-sm90", "2.8.3", CP312)],
        id="other ABIs and torch versions never leak in",
    ),
    pytest.param(
        [("torch2.8-cu128-cxx11abi0", "2.8.3", CP312, None),
         ("torch2.8-cu128-cxx11abi0-sm90", "2.8.3", CP312, None)],
        "torch2.8-cu128-cxx11abi0-sm90", [("torch2.8-cu128-cxx11abi0-sm90", "2.8.3", CP312)],
        id="narrowing works under a non-default ABI",
    ),
]


@pytest.mark.parametrize(("published", "root", "expected"), SELECTION)
def test_narrowed_arch_selection(
    storage: Storage,
    tmp_path: Path,
    published: list[tuple[str, str, str, tuple[str, ...] | None]],
    root: str,
    expected: list[tuple[str, str, str]],
) -> None:
    for variant, version, tag, archs in published:
        _publish(storage, tmp_path, variant, version, tag=tag, archs=archs)
    catalog = Catalog(storage, refresh_seconds=60)
    files = catalog.files(parse_variant(root), FA)
    listed = [(r.variant.key, str(parse_wheel_filename(r.filename)[1].public),
               r.filename.split("-", 2)[2].removesuffix(".whl")) for r in files]
    assert listed == expected
    _assert_one_file_per_version_and_tags(files)
    assert catalog.projects(parse_variant(root)) == (["flash-attn"] if expected else [])


def test_base_root_lists_one_file_per_version_and_tags(storage: Storage, tmp_path: Path) -> None:
    plain = _publish(storage, tmp_path, "torch2.8-cu128")
    rebuilt = _publish(storage, tmp_path, "torch2.8-cu128", build_tag="2")
    first = _publish(storage, tmp_path, "torch2.8-cu128", build_tag="1")
    other = _publish(storage, tmp_path, "torch2.8-cu128", tag=CP311, build_tag="1")
    catalog = Catalog(storage, refresh_seconds=60)
    for root in ("torch2.8-cu128", "torch2.8-cu128-sm90"):
        files = catalog.files(parse_variant(root), FA)
        _assert_one_file_per_version_and_tags(files)
        # The highest build tag wins, as installers would pick it.
        assert sorted(_names(files)) == sorted([rebuilt.filename, other.filename])
    assert {plain.filename, first.filename}.isdisjoint(
        _names(catalog.files(parse_variant("torch2.8-cu128"), FA)))


def test_many_wheels_never_list_duplicates(storage: Storage, tmp_path: Path) -> None:
    variants = ["torch2.8-cu128", "torch2.8-cu128-sm90", "torch2.8-cu128-sm80",
                "torch2.8-cu128-sm80-sm90", "torch2.8-cu128-sm90-sm100"]
    for variant in variants:
        for version in ("2.8.2", "2.8.3"):
            for tag in (CP311, CP312):
                _publish(storage, tmp_path, variant, version, tag=tag)
    catalog = Catalog(storage, refresh_seconds=60)
    for root in [*variants, "torch2.8-cu128-sm100", "torch2.8-cu128-sm120"]:
        files = catalog.files(parse_variant(root), FA)
        _assert_one_file_per_version_and_tags(files)
        assert len(files) == 4, root  # every (version, tags) has a fat wheel at least
    sm90 = catalog.files(parse_variant("torch2.8-cu128-sm90"), FA)
    assert {r.variant.key for r in sm90} == {"torch2.8-cu128-sm90"}
    sm100 = catalog.files(parse_variant("torch2.8-cu128-sm100"), FA)
    assert {r.variant.key for r in sm100} == {"torch2.8-cu128-sm90-sm100"}


def test_a_wheel_without_a_record_is_not_listed(storage: Storage, tmp_path: Path) -> None:
    record = _publish(storage, tmp_path, "torch2.8-cu128")
    # A half-finished publication: wheel and metadata there, no record.
    stray = make_wheel(tmp_path / "stray", "flash-attn", "2.8.4+cu128torch2.8", tag=CP312)
    storage.put_file(f"wheels/torch2.8-cu128/flash-attn/{stray.name}", stray)
    storage.put_bytes(f"wheels/torch2.8-cu128/flash-attn/{stray.name}.metadata", b"Name: x\n")
    bump_generation(storage)
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.files(parse_variant("torch2.8-cu128"), FA) == [record]
    assert catalog.find(parse_variant("torch2.8-cu128"), FA, stray.name) is None
    assert len(catalog) == 1


def test_another_catalog_sees_a_publication_after_refresh_seconds(
    storage: Storage, tmp_path: Path
) -> None:
    """Two catalogs on one storage, as two gunicorn workers: neither is told, both converge."""
    refresh = 1.5
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    worker_a = Catalog(storage, refresh_seconds=refresh)
    worker_b = Catalog(storage, refresh_seconds=refresh)
    assert worker_a.files(base, FA) == [first]
    loaded_at = time.monotonic()
    generation = worker_a.generation

    # Another process (the publisher) adds a wheel; worker B has not looked yet.
    second = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    assert worker_b.files(base, FA) == [first, second]
    if time.monotonic() - loaded_at < refresh:
        assert worker_a.files(base, FA) == [first], "re-read before refresh_seconds passed"
    time.sleep(max(0.0, loaded_at + refresh - time.monotonic()) + 0.1)
    assert worker_a.files(base, FA) == [first, second]
    assert worker_a.generation != generation
    assert worker_a.generation == worker_b.generation


def test_refresh_picks_up_new_projects_variants_and_removals(
    storage: Storage, tmp_path: Path
) -> None:
    catalog = Catalog(storage, refresh_seconds=60)
    assert catalog.variants() == []
    a = _publish(storage, tmp_path, "torch2.8-cu128")
    catalog.refresh()
    assert [v.key for v in catalog.variants()] == ["torch2.8-cu128"]

    b = _publish(storage, tmp_path, "torch2.9-cu130-sm100", project="other-ext")
    catalog.refresh()
    assert {"torch2.8-cu128", "torch2.9-cu130-sm100"} <= {v.key for v in catalog.variants()}
    assert catalog.projects(parse_variant("torch2.9-cu130-sm100")) == ["other-ext"]
    assert catalog.files(parse_variant("torch2.8-cu128"), FA) == [a]

    # Taking a record away (what gc or an operator would do) unlists the wheel everywhere.
    storage.delete(record_key(parse_variant("torch2.9-cu130"), b.project, b.filename))
    bump_generation(storage)
    catalog.refresh()
    assert catalog.projects(parse_variant("torch2.9-cu130-sm100")) == []
    assert catalog.files(parse_variant("torch2.9-cu130-sm100"),
                         NormalizedName("other-ext")) == []
    assert len(catalog) == 1
    assert catalog.files(parse_variant("torch2.8-cu128"), FA) == [a]


def test_without_a_generation_bump_nothing_is_reread(storage: Storage, tmp_path: Path) -> None:
    # The generation marker is what tells readers: a record written without it stays unseen
    # (a reader does not list storage on every request, only every RECONCILE seconds), and is
    # seen once it changes.
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    catalog = Catalog(storage, refresh_seconds=0)
    base = parse_variant("torch2.8-cu128")
    assert catalog.files(base, FA) == [first]
    generation = storage.get_bytes("generation")
    second = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    storage.put_bytes("generation", generation)
    assert catalog.files(base, FA) == [first]
    bump_generation(storage)
    assert catalog.files(base, FA) == [first, second]
    assert second.project == FA


def test_a_restore_that_writes_the_marker_first_is_seen_by_the_next_whole_listing(
    storage: Storage, tmp_path: Path
) -> None:
    """A backup restored key by key in name order (``generation`` before ``records/``) into
    storage a server read while it was empty: the server reads the marker with no records
    under it yet. The marker never changes again, so only a whole listing finds the records;
    it gives the view a generation of its own, so pages rendered from the empty view go."""
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    backup = {o.key: storage.get_bytes(o.key) for o in storage.list("")}
    for key in backup:
        storage.delete(key)
    reconcile = 0.3
    catalog = Catalog(storage, refresh_seconds=0, reconcile_seconds=reconcile)
    assert catalog.files(base, FA) == [] and catalog.generation == "empty"
    marker = backup["generation"].decode()
    storage.put_bytes("generation", backup.pop("generation"))
    assert catalog.files(base, FA) == [] and catalog.generation == marker
    for key, data in backup.items():
        storage.put_bytes(key, data)
    assert catalog.files(base, FA) == []  # the marker has not changed: not listed yet
    time.sleep(reconcile)
    # The reader that starts the whole listing does not wait for it; a later one sees it.
    deadline = time.monotonic() + 10
    while catalog.files(base, FA) != [first]:
        assert time.monotonic() < deadline, "the whole listing never found the restore"
        time.sleep(0.02)
    assert catalog.generation not in ("empty", marker) and catalog.generation.startswith(marker)
    # Listing it again finds nothing new: the same view, the same generation.
    seen = catalog.generation
    time.sleep(reconcile)
    catalog.refresh()
    assert catalog.generation == seen and catalog.files(base, FA) == [first]


def test_no_reader_waits_for_a_whole_listing_under_an_unchanged_marker(
    storage: Storage, tmp_path: Path
) -> None:
    """A whole listing finds only what a restore brought: the reader that starts one reads the
    current view at once, while a new marker (a publication) is still waited for."""
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    gated = _Listings(storage)
    catalog = Catalog(gated, refresh_seconds=0, wait=5, reconcile_seconds=0)
    assert catalog.files(base, FA) == [first]
    gated.gate.clear()  # listings hang; the marker is still read
    started = time.monotonic()
    assert catalog.files(base, FA) == [first]
    assert time.monotonic() - started < 2, "the reader waited for a whole listing"
    gated.gate.set()
    catalog.refresh()  # whoever asks to wait does

    second = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    catalog = Catalog(gated, refresh_seconds=0, wait=5, reconcile_seconds=3600)
    assert catalog.files(base, FA) == [first, second]
    third = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.4")
    # A new marker: the reader that starts the refresh waits for it (up to ``wait``).
    assert catalog.files(base, FA) == [first, second, third]


def test_a_whole_listing_reads_only_the_markers_that_changed(
    storage: Storage, tmp_path: Path
) -> None:
    """Yank markers (like proofs) are read again only when their stamp changed: a rewritten
    reason is seen, an unchanged marker is not fetched on every whole listing."""
    base = parse_variant("torch2.8-cu128")
    rec = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    marker = rec.yank_key
    storage.put_bytes(marker, b'{"reason": "broken"}')
    bump_generation(storage)
    counted = _Counted(storage)
    catalog = Catalog(counted, refresh_seconds=0, reconcile_seconds=0)
    assert catalog.files(base, FA)[0].yanked == "broken"
    for _ in range(3):
        catalog.refresh()
    assert counted.reads[marker] == 1
    time.sleep(0.05)  # a local file's time is precise; S3's ETag changes with the bytes
    storage.put_bytes(marker, b'{"reason": "miscompiled"}')
    catalog.refresh()
    assert counted.reads[marker] == 2
    assert catalog.files(base, FA)[0].yanked == "miscompiled"
    assert catalog.generation.endswith("+1")  # found by a whole listing, under its own name


# --- storage trouble: readers never wait, stale beats down ------------------------------------


class _Listings(ForwardingStorage):
    """A real storage whose listings (not reads) block while the gate is closed."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        assert self.gate.wait(60), "the test never reopened the gate"
        return super().list(prefix)


class _Counted(ForwardingStorage):
    """A real storage that counts reads of each key."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.reads: Counter[str] = Counter()

    def get_bytes(self, key: str) -> bytes:
        self.reads[key] += 1
        return super().get_bytes(key)


class _Gated(ForwardingStorage):
    """A real storage whose reads block while the gate is closed: storage that hangs."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()

    def before_read(self, key: str) -> None:
        assert self.gate.wait(60), "the test never reopened the gate"


def _unreachable(storage: Storage, tmp_path: Path) -> Storage:
    """The same kind of storage, with nothing behind it (real errors, translated)."""
    if isinstance(storage, LocalStorage):
        (tmp_path / "root-is-a-file").write_bytes(b"")
        return LocalStorage(tmp_path / "root-is-a-file")
    assert isinstance(storage, S3Storage)
    client = make_s3_client(Config(storage="s3://x", s3_endpoint_url=f"http://127.0.0.1:{free_port()}"),
                            policy=RetryPolicy(attempts=1, timeout=1))
    return S3Storage(client, storage.bucket, storage.prefix)


def test_readers_never_wait_on_a_hung_refresh(storage: Storage, tmp_path: Path) -> None:
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    gated = _Gated(storage)
    catalog = Catalog(gated, refresh_seconds=0, wait=0.5)
    assert catalog.files(base, FA) == [first]

    gated.gate.clear()  # storage hangs from now on
    second = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    started = time.monotonic()
    assert catalog.files(base, FA) == [first]  # the one that started the refresh waited 0.5 s
    for _ in range(20):  # ... every other reader not at all: a refresh is under way
        assert catalog.files(base, FA) == [first]
    assert time.monotonic() - started < 0.5 + 2
    time.sleep(0.3)  # the refresh has now hung for longer than ``wait``
    state = catalog.state()
    assert state.loaded and state.stale and state.error is None  # hung, not failed (yet)

    gated.gate.set()
    deadline = time.monotonic() + 30
    while catalog.files(base, FA) != [first, second]:
        assert time.monotonic() < deadline, "the refresh never finished after storage came back"
        time.sleep(0.05)
    assert not catalog.state().stale


def test_a_failed_refresh_keeps_the_last_catalog_and_says_so(
    storage: Storage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.files(base, FA) == [first] and not catalog.state().stale

    catalog.storage = _unreachable(storage, tmp_path)
    with caplog.at_level(logging.WARNING, logger="wheelhouse.index.catalog"):
        with pytest.raises(StorageUnavailable):
            catalog.refresh()  # an explicit refresh says why it failed
        for _ in range(5):
            assert catalog.files(base, FA) == [first]  # readers: the last good view
    state = catalog.state()
    assert state.stale and state.loaded and state.generation is not None
    assert state.error and state.age >= 0
    assert [r.getMessage() for r in caplog.records].count(
        f"catalog refresh failed; serving the last good catalog: {state.error}") == 1

    catalog.storage = storage
    second = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    deadline = time.monotonic() + 30
    while catalog.files(base, FA) != [first, second]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not catalog.state().stale and catalog.state().error is None


def test_a_catalog_never_read_answers_unavailable_until_storage_answers(
    storage: Storage, tmp_path: Path
) -> None:
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    catalog = Catalog(_unreachable(storage, tmp_path), refresh_seconds=0)
    with pytest.raises(StorageUnavailable):
        catalog.refresh()
    for read in (lambda: catalog.files(base, FA), lambda: catalog.generation,
                 catalog.variants, lambda: len(catalog)):
        with pytest.raises(StorageUnavailable, match="not been read from storage yet"):
            read()
    assert not catalog.state().loaded
    catalog.storage = storage
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(StorageUnavailable):
            if catalog.files(base, FA) == [first]:
                break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert catalog.state().loaded and not catalog.state().stale


def test_quarantined_records_are_not_listed(storage: Storage, tmp_path: Path) -> None:
    base = parse_variant("torch2.8-cu128")
    a = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    b = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.files(base, FA) == [a, b]
    storage.put_bytes(quarantine_key(b.key), b"{}")
    bump_generation(storage)
    assert catalog.files(base, FA) == [a]
    assert catalog.find(base, FA, b.filename) is None
    assert catalog.quarantined() == [b] and len(catalog) == 1
    storage.delete(quarantine_key(b.key))
    bump_generation(storage)
    assert catalog.files(base, FA) == [a, b] and catalog.quarantined() == []


def test_storage_emptied_under_a_running_catalog_is_not_an_empty_index(
    storage: Storage, tmp_path: Path
) -> None:
    """A bucket re-created empty, a volume not mounted: the generation marker, which is never
    deleted, is gone. Readers keep the last good catalog (stale) instead of listing nothing."""
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    catalog = Catalog(storage, refresh_seconds=0)
    assert catalog.files(base, FA) == [first]
    for obj in list(storage.list("")):
        storage.delete(obj.key)
    with pytest.raises(StorageUnavailable, match="generation marker is gone"):
        catalog.refresh()
    assert catalog.files(base, FA) == [first] and catalog.state().stale
    # A server started now accepts the empty storage.
    assert Catalog(storage, refresh_seconds=0).files(base, FA) == []


def test_catch_up_sees_a_publication_before_refresh_seconds(storage: Storage,
                                                            tmp_path: Path) -> None:
    """What a file download that another worker's page listed asks for (web.files)."""
    base = parse_variant("torch2.8-cu128")
    first = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.2")
    catalog = Catalog(storage, refresh_seconds=3600)
    assert catalog.files(base, FA) == [first]
    second = _publish(storage, tmp_path, "torch2.8-cu128", "2.8.3")
    assert catalog.find(base, FA, second.filename) is None  # not due for an hour
    time.sleep(CATCH_UP)
    catalog.catch_up()
    assert catalog.find(base, FA, second.filename) == second


def test_one_listing_answers_a_project_page(local_storage: LocalStorage, tmp_path: Path) -> None:
    """The files a root lists, where else the project is, and whether it is this index's own,
    from one view of the catalog."""
    here = _publish(local_storage, tmp_path, "torch2.8-cu128")
    catalog = Catalog(local_storage, refresh_seconds=0)
    listed = catalog.listing(parse_variant("torch2.8-cu128"), FA)
    assert listed.files == [here] and listed.elsewhere == [here.variant]
    assert listed.published_here and not listed.upstream_listed
    other = catalog.listing(parse_variant("torch2.8-cu126"), FA)
    assert other.files == [] and other.elsewhere == [here.variant]
    plain = catalog.listing(None, FA)  # /simple/: no variant wheel (no device code here)
    assert plain.files == [] and plain.published_here
    nothing = catalog.listing(parse_variant("torch2.8-cu128"), canonicalize_name("absent"))
    assert nothing == type(nothing)(files=[], elsewhere=[], published_here=False,
                                    upstream_listed=False)
