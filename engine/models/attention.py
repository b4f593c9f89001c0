"""What one forward pass needs to know to read and write the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvkernels
from kvstore import LayerKV


@dataclass
class RingMetadata:
    """A batch in which some sequence attends over sinks + a window (``kvstore.ring``): every sequence's
    kernel row (``FULL_RING_ROW`` for those without a window) and every query's position inside its cache, where
    its sink-facing copy is rotated."""

    rows: torch.Tensor  # (seqs, 4) int32: sinks, window, sink blocks, ring blocks
    sink_positions: torch.Tensor  # (tokens,) int64
    max_position: int  # the batch's largest position, known on the host (sizes the rotary lookup)
    has_sinks: bool  # whether any sequence keeps sinks (else no query needs its sink-facing copy)


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
    ring: RingMetadata | None = None  # some sequence attends over a window (``kvstore.ring``)

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
    q_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the pool, then attend: decode rows and prefill rows each by their own kernel.

    q ``(tokens, q_heads, head_dim)``, k and v ``(tokens, kv_heads, head_dim)``. With ``q_sink`` (the queries
    rotated at their positions inside their caches) the layer attends over ``meta.ring``'s windows.
    """
    if torch.compiler.is_compiling():  # a compiled one-sequence decode step (``compiled_decode.CompiledDecode``)
        return compiled_decode_attention(q, k, v, kv, meta, scale)
    scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
    kvkernels.store_kvcache(k, v, kv.k_cache, kv.v_cache, meta.slot_mapping, **scales)
    nd = meta.num_decodes
    windows = ({}, {}) if q_sink is None else (
        {"q_sink": q_sink[:nd], "ring": meta.ring.rows[:nd]}, {"q_sink": q_sink[nd:], "ring": meta.ring.rows[nd:]}
    )  # fmt: skip
    if nd == meta.num_seqs:
        return kvkernels.paged_decode_attention(
            q, kv.k_cache, kv.v_cache, meta.block_tables, meta.seq_lens, scale, **scales, **windows[0]
        )
    out = torch.empty_like(q)
    if nd:
        out[:nd] = kvkernels.paged_decode_attention(
            q[:nd], kv.k_cache, kv.v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, **scales, **windows[0]
        )
    out[nd:] = kvkernels.paged_prefill_attention(
        q[nd:], k[nd:], v[nd:], kv.k_cache, kv.v_cache,
        meta.block_tables[nd:], meta.cu_seqlens_q[nd:] - nd, meta.seq_lens[nd:], scale,
        max_q_len=meta.max_q_len, **scales, **windows[1],
    )  # fmt: skip
    return out


def compiled_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``paged_attention`` of a decode-only batch of float KV without windows, written for inductor: no value is
    read back to the host, so one graph serves every length. Each new token's K/V go to its slot (every slot
    valid: no padding rows), then each query scores the first ``seq_lens`` tokens held in its row of
    ``block_tables``: every column of the table, which the caller trims to the longest sequence's blocks.
    Inductor fuses the slot lookup into the products and the softmax, so the pool is read in place; the
    references gather the blocks first (``kvkernels.reference.paged_decode_attention``)."""
    block_size, num_kv_heads, head_dim = kv.k_cache.shape[1:]
    # index_put_ on the pool itself, which inductor writes in place; on a view of it, it copied the whole pool
    new_block, new_offset = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    kv.k_cache.index_put_((new_block, new_offset), k.to(kv.k_cache.dtype))
    kv.v_cache.index_put_((new_block, new_offset), v.to(kv.v_cache.dtype))
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    token = torch.arange(meta.block_tables.shape[1] * block_size, device=q.device)  # (tokens,)
    held = token[None, :] < meta.seq_lens[:, None].long()  # (seqs, tokens)
    # table entries past a sequence's blocks may hold anything: they read block 0, and are masked
    blocks = torch.where(held, meta.block_tables.long()[:, token // block_size], 0)  # (seqs, tokens)
    offsets = (token % block_size)[None, :]
    k_seq, v_seq = kv.k_cache[blocks, offsets].float(), kv.v_cache[blocks, offsets].float()  # (seqs, tokens, kv, dim)
    # query head h reads KV head h // group, as everywhere (``enable_gqa``)
    scores = (q.float().view(num_seqs, 1, num_kv_heads, group, head_dim) * k_seq[:, :, :, None]).sum(-1) * scale
    probs = torch.softmax(torch.where(held[:, :, None, None], scores, float("-inf")), dim=1)  # (seqs, tokens, kv, g)
    out = (probs[..., None] * v_seq[:, :, :, None]).sum(1)  # (seqs, kv_heads, group, dim)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
