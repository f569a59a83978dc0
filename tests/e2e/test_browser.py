"""The pages in real headless Chromium against the real server (gunicorn), Redis and worker.

Screenshots of every page go to ``<artifacts>/browser/``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from redis import Redis

from tests.helpers import clean_env, make_venv, make_wheel, run_worker, start_index
from tests.web.buildhelpers import advertise_worker
from tests.worker.conftest import FIXTURE_RECIPES, TORCH_FIND_LINKS
from wheelhouse.builds.fleet import live_workers
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import open_storage
from wheelhouse.index.tokens import create_token
from wheelhouse.variants import parse_variant

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
                  recipe_dirs=str(FIXTURE_RECIPES), torch_index_url="", torch_check=False,
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
    # The form suggests the recipe projects (built-in ones first); these tests build the fixture.
    page.goto(f"{url}/request?project=cudaext")
    assert page.input_value("#project") == "cudaext"


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


def test_the_front_page_command_installs_the_wheel_it_lists(
        browser: Any, tmp_path: Path, shots: Path) -> None:
    """Index-only, as a new user starts: the command shown is there before anything is
    published; a wheel built for one GPU architecture gets its own root's command, which the
    copy button copies and which installs it; the base root says where it is (never the
    upstream: nothing listens there); "Request a build" explains what builds need."""
    config = Config(storage=str(tmp_path / "data"), upstream="http://127.0.0.1:9/simple/",
                    upstream_rules="", catalog_refresh_seconds=0.2)
    with start_index(config, tmp_path) as url:
        context = browser.new_context(viewport={"width": 1200, "height": 900},
                                      permissions=["clipboard-read", "clipboard-write"])
        page = context.new_page()
        page.goto(url + "/")
        assert page.inner_text("#install-example") == (
            f"uv pip install --index-url {url}/torch2.8-cu128/simple PROJECT")
        assert "Nothing is published yet" in page.inner_text("#empty")
        page.screenshot(path=str(shots / "20-home-empty.png"), full_page=True)

        narrow = parse_variant("torch2.14-cu130-sm80")
        wheel = make_wheel(tmp_path / "w", "narrow-ext", f"1.0+{narrow.local_label}",
                           module_body="VALUE = 80\n")
        publish(open_storage(config), wheel, narrow)
        command = page.locator(f"tr[data-variant='{narrow.key}'] "
                               ".command[data-project='narrow-ext'] code")
        deadline = time.monotonic() + 30
        while command.count() == 0:
            assert time.monotonic() < deadline, "the front page never listed the wheel"
            time.sleep(0.3)
            page.reload()
        assert "narrow-ext" in page.inner_text("#narrowed")
        page.screenshot(path=str(shots / "21-home-narrow.png"), full_page=True)
        button = command.locator("xpath=following-sibling::button[1]")
        button.click()
        copied = page.evaluate("navigator.clipboard.readText()")
        assert copied == command.inner_text() == (
            f"uv pip install --index-url {url}/{narrow.key}/simple narrow-ext")
        assert button.inner_text() == "Copied"

        python = make_venv(tmp_path / "target")
        env = clean_env(VIRTUAL_ENV=str(python.parent.parent),
                        UV_CACHE_DIR=str(tmp_path / "uv-cache"))
        done = subprocess.run(shlex.split(copied), env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        got = subprocess.run([str(python), "-c", "import narrow_ext; print(narrow_ext.VALUE)"],
                             capture_output=True, text=True, check=True).stdout
        assert got.strip() == "80"
        base = requests.get(f"{url}/{narrow.base.key}/simple/narrow-ext/",
                            allow_redirects=False, timeout=10)
        assert base.status_code == 404
        assert f"It is built here for {narrow.key}" in base.text

        # Without JavaScript the commands are all there, as selectable text.
        plain = browser.new_page(java_script_enabled=False)
        plain.goto(url + "/")
        assert plain.locator("button.copy").count() == 0
        assert plain.inner_text(f"tr[data-variant='{narrow.key}'] code") == copied

        # Index-only: "Request a build" explains, and links the README's section.
        page.click("header >> text=Request a build")
        page.wait_for_selector("#no-queue")
        assert "Builds need a build queue (Redis) and a build worker" in " ".join(
            page.inner_text("#no-queue").split())
        assert page.locator("header >> text=Sign in").count() == 0
        page.screenshot(path=str(shots / "22-index-only-request.png"), full_page=True)
        page.click("#readme-link")
        page.wait_for_url(f"{url}/readme*")
        assert "## Running it for real" in page.inner_text("body")


def test_a_build_past_its_last_compile_step_is_finishing(
        browser: Any, redis_url: str, tmp_path: Path, shots: Path) -> None:
    """The live page never says "about 0 s left" or "100%" before the end: it follows the
    worker's progress without a reload and says "finishing" once every compile step is done."""
    from tests.helpers import build_job
    from wheelhouse.builds.queue import enqueue_build
    from wheelhouse.builds.spec import BuildSpec

    conn = Redis.from_url(redis_url)
    spec = BuildSpec.create("cudaext", "0.1.0", python="3.11", torch="2.8", cuda="12.8")
    job_id = enqueue_build(conn, spec, require_worker=False).job_id
    job = build_job(conn, job_id)
    job.meta.update(phase="compile", progress=[3, 10])
    job.save_meta()
    job.started_at = job.enqueued_at
    job.save()
    job.set_status("started")
    config = _config(tmp_path, redis_url, "off")
    with start_index(config, tmp_path) as url:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(f"{url}/builds/{job_id}")
        page.evaluate("window.__sameDocument = true")
        assert page.inner_text("#progress-text").startswith("[3/10] 30")
        assert page.inner_text("#estimate").startswith("about ")
        job.meta.update(progress=[10, 10])
        job.save_meta()
        page.wait_for_function(
            "document.getElementById('estimate').textContent.startsWith('finishing')")
        assert page.inner_text("#estimate") == "finishing (linking, packing, uploading)"
        assert page.inner_text("#progress-text") == "[10/10] finishing"
        assert "100" not in page.inner_text("#progress-text")
        assert page.evaluate("window.__sameDocument === true"), "the page reloaded"
        page.screenshot(path=str(shots / "23-build-finishing.png"), full_page=True)


def test_an_html_only_upstream_and_stable_abi_wheels(
        browser: Any, redis_url: str, tmp_path: Path, shots: Path) -> None:
    """The request form lists the versions of an upstream that serves PEP 503 HTML only, and
    the matrix shows abi3 and py3-none-any wheels in every Python column they install into."""
    from tests.helpers import QuietHandler, serve_http
    from wheelhouse.builds.spec import KNOWN_PYTHONS

    class HtmlOnly(QuietHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/simple/cudaext":
                self.send_error(404)
                return
            links = "".join(f'<a href="/files/cudaext-{v}.tar.gz#sha256={"0" * 64}">'
                            f"cudaext-{v}.tar.gz</a><br>" for v in ("0.1.0", "0.2.0"))
            self.send_body(f"<html><body>{links}</body></html>".encode(), "text/html")

    conn = Redis.from_url(redis_url)
    advertise_worker(conn, cuda="12.8", ttl=600)
    token = create_token(conn, "browser")
    variant = parse_variant("torch2.8-cu128")
    with serve_http(HtmlOnly) as upstream:
        config = _config(tmp_path, redis_url, f"{upstream}/simple/")
        storage = open_storage(config)
        for project, tag in (("abi-ext", "cp39-abi3-linux_x86_64"), ("pure-ext", "py3-none-any")):
            wheel = make_wheel(tmp_path / "w", project, f"1.0+{variant.local_label}", tag=tag)
            publish(storage, wheel, variant)
        with start_index(config, tmp_path) as url:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            _sign_in(page, url, token, shots)
            assert page.input_value("#project") == "cudaext"
            options = page.eval_on_selector_all("#version-list option",
                                                "os => os.map(o => o.value)")
            assert options == ["0.2.0", "0.1.0"]
            assert "2 versions on the upstream index" in page.inner_text("#version-help")
            page.screenshot(path=str(shots / "24-request-html-upstream.png"), full_page=True)

            page.goto(f"{url}/matrix")
            for project in ("abi-ext", "pure-ext"):
                cells = page.locator(f"#project-{project} td.cell[data-variant='{variant.key}']")
                states = {cells.nth(i).get_attribute("data-python"):
                          cells.nth(i).get_attribute("data-state") for i in range(cells.count())}
                assert set(states) == set(KNOWN_PYTHONS), states  # cp39-abi3: 3.9 on
                assert set(states.values()) == {"built"}, (project, states)
            page.screenshot(path=str(shots / "25-matrix-stable-abi.png"), full_page=True)
