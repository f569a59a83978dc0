"""Like ninja running memory-hungry compiles: N memory hogs at once, each in its own group.

``hog_jobs.py N MB GROW HOLD``. Exits 0 only if every job exited 0 (none was killed).
"""

from __future__ import annotations

import subprocess
import sys

from _common import record, script

record("ninja")
count, mb, grow, hold = sys.argv[1:5]
jobs = [subprocess.Popen(script("memory_hog.py", mb, grow, hold), process_group=0)
        for _ in range(int(count))]
codes = [job.wait() for job in jobs]
print("job exit codes:", codes, flush=True)
sys.exit(0 if all(code == 0 for code in codes) else 1)
