"""References of the decoder layer's fused element-wise ops: residual add + RMSNorm, rotary embedding and
SwiGLU's activation, each rounded exactly as transformers' Llama/Qwen2 layers round."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``: ``x``, ``residual`` ``(num_tokens, hidden)``, ``weight`` ``(hidden,)``.

    Returns ``(normed, x + residual)``; without a residual, ``(normed, x)``
    with ``x`` itself. The sum is taken in ``x``'s dtype (a running residual
    stream, as in Hugging Face's layers), normalized in float32, rounded to the
    dtype and scaled by ``weight`` (which has ``x``'s dtype) exactly as
    transformers' Llama/Qwen2 RMSNorm does.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype), x


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of ``q (num_tokens, q_heads, head_dim)`` and ``k (num_tokens, kv_heads, head_dim)``.

    ``cos_sin (num_tokens, head_dim)`` float32 holds, per token, the cosines of
    its ``head_dim / 2`` rotation angles followed by their sines. Dimension
    ``j`` of a head pairs with ``j + head_dim / 2``. Math in float32, one
    rounding to the input dtype; returns new tensors.
    """
    cos, sin = cos_sin[:, None].chunk(2, dim=-1)  # (tokens, 1, head_dim / 2) each
    return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``gate_up (num_tokens, 2 * I)`` holds gate then up; returns ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
