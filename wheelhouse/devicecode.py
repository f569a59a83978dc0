"""Which GPU architectures a wheel's shared libraries hold device code for.

nvcc embeds device code in the host ELF's ``.nv_fatbin`` section (``__nv_relfatbin`` for
relocatable device code): one or more fat binary containers, each a list of entries, one per
SASS cubin (``sm_XX``) or PTX text (``compute_XX``). Only the entry headers are parsed, never the
(often compressed) payloads. The layout is undocumented by NVIDIA; it follows the
reverse-engineered headers of n-eiling/cuda-fatbin-decompression (``fatbin-decompress.h``:
``fat_elf_header``, ``fat_text_header``), as also used by jiegec/fatbinary (``src/lib.rs``), and
the test suite checks it against NVIDIA's own ``cuobjdump --list-elf/--list-ptx``.

Container header (16 bytes, little-endian): u32 magic 0xBA55ED50, u16 version (1), u16 header
size (16), u64 size of the entries that follow. Entry header: u16 kind (1 PTX, 2 ELF/SASS), u16,
u32 header size, u64 payload size, u32 compressed size, u32 options offset, u16 minor, u16 major,
u32 arch (``80`` for sm_80), u32, u32, u64 flags, ...; the next entry starts at
entry + header size + payload size.

The worker's device-code check (``worker.devicecode``) and publishing (the variant form of a
wheel, ``wheelhouse.index.variantwheels``) both read wheels through this module.
"""


from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

#: Sections nvcc puts fat binaries in: whole-program and relocatable device code (``-rdc``).
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
_MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")
_ENTRY = struct.Struct("<HHIQIIHHI")
_FLAGS = struct.Struct("<Q")
_FLAGS_OFFSET = 40
#: Every entry header nvcc writes is at least 64 bytes (more for PTX options and sm_100+).
_MIN_ENTRY_HEADER = 64
_KIND_PTX = 1
_KIND_ELF = 2
#: Entry flag of arch-specific (``sm_90a``) code: observed on nvcc 13.0 output, where cuobjdump
#: names exactly the entries that carry it ``sm_XXa`` (checked by the tests against cuobjdump).
_FLAG_ARCH_SPECIFIC = 0x100000
#: Shared libraries in a wheel: ``_C.cpython-311-x86_64-linux-gnu.so``, ``libfoo.so.1``.
_SHARED_LIBRARY = re.compile(r"\.so(?:\.[0-9]+)*$")


@dataclass(frozen=True)
class DeviceCode:
    """The GPU code one library holds: architectures as wheelhouse spells them (``80``, ``90a``)."""

    sass: frozenset[str] = field(default_factory=frozenset)
    ptx: frozenset[str] = field(default_factory=frozenset)

    @property
    def empty(self) -> bool:
        return not self.sass and not self.ptx

    def covers(self, arch: str) -> bool:
        """Whether SASS for ``arch`` is present (``90`` is also met by ``90a``)."""
        return arch in self.sass or (not arch.endswith("a") and f"{arch}a" in self.sass)

    def describe(self) -> str:
        """``sm_80, sm_90a, compute_90`` or ``none``."""
        names = [f"sm_{a}" for a in _sorted(self.sass)] + [f"compute_{a}" for a in
                                                           _sorted(self.ptx)]
        return ", ".join(names) or "none"

    def to_dict(self) -> dict[str, list[str]]:
        return {"sass": _sorted(self.sass), "ptx": _sorted(self.ptx)}


def _sorted(archs: Iterable[str]) -> list[str]:
    return sorted(archs, key=lambda a: (int(a.rstrip("af")), a))


def parse_fatbin(data: bytes) -> DeviceCode:
    """The architectures in the bytes of a fatbin section (any number of containers).

    Containers are 8-byte aligned and may be separated by padding; bytes that are no container
    header are skipped. A truncated container or entry ends the scan rather than raising, since a
    library nvcc linked is trusted to be well-formed and the check errs towards "missing".
    """
    sass: set[str] = set()
    ptx: set[str] = set()
    offset = 0
    while offset + _CONTAINER.size <= len(data):
        magic, version, header_size, size = _CONTAINER.unpack_from(data, offset)
        if magic != _MAGIC or version != 1 or header_size < _CONTAINER.size:
            offset += 8
            continue
        entry = offset + header_size
        end = min(entry + size, len(data))
        while entry + _MIN_ENTRY_HEADER <= end:
            kind, _, entry_header, payload, _, _, _, _, arch = _ENTRY.unpack_from(data, entry)
            if entry_header < _MIN_ENTRY_HEADER:
                break
            (flags,) = _FLAGS.unpack_from(data, entry + _FLAGS_OFFSET)
            if kind == _KIND_ELF:
                sass.add(f"{arch}a" if flags & _FLAG_ARCH_SPECIFIC else str(arch))
            elif kind == _KIND_PTX:
                ptx.add(str(arch))
            entry += entry_header + payload
        offset = max(offset + 8, (end + 7) // 8 * 8)
    return DeviceCode(frozenset(sass), frozenset(ptx))


def library_device_code(stream: IO[bytes]) -> DeviceCode:
    """The device code of one ELF shared library (a seekable binary stream).

    A section's bytes are read from the file by its offset and size, never through
    pyelftools' ``data()``: for a ``SHT_NOBITS`` section that returns ``sh_size`` zero bytes
    however small the file, so a 408-byte library could make the reader allocate gigabytes.
    A fat binary section that is NOBITS, or that lies past the end of the file, holds no
    device code and is refused (:class:`ValueError`), as are bytes that are no ELF file.
    """
    size = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    try:
        elf = ELFFile(stream)
        sections = [(s.name, s["sh_type"], s["sh_offset"], s["sh_size"])
                    for s in elf.iter_sections() if s.name in FATBIN_SECTIONS]
    except ELFError as exc:
        raise ValueError(f"not an ELF shared library: {exc}") from None
    found = []
    for name, kind, offset, length in sections:
        if kind == "SHT_NOBITS":
            raise ValueError(f"its {name} section holds no bytes in the file (NOBITS)")
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"its {name} section lies past the end of the file")
        stream.seek(offset)
        found.append(parse_fatbin(stream.read(length)))
    return DeviceCode(frozenset().union(*(d.sass for d in found)),
                      frozenset().union(*(d.ptx for d in found)))


def shared_libraries(wheel: zipfile.ZipFile) -> list[str]:
    """Archive paths of the shared libraries a wheel installs (not those under ``.dist-info``)."""
    return sorted(name for name in wheel.namelist()
                  if _SHARED_LIBRARY.search(name) and ".dist-info/" not in name)


@contextmanager
def open_library(wheel: zipfile.ZipFile, name: str) -> Iterator[IO[bytes]]:
    """A seekable copy of one archive member: pyelftools seeks around, and a zip member stream
    seeks by decompressing again. Spooled to disk past 64 MiB (flash-attn's library is ~1 GB)."""
    with tempfile.SpooledTemporaryFile(max_size=64 << 20) as copy, wheel.open(name) as member:
        shutil.copyfileobj(member, copy, 1 << 20)
        copy.seek(0)
        yield copy


def wheel_device_code(wheel: Path) -> dict[str, DeviceCode]:
    """Device code per shared library of a wheel, keyed by archive path."""
    found: dict[str, DeviceCode] = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in shared_libraries(zf):
            with open_library(zf, name) as stream:
                try:
                    found[name] = library_device_code(stream)
                except ValueError:
                    found[name] = DeviceCode()  # a linker script or stub: holds no device code
    return found


def archs_found(found: Mapping[str, DeviceCode]) -> dict[str, dict[str, list[str]]]:
    """The build record's form: ``{"pkg/_C…so": {"sass": ["80"], "ptx": []}}``."""
    return {name: code.to_dict() for name, code in sorted(found.items())}
