"""The variant form of a wheel: labels, METADATA, variant.json, and its publication beside the
wheel it is made from (same protocol, listed only by the plain root)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from tests.helpers import make_wheel, run_console
from wheelhouse.builds.facts import BuildFacts
from wheelhouse.config import Config
from wheelhouse.index import gc, variantwheels, verify
from wheelhouse.index.catalog import Catalog
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import Storage, open_storage
from wheelhouse.variants import parse_variant
from wheelhouse.wheels import parse_metadata, read_metadata, split_variant_label, validate_wheel

VARIANT = parse_variant("torch2.14-cu130-sm90")


def facts(*sass: str) -> BuildFacts:
    """What the build's device-code check found, as the worker records it."""
    return BuildFacts(device_code={"pkg/_C.so": {"sass": list(sass), "ptx": []}})


@pytest.mark.parametrize(("cuda", "archs", "label"), [
    ("13.0", ["90"], "cu130sm90"),
    ("13.0", ["120", "80", "90"], "cu130sm80_90_120"),
    ("12.8", ["90a"], "cu128sm90a"),
    ("13.1", ["120"], "cu131sm120"),
])
def test_labels_name_cuda_and_archs(cuda: str, archs: list[str], label: str) -> None:
    assert variantwheels.label_for(cuda, archs) == label


def test_many_archs_get_a_short_stable_label() -> None:
    fat = variantwheels.label_for("13.0", ["80", "90", "100", "110", "120"])
    assert len(fat) == 16 and fat.startswith("cu130h")
    assert variantwheels.label_for("13.0", ["120", "110", "100", "90", "80"]) == fat
    assert variantwheels.label_for("13.0", ["80", "90", "100", "120"]) != fat
    assert variantwheels.label_for("12.8", ["80", "90", "100", "110", "120"]) != fat


def test_properties_one_real_arch_per_sass_arch() -> None:
    assert variantwheels.properties("13.0", ["90a", "90", "120", "80"]) == {
        "nvidia": {"cuda_version_lower_bound": ["13.0"],
                   "sm_arch": ["80_real", "90_real", "120_real"]}}


@pytest.mark.parametrize(("filename", "plain", "label"), [
    ("x-1.0-py3-none-any.whl", "x-1.0-py3-none-any.whl", None),
    ("x-1.0-1-py3-none-any.whl", "x-1.0-1-py3-none-any.whl", None),  # a build tag
    ("x-1.0+pt214-py3-none-any-cu130sm90.whl", "x-1.0+pt214-py3-none-any.whl", "cu130sm90"),
    ("x-1.0-1-py3-none-any-cu130sm90.whl", "x-1.0-1-py3-none-any.whl", "cu130sm90"),
    ("x-1.0-py3-none-any-CU130.whl", "x-1.0-py3-none-any-CU130.whl", None),
])
def test_split_variant_label(filename: str, plain: str, label: str | None) -> None:
    assert split_variant_label(filename) == (plain, label)


def test_variant_wheel_is_a_whole_wheel(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "src", "pkg", f"1.0+{VARIANT.local_label}",
                     tag="cp311-cp311-linux_x86_64",
                     requires=["torch", "einops", 'torch>=2 ; extra == "test"'])
    out = tmp_path / "out"
    out.mkdir()
    path, label = variantwheels.make_variant_wheel(src, VARIANT, ["90"], out)
    assert label == "cu130sm90"
    assert path.name == "pkg-1.0+pt214-cp311-cp311-linux_x86_64-cu130sm90.whl"
    meta = read_metadata(path).decode()
    assert "Version: 1.0+pt214" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist")]
    assert requires == ["Requires-Dist: einops", 'Requires-Dist: torch>=2 ; extra == "test"',
                        "Requires-Dist: torch==2.14.*"]
    with zipfile.ZipFile(path) as zf:
        own = json.loads(zf.read("pkg-1.0+pt214.dist-info/variant.json"))
        assert "pkg-1.0+pt214.dist-info/variant.json" in zf.read(
            "pkg-1.0+pt214.dist-info/RECORD").decode()
    assert own["variants"] == {"cu130sm90": {"nvidia": {
        "cuda_version_lower_bound": ["13.0"], "sm_arch": ["90_real"]}}}
    assert own["providers"]["nvidia"] == dict(variantwheels.PROVIDER)
    assert own["default-priorities"] == {"namespace": ["nvidia"]}
    # RECORD, names and METADATA check out as for any wheel (under its plain name).
    plain = tmp_path / split_variant_label(path.name)[0]
    shutil.copy(path, plain)
    validate_wheel(plain, "pkg", Version("1.0+pt214"), lambda tags: True)
    # The same source gives the same bytes: republishing is a no-op, not a conflict.
    again, _ = variantwheels.make_variant_wheel(src, VARIANT, ["90"], tmp_path / "src")
    assert again.read_bytes() == path.read_bytes()


def test_publish_writes_both_forms(storage: Storage, tmp_path: Path) -> None:
    src = make_wheel(tmp_path, "pkg", f"1.0+{VARIANT.local_label}", requires=["torch"])
    record = publish(storage, src, VARIANT, build=facts("90"))
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    [vrec] = catalog.variant_files(record.project)
    assert vrec.filename == "pkg-1.0+pt214-py3-none-any-cu130sm90.whl"
    assert (vrec.variant_label, vrec.archs, vrec.version) == ("cu130sm90", ("90",), "1.0+pt214")
    # The variant roots stay as they were; the plain root lists only the variant form.
    assert [r.filename for r in catalog.files(VARIANT, record.project)] == [record.filename]
    assert catalog.variants() == [VARIANT]
    assert catalog.variant_projects() == ["pkg"]
    stored = storage.get_bytes(vrec.wheel_key)
    assert len(stored) == vrec.size
    meta = storage.get_bytes(vrec.metadata_key)
    assert parse_metadata(meta).version == Version("1.0+pt214")
    (tmp_path / "v.whl").write_bytes(stored)
    assert read_metadata(tmp_path / "v.whl") == meta
    # Publishing the same bytes again changes nothing; verify checks both forms.
    assert publish(storage, src, VARIANT, build=facts("90")) == record
    catalog.refresh()
    assert catalog.variant_files(record.project) == [vrec]
    report = verify.verify(storage)
    assert report.checked == 2 and not report.problems


def test_no_variant_form_without_sass(storage: Storage, tmp_path: Path) -> None:
    src = make_wheel(tmp_path, "pkg", f"1.0+{VARIANT.local_label}")
    publish(storage, src, VARIANT, build=BuildFacts(device_code={"pkg/_C.so": {
        "sass": [], "ptx": ["90"]}}))
    publish(storage, make_wheel(tmp_path, "other", f"1.0+{VARIANT.local_label}"), VARIANT)
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    assert catalog.variant_projects() == []


def test_republish_backfills_and_gc_keeps_both_forms(storage: Storage, tmp_path: Path) -> None:
    older = make_wheel(tmp_path, "pkg", f"1.0+{VARIANT.local_label}")
    newer = make_wheel(tmp_path, "pkg", f"2.0+{VARIANT.local_label}")
    publish(storage, older, VARIANT, build=facts("90"), variant_form=False)
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    assert catalog.variant_projects() == []
    # Published before variant wheels existed: publishing the same bytes again adds the form.
    publish(storage, older, VARIANT, build=facts("90"))
    publish(storage, newer, VARIANT, build=facts("90"))
    catalog.refresh()
    assert [r.version for r in catalog.variant_files(catalog.variant_projects()[0])] == [
        "1.0+pt214", "2.0+pt214"]
    # Long past the publish timeout, the variant wheels' claims are still not orphans.
    assert gc.plan(storage, claim_timeout=0, now=2**40) == []
    # Pruning takes a version's variant wheel with it.
    doomed = {d.key.rpartition("/")[2] for d in gc.plan(storage, keep_versions=1)}
    assert "pkg-1.0+pt214-py3-none-any-cu130sm90.whl" in doomed
    assert not any(name.startswith("pkg-2.0") for name in doomed)


def test_backfill_command(tmp_path: Path) -> None:
    config = Config(storage=str(tmp_path / "data"))
    storage = open_storage(config)
    gpu = make_wheel(tmp_path, "pkg", f"1.0+{VARIANT.local_label}")
    cpu = make_wheel(tmp_path, "cpu-only", f"1.0+{VARIANT.local_label}")
    publish(storage, gpu, VARIANT, build=facts("90"), variant_form=False)
    publish(storage, cpu, VARIANT, variant_form=False)
    dry = run_console("variants", "backfill", "--dry-run", config=config)
    assert dry.returncode == 0, dry.stderr
    assert f"would make the variant form of {gpu.name}" in dry.stdout
    first = run_console("variants", "backfill", config=config)
    assert first.returncode == 0, first.stderr
    assert "published pkg-1.0+pt214-py3-none-any-cu130sm90.whl" in first.stdout
    assert f"no variant form of {cpu.name}" in first.stdout
    again = run_console("variants", "backfill", config=config)
    assert "1 wheels without a variant form; 0 published" in again.stdout  # the CPU-only one
    catalog = Catalog(storage, refresh_seconds=0)
    catalog.refresh()
    assert catalog.variant_projects() == ["pkg"]
