"""Triton building blocks shared by the attention kernels: paged-row addressing and one online-softmax step.

Only ``@triton.jit`` helpers live here; the kernels that call them are in
``decode_attention.py`` and ``prefill_attention.py``. Every helper works on a
*tile* of ``N`` key tokens against ``M`` query rows, in registers.

Scores are kept in the log2 domain: the caller folds ``log2(e)`` into
``qk_scale`` so that the softmax uses ``exp2`` (one instruction on the GPU).
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def paged_slots(block_table_row, tokens, token_ok, BLOCK_SIZE: tl.constexpr):
    """Physical ``(block id int64 [N], offset in block [N])`` of logical ``tokens [N]`` of one sequence.

    Masked tokens map to block 0, offset ``token % BLOCK_SIZE``: a valid address
    that is never used because every later load is masked by ``token_ok`` too.
    """
    blocks = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
    return blocks, tokens % BLOCK_SIZE


@triton.jit
def load_paged_rows(
    cache_ptr,
    scale_ptr,
    blocks,
    offsets,
    token_ok,
    kv_head,
    dims,
    dim_ok,
    stride_block,
    stride_token,
    stride_head,
    scale_stride_block,
    scale_stride_token,
    scale_stride_head,
    IS_INT8: tl.constexpr,
):
    """Rows ``[N, D]`` of one KV head from a paged cache, in the cache's dtype, and their scales.

    The scales ``[N]`` (float32) are only loaded when ``IS_INT8``; otherwise a
    scalar placeholder is returned and never used.
    """
    rows = blocks * stride_block + offsets * stride_token + kv_head * stride_head  # [N] int64
    values = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=token_ok[:, None] & dim_ok[None, :], other=0)
    if IS_INT8:
        scale_rows = blocks * scale_stride_block + offsets * scale_stride_token + kv_head * scale_stride_head
        scales = tl.load(scale_ptr + scale_rows, mask=token_ok, other=0.0)
    else:
        scales = 1.0
    return values, scales


@triton.jit
def attend_tile(
    q,
    k,
    v,
    k_scales,
    v_scales,
    visible,
    m_i,
    l_i,
    acc,
    qk_scale,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One flash-attention step: fold the key tile ``k, v [N, D]`` into the running ``(m_i, l_i, acc)``.

    Shapes: ``q [M, D]``, ``visible [M, N]`` (bool), ``m_i, l_i [M]``, ``acc [M, D]``
    (all float32 except ``q``, ``k``, ``v``). INT8 tiles stay integer-valued in the
    model dtype (exact for |x| <= 127) and their per-token scales are applied on
    the ``[M, N]`` side: to the scores for K, to the probabilities for V.

    Invariant required by the caller: every row has at least one visible key
    in this tile or in an earlier one, so ``m_new`` is finite and no NaN appears.
    ``l_i`` sums the unscaled probabilities; ``acc`` is not normalized.
    """
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # [M, N] float32
    if K_INT8:
        scores = scores * k_scales[None, :]
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_INT8:
        p = p * v_scales[None, :]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_paged(
    q,
    m_i,
    l_i,
    acc,
    start,
    end,
    block_table_row,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,
    dims,
    dim_ok,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_ks_block,
    stride_ks_token,
    stride_ks_head,
    stride_vs_block,
    stride_vs_token,
    stride_vs_head,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one sequence's paged keys ``start..end-1`` of KV head ``kv_head`` into ``(m_i, l_i, acc)``.

    Every query row of ``q [M, D]`` sees every one of these keys (decode, and a
    prefill's cached prefix). Walks tiles of ``BLOCK_N`` tokens; each tile starts
    below ``end``, so it holds at least one visible key (``attend_tile``'s invariant).
    """
    for tile_start in tl.range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_ok = tokens < end
        blocks, offsets = paged_slots(block_table_row, tokens, token_ok, BLOCK_SIZE)
        k, k_scales = load_paged_rows(
            k_cache_ptr, k_scale_ptr, blocks, offsets, token_ok, kv_head, dims, dim_ok,
            stride_k_block, stride_k_token, stride_k_head,
            stride_ks_block, stride_ks_token, stride_ks_head, K_INT8,
        )  # fmt: skip
        v, v_scales = load_paged_rows(
            v_cache_ptr, v_scale_ptr, blocks, offsets, token_ok, kv_head, dims, dim_ok,
            stride_v_block, stride_v_token, stride_v_head,
            stride_vs_block, stride_vs_token, stride_vs_head, V_INT8,
        )  # fmt: skip
        m_i, l_i, acc = attend_tile(
            q, k, v, k_scales, v_scales, token_ok[None, :], m_i, l_i, acc, qk_scale, K_INT8, V_INT8, DOT_PRECISION
        )
    return m_i, l_i, acc


@triton.jit
def ring_paged_slots(block_table_row, tokens, token_ok, sink_blocks, ring_blocks, BLOCK_SIZE: tl.constexpr):
    """``paged_slots`` of a sequence whose blocks past its ``sink_blocks`` form a ring of ``ring_blocks``:
    logical block ``j >= sink_blocks`` is table column ``sink_blocks + (j - sink_blocks) % ring_blocks``."""
    logical = tokens // BLOCK_SIZE
    columns = tl.where(logical < sink_blocks, logical, sink_blocks + (logical - sink_blocks) % ring_blocks)
    blocks = tl.load(block_table_row + columns, mask=token_ok, other=0).to(tl.int64)
    return blocks, tokens % BLOCK_SIZE


@triton.jit
def attend_tile_guarded(
    q,
    k,
    v,
    k_scales,
    v_scales,
    visible,
    m_i,
    l_i,
    acc,
    qk_scale,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``attend_tile`` for windows, where a row may see no key in this tile nor before it: such a row keeps
    ``m_i = -inf``, ``l_i = 0`` and a zero ``acc`` instead of turning NaN."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)  # [M, N] float32
    if K_INT8:
        scores = scores * k_scales[None, :]
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: every exp2 below is of -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_INT8:
        p = p * v_scales[None, :]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_ring_paged(
    q,
    m_i,
    l_i,
    acc,
    start,
    end,
    first_visible,
    block_table_row,
    sink_blocks,
    ring_blocks,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,
    dims,
    dim_ok,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_ks_block,
    stride_ks_token,
    stride_ks_head,
    stride_vs_block,
    stride_vs_token,
    stride_vs_head,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``attend_paged`` over a ring (``ring_paged_slots``): row ``r`` of ``q [M, D]`` sees the keys
    ``start..end-1`` at or after ``first_visible[r]`` (its window's first position; 0: all of them)."""
    for tile_start in tl.range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_ok = tokens < end
        blocks, offsets = ring_paged_slots(block_table_row, tokens, token_ok, sink_blocks, ring_blocks, BLOCK_SIZE)
        k, k_scales = load_paged_rows(
            k_cache_ptr, k_scale_ptr, blocks, offsets, token_ok, kv_head, dims, dim_ok,
            stride_k_block, stride_k_token, stride_k_head,
            stride_ks_block, stride_ks_token, stride_ks_head, K_INT8,
        )  # fmt: skip
        v, v_scales = load_paged_rows(
            v_cache_ptr, v_scale_ptr, blocks, offsets, token_ok, kv_head, dims, dim_ok,
            stride_v_block, stride_v_token, stride_v_head,
            stride_vs_block, stride_vs_token, stride_vs_head, V_INT8,
        )  # fmt: skip
        visible = token_ok[None, :] & (tokens[None, :] >= first_visible[:, None])
        m_i, l_i, acc = attend_tile_guarded(
            q, k, v, k_scales, v_scales, visible, m_i, l_i, acc, qk_scale, K_INT8, V_INT8, DOT_PRECISION
        )
    return m_i, l_i, acc


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32 tensors (tests), tensor-core default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def padded(n: int, minimum: int = 16) -> int:
    """The power of two ``>= n`` and ``>= minimum`` (``tl.dot`` needs every dimension >= 16)."""
    return max(minimum, triton.next_power_of_2(n))
