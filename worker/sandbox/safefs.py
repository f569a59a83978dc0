"""The one place the worker touches directories a build could write: by descriptor, never by path.

The worker runs outside the sandbox, as root on a real fleet. Everything a build can write is
hostile input until it has been copied out and checked: a name the worker expects may be a link
(to the worker's credentials, to another project's wheel, up and out of the tree), a FIFO that
blocks whoever opens it, a device, a socket, or a sparse file of terabytes. So here:

- a path below a trusted directory (one the worker created, whose parents the build never had)
  is opened relative to that directory's descriptor with **no link followed at any level**:
  ``openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)`` where the kernel has it (Linux >= 5.6),
  else component by component with ``O_NOFOLLOW``;
- a file is first opened ``O_PATH`` (which opens nothing: no FIFO blocks, no device driver
  runs), checked with ``fstat`` to be a regular file within the size cap, and only then opened
  for reading (``O_NONBLOCK``, the same inode or a refusal);
- reads stop at the size cap and at a deadline;
- writes create fresh files (``O_CREAT | O_EXCL | O_NOFOLLOW``), never write through what is
  there; trees are walked and removed by descriptor.

Every refusal is :class:`~worker.errors.UnsafePath` with one line saying what was found.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from worker.errors import UnsafePath

MAX_DEPTH = 256
"""Deepest directory nesting walked in a build's tree; deeper is refused."""

#: openat2's ``resolve`` flags (linux/openat2.h).
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture Linux added it to (5.6)
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CHUNK = 1024 * 1024


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
USE_OPENAT2 = True
"""Whether to try ``openat2`` (tests switch it off to run the component-by-component walk)."""
_openat2_missing = False


def _openat2(dirfd: int, rel: str, flags: int) -> int | None:
    """``openat2`` without following any link; None where the kernel lacks it."""
    global _openat2_missing
    if not USE_OPENAT2 or _openat2_missing:
        return None
    how = _OpenHow(flags=flags, mode=0,
                   resolve=_RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd),
                  ctypes.c_char_p(os.fsencode(rel)), ctypes.byref(how),
                  ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and not _probe_openat2():
        _openat2_missing = True  # no openat2 here, or a seccomp profile that denies it
        return None
    raise OSError(err, os.strerror(err), rel)


def _probe_openat2() -> bool:
    how = _OpenHow(flags=_O_PATH | os.O_CLOEXEC, mode=0, resolve=0)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(-100), ctypes.c_char_p(b"/"),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        return False
    os.close(fd)
    return True


def _parts(rel: str | PurePosixPath) -> list[str]:
    text = str(rel)
    parts = text.split("/")
    if not text or text.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"{text[:200]!r} is not a plain relative path")
    return parts


def _describe(err: OSError, rel: str) -> UnsafePath:
    if err.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR, errno.EMLINK):
        return UnsafePath(f"{rel[:200]} goes through a link or something not a directory; "
                          "refusing to follow it")
    return UnsafePath(f"{rel[:200]}: {err.strerror}")


def open_beneath(dirfd: int, rel: str | PurePosixPath, flags: int) -> int:
    """Open ``rel`` below the directory ``dirfd`` following no link at any level.

    ``flags`` should hold ``O_PATH`` or ``O_DIRECTORY`` for anything not yet checked (see
    :func:`open_regular`). Raise :class:`UnsafePath` for a link on the way, an escape, or a
    missing name (``FileNotFoundError``'s message).
    """
    parts = _parts(rel)
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = _openat2(dirfd, "/".join(parts), flags)
        if fd is not None:
            return fd
        current = dirfd
        try:
            for part in parts[:-1]:
                nxt = os.open(part, _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=current)
                if current != dirfd:
                    os.close(current)
                current = nxt
            return os.open(parts[-1], flags, dir_fd=current)
        finally:
            if current != dirfd:
                os.close(current)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _describe(exc, "/".join(parts)) from None


def open_dir(root: Path | str) -> int:
    """A descriptor of a trusted directory (one the worker made; its parents never the build's).

    The last component is still not followed if it is a link.
    """
    try:
        return os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise _describe(exc, str(root)) from None


def open_subdir(dirfd: int, rel: str | PurePosixPath) -> int:
    """A readable descriptor of the directory ``rel`` below ``dirfd`` (no links on the way)."""
    return open_beneath(dirfd, rel, os.O_RDONLY | os.O_DIRECTORY)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(dirfd: int, rel: str | PurePosixPath, *,
                 max_bytes: int) -> tuple[int, os.stat_result]:
    """A read descriptor of the regular file ``rel`` below ``dirfd``, and its ``fstat``.

    Nothing else is ever opened for reading: the name is first opened ``O_PATH`` and checked,
    so a FIFO, device or socket is refused without blocking or reaching a driver. Over
    ``max_bytes`` is refused too.
    """
    name = str(rel)
    probe = open_beneath(dirfd, rel, _O_PATH)
    try:
        st = os.fstat(probe)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{name[:200]} is {_kind(st.st_mode)}; refusing to read it")
        if st.st_size > max_bytes:
            raise UnsafePath(f"{name[:200]} holds {st.st_size} bytes, over the {max_bytes} byte "
                             "cap; refusing to read it")
        # O_PATH descriptors can't be read; open again and check it is the same inode.
        fd = open_beneath(dirfd, rel, _READ_FLAGS)
    finally:
        os.close(probe)
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise UnsafePath(f"{name[:200]} changed while it was opened; refusing to read it")
    return fd, again


def _copy(fd: int, out: int | None, *, max_bytes: int, deadline: float | None,
          name: str) -> bytes:
    """Read ``fd`` to its end (into ``out``, or returned), within the cap and the deadline."""
    chunks: list[bytes] = []
    total = 0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise UnsafePath(f"{name[:200]} was not read within its deadline")
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > max_bytes:
            raise UnsafePath(f"{name[:200]} grew past the {max_bytes} byte cap while read")
        if out is None:
            chunks.append(chunk)
        else:
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
    return b"".join(chunks)


def read_bytes(dirfd: int, rel: str | PurePosixPath, *, max_bytes: int,
               timeout: float = 30.0) -> bytes:
    """The contents of the regular file ``rel`` below ``dirfd``, at most ``max_bytes``."""
    fd, _ = open_regular(dirfd, rel, max_bytes=max_bytes)
    try:
        return _copy(fd, None, max_bytes=max_bytes, deadline=time.monotonic() + timeout,
                     name=str(rel))
    finally:
        os.close(fd)


def read_text(root: Path, rel: str | PurePosixPath, *, max_bytes: int,
              timeout: float = 30.0) -> str:
    """:func:`read_bytes` below the trusted directory ``root``, decoded (errors replaced)."""
    dirfd = open_dir(root)
    try:
        return read_bytes(dirfd, rel, max_bytes=max_bytes, timeout=timeout).decode(
            errors="replace")
    finally:
        os.close(dirfd)


def copy_out(dirfd: int, rel: str | PurePosixPath, dest: Path, *, max_bytes: int,
             timeout: float = 600.0, mode: int = 0o644) -> int:
    """Copy the regular file ``rel`` below ``dirfd`` into the new file ``dest`` (in a directory
    the worker owns and the build never had); return its size. ``dest`` must not exist.

    A file with a hole is refused: the copy would be written out whole, so a sparse file
    (which costs the build no disk, and passes its disk cap) would fill the worker's disk and
    hold it past the build's deadline. Wheels and compile cache entries are written densely.
    """
    fd, st = open_regular(dirfd, rel, max_bytes=max_bytes)
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE) if st.st_size else 0
        if hole < st.st_size:
            raise UnsafePath(f"{str(rel)[:200]} is sparse (a hole at byte {hole} of "
                             f"{st.st_size}); refusing to copy it")
        os.lseek(fd, 0, os.SEEK_SET)
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      mode & 0o777)
        try:
            _copy(fd, out, max_bytes=max_bytes, deadline=time.monotonic() + timeout,
                  name=str(rel))
            return os.fstat(out).st_size
        except BaseException:
            os.close(out)
            out = -1
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise
        finally:
            if out >= 0:
                os.close(out)
    finally:
        os.close(fd)


def make_dirs(dirfd: int, rel: str | PurePosixPath, mode: int = 0o755) -> int:
    """Descriptor of the directory ``rel`` below ``dirfd``, created where missing; a link or
    non-directory on the way is refused, never followed."""
    parts = _parts(rel)
    current = os.dup(dirfd)
    try:
        for part in parts:
            try:
                os.mkdir(part, mode, dir_fd=current)
            except FileExistsError:
                pass
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=current)
            except OSError as exc:
                raise _describe(exc, "/".join(parts)) from None
            os.close(current)
            current = nxt
        return current
    except BaseException:
        os.close(current)
        raise


def create_file(dirfd: int, name: str, data: bytes | None = None, *, mode: int = 0o644) -> int:
    """Create the new file ``name`` directly in ``dirfd`` (never through what is there) and
    return a write descriptor; ``data``, when given, is written and the descriptor closed
    (-1 is returned). Setuid and setgid bits are never set."""
    _parts(name)
    if "/" in name:
        raise UnsafePath(f"{name[:200]!r} is not a plain file name")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode & 0o777, dir_fd=dirfd)
    os.fchmod(fd, mode & 0o777)  # past the umask, and never setuid
    if data is None:
        return fd
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return -1


def write_new(root: Path, rel: str | PurePosixPath, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` into the new file ``rel`` below the trusted directory ``root``, creating
    directories on the way; an existing name (file or link) is refused."""
    parts = _parts(rel)
    top = open_dir(root)
    try:
        parent = make_dirs(top, "/".join(parts[:-1])) if len(parts) > 1 else os.dup(top)
        try:
            create_file(parent, parts[-1], data, mode=mode)
        except FileExistsError:
            raise UnsafePath(f"{'/'.join(parts)[:200]} exists already; refusing to write "
                             "through it") from None
        finally:
            os.close(parent)
    finally:
        os.close(top)


@dataclass(frozen=True)
class Entry:
    """One thing found by :func:`walk`: where it is and what it is (never followed)."""

    dirfd: int
    """Its directory's descriptor, valid only until the walk moves on."""
    name: str
    rel: str
    """Its path below the walked directory, ``/``-separated."""
    stat: os.stat_result


def walk(dirfd: int, *, max_depth: int = MAX_DEPTH) -> Iterator[Entry]:
    """Everything below the directory ``dirfd``, depth first, by descriptor.

    No link is followed and no path grows past ``PATH_MAX``, however deep a hostile tree is;
    past ``max_depth`` levels :class:`UnsafePath` is raised, which bounds the descriptors held.
    """
    top = os.dup(dirfd)
    stack: list[tuple[int, str, Iterator[os.DirEntry[str]]]] = [(top, "", os.scandir(top))]
    try:
        while stack:
            fd, prefix, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                _close(fd, entries)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed while we looked
            rel = f"{prefix}{entry.name}"
            yield Entry(fd, entry.name, rel, st)
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= max_depth:
                    raise UnsafePath(f"the tree nests directories deeper than {max_depth} levels")
                try:
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                stack.append((sub, rel + "/", os.scandir(sub)))
    finally:
        for fd, _, entries in stack:
            _close(fd, entries)


def _close(fd: int, entries: Iterator[os.DirEntry[str]]) -> None:
    close = getattr(entries, "close", None)
    if close is not None:
        close()
    os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything below it without following a link (missing is fine).

    ``path`` itself must lie in a directory the build never had; below it anything goes.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    parent = open_dir(path.parent)
    try:
        _remove_below(parent, path.name)
    finally:
        os.close(parent)


def remove_entry(dirfd: int, name: str) -> None:
    """Remove ``name`` of the directory ``dirfd``, a whole tree if it is a directory, without
    following a link (missing is fine)."""
    try:
        st = os.lstat(name, dir_fd=dirfd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _remove_below(dirfd, name)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dirfd)


def _remove_below(parent: int, name: str) -> None:
    # Iterative, by descriptor: a deep hostile tree can't exhaust the stack or PATH_MAX.
    stack = [(parent, name, os.open(name, _DIR_FLAGS, dir_fd=parent))]
    try:
        while stack:
            _, _, fd = stack[-1]
            descended = False
            with os.scandir(fd) as entries:
                found = list(entries)
            for entry in found:
                if entry.is_dir(follow_symlinks=False):
                    if len(stack) > MAX_DEPTH * 4:
                        raise UnsafePath("the tree is too deep to remove")
                    try:
                        sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        continue
                    stack.append((fd, entry.name, sub))
                    descended = True
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=fd)
            if descended:
                continue
            up, own, fd = stack.pop()
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(own, dir_fd=up)
    finally:
        for _, _, fd in stack:
            os.close(fd)


def discard_tree(path: Path) -> None:
    """:func:`remove_tree`, best effort (what is left is found by the next build's sweep)."""
    with contextlib.suppress(OSError):
        remove_tree(path)
