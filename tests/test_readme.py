"""The README stays true: every setting is documented (docs/configuration.md), every
``wheelhouse`` command it and the docs show parses with the real CLI, and its quick start,
followed verbatim in a fresh clone, serves and installs a wheel."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import requests

from tests.helpers import free_port, wait_for_port
from wheelhouse.cli.main import main
from wheelhouse.config import Config, documented_settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
#: Every page that shows commands: the README, the contributors' guide and the docs.
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _code_lines(text: str) -> list[str]:
    """The lines of the indented code blocks, with ``\\`` continuations joined."""
    lines: list[str] = []
    previous_blank = True
    in_block = False
    for raw in text.splitlines():
        if raw.startswith("    ") and (in_block or previous_blank):
            in_block = True
            line = raw[4:]
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.rstrip())
        elif raw.strip():
            in_block = False
        previous_blank = not raw.strip()
    return lines


def _wheelhouse_argv(line: str) -> list[str] | None:
    """The arguments after ``wheelhouse`` in a shell line, or None if it runs no wheelhouse."""
    words = shlex.split(line, comments=True)
    for i, word in enumerate(words):
        if word == "wheelhouse":
            rest: list[str] = []
            for w in words[i + 1:]:
                if w in ("&&", "||", ";", "|"):
                    break
                rest.append(w.removesuffix(")") if "$(" in line else w)
            return rest
    return None


def test_every_setting_is_in_the_settings_table() -> None:
    text = CONFIGURATION.read_text()
    table = text.split("<!-- settings:start -->")[1].split("<!-- settings:end -->")[0]
    for variable, _default, doc in documented_settings():
        assert f"`{variable}`" in table, f"{variable} is missing from {CONFIGURATION.name}"
        assert doc, f"{variable} has no docstring in wheelhouse/config.py"


#: ``WHEELHOUSE_*`` names the code uses that are not settings a user sets: markers the worker
#: puts into its own children's environments, and a prefix in a message.
NOT_SETTINGS = {
    "WHEELHOUSE_BUILD_ID": "the cookie each build process carries (worker/supervision/reaper.py)",
    "WHEELHOUSE_COMPILE_SERVER": "marks the compile cache's own server (worker/compilecache.py)",
    "WHEELHOUSE_SDIST_MAX": "the prefix of WHEELHOUSE_SDIST_MAX_* in a docstring",
}


def test_every_wheelhouse_variable_the_code_reads_is_in_the_table() -> None:
    """Issue 21: not only Config's fields: every WHEELHOUSE_ name in the source is listed
    (the client's own variables too), or is named above as not a setting."""
    table = CONFIGURATION.read_text().split("<!-- settings:start -->")[1].split(
        "<!-- settings:end -->")[0]
    used: set[str] = set()
    for package in ("wheelhouse", "web", "worker"):
        for path in (ROOT / package).rglob("*"):
            if path.suffix in (".py", ".html", ".js", ".json", ".toml") and path.is_file():
                used |= set(re.findall(r"WHEELHOUSE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert "WHEELHOUSE_TOOLKIT_REDIST_URL" in used and "WHEELHOUSE_TOKEN" in used
    missing = sorted(n for n in used - set(NOT_SETTINGS) if f"`{n}`" not in table)
    assert missing == [], f"missing from {CONFIGURATION.name}'s settings table: {missing}"


def test_readme_shows_the_quick_start_and_the_test_command() -> None:
    text = README.read_text()
    quick = _code_lines(_section(text, "Quick start"))
    for step in ("pip install .", "pip wheel", "wheelhouse serve", "wheelhouse publish",
                 "uv pip install", "wheelhouse build", "wheelhouse token create",
                 "wheelhouse request"):
        assert any(step in line for line in quick), f"the quick start lacks {step!r}"
    assert ".ci/test" in _code_lines(_section(text, "Running the tests"))
    assert ".ci/test" in (ROOT / ".ci" / "run").read_text()


def _parse(argv: list[str]) -> None:
    """Parse ``argv`` as ``wheelhouse`` would, down to the subcommand's own options, without
    running anything; raise click's error for an unknown command or option."""
    # The groups (wheelhouse, token) take no options of their own: walk down by name.
    ctx = click.Context(main, info_name="wheelhouse", obj=Config())  # as the group's callback
    group: click.Group = main
    args = list(argv)
    while True:
        name, command, args = group.resolve_command(ctx, args)
        assert command is not None, name
        if not isinstance(command, click.Group):
            command.make_context(name or "", args, parent=ctx)
            return
        ctx = click.Context(command, info_name=name, parent=ctx)
        group = command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_wheelhouse_command_shown_parses(
        page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command shown is one that runs: the real CLI accepts its command and options."""
    commands = [argv for line in _code_lines(page.read_text())
                if (argv := _wheelhouse_argv(line)) is not None]
    if page == README:
        assert len(commands) >= 8
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        for arg in argv:  # files the commands name must exist for click to accept them
            if arg.endswith((".whl", ".tar.gz")):
                (tmp_path / arg).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / arg).touch()
        try:
            _parse(argv)
        except click.ClickException as exc:
            pytest.fail(f"wheelhouse {shlex.join(argv)}: {exc.format_message()}")


# -- the quick start, verbatim, in a fresh clone --


def _quick_start() -> dict[str, str]:
    """The quick start's command lines by what they do."""
    lines = _code_lines(_section(README.read_text(), "Quick start"))

    def one(prefix: str) -> str:
        found = [line for line in lines if line.startswith(prefix)]
        assert found, f"no quick-start line starts with {prefix!r}"
        return found[0]

    return {"venv": one("python3 -m venv"), "activate": one(". .venv/bin/activate"),
            "install": one("pip install"), "serve": one("wheelhouse serve"),
            "wheel": one("pip wheel"), "publish": one("wheelhouse publish"),
            "uv": one("uv pip install")}


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    path = tmp_path / "clone"
    subprocess.run([git, "clone", "-q", "--depth", "1", f"file://{ROOT}", str(path)],
                   check=True, capture_output=True)
    return path


def _bash(script: str, cwd: Path, env: dict[str, str], timeout: float = 600,
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _serving(line: str, activate: str, clone: Path, env: dict[str, str],
             port: int) -> Iterator[str]:
    """Run the README's ``wheelhouse serve`` line (on ``port``) in the background."""
    log = clone.parent / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-c", f"{activate}\nexec {line}"], cwd=clone, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_the_quick_start_serves_and_installs_a_wheel_in_a_fresh_clone(
        clone: Path, tmp_path: Path) -> None:
    """A new user's first steps, as the README writes them: a virtual environment, ``pip
    install .``, ``wheelhouse serve``, ``pip wheel`` of the example, ``wheelhouse publish``,
    then ``uv pip install`` from the index into another environment. The only change is the
    port (8000 may be taken)."""
    steps = _quick_start()
    port = free_port()
    assert "--port 8000" in steps["serve"] and "127.0.0.1:8000/" in steps["uv"]
    serve = steps["serve"].replace("--port 8000", f"--port {port}")
    uv = steps["uv"].replace("127.0.0.1:8000/", f"127.0.0.1:{port}/")
    # The user's own environment, minus an active venv and wheelhouse settings.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("WHEELHOUSE_") and k != "VIRTUAL_ENV"}

    setup = _bash("\n".join((steps["venv"], steps["activate"], steps["install"])), clone, env)
    assert setup.returncode == 0, setup.stderr[-3000:]
    # The wheel the publish line names, made with the README's one command.
    wheel_made = _bash(f"{steps['activate']}\n{steps['wheel']}", clone, env)
    assert wheel_made.returncode == 0, wheel_made.stderr[-3000:]
    wheel_path = clone / shlex.split(steps["publish"])[2]
    assert wheel_path.is_file(), sorted(p.name for p in wheel_path.parent.iterdir())
    name, version, *_ = wheel_path.name.split("-")
    project = name.replace("_", "-")

    with _serving(serve, steps["activate"], clone, env, port) as url:
        published = _bash(f"{steps['activate']}\n{steps['publish']}", clone, env)
        assert published.returncode == 0, published.stderr
        variant = shlex.split(steps["uv"])[4].rstrip("/").split("/")[-2]
        deadline = time.monotonic() + 30  # the catalog notices within a second
        while variant not in requests.get(url + "/", timeout=10).text:
            assert time.monotonic() < deadline, "the front page never listed the wheel"
            time.sleep(0.3)
        assert f"--index-url {url}/{variant}/simple" in requests.get(url + "/", timeout=10).text
        # Every server process notices within WHEELHOUSE_CATALOG_REFRESH_SECONDS (1 s): until
        # then one may still answer 404 for the project (never the upstream: it is hosted).
        page, ok = f"{url}/{variant}/simple/{project}/", 0
        while ok < 5:
            assert time.monotonic() < deadline + 10, "the project page never listed the wheel"
            ok = ok + 1 if requests.get(page, timeout=10).status_code == 200 else 0
            time.sleep(0.2)

        target = tmp_path / "target"
        uv_bin = clone / ".venv" / "bin" / "uv"  # pip install . brought it
        made = subprocess.run([str(uv_bin), "venv", "-q", str(target)], env=env,
                              capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        into = {**env, "VIRTUAL_ENV": str(target),
                "PATH": f"{target}/bin:{clone}/.venv/bin:{env.get('PATH', '')}"}
        installed = _bash(uv, clone, into)
        assert installed.returncode == 0, installed.stderr
    got = subprocess.run([str(target / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({project!r}))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == f"{version}+cu128torch2.8"
