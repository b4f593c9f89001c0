"""What one forward pass needs to know to read and write the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kvstore import LayerKV


@dataclass
class AttentionMetadata:
    """Flat tensors describing one step's batch; the kernels consume them directly.

    The batch is ordered decodes first: sequences ``0..num_decodes-1`` bring
    exactly one new token each (rows ``0..num_decodes-1``), the rest bring
    prompt chunks. Per sequence ``i``: its rows are
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, its length after this step is
    ``seq_lens[i]`` and its blocks are ``block_tables[i]``. ``max_q_len``, the most new tokens any sequence
    brings, comes from the host so the prefill kernel need not read it back (None: it does). A decode row
    with slot -1 and length 0 is padding (a CUDA graph's fixed batch size): nothing stored, output zeros.
    """

    slot_mapping: torch.Tensor  # (tokens,) int64, block_id * block_size + offset
    block_tables: torch.Tensor  # (seqs, max_blocks) int32
    seq_lens: torch.Tensor  # (seqs,) int32
    cu_seqlens_q: torch.Tensor  # (seqs + 1,) int32
    num_decodes: int
    max_q_len: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the pool, then attend: decode rows and prefill rows each by their own kernel.

    q ``(tokens, q_heads, head_dim)``, k and v ``(tokens, kv_heads, head_dim)``.
    """
    scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
    kernels.store_kvcache(k, v, kv.k_cache, kv.v_cache, meta.slot_mapping, **scales)
    nd = meta.num_decodes
    if nd == meta.num_seqs:
        return kernels.paged_decode_attention(
            q, kv.k_cache, kv.v_cache, meta.block_tables, meta.seq_lens, scale, **scales
        )
    out = torch.empty_like(q)
    if nd:
        out[:nd] = kernels.paged_decode_attention(
            q[:nd], kv.k_cache, kv.v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, **scales
        )
    out[nd:] = kernels.paged_prefill_attention(
        q[nd:], k[nd:], v[nd:], kv.k_cache, kv.v_cache,
        meta.block_tables[nd:], meta.cu_seqlens_q[nd:] - nd, meta.seq_lens[nd:], scale,
        max_q_len=meta.max_q_len, **scales,
    )  # fmt: skip
    return out
