"""The matrix, the request form and build pages, rendered from real Redis and real storage."""

from __future__ import annotations

import hashlib
import html
import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from packaging.version import Version
from redis import Redis
from rq.job import JobStatus

from tests.helpers import QuietHandler, build_job, make_wheel, serve_http
from tests.web.buildhelpers import GOOD, advertise_worker, bearer, make_app, sign_in, token
from wheelhouse.builds.facts import AppliedPatch, BuildFacts, CompileCacheStats, MaxJobs
from wheelhouse.builds.fleet import advertise
from wheelhouse.builds.queue import append_log, enqueue_build, record_requester
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.index.catalog import Record
from wheelhouse.index.layout import GENERATION_KEY, record_key
from wheelhouse.index.publish import publish
from wheelhouse.provenance import attest, ca, predicates
from wheelhouse.retry import ABANDONED_JOBS
from wheelhouse.variants import KNOWN_CUDA, parse_variant


def _spec(python: str = "3.11", version: str = "2.8.3", archs: tuple[str, ...] = ()) -> BuildSpec:
    return BuildSpec.create("flash-attn", version, python=python, torch="2.8", cuda="12.8",
                            archs=archs)


def _as_worker(conn: Redis, spec: BuildSpec, status: JobStatus, **meta: object) -> str:
    """Move a queued job the way the worker does: its RQ status and its meta."""
    job_id = enqueue_build(conn, spec, require_worker=False).job_id
    job = build_job(conn, job_id)
    job.meta.update(meta)
    job.save_meta()
    if status is JobStatus.STARTED:
        job.started_at = job.enqueued_at
        job.save()
    job.set_status(status)
    return job_id


def _cell(page: str, version: str, variant: str, python: str) -> str:
    marker = (f'data-variant="{variant}" data-python="{python}" data-version="{version}"')
    start = page.index(marker)
    return page[page.rindex("<td", 0, start):page.index("</td>", start)]


def test_matrix_shows_every_state(fleet_client: FlaskClient, queue_app: Flask, conn: Redis,
                                  tmp_path: Path) -> None:
    built = _spec("3.10")
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(built.wheel_version),
                       tag="cp310-cp310-linux_x86_64")
    publish(queue_app.extensions["wheelhouse"].storage, wheel, built.variant)
    enqueue_build(conn, _spec("3.11"))
    building = _as_worker(conn, _spec("3.12"), JobStatus.STARTED, phase="compile",
                          progress=[42, 96])
    _as_worker(conn, _spec("3.13"), JobStatus.FAILED, phase="failed",
               failure={"kind": "incompatible",
                        "reason": "flash-attn 2.8.3 compiles with -std=c++17; torch needs C++20"})
    _as_worker(conn, _spec("3.11", "2.8.2"), JobStatus.QUEUED)

    page = fleet_client.get("/matrix").text
    v = "torch2.8-cu128"
    assert 'class="cell built"' in _cell(page, "2.8.3", v, "3.10")
    assert wheel.name in _cell(page, "2.8.3", v, "3.10")
    assert ">queued<" in _cell(page, "2.8.3", v, "3.11")
    cell = _cell(page, "2.8.3", v, "3.12")
    assert "building 43%" in cell and f"/builds/{building}" in cell and "mini-bar" in cell
    cell = _cell(page, "2.8.3", v, "3.13")
    assert 'class="cell failed"' in cell and "-std=c++17; torch needs C++20" in html.unescape(cell)
    missing = _cell(page, "2.8.2", v, "3.10")  # a hole in the grid is one click from a request
    assert 'class="cell missing"' in missing
    assert "/request?project=flash-attn&amp;version=2.8.2&amp;torch=2.8&amp;cuda=12.8" \
           "&amp;python=3.10" in missing


def test_matrix_offers_every_hosted_project_and_only_its_own_columns(
        fleet_client: FlaskClient, queue_app: Flask, conn: Redis, tmp_path: Path) -> None:
    """Issue 21: the filter lists hosted projects without a recipe too. Issue 30: a column is a
    variant the project has a wheel or a build of, not each CUDA line a live worker builds
    (the request form offers those)."""
    variant = parse_variant("torch2.8-cu128")
    publish(queue_app.extensions["wheelhouse"].storage,
            make_wheel(tmp_path / "w", "demo-ext", f"1.0+{variant.local_label}",
                       tag="cp311-cp311-linux_x86_64"), variant)
    advertise_worker(conn, cuda="13.0", name="gpu-13")
    page = fleet_client.get("/matrix").text
    assert '<option value="demo-ext">demo-ext</option>' in page
    assert '<option value="flash-attn">flash-attn</option>' in page  # a recipe, nothing built
    assert 'class="cell built"' in _cell(page, "1.0", "torch2.8-cu128", "3.11")
    assert 'data-variant="torch2.8-cu130"' not in page
    empty = fleet_client.get("/matrix?project=flash-attn").text
    assert "Nothing of flash-attn is built or queued yet." in empty
    assert "/request?project=flash-attn" in empty


def test_matrix_places_wheels_by_the_build_spec_rule(fleet_client: FlaskClient, queue_app: Flask,
                                                    tmp_path: Path) -> None:
    """A stable-ABI wheel fills the column of every Python it installs into; an aarch64 wheel
    counts too (the matrix has no CPU axis)."""
    storage = queue_app.extensions["wheelhouse"].storage
    label = _spec().wheel_version
    for tag in ("cp39-cp39-linux_x86_64", "cp311-abi3-linux_x86_64"):
        publish(storage, make_wheel(tmp_path / "w", "flash-attn", str(label), tag=tag),
                _spec().variant)
    arm = BuildSpec.create("flash-attn", "2.8.2", python="3.9", torch="2.8", cuda="12.8")
    publish(storage, make_wheel(tmp_path / "w", "flash-attn", str(arm.wheel_version),
                                tag="cp39-cp39-manylinux_2_28_aarch64"), arm.variant)
    page = fleet_client.get("/matrix").text
    v = "torch2.8-cu128"
    assert "flash_attn-2.8.3+cu128torch2.8-cp39-cp39" in _cell(page, "2.8.3", v, "3.9")
    assert 'data-python="3.10"' not in page  # the abi3 wheel serves 3.11 on, not 3.10
    for python in ("3.11", "3.12", "3.13", "3.14"):
        assert "cp311-abi3" in _cell(page, "2.8.3", v, python), python
    assert "manylinux_2_28_aarch64" in _cell(page, "2.8.2", v, "3.9")


def test_a_missing_cell_is_one_click_from_a_build_when_signed_in(
        fleet_client: FlaskClient, conn: Redis) -> None:
    enqueue_build(conn, _spec("3.11"))
    enqueue_build(conn, _spec("3.12", archs=("90",)))
    sign_in(fleet_client, token(conn))
    page = fleet_client.get("/matrix").text
    cell = _cell(page, "2.8.3", "torch2.8-cu128-sm90", "3.11")
    assert "<form" in cell and 'name="archs" value="90"' in cell
    fields = dict(
        (m.split('name="')[1].split('"')[0], html.unescape(m.split('value="')[1].split('"')[0]))
        for m in cell.split("<input")[1:])
    resp = fleet_client.post("/request", data=fields)
    assert resp.status_code == 303
    assert resp.headers["Location"] == f"/builds/{_spec('3.11', archs=('90',)).job_id}"


def _redis_calls(conn: Redis) -> dict[str, int]:
    """Commands the Redis server ran since its last ``CONFIG RESETSTAT``, by name."""
    return {name.removeprefix("cmdstat_"): int(stat["calls"])
            for name, stat in conn.info("commandstats").items()
            if not name.startswith("cmdstat_config")}


def test_matrix_filters_by_project_and_reads_in_bulk(
        fleet_client: FlaskClient, queue_app: Flask, conn: Redis) -> None:
    """3,000 published wheels and 300 jobs: wheels come from the in-memory catalog and jobs
    from one Redis pipeline, so the Redis reads grow with the jobs, not with the cells."""
    for i in range(300):
        spec = BuildSpec.create("flash-attn", f"2.{i // 6}.0", python=f"3.{9 + i % 6}",
                                torch="2.8", cuda="12.8")
        enqueue_build(conn, spec, require_worker=False)
    conn.config_resetstat()
    page = fleet_client.get("/matrix")
    assert page.status_code == 200 and page.text.count('data-state="queued"') == 300
    without_wheels = _redis_calls(conn)
    assert without_wheels["hgetall"] == 300  # each job read once...
    assert without_wheels["exec"] == 1  # ...in one pipeline
    scans = sum(without_wheels.values()) - 300 - 2  # the queue and registry listings
    assert scans <= 14, without_wheels  # 12, and the fleet's adverts (a SCAN and an MGET)

    storage = queue_app.extensions["wheelhouse"].storage
    variants = [parse_variant(k) for k in ("torch2.8-cu128", "torch2.9-cu128", "torch2.14-cu130")]
    n = 0
    for variant in variants:
        for minor in range(200):
            for py in ("310", "311", "312", "313", "314"):
                version = f"1.{minor}"
                name = f"demo_ext-{version}+{variant.local_label}-cp{py}-cp{py}-linux_x86_64.whl"
                rec = Record(filename=name, project="demo-ext", version=f"{version}+"
                             f"{variant.local_label}", variant=variant, archs=None,
                             sha256="0" * 64, size=1, metadata_sha256="0" * 64,
                             requires_python=None, upload_time="2025-01-01T00:00:00Z")
                storage.put_bytes(record_key(variant, "demo-ext", name), rec.to_json())
                n += 1
    storage.put_bytes(GENERATION_KEY, b"big")
    assert n == 3000
    conn.config_resetstat()
    page = fleet_client.get("/matrix")
    assert page.text.count('data-state="built"') == n
    assert page.text.count('data-state="queued"') == 300
    assert _redis_calls(conn) == without_wheels  # 3,000 more cells, not one more read
    only = fleet_client.get("/matrix?project=flash-attn").text
    assert 'id="project-flash-attn"' in only and 'id="project-demo-ext"' not in only
    assert only.count('data-state="queued"') == 300 and 'data-state="built"' not in only


class _Options(HTMLParser):
    """The options of each ``<select>``: value -> (enabled, label)."""

    def __init__(self) -> None:
        super().__init__()
        self.selects: dict[str, dict[str, tuple[bool, str]]] = {}
        self._select: str | None = None
        self._option: tuple[str, bool] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "select":
            self._select = a.get("id") or ""
            self.selects[self._select] = {}
        elif tag == "option" and self._select is not None:
            self._option = (a.get("value") or "", "disabled" not in a)

    def handle_data(self, data: str) -> None:
        if self._option is not None and self._select is not None:
            value, enabled = self._option
            self.selects[self._select][value] = (enabled, " ".join(data.split()))
            self._option = None

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None


def _options(page: str) -> dict[str, dict[str, tuple[bool, str]]]:
    parser = _Options()
    parser.feed(page)
    return parser.selects


def test_request_form_offers_only_what_the_fleet_serves(fleet_client: FlaskClient,
                                                        conn: Redis) -> None:
    """One live worker with CUDA 12.8 on x86_64: only its CUDA versions and CPU can be chosen."""
    advertise_worker(conn, cuda="12.8", machine="x86_64")
    sign_in(fleet_client, token(conn))
    page = fleet_client.get("/request").text
    options = _options(page)
    # The project is typed; recipe projects are suggested.
    assert 'id="project" name="project" list="project-list" value="causal-conv1d"' in page
    assert ('<datalist id="project-list"><option value="causal-conv1d"><option value="flash-attn">'
            '<option value="mamba-ssm"><option value="torch-cluster"><option value="torch-scatter">'
            '<option value="torch-spline-conv"></datalist>') in page
    cuda = {v: o for v, o in options["cuda"].items() if v}
    assert set(cuda) == set(KNOWN_CUDA)
    # A 12.8 toolkit builds every CUDA 12.x up to 12.8, never 12.9 or 13.x.
    servable = {c for c in KNOWN_CUDA if c.startswith("12.") and Version(c) <= Version("12.8")}
    assert {c for c, (enabled, _) in cuda.items() if enabled} == servable
    for c, (enabled, label) in cuda.items():
        assert label.endswith("(no live worker)") != enabled, (c, label)
    assert {m: o[0] for m, o in options["machine"].items()} == {"x86_64": True, "aarch64": False}
    fleet = page[page.index('id="fleet"'):]
    assert "CUDA 12.8 on x86_64" in fleet and "gpu-1" in fleet and "13.0" not in fleet

    # Issue 21: a worker that could not provision 13.0 offers it not; the form says why.
    why = "no CUDA 13.0 release at http://mirror/ (no redistrib_13.0.0.json)"
    advertise(conn, replace(advertise_worker(conn, name="gpu-2"), unavailable={"13.0": why}),
              ttl=120)
    page = fleet_client.get("/request").text
    assert _options(page)["cuda"]["13.0"] == (False, "13.0 (can't be provisioned)")
    assert f"CUDA 13.0: gpu-2: {why}" in page[page.index('id="unavailable"'):]

    advertise_worker(conn, cuda="13.0", machine="aarch64", name="arm-1")
    options = _options(fleet_client.get("/request").text)
    assert options["cuda"]["13.0"][0] and options["machine"]["aarch64"][0]


def test_validation_errors_are_shown_next_to_their_fields(
        fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    resp = fleet_client.post("/request", data={
        "csrf_token": csrf, "project": "flash-attn", "version": "latest; rm -rf /",
        "torch": "2.8", "cuda": "12.8", "archs": ["sm999"]})
    assert resp.status_code == 400
    page = resp.text
    version_field = page[page.index('<label for="version">'):page.index('<label for="torch">')]
    assert 'id="version-error"' in version_field and "not a PEP 440 version" in version_field
    assert 'value="latest; rm -rf /"' in version_field  # kept for correction, escaped
    archs_field = page[page.index('id="archs-field"'):page.index("</fieldset>",
                                                                  page.index('id="archs-field"'))]
    assert "unknown GPU architecture" in archs_field
    python_field = page[page.index('id="python-field"'):page.index('id="archs-field"')]
    assert "choose at least one Python version" in python_field
    assert not any(k.startswith(b"rq:job:") for k in conn.keys())


def test_an_unservable_combination_is_explained_on_the_cuda_field(
        fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    resp = fleet_client.post("/request", data={**GOOD, "cuda": "13.0", "python": "3.11",
                                               "csrf_token": csrf})
    assert resp.status_code == 400
    cuda_field = resp.text[resp.text.index('<label for="cuda">'):
                           resp.text.index('<label for="machine">')]
    assert 'id="cuda-error"' in cuda_field and "no live worker can build for CUDA 13.0" in \
        cuda_field


def test_one_submission_creates_several_builds_and_links_existing_ones(
        fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    existing = enqueue_build(conn, _spec("3.12", archs=("90",))).job_id
    resp = fleet_client.post("/request", data={**GOOD, "python": ["3.11", "3.12"],
                                               "csrf_token": csrf})
    assert resp.status_code == 200
    results = resp.text[resp.text.index('id="submitted"'):]
    assert f'/builds/{_spec("3.11", archs=("90",)).job_id}">new build' in results
    assert f'/builds/{existing}">existing build' in results


def test_any_project_may_be_requested_and_recipes_are_suggested(
        fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    form = fleet_client.get("/request").text
    assert "the others build with the generic recipe" in " ".join(form.split())
    resp = fleet_client.post("/request", data={**GOOD, "project": "my-cuda-ext", "python": "3.11",
                                               "csrf_token": csrf})
    assert resp.status_code == 303, resp.text
    page = fleet_client.get(resp.headers["Location"]).text
    assert "my-cuda-ext 2.8.3 for Python 3.11, torch2.8-cu128-sm90" in page
    bad = fleet_client.post("/request", data={**GOOD, "project": "my ext!", "python": "3.11",
                                              "csrf_token": csrf})
    assert bad.status_code == 400
    text = bad.text
    field = text[text.index('<label for="project">'):text.index('<label for="version">')]
    assert "&#39;my ext!&#39; is not a valid project name" in field


def test_the_allowlist_is_what_the_form_offers_and_accepts(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    advertise_worker(conn)
    client = make_app(redis_url, tmp_path, allowed_projects="flash-attn,causal-conv1d"
                      ).test_client()
    csrf = sign_in(client, token(conn))
    form = client.get("/request").text
    assert ('<datalist id="project-list"><option value="causal-conv1d">'
            '<option value="flash-attn"></datalist>') in form
    assert "This server builds causal-conv1d, flash-attn." in form
    resp = client.post("/request", data={**GOOD, "project": "my-cuda-ext", "python": "3.11",
                                         "csrf_token": csrf})
    assert resp.status_code == 400
    assert "is not built by this server; it builds causal-conv1d, flash-attn" in resp.text
    assert not any(k.startswith(b"rq:job:") for k in conn.keys())


def test_one_build_lands_on_its_page(fleet_client: FlaskClient, conn: Redis) -> None:
    csrf = sign_in(fleet_client, token(conn))
    resp = fleet_client.post("/request", data={**GOOD, "python": "3.11", "csrf_token": csrf})
    assert resp.status_code == 303
    page = fleet_client.get(resp.headers["Location"])
    assert page.status_code == 200
    assert "flash-attn 2.8.3 for Python 3.11, torch2.8-cu128-sm90" in page.text
    assert 'id="position">1 (next)' in page.text
    assert 'id="cancel-form"' in page.text


class _Upstream(QuietHandler):
    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/simple/flash-attn" or "vnd.pypi.simple.v1+json" not in \
                self.headers.get("Accept", ""):
            self.send_error(404)
            return
        body = json.dumps({"meta": {"api-version": "1.1"}, "name": "flash-attn",
                           "files": [{"filename": f"flash_attn-{v}.tar.gz", "url": "x",
                                      "hashes": {}} for v in ("2.7.4", "2.8.3", "2.8.2")],
                           "versions": ["2.7.4", "2.8.2", "2.8.3"]}).encode()
        self.send_body(body, "application/vnd.pypi.simple.v1+json")


@pytest.fixture
def upstream_json() -> Iterator[str]:
    with serve_http(_Upstream) as url:
        yield f"{url}/simple/"


def test_versions_come_from_the_upstream_index(
        redis_url: str, tmp_path: Path, conn: Redis, upstream_json: str) -> None:
    advertise_worker(conn)
    client = make_app(redis_url, tmp_path, upstream=upstream_json).test_client()
    sign_in(client, token(conn))
    page = client.get("/request?project=flash-attn").text
    datalist = page[page.index('<datalist id="version-list">'):]
    assert datalist.index('"2.8.3"') < datalist.index('"2.8.2"') < datalist.index('"2.7.4"')
    assert "3 versions on the upstream index" in page


def test_a_project_upstream_does_not_list_is_said_so(
        redis_url: str, tmp_path: Path, conn: Redis, upstream_json: str) -> None:
    advertise_worker(conn)
    elsewhere = upstream_json.replace("/simple/", "/other/")  # answers 404 for flash-attn
    client = make_app(redis_url, tmp_path, upstream=elsewhere).test_client()
    sign_in(client, token(conn))
    page = client.get("/request?project=flash-attn").text
    assert "The upstream index lists no release of flash-attn" in page
    assert "did not answer" not in page


class _HtmlOnlyUpstream(QuietHandler):
    """An index that serves PEP 503 HTML only, whatever the client asks for."""

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/simple/flash-attn":
            self.send_error(404)
            return
        links = "".join(
            f'<a href="../../files/{name}#sha256={"0" * 64}" '
            f'data-requires-python="&gt;=3.9">{name}</a><br/>\n'
            for name in ("flash_attn-2.7.4.tar.gz", "flash_attn-2.8.3.tar.gz",
                         "flash_attn-2.8.2.tar.gz", "flash_attn-2.8.3.post1.tar.gz",
                         "flash_attn-2.9.0.dev3.tar.gz"))
        body = f"<!DOCTYPE html><html><body><h1>flash-attn</h1>\n{links}</body></html>"
        self.send_body(body.encode(), "text/html")


def test_versions_come_from_an_html_only_upstream(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    """Issue 11: an upstream without PEP 691 JSON still answers the form's version list."""
    advertise_worker(conn)
    with serve_http(_HtmlOnlyUpstream) as url:
        client = make_app(redis_url, tmp_path, upstream=f"{url}/simple/").test_client()
        sign_in(client, token(conn))
        page = client.get("/request?project=flash-attn").text
    start = page.index('<datalist id="version-list">')
    datalist = page[start:page.index("</datalist>", start)]
    shown = [m.split('"')[1] for m in datalist.split("<option value=")[1:]]
    assert shown == ["2.8.3.post1", "2.8.3", "2.8.2", "2.7.4"]  # newest first, no dev releases
    assert "4 versions on the upstream index" in page
    assert "did not answer" not in page


def test_an_unreachable_upstream_leaves_a_free_text_version(
        redis_url: str, tmp_path: Path, conn: Redis) -> None:
    from tests.helpers import free_port

    advertise_worker(conn)
    client = make_app(redis_url, tmp_path,
                      upstream=f"http://127.0.0.1:{free_port()}/simple/").test_client()
    csrf = sign_in(client, token(conn))
    page = client.get("/request").text
    assert "did not answer, so type any PEP 440 version" in page
    resp = client.post("/request", data={**GOOD, "version": "2.9.0rc1", "python": "3.11",
                                         "csrf_token": csrf})
    assert resp.status_code == 303


def test_build_page_while_building(fleet_client: FlaskClient, conn: Redis) -> None:
    jobs = MaxJobs(jobs=6, reason="6 jobs of 5.0 GiB fit in 31 GiB free",
                   per_thread_bytes=5 * 1024**3, nvcc_threads=1, available_bytes=31 * 1024**3,
                   reserve_bytes=1024**3, cores=16, learned=True)
    job_id = _as_worker(conn, _spec(), JobStatus.STARTED, phase="compile", progress=[12, 96],
                        build=BuildFacts(max_jobs=jobs, peak_tree_bytes=3 * 1024**3).to_dict())
    append_log(conn, job_id, ["[11/96] nvcc flash_fwd_hdim64.cu", "[12/96] nvcc flash_bwd.cu"])
    page = fleet_client.get(f"/builds/{job_id}").text
    assert 'id="state" class="state building">building' in page
    assert "[12/96] 12.5%" in page and 'style="width: 12.5%"' in page
    assert "6 jobs of 5.0 GiB fit" in page
    assert "3.0 GiB" in page
    assert "[12/96] nvcc flash_bwd.cu" in page  # the log is in the page, without JavaScript
    assert 'src="/static/build.js"' in page
    assert 'id="cancel-form"' not in page  # not signed in
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view["progress"] == {"done": 12, "total": 96, "percent": 12.5}
    assert view["peak_memory_bytes"] == 3 * 1024**3


@pytest.mark.parametrize(("targets", "charge"), [
    (1, "5.0 GiB per compile job: 1 device target on 1 nvcc thread (NVCC_THREADS=4)"),
    (4, "20.0 GiB per compile job: 4 device targets on 4 nvcc threads (NVCC_THREADS=4)"),
    (None, None),  # a decision recorded before targets were counted: no row
])
def test_build_page_says_what_each_job_was_charged_for(
        fleet_client: FlaskClient, conn: Redis, targets: int | None, charge: str | None) -> None:
    jobs = MaxJobs(jobs=6, reason="MAX_JOBS=6", per_thread_bytes=5 * 1024**3, nvcc_threads=4,
                   available_bytes=200 * 1024**3, reserve_bytes=30 * 1024**3, cores=96,
                   learned=False, targets=targets,
                   effective_threads=min(4, targets) if targets else None)
    job_id = _as_worker(conn, _spec(), JobStatus.STARTED, phase="compile", max_jobs=6,
                        max_jobs_reason=jobs.reason, build={"max_jobs": jobs.to_dict()})
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view is not None and view["max_jobs_charge"] == charge
    page = fleet_client.get(f"/builds/{job_id}").text
    if charge is None:
        assert 'id="max-jobs-charge"' not in page
    else:
        assert f'<td id="max-jobs-charge">{charge}</td>' in page


@pytest.mark.parametrize("meta", [
    {"phase": "compile", "progress": [96, 96]},  # every compile step done: linking
    {"phase": "check", "progress": [96, 96]},  # packing, loading the extension
    {"phase": "publish"},  # uploading
])
def test_a_running_build_is_finishing_never_done(
        fleet_client: FlaskClient, conn: Redis, meta: dict[str, object]) -> None:
    job_id = _as_worker(conn, _spec(), JobStatus.STARTED, **meta)
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view["finishing"] is True and view["remaining_seconds"] is None
    assert view["progress"] is None or view["progress"]["percent"] < 100
    page = fleet_client.get(f"/builds/{job_id}").text
    estimate = page[page.index('id="estimate"'):page.index("</td>", page.index('id="estimate"'))]
    assert "finishing (linking, packing, uploading)" in estimate
    assert "100.0%" not in page and "0 s left" not in page


def test_a_nearly_done_build_is_never_zero_seconds_from_the_end(
        fleet_client: FlaskClient, conn: Redis) -> None:
    job_id = _as_worker(conn, _spec(), JobStatus.STARTED, phase="compile",
                        progress=[9999, 10000])
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view["finishing"] is False
    assert view["remaining_seconds"] >= 1.0
    assert view["progress"]["percent"] == 99.0  # 99.99 would print as 100.0
    assert "0 s left" not in fleet_client.get(f"/builds/{job_id}").text

@pytest.mark.parametrize(("sandbox", "unsafe"), [
    ("bubblewrap: build user 65533:65533, own PID, mount, network, IPC and UTS namespaces", False),
    ("off (unsafe): WHEELHOUSE_BUILD_SANDBOX=off", True),
])
def test_build_page_says_how_the_build_is_sandboxed(fleet_client: FlaskClient, conn: Redis,
                                                    sandbox: str, unsafe: bool) -> None:
    job_id = _as_worker(conn, _spec(), JobStatus.STARTED, phase="compile",
                        build={"sandbox": sandbox})
    page = fleet_client.get(f"/builds/{job_id}").text
    cell = page[page.index('id="sandbox"'):]
    cell = cell[:cell.index("</td>")]
    assert html.escape(sandbox) in cell
    assert ('class="unsafe"' in cell) is unsafe
    assert fleet_client.get(f"/api/builds/{job_id}").json["sandbox"] == sandbox


def test_build_page_of_a_failure_puts_the_reason_first(fleet_client: FlaskClient,
                                                       conn: Redis) -> None:
    job_id = _as_worker(conn, _spec(), JobStatus.FAILED, phase="failed",
                        failure={"kind": "compile-error",
                                 "reason": "csrc/flash_api.cpp:12: error: no member named 'x'"})
    append_log(conn, job_id, ["line before", "csrc/flash_api.cpp:12: error: no member named 'x'"])
    page = fleet_client.get(f"/builds/{job_id}").text
    assert page.index('id="failure"') < page.index('id="log"')
    assert "Failed: <span id=\"failure-kind\">compile error</span>" in page
    assert "Request it again" in page


def test_build_page_of_a_misconfigured_worker_says_what_to_change_not_to_retry(
        fleet_client: FlaskClient, conn: Redis) -> None:
    reason = ("installing torch and the build requirements: download.pytorch.org does not "
              "resolve (tried https://download.pytorch.org/whl/cu128/torch/): set "
              "WHEELHOUSE_TORCH_INDEX_URL to an index this worker reaches")
    job_id = _as_worker(conn, _spec(), JobStatus.FAILED, phase="failed",
                        failure={"kind": "misconfigured", "reason": reason})
    page = fleet_client.get(f"/builds/{job_id}").text
    assert "Request it again" not in page
    assert "WHEELHOUSE_TORCH_INDEX_URL" in page and "an operator changes the setting" in page


def test_build_page_of_a_built_wheel_shows_the_install_command(
        fleet_client: FlaskClient, conn: Redis) -> None:
    spec = _spec(archs=("90",))
    job_id = _as_worker(conn, spec, JobStatus.FINISHED, phase="published",
                        wheel=spec.expected_wheel_name)
    page = fleet_client.get(f"/builds/{job_id}").text
    assert ("uv pip install --index-url http://localhost/torch2.8-cu128-sm90/simple "
            "&#39;flash-attn==2.8.3+cu128torch2.8.sm90&#39; &#39;torch==2.8.*&#39;") in page
    assert 'id="cancel-form"' not in page


PATCH = AppliedPatch(recipe="flash-attn", id="cxx20", sha256="ab" * 32,
                     description="Compile as C++20 instead of C++17: torch 2.14's headers "
                                 "require C++20")
FACTS = BuildFacts(
    patches=(PATCH,), peak_tree_bytes=2 * 1024**3, toolkit="V13.0.88 (wheels)",
    device_code={"flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so":
                 {"sass": ["90", "80"], "ptx": []}},
    compile_cache=CompileCacheStats(requests=80, hits=70, misses=2),
    step_seconds={"toolkit": 0.1, "fetch": 1.5, "venv": 9.0, "compile": 610.0, "check": 12.3})


def test_build_page_says_what_was_patched_compiled_and_cached(
        fleet_client: FlaskClient, conn: Redis) -> None:
    """Issue 13: the patches applied to the sdist, the device code found, the cache's hits."""
    spec = _spec(archs=("80", "90"))
    job_id = _as_worker(conn, spec, JobStatus.FINISHED, phase="published",
                        wheel=spec.expected_wheel_name, build=FACTS.to_dict())
    page = fleet_client.get(f"/builds/{job_id}").text
    patches = page[page.index('id="patches"'):page.index("</td>", page.index('id="patches"'))]
    assert "<code" in patches and "flash-attn/cxx20</code> Compile as C++20" in patches
    assert f"sha256 {'ab' * 32}" in patches
    assert 'id="device-code">sm_80, sm_90<' in page
    assert 'id="compile-cache">70 hits, 2 misses (97%)<' in page
    assert 'id="toolkit">V13.0.88 (wheels)<' in page
    # Where its time went, step by step.
    steps = "toolkit 0.1 s, fetch 1.5 s, venv 9.0 s, compile 610.0 s, check 12.3 s"
    assert f'id="steps">{steps}<' in page
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view["steps"] == steps
    assert view["patches"] == [{**PATCH.to_dict(), "ref": "flash-attn/cxx20"}]
    assert view["device_code"] == "sm_80, sm_90"
    assert view["compile_cache"] == {"hits": 70, "misses": 2, "hit_rate": 0.972, "fetched": 0}
    assert view["attempt"] == 1 and 'id="attempt"' not in page

    unpatched = _as_worker(conn, _spec("3.12"), JobStatus.FINISHED, phase="published",
                           build=BuildFacts(patches=(), device_code={}).to_dict())
    page = fleet_client.get(f"/builds/{unpatched}").text
    assert 'id="patches">none: the sdist as released<' in page
    assert 'id="device-code">no SASS<' in page and 'id="compile-cache">—<' in page
    assert 'id="steps">—<' in page


def test_build_page_of_a_resumed_build_says_so(fleet_client: FlaskClient, conn: Redis) -> None:
    """Issue 31: a job RQ handed to another worker after its first one died (its retry
    spent) is attempt 2, and its page says it resumed from what the first attempt pushed."""
    spec = _spec("3.12")
    resumed = BuildFacts(compile_cache=CompileCacheStats(requests=30, hits=21, misses=3,
                                                         fetched=21))
    job_id = _as_worker(conn, spec, JobStatus.FINISHED, phase="published",
                        wheel=spec.expected_wheel_name, build=resumed.to_dict())
    job = build_job(conn, job_id)
    assert job.retries_left == ABANDONED_JOBS.retries  # what a first attempt has left
    job.retries_left = 0
    job.save()
    page = fleet_client.get(f"/builds/{job_id}").text
    assert ('id="compile-cache">21 hits, 3 misses (88%); 21 entries fetched from storage '
            "first<") in page
    attempt = page[page.index('id="attempt"'):page.index("</td>", page.index('id="attempt"'))]
    assert "2: the worker of attempt 1 died mid-build" in attempt and "(21 hits)" in attempt
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view["attempt"] == 2 and view["compile_cache"]["fetched"] == 21


def test_build_page_reads_the_record_when_the_meta_lacks_the_facts(
        fleet_client: FlaskClient, queue_app: Flask, conn: Redis, tmp_path: Path) -> None:
    spec = _spec()
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(spec.wheel_version),
                       tag="cp311-cp311-linux_x86_64")
    publish(queue_app.extensions["wheelhouse"].storage, wheel, spec.variant, build=FACTS)
    job_id = _as_worker(conn, spec, JobStatus.FINISHED, phase="published", wheel=wheel.name)
    page = fleet_client.get(f"/builds/{job_id}").text
    assert "flash-attn/cxx20" in page and 'id="device-code">sm_80, sm_90<' in page

    # The matrix says what the built wheel holds, in the cell's tooltip.
    cell = _cell(fleet_client.get("/matrix").text, "2.8.3", "torch2.8-cu128", "3.11")
    assert 'data-device-code="sm_80, sm_90"' in cell
    assert f"{wheel.name} · device code: sm_80, sm_90" in html.unescape(cell)


def test_cancel_is_offered_to_those_allowed(fleet_client: FlaskClient, conn: Redis) -> None:
    job_id = enqueue_build(conn, _spec()).job_id
    sign_in(fleet_client, token(conn, "reader", ("read",)))
    assert 'id="cancel-form"' not in fleet_client.get(f"/builds/{job_id}").text
    fleet_client.post("/logout", data={"csrf_token": sign_in(fleet_client, token(conn, "builder"))})
    sign_in(fleet_client, token(conn, "builder2"))
    # Only the token that requested it (or an admin): none is recorded for this one yet.
    assert 'id="cancel-form"' not in fleet_client.get(f"/builds/{job_id}").text
    record_requester(conn, job_id, "builder2")
    assert 'id="cancel-form"' in fleet_client.get(f"/builds/{job_id}").text
    sign_in(fleet_client, token(conn, "ops", ("admin",)))
    record_requester(conn, job_id, "someone-else")  # the first requester stays
    assert 'id="cancel-form"' in fleet_client.get(f"/builds/{job_id}").text


def test_unknown_build_page_is_a_404_page(fleet_client: FlaskClient) -> None:
    resp = fleet_client.get("/builds/build-nope")
    assert resp.status_code == 404 and "no such build" in resp.text


def test_request_needs_sign_in(fleet_client: FlaskClient, conn: Redis) -> None:
    resp = fleet_client.get("/request?project=flash-attn&version=2.8.3")
    assert resp.status_code == 302
    assert resp.headers["Location"].startswith("/login?next=")
    api = fleet_client.post("/api/builds", json=GOOD, headers=bearer("whk_x"))
    assert api.status_code == 401


def test_a_version_the_upstream_does_not_list_is_refused_on_the_form(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    """Issue 30: the form already asks the upstream for versions; a typo is refused when
    submitted, with what it lists, and nothing is queued."""
    from tests.helpers import QuietHandler, serve_http
    from tests.web.buildhelpers import make_app

    class Upstream(QuietHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/simple/flash-attn":
                self.send_error(404)
                return
            links = "".join(f'<a href="/f/flash_attn-{v}.tar.gz#sha256={"0" * 64}">'
                            f"flash_attn-{v}.tar.gz</a>"
                            for v in ("2.8.2", "2.8.3"))
            self.send_body(f"<html><body>{links}</body></html>".encode(), "text/html")

    advertise_worker(conn)
    with serve_http(Upstream) as upstream:
        client = make_app(redis_url, tmp_path, upstream=f"{upstream}/simple/").test_client()
        csrf = sign_in(client, token(conn))
        typo = client.post("/request", data={**GOOD, "version": "2.8.33", "csrf_token": csrf})
        assert typo.status_code == 400
        field = typo.text[typo.text.index('<label for="version">'):
                          typo.text.index('<label for="torch">')]
        assert "flash-attn 2.8.33 is not on the upstream index" in field
        assert "newest: 2.8.3, 2.8.2" in field
        assert not any(k.startswith(b"rq:job:") for k in conn.keys())
        listed = client.post("/request", data={**GOOD, "csrf_token": csrf})
        assert listed.status_code == 303


def test_the_form_builds_an_uploaded_sdist_and_refuses_an_impersonating_one(
        redis_url: str, conn: Redis, tmp_path: Path) -> None:
    """Issue 30: the form takes an sdist as `wheelhouse request PATH` does, with its checks
    (issue 25: a released version must be the upstream's bytes)."""
    import hashlib
    import io

    from tests.web.buildhelpers import make_app
    from wheelhouse.index.layout import source_key

    advertise_worker(conn)
    app = make_app(redis_url, tmp_path, allowed_projects="own-ext")  # upstream off
    client = app.test_client()
    storage = app.extensions["wheelhouse"].storage
    csrf = sign_in(client, token(conn))
    body = b"\x1f\x8b own-ext 1.0"
    fields = {**GOOD, "project": "own-ext", "version": "1.0", "csrf_token": csrf}
    wrong = client.post("/request", data={**fields, "sdist": (io.BytesIO(body),
                                                              "other-1.0.tar.gz")},
                        content_type="multipart/form-data")
    assert wrong.status_code == 400 and "is not an sdist of own-ext" in wrong.text
    made = client.post("/request", data={**fields, "sdist": (io.BytesIO(body),
                                                             "own_ext-1.0.tar.gz")},
                       content_type="multipart/form-data")
    assert made.status_code == 303, made.text
    sha = hashlib.sha256(body).hexdigest()
    assert storage.get_bytes(source_key(sha, "own_ext-1.0.tar.gz")) == body
    job = build_job(conn, made.headers["Location"].rsplit("/", 1)[1])
    assert job.args[0]["source"] == {"sha256": sha, "filename": "own_ext-1.0.tar.gz"}
    # Another token may not build the project the first one now owns from its own bytes.
    mallory = app.test_client()
    csrf = sign_in(mallory, token(conn, "mallory"))
    theirs = b"\x1f\x8b mallory's own-ext"
    refused = mallory.post("/request", data={**fields, "csrf_token": csrf, "sdist": (
        io.BytesIO(theirs), "own_ext-1.0.tar.gz")}, content_type="multipart/form-data")
    assert refused.status_code == 400 and "own-ext is owned here by alice" in refused.text
    assert not storage.exists(source_key(hashlib.sha256(theirs).hexdigest(),
                                         "own_ext-1.0.tar.gz"))


def test_build_page_says_what_it_was_built_from_and_links_its_provenance(
        fleet_client: FlaskClient, queue_app: Flask, conn: Redis, tmp_path: Path) -> None:
    spec = _spec()
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(spec.wheel_version),
                       tag="cp311-cp311-linux_x86_64")
    facts = BuildFacts(build_id="b-3", host="box", sdist_sha256="cd" * 32,
                       sdist_url="https://files.example/flash_attn-2.8.3.tar.gz")
    identity = ca.local_identity(tmp_path / "ca", "worker")

    def sign(filename: str, sha256: str) -> bytes:
        predicate = predicates.publish(publisher="t", index="i", when=datetime.now(UTC))
        return attest.document([attest.Bundle({}, (attest.sign(
            identity, filename, sha256, predicates.PUBLISH, predicate),))])

    record = publish(queue_app.extensions["wheelhouse"].storage, wheel, spec.variant,
                     build=facts, sign=sign)
    job_id = _as_worker(conn, spec, JobStatus.FINISHED, phase="published", wheel=wheel.name,
                        build=facts.to_dict())
    page = fleet_client.get(f"/builds/{job_id}").text
    assert ('id="source"><code>https://files.example/flash_attn-2.8.3.tar.gz</code> '
            f'<span class="muted">sha256 {"cd" * 32}</span>') in page
    view = fleet_client.get(f"/api/builds/{job_id}").json
    assert view["source"] == {"url": "https://files.example/flash_attn-2.8.3.tar.gz",
                              "sha256": "cd" * 32}
    assert view["provenance"].endswith(f"/{wheel.name}.provenance")
    assert f'<a href="{view["provenance"]}">' in page
    served = fleet_client.get(view["provenance"])
    assert hashlib.sha256(served.data).hexdigest() == record.provenance_sha256
