"""What the kernel benchmarks (``kvserve.bench.kernels``, ``kernel_sweep``) run on: random K/V laid out as the
engine's pool, behind a shuffled block table, on ``DEVICE`` in ``DTYPE``."""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
DEVICE = "cuda"
DTYPE = torch.bfloat16  # the smoke test swaps in float16 (the CPU interpreter gets bf16 tl.dot wrong)


def paged_copy(k: torch.Tensor, v: torch.Tensor, generator: torch.Generator):
    """Contiguous ``k, v [batch, kv_heads, ctx, d]`` -> paged caches behind a shuffled block table."""
    batch, num_kv_heads, ctx, head_dim = k.shape
    blocks_per_seq = ctx // BLOCK_SIZE
    order = torch.randperm(batch * blocks_per_seq, generator=generator).to(k.device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    caches = []
    for contiguous in (k, v):
        # [batch, heads, ctx, d] -> [batch * blocks, block_size, heads, d], scattered to the shuffled blocks.
        pages = contiguous.permute(0, 2, 1, 3).reshape(batch * blocks_per_seq, BLOCK_SIZE, num_kv_heads, head_dim)
        cache = torch.empty(pages.shape, dtype=pages.dtype, device=pages.device)  # contiguous, like the pool
        cache[order] = pages
        caches.append(cache)
    return caches[0], caches[1], block_tables


def quantize_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache as INT8 values ``[blocks, block_size, heads, d]`` and per-token, per-head scales."""
    from kvkernels.reference import quantize_int8

    values, scales = quantize_int8(cache.flatten(0, 1))
    return values.view(cache.shape), scales.view(cache.shape[:3])
