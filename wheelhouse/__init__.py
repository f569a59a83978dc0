"""wheelhouse core: configuration, variants, wheels, storage, catalog and build specs.

The core imports neither Flask nor RQ's worker; ``web`` and ``worker`` build on it.
"""

from __future__ import annotations

__version__ = "0.1.0"
