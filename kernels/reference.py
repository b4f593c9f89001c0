"""Plain-PyTorch references for the kernels: paged attention, the decoder layer's fused element-wise ops and the
sampler's Gumbel-max draw.

These define the semantics that the Triton kernels in this package must match,
and they are what runs on the CPU. Layouts (shared with the Triton kernels):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (one layer's slice of the KV pool).
* ``k_scale`` / ``v_scale`` (INT8 KV only): ``[num_blocks, block_size, num_kv_heads]``
  float32, one scale per token and head; the stored value is
  ``round(x / scale)`` clamped to [-127, 127].
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a
  sequence's last block are never read (their value does not matter).
* ``slot_mapping``: int ``[num_tokens]``, ``block_id * block_size + offset``;
  ``-1`` means "do not store this token".
* ``ring`` (windowed attention only): int32 ``[num_seqs, 4]``, per sequence ``(num_sinks S, window W,
  sink_blocks, ring_blocks)``. A query at position ``t`` sees keys ``0..S-1`` (the sinks, scored with
  ``q_sink``: the same query rotated at its position inside the cache) and ``t-W+1..t`` (scored with ``q``),
  nothing else; logical block ``j`` of the sequence is table column ``j`` below ``sink_blocks`` and
  ``sink_blocks + (j - sink_blocks) % ring_blocks`` from there (``kvstore.ring``). ``FULL_RING_ROW`` sees
  every key through the plain table: a sequence without a window in a batch that has windowed ones, computed
  exactly as without ``ring``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
UNBOUNDED = 1 << 30  # a window or a ring that never ends
RING_SINKS, RING_WINDOW, RING_SINK_BLOCKS, RING_BLOCKS = range(4)  # the columns of ``ring``
FULL_RING_ROW = (0, UNBOUNDED, 0, UNBOUNDED)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) INT8: ``x [T, H, D]`` -> (int8 values, float32 scales ``[T, H]``)."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX
    q = torch.round(x.float() / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _dequant(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale[..., None]).to(dtype)


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
    """Write ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots, in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    num_blocks, block_size = k_cache.shape[:2]
    for new, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, *cache.shape[2:])
        if scale is None:
            flat.index_copy_(0, slots, new.to(cache.dtype))
        else:
            q, s = quantize_int8(new)
            flat.index_copy_(0, slots, q)
            scale.view(num_blocks * block_size, -1).index_copy_(0, slots, s)


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, length: int, dtype: torch.dtype):
    """The first ``length`` tokens held in ``blocks``: ``[length, num_kv_heads, head_dim]``."""
    return _gather_batch(cache, scale, blocks[None], length, dtype)[0]


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
    (see the module's docstring); sequences whose row is ``FULL_RING_ROW`` take the path below unchanged.

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
    k = _gather_batch(k_cache, k_scale, blocks, max_len, torch.float32)  # (seqs, len, kv_heads, dim)
    v = _gather_batch(v_cache, v_scale, blocks, max_len, torch.float32)
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


def _gather_batch(cache, scale, blocks, length, dtype):
    num_seqs = blocks.shape[0]
    flat = blocks.reshape(-1)  # index_select copies whole blocks, several times faster than advanced indexing
    values = cache.index_select(0, flat).reshape(num_seqs, -1, *cache.shape[2:])[:, :length]
    token_scale = None
    if scale is not None:
        token_scale = scale.index_select(0, flat).reshape(num_seqs, -1, scale.shape[-1])[:, :length]
    return _dequant(values, token_scale, dtype)


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
    With ``ring`` (and ``q_sink``) a sequence attends over its sinks and window only (module docstring).
    """
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    lengths = seq_lens.tolist()
    rings = None if ring is None else ring.tolist()
    for i, total in enumerate(lengths):
        start, end = bounds[i], bounds[i + 1]
        num_new = end - start
        if num_new == 0:
            continue
        num_cached = total - num_new
        if rings is not None and tuple(rings[i]) != FULL_RING_ROW:
            num_sinks, window, sink_blocks, ring_blocks = rings[i]
            cached = _visible(num_cached, num_cached, num_sinks, window)  # the cached keys any row reads
            keys = _gather_positions(k_cache, k_scale, block_tables[i], cached, sink_blocks, ring_blocks, q.dtype)
            values = _gather_positions(v_cache, v_scale, block_tables[i], cached, sink_blocks, ring_blocks, q.dtype)
            # keys in order: cached sinks, new sinks, cached window, new window (sinks first for _attend_window)
            new = torch.arange(num_cached, total)
            key_positions = torch.cat([cached, new])
            order = torch.argsort((key_positions >= num_sinks).int(), stable=True)
            key_positions = key_positions[order].to(q.device)
            queries = new.to(q.device)[:, None]
            visible = (key_positions[None, :] <= queries) & (
                (key_positions[None, :] < num_sinks) | (key_positions[None, :] > queries - window)
            )  # fmt: skip
            out[start:end] = _attend_window(
                q[start:end], q_sink[start:end], torch.cat([keys, k[start:end]])[order.to(q.device)],
                torch.cat([values, v[start:end]])[order.to(q.device)], int((key_positions < num_sinks).sum()), scale,
                visible,
            )  # fmt: skip
            continue
        keys, values = k[start:end], v[start:end]
        if num_cached > 0:
            blocks = block_tables[i, : (num_cached + block_size - 1) // block_size].long()
            keys = torch.cat([_gather(k_cache, k_scale, blocks, num_cached, q.dtype), keys])
            values = torch.cat([_gather(v_cache, v_scale, blocks, num_cached, q.dtype), values])
        # Query j sits at absolute position num_cached + j and sees keys 0..num_cached + j.
        mask = None
        if num_cached > 0:
            rows = torch.arange(num_new, device=q.device)[:, None] + num_cached
            mask = torch.arange(total, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _ring_decode(q, q_sink, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, ring):
    """``paged_decode_attention`` with ``ring``: plain rows through the path without it, the others one by one."""
    rings, lengths = ring.tolist(), seq_lens.tolist()
    plain = [i for i, row in enumerate(rings) if tuple(row) == FULL_RING_ROW]
    out = torch.zeros_like(q)
    if plain:
        rows = torch.tensor(plain, device=q.device)
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale,
                                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    for i, (num_sinks, window, sink_blocks, ring_blocks) in enumerate(rings):
        length = lengths[i]
        if tuple(rings[i]) == FULL_RING_ROW or length == 0:
            continue
        positions = _visible(length - 1, length, num_sinks, window)  # every one of them visible to the query
        keys = _gather_positions(k_cache, k_scale, block_tables[i], positions, sink_blocks, ring_blocks, q.dtype)
        values = _gather_positions(v_cache, v_scale, block_tables[i], positions, sink_blocks, ring_blocks, q.dtype)
        out[i : i + 1] = _attend_window(q[i : i + 1], q_sink[i : i + 1], keys, values, min(num_sinks, length),
                                        scale)  # fmt: skip
    return out


def _visible(first_query: int, length: int, num_sinks: int, window: int) -> torch.Tensor:
    """Positions below ``length`` that a query at ``first_query`` or later may see: the sinks, then what is
    inside the first query's window (int64, ascending)."""
    sinks = torch.arange(min(num_sinks, length))
    recent = torch.arange(min(max(num_sinks, first_query - window + 1), length), length)
    return torch.cat([sinks, recent])


def _gather_positions(cache, scale, table_row, positions, sink_blocks, ring_blocks, dtype) -> torch.Tensor:
    """Tokens at logical ``positions (n,)`` of one sequence whose blocks form a ring: ``[n, kv_heads, dim]``."""
    block_size = cache.shape[1]
    positions = positions.to(cache.device)
    logical = positions // block_size
    columns = torch.where(logical < sink_blocks, logical, sink_blocks + (logical - sink_blocks) % ring_blocks)
    slots = table_row.to(cache.device)[columns].long() * block_size + positions % block_size
    values = cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    token_scale = None if scale is None else scale.view(-1, scale.shape[-1]).index_select(0, slots)
    return _dequant(values, token_scale, dtype)


def _attend_window(q, q_sink, keys, values, num_sink_keys, scale, visible=None):
    """Queries ``q``/``q_sink`` ``(n, q_heads, dim)`` over ``keys``/``values`` ``(k, kv_heads, dim)``, whose first
    ``num_sink_keys`` are sinks (scored with ``q_sink``) and the rest window keys (scored with ``q``);
    ``visible (n, k)`` masks keys per query (None: all visible). A row that sees nothing gets zeros."""
    n, num_q_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads

    def rows(x):  # (n, q_heads, dim) -> (kv_heads, n * group, dim): a KV head's queries as rows
        return x.float().view(n, num_kv_heads, group, dim).transpose(0, 1).reshape(num_kv_heads, n * group, dim)

    k = keys.float().transpose(0, 1)  # (kv_heads, k, dim)
    scores = torch.cat([torch.bmm(rows(q_sink), k[:, :num_sink_keys].transpose(1, 2)),
                        torch.bmm(rows(q), k[:, num_sink_keys:].transpose(1, 2))], dim=-1) * scale  # fmt: skip
    scores = scores.view(num_kv_heads, n, group, -1)  # (kv_heads, n, group, k)
    if visible is not None:
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if visible is not None:
        probs = probs.nan_to_num(0.0)  # a row with no visible key: all -inf, NaN -> 0
    out = torch.bmm(probs.view(num_kv_heads, n * group, -1), values.float().transpose(0, 1))  # (kv, n * group, dim)
    return out.view(num_kv_heads, n, group, dim).transpose(0, 1).reshape(n, num_q_heads, dim).to(q.dtype)


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


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; int64 wraps with the same bits)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` is arithmetic on int64 and would copy the sign bit in)."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place: a bijection of 64-bit values whose every output bit depends on every
    input bit. ``x`` int64, any shape."""
    x ^= _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``seeds (rows,)``, ``positions (rows,)`` int64 -> ``(rows, vocab_size)`` float32 uniforms in (0, 1).

    Entry ``[r, t]`` is a function of ``(seeds[r], positions[r], t)`` alone: the ``t + 1``-th output of a
    splitmix64 generator whose state starts at ``mix(mix(seed) + position)``. The top 23 bits make the
    uniform ``(k + 0.5) / 2**23``, exact in float32 and never 0 or 1.
    """
    keys = _mix64_(_mix64_(seeds.clone()) + positions)  # (rows,)
    counters = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN  # (vocab,)
    bits = _mix64_(keys[:, None] + counters)  # (rows, vocab)
    return (_shr(bits, 41).float() + 0.5) * 2.0**-23


def gumbel_argmax(scaled_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of ``scaled_logits (rows, vocab)`` float32, drawn with probability
    ``softmax(row)[t]`` by the noise of ``(seeds[r], positions[r])`` (``(rows,)`` int64 each) -> ``(rows,)`` int64.

    Gumbel-max: ``argmax(logit - log(-log(u)))``. It is the exponential race ``argmax(p / E)`` with
    ``E = -log(u)`` taken in logs, where ``log(p)`` differs from the logit by a per-row constant, so no
    softmax is needed; ``-inf`` logits stay ``-inf`` and are never drawn. Ties go to the lowest token id.
    """
    u = uniform_noise(seeds, positions, scaled_logits.shape[-1])
    return (scaled_logits - u.log_().neg_().log_()).argmax(-1)
