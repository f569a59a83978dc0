"""Variant keys: parsing, printing, canonical form, labels."""

from __future__ import annotations

import pytest
from packaging.version import Version

from wheelhouse.errors import InvalidVariant
from wheelhouse.variants import (
    KNOWN_ARCHS,
    KNOWN_CUDA,
    MAX_KEY_LENGTH,
    Variant,
    default_cxx11abi,
    normalize_arch,
    normalize_cuda,
    normalize_torch,
    parse_variant,
    variant_from_label,
)

CANONICAL = [
    # key, torch, cuda, cxx11abi, archs
    ("torch2.8-cu128", "2.8", "12.8", True, ()),
    ("torch2.8-cu128-sm90", "2.8", "12.8", True, ("90",)),
    ("torch2.8-cu128-sm80-sm90", "2.8", "12.8", True, ("80", "90")),
    ("torch2.8-cu128-sm90-sm90a", "2.8", "12.8", True, ("90", "90a")),
    ("torch2.8-cu128-cxx11abi0", "2.8", "12.8", False, ()),
    ("torch2.8-cu129-cxx11abi0-sm100", "2.8", "12.9", False, ("100",)),
    ("torch2.5-cu124", "2.5", "12.4", False, ()),
    ("torch2.5-cu124-cxx11abi1-sm80-sm90", "2.5", "12.4", True, ("80", "90")),
    ("torch2.6-cu118-sm70-sm75", "2.6", "11.8", False, ("70", "75")),
    ("torch2.7-cu126", "2.7", "12.6", True, ()),
    ("torch2.9-cu130-sm90a-sm100a-sm120", "2.9", "13.0", True, ("90a", "100a", "120")),
    ("torch2.10-cu130", "2.10", "13.0", True, ()),
    ("torch2.14-cu132-sm121", "2.14", "13.2", True, ("121",)),
    ("torch3.0-cu131", "3.0", "13.1", True, ()),
    ("torch10.100-cu128", "10.100", "12.8", True, ()),
]


@pytest.mark.parametrize(("key", "torch", "cuda", "abi", "archs"), CANONICAL)
def test_parse_print_round_trip(
    key: str, torch: str, cuda: str, abi: bool, archs: tuple[str, ...]
) -> None:
    v = parse_variant(key)
    assert (v.torch, v.cuda, v.cxx11abi, v.archs) == (torch, cuda, abi, archs)
    assert v.key == key
    assert str(v) == key
    assert parse_variant(v.key) == v
    assert v.base == Variant(torch, cuda, abi, ())
    assert v.base.key == key.split("-sm")[0]
    assert v.cu == "cu" + cuda.replace(".", "")


@pytest.mark.parametrize(("key", "canonical"), [
    ("torch2.8-cu128-sm90-sm80", "torch2.8-cu128-sm80-sm90"),        # arch order
    ("torch2.8-cu128-sm90-sm90", "torch2.8-cu128-sm90"),             # duplicate arch
    ("torch2.8-cu128-sm90a-sm90", "torch2.8-cu128-sm90-sm90a"),
    ("torch2.8-cu128-sm100-sm90", "torch2.8-cu128-sm90-sm100"),      # numeric, not text order
    ("torch2.8-cu128-cxx11abi1", "torch2.8-cu128"),                  # default ABI spelled out
    ("torch2.5-cu124-cxx11abi0", "torch2.5-cu124"),
    ("torch02.8-cu128", "torch2.8-cu128"),
    ("torch2.08-cu128", "torch2.8-cu128"),
])
def test_non_canonical_keys_name_the_canonical_one(key: str, canonical: str) -> None:
    with pytest.raises(InvalidVariant, match="canonical") as exc:
        parse_variant(key)
    assert repr(canonical) in str(exc.value)
    assert parse_variant(canonical).key == canonical


@pytest.mark.parametrize(("key", "message"), [
    ("torch2.8-cu127", "unknown CUDA"),
    ("torch2.8-cu999", "unknown CUDA"),
    ("torch2.8-cu0128", "unknown CUDA"),
    ("torch2.8-cu1280", "unknown CUDA"),
    ("torch2.8-cu128-sm91", "unknown GPU architecture"),
    ("torch2.8-cu128-sm99a", "unknown GPU architecture"),
    ("torch2.8-cu128-sm80-sm999", "unknown GPU architecture"),
])
def test_unknown_cuda_or_arch(key: str, message: str) -> None:
    with pytest.raises(InvalidVariant, match=message):
        parse_variant(key)


HOSTILE = [
    "",
    " ",
    "torch2.8",
    "cu128",
    "torch2.8-cu128-",
    "torch2.8-cu128-sm",
    "torch2.8-cu128-sm_90",
    "torch2.8--cu128",
    "-torch2.8-cu128",
    "Torch2.8-cu128",
    "TORCH2.8-CU128",
    "torch2.8-cu12.8",
    "torch2-cu128",
    "torch2.8.1-cu128",
    "torch2.8-cu128-cxx11abi2",
    "torch2.8-cu128-cxx11abiTRUE",
    "torch2.8-cu128 ",
    "torch2.8-cu128\n",
    "\ttorch2.8-cu128",
    "torch2.8-cu128/",
    "torch2.8-cu128/../etc",
    "../torch2.8-cu128",
    "..",
    ".",
    "%2e%2e",
    "%2e%2e%2ftorch2.8-cu128",
    "torch2.8-cu128%2fsm90",
    "torch2.8-cu128\x00",
    "torch\uff12.\uff18-cu128",                           # fullwidth digits
    "torch\u0662.\u0668-cu128",                           # Arabic-Indic digits
    "torch2.8-cu128-sm\uff190",
    "t\u03bfrch2.8-cu128",                                # Greek omicron
    "torch2.8-cu128-sm90;rm -rf /",
    "<script>alert(1)</script>",
    "torch2.8-cu128-" + "-".join(["sm90"] * 30),         # overlong
    "x" * (MAX_KEY_LENGTH + 1),
    "torch2.8-cu128" + "0" * 10_000,
]


@pytest.mark.parametrize("key", HOSTILE)
def test_hostile_keys_raise_invalid_variant(key: str) -> None:
    with pytest.raises(InvalidVariant) as exc:
        parse_variant(key)
    # A plain message, short enough for a 404 page, that never echoes an overlong key in full.
    assert isinstance(exc.value, ValueError)
    assert 0 < len(str(exc.value)) < 400


def test_overlong_key_is_refused_before_matching() -> None:
    key = "torch2.8-cu128" + "-sm90" * 100
    with pytest.raises(InvalidVariant, match="too long"):
        parse_variant(key)


def test_longest_canonical_key_fits() -> None:
    v = Variant.of("2.14", "13.2", KNOWN_ARCHS, cxx11abi=False)
    assert len(v.key) <= MAX_KEY_LENGTH
    assert parse_variant(v.key) == v


@pytest.mark.parametrize(("torch", "expected"), [
    ("1.13", False), ("2.0", False), ("2.5", False), ("2.6", False),
    ("2.7", True), ("2.8", True), ("2.10", True), ("3.0", True),
])
def test_default_abi_by_torch_version(torch: str, expected: bool) -> None:
    assert default_cxx11abi(torch) is expected
    v = Variant.of(torch, "12.8")
    assert v.cxx11abi is expected
    assert "cxx11abi" not in v.key
    flipped = Variant.of(torch, "12.8", cxx11abi=not expected)
    assert flipped.key.endswith(f"-cxx11abi{int(not expected)}")
    assert parse_variant(flipped.key) == flipped


@pytest.mark.parametrize(("given", "expected"), [
    ("2.8", "2.8"), ("2.8.0", "2.8"), ("2.8.0+cu128", "2.8"), ("2.8.1rc1", "2.8"),
    ("2.10.0.dev20250101", "2.10"), (" 2.8 ", "2.8"),
])
def test_normalize_torch(given: str, expected: str) -> None:
    assert normalize_torch(given) == expected


@pytest.mark.parametrize("given", ["2", "", "two.eight", "2.8-cu128", "../2.8"])
def test_normalize_torch_refuses(given: str) -> None:
    with pytest.raises(InvalidVariant):
        normalize_torch(given)


@pytest.mark.parametrize(("given", "expected"), [
    ("12.8", "12.8"), ("cu128", "12.8"), ("128", "12.8"), ("CU128", "12.8"), (" 13.0 ", "13.0"),
    ("cu118", "11.8"),
])
def test_normalize_cuda(given: str, expected: str) -> None:
    assert normalize_cuda(given) == expected


@pytest.mark.parametrize("given", ["12.7", "cu12", "12", "", "cu", "1.28", "12.8.1"])
def test_normalize_cuda_refuses(given: str) -> None:
    with pytest.raises(InvalidVariant, match="known: " + KNOWN_CUDA[0]):
        normalize_cuda(given)


@pytest.mark.parametrize(("given", "expected"), [
    ("sm90", "90"), ("sm_90", "90"), ("SM_90", "90"), ("9.0", "90"), ("90", "90"),
    ("sm90a", "90a"), ("9.0a", "90a"), ("sm_100a", "100a"), ("12.0", "120"),
])
def test_normalize_arch(given: str, expected: str) -> None:
    assert normalize_arch(given) == expected


@pytest.mark.parametrize("given", ["sm91", "9.1", "compute_90", "", "sm", "90b", "sm__90"])
def test_normalize_arch_refuses(given: str) -> None:
    with pytest.raises(InvalidVariant, match="unknown GPU architecture"):
        normalize_arch(given)


def test_of_normalizes_loose_input() -> None:
    v = Variant.of("2.8.0+cu128", "cu128", ["sm_90", "8.0", "sm90"])
    assert v == parse_variant("torch2.8-cu128-sm80-sm90")


@pytest.mark.parametrize(("key", "label"), [
    ("torch2.8-cu128", "cu128torch2.8"),
    ("torch2.8-cu128-sm90", "cu128torch2.8.sm90"),
    ("torch2.8-cu128-sm80-sm90a", "cu128torch2.8.sm80.sm90a"),
    ("torch2.8-cu128-cxx11abi0", "cu128torch2.8.cxx11abi0"),
    ("torch2.5-cu124-cxx11abi1-sm90", "cu124torch2.5.cxx11abi1.sm90"),
    ("torch2.10-cu130", "cu130torch2.10"),
    ("torch3.0-cu131", "cu131torch3.0"),
])
def test_local_label_round_trip(key: str, label: str) -> None:
    v = parse_variant(key)
    assert v.local_label == label
    assert variant_from_label(label) == v
    # The label survives PEP 440 normalization unchanged, so file names and METADATA agree.
    version = Version(f"2.8.3+{label}")
    assert version.local == label
    assert str(version) == f"2.8.3+{label}"


@pytest.mark.parametrize("key", [k for k, *_ in CANONICAL])
def test_every_canonical_key_round_trips_through_its_label(key: str) -> None:
    v = parse_variant(key)
    assert variant_from_label(v.local_label) == v
    assert Version(f"1.0+{v.local_label}").local == v.local_label


@pytest.mark.parametrize("label", [
    "",
    "cu12torch2.8cxx11abiTRUE",     # the upstream flash-attn label
    "cu12torch2.8cxx11abitrue",
    "cu127torch2.8",                 # unknown CUDA
    "cu128torch2.8.sm91",            # unknown arch
    "cu128torch2",
    "torch2.8cu128",
    "cu128torch2.8.",
    "cu128torch2.8.cxx11abi2",
    "cu128torch2.8-sm90",
    "cu128torch2.8.sm90/..",
    "local",
])
def test_variant_from_label_names_none(label: str) -> None:
    assert variant_from_label(label) is None


def test_known_tables_are_canonical() -> None:
    for cuda in KNOWN_CUDA:
        assert normalize_cuda(cuda) == cuda
        assert normalize_cuda("cu" + cuda.replace(".", "")) == cuda
    for arch in KNOWN_ARCHS:
        assert normalize_arch("sm" + arch) == arch


def test_variants_sort_numerically() -> None:
    keys = ["torch2.10-cu128", "torch2.9-cu130", "torch2.9-cu128-sm100", "torch2.9-cu128-sm90",
            "torch2.9-cu128", "torch2.9-cu126", "torch2.9-cu128-cxx11abi0", "torch2.9-cu118"]
    ordered = [v.key for v in sorted(parse_variant(k) for k in keys)]
    assert ordered == [
        "torch2.9-cu118", "torch2.9-cu126", "torch2.9-cu128-cxx11abi0", "torch2.9-cu128",
        "torch2.9-cu128-sm90", "torch2.9-cu128-sm100", "torch2.9-cu130", "torch2.10-cu128",
    ]
    a, b = parse_variant("torch2.9-cu128"), parse_variant("torch2.10-cu128")
    assert a < b and a <= b and b > a and b >= a and a != b
    assert a == parse_variant("torch2.9-cu128") and hash(a) == hash(parse_variant("torch2.9-cu128"))
