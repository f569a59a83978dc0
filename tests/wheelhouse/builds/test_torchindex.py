"""The torch and CUDA check, against a fake torch index served over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from tests.helpers import QuietHandler, free_port, serve_http
from wheelhouse.builds.torchindex import TorchIndex, nearest
from wheelhouse.config import Config
from wheelhouse.errors import TorchUnavailable

#: What the fake index lists per ``{cu}``, as download.pytorch.org names its files.
LISTED = {
    "cu128": ["2.7.1+cu128", "2.8.0+cu128", "2.9.0+cu128"],
    "cu126": ["2.6.0+cu126", "2.7.1+cu126", "2.8.0+cu126"],
    "cu130": ["2.9.0+cu130"],
}


class FakeTorchIndex(QuietHandler):
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        FakeTorchIndex.asked.append(self.path)
        cu, _, rest = self.path.strip("/").partition("/")
        if rest != "torch" or cu not in LISTED:
            self.send_error(404)
            return
        links = "".join(f'<a href="/files/torch-{v}-cp311-cp311-linux_x86_64.whl">'
                        f"torch-{v}-cp311-cp311-linux_x86_64.whl</a>\n" for v in LISTED[cu])
        self.send_body(f"<html><body>{links}</body></html>".encode(), "text/html")


@pytest.fixture
def index() -> Iterator[str]:
    FakeTorchIndex.asked = []
    with serve_http(FakeTorchIndex) as url:
        yield url


def test_torch_builds_that_exist_pass_and_answers_are_cached(index: str) -> None:
    torch = TorchIndex(Config(torch_index_url=index + "/{cu}"))
    assert torch.check("2.8", "12.8") is None
    assert torch.check("2.7", "12.8") is None
    assert FakeTorchIndex.asked == ["/cu128/torch/"]  # one question per CUDA version


@pytest.mark.parametrize(("torch", "cuda", "message"), [
    ("2.88", "12.8", r"^torch 2\.88 has no build for CUDA 12\.8 at http://127\.0\.0\.1:\d+/cu128/"
                     r"torch/; nearest: 2\.9, 2\.8$"),
    ("2.6", "12.8", r"^torch 2\.6 has no build for CUDA 12\.8 at .*; nearest: 2\.7, 2\.8$"),
    ("2.8", "11.8", r"^no torch build exists for CUDA 11\.8 at http://127\.0\.0\.1:\d+/cu118/"
                    r"torch/; torch 2\.8 is built for CUDA 12\.6, 12\.8$"),
])
def test_what_does_not_exist_is_refused_in_one_line(
        index: str, torch: str, cuda: str, message: str) -> None:
    with pytest.raises(TorchUnavailable, match=message):
        TorchIndex(Config(torch_index_url=index + "/{cu}")).check(torch, cuda)


def test_find_links_count_and_an_unlabelled_wheel_serves_any_cuda(tmp_path: Path) -> None:
    links = tmp_path / "links"
    links.mkdir()
    (links / "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (links / "torch-2.13.0+cu126-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    config = Config(torch_index_url=f"file://{tmp_path}/{{cu}}", torch_find_links=str(links))
    torch = TorchIndex(config)
    assert torch.check("2.14", "13.0") is None
    with pytest.raises(TorchUnavailable, match=r"torch 2\.13 has no build for CUDA 13\.0 .*"
                                               r"nearest: 2\.14$"):
        torch.check("2.13", "13.0")


def test_an_index_that_does_not_answer_is_said_not_refused() -> None:
    closed = f"http://127.0.0.1:{free_port()}/whl/{{cu}}"
    warning = TorchIndex(Config(torch_index_url=closed)).check("2.88", "12.8")
    assert warning is not None and "\n" not in warning
    assert warning.startswith("torch 2.88 for CUDA 12.8 was not checked: http://127.0.0.1:")
    assert warning.endswith("(WHEELHOUSE_TORCH_INDEX_URL); queued unchecked")


def test_nearest() -> None:
    assert nearest("3.0", {"2.8", "2.9", "2.10"}) == ["2.10", "2.9"]
    assert nearest("2.88", {"2.7", "2.8", "2.9"}) == ["2.9", "2.8"]
