"""Host-side checks and launch arguments that the two paged-attention wrappers (``decode_attention``,
``prefill_attention``) share: both kernels take INT8 scales and a ring in fixed argument slots, filled with
placeholders when a call has none, so that the argument list never changes shape."""

from __future__ import annotations

import torch


def check_inputs(num_q_heads: int, num_kv_heads: int, tensors: tuple[torch.Tensor, ...], names: str) -> None:
    """``ValueError`` unless query heads come in whole groups per KV head and ``tensors`` (called ``names``)
    have a contiguous last dimension."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{names} need a contiguous last dimension")


def check_ring(q: torch.Tensor, q_sink: torch.Tensor | None, ring: torch.Tensor | None, num_seqs: int) -> None:
    """``ValueError`` unless a ``ring`` comes with a ``q_sink`` shaped like ``q`` and is ``(num_seqs, 4)``."""
    if ring is not None and (q_sink is None or q_sink.shape != q.shape or q_sink.stride(-1) != 1
                             or ring.shape != (num_seqs, 4) or not ring.is_contiguous()):  # fmt: skip
        raise ValueError("a ring needs q_sink shaped like q (contiguous last dimension) and a contiguous "
                         "(num_seqs, 4) ring")  # fmt: skip


def scale_args(k_cache, v_cache, k_scale, v_scale) -> tuple:
    """The kernels' ``k_scale_ptr, v_scale_ptr`` and then their six strides; a cache without scales passes
    itself and zero strides (never read: ``K_INT8``/``V_INT8`` are off)."""
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    ks_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    vs_strides = v_scale.stride() if v_scale is not None else (0, 0, 0)
    return ks, vs, ks_strides, vs_strides


def ring_args(q, q_sink, ring, seq_lens) -> tuple:
    """The kernels' ``q_sink_ptr, ring_ptr, stride_qs_*``; without a ring, ``q`` and ``seq_lens`` stand in
    (never read: ``RING`` is off)."""
    if ring is None:
        return q, seq_lens, 0, 0
    return q_sink, ring, *q_sink.stride()[:2]
