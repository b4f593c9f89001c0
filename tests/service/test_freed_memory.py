"""``engine.heap.keep_freed_memory``: blocks a step frees stay in the process's heap, and the next step's blocks
of the same sizes reuse them without a page fault. Counted by the kernel (``ru_minflt``) in fresh processes,
since glibc's thresholds move with a process's history: one that never called it faults every page again."""

from __future__ import annotations

import subprocess
import sys

from engine import heap

# A step's pattern: one large block freed (glibc then serves blocks of that size from its heap, and returns the
# heap's top to the kernel past twice it), then steps of three smaller blocks, each written and freed.
_STEPS = """
import ctypes, ctypes.util, importlib.util, resource, sys
if sys.argv[1] == "keep":  # (the module alone: the engine package would import torch, seconds of this test)
    spec = importlib.util.spec_from_file_location("heap", sys.argv[2])
    heap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heap)
    assert heap.keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def step(sizes):
    blocks = [libc.malloc(n) for n in sizes]
    for block, n in zip(blocks, sizes):
        libc.memset(block, 1, n)
    for block in blocks:
        libc.free(block)
step([20 << 20])
step([15 << 20] * 3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step([15 << 20] * 3)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    command = [sys.executable, "-c", _STEPS, mode, heap.__file__]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_steps_reuse_freed_blocks_without_page_faults():
    pages = 3 * 3 * (15 << 20) // 4096  # what the three later steps write
    assert _faults("plain") > pages // 2  # (glibc's defaults: the heap's top went back to the kernel each step)
    assert _faults("keep") < pages // 100
