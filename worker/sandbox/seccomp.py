"""A seccomp filter for builds: no new user namespaces, no kernel keyrings.

A root worker runs bubblewrap without a user namespace (the build gets a real second identity
instead), so bubblewrap's own ``--disable-userns`` (which needs ``--unshare-user``) does not
apply, and an unprivileged build could create user namespaces of its own: root inside them,
with the kernel's whole namespaced attack surface to poke at. The kernel keyring is per uid and
outlives processes, so a key one build adds would be read by a later build of the same uid.
This filter, loaded by bubblewrap (``--seccomp FD``) just before the build's first program runs,
makes ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` fail with ``EPERM``, ``clone3`` fail with
``ENOSYS`` (its flags live in memory a filter can't read; C libraries then fall back to
``clone``, as under Docker's default profile), and ``add_key``, ``request_key`` and ``keyctl``
fail with ``EPERM``. Everything else is allowed. Syscalls of another ABI (x32, 32-bit) fail with
``EPERM``: a CUDA build runs none.

Written as classic BPF by hand (a dozen instructions), so the worker needs no libseccomp.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import struct
import tempfile
from pathlib import Path

CLONE_NEWUSER = 0x10000000

# <linux/audit.h> architectures and the syscall numbers that matter, per architecture.
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435, "add_key": 248,
                            "request_key": 249, "keyctl": 250}),
    "aarch64": (0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435, "add_key": 217,
                             "request_key": 218, "keyctl": 219}),
}
_X32_BIT = 0x40000000

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0 = 16  # low 32 bits of args[0] (little-endian; both architectures above are)


def supported() -> bool:
    return platform.machine() in _ARCHES


def program(machine: str | None = None) -> bytes:
    """The filter as ``struct sock_filter[]`` bytes, the form bubblewrap's ``--seccomp`` reads."""
    arch, nr = _ARCHES[machine or platform.machine()]
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    # (code, jt, jf, k); jumps are relative to the next instruction. Labels resolved by hand:
    ins: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 1, 0, arch),                 # native ABI: go on
        (_RET_K, 0, 0, eperm),
        (_LD_W_ABS, 0, 0, _OFF_NR),
        (_JGE_K, 0, 1, _X32_BIT),             # x32 on x86_64
        (_RET_K, 0, 0, eperm),
        (_JEQ_K, 4, 0, nr["unshare"]),        # -> check flags
        (_JEQ_K, 3, 0, nr["clone"]),          # -> check flags
        (_JEQ_K, 4, 0, nr["clone3"]),         # -> ENOSYS
        (_JEQ_K, 6, 0, nr["add_key"]),        # -> EPERM
        (_JEQ_K, 5, 6, nr["request_key"]),    # -> EPERM, else keyctl check
        (_LD_W_ABS, 0, 0, _OFF_ARG0),         # flags
        (_JSET_K, 2, 1, CLONE_NEWUSER),       # -> EPERM : ALLOW
        (_RET_K, 0, 0, enosys),
        (_RET_K, 0, 0, _RET_ALLOW),
        (_RET_K, 0, 0, eperm),
        (_RET_K, 0, 0, eperm),
        (_JEQ_K, 0, 1, nr["keyctl"]),         # keyctl -> EPERM
        (_RET_K, 0, 0, eperm),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


def write_filter(directory: Path) -> Path:
    """The filter in a file under ``directory`` (the worker's, never a build's), for bubblewrap.

    Written to a fresh name and renamed over, so a reader never sees half of it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"build-{platform.machine()}.bpf"
    data = program()
    try:
        if target.read_bytes() == data:
            return target
    except OSError:
        pass
    # A name of its own per writer: two builds in one process (threads share the pid) must
    # not rename each other's file away.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=directory)
    try:
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target
