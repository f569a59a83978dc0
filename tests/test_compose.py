"""compose.yaml and compose.tls.yaml: valid against the Compose specification, what the README
says they are, and Redis started by the compose service's own script on a real redis-server."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
import yaml
from click.testing import CliRunner

from tests.helpers import free_port, make_tls_certs, wait_for_port
from wheelhouse.cli.main import main
from wheelhouse.config import Config, documented_settings
from wheelhouse.redisconn import connect

ROOT = Path(__file__).resolve().parent.parent
#: The Compose Specification's JSON schema (Apache-2.0: see NOTICE and LICENSE beside it).
SCHEMA = ROOT / "tests" / "fixtures" / "compose-spec" / "compose-spec.json"


FILES = ("compose.yaml", "compose.tls.yaml")
#: One worker service per CUDA line (issue 21): profile, and the CUDA release of its image.
WORKERS = {"worker-cu128": ("cu128", "12.8."), "worker-cu130": ("cu130", "13.0.")}
SECRET = "/run/secrets/redis_password"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / name).read_text())
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load("compose.yaml")


@pytest.fixture(scope="module")
def tls_override() -> dict[str, Any]:
    return _load("compose.tls.yaml")


@pytest.mark.parametrize("name", FILES)
def test_valid_against_compose_spec(name: str) -> None:
    schema = json.loads(SCHEMA.read_text())
    # The spec says draft-07 (its $schema URL lacks the '#' jsonschema looks up by).
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(_load(name)), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_services_and_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", "minio", "minio-init", "provenance-init", "web", "proxy",
                             *WORKERS}
    for name, svc in services.items():
        if name not in ("minio-init", "provenance-init"):
            assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (
                f"{name} waits for {dep} to start, not to be healthy")
    assert "--appendonly" in services["redis"]["command"]
    for name in WORKERS:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_a_worker_per_cuda_line(compose: dict[str, Any], tls_override: dict[str, Any]) -> None:
    """Each CUDA line's worker: its own profile, the matching CUDA devel image, its own
    workspace; the rest of their definition is shared."""
    services = compose["services"]
    shared = None
    for name, (profile, release) in WORKERS.items():
        svc = services[name]
        assert svc["profiles"] == [profile]
        image = svc["build"]["args"]["CUDA_IMAGE"]
        assert image.startswith(f"nvidia/cuda:{release}") and "-devel-" in image
        assert svc["build"]["dockerfile"] == "worker/Dockerfile"
        assert svc["volumes"] == [f"{name}-work:/work", f"provenance-{name}:/provenance:ro"]
        assert {f"{name}-work", f"provenance-{name}"} <= set(compose["volumes"])
        own = {"WHEELHOUSE_PROVENANCE_CERT": f"/provenance/{name}.pem",
               "WHEELHOUSE_PROVENANCE_KEY": f"/provenance/{name}.key"}
        assert {k: svc["environment"][k] for k in own} == own
        rest = {k: v for k, v in svc.items() if k not in ("profiles", "build", "image", "volumes")}
        rest["environment"] = {k: v for k, v in svc["environment"].items() if k not in own}
        assert shared is None or rest == shared
        shared = rest
        assert tls_override["services"][name]["volumes"] == ["./tls/ca.crt:/tls/ca.crt:ro"]
    assert "ARG CUDA_IMAGE=" in (ROOT / "worker" / "Dockerfile").read_text()


def test_the_web_healthcheck_is_liveness(compose: dict[str, Any]) -> None:
    """A container healthcheck decides restarts: it must be /healthz, which a Redis or S3
    outage doesn't fail, never /readyz, which it does (a restart wouldn't fix those)."""
    probe = " ".join(compose["services"]["web"]["healthcheck"]["test"])
    assert "/healthz" in probe and "/readyz" not in probe


NGINX_CONF = ROOT / "deploy" / "nginx" / "wheelhouse.conf"


def test_the_web_is_reached_through_the_buffering_proxy(compose: dict[str, Any],
                                                        tls_override: dict[str, Any]) -> None:
    """Issue 26: gunicorn is not the front door; nginx, which reads requests whole, is."""
    services = compose["services"]
    assert "ports" not in services["web"], "the web must be reached through the proxy only"
    assert "ports" not in tls_override["services"].get("web", {})
    proxy = services["proxy"]
    assert proxy["image"].startswith("nginx:")
    assert proxy["ports"] == ["8000:8080"]
    assert proxy["volumes"] == ["./deploy/nginx/wheelhouse.conf:/etc/nginx/conf.d/default.conf:ro"]
    assert proxy["depends_on"] == {"web": {"condition": "service_healthy"}}
    assert "/healthz" in " ".join(proxy["healthcheck"]["test"])
    # The web trusts the one proxy's X-Forwarded-For/-Proto, and nothing more.
    assert services["web"]["environment"]["WHEELHOUSE_PROXY_HOPS"] == "1"
    conf = NGINX_CONF.read_text()
    directives = dict(re.findall(r"^[ \t]*(\w+)[ \t]+([^;{}\n]*);", conf, re.MULTILINE))
    assert directives["listen"] == "8080"
    assert directives["proxy_request_buffering"] == "on"
    assert directives["client_header_timeout"] == "10s"
    assert directives["client_max_body_size"] == f"{Config().upload_max_mib}m"
    assert "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;" in conf
    assert "proxy_set_header X-Forwarded-Proto $scheme;" in conf
    assert re.search(r"server web:8000;", conf)


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_the_proxy_config_is_one_nginx_accepts(tmp_path: Path) -> None:
    """``nginx -t`` on the config as the image includes it (inside ``http {}``), with the
    web's name replaced by an address that resolves here."""
    server = NGINX_CONF.read_text().replace("server web:8000;", "server 127.0.0.1:8000;")
    (tmp_path / "default.conf").write_text(server)
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;\n"
        "events {}\n"
        f"http {{ access_log off; client_body_temp_path {tmp_path}/body; "
        f"proxy_temp_path {tmp_path}/proxy; include {tmp_path}/default.conf; }}\n")
    done = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "test is successful" in done.stderr


def test_commands_are_the_cli_the_tests_exercise(compose: dict[str, Any]) -> None:
    """Every wheelhouse command compose runs parses with the real CLI."""
    runner = CliRunner()
    for name, svc in compose["services"].items():
        for argv in (svc.get("command"), svc.get("healthcheck", {}).get("test", [])[1:]):
            if not argv or argv[0] != "wheelhouse":
                continue
            result = runner.invoke(main, [*argv[1:], "--help"])
            assert result.exit_code == 0, f"{name}: {argv} -> {result.output}"


def test_environment_is_documented(compose: dict[str, Any]) -> None:
    known = {v for v, _d, _doc in documented_settings()}
    for name, svc in compose["services"].items():
        for var in svc.get("environment", {}):
            if var.startswith("WHEELHOUSE_"):
                assert var in known, f"{name} sets {var}, which wheelhouse does not read"


@pytest.mark.parametrize("name", FILES)
def test_no_secrets_in_the_file(name: str) -> None:
    text = (ROOT / name).read_text()
    for line in text.splitlines():
        if re.search(r"(PASSWORD|SECRET|TOKEN|ACCESS_KEY)\w*:\s*\S", line):
            # A value from the environment, or the path of a secret's file.
            reference = re.search(r"_FILE:\s*/run/secrets/\w+$", line.rstrip())
            assert "${" in line or reference, f"a literal secret in {name}: {line.strip()}"


def test_readme_operator_section_matches(compose: dict[str, Any]) -> None:
    # The README's "Running it for real" points to docs/running.md, which holds the details.
    section = (ROOT / "docs" / "running.md").read_text()
    for name in compose["services"]:
        assert f"`{name}`" in section, f"docs/running.md omits `{name}`"
    for dockerfile in ("web/Dockerfile", "worker/Dockerfile"):
        assert dockerfile in section


# -- the fleet's doors (README, Security) --


def test_redis_is_private_and_wants_a_password(compose: dict[str, Any],
                                               tls_override: dict[str, Any]) -> None:
    services = compose["services"]
    redis_svc = services["redis"]
    assert "ports" not in redis_svc, "Redis must not be published by default"
    assert compose["secrets"]["redis_password"] == {"environment": "REDIS_PASSWORD"}
    assert redis_svc["secrets"] == ["redis_password"]
    started = " ".join([*redis_svc["entrypoint"], *redis_svc["command"]])
    assert "requirepass" in started and "--requirepass" not in started
    for name in ("web", *WORKERS):
        svc = services[name]
        assert svc["secrets"] == ["redis_password"]
        env = svc["environment"]
        assert env["WHEELHOUSE_REDIS_PASSWORD_FILE"] == SECRET
        # MinIO's administrator stays with minio and minio-init.
        assert "MINIO_ROOT" not in json.dumps(env), name
    # The TLS port is the only one published, and the worker gets the CA to check it with.
    tls = tls_override["services"]
    assert tls["redis"]["ports"] == ["6380:6380"]
    assert "--tls-port" in tls["redis"]["command"]
    assert tls["redis"]["command"][:4] == redis_svc["command"], "keep the persistence flags"


def test_each_role_has_its_own_s3_user(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "WEB_S3_ACCESS_KEY" in services["web"]["environment"]["AWS_ACCESS_KEY_ID"]
    for name in WORKERS:
        assert "WORKER_S3_ACCESS_KEY" in services[name]["environment"]["AWS_ACCESS_KEY_ID"]
    init = services["minio-init"]
    assert init["volumes"] == ["./deploy/s3:/policies:ro"]
    script = init["command"][0]
    for role, user in (("web", "web"), ("web-cache", "web"), ("worker", "worker")):
        policy = ROOT / "deploy" / "s3" / f"{role}-policy.json"
        assert f"/policies/{policy.name}" in script
        assert json.loads(policy.read_text())["Version"] == "2012-10-17"
        assert (f"policy attach local wheelhouse-{role} --user "
                f'"$${user.upper()}_S3_ACCESS_KEY"') in script


def _script(svc: dict[str, Any], secret: Path) -> list[str]:
    """The service's entrypoint as the container's shell gets it: compose turns ``$$`` into
    ``$``; the secret's file is where this test keeps it."""
    return [arg.replace("$$", "$").replace(SECRET, str(secret)) for arg in svc["entrypoint"]]


@contextmanager
def _redis_as_compose_runs_it(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_redis_starts_as_compose_runs_it(compose: dict[str, Any], tmp_path: Path) -> None:
    svc = compose["services"]["redis"]
    password = secrets.token_hex(32)
    secret = tmp_path / "redis_password"
    secret.write_text(password)  # compose writes the variable's value, without a newline
    port = free_port()
    # Where a test can run it: its own port and directory, after the service's own arguments.
    argv = [*_script(svc, secret), *svc["command"], "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(tmp_path)]
    with _redis_as_compose_runs_it(argv, tmp_path / "redis.log") as proc:
        wait_for_port(port)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        conn = connect(Config(redis_url=f"redis://127.0.0.1:{port}/0",
                              redis_password_file=str(secret)), timeout=5)
        assert conn.ping()
        assert conn.config_get("appendonly") == {"appendonly": "yes"}
        # Nowhere another local user could read it: not in the arguments, not in the
        # environment (only root and the redis user can read /proc/PID/environ anyway).
        for part in ("cmdline", "environ"):
            assert password.encode() not in Path(f"/proc/{proc.pid}/{part}").read_bytes()
        # The healthcheck, pointed at this port: healthy with the password, not without.
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL"
        check = test[1].replace("$$", "$").replace("redis-cli ping", f"redis-cli -p {port} ping")
        assert subprocess.run(["sh", "-c", check.replace(SECRET, str(secret))],
                              timeout=30).returncode == 0
        wrong = tmp_path / "wrong"
        wrong.write_text("0" * 64)
        assert subprocess.run(["sh", "-c", check.replace(SECRET, str(wrong))],
                              timeout=30).returncode != 0


@pytest.mark.parametrize("password", ["", "tooshort", "with spaces inside of it!",
                                      'quote"' + "x" * 20, "x" * 20 + "\nrequirepass ''"])
def test_redis_will_not_start_without_a_sound_password(compose: dict[str, Any], tmp_path: Path,
                                                       password: str) -> None:
    svc = compose["services"]["redis"]
    secret = tmp_path / "redis_password"
    secret.write_text(password)
    port = free_port()
    argv = [*_script(svc, secret), *svc["command"], "--port", str(port), "--dir", str(tmp_path)]
    with _redis_as_compose_runs_it(argv, tmp_path / "redis.log") as proc:
        assert proc.wait(timeout=30) == 1
    assert "REDIS_PASSWORD" in (tmp_path / "redis.log").read_text()


def test_redis_over_tls_as_compose_tls_runs_it(compose: dict[str, Any],
                                               tls_override: dict[str, Any],
                                               tmp_path: Path) -> None:
    """compose.yaml's start-up with compose.tls.yaml's command: a worker elsewhere connects
    with ``rediss://``, the CA and the password, and nothing less."""
    files = make_tls_certs(tmp_path / "tls")
    secret = tmp_path / "redis_password"
    secret.write_text(secrets.token_hex(32))
    tls_port, plain_port = free_port(), free_port()
    command = [arg.replace("/tls/", f"{tmp_path}/tls/").replace("6380", str(tls_port))
               for arg in tls_override["services"]["redis"]["command"]]
    argv = [*_script(compose["services"]["redis"], secret), *command,
            "--port", str(plain_port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    with _redis_as_compose_runs_it(argv, tmp_path / "redis.log"):
        wait_for_port(tls_port)
        worker = Config(redis_url=f"rediss://localhost:{tls_port}/0?ssl_ca_certs={files.ca}",
                        redis_password_file=str(secret))
        assert connect(worker, timeout=5).ping()
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            connect(worker.replace(redis_url=f"rediss://localhost:{tls_port}/0"),
                    timeout=5).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(worker.replace(redis_password_file=None), timeout=5).ping()


def _provenance_init(svc: dict[str, Any], root: Path) -> tuple[list[str], dict[str, Path]]:
    """provenance-init's script as the container's shell gets it, with its mount points
    under ``root`` and the web's user the one running the test; and each volume's place."""
    script = svc["command"][0].replace("$$", "$")
    mounts = {m.split(":")[0]: root / m.split(":")[1].lstrip("/") for m in svc["volumes"]}
    return [*svc["entrypoint"], script], mounts


def test_provenance_init_gives_each_signer_a_certificate_of_one_ca(
        compose: dict[str, Any], tmp_path: Path) -> None:
    """Run as compose runs it (the real ``wheelhouse ca``): one CA; the index and each worker a
    certificate that CA issued, with its key, where their settings point; re-run on every
    ``up``, it keeps what is valid and renews what is near its expiry."""
    from cryptography import x509

    from wheelhouse.provenance import ca

    services = compose["services"]
    init = services["provenance-init"]
    argv, volume = _provenance_init(init, tmp_path)
    env = {**os.environ, "CA_DIR": str(tmp_path / "ca"), "SIGNERS_DIR": str(tmp_path / "signers"),
           "WEB_USER": str(os.getuid()),
           "PATH": f"{Path(shutil.which('wheelhouse') or 'wheelhouse').parent}"
                   f"{os.pathsep}{os.environ['PATH']}"}
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    authority = x509.load_pem_x509_certificate((volume["provenance-ca"] / "ca.pem")
                                               .read_bytes())
    signers = {"web": ("provenance-index", "index"),
               **{name: (f"provenance-{name}", name) for name in WORKERS}}
    issued = {}
    for service, (volume_name, signer) in signers.items():
        svc = services[service]
        assert f"{volume_name}:/provenance:ro" in svc["volumes"]
        env_of = svc["environment"]
        files = {k: volume[volume_name] / Path(env_of[k]).relative_to("/provenance")
                 for k in ("WHEELHOUSE_PROVENANCE_CA", "WHEELHOUSE_PROVENANCE_CERT",
                           "WHEELHOUSE_PROVENANCE_KEY")}
        assert files["WHEELHOUSE_PROVENANCE_CA"].read_bytes() == (
            volume["provenance-ca"] / "ca.pem").read_bytes()
        me = ca.load_identity(files["WHEELHOUSE_PROVENANCE_CERT"],
                              files["WHEELHOUSE_PROVENANCE_KEY"])
        me.cert.verify_directly_issued_by(authority)
        assert me.name == signer
        assert files["WHEELHOUSE_PROVENANCE_KEY"].stat().st_mode & 0o077 == 0
        issued[signer] = me.cert.serial_number
    for name, place in volume.items():  # the CA's key stays in the CA's volume
        assert (place / "ca.key").exists() == (name == "provenance-ca"), name

    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("not renewed") == len(signers) and "kept" in again.stdout
    # A certificate near its expiry is renewed on the next run; the others are kept.
    near = volume["provenance-worker-cu130"]
    ca.write_identity(ca.issue(ca.load_ca(volume["provenance-ca"]), "worker-cu130",
                               days=2), near)
    third = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stdout + third.stderr
    renewed = ca.load_identity(near / "worker-cu130.pem", near / "worker-cu130.key")
    assert renewed.cert.not_valid_after_utc.timestamp() - time.time() > 20 * 86400
    assert third.stdout.count("not renewed") == len(signers) - 1
