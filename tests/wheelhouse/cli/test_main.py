"""The ``wheelhouse`` command as a user meets it: the installed console script, run by its path
with a minimal ``PATH`` (as systemd units and containers run it), its help, ``--storage``, and
how it is assembled (subcommands from entry points; the core imports neither web nor worker)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import requests

from tests.helpers import (
    MINIMAL_PATH,
    free_port,
    make_wheel,
    run_console,
    start_index,
)
from wheelhouse.builds.spec import BuildSpec
from wheelhouse.cli.main import main
from wheelhouse.config import Config
from wheelhouse.index.publish import publish
from wheelhouse.index.storage import LocalStorage
from wheelhouse.variants import parse_variant

ROOT = Path(__file__).resolve().parents[3]
JSON = {"Accept": "application/vnd.pypi.simple.v1+json"}
COMMANDS = ["build", "ca", "delete", "gc", "mirror", "projects", "prove", "publish", "request",
            "serve", "token", "unyank", "variants", "verify", "verify-provenance", "worker",
            "workers", "yank"]
#: Every command that opens storage offers --storage.
STORAGE_COMMANDS = ["build", "delete", "gc", "publish", "serve", "unyank", "verify", "yank"]


def _flat(text: str) -> str:
    """Help text with click's line wrapping undone."""
    return " ".join(text.split())


def _command_paths() -> list[tuple[str, ...]]:
    ctx = click.Context(main)
    paths: list[tuple[str, ...]] = []
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None, name
        paths.append((name,))
        if isinstance(command, click.Group):
            paths.extend((name, sub) for sub in command.list_commands(ctx))
    return paths


def _resolve(path: tuple[str, ...]) -> click.Command:
    ctx = click.Context(main)
    command: click.Command | None = main
    for name in path:
        assert isinstance(command, click.Group)
        command = command.get_command(ctx, name)
    assert command is not None, path
    return command


def _listed(help_text: str) -> list[str]:
    """The command names a group's ``--help`` lists."""
    return [line.split()[0] for line in help_text.split("Commands:", 1)[1].splitlines()
            if line.startswith("  ") and not line.startswith("   ")]


def test_every_command_is_listed() -> None:
    done = run_console("--help")
    assert done.returncode == 0, done.stderr
    assert _listed(done.stdout) == COMMANDS


@pytest.mark.parametrize("path", _command_paths(), ids=" ".join)
def test_every_option_has_help(path: tuple[str, ...]) -> None:
    command = _resolve(path)
    options = [p for p in command.params if isinstance(p, click.Option)]
    done = run_console(*path, "--help")
    assert done.returncode == 0, done.stderr
    shown = _flat(done.stdout)
    for option in options:
        assert option.help and option.help.strip(), f"{' '.join(path)} {option.opts[0]}: no help"
        assert option.opts[0] in shown
        assert _flat(option.help.split("(")[0]) in shown, option.opts[0]


def test_serve_help_documents_port_and_access_log() -> None:
    shown = _flat(run_console("serve", "--help").stdout)
    assert "--port INTEGER RANGE TCP port to listen on. [default: 8000;" in shown
    assert "--access-log / --no-access-log Log every request to stdout" in shown


@pytest.mark.parametrize("command", STORAGE_COMMANDS)
def test_storage_option_is_offered(command: str) -> None:
    shown = _flat(run_console(command, "--help").stdout)
    assert ("--storage DIR|s3://BUCKET/PREFIX Where wheels live: a directory, or "
            "s3://bucket/prefix (overrides WHEELHOUSE_STORAGE).") in shown


def test_publish_and_gc_use_storage_over_the_environment(tmp_path: Path) -> None:
    configured, chosen = tmp_path / "configured", tmp_path / "chosen"
    config = Config(storage=str(configured))
    variant = "torch2.8-cu128"
    wheels = [make_wheel(tmp_path / v, "demo", v) for v in ("1.0", "2.0")]
    done = run_console("publish", *map(str, wheels), "--variant", variant, "--relabel",
                       "--storage", str(chosen), config=config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("published demo-") == 2
    # Issue 21: it says where it published, and that it made a new, empty storage there.
    assert done.stdout.count(f" to {variant} in {chosen.resolve()} (sha256 ") == 2
    assert done.stderr.startswith(f"warning: {chosen.resolve()} does not exist: creating a new, "
                                  "empty storage there")
    assert (chosen / "records").is_dir()
    assert not configured.exists()
    again = run_console("publish", str(wheels[0]), "--variant", variant, "--relabel",
                        "--storage", str(chosen), config=config)
    assert again.returncode == 0 and "warning" not in again.stderr

    pruned = run_console("gc", "--keep-versions", "1", "--storage", str(chosen), config=config)
    assert pruned.returncode == 0, pruned.stderr
    doomed = [line for line in pruned.stdout.splitlines() if line.startswith("would delete")]
    assert doomed and all("demo-1.0+cu128torch2.8" in line for line in doomed)
    assert all("2.0" not in line.split(" (")[0] for line in doomed)
    # Without --storage it looks where the environment says: nothing there.
    assert run_console("gc", "--keep-versions", "1", config=config).stdout.strip() == (
        "nothing to collect")


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path: Path) -> None:
    """Issue 21: one line, a non-zero exit, and no "serving on" before it."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_console("serve", "--port", str(port), "--storage", str(tmp_path / "d"),
                           config=Config(storage=str(tmp_path / "d"), upstream="off"))
    assert done.returncode != 0
    assert done.stderr.strip() == (f"Error: port {port} on 127.0.0.1 is already in use; stop "
                                   "what listens there or choose another --port")
    assert "serving" not in done.stdout + done.stderr


def test_serve_uses_storage_over_the_environment(tmp_path: Path) -> None:
    chosen = tmp_path / "chosen"
    variant = parse_variant("torch2.8-cu128")
    wheel = make_wheel(tmp_path / "w", "demo", f"1.0+{variant.local_label}")
    publish(LocalStorage(chosen), wheel, variant)
    config = Config(storage=str(tmp_path / "configured"), upstream="off")
    with start_index(config, tmp_path, args=("--storage", str(chosen))) as url:
        resp = requests.get(f"{url}/{variant.key}/simple/demo/", headers=JSON, timeout=10)
    assert resp.status_code == 200, url.access_log()
    assert [f["filename"] for f in resp.json()["files"]] == [wheel.name]
    assert f"serving {chosen}" in url.access_log()


def test_build_uses_storage_over_the_environment(tmp_path: Path) -> None:
    """A wheel already in the chosen storage is found there: nothing is built."""
    chosen = tmp_path / "chosen"
    spec = BuildSpec.create("flash-attn", "2.8.3", python="3.11", torch="2.8", cuda="12.8")
    wheel = make_wheel(tmp_path / "w", "flash-attn", str(spec.wheel_version),
                       tag="cp311-cp311-linux_x86_64")
    publish(LocalStorage(chosen), wheel, spec.variant)
    # No toolkit from NVIDIA's wheels either: the build fails at once, as this test needs.
    config = Config(storage=str(tmp_path / "configured"), workspace=str(tmp_path / "work"),
                    upstream="off", toolkit_wheels=False)
    argv = ("build", "flash-attn==2.8.3", "--torch", "2.8", "--cuda", "12.8", "--python", "3.11")
    done = run_console(*argv, "--storage", str(chosen), config=config)
    assert done.returncode == 0, done.stderr
    assert f"{wheel.name} is already published in torch2.8-cu128" in done.stdout
    # The configured storage has no such wheel: there, the build is attempted (and fails).
    attempted = run_console(*argv, config=config)
    assert attempted.returncode == 1
    assert "build failed [" in attempted.stderr and "Traceback" not in attempted.stderr


def test_build_takes_any_project_unless_the_allowlist_says_otherwise(tmp_path: Path) -> None:
    """The CLI agrees with the API and the form: no recipe is needed (the generic one builds
    it), and WHEELHOUSE_ALLOWED_PROJECTS is the operator's way to restrict what is built."""
    config = Config(storage=str(tmp_path / "data"), workspace=str(tmp_path / "work"),
                    upstream="off", toolkit_wheels=False)
    argv = ("build", "some-cuda-ext==1.0", "--torch", "2.8", "--cuda", "12.8", "--python",
            "3.11")
    attempted = run_console(*argv, config=config)
    assert attempted.returncode == 1  # it got as far as building (no toolkit or upstream here)
    assert "building some-cuda-ext 1.0 for Python 3.11" in attempted.stderr
    assert "build failed [" in attempted.stderr and "recipe" not in attempted.stderr
    refused = run_console(*argv, config=config.replace(allowed_projects="flash-attn"))
    assert refused.returncode == 2
    assert ("'some-cuda-ext' is not built by this server; it builds flash-attn "
            "(WHEELHOUSE_ALLOWED_PROJECTS)") in refused.stderr
    assert "Traceback" not in refused.stderr and "building" not in refused.stderr


def test_bad_setting_in_the_environment_is_one_line(tmp_path: Path) -> None:
    done = run_console("gc", env={"WHEELHOUSE_PAGE_MAX_AGE": "soon"}, cwd=tmp_path)
    assert done.returncode == 1
    assert "WHEELHOUSE_PAGE_MAX_AGE must be a number, got 'soon'" in done.stderr
    assert "Traceback" not in done.stderr


def _python(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={"PATH": MINIMAL_PATH}, cwd=cwd, timeout=60)


def test_core_commands_import_neither_web_nor_worker(tmp_path: Path) -> None:
    code = """
import json, sys
from wheelhouse.cli.main import main
for argv in (["gc", "--storage", sys.argv[1]], ["request", "--help"], ["token", "--help"]):
    main(argv, standalone_mode=False)
print(json.dumps(sorted(m for m in sys.modules
                        if m.partition(".")[0] in ("web", "worker", "flask", "gunicorn"))))
"""
    done = _python(code, str(tmp_path / "data"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "nothing to collect" in done.stdout
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_command_whose_package_is_missing_is_not_listed(tmp_path: Path) -> None:
    code = """
import sys
sys.modules["web"] = None  # as if the web part were not installed
from wheelhouse.cli.main import main
main(sys.argv[1:])
"""
    listing = _python(code, "--help", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert _listed(listing.stdout) == [c for c in COMMANDS if c != "serve"]
    serve = _python(code, "serve", cwd=tmp_path)
    assert serve.returncode == 2
    assert "No such command 'serve'" in serve.stderr


def test_a_clone_stays_clean_after_running_with_the_defaults(tmp_path: Path) -> None:
    """Run from a fresh clone with no settings: what the defaults create is ignored by git."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run([git, "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)],
                   check=True, capture_output=True)
    wheel = make_wheel(tmp_path / "w", "demo", "1.0")
    published = run_console("publish", str(wheel), "--variant", "torch2.8-cu128", "--relabel",
                            cwd=clone)
    assert published.returncode == 0, published.stderr
    # A build (that fails: no toolkit or no upstream) leaves its log in the default workspace.
    built = run_console("build", "flash-attn==2.8.3", "--torch", "2.8", "--cuda", "12.8",
                        "--keep-workspace", cwd=clone,
                        env={"WHEELHOUSE_UPSTREAM": "off", "WHEELHOUSE_TOOLKIT_WHEELS": "false"})
    assert built.returncode == 1
    defaults = Config()
    assert any((clone / defaults.storage).rglob("*.whl"))
    assert any((clone / defaults.workspace).rglob("build.log"))
    status = subprocess.run([git, "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                            capture_output=True, text=True, check=True)
    assert status.stdout == ""


@pytest.mark.parametrize("command", [("token", "list"), ("token", "create", "x"),
                                     ("token", "revoke", "x"), ("workers",)])
def test_a_redis_that_cannot_be_reached_is_one_line(command: tuple[str, ...]) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    done = run_console(*command, env={"WHEELHOUSE_REDIS_URL": dead})
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: Redis can't be reached (") and "WHEELHOUSE_REDIS_URL" in line
