"""Triton rotary embedding (rotate-half, as in Llama/Qwen2) of q and k together, in one launch.

One program owns one token: it loads the token's ``cos_sin`` row once and
rotates every query head and every key head of that token, as two register
tiles ``[heads, head_dim / 2]`` per half. ``q`` and ``k`` may be strided views
of the fused QKV projection (only the last dimension must be contiguous); the
results are written to new contiguous tensors, so the projection output is
left as it is (``v`` is still read from it). Math in float32, one rounding to
the model dtype, as in ``reference.rotary_embedding``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_src_head,
    stride_dst_head,
    cos,  # [1, HALF_PAD] float32
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """``dst = src * cos + rotate_half(src) * sin`` for the ``NUM_HEADS`` heads of one token."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = src_ptr + heads * stride_src_head + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD], first half of each head
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + heads * stride_dst_head + dims
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, NUM_Q_HEADS, 2 * HALF]
    k_ptr,  # [num_tokens, NUM_KV_HEADS, 2 * HALF]
    cos_sin_ptr,  # [num_tokens, 2 * HALF] float32: cos of each frequency, then sin
    q_out_ptr,
    k_out_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_sin_token,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + token * stride_cos_sin_token
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + token * stride_q_token, q_out_ptr + token * stride_q_out_token, stride_q_head, stride_q_out_head,
        cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_k_token, k_out_ptr + token * stride_k_out_token, stride_k_head, stride_k_out_head,
        cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD,
    )  # fmt: skip


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.rotary_embedding``: returns new contiguous ``(q, k)``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or (k.shape[0], k.shape[2]) != (num_tokens, head_dim) or cos_sin.shape != (num_tokens, head_dim):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and cos_sin {tuple(cos_sin.shape)} need the "
                         "same tokens and the same even head_dim")  # fmt: skip
    if any(t.stride(-1) != 1 for t in (q, k, cos_sin)):
        raise ValueError("q, k and cos_sin need a contiguous last dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    q_heads_pad = triton.next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        q, k, cos_sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=q_heads_pad,
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        num_warps=4 if q_heads_pad * half <= 2048 else 8,
    )  # fmt: skip
    return q_out, k_out
