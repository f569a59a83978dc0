"""Yank, unyank and delete on storage, as the catalog of a running server sees them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_wheel
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.errors import InvalidTarget, NothingPublished
from wheelhouse.index.catalog import Catalog, Record
from wheelhouse.index.manage import Target, audit_entries, delete, unyank, yank
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import LocalStorage, Storage
from wheelhouse.variants import Variant, parse_variant

V = parse_variant("torch2.14-cu130")
W = parse_variant("torch2.14-cu128")


def _publish(storage: Storage, tmp: Path, version: str, variant: Variant = V,
             body: str = "") -> Record:
    wheel = make_wheel(tmp / f"{variant.key}-{version}-{len(body)}", "demo",
                       f"{version}+{variant.local_label}", module_body=body)
    return publish(storage, wheel, variant)


def test_yank_and_unyank_a_version_in_one_root(storage: Storage, tmp_path: Path) -> None:
    one = _publish(storage, tmp_path, "1.0")
    other_root = _publish(storage, tmp_path, "1.0", W)
    catalog = Catalog(storage, refresh_seconds=0)
    assert yank(storage, Target.parse("demo==1.0", V.key), who="t", reason="why") == [one]
    assert [r.yanked for r in catalog.files(V, one.project)] == ["why"]
    assert [r.yanked for r in catalog.files(W, one.project)] == [False]
    # Without --variant: every root; without a reason: yanked all the same.
    yank(storage, Target.parse("demo==1.0"), who="t")
    assert [r.yanked for r in catalog.files(W, other_root.project)] == [True]
    unyank(storage, Target.parse(one.filename), who="t")
    assert [r.yanked for r in catalog.files(V, one.project)] == [False]
    assert [e["action"] for e in audit_entries(storage)] == ["yank", "yank", "unyank"]


@pytest.mark.parametrize(("spec", "error"), [
    ("demo", InvalidTarget), ("demo==not a version", InvalidTarget),
    ("demo==9.9", NothingPublished), ("other==1.0", NothingPublished),
])
def test_targets_that_name_nothing(storage: Storage, tmp_path: Path, spec: str,
                                   error: type[Exception]) -> None:
    _publish(storage, tmp_path, "1.0")
    with pytest.raises(error):
        yank(storage, Target.parse(spec), who="t")


def test_a_name_deleted_and_published_again_is_read_again(local_storage: LocalStorage,
                                                          tmp_path: Path) -> None:
    """A server process that did not refresh between the delete and the new publication
    must not keep serving the old record (its sha256 would not match the new bytes)."""
    old = _publish(local_storage, tmp_path, "1.0")
    catalog = Catalog(local_storage, refresh_seconds=3600)
    catalog.refresh()
    delete(local_storage, Target.parse("demo==1.0"), who="t", reason="oops")
    assert not any(local_storage.exists(k) for k in (old.key, old.wheel_key, old.metadata_key))
    new = _publish(local_storage, tmp_path, "1.0", body="X = 1\n")
    assert new.filename == old.filename and new.sha256 != old.sha256
    catalog.refresh()
    assert [r.sha256 for r in catalog.files(V, new.project)] == [new.sha256]


def test_the_variant_form_goes_with_its_wheel(storage: Storage, tmp_path: Path) -> None:
    """Yanking or deleting a wheel with GPU code takes the variant form that ``/simple/``
    lists along (it names its source), and delete removes every key either one owns."""
    wheel = make_wheel(tmp_path / "gpu", "demo", f"1.0+{V.local_label}")
    source = publish(storage, wheel, V, build=BuildFacts(
        device_code={"demo/_C.so": {"sass": ["90"], "ptx": []}}))
    catalog = Catalog(storage, refresh_seconds=0)
    [form] = catalog.variant_files(source.project)
    assert form.variant_of == source.filename
    changed = yank(storage, Target.parse("demo==1.0", V.key), who="t", reason="bad")
    assert sorted(r.filename for r in changed) == sorted([source.filename, form.filename])
    assert [r.yanked for r in catalog.variant_files(source.project)] == ["bad"]
    delete(storage, Target.parse(source.filename), who="t")
    assert catalog.variant_files(source.project) == []
    for record in (source, form):
        assert not any(storage.exists(key) for key in record.keys())
