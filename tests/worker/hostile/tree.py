"""A hostile build: every trick a build's processes use to outlive a kill of its parent.

Environment: HOSTILE_PIDS (where pids are recorded), HOSTILE_NVCC (a link to sleep named nvcc),
HOSTILE_CLEAR_ENV=1 to add an escapee without the build id cookie, HOSTILE_HOG_MB to add a
memory hog.
"""

from __future__ import annotations

import os
import subprocess
import time

from _common import record, script

record("main")
children = [
    script("pgroup_jobs.py", "2", *([os.environ["HOSTILE_NVCC"]]
                                    if os.environ.get("HOSTILE_NVCC") else [])),
    script("double_fork.py"),
    script("sleeper.py", "ignorer", "--ignore-term"),
    script("sleeper.py", "stopped", "--stop"),
    script("fast_forker.py"),
]
if os.environ.get("HOSTILE_CLEAR_ENV") == "1":
    children.append(script("double_fork.py", "--clear-env"))
if os.environ.get("HOSTILE_HOG_MB"):
    children.append(script("memory_hog.py", os.environ["HOSTILE_HOG_MB"]))
procs = [subprocess.Popen(argv) for argv in children]
time.sleep(1000)
