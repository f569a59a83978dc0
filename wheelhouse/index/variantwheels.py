"""The variant form of a published wheel (wheel variants, PEP 817/825 drafts): one index for
every GPU, where the installer picks the build that fits the machine.

A CUDA-extension wheel published into a variant root (``torch2.14-cu130-sm90``) is also
published as a *variant wheel*, listed by the plain root ``/simple/``:

- its file name has a label before ``.whl``: ``flash_attn-2.8.3+pt214-cp311-cp311-
  linux_x86_64-cu130sm90.whl``. The label names the CUDA version and the GPU architectures the
  wheel holds SASS for, and nothing else, so the same CUDA and archs always get the same label
  (:func:`label_for`; hash-shortened where the archs would pass 16 characters);
- its version's local label is the torch minor (``+pt214``), and METADATA requires that torch
  (``torch==2.14.*``): the installer's resolver then picks the build for the torch it installs
  (uv 0.13.9 does not act on the draft's ``abi_dependency``);
- ``*.dist-info/variant.json`` holds the index's variants document with only its own label.

Per project and version the index serves ``{name}-{version}-variants.json``
(:func:`variants_document`): the properties of every label, and the ``providers`` entry uv
recognises as its built-in NVIDIA provider. ``nvidia :: cuda_version_lower_bound`` is the CUDA
the wheel was built with (compatible where the driver's CUDA is at least that);
``nvidia :: sm_arch`` has one ``NN_real`` value per architecture with SASS. The archs come from
the wheel's device code as the build's check found it (:attr:`BuildFacts.device_code`), or from
reading the wheel for one not built here; never from a label or a root's name.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.version import Version

from wheelhouse.builds.facts import BuildFacts
from wheelhouse.devicecode import wheel_device_code
from wheelhouse.variants import Variant, default_cxx11abi
from wheelhouse.wheels import VARIANT_LABEL, edit_metadata, parse_name, rewrite_wheel

SCHEMA = "https://variants-schema.wheelnext.dev/peps/850/v0.2.0.json"
NAMESPACE = "nvidia"
#: The provider entry uv (0.13.9) runs its built-in NVIDIA provider for; any other is ignored.
PROVIDER: Mapping[str, Any] = {
    "requires": ["nvidia-variant-provider"],
    "plugin-api": "nvidia_variant_provider.plugin:NvidiaVariantPlugin",
}
MAX_LABEL = 16
VARIANT_JSON = "variant.json"
_ARCH = re.compile(r"([0-9]{2,3})(a|f)?")


def _arch_key(arch: str) -> tuple[int, str]:
    return int(arch.rstrip("af")), arch


def sass_archs(archs: Iterable[str]) -> tuple[str, ...]:
    """Architectures as the device-code reader spells them (``90``, ``90a``, ``100f``), sorted
    numerically; anything else dropped."""
    return tuple(sorted({a for a in archs if _ARCH.fullmatch(a)}, key=_arch_key))


def label_for(cuda: str, archs: Iterable[str]) -> str:
    """``cu130sm90``, ``cu130sm80_90_120``; past 16 characters ``cu130h`` and a digest of the
    archs. The same CUDA and archs always give the same label."""
    cu = "cu" + cuda.replace(".", "")
    ordered = sass_archs(archs)
    if not ordered:
        raise ValueError("a variant label needs at least one architecture")
    label = cu + "sm" + "_".join(ordered)
    if len(label) > MAX_LABEL:
        digest = hashlib.sha256(",".join(ordered).encode()).hexdigest()
        label = (cu + "h" + digest)[:MAX_LABEL]
    assert VARIANT_LABEL.fullmatch(label), label
    return label


def torch_label(variant: Variant) -> str:
    """The local version label of a variant wheel: ``pt214`` (``pt25.cxx11abi1`` where the C++
    ABI is not torch's default)."""
    label = "pt" + variant.torch.replace(".", "")
    if variant.cxx11abi != default_cxx11abi(variant.torch):
        label += f".cxx11abi{int(variant.cxx11abi)}"
    return label


def torch_requirement(variant: Variant) -> str:
    return f"torch=={variant.torch}.*"


def properties(cuda: str, archs: Iterable[str]) -> dict[str, dict[str, list[str]]]:
    """The properties of one label: ``nvidia :: cuda_version_lower_bound :: 13.0`` and one
    ``nvidia :: sm_arch :: NN_real`` per architecture (``90a`` runs on 9.0 alone: ``90_real``)."""
    reals = sorted({f"{int(a.rstrip('af'))}_real" for a in sass_archs(archs)},
                   key=lambda v: int(v.split("_")[0]))
    return {NAMESPACE: {"cuda_version_lower_bound": [cuda], "sm_arch": reals}}


def variants_document(labels: Mapping[str, Mapping[str, Any]]) -> bytes:
    """The variants document (index-level ``-variants.json``, or a wheel's ``variant.json``
    with its own label only): the same bytes for the same labels."""
    doc = {
        "$schema": SCHEMA,
        "default-priorities": {"namespace": [NAMESPACE]},
        "providers": {NAMESPACE: dict(PROVIDER)},
        "variants": {label: labels[label] for label in sorted(labels)},
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def variants_filename(dist_name: str, version: str) -> str:
    """``flash_attn-2.8.3+pt214-variants.json``: the wheel name's spelling of the project."""
    return f"{dist_name}-{version}-variants.json"


def archs_of(path: Path, build: BuildFacts) -> tuple[str, ...]:
    """The SASS archs of a wheel: the build's device-code check's findings where it ran here,
    else read from the wheel itself the same way."""
    if build.device_code is not None:
        return sass_archs(build.sass_archs)
    return sass_archs(a for code in wheel_device_code(path).values() for a in code.sass)


def _variant_version(filename: str, variant: Variant) -> Version:
    return Version(f"{parse_name(filename).version.public}+{torch_label(variant)}")


def variant_filename(filename: str, variant: Variant, label: str) -> str:
    """The variant form's file name of the wheel ``filename`` published into ``variant``:
    ``flash_attn-2.8.3+pt214-cp311-cp311-linux_x86_64-cu13_sm90.whl``."""
    parts = filename.removesuffix(".whl").split("-")
    parts[1] = str(_variant_version(filename, variant))
    return "-".join([*parts, label]) + ".whl"


def make_variant_wheel(path: Path, variant: Variant, archs: Iterable[str],
                       dest_dir: Path) -> tuple[Path, str]:
    """Write the variant form of the wheel at ``path`` (published into ``variant``, holding SASS
    for ``archs``) into ``dest_dir``; return its path and label."""
    ordered = sass_archs(archs)
    label = label_for(variant.cuda, ordered)
    version = _variant_version(path.name, variant)
    filename = variant_filename(path.name, variant, label)
    own = variants_document({label: properties(variant.cuda, ordered)})
    dest = rewrite_wheel(path, dest_dir / filename, version,
                         more=lambda data: edit_metadata(data, torch=torch_requirement(variant)),
                         add_info={VARIANT_JSON: own})
    return dest, label
