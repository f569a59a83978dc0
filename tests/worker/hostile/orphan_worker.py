"""A worker that starts a hostile build and then waits to be SIGKILLed.

``orphan_worker.py BUILD_ID WORKDIR``: prints ``ready`` once the build runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from _common import HERE

from worker.supervision.reaper import BuildProcess

build_id, workdir = sys.argv[1], Path(sys.argv[2])
build = BuildProcess.start(
    [sys.executable, str(HERE / "tree.py")], build_id=build_id, env=dict(os.environ),
    cwd=workdir, log_path=workdir / "build.log",
)
print("ready", build.pid, build.cgroup or "", flush=True)
time.sleep(1000)
