"""The program :meth:`worker.compilecache.CompileCache.wrap` runs around a build's compile.

It brings the build's own sccache server up, runs the compile with the launchers in its
environment, writes the server's statistics to a file and takes the server down. Its source is
handed to the build's Python as ``python -I -c SOURCE PAYLOAD`` (``PAYLOAD`` is the JSON of
``wrap``); so it runs inside the build (and its sandbox), in any Python from 3.9, isolated: it
imports the standard library only, nothing of wheelhouse, and uses nothing newer than 3.9
(ruff reads it as 3.9, ``tests/worker/test_compilecache_wrapper.py`` checks both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

#: A unix socket's path holds 108 bytes with the NUL; longer ones go to a short directory.
MAX_SOCKET_PATH = 100


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    """Run the compile ``argv[1]`` describes; return its exit status (a signal as 128 + n)."""
    p: dict[str, Any] = json.loads(argv[1])
    sccache = str(p["sccache"])
    sock = str(p["socket"])
    short = None
    if len(os.fsencode(sock)) >= MAX_SOCKET_PATH:
        # In /tmp, not TMPDIR: the build's TMPDIR lies in its (long) workspace path.
        short = tempfile.mkdtemp(prefix="wh-sccache-", dir="/tmp")
        sock = os.path.join(short, "sccache.sock")
    client = dict(os.environ, SCCACHE_SERVER_UDS=sock)
    server_env = dict(client, **p["server_env"])
    server_env.update(SCCACHE_START_SERVER="1", SCCACHE_NO_DAEMON="1", SCCACHE_IDLE_TIMEOUT="0",
                      SCCACHE_ERROR_LOG=p["log"], SCCACHE_LOG=p.get("log_level", "warn"))
    server_env[p["mark"]] = "1"
    stats = [sccache, "--show-stats", "--stats-format=json"]

    def answers() -> bool:
        try:
            return subprocess.run(stats, env=client, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    server: subprocess.Popen[bytes] | None = None
    _unlink(sock)  # a killed build's: the server would not bind
    try:
        with open(p["log"], "ab") as log:
            # Its own process group: the memory governor counts each of its children as one job.
            server = subprocess.Popen([sccache], env=server_env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, preexec_fn=os.setpgrp)
        deadline = time.monotonic() + 30
        while server.poll() is None and time.monotonic() < deadline:
            if os.path.exists(sock) and answers():
                break
            time.sleep(0.1)
        else:
            raise OSError(f"the server did not answer within 30 s (exit {server.poll()})")
    except OSError as exc:
        print(f"wheelhouse: compile cache unavailable, compiling without it: {exc}", flush=True)
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()
        server = None
    env = dict(client, **p["client_env"]) if server is not None else dict(os.environ)
    print(f"wheelhouse: compile cache: {p['describe'] if server else 'off'}", flush=True)
    code = subprocess.call(p["argv"], env=env)
    if server is not None:
        out = subprocess.run(stats, env=client, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=60)
        if out.returncode == 0:
            with open(p["stats"], "wb") as f:
                f.write(out.stdout)
        subprocess.run([sccache, "--stop-server"], env=client, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    _unlink(sock)
    if short:
        os.rmdir(short)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
