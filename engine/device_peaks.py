"""What the device can do at best: its memory bandwidth and its compute, the denominators of a step's diagnosis
(``engine.step_diagnosis``).

* A GPU: ``GPU_PEAKS``, HBM/GDDR bandwidth and dense (no 2:4 sparsity) 16-bit tensor-core FLOP/s from the
  vendor's public datasheets, looked up by ``torch.cuda.get_device_name``; its copy bandwidth is measured too (a
  256 MiB device-to-device copy: bytes read + bytes written over the time), logged beside the table's figure and
  used in its place for a GPU the table lacks. Its compute is measured by a GEMM probe when the table lacks it or
  the model runs in float32 (the table's figures are 16-bit).
* The CPU: measured, by a copy probe (a 128 MiB tensor copied; bytes read + written over the best time of three)
  and a GEMM probe (square, of the model's hidden size and at least 512, in the model's dtype, on the process's
  threads): about 0.2 s together, once per process and shape (``device_peaks`` caches them).

The engine options ``peak_memory_bandwidth_gbs`` and ``peak_tflops`` override the table and the probes (their
probe is then skipped).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig

log = logging.getLogger(__name__)

# (name pattern, memory bandwidth GB/s, dense BF16/FP16 tensor TFLOP/s), most specific first; matched against
# torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S").
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    (r"\bB200\b", 8000, 2250),
    (r"\bH200\b.*\bNVL\b", 4800, 835),
    (r"\bH200\b", 4800, 989),  # SXM
    (r"\bH100\b.*\bNVL\b", 3900, 835),
    (r"\bH100\b.*\bPCIe\b", 2000, 756),
    (r"\bH100\b", 3350, 989),  # SXM
    (r"\bA100\b.*80GB.*\bPCIe\b", 1935, 312),
    (r"\bA100\b.*80GB", 2039, 312),  # SXM
    (r"\bA100\b", 1555, 312),  # 40 GB, SXM or PCIe
    (r"\bL40S\b", 864, 362),
    (r"\bL40\b", 864, 181),
    (r"\bL4\b", 300, 121),
    (r"\bA10G\b", 600, 70),  # AWS's variant of the A10: fewer tensor FLOPs, the same memory
    (r"\bA10\b", 600, 125),
)

_CPU_COPY_BYTES = 128 << 20
_GPU_COPY_BYTES = 256 << 20
_MIN_GEMM = 512
_GPU_GEMM = 4096


@dataclass(frozen=True)
class DevicePeaks:
    """``memory_bandwidth`` (bytes/s) and ``flops`` (FLOP/s): the peaks a step is measured against;
    ``copy_bandwidth``: the measured copy's bytes/s (None when a flag made the probe needless); ``source``: where
    each peak came from, for the log."""

    memory_bandwidth: float
    flops: float
    copy_bandwidth: float | None
    source: str

    def describe(self) -> str:
        copy = "" if self.copy_bandwidth is None else f", measured copy {self.copy_bandwidth / 1e9:.1f} GB/s"
        return (f"peaks: memory bandwidth {self.memory_bandwidth / 1e9:.1f} GB/s, compute "
                f"{self.flops / 1e12:.3f} TFLOP/s ({self.source}{copy})")  # fmt: skip


def gpu_table_peaks(name: str) -> tuple[float, float] | None:
    """(bytes/s, FLOP/s) of ``GPU_PEAKS``' first row whose pattern ``name`` matches; None for an unknown GPU."""
    for pattern, gbs, tflops in GPU_PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return gbs * 1e9, tflops * 1e12
    return None


def device_peaks(device: torch.device, dtype: torch.dtype, hidden_size: int,
                 bandwidth_gbs: float | None = None, tflops: float | None = None) -> DevicePeaks:  # fmt: skip
    """The peaks of ``device`` for a model of ``hidden_size`` in ``dtype``; flags (GB/s, TFLOP/s) override."""
    return _peaks(str(device), dtype, max(hidden_size, _MIN_GEMM), torch.get_num_threads(), bandwidth_gbs, tflops)


def engine_peaks(config: EngineConfig, model_config: ModelConfig) -> DevicePeaks | None:
    """The peaks of an engine's device (``device_peaks``), or None when its ``step_diagnosis`` is off."""
    if not config.step_diagnosis:
        return None
    device = config.torch_device()
    return device_peaks(device, config.torch_dtype(device), model_config.hidden_size,
                        config.peak_memory_bandwidth_gbs, config.peak_tflops)  # fmt: skip


@functools.lru_cache(maxsize=8)
def _peaks(device_name: str, dtype: torch.dtype, gemm_size: int, threads: int, bandwidth_gbs: float | None,
           tflops: float | None) -> DevicePeaks:  # fmt: skip
    device = torch.device(device_name)
    table, sources = None, []
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = gpu_table_peaks(name)
        if dtype == torch.float32 and table is not None:  # the table's compute is 16-bit: measure float32's
            table = (table[0], None)
        copy = _copy_bandwidth(device, _GPU_COPY_BYTES)
    else:
        name = f"CPU, {threads} threads"
        copy = None if bandwidth_gbs is not None else _copy_bandwidth(device, _CPU_COPY_BYTES)
    if bandwidth_gbs is not None:
        bandwidth, sources = bandwidth_gbs * 1e9, ["bandwidth: --peak-memory-bandwidth-gbs"]
    elif table is not None:
        bandwidth, sources = table[0], [f"bandwidth: table ({name})"]
    else:
        bandwidth, sources = copy, [f"bandwidth: copy probe ({name})"]
    if tflops is not None:
        flops = tflops * 1e12
        sources.append("compute: --peak-tflops")
    elif table is not None and table[1] is not None:
        flops = table[1]
        sources.append(f"compute: table ({name})")
    else:
        size = _GPU_GEMM if device.type == "cuda" else gemm_size
        flops = _gemm_flops(device, dtype, size)
        sources.append(f"compute: {size}x{size} {str(dtype).removeprefix('torch.')} GEMM probe ({name})")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probes' buffers: the KV pool is sized from the memory free after them
    peaks = DevicePeaks(bandwidth, flops, copy, "; ".join(sources))
    log.info("%s", peaks.describe())
    return peaks


def _copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by the best of three copies of ``nbytes`` (after an untimed one that
    faults the pages in)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(device, lambda: dst.copy_(src)) for _ in range(3))
    return 2 * nbytes / best


def _gemm_flops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """FLOP/s of a ``size`` x ``size`` x ``size`` GEMM in ``dtype``: the best of five after a warm-up."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)
    best = min(_timed(device, lambda: torch.mm(a, b)) for _ in range(5))
    return 2 * size**3 / best


def _timed(device: torch.device, run) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    run()
    return time.perf_counter() - began
