"""The device-code check of a build: which GPU architectures a built wheel must hold.

The reader of fat binaries is core (:mod:`wheelhouse.devicecode`), since publishing reads
wheels too; it is re-exported here under the names the worker has always used.

The rule for a CUDA-labelled wheel (:func:`check_device_code`): every requested architecture
needs SASS for that architecture in every library that holds device code at all. PTX never
satisfies a request, not even PTX for the same architecture: the driver would JIT-compile it on
first use (minutes for flash-attn's kernels, on every machine with a cold JIT cache), which is
what a prebuilt wheel is for avoiding; and PTX for an older architecture is no ``sm_XX`` build at
all. PTX is still reported, so a recipe that ships ``+PTX`` shows it. A request for ``90`` is met
by ``sm_90`` or the arch-specific ``sm_90a`` (both run on compute capability 9.0); a request for
``90a`` only by ``sm_90a``. Libraries without any device code (host-only helpers) are not checked,
but a wheel where no library holds device code fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from wheelhouse.devicecode import (
    FATBIN_SECTIONS,
    DeviceCode,
    archs_found,
    library_device_code,
    open_library,
    parse_fatbin,
    shared_libraries,
    wheel_device_code,
)
from wheelhouse.errors import BuildFailed, FailureKind

__all__ = [
    "FATBIN_SECTIONS", "DeviceCode", "archs_found", "check_device_code", "library_device_code",
    "open_library", "parse_fatbin", "shared_libraries", "wheel_device_code",
]


def check_device_code(found: Mapping[str, DeviceCode], archs: Sequence[str],
                      *, wheel_name: str = "the wheel") -> None:
    """Raise ``no-device-code`` unless every requested arch has SASS (see the module docstring).

    The reason lists what was found per library, so the build page shows e.g. that only PTX or
    only other architectures were compiled in.
    """
    with_code = {name: code for name, code in found.items() if not code.empty}
    wanted = ", ".join(f"sm_{a}" for a in archs)
    if not with_code:
        libraries = f"{len(found)} shared librar{'y' if len(found) == 1 else 'ies'}"
        raise BuildFailed(FailureKind.NO_DEVICE_CODE,
                          f"{wheel_name} holds no GPU device code in its {libraries} "
                          f"(asked for {wanted}): the CUDA extension was not compiled")
    lacking = {name: [a for a in archs if not code.covers(a)] for name, code in with_code.items()}
    lacking = {name: missing for name, missing in lacking.items() if missing}
    if lacking:
        parts = [f"{Path(name).name} lacks {', '.join(f'sm_{a}' for a in missing)} "
                 f"(has {with_code[name].describe()})" for name, missing in lacking.items()]
        raise BuildFailed(FailureKind.NO_DEVICE_CODE,
                          f"{wheel_name} misses SASS for requested archs: " + "; ".join(parts))
