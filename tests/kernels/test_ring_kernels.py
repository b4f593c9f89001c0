"""Windowed paged attention (sinks + window over a ring of blocks): the references against a dense
computation over the kept tokens, and the Triton kernels against the references (interpreted on CPU)."""

import pytest
import torch
from paged_kv_testing import (  # noqa: F401  (interpreted_triton: an autouse fixture, found by name)
    DEVICE,
    assert_matches,
    interpreted_triton,
    random_tensor,
    triton_ops,
)

from kvkernels import reference
from kvstore.ring import FULL_RING_ROW, RingSpec

NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32


def _ring_batch(specs, lengths, *, block_size, dtype, generator):
    """Per sequence ``i``: logical K/V ``(lengths[i], kv_heads, dim)`` and a pool whose blocks hold what a ring
    of ``specs[i]`` holds after its first ``lengths[i]`` tokens were written in order (later positions
    overwrite the slots of earlier ones); ``specs[i]`` None: a plain table. Returns (logical k, logical v,
    k_cache, v_cache, block_tables, ring rows)."""
    tables = []
    for spec, length in zip(specs, lengths, strict=True):
        n = -(-max(length, 1) // block_size)
        tables.append(n if spec is None else spec.num_table_blocks(max(length, 1)))
    num_blocks = sum(tables) + 2
    order = torch.randperm(num_blocks, generator=generator)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    block_tables = torch.full((len(specs), max(tables) + 1), num_blocks + 100, dtype=torch.int32)
    logical_k, logical_v, used = [], [], 0
    for i, (spec, length) in enumerate(zip(specs, lengths, strict=True)):
        block_tables[i, : tables[i]] = order[used : used + tables[i]]
        used += tables[i]
        k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        for position in range(length):
            logical = position // block_size
            column = logical if spec is None else spec.table_index(logical)
            block = block_tables[i, column]
            k_cache[block, position % block_size], v_cache[block, position % block_size] = k[position], v[position]
        logical_k.append(k)
        logical_v.append(v)
    rings = torch.tensor([FULL_RING_ROW if s is None else s.kernel_row() for s in specs], dtype=torch.int32)
    return logical_k, logical_v, k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE), rings.to(DEVICE)


def _dense(q, q_sink, t, keys, values, num_sinks, window, scale):
    """One query row ``(q_heads, dim)`` at position ``t`` over logical ``keys``/``values`` ``(>t, kv, dim)``: the
    sinks scored with ``q_sink``, the window with ``q``, built position by position."""
    kept = sorted({p for p in range(min(num_sinks, t + 1))} | {p for p in range(max(0, t - window + 1), t + 1)})
    out = torch.empty(q.shape, dtype=torch.float32)
    for head in range(q.shape[0]):
        kv = head // GROUP
        scores = torch.stack([(q_sink if p < num_sinks else q)[head].float() @ keys[p, kv].float() for p in kept])
        probs = torch.softmax(scores * scale, 0)
        out[head] = sum(w * values[p, kv].float() for w, p in zip(probs, kept, strict=True))
    return out


# (dtype, block_size, [(sinks, window) or None per sequence], [length per sequence])
DECODE_CASES = [
    pytest.param(torch.float32, 4, [(2, 8), (0, 8), None, (3, 12)], [40, 27, 9, 5], id="fp32-bs4"),
    pytest.param(torch.float16, 8, [(4, 20), (1, 8)], [90, 9], id="fp16-bs8-wrapped"),
]


@pytest.mark.parametrize("dtype,block_size,windows,lengths", DECODE_CASES)
def test_ring_decode_matches_a_dense_window_and_triton(dtype, block_size, windows, lengths):
    generator = torch.Generator().manual_seed(1)
    specs = [None if w is None else RingSpec(w[0], w[1], block_size) for w in windows]
    logical_k, logical_v, k_cache, v_cache, tables, rings = _ring_batch(
        specs, lengths, block_size=block_size, dtype=dtype, generator=generator
    )
    num_seqs, scale = len(lengths), HEAD_DIM**-0.5
    q = random_tensor(num_seqs, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=dtype, generator=generator)
    q_sink = random_tensor(num_seqs, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=dtype, generator=generator)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, tables, seq_lens, scale)

    expected = reference.paged_decode_attention(*args, q_sink=q_sink, ring=rings)

    for i, (spec, length) in enumerate(zip(specs, lengths, strict=True)):
        if spec is None:  # without a window in a ring batch: the call without a ring on its row, bit-equal
            row = slice(i, i + 1)
            plain = reference.paged_decode_attention(q[row], k_cache, v_cache, tables[row], seq_lens[row], scale)
            assert torch.equal(expected[i], plain[0])
            continue
        dense = _dense(q[i].cpu(), q_sink[i].cpu(), length - 1, logical_k[i], logical_v[i], spec.num_sinks,
                       spec.window, scale)  # fmt: skip
        torch.testing.assert_close(expected[i].float().cpu(), dense, atol=2e-3, rtol=2e-3)
    for num_splits in (1, 3):
        assert_matches(triton_ops().decode(*args, q_sink=q_sink, ring=rings, num_splits=num_splits), expected)


# (dtype, block_size, (sinks, window), [(cached, new) per sequence])
PREFILL_CASES = [
    pytest.param(torch.float32, 4, (2, 8), [(0, 14), (30, 5), (13, 1)], id="fp32-bs4"),
    pytest.param(torch.float16, 8, (4, 16), [(50, 9), (0, 23)], id="fp16-bs8"),
    pytest.param(torch.float32, 4, (0, 8), [(21, 6), (3, 4)], id="fp32-no-sinks"),
]


@pytest.mark.parametrize("dtype,block_size,window,chunks", PREFILL_CASES)
def test_ring_prefill_matches_a_dense_window_and_triton(dtype, block_size, window, chunks):
    generator = torch.Generator().manual_seed(2)
    spec = RingSpec(window[0], window[1], block_size)
    for cached, new in chunks:
        assert new <= spec.max_chunk(cached), "the engine never computes a chunk past the ring's cap"
    # The pool as a step sees it: the new tokens were stored (through the ring) before attention runs.
    logical_k, logical_v, k_cache, v_cache, tables, rings = _ring_batch(
        [spec] * len(chunks), [c + n for c, n in chunks], block_size=block_size, dtype=dtype, generator=generator
    )
    num_q_heads, scale = NUM_KV_HEADS * GROUP, HEAD_DIM**-0.5
    num_tokens = sum(n for _, n in chunks)
    q = random_tensor(num_tokens, num_q_heads, HEAD_DIM, dtype=dtype, generator=generator)
    q_sink = random_tensor(num_tokens, num_q_heads, HEAD_DIM, dtype=dtype, generator=generator)
    k = torch.cat([logical_k[i][c : c + n] for i, (c, n) in enumerate(chunks)]).to(DEVICE)
    v = torch.cat([logical_v[i][c : c + n] for i, (c, n) in enumerate(chunks)]).to(DEVICE)
    cu = torch.tensor([0, *[n for _, n in chunks]]).cumsum(0).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, k_cache, v_cache, tables, cu, seq_lens, scale)

    expected = reference.paged_prefill_attention(*args, q_sink=q_sink, ring=rings)

    row = 0
    for i, (cached, new) in enumerate(chunks):
        for j in range(new):
            dense = _dense(q[row].cpu(), q_sink[row].cpu(), cached + j, logical_k[i], logical_v[i], spec.num_sinks,
                           spec.window, scale)  # fmt: skip
            torch.testing.assert_close(expected[row].float().cpu(), dense, atol=2e-3, rtol=2e-3)
            row += 1
    out = triton_ops().prefill(*args, q_sink=q_sink, ring=rings)
    assert not out.isnan().any()
    assert_matches(out, expected)


def test_a_full_row_in_a_ring_batch_equals_the_plain_kernel():
    """Triton: a sequence without a window, launched beside a windowed one, gets what it gets without a ring."""
    generator = torch.Generator().manual_seed(3)
    specs = [None, RingSpec(2, 8, 4)]
    _, _, k_cache, v_cache, tables, rings = _ring_batch(specs, [23, 30], block_size=4, dtype=torch.float32,
                                                        generator=generator)  # fmt: skip
    q = random_tensor(2, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=torch.float32, generator=generator)
    seq_lens = torch.tensor([23, 30], dtype=torch.int32, device=DEVICE)
    ops = triton_ops()
    with_ring = ops.decode(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5, q_sink=q.clone(), ring=rings,
                           num_splits=2)  # fmt: skip
    plain = ops.decode(q[:1], k_cache, v_cache, tables[:1], seq_lens[:1], HEAD_DIM**-0.5, num_splits=2)
    # Within 1e-5 (fp32: ~100 ulps), not bit-equal: the ring kernel is another compilation (RING); its full row
    # takes the same tiles in the same order through other code, and a compiler may fuse multiply-adds otherwise. A
    # window or sink applied to the row by mistake changes the output by far more than 1e-5.
    torch.testing.assert_close(with_ring[0], plain[0], rtol=1e-5, atol=1e-6)
