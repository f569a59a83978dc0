"""Build specs: validation, normalization, and the names a spec maps to."""

from __future__ import annotations

import re

import pytest
from packaging.tags import parse_tag
from packaging.utils import parse_wheel_filename

from wheelhouse.builds.spec import BuildSpec, normalize_python, tags_serve
from wheelhouse.errors import FailureKind, InvalidBuildSpec


def spec(**overrides: object) -> BuildSpec:
    args: dict[str, object] = {"python": "3.11", "torch": "2.14", "cuda": "13.0"}
    args.update(overrides)
    project = str(args.pop("project", "flash-attn"))
    version = str(args.pop("version", "2.8.3"))
    return BuildSpec.create(project, version, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "variant_key", "wheel"),
    [
        ({}, "torch2.14-cu130",
         "flash_attn-2.8.3+cu130torch2.14-cp311-cp311-linux_x86_64.whl"),
        ({"archs": ["sm_90", "8.0"]}, "torch2.14-cu130-sm80-sm90",
         "flash_attn-2.8.3+cu130torch2.14.sm80.sm90-cp311-cp311-linux_x86_64.whl"),
        ({"torch": "2.5.1+cu124", "cuda": "cu124", "python": "cp310"}, "torch2.5-cu124",
         "flash_attn-2.8.3+cu124torch2.5-cp310-cp310-linux_x86_64.whl"),
        ({"torch": "2.5", "cuda": "12.4", "cxx11abi": True}, "torch2.5-cu124-cxx11abi1",
         "flash_attn-2.8.3+cu124torch2.5.cxx11abi1-cp311-cp311-linux_x86_64.whl"),
        ({"project": "Flash_Attn", "version": "2.8.3.post1", "machine": "arm64"},
         "torch2.14-cu130",
         "flash_attn-2.8.3.post1+cu130torch2.14-cp311-cp311-linux_aarch64.whl"),
    ],
)
def test_spec_maps_to_one_variant_and_one_wheel_name(
    overrides: dict[str, object], variant_key: str, wheel: str
) -> None:
    s = spec(**overrides)
    assert s.variant.key == variant_key
    assert s.expected_wheel_name == wheel
    name, version, _, tags = parse_wheel_filename(wheel)
    assert name == s.project and version == s.wheel_version
    assert s.tags_match(tags)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"version": "latest"}, "not a valid PEP 440 version"),
        ({"version": "2.8.3+cu128"}, "local label"),
        ({"project": "../etc/passwd"}, "not a valid project name"),
        ({"project": "flash-attn; rm -rf /"}, "not a valid project name"),
        ({"project": "a" * 200}, "too long"),
        ({"cuda": "10.2"}, "unknown CUDA version"),
        ({"cuda": "13.0; echo"}, "unknown CUDA version"),
        ({"archs": ["sm_61"]}, "unknown GPU architecture"),
        ({"archs": ["$(reboot)"]}, "unknown GPU architecture"),
        ({"torch": "two"}, "not a valid version"),
        ({"torch": "2"}, "major.minor"),
        ({"python": "2.7"}, "unsupported Python version"),
        ({"python": "3.11; ls"}, "not a version"),
        ({"machine": "riscv64"}, "unknown CPU architecture"),
        ({"archs": ["80"] * 21}, "short list"),
    ],
)
def test_invalid_specs_get_a_clear_error(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidBuildSpec, match=re.escape(message)):
        spec(**overrides)


def test_job_id_is_deterministic_safe_and_distinct() -> None:
    a = spec(archs=["80"])
    assert a.job_id == spec(archs=["sm80"], project="Flash_Attn").job_id
    assert re.fullmatch(r"[A-Za-z0-9_-]+", a.job_id)
    assert a.job_id.startswith("build-flash-attn-2_8_3-py3_11-torch2_14-cu130-sm80-x86_64-")
    others = {spec(archs=["90"]).job_id, spec(python="3.12").job_id,
              spec(version="2.8.2").job_id, spec(machine="aarch64").job_id,
              spec(version="1!2.8.3").job_id, spec(cuda="12.8", torch="2.8").job_id}
    assert a.job_id not in others and len(others) == 6
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", j) for j in others)


def test_round_trip_through_job_arguments() -> None:
    s = spec(archs=["90", "80"], cxx11abi=True)
    again = BuildSpec.from_dict(s.to_dict())
    assert again == s and again.job_id == s.job_id
    with pytest.raises(InvalidBuildSpec, match="missing"):
        BuildSpec.from_dict({"project": "x"})


@pytest.mark.parametrize(
    ("wheel_tags", "python", "machine", "ok"),
    [
        # The interpreter's own tag, on every Linux platform spelling of its CPU.
        ("cp311-cp311-linux_x86_64", "3.11", "x86_64", True),
        ("cp311-cp311-manylinux_2_28_x86_64", "3.11", "x86_64", True),
        ("cp311-cp311-manylinux2014_x86_64", "3.11", "x86_64", True),
        ("cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64", "3.11", "x86_64", True),
        ("cp311-cp311-musllinux_1_2_x86_64", "3.11", "x86_64", True),
        ("cp311-cp311-linux_aarch64", "3.11", "aarch64", True),
        ("cp311-cp311-manylinux_2_28_aarch64", "3.11", "aarch64", True),
        ("cp312-cp312-manylinux_2_17_aarch64.manylinux2014_aarch64", "3.12", "aarch64", True),
        # ...never another CPU's.
        ("cp311-cp311-linux_aarch64", "3.11", "x86_64", False),
        ("cp311-cp311-manylinux_2_28_x86_64", "3.11", "aarch64", False),
        ("cp311-cp311-win_amd64", "3.11", "x86_64", False),
        ("cp311-cp311-macosx_11_0_arm64", "3.11", "aarch64", False),
        # The stable ABI: built for this CPython or an older one, never a newer one.
        ("cp39-abi3-linux_x86_64", "3.11", "x86_64", True),
        ("cp311-abi3-manylinux_2_28_aarch64", "3.11", "aarch64", True),
        ("cp312-abi3-linux_x86_64", "3.11", "x86_64", False),
        ("cp38-abi3-manylinux_2_17_x86_64", "3.14", "x86_64", True),
        # Another CPython's own ABI does not load: a cp312 wheel for 3.11, or the reverse.
        ("cp312-cp312-linux_x86_64", "3.11", "x86_64", False),
        ("cp310-cp310-linux_x86_64", "3.11", "x86_64", False),
        # Pure Python wheels serve every Python 3 on every CPU.
        ("py3-none-any", "3.11", "x86_64", True),
        ("py3-none-any", "3.13", "aarch64", True),
        ("py2.py3-none-any", "3.9", "x86_64", True),
        ("py311-none-any", "3.12", "x86_64", True),
        ("py312-none-any", "3.11", "x86_64", False),
        ("cp311-none-any", "3.11", "aarch64", True),
        ("py2-none-any", "3.11", "x86_64", False),
        ("py3-none-linux_aarch64", "3.11", "aarch64", True),
    ],
)
def test_which_wheel_tags_serve_which_interpreter(
        wheel_tags: str, python: str, machine: str, ok: bool) -> None:
    tags = parse_tag(wheel_tags)
    assert tags_serve(tags, python, machine) is ok
    assert spec(python=python, machine=machine).tags_match(tags) is ok


def test_tags_serve_any_python_version_but_not_garbage() -> None:
    assert tags_serve(parse_tag("cp315-cp315-linux_x86_64"), "3.15", "x86_64")
    with pytest.raises(InvalidBuildSpec, match="not a version"):
        tags_serve(parse_tag("py3-none-any"), "three", "x86_64")


@pytest.mark.parametrize(("filename", "ok"), [
    ("flash_attn-2.8.3+cu130torch2.14-cp311-cp311-linux_x86_64.whl", True),
    ("flash_attn-2.8.3+cu130torch2.14.sm90-cp311-cp311-linux_x86_64.whl", True),
    ("flash_attn-2.8.3-cp311-abi3-linux_x86_64.whl", True),
    ("flash_attn-2.8.4+cu130torch2.14-cp311-cp311-linux_x86_64.whl", False),
    ("flash_attn-2.8.3+cu130torch2.14-cp312-cp312-linux_x86_64.whl", False),
    ("flash_attn-2.8.3+cu130torch2.14-cp311-cp311-linux_aarch64.whl", False),
    ("flash_attn-2.8.3.tar.gz", False),
])
def test_which_published_wheel_serves_a_spec(filename: str, ok: bool) -> None:
    assert spec().served_by(filename) is ok


def test_queue_is_per_cuda_and_machine() -> None:
    assert spec().queue_name == "build-cu130-x86_64"
    assert spec(cuda="12.8", torch="2.8", machine="aarch64").queue_name == "build-cu128-aarch64"


def test_python_spellings() -> None:
    assert {normalize_python(p) for p in ("3.11", "3.11.7", "cp311", "311", "py311")} == {"3.11"}


def test_failure_kinds_are_strings_with_a_retry_policy() -> None:
    assert FailureKind("incompatible") is FailureKind.INCOMPATIBLE
    assert FailureKind.OOM == "oom"
    assert {k for k in FailureKind if k.retryable} == {FailureKind.INFRASTRUCTURE, FailureKind.OOM}


@pytest.mark.parametrize(("raw", "kind"), [
    ("compile-error", FailureKind.COMPILE_ERROR),
    ("compile_error", FailureKind.COMPILE_ERROR),  # written before kinds were hyphenated
    ("oom", FailureKind.OOM),
    ("no-such-kind", None),
    (None, None),
])
def test_failure_kinds_parse_old_and_new_spellings(raw: object, kind: FailureKind | None) -> None:
    assert FailureKind.parse(raw) is kind
