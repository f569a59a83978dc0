"""A "compile": grow to MB megabytes in steps, touching every page, hold, exit 0.

``memory_hog.py MB [SECONDS_TO_GROW] [SECONDS_TO_HOLD]``
"""

from __future__ import annotations

import sys
import time

from _common import record

record("hog")
total = int(sys.argv[1]) << 20
grow = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
hold = float(sys.argv[3]) if len(sys.argv) > 3 else 1000.0
steps = 20
chunks = []
for _ in range(steps):
    chunks.append(b"\x01" * (total // steps))  # bytes * n writes every page
    time.sleep(grow / steps)
time.sleep(hold)
