"""``kernels.bench`` end to end on tiny shapes, so the one-shot GPU run cannot fail on host-side code.

On the CPU the kernels are interpreted, the timer is replaced by one call, and
the memory check always passes, and fp16 stands in for bf16; the printed table's
layout and the kernel-vs-SDPA difference are checked, not the timings.
"""

import pytest
import torch
from paged_kv_testing import DEVICE, HAS_CUDA, interpreted_triton, triton_ops  # noqa: F401

from kernels import bench


@pytest.fixture
def tiny_bench(monkeypatch):
    if not HAS_CUDA:
        triton_ops()  # make sure the kernel modules are the interpreted ones
        monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
        monkeypatch.setattr(bench, "_fits", lambda num_bytes: True)
        monkeypatch.setattr(bench, "DTYPE", torch.float16)
    monkeypatch.setattr(bench, "DEVICE", str(DEVICE))


def test_every_bench_section_runs(tiny_bench, capsys):
    layouts = ((4, 2, 64),)
    bench.bench_decode(batches=(2,), contexts=(48,), layouts=layouts)
    bench.bench_int8(batch=2, ctx=48, layouts=layouts)
    bench.bench_store(num_tokens=64, num_kv_heads=2, head_dim=64)
    bench.bench_sweep(batch=2, ctx=48, num_q_heads=4, num_kv_heads=2, head_dim=64)
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("  4:2      64     2    48"))
    assert float(row.split()[-1]) < 0.01  # max |ours - SDPA| over the same data
    assert "int8_v" in printed and "store int8" in printed
    assert "shipped config:" in printed and "rank" in printed
