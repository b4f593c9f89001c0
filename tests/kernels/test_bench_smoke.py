"""``kvserve.bench.kernels`` end to end on tiny shapes, so the one-shot GPU run cannot fail on host-side code.

On the CPU the kernels are interpreted, the timers are replaced by one call, and
the memory check always passes, and fp16 stands in for bf16; the printed table's
layout and the kernel-vs-SDPA difference are checked, not the timings.
"""

import pytest
import torch
from paged_kv_testing import DEVICE, HAS_CUDA, interpreted_triton, triton_ops  # noqa: F401

from kvserve.bench import kernel_inputs, kernel_sweep
from kvserve.bench import kernels as bench

LAYOUT = (4, 2, 64)  # query heads, kv heads, head_dim


@pytest.fixture
def tiny_bench(monkeypatch):
    if not HAS_CUDA:
        triton_ops()  # make sure the kernel modules are the interpreted ones
        monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
        monkeypatch.setattr(kernel_sweep, "_bench_graph", lambda fn: (fn(), 1.0)[1])
        monkeypatch.setattr(bench, "_fits", lambda num_bytes: True)
        monkeypatch.setattr(kernel_inputs, "DTYPE", torch.float16)
    monkeypatch.setattr(kernel_inputs, "DEVICE", str(DEVICE))
    # The shipped d64 configs, bf16 (128, 4, 3) and INT8 (64, 4, 3), and one more: 3 configs, not 12.
    monkeypatch.setattr(kernel_sweep, "SWEEP_GRID", ((32, 4, 2), (64, 4, 3), (128, 4, 3)))


def test_every_bench_section_runs(tiny_bench, capsys):
    bench.bench_decode(batches=(2,), contexts=(48,), layouts=(LAYOUT,))
    bench.bench_int8(batch=2, ctx=48, layouts=(LAYOUT,))
    bench.bench_store(num_tokens=64, num_kv_heads=2, head_dim=64)
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("  4:2      64     2    48"))
    assert float(row.split()[-1]) < 0.01  # max |ours - SDPA| over the same data
    assert "int8_v" in printed and "store int8" in printed


def test_sweep_of_each_cache_prints_ratios_and_table_entries(tiny_bench, capsys):
    results = [kernel_sweep.bench_sweep(kv_dtype, 2, 48, *LAYOUT) for kv_dtype in ("auto", "int8_v", "int8")]
    kernel_sweep.print_int8_ratios(results)
    kernel_sweep.print_table_entries(results, "Some GPU")
    printed = capsys.readouterr().out
    assert printed.count("shipped config at the heuristic's splits:") == 3
    assert "int8_v vs bf16, batch 2, ctx 48" in printed and "(target 1.4x)" in printed
    lines = printed.splitlines()
    start = lines.index('    "Some GPU": {')
    end = lines.index("    },", start)
    entries = eval("{" + "\n".join(lines[start + 1 : end]) + "}")  # the printed entries are valid Python
    assert set(entries) == {(64, "auto"), (64, "int8_v"), (64, "int8")}
    assert all(config in kernel_sweep.SWEEP_GRID for config in entries.values())


def test_measured_configs_apply_to_their_gpu_only(monkeypatch):
    triton_ops()
    from kvkernels import decode_config

    h200 = torch.device("cuda", 0)
    monkeypatch.setattr(decode_config, "gpu_keys", lambda device: ("NVIDIA H200", "sm_90") if device else ())
    assert decode_config.default_tile_config(128, "auto", h200) == (64, 4, 2)  # measured
    assert decode_config.default_tile_config(128, "int8_v", h200) == (128, 4, 3)  # measured (2026-12-04)
    assert decode_config.default_tile_config(256, "auto", h200) == (32, 4, 3)  # not measured: fallback
    assert decode_config.default_tile_config(128, "auto", None) == (64, 4, 3)  # fallback off-GPU
    assert decode_config.default_tile_config(96, "auto", h200) == (64, 4, 2)  # d96 runs as padded d128


def test_sweep_only_command_line(tiny_bench, monkeypatch, capsys):
    """``python -m kvserve.bench.kernels --sweep-only``, the GPU check's command, with a tiny shape per cache."""
    shapes = tuple((kv_dtype, 2, 48, *LAYOUT) for kv_dtype in ("auto", "int8"))
    monkeypatch.setattr(kernel_sweep, "SWEEP_SHAPES", shapes)
    if not HAS_CUDA:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "Some GPU")
    assert bench.main(["--sweep-only"]) == 0
    printed = capsys.readouterr().out
    assert "int8 vs bf16, batch 2, ctx 48" in printed
    assert '        (64, "int8"): (' in printed
    assert "paged decode attention" not in printed  # the tables are not run
