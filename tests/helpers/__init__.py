"""Helpers shared by tests, one module per concern: ``jobs`` (build jobs in Redis), ``tls``
(throwaway certificates), ``net`` (ports, waiting, small loopback servers), ``wheels`` (real
wheels, PyPI sdists) and ``processes`` (venvs, the console script, the real index, worker and
Redis). Everything is re-exported here, so ``from tests.helpers import make_wheel`` works."""

from tests.helpers.jobs import build_job, plant_job
from tests.helpers.net import (
    Listener,
    QuietHandler,
    free_port,
    host_addresses,
    moto_s3_server,
    serve_http,
    simple_index,
    wait_for_port,
    wait_until,
)
from tests.helpers.processes import (
    HOST_NETWORK_ENV,
    MINIMAL_PATH,
    IndexURL,
    RedisProcess,
    clean_env,
    config_env,
    console_script,
    fake_cuda_toolkit,
    group_gone,
    make_venv,
    own_session,
    run_console,
    run_worker,
    start_index,
    stop_group,
)
from tests.helpers.tls import TLSFiles, make_tls_certs
from tests.helpers.wheels import SDIST_CACHE, make_wheel, metadata_bomb, pypi_sdist

__all__ = [
    "HOST_NETWORK_ENV", "MINIMAL_PATH", "SDIST_CACHE", "IndexURL", "Listener", "QuietHandler",
    "RedisProcess", "TLSFiles", "build_job", "clean_env", "config_env", "console_script",
    "fake_cuda_toolkit", "free_port", "group_gone", "host_addresses", "make_tls_certs",
    "make_venv", "make_wheel", "metadata_bomb", "moto_s3_server", "own_session", "plant_job",
    "pypi_sdist",
    "run_console", "run_worker", "serve_http", "simple_index", "start_index", "stop_group",
    "wait_for_port", "wait_until",
]
