"""Paged attention references: one new token per sequence (``paged_decode_attention``) and packed new tokens
over a cached prefix (``paged_prefill_attention``). Layouts and ``ring``: the package's docstring; a windowed
sequence's attention is ``window``'s."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvkernels.reference import window
from kvkernels.reference.paged_kv import FULL_RING_ROW, gather, gather_batch


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
) -> torch.Tensor:
    """One query token per sequence over its whole paged KV: ``q [num_seqs, num_q_heads, head_dim]``.

    With ``ring`` (and ``q_sink``, shaped like ``q``), each sequence attends over its sinks and window only
    (see the package's docstring); sequences whose row is ``FULL_RING_ROW`` take the path below unchanged.

    Sequences whose lengths lie within a factor of two of each other (``(2**(c-1), 2**c]``) are attended
    together: one gather of their blocks, padded to the longest, and one SDPA call (masked when lengths
    differ), so padding never more than doubles the tokens read, and a batch of similar lengths costs one
    gather and one call (a group is split only to keep one gather under ``_MAX_GATHER_ELEMENTS``). A
    sequence of length 0 (batch padding) gets a zero output.
    """
    if ring is not None:
        return _ring_decode(q, q_sink, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, ring)
    lens = seq_lens.to(q.device).long()
    groups = _length_groups(lens, k_cache.shape[2] * k_cache.shape[3])
    if len(groups) == 1 and groups[0] is None:
        return _decode_group(q, k_cache, v_cache, block_tables, lens, scale, k_scale, v_scale)
    out = torch.zeros_like(q)
    for rows in groups:
        out[rows] = _decode_group(q[rows], k_cache, v_cache, block_tables[rows], lens[rows], scale, k_scale, v_scale)
    return out


_MAX_GATHER_ELEMENTS = 1 << 24  # per K (and per V) gather of one group: 64 MiB in float32


def _length_groups(lens: torch.Tensor, elements_per_token: int) -> list[torch.Tensor | None]:
    """Row indices of each group of non-empty sequences of the same length class ``ceil(log2(len))``, each
    cut to fit ``_MAX_GATHER_ELEMENTS`` once padded; ``[None]`` when the whole batch can be one group (no
    empty sequence, the longest at most twice the shortest, one gather)."""
    min_len, max_len = int(lens.min()), int(lens.max())
    if max_len == 0:
        return []
    fits = lens.shape[0] * max_len * elements_per_token <= _MAX_GATHER_ELEMENTS
    if 0 < min_len and max_len <= 2 * min_len and fits:
        return [None]  # the common case, e.g. a decode batch of similar lengths: no class to work out
    live = lens > 0
    classes = torch.where(live, torch.log2(lens.clamp(min=1).double()).ceil().long(), -1)
    groups = []
    for length_class in torch.unique(classes[live]).tolist():
        rows = torch.nonzero(classes == length_class).flatten()
        rows_per_gather = max(1, _MAX_GATHER_ELEMENTS // ((1 << length_class) * elements_per_token))
        groups.extend(rows.split(rows_per_gather))
    return groups


def _decode_group(q, k_cache, v_cache, block_tables, lens, scale, k_scale, v_scale) -> torch.Tensor:
    """Attention of ``q (seqs, q_heads, dim)`` over each sequence's first ``lens`` tokens (all > 0)."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    # Table entries past a sequence's last block may hold anything (even out-of-range ids): read block 0 there.
    owned = torch.arange(num_blocks, device=q.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    blocks = torch.where(owned, block_tables[:, :num_blocks].long(), 0)
    k = gather_batch(k_cache, k_scale, blocks, max_len, torch.float32)  # (seqs, len, kv_heads, dim)
    v = gather_batch(v_cache, v_scale, blocks, max_len, torch.float32)
    mask = None
    if int(lens.min()) < max_len:
        mask = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]  # (seqs,1,1,len)
    # Query head h reads KV head h // group (as enable_gqa does): the group's queries become query rows of
    # their KV head, so no KV is repeated or expanded.
    group = num_q_heads // num_kv_heads
    out = F.scaled_dot_product_attention(
        q.float().view(num_seqs, num_kv_heads, group, head_dim),  # (seqs, kv_heads, group, dim)
        k.transpose(1, 2),  # (seqs, kv_heads, len, dim), a strided view: no copy
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


def _ring_decode(q, q_sink, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, ring):
    """``paged_decode_attention`` with ``ring``: plain rows through the path without it, the others one by one."""
    rings, lengths = ring.tolist(), seq_lens.tolist()
    plain = [i for i, row in enumerate(rings) if tuple(row) == FULL_RING_ROW]
    out = torch.zeros_like(q)
    if plain:
        rows = torch.tensor(plain, device=q.device)
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale,
                                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    for i, row in enumerate(rings):
        if tuple(row) == FULL_RING_ROW or lengths[i] == 0:
            continue
        out[i : i + 1] = window.decode_windowed(q[i : i + 1], q_sink[i : i + 1], k_cache, v_cache, k_scale, v_scale,
                                                block_tables[i], lengths[i], row, scale)  # fmt: skip
    return out


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
) -> torch.Tensor:
    """Causal attention of packed new tokens over a cached prefix plus themselves.

    Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of
    ``q``/``k``/``v`` (``[num_tokens, heads, head_dim]``); its total length
    after this step is ``seq_lens[i]``, so its first ``seq_lens[i] - q_len``
    tokens are read from the paged cache and the new ones from ``k``/``v``.
    With ``ring`` (and ``q_sink``) a sequence attends over its sinks and window only (package docstring).
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    rings = None if ring is None else ring.tolist()
    for i, total in enumerate(seq_lens.tolist()):
        new = slice(bounds[i], bounds[i + 1])
        if bounds[i + 1] == bounds[i]:
            continue
        if rings is not None and tuple(rings[i]) != FULL_RING_ROW:
            out[new] = window.prefill_windowed(q[new], q_sink[new], k[new], v[new], k_cache, v_cache, k_scale,
                                               v_scale, block_tables[i], total, rings[i], scale)  # fmt: skip
        else:
            out[new] = _prefill_sequence(q[new], k[new], v[new], k_cache, v_cache, k_scale, v_scale,
                                         block_tables[i], total, scale)  # fmt: skip
    return out


def _prefill_sequence(q, k, v, k_cache, v_cache, k_scale, v_scale, table_row, total, scale) -> torch.Tensor:
    """Causal attention of one sequence's new tokens ``q``/``k``/``v`` ``(new, heads, dim)``, the last of its
    ``total`` tokens, over its cached prefix (through ``table_row``) and themselves: ``(new, q_heads, dim)``."""
    block_size = k_cache.shape[1]
    num_new = q.shape[0]
    num_cached = total - num_new
    keys, values = k, v
    mask = None
    if num_cached > 0:
        blocks = table_row[: (num_cached + block_size - 1) // block_size].long()
        keys = torch.cat([gather(k_cache, k_scale, blocks, num_cached, q.dtype), keys])
        values = torch.cat([gather(v_cache, v_scale, blocks, num_cached, q.dtype), values])
        # Query j sits at absolute position num_cached + j and sees keys 0..num_cached + j.
        rows = torch.arange(num_new, device=q.device)[:, None] + num_cached
        mask = torch.arange(total, device=q.device)[None, :] <= rows
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)
