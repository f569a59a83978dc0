"""The pages in real headless Chromium against the real server (gunicorn), Redis and worker.

Screenshots of every page go to ``<artifacts>/browser/``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.helpers import run_worker, start_index
from tests.web.buildhelpers import advertise_worker
from tests.worker.conftest import FIXTURE_RECIPES, TORCH_FIND_LINKS
from wheelhouse.config import Config
from wheelhouse.fleet import live_workers
from wheelhouse.tokens import create_token

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed")


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def shots(artifacts_dir: Path) -> Path:
    out = artifacts_dir / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _config(tmp_path: Path, redis_url: str, upstream: str) -> Config:
    return Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                  redis_url=redis_url, upstream=upstream, upstream_rules="",
                  recipe_dirs=str(FIXTURE_RECIPES), torch_index_url="",
                  torch_find_links=TORCH_FIND_LINKS, catalog_refresh_seconds=0.5,
                  worker_heartbeat_seconds=2, build_timeout=1500)


def _sign_in(page: Any, url: str, token: str, shots: Path) -> None:
    page.goto(f"{url}/request")
    assert "/login" in page.url  # the form needs a token first
    page.screenshot(path=str(shots / "01-login.png"), full_page=True)
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{url}/request")
    assert "signed in as" in page.inner_text("header")


def _fill(page: Any, *, version: str, torch: str, cuda: str, python: str,
          arch: str | None = None) -> None:
    page.fill("#version", version)
    page.fill("#torch", torch)
    page.select_option("#cuda", cuda)
    page.check(f"#python-field input[value='{python}']")
    if arch:
        page.check(f"#archs-field input[value='{arch}']")


def test_validation_error_and_cancel(
        browser: Any, redis_url: str, tmp_path: Path, cudaext_upstream: str, shots: Path) -> None:
    """No GPU needed: a fleet advert for CUDA 12.8 that nobody consumes keeps builds queued."""
    conn = Redis.from_url(redis_url)
    advertise_worker(conn, cuda="12.8", ttl=600)
    token = create_token(conn, "browser")
    config = _config(tmp_path, redis_url, cudaext_upstream)
    with start_index(config, tmp_path) as url:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        _sign_in(page, url, token, shots)
        assert page.is_disabled("#cuda option[value='13.0']")  # no live worker for it
        # The versions came from the upstream index (PEP 691).
        assert page.locator("#version-list option[value='0.1.0']").count() == 1

        _fill(page, version="0.1.0 && rm -rf ~", torch="2.8", cuda="12.8", python="3.11")
        page.click("#request-form button[type=submit]")
        error = page.locator("#version-error")
        error.wait_for()
        assert "not a PEP 440 version" in error.inner_text()
        # Next to its field: inside the version field's box, right below the input.
        assert page.locator(".field.has-error #version").count() == 1
        box, field = error.bounding_box(), page.locator("#version").bounding_box()
        assert 0 <= box["y"] - (field["y"] + field["height"]) < 120
        page.screenshot(path=str(shots / "02-validation-error.png"), full_page=True)

        page.fill("#version", "0.1.0")
        page.click("#request-form button[type=submit]")
        page.wait_for_url(f"{url}/builds/*")
        assert page.inner_text("#state") == "QUEUED" or page.inner_text("#state") == "queued"
        assert "1 (next)" in page.inner_text("#position")
        page.screenshot(path=str(shots / "03-build-queued.png"), full_page=True)

        page.click("#cancel")
        page.wait_for_selector("#failure")
        assert page.inner_text("#state").lower() == "cancelled"
        assert page.locator("#cancel").count() == 0
        page.screenshot(path=str(shots / "04-build-cancelled.png"), full_page=True)

        page.goto(f"{url}/matrix")
        cell = page.locator("td.cell[data-python='3.11'][data-variant='torch2.8-cu128']")
        assert cell.get_attribute("data-state") == "cancelled"
        page.screenshot(path=str(shots / "05-matrix-cancelled.png"), full_page=True)


@pytest.mark.slow
@pytest.mark.nvcc
def test_watch_a_real_worker_build(
        browser: Any, redis_url: str, tmp_path: Path, cudaext_upstream: str, shots: Path) -> None:
    """Sign in, request, and watch progress and log advance live while ``wheelhouse worker``
    builds the fixture extension with real nvcc; then install from the index."""
    from tests.worker.conftest import nvcc_missing

    reason = nvcc_missing()
    if reason is not None:
        if os.environ.get("WHEELHOUSE_REQUIRE_NVCC") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    conn = Redis.from_url(redis_url)
    token = create_token(conn, "browser")
    config = _config(tmp_path, redis_url, cudaext_upstream)
    worker_log = tmp_path / "worker.log"
    with start_index(config, tmp_path) as url, \
            run_worker(config, "browser-worker", worker_log):
        deadline = time.monotonic() + 120
        while not live_workers(conn):
            assert time.monotonic() < deadline, worker_log.read_text()
            time.sleep(0.5)
        page = browser.new_page(viewport={"width": 1200, "height": 1000})
        _sign_in(page, url, token, shots)
        assert not page.is_disabled("#cuda option[value='13.0']")
        page.screenshot(path=str(shots / "10-request-form.png"), full_page=True)
        _fill(page, version="0.1.0", torch="2.14", cuda="13.0", python="3.11", arch="80")
        page.click("#request-form button[type=submit]")
        page.wait_for_url(f"{url}/builds/*")
        build_url = page.url
        page.evaluate("window.__sameDocument = true")  # gone if the page reloads

        # Watch the live parts advance without a reload.
        seen: list[tuple[str, str, int]] = []
        shot_at = 0.0
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline:
            state = page.inner_text("#state").lower()
            if state in ("built", "failed", "cancelled"):
                break
            progress = page.inner_text("#progress-text")
            log_lines = page.evaluate("document.getElementById('log').textContent.split('\\n')"
                                      ".filter(Boolean).length")
            if not seen or seen[-1] != (state, progress, log_lines):
                seen.append((state, progress, log_lines))
                assert page.evaluate("window.__sameDocument === true"), "the page reloaded"
            if progress.startswith("[") and time.monotonic() - shot_at > 20:
                page.screenshot(path=str(shots / "11-build-progress.png"), full_page=True)
                shot_at = time.monotonic()
            time.sleep(0.5)
        page.wait_for_selector("#installed, #failure", timeout=30_000)
        page.screenshot(path=str(shots / "12-build-done.png"), full_page=True)
        assert page.locator("#installed").count() == 1, (
            page.inner_text("#failure") + "\n" + worker_log.read_text()[-3000:])
        install = page.inner_text("#install")
        assert "cudaext==0.1.0+cu130torch2.14.sm80" in install
        assert f"{url}/torch2.14-cu130-sm80/simple" in install
        assert "GiB" in page.inner_text("#peak-memory")  # from the published record

        # Progress was seen live: ninja's [N/M] rose and the log grew, in one document.
        fractions = [p for _, p, _ in seen if p.startswith("[")]
        assert len(set(fractions)) >= 2, seen
        assert seen[-1][2] > seen[0][2], seen
        assert any(s == "building" for s, _, _ in seen), seen

        page.goto(f"{url}/matrix")
        cell = page.locator("td.cell[data-python='3.11'][data-variant='torch2.14-cu130-sm80']")
        assert cell.get_attribute("data-state") == "built"
        page.screenshot(path=str(shots / "13-matrix.png"), full_page=True)
        page.goto(url + "/")
        page.screenshot(path=str(shots / "14-home.png"), full_page=True)
        assert build_url.startswith(url)
