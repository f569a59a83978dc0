"""A process that sleeps: ``sleeper.py ROLE [--ignore-term] [--stop]``."""

from __future__ import annotations

import os
import signal
import sys
import time

from _common import record

role = sys.argv[1]
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record(role)
if "--stop" in sys.argv:
    os.kill(os.getpid(), signal.SIGSTOP)  # as if paused by a governor
time.sleep(1000)
