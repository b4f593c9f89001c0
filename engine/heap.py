"""What a long-running process does to its heaps once started: ``freeze_startup_heap`` (a worker, a
tensor-parallel rank, the router), so that Python's full garbage collections stop stalling it, and
``keep_freed_memory`` (a process that runs an engine), so that each step stops faulting its activations back in.

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
import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes on 64 bits; larger blocks are mapped and unmapped as before
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze every object still alive; returns how many are frozen.
    They are unfrozen at exit, so that the interpreter's shutdown frees them as usual (nanobind's extensions,
    xgrammar's, report each object still alive then as a leak)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


def keep_freed_memory() -> bool:
    """Keep the memory of freed blocks up to ``MMAP_THRESHOLD`` in the process's heap instead of handing it back
    to the kernel (glibc's ``mallopt``); returns whether this C library took it (False elsewhere: nothing
    changes).

    A step's activations are blocks of 0.1 to 30 MB, allocated and freed every step. glibc maps such a block
    afresh (past a threshold it moves as blocks are freed) or returns the top of its heap to the kernel once
    that exceeds twice the threshold, so a step after steps of another shape touches fresh pages: one minor
    page fault per 4 KiB, each zeroed by the kernel. Measured in one process on the bundled model, a 128-token
    prompt prefilled while four lower-priority decodes sat out (``engine.priorities``) took 10,788 page faults
    and 235 ms, against 2,464 and 175 ms prefilled alone; with this, 1,440 faults either way (its KV pages) and
    186 against 183 ms. The process keeps the most its steps ever held at once (what they need again at the
    next such step); blocks over ``MMAP_THRESHOLD`` come and go as before."""
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt if path else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    if not applied:
        log.warning("the C library refused glibc's mallopt settings: freed activations go back to the kernel")
    return applied
