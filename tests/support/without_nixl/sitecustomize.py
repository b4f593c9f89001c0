"""Run as if NIXL were not installed: with this directory first on PYTHONPATH, Python imports this file at
start-up, and NIXL's modules are then neither importable nor found (``importlib.util.find_spec`` is None)."""

import sys

for name in ("nixl_cu12", "nixl"):
    sys.modules[name] = None  # type: ignore[assignment]
