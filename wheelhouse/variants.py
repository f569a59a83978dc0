"""Variant keys: what a CUDA-extension wheel must match beyond its Python and platform tags.

A variant is torch ``major.minor``, the CUDA version torch was built with, the C++ ABI (only
spelled out where it differs from torch's default), and optionally a narrowed set of GPU
architectures. Its key names an index root: ``torch2.8-cu128``, ``torch2.8-cu128-sm90``,
``torch2.5-cu124-cxx11abi1-sm80-sm90``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from wheelhouse.errors import InvalidVariant

#: CUDA versions torch has shipped builds for (and that a key may name).
KNOWN_CUDA: tuple[str, ...] = (
    "11.8", "12.1", "12.4", "12.6", "12.8", "12.9", "13.0", "13.1", "13.2",
)
#: GPU architectures (compute capability without the dot, ``a`` for arch-specific features).
KNOWN_ARCHS: tuple[str, ...] = (
    "70", "75", "80", "86", "87", "89", "90", "90a",
    "100", "100a", "101", "103", "110", "120", "121",
)
MAX_KEY_LENGTH = 120

_KEY = re.compile(
    r"torch(?P<torch>[0-9]{1,2}\.[0-9]{1,3})"
    r"-cu(?P<cu>[0-9]{3,4})"
    r"(?:-cxx11abi(?P<abi>[01]))?"
    r"(?P<archs>(?:-sm[0-9]{2,3}a?)*)"
)


def _arch_key(arch: str) -> tuple[int, str]:
    return (int(arch.rstrip("a")), arch)


def normalize_torch(version: str) -> str:
    """``2.8``, ``2.8.0`` or ``2.8.0+cu128`` → ``2.8``."""
    try:
        v = Version(version)
    except InvalidVersion:
        raise InvalidVariant(f"torch version {version!r} is not a valid version") from None
    if len(v.release) < 2:
        raise InvalidVariant(f"torch version {version!r} needs major.minor, e.g. 2.8")
    return f"{v.major}.{v.minor}"


def normalize_cuda(cuda: str) -> str:
    """``12.8``, ``cu128`` or ``128`` → ``12.8``, for known CUDA versions only."""
    text = cuda.strip().lower().removeprefix("cu")
    for known in KNOWN_CUDA:
        if text in (known, known.replace(".", "")):
            return known
    raise InvalidVariant(
        f"unknown CUDA version {cuda!r}; known: {', '.join(KNOWN_CUDA)}"
    )


def normalize_arch(arch: str) -> str:
    """``sm90``, ``sm_90``, ``9.0``, ``90`` → ``90``, for known architectures only."""
    text = arch.strip().lower().removeprefix("sm").removeprefix("_")
    if re.fullmatch(r"[0-9]+\.[0-9]+a?", text):
        text = text.replace(".", "")
    if text not in KNOWN_ARCHS:
        raise InvalidVariant(
            f"unknown GPU architecture {arch!r}; known: "
            + ", ".join("sm" + a for a in KNOWN_ARCHS)
        )
    return text


def default_cxx11abi(torch: str) -> bool:
    """torch builds use the new C++ ABI from 2.7 on (PyPI wheels before that did not)."""
    major, minor = (int(p) for p in torch.split("."))
    return (major, minor) >= (2, 7)


@functools.total_ordering
@dataclass(frozen=True)
class Variant:
    """One index root. ``archs`` empty means the recipe's default (fat) architecture set."""

    torch: str
    cuda: str
    cxx11abi: bool
    archs: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        torch: str,
        cuda: str,
        archs: Iterable[str] = (),
        cxx11abi: bool | None = None,
    ) -> Variant:
        """Build a variant from loose user input, normalizing and validating each part."""
        t = normalize_torch(torch)
        c = normalize_cuda(cuda)
        a = tuple(sorted({normalize_arch(x) for x in archs}, key=_arch_key))
        abi = default_cxx11abi(t) if cxx11abi is None else cxx11abi
        return cls(torch=t, cuda=c, cxx11abi=abi, archs=a)

    @property
    def cu(self) -> str:
        """``cu128``: the spelling PyTorch's own index URLs use."""
        return "cu" + self.cuda.replace(".", "")

    @property
    def key(self) -> str:
        parts = [f"torch{self.torch}", self.cu]
        if self.cxx11abi != default_cxx11abi(self.torch):
            parts.append(f"cxx11abi{int(self.cxx11abi)}")
        parts.extend(f"sm{a}" for a in self.archs)
        return "-".join(parts)

    @property
    def base(self) -> Variant:
        """The same variant with the default architecture set: where fat wheels live."""
        return Variant(self.torch, self.cuda, self.cxx11abi, ())

    @property
    def local_label(self) -> str:
        """The PEP 440 local version label wheels of this variant carry: ``cu128torch2.8``."""
        label = f"{self.cu}torch{self.torch}"
        if self.cxx11abi != default_cxx11abi(self.torch):
            label += f".cxx11abi{int(self.cxx11abi)}"
        for a in self.archs:
            label += f".sm{a}"
        return label

    def __str__(self) -> str:
        return self.key

    def _sort_key(self) -> tuple[Any, ...]:
        return (tuple(int(p) for p in self.torch.split(".")),
                tuple(int(p) for p in self.cuda.split(".")),
                self.cxx11abi, tuple(_arch_key(a) for a in self.archs))

    def __lt__(self, other: object) -> bool:
        # Numerically: torch2.10 comes after torch2.9, sm100 after sm90.
        if not isinstance(other, Variant):
            return NotImplemented
        return self._sort_key() < other._sort_key()


@functools.lru_cache(maxsize=4096)  # keys repeat on every request; Variant is immutable
def parse_variant(key: str) -> Variant:
    """Parse and validate an index-root key; raise :class:`InvalidVariant` with a plain message."""
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidVariant("variant key is too long")
    m = _KEY.fullmatch(key)
    if m is None:
        raise InvalidVariant(
            f"{key!r} is not a variant key; expected e.g. torch2.8-cu128 or torch2.8-cu128-sm90"
        )
    archs_text = m.group("archs")
    archs = [a for a in archs_text.split("-sm") if a]
    abi = m.group("abi")
    variant = Variant.of(
        m.group("torch"), m.group("cu"), archs, None if abi is None else abi == "1"
    )
    if variant.key != key:
        # One spelling per variant, so that caches and links never split.
        raise InvalidVariant(f"{key!r} is not in canonical form; use {variant.key!r}")
    return variant


def variant_from_label(label: str) -> Variant | None:
    """Recover the variant from a wheel's local version label, or None if it names none."""
    m = re.fullmatch(
        r"cu(?P<cu>[0-9]{3,4})torch(?P<torch>[0-9]+\.[0-9]+)"
        r"(?:\.cxx11abi(?P<abi>[01]))?(?P<archs>(?:\.sm[0-9]{2,3}a?)*)",
        label,
    )
    if m is None:
        return None
    try:
        archs = [a for a in m.group("archs").split(".sm") if a]
        abi = m.group("abi")
        return Variant.of(m.group("torch"), m.group("cu"), archs,
                          None if abi is None else abi == "1")
    except InvalidVariant:
        return None
