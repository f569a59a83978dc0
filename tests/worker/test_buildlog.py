"""The build log: notes and program output in one file, tailed into lines and progress."""

from __future__ import annotations

from pathlib import Path

from worker.buildlog import BuildLog


class _Seen:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.progress: list[tuple[int, int]] = []

    def log(self, path: Path) -> BuildLog:
        return BuildLog(path, on_lines=self.lines.extend,
                        on_progress=lambda done, total: self.progress.append((done, total)))


def test_notes_are_marked_and_reported_at_once(tmp_path: Path) -> None:
    seen = _Seen()
    log = seen.log(tmp_path / "deep" / "build.log")
    log.write("building x\nwith recipe y")
    assert seen.lines == ["wheelhouse: building x", "wheelhouse: with recipe y"]
    assert log.path.read_text() == "wheelhouse: building x\nwheelhouse: with recipe y\n"


def test_pump_reports_complete_lines_and_the_last_progress(tmp_path: Path) -> None:
    seen = _Seen()
    log = seen.log(tmp_path / "build.log")
    with log.path.open("ab") as f:  # as a subprocess appends
        f.write(b"[1/96] nvcc a.cu\n[2/96] nvcc b.cu\n[3/9")
    log.pump()
    assert seen.lines == ["[1/96] nvcc a.cu", "[2/96] nvcc b.cu"]
    assert seen.progress == [(2, 96)]  # the newest of the batch only
    with log.path.open("ab") as f:
        f.write(b"6] nvcc c.cu\r\ncaf\xc3\xa9 \xff\n")
    log.pump()
    assert seen.lines[2:] == ["[3/96] nvcc c.cu", "café \ufffd"]
    assert seen.progress == [(2, 96), (3, 96)]
    log.pump()  # nothing new: nothing reported
    assert len(seen.lines) == 4 and len(seen.progress) == 2


def test_tail_is_the_end_of_the_file(tmp_path: Path) -> None:
    log = _Seen().log(tmp_path / "build.log")
    log.write("x" * 100)
    log.write("the error")
    content = log.path.read_text()
    assert content == f"wheelhouse: {'x' * 100}\nwheelhouse: the error\n"
    assert log.tail(20) == content[-20:]
    assert log.tail() == content
