"""How paged decode attention cuts its work (``decode_attention``): the tile config per head dim, KV cache
dtype and GPU (measured where a sweep has run, else a fallback), and how many splits fill the GPU."""

from __future__ import annotations

import functools

import torch
import triton

from kvkernels.tiles import padded

# Tile configs: (tokens per tile, num_warps, num_stages), keyed by (head_dim padded, KV cache dtype), where the
# KV cache dtype is the engine's name for it: "auto" (the model's 16-bit dtype), "int8_v" or "int8".
#
# Measured: per GPU (``torch.cuda.get_device_name()``, or "sm_XY" for a whole architecture), the fastest
# config of a ``python -m kvserve.bench.kernels --sweep`` on that GPU, which prints these entries ready to paste.
_MEASURED_CONFIGS: dict[str, dict[tuple[int, str], tuple[int, int, int]]] = {
    "NVIDIA H200": {
        # 2026-11-30, batch 64, ctx 2048, 32:8: 138.8 us = 3.87 TB/s, against 180.5 us for (64, 4, 3).
        # 2026-12-04 (kvserve.bench.kernels --sweep-only, CUDA-graph replay): ctx 8192 483.1 us = 4.45 TB/s and
        # ctx 2048 126.3 us = 4.25 TB/s, the best of 12 at both.
        (128, "auto"): (64, 4, 2),
        # 2026-12-04, batch 64, ctx 8192, 32:8: 585.6 us, against 886.4 us for the fallback (32, 4, 3).
        (128, "int8_v"): (128, 4, 3),
        # 2026-12-04, batch 64, ctx 8192, 32:8: 515.0 us, against 873.6 us for the fallback (32, 4, 3).
        (128, "int8"): (128, 4, 3),
        # 2026-12-04, batch 64, ctx 2048, 14:2: 23.8 us = 2.82 TB/s, the fallback's config and the best of 12.
        (64, "auto"): (128, 4, 3),
    },
}
# Not measured: chosen from what Triton 3.9 generates for sm_90 (no spills, cp.async loads, registers low
# enough for 3+ programs per SM); used wherever the table above has no entry. Triton keeps one shared-memory
# buffer per K/V tile here (the block-table load makes the K/V loads indirect), so load latency is hidden by
# several resident programs per SM rather than by deep pipelining: a 16-bit tile pair is 32 KiB and uses ~96
# registers per thread at 4 warps. INT8 tiles upcast in registers, which costs more of them, hence the
# shorter tiles.
_FALLBACK_CONFIGS = {
    (64, "auto"): (128, 4, 3),
    (128, "auto"): (64, 4, 3),
    (256, "auto"): (32, 4, 3),
    (64, "int8_v"): (64, 4, 3),
    (64, "int8"): (64, 4, 3),
    (128, "int8_v"): (32, 4, 3),
    (128, "int8"): (32, 4, 3),
}
_DEFAULT_CONFIG = (32, 4, 2)
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 4  # enough loads in flight per SM; ~5 such programs fit on an SM (registers, smem)


def kv_cache_dtype(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str:
    """The engine's name of a cache layout from which of K and V carry INT8 scales."""
    return "int8" if k_scale is not None else "int8_v" if v_scale is not None else "auto"


@functools.cache
def gpu_keys(device: torch.device | None) -> tuple[str, ...]:
    """The keys of ``_MEASURED_CONFIGS`` that may describe ``device``, most specific first (none off-GPU)."""
    if device is None or device.type != "cuda":
        return ()
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"sm_{major}{minor}"


def default_tile_config(
    head_dim: int, kv_dtype: str = "auto", device: torch.device | None = None
) -> tuple[int, int, int]:
    """(tokens per tile, num_warps, num_stages) for a head dim and KV cache dtype on ``device``: the measured
    entry for that GPU when there is one, else the unmeasured fallback."""
    key = (padded(head_dim), kv_dtype)
    for gpu in gpu_keys(device):
        if key in _MEASURED_CONFIGS.get(gpu, {}):
            return _MEASURED_CONFIGS[gpu][key]
    return _FALLBACK_CONFIGS.get(key, _DEFAULT_CONFIG)


@functools.cache
def count_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; 1 off-GPU, where the interpreter runs programs one by one."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_tokens: int, num_sms: int) -> int:
    """Splits per sequence so that ``num_seqs * num_kv_heads * splits`` programs fill the GPU in one wave.

    Aims at ``_PROGRAMS_PER_SM`` programs per SM without exceeding it (rounding
    down), because a partial second wave would leave most SMs idle at the end.
    Never more splits than tiles in the longest sequence (each split should get
    work) and never more than ``_MAX_SPLITS`` (bounds the reduction's tile).
    """
    wanted = _PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, tile_tokens), _MAX_SPLITS))
