"""Escape the tree: fork, setsid, fork again, exec sleep; the intermediates exit.

``double_fork.py [--clear-env]``: with --clear-env the survivor also drops its environment, so
neither its session, its parent nor the build id cookie lead to it (only a cgroup does).
"""

from __future__ import annotations

import os
import sys

from _common import record

clear_env = "--clear-env" in sys.argv
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        record("escaped-noenv" if clear_env else "escaped")
        os.execve("/bin/sleep", ["sleep", "1000"], {} if clear_env else dict(os.environ))
    os._exit(0)
os.wait()
