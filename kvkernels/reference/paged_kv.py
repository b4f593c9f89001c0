"""The paged KV pool as the references read and write it: INT8 quantization, storing new tokens into their
slots, and gathering a sequence's tokens back through its block table (or its ring of blocks). Layouts: the
package's docstring."""

from __future__ import annotations

import torch

INT8_MAX = 127.0
UNBOUNDED = 1 << 30  # a window or a ring that never ends
RING_SINKS, RING_WINDOW, RING_SINK_BLOCKS, RING_BLOCKS = range(4)  # the columns of ``ring``
FULL_RING_ROW = (0, UNBOUNDED, 0, UNBOUNDED)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) INT8: ``x [T, H, D]`` -> (int8 values, float32 scales ``[T, H]``)."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX
    q = torch.round(x.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequant(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale[..., None]).to(dtype)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    num_blocks, block_size = k_cache.shape[:2]
    for new, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, *cache.shape[2:])
        if scale is None:
            flat.index_copy_(0, slots, new.to(cache.dtype))
        else:
            q, s = quantize_int8(new)
            flat.index_copy_(0, slots, q)
            scale.view(num_blocks * block_size, -1).index_copy_(0, slots, s)


def gather(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, length: int, dtype: torch.dtype):
    """The first ``length`` tokens held in ``blocks``: ``[length, num_kv_heads, head_dim]``."""
    return gather_batch(cache, scale, blocks[None], length, dtype)[0]


def gather_batch(cache, scale, blocks, length, dtype):
    """The first ``length`` tokens held in each row of ``blocks (seqs, n)``: ``[seqs, length, kv_heads, dim]``."""
    num_seqs = blocks.shape[0]
    flat = blocks.reshape(-1)  # index_select copies whole blocks, several times faster than advanced indexing
    values = cache.index_select(0, flat).reshape(num_seqs, -1, *cache.shape[2:])[:, :length]
    token_scale = None
    if scale is not None:
        token_scale = scale.index_select(0, flat).reshape(num_seqs, -1, scale.shape[-1])[:, :length]
    return dequant(values, token_scale, dtype)


def gather_positions(cache, scale, table_row, positions, sink_blocks, ring_blocks, dtype) -> torch.Tensor:
    """Tokens at logical ``positions (n,)`` of one sequence whose blocks form a ring: ``[n, kv_heads, dim]``.

    The ring's block layout is ``kvstore.ring``'s; it is spelled out here (and in ``tiles.ring_paged_slots``)
    because the kernels sit below ``kvstore`` and cannot import it."""
    block_size = cache.shape[1]
    positions = positions.to(cache.device)
    logical = positions // block_size
    columns = torch.where(logical < sink_blocks, logical, sink_blocks + (logical - sink_blocks) % ring_blocks)
    slots = table_row.to(cache.device)[columns].long() * block_size + positions % block_size
    values = cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    token_scale = None if scale is None else scale.view(-1, scale.shape[-1]).index_select(0, slots)
    return dequant(values, token_scale, dtype)
