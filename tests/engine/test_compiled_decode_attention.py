"""The attention a compiled one-sequence decode step runs (``engine.models.attention.compiled_decode_attention``),
run eagerly here (compiling starts the C++ compiler: ``tests/service/test_compiled_decode.py`` compiles it),
against the reference the eager steps run, ``kvkernels.reference``: what it stores and what it attends to."""

from __future__ import annotations

import torch

from engine.models.attention import AttentionMetadata, compiled_decode_attention
from kvkernels import reference
from kvstore import LayerKV

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM = 12, 4, 2, 6, 8


def _case(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    width = max(-(-n // BLOCK_SIZE) for n in lengths) + 1  # a column past every sequence's blocks
    tables = torch.full((len(lengths), width), 10**6, dtype=torch.int32)  # past a sequence's blocks: anything
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    for i, n in enumerate(lengths):
        blocks = -(-n // BLOCK_SIZE)
        tables[i, :blocks] = torch.tensor(order[:blocks])
        order = order[blocks:]
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          for i, n in enumerate(lengths)])  # fmt: skip
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.tensor(lengths, dtype=torch.int32),
                             cu_seqlens_q=torch.arange(len(lengths) + 1, dtype=torch.int32),
                             num_decodes=len(lengths))  # fmt: skip
    q = torch.randn(len(lengths), Q_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(len(lengths), KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(len(lengths), KV_HEADS, HEAD_DIM, generator=g)
    return q, k, v, k_cache, v_cache, meta


def test_it_stores_the_new_tokens_and_attends_as_the_reference_does():
    for lengths, seed in (([1], 0), ([4], 1), ([9], 2), ([13, 3, 8], 3)):
        q, k, v, k_cache, v_cache, meta = _case(lengths, seed)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        reference.store_kvcache(k, v, want_k, want_v, meta.slot_mapping)
        want = reference.paged_decode_attention(q, want_k, want_v, meta.block_tables, meta.seq_lens, 0.3)
        got = compiled_decode_attention(q, k, v, LayerKV(k_cache, v_cache), meta, 0.3)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), lengths  # a copy into each slot
        # different summation orders (the reference's SDPA): within float32's rounding over a few terms
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"lengths {lengths}")


def test_tokens_past_a_sequences_length_are_not_attended_to():
    q, k, v, k_cache, v_cache, meta = _case([6], 4)
    got = compiled_decode_attention(q, k, v, LayerKV(k_cache.clone(), v_cache.clone()), meta, 0.3)
    block = int(meta.block_tables[0, 1])
    k_cache[block, 2:], v_cache[block, 2:] = 1e3, 1e3  # tokens 6 and 7 of the sequence's second block
    assert torch.equal(compiled_decode_attention(q, k, v, LayerKV(k_cache, v_cache), meta, 0.3), got)
