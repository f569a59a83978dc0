"""Like ninja under the compile cache: the compiles run as children of one sccache-like server.

``server_jobs.py N MB GROW HOLD``: a "server" in its own process group, carrying the compile
server's mark in its environment, runs N memory hogs as its children (in its group, without the
mark, as sccache gives compilers the client's environment); beside it, N "clients", each in its
own group, only wait, as sccache clients do. Exits 0 only if every hog exited 0.
"""

from __future__ import annotations

import os
import subprocess
import sys

from _common import record, script

MARK = "WHEELHOUSE_COMPILE_SERVER"

if len(sys.argv) > 1 and sys.argv[1] == "--server":
    record("server")
    env = {k: v for k, v in os.environ.items() if k != MARK}
    hogs = [subprocess.Popen(script("memory_hog.py", *sys.argv[3:6]), env=env)
            for _ in range(int(sys.argv[2]))]
    sys.exit(0 if all(h.wait() == 0 for h in hogs) else 1)

record("ninja")
count = sys.argv[1]
server = subprocess.Popen([sys.executable, __file__, "--server", count, *sys.argv[2:5]],
                          env={**os.environ, MARK: "1"}, process_group=0)
clients = [subprocess.Popen(script("sleeper.py", "client"), process_group=0)
           for _ in range(int(count))]
code = server.wait()
for client in clients:
    client.kill()
    client.wait()
print("server exit code:", code, flush=True)
sys.exit(code)
