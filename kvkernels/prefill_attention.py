"""Paged prefill attention in Triton: packed new tokens over a cached paged prefix plus themselves.

Program ``(seq, kv_head, tile)`` owns ``BLOCK_M`` query *rows* of one
sequence, where row ``r`` is (new token ``r // GROUP``, query head
``kv_head * GROUP + r % GROUP``). Folding the GQA group into the rows means
each key tile is loaded once per KV head and serves every query head of it.

Two passes over keys, one online softmax:

1. the cached prefix, absolute positions ``[0, num_cached)``, read through the
   block table (INT8 dequantized in registers), visible to every row;
2. the new tokens from the packed ``k``/``v`` (always full precision), new
   token ``j`` visible to row token ``t`` iff ``j <= t`` (causal).

Every valid row sees key 0 in the first tile it processes, so the running max
is finite from then on and no NaN can appear.

Windows (``ring``, ``RING``): row ``t`` sees the sinks (positions below
``S``, scored with ``q_sink``) and positions ``t-W+1..t`` (scored with
``q``). The passes become: cached sinks, the cached part of the tile's windows
(through the ring of blocks), new tokens that are sinks, new tokens inside the
windows. A row may see nothing in a whole tile there, so those passes use
``tiles.attend_tile_guarded``. Without ``ring`` the kernel compiles exactly as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.attention_args import check_inputs, check_ring, ring_args, scale_args
from kvkernels.tiles import (
    LOG2E,
    attend_paged,
    attend_ring_paged,
    attend_tile,
    attend_tile_guarded,
    dot_precision,
    padded,
)

# head_dim (padded) -> (BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages). Not measured; chosen so
# that Triton 3.9 compiles every variant for sm_80 and sm_90 without register spills (kvserve.bench.kernel_compile).
_CONFIGS = {64: (64, 64, 4, 2), 128: (64, 64, 8, 2), 256: (32, 32, 4, 1)}
_DEFAULT_CONFIG = (32, 32, 4, 1)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    k_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM], the new tokens' keys
    v_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads] float32 (K_INT8 only)
    v_scale_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs], cached + new
    out_ptr,  # like q
    qk_scale,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_o_token,
    stride_o_head,
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
    stride_bt_seq,
    q_sink_ptr,  # like q, rotated at each query's position inside its cache (RING only)
    ring_ptr,  # [num_seqs, 4] int32: sinks, window, sink blocks, ring blocks (RING only)
    stride_qs_token,
    stride_qs_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RING: tl.constexpr,  # attend over sinks + window through a ring of blocks
):
    """One program ``(seq, kv_head, tile)``: ``BLOCK_M`` query rows over the cached prefix, then over the new
    tokens, causally (module docstring), and their output.

    One function over 60 lines on purpose: a third of it is the launch's argument list, and the passes are
    already calls of ``tiles``' helpers; cutting the ring's four passes into ``@triton.jit`` helpers of their
    own would hand each the same ~35 pointers, strides and row vectors, and read no better.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if first_row >= q_len * GROUP:
        return
    num_cached = tl.load(seq_lens_ptr + seq) - q_len

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    row_token = rows // GROUP  # index among the new tokens; >= q_len for padding rows
    q_heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row_mask = row_ok[:, None] & dim_ok[None, :]
    q_offsets = (q_start + row_token)[:, None] * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    last_token = tl.minimum(q_len - 1, (first_row + BLOCK_M - 1) // GROUP)  # the last new token these rows see
    if RING:
        num_sinks = tl.load(ring_ptr + seq * 4)
        window = tl.load(ring_ptr + seq * 4 + 1)
        sink_blocks = tl.load(ring_ptr + seq * 4 + 2)
        ring_blocks = tl.load(ring_ptr + seq * 4 + 3)
        qs_offsets = (q_start + row_token)[:, None] * stride_qs_token + q_heads[:, None] * stride_qs_head
        q_sink = tl.load(q_sink_ptr + qs_offsets + dims[None, :], mask=row_mask, other=0.0)
        table_row = block_tables_ptr + seq * stride_bt_seq
        first_token = first_row // GROUP
        # 1a) Cached sinks, seen by every row.
        m_i, l_i, acc = attend_ring_paged(
            q_sink, m_i, l_i, acc, 0, tl.minimum(num_sinks, num_cached), tl.zeros([BLOCK_M], tl.int32), table_row,
            sink_blocks, ring_blocks, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok,
            stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
            stride_ks_block, stride_ks_token, stride_ks_head, stride_vs_block, stride_vs_token, stride_vs_head,
            qk_scale, BLOCK_SIZE, BLOCK_N, K_INT8, V_INT8, DOT_PRECISION,
        )  # fmt: skip
        # 1b) The cached part of the windows: row t sees positions from t - W + 1.
        cached_start = tl.minimum(tl.maximum(num_sinks, num_cached + first_token - window + 1), num_cached)
        m_i, l_i, acc = attend_ring_paged(
            q, m_i, l_i, acc, cached_start, num_cached, num_cached + row_token - window + 1, table_row,
            sink_blocks, ring_blocks, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok,
            stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
            stride_ks_block, stride_ks_token, stride_ks_head, stride_vs_block, stride_vs_token, stride_vs_head,
            qk_scale, BLOCK_SIZE, BLOCK_N, K_INT8, V_INT8, DOT_PRECISION,
        )  # fmt: skip
        # 2a) New tokens that are sinks (new token j is at position num_cached + j), causally, with q_sink.
        new_sinks = tl.minimum(tl.maximum(num_sinks - num_cached, 0), last_token + 1)
        for tile_start in tl.range(0, new_sinks, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_ok = keys < new_sinks
            k, v = _load_new(k_ptr, v_ptr, q_start, keys, key_ok, kv_head, dims, dim_ok,
                             stride_k_token, stride_k_head, stride_v_token, stride_v_head)  # fmt: skip
            visible = key_ok[None, :] & (keys[None, :] <= row_token[:, None])
            m_i, l_i, acc = attend_tile_guarded(q_sink, k, v, 1.0, 1.0, visible, m_i, l_i, acc, qk_scale,
                                                False, False, DOT_PRECISION)  # fmt: skip
        # 2b) New tokens inside the windows, causally, with q.
        for tile_start in tl.range(tl.maximum(new_sinks, first_token - window + 1), last_token + 1, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_ok = keys < q_len
            k, v = _load_new(k_ptr, v_ptr, q_start, keys, key_ok, kv_head, dims, dim_ok,
                             stride_k_token, stride_k_head, stride_v_token, stride_v_head)  # fmt: skip
            visible = key_ok[None, :] & (keys[None, :] <= row_token[:, None])
            visible = visible & (keys[None, :] > row_token[:, None] - window) & (keys[None, :] >= new_sinks)
            m_i, l_i, acc = attend_tile_guarded(q, k, v, 1.0, 1.0, visible, m_i, l_i, acc, qk_scale,
                                                False, False, DOT_PRECISION)  # fmt: skip
    else:
        # 1) Cached prefix, seen by every row.
        m_i, l_i, acc = attend_paged(
            q, m_i, l_i, acc, 0, num_cached, block_tables_ptr + seq * stride_bt_seq,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok,
            stride_kc_block, stride_kc_token, stride_kc_head, stride_vc_block, stride_vc_token, stride_vc_head,
            stride_ks_block, stride_ks_token, stride_ks_head, stride_vs_block, stride_vs_token, stride_vs_head,
            qk_scale, BLOCK_SIZE, BLOCK_N, K_INT8, V_INT8, DOT_PRECISION,
        )  # fmt: skip

        # 2) The new tokens, causally; this tile's rows reach new token `last_token` at most.
        for tile_start in tl.range(0, last_token + 1, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_ok = keys < q_len
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k_offsets = (q_start + keys)[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :]
            v_offsets = (q_start + keys)[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :]
            k = tl.load(k_ptr + k_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + v_offsets, mask=kv_mask, other=0.0)
            visible = key_ok[None, :] & (keys[None, :] <= row_token[:, None])
            m_i, l_i, acc = attend_tile(
                q, k, v, 1.0, 1.0, visible, m_i, l_i, acc, qk_scale, False, False, DOT_PRECISION
            )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offsets = (q_start + row_token)[:, None] * stride_o_token + q_heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _load_new(k_ptr, v_ptr, q_start, keys, key_ok, kv_head, dims, dim_ok,
              stride_k_token, stride_k_head, stride_v_token, stride_v_head):  # fmt: skip
    """The packed new tokens' keys and values ``[N, HEAD_DIM_PAD]`` of one KV head (masked rows are 0)."""
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + (q_start + keys)[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                mask=kv_mask, other=0.0)  # fmt: skip
    v = tl.load(v_ptr + (q_start + keys)[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                mask=kv_mask, other=0.0)  # fmt: skip
    return k, v


def paged_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_sink: torch.Tensor | None = None,
    ring: torch.Tensor | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.paged_prefill_attention`` (``ring`` and ``q_sink``: windows).

    ``max_q_len`` (at least the most new tokens of any sequence) sizes the
    grid; without it the longest new-token count is read back to the host, one
    sync per call.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = seq_lens.shape[0]
    check_inputs(num_q_heads, num_kv_heads, (q, k, v, k_cache, v_cache, block_tables),
                 "q, k, v, the caches and block_tables")  # fmt: skip
    check_ring(q, q_sink, ring, num_seqs)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_dim_pad = padded(head_dim)
    block_m, block_n, num_warps, num_stages = _CONFIGS.get(head_dim_pad, _DEFAULT_CONFIG)
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    ks, vs, ks_strides, vs_strides = scale_args(k_cache, v_cache, k_scale, v_scale)

    grid = (num_seqs, num_kv_heads, triton.cdiv(max_q_len * group, block_m))
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *ks_strides, *vs_strides,
        block_tables.stride(0), *ring_args(q, q_sink, ring, seq_lens),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n,
        K_INT8=k_scale is not None, V_INT8=v_scale is not None, DOT_PRECISION=dot_precision(q.dtype),
        RING=ring is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
