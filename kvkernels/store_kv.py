"""Triton KV store: scatter new tokens' K and V into their cache slots, quantizing to INT8 when asked.

The work is a list of *rows*, one per (token, KV head), each ``head_dim``
values long; a program moves ``BLOCK_ROWS`` of them for K and for V. A token
whose slot is ``-1`` is skipped (padding in a batch). INT8 rows get one
float32 scale each, computed exactly as ``reference.quantize_int8`` does:
``scale = max(absmax, 1e-8) / 127``, ``q = round_half_even(x / scale)`` with
correctly rounded divisions, so the interpreter and the reference agree bit
for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.tiles import padded


@triton.jit
def _round_half_even(x):
    """``torch.round`` for float32 values of magnitude < 2**31, built from exact operations only."""
    whole = x.to(tl.int32)  # truncates toward zero
    frac = x - whole.to(tl.float32)  # exact
    distance = tl.abs(frac)
    away = (distance > 0.5) | ((distance == 0.5) & ((whole & 1) != 0))
    return whole + tl.where(away, tl.where(x < 0, -1, 1), 0)


@triton.jit
def _store_rows(
    src_ptr,
    src_rows,  # [BLOCK_ROWS] element offsets of each row in src
    cache_ptr,
    cache_rows,  # [BLOCK_ROWS] element offsets of each row's slot in the cache
    scale_ptr,
    scale_rows,  # [BLOCK_ROWS] offsets into the scales (QUANTIZE only)
    keep,  # [BLOCK_ROWS] bool
    dims,
    dim_ok,
    QUANTIZE: tl.constexpr,
):
    mask = keep[:, None] & dim_ok[None, :]
    x = tl.load(src_ptr + src_rows[:, None] + dims[None, :], mask=mask, other=0.0)  # [BLOCK_ROWS, HEAD_DIM_PAD]
    if QUANTIZE:
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-8), 127.0)  # [BLOCK_ROWS]
        quantized = _round_half_even(tl.math.div_rn(x, scale[:, None]))
        quantized = tl.minimum(tl.maximum(quantized, -127), 127).to(tl.int8)
        tl.store(cache_ptr + cache_rows[:, None] + dims[None, :], quantized, mask=mask)
        tl.store(scale_ptr + scale_rows, scale, mask=keep)
    else:
        tl.store(cache_ptr + cache_rows[:, None] + dims[None, :], x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    v_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS] float32 (K_INT8 only)
    v_scale_ptr,
    slot_mapping_ptr,  # [num_tokens], -1 = skip
    num_rows,  # num_tokens * NUM_KV_HEADS
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    stride_ks_block,
    stride_ks_token,
    stride_ks_head,
    stride_vs_block,
    stride_vs_token,
    stride_vs_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    tokens = rows // NUM_KV_HEADS
    heads = rows % NUM_KV_HEADS
    slots = tl.load(slot_mapping_ptr + tokens, mask=row_ok, other=-1).to(tl.int64)
    keep = row_ok & (slots >= 0)
    blocks = tl.where(keep, slots, 0) // BLOCK_SIZE
    offsets = tl.where(keep, slots, 0) % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    _store_rows(
        k_ptr, tokens * stride_k_token + heads * stride_k_head,
        k_cache_ptr, blocks * stride_kc_block + offsets * stride_kc_token + heads * stride_kc_head,
        k_scale_ptr, blocks * stride_ks_block + offsets * stride_ks_token + heads * stride_ks_head,
        keep, dims, dim_ok, K_INT8,
    )  # fmt: skip
    _store_rows(
        v_ptr, tokens * stride_v_token + heads * stride_v_head,
        v_cache_ptr, blocks * stride_vc_block + offsets * stride_vc_token + heads * stride_vc_head,
        v_scale_ptr, blocks * stride_vs_block + offsets * stride_vs_token + heads * stride_vs_head,
        keep, dims, dim_ok, V_INT8,
    )  # fmt: skip


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
    """Triton twin of ``reference.store_kvcache``: writes in place, returns nothing."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches need a contiguous last dimension")
    if num_tokens == 0:
        return
    head_dim_pad = padded(head_dim, minimum=1)
    block_rows = max(1, 4096 // head_dim_pad)  # ~4096 elements of K (and of V) per program
    num_rows = num_tokens * num_kv_heads
    ks = k_scale if k_scale is not None else k_cache  # placeholders keep the argument list fixed
    vs = v_scale if v_scale is not None else v_cache
    ks_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    vs_strides = v_scale.stride() if v_scale is not None else (0, 0, 0)
    _store_kvcache_kernel[(triton.cdiv(num_rows, block_rows),)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping, num_rows,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *ks_strides, *vs_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_ROWS=block_rows, K_INT8=k_scale is not None, V_INT8=v_scale is not None,
        num_warps=4,
    )  # fmt: skip
