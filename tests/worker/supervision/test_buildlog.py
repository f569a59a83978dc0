"""The build log: notes and program output in one capped file, reported as lines and progress."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

from worker.supervision.buildlog import LIVE_LIMIT, BuildLog, plain
from worker.supervision.reaper import BuildProcess

MiB = 1 << 20


class _Seen:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.progress: list[tuple[int, int]] = []

    def log(self, path: Path, limit_bytes: int = 0) -> BuildLog:
        return BuildLog(path, on_lines=self.lines.extend,
                        on_progress=lambda done, total: self.progress.append((done, total)),
                        limit_bytes=limit_bytes)


def _until(what: str, check: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_notes_are_marked_and_reported_at_once(tmp_path: Path) -> None:
    seen = _Seen()
    log = seen.log(tmp_path / "deep" / "build.log")
    log.write("building x\nwith recipe y")
    assert seen.lines == ["wheelhouse: building x", "wheelhouse: with recipe y"]
    assert log.path.read_text() == "wheelhouse: building x\nwheelhouse: with recipe y\n"


def test_pump_reports_complete_lines_and_the_last_progress(tmp_path: Path) -> None:
    seen = _Seen()
    log = seen.log(tmp_path / "build.log")
    read_end, write_end = os.pipe()
    drain = log.drain(read_end)
    os.write(write_end, b"[1/96] nvcc a.cu\n[2/96] nvcc b.cu\n[3/9")  # as a program prints
    _until("the drain read nothing", lambda: log.path.stat().st_size == 38)
    log.pump()
    assert seen.lines == ["[1/96] nvcc a.cu", "[2/96] nvcc b.cu"]
    assert seen.progress == [(2, 96)]  # the newest of the batch only
    os.write(write_end, b"6] nvcc c.cu\r\ncaf\xc3\xa9 \xff\n")
    os.close(write_end)
    drain.close()  # reads to the end of the pipe, then reports
    assert seen.lines[2:] == ["[3/96] nvcc c.cu", "café \ufffd"]
    assert seen.progress == [(2, 96), (3, 96)]
    log.pump()  # nothing new: nothing reported
    assert len(seen.lines) == 4 and len(seen.progress) == 2
    assert log.path.read_bytes().endswith(b"c.cu\ncaf\xc3\xa9 \xff\n")  # no \r kept


#: What a hostile (or just colourful) build prints, in pieces that cut its sequences in two:
#: colours, an OSC window title (BEL- and ST-ended), cursor moves, a hyperlink, C0 and C1
#: controls, and a note that says it wants the worker's terminal.
COLOURFUL = [
    b"\x1b[1;31merror\x1b[0m: oops\n\x1b]0;pwned title\x07",
    b"next \x1b[", b"32mgreen\x1b", b"[0m\n\x1b]2;another", b" title\x1b\\line\x1b[2K\x1b[1A",
    b"\r\x00bell\x07 tab\there\x1b]8;;http://x/\x1b\\link\x1b]8;;\x1b\\\n",
    b"c1 \xc2", b"\x9b31m csi \xc2\xa0nbsp caf\xc3\xa9\n\x1b[",
]
PLAIN = (b"error: oops\nnext green\nline"
         b"bell tab\there" b"link\n"
         b"c1 31m csi \xc2\xa0nbsp caf\xc3\xa9\n")  # the unfinished "ESC [" at the end too


def test_terminal_control_sequences_are_stripped_and_the_text_kept(tmp_path: Path) -> None:
    """A real program writes the pieces with pauses (so the drain reads them one by one): the
    stored log, its tail and the live lines are plain text, whatever the cuts."""
    seen = _Seen()
    log = seen.log(tmp_path / "build.log")
    code = ("import sys, time, ast\n"
            "for piece in ast.literal_eval(sys.argv[1]):\n"
            "    sys.stdout.buffer.write(piece); sys.stdout.flush(); time.sleep(0.05)\n")
    read_end, write_end = os.pipe()
    build = BuildProcess.start([sys.executable, "-c", code, repr(COLOURFUL)],
                               build_id=f"test-log-{uuid.uuid4().hex[:8]}", env=dict(os.environ),
                               cwd=tmp_path, stdout=write_end)
    os.close(write_end)
    drain = log.drain(read_end)
    assert build.wait(deadline=time.monotonic() + 30).returncode == 0
    drain.close()
    log.write("the build said \x1b]0;title\x07 \x1b[31mthis\x1b[0m")
    stored = log.path.read_bytes()
    assert stored == PLAIN + b"wheelhouse: the build said  this\n"
    assert not any(b in stored for b in (b"\x1b", b"\x07", b"\r", b"\x00", b"\xc2\x9b"))
    assert log.tail() == stored.decode()
    assert "".join(seen.lines).find("\x1b") == -1 and "line" in "".join(seen.lines)
    assert plain(b"".join(COLOURFUL)) == PLAIN


def test_tail_is_the_end_of_the_file(tmp_path: Path) -> None:
    log = _Seen().log(tmp_path / "build.log")
    log.write("x" * 100)
    log.write("the error")
    content = log.path.read_text()
    assert content == f"wheelhouse: {'x' * 100}\nwheelhouse: the error\n"
    assert log.tail(20) == content[-20:]
    assert log.tail() == content


def test_what_a_program_adds_is_read_back_also_past_the_cap(tmp_path: Path) -> None:
    """The load check parses its own output from the log: over the cap, new output is held in
    memory until the log is sealed, and must still be what ``since`` returns."""
    log = _Seen().log(tmp_path / "build.log", limit_bytes=1000)
    log.write("y" * 2000)  # past the cap: the file stops growing
    start = log.size()
    log.write("loaded: import cext._native")
    assert log.since(start) == "wheelhouse: loaded: import cext._native\n"
    assert log.since(log.size()) == ""


def test_a_log_over_its_cap_keeps_its_head_and_tail_and_says_what_was_cut(
    tmp_path: Path,
) -> None:
    seen = _Seen()
    log = seen.log(tmp_path / "build.log", limit_bytes=1000)
    log.write("start")  # 18 bytes
    read_end, write_end = os.pipe()
    drain = log.drain(read_end)
    body = b"".join(b"line %05d\n" % i for i in range(1000))  # 11 bytes a line
    os.write(write_end, body)
    os.close(write_end)
    drain.close()
    assert log.truncated == 18 + len(body) - 1000
    assert "line 00999" in log.tail(11)  # the failure is classified from what came last
    log.write("FAILED [compile-error]: x")
    log.seal()

    stored = log.path.read_bytes()
    head, note, tail = stored.partition(b"bytes of output truncated here")
    assert note and len(head) < 540 and len(tail) < 600
    assert head.startswith(b"wheelhouse: start\nline 00000\n")
    assert f"[{log.truncated} ".encode() in head[-40:]
    assert b"(WHEELHOUSE_BUILD_LOG_MAX_MIB)" in tail
    assert tail.endswith(b"line 00999\nwheelhouse: FAILED [compile-error]: x\n")
    # The live log saw every line (the cap is on what is stored).
    assert seen.lines[1] == "line 00000" and seen.lines[-1].startswith("wheelhouse: FAILED")
    assert len(seen.lines) == 1002


def test_a_build_that_prints_without_pause_stays_bounded_and_supervised(tmp_path: Path) -> None:
    """The worker drains the pipe as fast as a build prints: the build never blocks on it, the
    worker's ticks go on (here its deadline kills the build), and only the capped log and a
    bounded live batch are kept."""
    seen = _Seen()
    log = seen.log(tmp_path / "build.log", limit_bytes=2 * MiB)
    spew = ("import sys\nline = b'x' * 1023 + b'\\n'\n"
            "while True:\n    sys.stdout.buffer.write(line)\n")
    read_end, write_end = os.pipe()
    try:
        build = BuildProcess.start([sys.executable, "-c", spew],
                                   build_id=f"test-spew-{uuid.uuid4().hex[:8]}",
                                   env=dict(os.environ), cwd=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    drain = log.drain(read_end)
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(len(seen.lines))
        log.pump()

    outcome = build.wait(deadline=time.monotonic() + 3, on_tick=tick, tick=0.1, grace=0.5)
    drain.close()
    log.seal()

    assert outcome.timed_out and build.processes() == []
    assert len(ticks) >= 5
    printed = log.truncated + log.path.stat().st_size
    assert printed > 8 * MiB  # it printed on; the drain kept up
    assert log.path.stat().st_size < 2 * MiB + 1024
    assert all(len(line) <= 1023 for line in seen.lines[1:] if not line.startswith("wheelhouse"))
    assert len(seen.lines) < printed // 1024  # the live view dropped what it could not show
    assert any("not shown live" in line for line in seen.lines)
    assert LIVE_LIMIT <= MiB
