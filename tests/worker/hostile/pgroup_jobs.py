"""Like ninja: start each job in its own process group, one of them an ``nvcc``-named sleeper.

``pgroup_jobs.py N [NVCC_PATH]``: N python sleepers plus, if given, NVCC_PATH (a link to sleep).
"""

from __future__ import annotations

import subprocess
import sys
import time

from _common import record, script

record("ninja")
jobs = [subprocess.Popen(script("sleeper.py", "job"), process_group=0)
        for _ in range(int(sys.argv[1]))]
if len(sys.argv) > 2:
    nvcc = subprocess.Popen([sys.argv[2], "1000"], process_group=0)
    record("nvcc", nvcc.pid)
time.sleep(1000)
