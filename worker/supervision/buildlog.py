"""The build log: one file that our notes and every program of the build write into.

Programs write into a pipe that a thread of the worker drains (:meth:`BuildLog.drain`), so a
build that prints without pause never blocks on its output and never fills the disk: the file
keeps the first half of ``limit_bytes``, a rolling tail keeps the last half in memory, and
:meth:`BuildLog.seal` writes that tail after a note saying how much was cut. New output is also
handed, in bounded batches, to the reporter (the live log, ninja's ``[N/M]`` progress); its end
is what a failure is classified from, and the sealed file is stored beside the result.

What a build prints is kept as text only: terminal control sequences (CSI and OSC escapes,
the other escapes, C1 controls) and every C0 control but newline and tab are stripped
before anything is stored or shown (:class:`PlainText`), so a log viewed in a terminal can't
set its title, move its cursor or hide lines, and colours leave only their words.
"""

from __future__ import annotations

import os
import re
import select
import threading
from collections.abc import Callable
from pathlib import Path

_PROGRESS = re.compile(r"^\s*\[(\d+)/(\d+)\]")
_READ = 64 * 1024
#: Most output held for the next ``pump`` (the live log); a build that prints faster than the
#: worker reports loses lines from the live view only, never from the stored log's tail.
LIVE_LIMIT = 1024 * 1024
MIB = 1024 * 1024

#: Most bytes of one control sequence kept back until its end arrives in the next read.
MAX_SEQUENCE = 4096
#: Whole control sequences: CSI, OSC (ended by BEL or ST), DCS/SOS/PM/APC (ended by ST), the
#: other ESC sequences. One cut short by a newline, or too long, is not one: its ESC goes with
#: the controls below, and its text stays.
_SEQUENCE = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]"
                       rb"|\x1b\][^\x07\x1b\n]{0,%d}(?:\x07|\x1b\\)"
                       rb"|\x1b[PX^_][^\x1b\n]{0,%d}\x1b\\"
                       rb"|\x1b[ -/]*[0-~]" % (MAX_SEQUENCE, MAX_SEQUENCE))
#: The start of a sequence that the next read may complete.
_UNFINISHED = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b\n]*\x1b?|[PX^_][^\x1b\n]*\x1b?"
                         rb"|[ -/]*)?")
_CONTROLS = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]+")
#: The bytes :data:`_CONTROLS` removes (ESC among them: every sequence starts with one).
_CONTROL_BYTES = bytes([*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f])
#: C1 controls left once the rest is gone, in runs: a removal never joins a new pair.
_C1 = re.compile(rb"\xc2+[\x80-\x9f]+")


def plain(data: bytes) -> bytes:
    """``data`` without terminal control sequences and C0 controls (``\\n`` and ``\\t`` kept).

    In this order, so that no removal joins what is left into a new control: whole sequences,
    then lone controls (ESC among them), then C1 controls.
    """
    if len(data.translate(None, _CONTROL_BYTES)) == len(data) and b"\xc2" not in data:
        return data  # plain already (most output): a C-speed look instead of three regexes
    return _C1.sub(b"", _CONTROLS.sub(b"", _SEQUENCE.sub(b"", data)))


class PlainText:
    """:func:`plain` over a stream read in pieces: a sequence split between two reads is
    held back (up to :data:`MAX_SEQUENCE` bytes) and stripped whole."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        data = self._held + data
        self._held = b""
        start = data.rfind(b"\x1b", max(0, len(data) - MAX_SEQUENCE))
        if start >= 0 and _UNFINISHED.fullmatch(data, start) is not None:
            data, self._held = data[:start], data[start:]
        elif data.endswith(b"\xc2"):  # a C1 control's first byte, or a character's
            data, self._held = data[:-1], data[-1:]
        return plain(data)

    def flush(self) -> bytes:
        """What is held back, as text (an unfinished sequence at the end of the stream)."""
        held, self._held = self._held, b""
        return plain(held)


class BuildLog:
    """The build log file: our notes and the programs' output go in, ``pump`` reports it.

    Each :meth:`pump` hands the new complete lines to ``on_lines`` and the last ninja
    ``[N/M]`` among them to ``on_progress``. ``limit_bytes`` (0: none) caps the stored file;
    it is safe to append from the drain threads while the builder pumps.
    """

    def __init__(self, path: Path, *, on_lines: Callable[[list[str]], None],
                 on_progress: Callable[[int, int], None], limit_bytes: int = 0) -> None:
        self.path = path
        self.on_lines = on_lines
        self.on_progress = on_progress
        self.limit_bytes = limit_bytes
        self._head_limit = limit_bytes - limit_bytes // 2 if limit_bytes else 0
        self._tail_limit = limit_bytes // 2
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        self._lock = threading.Lock()
        self._written = path.stat().st_size
        self._appended = self._written
        """Every byte ever appended, stored or not: the offsets of :meth:`size`."""
        self._tail = bytearray()
        self._dropped = 0
        self.truncated = 0
        """Bytes of output left out of the stored log so far."""
        self._live = bytearray()
        self._live_skipped = 0
        self._partial = b""

    # -- in --

    def write(self, text: str) -> None:
        """A note of the worker's own, marked ``wheelhouse:``; reported at once."""
        lines = text.splitlines() or [""]
        # Notes quote what builds said (a failure's reason): they are stripped too.
        self._append(plain("".join(f"wheelhouse: {line}\n" for line in lines).encode()))
        self.pump()

    def _append(self, data: bytes) -> None:
        with self._lock:
            self._appended += len(data)
            self._live += data
            if len(self._live) > LIVE_LIMIT:
                cut = len(self._live) - LIVE_LIMIT
                del self._live[:cut]
                self._live_skipped += cut
            if not self.limit_bytes or (not self._tail and
                                        self._written + len(data) <= self._head_limit):
                self._to_file(data)
                return
            room = max(0, self._head_limit - self._written) if not self._tail else 0
            if room:
                self._to_file(data[:room])
            self._tail += data[room:]
            if len(self._tail) > self._tail_limit:
                cut = len(self._tail) - self._tail_limit
                del self._tail[:cut]
                self._dropped += cut
                self.truncated += cut

    def _to_file(self, data: bytes) -> None:
        try:
            with self.path.open("ab") as f:
                f.write(data)
        except OSError:
            # A full disk costs the log these bytes, not the build: the drain must go on, or
            # the build would block on (or, once the drain ends, be killed by) its output.
            self.truncated += len(data)
            return
        self._written += len(data)

    def drain(self, fd: int) -> Drain:
        """Append what is read from ``fd`` (a pipe's read end) in a thread; see :class:`Drain`."""
        return Drain(self, fd)

    def seal(self) -> None:
        """Write the kept tail after a note of what was cut, so that the file is the log to store.

        Output that comes later is kept and sealed the same way (e.g. the failure's note).
        """
        with self._lock:
            if not self._tail and not self._dropped:
                return
            note = b""
            if self._dropped:
                note = (f"\nwheelhouse: [{self._dropped} bytes of output truncated here: the "
                        f"stored log keeps its first {_size(self._head_limit)} and last "
                        f"{_size(self._tail_limit)} (WHEELHOUSE_BUILD_LOG_MAX_MIB)]\n"
                        ).encode()
            self._to_file(note + bytes(self._tail))
            self._tail.clear()
            self._dropped = 0

    # -- out --

    def pump(self) -> None:
        """Report what was appended since the last pump: complete lines, and the progress."""
        with self._lock:
            data = bytes(self._live)
            self._live.clear()
            skipped, self._live_skipped = self._live_skipped, 0
        if skipped:
            # The cut landed mid-line: what is left of that line is noise.
            self._partial = b""
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""
        if not data and not skipped:
            return
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        lines = [line.decode("utf-8", errors="replace").rstrip("\r") for line in complete]
        if skipped:
            lines.insert(0, f"wheelhouse: [{skipped} bytes of output not shown live: the build "
                            "printed faster than the log is followed]")
        if not lines:
            return
        for line in reversed(lines):
            m = _PROGRESS.match(line)
            if m is not None:
                self.on_progress(int(m.group(1)), int(m.group(2)))
                break
        self.on_lines(lines)

    def size(self) -> int:
        """Where the log ends now: pass it to :meth:`since` to read what a program adds."""
        with self._lock:
            return self._appended

    def since(self, offset: int, limit: int = 1_000_000) -> str:
        """What was appended after ``offset`` (its last ``limit`` bytes), also once the log is
        over its cap and new output is kept in memory rather than in the file."""
        with self._lock:
            added = self._appended - offset
        return self.tail(min(added, limit)) if added > 0 else ""

    def tail(self, limit: int = 400_000) -> str:
        """The last ``limit`` bytes of the log (the kept tail, when output was cut)."""
        with self._lock:
            kept = bytes(self._tail[-limit:])
        if len(kept) < limit:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                f.seek(max(0, size - (limit - len(kept))))
                kept = f.read() + kept
        return kept.decode("utf-8", errors="replace")


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n} bytes"


class Drain:
    """A thread that reads a pipe into a :class:`BuildLog` until the pipe's writers are gone."""

    def __init__(self, log: BuildLog, fd: int) -> None:
        self.log = log
        self.fd = fd
        self._plain = PlainText()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wheelhouse-log-drain",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self.fd], [], [], 0.2)
                if not ready:
                    if self._stop.is_set():
                        return  # idle, and told to stop: a stray holds the pipe open
                    continue
                data = os.read(self.fd, _READ)
                if not data:
                    return
                self.log._append(self._plain.feed(data))
        except OSError:
            return
        finally:
            self.log._append(self._plain.flush())
            os.close(self.fd)

    def close(self, timeout: float = 10.0) -> None:
        """Read what is left (until the writers are gone or the pipe is idle), then report it.

        Call it once the program has exited and its strays are killed. The thread closes the
        pipe itself when it ends (a writer that outlives ``timeout`` keeps it a while longer).
        """
        self._stop.set()
        self._thread.join(timeout)
        self.log.pump()
