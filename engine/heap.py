"""``freeze_startup_heap``: what a long-running process (a worker, a tensor-parallel rank, the router) does once
started, so that Python's full garbage collections stop stalling it.

A worker's heap after start-up is about a million objects (torch, transformers, the model's modules, RPC),
all kept for the process's life. Python's collection of its oldest generation walks every one of them: 116-124
ms on the bundled model's decode worker here, with the GIL held, so an engine step, a stream's relay or a
router's dispatch stalls that long whenever one runs (once the objects that survived since the last one reach a
quarter of the old generation). ``gc.freeze()`` moves what start-up made into a permanent generation the
collector never walks: a later full collection walks only what serving made since (0.0 ms after the freeze,
the same process). vLLM's engine core freezes its heap after loading the model for the same reason.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze every object still alive; returns how many are frozen.
    They are unfrozen at exit, so that the interpreter's shutdown frees them as usual (nanobind's extensions,
    xgrammar's, report each object still alive then as a leak)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
