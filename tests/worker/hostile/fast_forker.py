"""Ignore SIGTERM and fork long-lived children as fast as possible (capped, to stay polite)."""

from __future__ import annotations

import os
import signal
import time

from _common import record

signal.signal(signal.SIGTERM, signal.SIG_IGN)
record("forker")
for _ in range(400):
    if os.fork() == 0:
        record("forked")
        time.sleep(1000)
        os._exit(0)
    time.sleep(0.01)
time.sleep(1000)
