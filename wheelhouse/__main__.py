"""``python -m wheelhouse``: the ``wheelhouse`` command, run by this very interpreter.

``serve --with-worker`` starts its worker this way, so that the worker is the same
installation as the server whatever ``PATH`` says (systemd units and containers often run
``/srv/venv/bin/wheelhouse`` without the venv on ``PATH``).
"""

from __future__ import annotations

from wheelhouse.cli.main import run

run()
