"""Paged decode attention in Triton: split-K (flash-decoding) plus a reduction kernel.

Work decomposition. Program ``(seq, kv_head, split)`` of the first kernel
reads one contiguous token range of one sequence's KV for one KV head, once,
and attends *all* query heads that share that KV head (the GQA group, padded
to a power of two >= 16 so it can feed ``tl.dot``). The range is walked in
tiles of ``BLOCK_N`` tokens: whole pages when ``block_size`` divides
``BLOCK_N``, each page addressed through the block table.

Splits. Every sequence is cut into ``num_splits`` ranges of equal length,
rounded up to whole tiles, so short sequences may have empty splits (more
splits than pages). An empty split writes ``max = -inf``, ``sum = 0`` and a zero
accumulator; the reduction kernel gives it weight 0. With one split the first
kernel normalizes and writes the output itself and the reduction is skipped.
``num_splits`` is a runtime argument, so a heuristic that changes with the
batch never triggers a recompile (only the reducer's power-of-two width is
compiled in). The tile configs and the split heuristic: ``decode_config``.

Numerics: fp32 accumulation, scores in the log2 domain (``exp2``), INT8
caches dequantized in registers (see ``tiles.attend_tile``). A sequence of
length 0 produces zeros.

Windows (``ring``, ``RING``): the splits cut the sequence's window instead of
its whole length, and split 0 first folds in the sinks, scored with
``q_sink``; blocks are addressed through the ring (``tiles.ring_paged_slots``).
Without ``ring`` the kernel compiles exactly as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvkernels.attention_args import check_inputs, check_ring, ring_args, scale_args
from kvkernels.decode_config import choose_num_splits, count_sms, default_tile_config, kv_cache_dtype
from kvkernels.tiles import LOG2E, attend_paged, attend_ring_paged, dot_precision, padded


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_q_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads] float32 (K_INT8 only)
    v_scale_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_q_heads, HEAD_DIM] (SINGLE_SPLIT only)
    part_acc_ptr,  # [num_seqs, num_q_heads, num_splits, HEAD_DIM_PAD] float32, unnormalized
    part_max_ptr,  # [num_seqs, num_q_heads, num_splits] float32, log2 domain
    part_sum_ptr,  # [num_seqs, num_q_heads, num_splits] float32
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # a runtime value: changing it does not recompile
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
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
    stride_bt_seq,
    q_sink_ptr,  # like q, rotated at each query's position inside its cache (RING only)
    ring_ptr,  # [num_seqs, 4] int32: sinks, window, sink blocks, ring blocks (RING only)
    stride_qs_seq,
    stride_qs_head,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_N: tl.constexpr,  # tokens per tile
    SINGLE_SPLIT: tl.constexpr,  # num_splits == 1: normalize and write the output directly
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RING: tl.constexpr,  # attend over sinks + window through a ring of blocks
):
    """One program ``(seq, kv_head, split)``: the GQA group's queries over the split's keys (split 0 of a ring
    first folds in the sinks), then the output (``SINGLE_SPLIT``) or the split's partials.

    One function over 60 lines on purpose: half of it is the launch's argument list, and the body is one
    program's straight line (load the queries, attend through ``tiles``' helpers, store) that more
    ``@triton.jit`` helpers would only scatter, each taking the same ~30 pointers and strides.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    if RING:
        num_sinks = tl.load(ring_ptr + seq * 4)
        window = tl.load(ring_ptr + seq * 4 + 1)
        sink_blocks = tl.load(ring_ptr + seq * 4 + 2)
        ring_blocks = tl.load(ring_ptr + seq * 4 + 3)
        window_start = tl.minimum(tl.maximum(num_sinks, seq_len - window), seq_len)
        split_len = tl.cdiv(tl.cdiv(seq_len - window_start, num_splits), BLOCK_N) * BLOCK_N
        start = window_start + split * split_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
    end = tl.minimum(start + split_len, seq_len)  # start >= end: empty split

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    q_heads = kv_head * GROUP + rows  # [GROUP_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offsets = seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    if RING:
        qs_offsets = seq * stride_qs_seq + q_heads[:, None] * stride_qs_head + dims[None, :]
        q_sink = tl.load(q_sink_ptr + qs_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        every_key = tl.zeros([GROUP_PAD], tl.int32)
        sinks_end = tl.where(split == 0, tl.minimum(num_sinks, seq_len), 0)  # split 0 takes the sinks
        table_row = block_tables_ptr + seq * stride_bt_seq
        m_i, l_i, acc = attend_ring_paged(
            q_sink, m_i, l_i, acc, 0, sinks_end, every_key, table_row, sink_blocks, ring_blocks,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok,
            stride_k_block, stride_k_token, stride_k_head, stride_v_block, stride_v_token, stride_v_head,
            stride_ks_block, stride_ks_token, stride_ks_head, stride_vs_block, stride_vs_token, stride_vs_head,
            qk_scale, BLOCK_SIZE, BLOCK_N, K_INT8, V_INT8, DOT_PRECISION,
        )  # fmt: skip
        m_i, l_i, acc = attend_ring_paged(
            q, m_i, l_i, acc, start, end, every_key, table_row, sink_blocks, ring_blocks,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok,
            stride_k_block, stride_k_token, stride_k_head, stride_v_block, stride_v_token, stride_v_head,
            stride_ks_block, stride_ks_token, stride_ks_head, stride_vs_block, stride_vs_token, stride_vs_head,
            qk_scale, BLOCK_SIZE, BLOCK_N, K_INT8, V_INT8, DOT_PRECISION,
        )  # fmt: skip
    else:
        m_i, l_i, acc = attend_paged(
            q, m_i, l_i, acc, start, end, block_tables_ptr + seq * stride_bt_seq,
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, dims, dim_ok,
            stride_k_block, stride_k_token, stride_k_head, stride_v_block, stride_v_token, stride_v_head,
            stride_ks_block, stride_ks_token, stride_ks_head, stride_vs_block, stride_vs_token, stride_vs_head,
            qk_scale, BLOCK_SIZE, BLOCK_N, K_INT8, V_INT8, DOT_PRECISION,
        )  # fmt: skip

    if SINGLE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offsets = seq * stride_o_seq + q_heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (seq * num_q_heads + q_heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,  # [num_seqs, num_q_heads, num_splits, HEAD_DIM_PAD] float32
    part_max_ptr,  # [num_seqs, num_q_heads, num_splits] float32
    part_sum_ptr,  # [num_seqs, num_q_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_q_heads, HEAD_DIM]
    num_splits,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # power of two >= num_splits
):
    """Merge the splits of one (sequence, query head); empty splits (sum 0) get weight 0."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (seq * tl.num_programs(1) + head) * num_splits + splits  # [SPLITS_PAD]

    maxes = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    global_max = tl.max(maxes, 0)
    global_max = tl.where(global_max > float("-inf"), global_max, 0.0)  # all splits empty: avoid -inf - -inf
    weights = tl.where(sums > 0, tl.exp2(maxes - global_max), 0.0)  # [SPLITS_PAD]
    total = tl.sum(sums * weights, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], 0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]
    out_offsets = seq * stride_o_seq + head * stride_o_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_sink: torch.Tensor | None = None,
    ring: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile_config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.paged_decode_attention`` (``ring`` and ``q_sink``: windows).

    ``num_splits`` and ``tile_config`` = (tokens per tile, num_warps,
    num_stages) override the heuristic and ``default_tile_config`` (tests, the bench's sweep).

    The split heuristic bounds the sequence length by the block table's width,
    so no device-to-host copy is needed (the call is CUDA-graph safe).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_inputs(num_q_heads, num_kv_heads, (q, k_cache, v_cache, block_tables),
                 "q, k_cache, v_cache and block_tables")  # fmt: skip
    check_ring(q, q_sink, ring, num_seqs)
    group = num_q_heads // num_kv_heads
    head_dim_pad = padded(head_dim)
    tile_config = tile_config or default_tile_config(head_dim, kv_cache_dtype(k_scale, v_scale), q.device)
    tile_tokens, num_warps, num_stages = tile_config
    if num_splits is None:
        max_seq_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, tile_tokens, count_sms(q.device))

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    part_acc, part_max, part_sum = _partials(out, num_splits, head_dim_pad)
    ks, vs, ks_strides, vs_strides = scale_args(k_cache, v_cache, k_scale, v_scale)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens,
        out, part_acc, part_max, part_sum,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *ks_strides, *vs_strides,
        block_tables.stride(0), *ring_args(q, q_sink, ring, seq_lens),
        GROUP=group, GROUP_PAD=padded(group), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=tile_tokens, SINGLE_SPLIT=num_splits == 1,
        K_INT8=k_scale is not None, V_INT8=v_scale is not None, DOT_PRECISION=dot_precision(q.dtype),
        RING=ring is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_acc, part_max, part_sum, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )  # fmt: skip
    return out


def _partials(out: torch.Tensor, num_splits: int, head_dim_pad: int) -> tuple[torch.Tensor, ...]:
    """The splits' (unnormalized accumulators, maxes, sums), float32; with one split there are none and
    ``out`` stands in for all three (never read)."""
    if num_splits <= 1:
        return out, out, out
    num_seqs, num_q_heads, _ = out.shape
    part_acc = torch.empty(num_seqs, num_q_heads, num_splits, head_dim_pad, dtype=torch.float32, device=out.device)
    part_max = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=out.device)
    return part_acc, part_max, torch.empty_like(part_max)
