"""A build that parks memory beside its compile: ``parked_hog.py LINK_DIR COMPILE_MB PARKED_MB``.

One compile job, in its own process group as ninja starts it, runs as ``cc1plus`` (a link to
this Python in LINK_DIR) and grows to COMPILE_MB; it first starts a plain Python child in its
group that holds PARKED_MB. Beside it a plain Python in a group of its own holds PARKED_MB too.
Exits 0 once the compile is done; the parked processes end with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _common import HERE, record, script

HOG = str(HERE / "memory_hog.py")

if sys.argv[1] == "--compile":  # the job: ``cc1plus --compile PYTHON COMPILE_MB PARKED_MB``
    python, compile_mb, parked_mb = sys.argv[2:5]
    record("compile")
    subprocess.Popen([python, HOG, parked_mb, "0", "4"])  # holds while the compile grows
    os.execv(sys.executable, [sys.executable, HOG, compile_mb, "1", "2"])  # still cc1plus

record("ninja")
link_dir, compile_mb, parked_mb = sys.argv[1:4]
compiler = Path(link_dir) / "cc1plus"
os.symlink(sys.executable, compiler)
parked = subprocess.Popen(script("memory_hog.py", parked_mb, "0", "1000"), process_group=0)
job = subprocess.Popen([str(compiler), __file__, "--compile", sys.executable, compile_mb,
                        parked_mb], process_group=0)
code = job.wait()
parked.kill()
parked.wait()
sys.exit(code)
