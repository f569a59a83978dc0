"""A build that succeeds but leaves two jobs behind (one in its own group, one ignoring TERM)."""

from __future__ import annotations

import subprocess
import time

from _common import record, script

record("main")
subprocess.Popen(script("sleeper.py", "straggler"), process_group=0)
subprocess.Popen(script("sleeper.py", "straggler", "--ignore-term"))
time.sleep(0.5)
